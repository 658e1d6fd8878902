// The sm90 forward's producer: warpgroup 0 gives its registers to the consumers, and lane 0 of
// its first warp issues every TMA load but the pieces of a paged cache's key blocks, which the
// warp's lanes issue one each. An e4m3 cache's pieces land in staging slots (a tile's first ones
// issued by the first warp, the refills by the four warps in turn), from which the whole
// warpgroup widens them into the stages (fwd_cache_staging.h); where a paged cache's pages hold
// neither whole key blocks nor whole pieces (and an e4m3 cache's at d256), the whole warpgroup
// copies K's and V's rows (fwd_paged_rows.h), widening an e4m3 cache's. Per tile: the first K
// block, then Q (with one Q buffer it waits for the last Q·Kᵀ of the tile before), then the
// first V block and the other K/V blocks, last to first, into the two kStages-deep pipelines.
// With pack-GQA a tile's Q rows are no TMA box: the consumers gather them (fwd_packed_q.h), and
// the producer only passes the Q buffer on (a Q stage that brings no bytes).
#pragma once

#include <cute/arch/copy_sm80.hpp>
#include <cutlass/arch/reg_reconfig.h>

#include "fwd_scheduler.h"
#include "fwd_traits.h"
#include "grid_dependency.h"

namespace flashattn::sm90 {

// How the producer fills the K and V stages: by TMA (the first warp), rows gathered by the
// warpgroup (fwd_paged_rows.h), or an e4m3 cache's pieces staged by TMA and widened by the
// warpgroup (fwd_cache_staging.h).
enum class KvLoad { Tma, Gathered, Staged };

template <class Traits, bool kPartials>
struct FwdProducer {
  __device__ static void run(const FwdParams<Traits>& params,
                             typename Traits::SharedStorage& smem) {
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
    // A walk each, each with only its own state in the producer's few registers
    // (FwdTraits::kProducerRegs).
    if constexpr (Traits::kWidensCache) {
      if constexpr (Traits::kStagesCache) {
        if (params.piece_rows > 0) {
          walk<KvLoad::Staged>(params, smem);
          return;
        }
      }
      walk<KvLoad::Gathered>(params, smem);
    } else {
      if constexpr (!Traits::kFp8) {  // FP8 takes no paged cache (flash_api.h)
        if (params.gathers_pages()) {
          walk<KvLoad::Gathered>(params, smem);
          return;
        }
      }
      if (threadIdx.x / 32 == 0) walk<KvLoad::Tma>(params, smem);
    }
  }

  // The tiles' loads. The first warp walks the tiles and waits for the stages; lane 0 arrives
  // on them and issues their TMA loads (the lanes one piece each of a paged block). Gathered and
  // Staged: the other warps walk beside it, and the whole warpgroup writes K's and V's rows;
  // Staged, each warp in turn also refills a staging slot (its lane 0 arrives, its lanes issue
  // the pieces).
  template <KvLoad kLoad>
  __device__ static void walk(const FwdParams<Traits>& params,
                              typename Traits::SharedStorage& smem) {
    constexpr int kBlockN = Traits::kBlockN;
    constexpr int kStages = Traits::kStages;
    constexpr int kQStages = Traits::kQStages;
    constexpr int kConsumerWGs = Traits::kConsumerWGs;
    constexpr bool kGathers = kLoad == KvLoad::Gathered;
    constexpr bool kWarpgroup = kLoad != KvLoad::Tma;  // the whole warpgroup walks
    const int lane = threadIdx.x % 32;
    const bool first_warp = threadIdx.x / 32 == 0;
    const bool leader = (kWarpgroup ? threadIdx.x : lane) == 0;

    const int batch = params.tensor_batch();
    Tensor mQ = params.tma_q.get_tma_tensor(
        make_shape(params.seqlen_q, int(Traits::kHeadDim), params.heads_q, batch));
    Tensor mK = params.tma_k.get_tma_tensor(
        make_shape(params.kv_rows(), int(Traits::kHeadDim), params.heads_kv, params.kv_batch()));
    Tensor mV = [&] {
      if constexpr (Traits::kFp8) {
        return params.tma_v.get_tma_tensor(make_shape(
            int(Traits::kHeadDim), params.num_n_blocks * kBlockN, params.heads_kv, batch));
      } else {
        return params.tma_v.get_tma_tensor(make_shape(params.kv_rows(), int(Traits::kHeadDimV),
                                                      params.heads_kv, params.kv_batch()));
      }
    }();
    auto cta_q = params.tma_q.get_slice(0);
    auto cta_k = params.tma_k.get_slice(0);
    auto cta_v = params.tma_v.get_slice(0);
    Tensor sK = make_tensor(make_smem_ptr(smem.k.begin()), typename Traits::SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(smem.v.begin()), typename Traits::SmemLayoutV{});
    Tensor tKsK = group_modes<0, 3>(cta_k.partition_D(sK));  // (TMA, stage)
    Tensor tVsV = group_modes<0, 3>(cta_v.partition_D(sV));

    PipelineState<kStages> st;
    PipelineState<kQStages> st_q;
    // A gathered e4m3 cache: the stage of the block whose rows are copied but not yet widened
    // (-1: none), and its widening, by each thread of its own chunks, once they have landed.
    constexpr bool kWidensGathered = kGathers && Traits::kWidensCache;
    int widening = -1;
    auto widen = [&](auto dim, auto layout, auto& pipe, auto& buffer) {
      using Gather = PagedRowGather<typename Traits::Element, typename Traits::Cache, kBlockN,
                                    decltype(dim)::value, decltype(layout)>;
      Gather::widen(cast_smem_ptr_to_uint(buffer.begin()), widening, threadIdx.x);
      pipe.producer_commit_written(widening);
    };
    auto widen_k = [&] {
      if constexpr (kWidensGathered)
        widen(Int<Traits::kHeadDim>{}, typename Traits::SmemLayoutK{}, smem.pipe_k, smem.k);
    };
    auto widen_v = [&] {
      if constexpr (kWidensGathered)
        widen(Int<Traits::kHeadDimV>{}, typename Traits::SmemLayoutV{}, smem.pipe_v, smem.v);
    };
    // Staged: the items the CTA has widened in the tiles before (its staging slots' ring turns
    // on across tiles).
    uint32_t staged = 0;
    WorkTile t;
#pragma unroll 1
    for (FwdTileScheduler<Traits, kPartials> tiles{params}; tiles.next(t);) {
      if (t.n_blocks() == 0) continue;  // the consumers zero-fill it alone
      const int head_kv =
          kPartials ? params.kv_head(t.head) : t.head / (params.heads_q / params.heads_kv);
      // The entry's rows start at row q_start / k_start of the tensors (0 in dense calls). Blocks
      // reaching past the entry's end read the next sequence's rows, or zeros past the tensor's
      // end (TMA): keys there are masked, query rows there not stored.
      auto entry_rows = [&](auto m, int start) {
        return domain_offset(make_coord(start, _0{}), m);
      };
      Tensor tKgK = group_modes<0, 3>(cta_k.partition_S(
          local_tile(entry_rows(mK(_, _, head_kv, t.seq.batch), t.seq.k_start),
                     typename Traits::TileKV{}, make_coord(_, _0{}))));
      Tensor tVgV = [&] {
        if constexpr (Traits::kFp8) {
          // (head_dim, keys): key blocks along mode 1; packed, the entry's from its packed_block
          // on (sequences.h).
          const int first_key = params.seqs.packed()
                                    ? int(packed_block(t.seq.k_start, t.seq.index, kBlockN)) * kBlockN
                                    : 0;
          return group_modes<0, 3>(cta_v.partition_S(
              local_tile(domain_offset(make_coord(_0{}, first_key), mV(_, _, head_kv, t.seq.batch)),
                         typename Traits::TileV{}, make_coord(_0{}, _))));
        } else {
          return group_modes<0, 3>(cta_v.partition_S(
              local_tile(entry_rows(mV(_, _, head_kv, t.seq.batch), t.seq.k_start),
                         typename Traits::TileV{}, make_coord(_, _0{}))));
        }
      }();
      // A paged cache's block n: block `in_page` of its page, as a whole tile of that page's rows.
      auto page_tile = [&](auto& tma, auto m, auto tile, int page, int in_page) {
        return group_modes<0, 3>(tma.get_slice(0).partition_S(
            local_tile(m(_, _, head_kv, page), tile, make_coord(_, _0{}))))(_, in_page);
      };
      // Pages of no whole block but whole pieces: the pieces of kRows rows from key first_key
      // on (a block, or a staged half block), each from its page into its rows of the stage (or
      // staging slot), lane i issuing piece i (one thread issuing them all would wait a load's
      // latency for each piece's page). TMA walk: K's load looks the lane's page up before it
      // waits for the stage; V's load of the same block, which always follows it, takes it again.
      int piece_page = 0;
      auto look_up_piece = [&](int first_key) {
        if (lane < Traits::kPiecesSpan / params.piece_rows)
          piece_page =
              params.page(t.seq.index, (first_key + lane * params.piece_rows) / params.page_size);
      };
      // dst_of(cta, lane): where the TMA slice `cta` puts lane's piece.
      auto load_pieces = [&](auto rows, auto& tma_piece, auto dim, int first_key,
                             uint64_t& barrier, auto dst_of) {
        constexpr int kRows = decltype(rows)::value;
        constexpr int kDim = decltype(dim)::value;
        if (lane >= Traits::kPiecesSpan / kRows) return;
        const int key = first_key + lane * kRows;
        auto cta = tma_piece.get_slice(0);
        Tensor m = tma_piece.get_tma_tensor(
            make_shape(params.page_size, kDim, params.heads_kv, params.num_pages));
        Tensor src = cta.partition_S(local_tile(m(_, _, head_kv, piece_page),
                                                Shape<Int<kRows>, Int<kDim>>{},
                                                make_coord(_, _0{})));  // (TMA, 1, 1, piece)
        copy(tma_piece.with(barrier), src(_, _0{}, _0{}, (key % params.page_size) / kRows),
             dst_of(cta, lane));
      };
      // Pieces from key first_key on: wide ones where the launcher built them.
      auto load_in_pieces = [&](auto& piece, auto& wide_piece, auto dim, int first_key,
                                uint64_t& barrier, auto dst_of) {
        if constexpr (Traits::kTakesWidePieces) {
          if (params.piece_rows == kWidePieceRows) {
            load_pieces(Int<kWidePieceRows>{}, wide_piece, dim, first_key, barrier, dst_of);
            return;
          }
        }
        load_pieces(Int<kPieceRows>{}, piece, dim, first_key, barrier, dst_of);
      };
      // A stage's rows of each piece: (TMA, piece, 1, stage).
      auto in_stage = [&](auto smem_tensor, int stage) {
        return [=](auto& cta, int piece) {
          return cta.partition_D(smem_tensor)(_, piece, _0{}, stage);
        };
      };
      // Block n of K or V (its `rows`) into the stage by the whole warpgroup, row by row. K's
      // load looks up the block's pages (before it waits for the stage), and V's load of the
      // same block, which always follows it, takes them again.
      auto page_at = [&](int column) {
        return params.page(t.seq.index, column);
      };
      BlockPages pages{};
      auto gather_block = [&](auto dim, auto layout, auto& pipe, const PagedRows& rows,
                              auto& buffer, int n, bool look_up, auto widen_before) {
        if (look_up) {
          pages.first_column = n * kBlockN / params.page_size;
          pages.lane_page = page_at(pages.first_column + threadIdx.x % 32);
        }
        pipe.producer_wait(st);
        PagedRowGather<typename Traits::Element, typename Traits::Cache, kBlockN,
                       decltype(dim)::value, decltype(layout)>::load(
            cast_smem_ptr_to_uint(buffer.begin()), st.index, rows, head_kv, n * kBlockN,
            params.page_size, pages, page_at, threadIdx.x);
        if constexpr (Traits::kWidensCache) {
          // The block before is widened once this block's copies are under way: its copies are
          // the groups before the last two (each block's K, then V). Its K stage must be full
          // before this block's V stage is free: the consumers release the V stage of two blocks
          // back only after the Q·Kᵀ of the block before.
          cp_async_fence();
          if (widening >= 0) {
            cp_async_wait<2>();
            widen_before();
          }
        } else {
          pipe.producer_commit_copies(st);
        }
      };
      // Staged (an e4m3 cache whose pages hold whole pieces): the tile's items j = 0, 1, ... in
      // the order they are widened: block n_max − 1 − j / 4's K (j / 2 even) or V, its half j % 2.
      // Item j fills slot (staged + j) % kSlots, issued once every warp has widened the slot's
      // item before: the tile's first kSlots items by the first warp, item j + kSlots by warp
      // j % kWarps after it has widened item j + 1 (by then the other warps are done with item
      // j, so it seldom waits for them), so that the warps take turns at the lookups and copies
      // and widen at their own pace in between.
      using StagingK = typename Traits::StagingK;
      constexpr int kSlots = StagingK::kSlots;
      const int items = 4 * t.n_blocks();
      auto slot_of = [&](int j) { return int((staged + uint32_t(j)) % kSlots); };
      auto item_key = [&](int j) {  // its first key
        return (t.n_max - 1 - j / 4) * kBlockN + j % 2 * StagingK::kItemRows;
      };
      // Item j's pieces, whose pages look_up_piece(item_key(j)) has looked up.
      auto issue_item = [&](int j) {
        if constexpr (kLoad == KvLoad::Staged) {
          const int first_key = item_key(j);
          const int slot = slot_of(j);
          const uint32_t item = staged + uint32_t(j);  // the CTA's count
          if (item >= uint32_t(kSlots))  // the slot's item before, read by every warp
            cutlass::arch::ClusterBarrier::wait(&smem.staging.read[slot],
                                                (item / kSlots - 1) % 2);
          uint64_t& full = smem.staging.full[slot];
          if (lane == 0)
            cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&full,
                                                                           StagingK::kItemBytes);
          __syncwarp();
          Tensor rows = make_tensor(
              make_smem_ptr(reinterpret_cast<typename Traits::Cache*>(
                  smem.staging.rows + slot * StagingK::kItemBytes)),
              typename StagingK::SlotLayout{});
          auto in_slot = [&](auto& cta, int piece) {
            return cta.partition_D(rows)(_, piece, _0{});  // (TMA, piece, 1)
          };
          if (j / 2 % 2 == 0) {
            load_in_pieces(params.tma_piece_k, params.tma_wide_piece_k, Int<Traits::kHeadDim>{},
                           first_key, full, in_slot);
          } else {
            load_in_pieces(params.tma_piece_v, params.tma_wide_piece_v,
                           Int<Traits::kHeadDimV>{}, first_key, full, in_slot);
          }
        }
      };
      // Item j widened into its half of the stage, which the first half waits for and the second
      // fills; then item j − 1's slot takes item j − 1 + kSlots, whose pages its refilling warp
      // looked up before it widened item j − 1 (their loads' latency under the widening).
      auto refills = [&](int j) {
        return j >= 0 && threadIdx.x / 32 == j % StagingK::kWarps && j + kSlots < items;
      };
      auto widen_item = [&](int j, auto staging, auto& pipe, auto& buffer) {
        if constexpr (kLoad == KvLoad::Staged) {
          using Staging = decltype(staging);
          if (refills(j)) look_up_piece(item_key(j + kSlots));
          const int slot = slot_of(j);
          cutlass::arch::ClusterTransactionBarrier::wait(&smem.staging.full[slot],
                                                         (staged + uint32_t(j)) / kSlots % 2);
          if (j % 2 == 0) pipe.producer_wait(st);
          Staging::widen(cast_smem_ptr_to_uint(smem.staging.rows) + slot * StagingK::kItemBytes,
                         cast_smem_ptr_to_uint(buffer.begin()), st.index,
                         j % 2 * Staging::kItemRows, threadIdx.x);
          if (j % 2 == 1) pipe.producer_commit_written(st.index);
          smem.staging.mark_read(slot);
          if (refills(j - 1)) issue_item(j - 1 + kSlots);
        }
      };
      if constexpr (kLoad == KvLoad::Staged) {
        if (first_warp) {
#pragma unroll 1
          for (int j = 0; j < kSlots && j < items; ++j) {
            look_up_piece(item_key(j));
            issue_item(j);
          }
        }
      }
      // K's (kv = _0) or V's (_1) block n: by TMA from the tensor, a page of whole blocks or the
      // block's pieces, staged, or gathered. K's load looks up the block's pages, and V's load of
      // the same block, which always follows it, takes them again.
      auto pick = [](auto kv, auto& k, auto& v) -> auto& {
        if constexpr (decltype(kv)::value == 0) {
          return k;
        } else {
          return v;
        }
      };
      auto load_block = [&](auto kv, int n) {
        constexpr bool kIsK = decltype(kv)::value == 0;
        constexpr int kDim = kIsK ? Traits::kHeadDim : Traits::kHeadDimV;
        auto& pipe = pick(kv, smem.pipe_k, smem.pipe_v);
        auto& stages = pick(kv, smem.k, smem.v);
        if constexpr (kLoad == KvLoad::Staged) {
          using Staging = conditional_t<kIsK, typename Traits::StagingK, typename Traits::StagingV>;
          const int j = 4 * (t.n_max - 1 - n) + (kIsK ? 0 : 2);
          widen_item(j, Staging{}, pipe, stages);
          widen_item(j + 1, Staging{}, pipe, stages);
        } else if constexpr (kGathers) {
          using Layout =
              conditional_t<kIsK, typename Traits::SmemLayoutK, typename Traits::SmemLayoutV>;
          gather_block(Int<kDim>{}, Layout{}, pipe, pick(kv, params.k_pages, params.v_pages),
                       stages, n, kIsK, pick(kv, widen_k, widen_v));
        } else {
          if constexpr (kIsK && Traits::kTakesPieces) {
            if (params.piece_rows > 0) look_up_piece(n * kBlockN);
          }
          pipe.producer_acquire_by_warp(st, kIsK ? Traits::kBytesK : Traits::kBytesV);
          auto& tma_block = pick(kv, params.tma_k, params.tma_v);
          auto tma = tma_block.with(pipe.full_barrier(st));
          auto& smem_blocks = pick(kv, tKsK, tVsV);  // (TMA, stage)
          if constexpr (!Traits::kFp8) {
            if (params.paged()) {
              if constexpr (Traits::kTakesPieces) {
                if (params.piece_rows > 0) {
                  load_in_pieces(pick(kv, params.tma_piece_k, params.tma_piece_v),
                                 pick(kv, params.tma_wide_piece_k, params.tma_wide_piece_v),
                                 Int<kDim>{}, n * kBlockN, pipe.full_barrier(st),
                                 in_stage(pick(kv, sK, sV), st.index));
                  return;
                }
              }
              using Tile = conditional_t<kIsK, typename Traits::TileKV, typename Traits::TileV>;
              int in_page;
              const int page = params.page_of(t.seq.index, n, in_page);
              if (leader)
                copy(tma, page_tile(tma_block, pick(kv, mK, mV), Tile{}, page, in_page),
                     smem_blocks(_, st.index));
              return;
            }
          }
          if (leader) copy(tma, pick(kv, tKgK, tVgV)(_, n), smem_blocks(_, st.index));
        }
      };
      auto load_k = [&](int n) { load_block(_0{}, n); };
      auto load_v = [&](int n) { load_block(_1{}, n); };
      // The first K block first: with one Q buffer, Q waits for the last Q·Kᵀ of the tile before.
      load_k(t.n_max - 1);
      const bool gathered_q = kPartials && !Traits::kFp8 && params.group > 1;
      if (!kWarpgroup || first_warp)
        smem.pipe_q.producer_acquire_by_warp(st_q, gathered_q ? 0 : Traits::kBytesQ * kConsumerWGs);
#pragma unroll
      for (int wg = 0; wg < kConsumerWGs && !gathered_q && leader; ++wg) {
        Tensor gQ = local_tile(entry_rows(mQ(_, _, t.head, t.seq.batch), t.seq.q_start),
                               typename Traits::TileQ{},
                               make_coord(t.m_block * kConsumerWGs + wg, _0{}));
        Tensor sQ = make_tensor(make_smem_ptr(smem.q[wg].begin()), typename Traits::SmemLayoutQ{});
        copy(params.tma_q.with(smem.pipe_q.full_barrier(st_q)), cta_q.partition_S(gQ),
             cta_q.partition_D(sQ(_, _, st_q.index)));
      }
      st_q.advance();
      load_v(t.n_max - 1);
      if constexpr (kWidensGathered) widening = st.index;
      st.advance();
      // Not unrolled: the producer lives in few registers.
#pragma unroll 1
      for (int n = t.n_max - 2; n >= t.n_min; --n) {
        load_k(n);
        load_v(n);
        if constexpr (kWidensGathered) widening = st.index;
        st.advance();
      }
      staged += uint32_t(items);
    }
    if constexpr (kWidensGathered) {
      if (widening >= 0) {  // the last block's rows
        cp_async_wait<0>();
        widen_k();
        widen_v();
      }
    }
    // A partial-results launch may start beside the grid before it (the tail's whole waves),
    // reading nothing that grid writes; waiting keeps it from completing before that grid, as
    // the launches after it (the merge) assume.
    if constexpr (kPartials) wait_for_prior_grids();
    // The consumers wait for every stage filled, so no copy outlives the CTA; the thread still
    // leaves none of its own in flight.
    if constexpr (kGathers) cp_async_wait<0>();
  }
};

}  // namespace flashattn::sm90
