// The sm90 forward's producer: warpgroup 0 gives its registers to the consumers, and lane 0 of
// its first warp issues every TMA load but the pieces of a paged cache's key blocks, which the
// warp's lanes issue one each; where a paged cache's pages hold neither whole key blocks nor whole
// pieces, and for an e4m3 cache, the whole warpgroup copies K's and V's rows (fwd_paged_rows.h),
// widening an e4m3 cache's. Per tile: the first K block, then
// Q (with one Q buffer it waits for the last Q·Kᵀ of the tile before), then the first V block
// and the other K/V blocks, last to first, into the two kStages-deep pipelines. With pack-GQA a
// tile's Q rows are no TMA box: the consumers gather them (fwd_packed_q.h), and the producer
// only passes the Q buffer on (a Q stage that brings no bytes).
#pragma once

#include <cute/arch/copy_sm80.hpp>
#include <cutlass/arch/reg_reconfig.h>

#include "fwd_scheduler.h"
#include "fwd_traits.h"
#include "grid_dependency.h"

namespace flashattn::sm90 {

template <class Traits, bool kPartials>
struct FwdProducer {
  __device__ static void run(const FwdParams<Traits>& params,
                             typename Traits::SharedStorage& smem) {
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
    // Two walks, each with only its own state in the producer's 24 registers.
    if constexpr (Traits::kWidensCache) {
      walk<true>(params, smem);
    } else {
      if constexpr (!Traits::kFp8) {  // FP8 takes no paged cache (flash_api.h)
        if (params.gathers_pages()) {
          walk<true>(params, smem);
          return;
        }
      }
      if (threadIdx.x / 32 == 0) walk<false>(params, smem);
    }
  }

  // The tiles' loads. The first warp walks the tiles and waits for the stages; lane 0 arrives
  // on them and issues their TMA loads. kGathers: the other warps walk beside it, and the whole
  // warpgroup copies K's and V's rows.
  template <bool kGathers>
  __device__ static void walk(const FwdParams<Traits>& params,
                              typename Traits::SharedStorage& smem) {
    constexpr int kBlockN = Traits::kBlockN;
    constexpr int kStages = Traits::kStages;
    constexpr int kQStages = Traits::kQStages;
    constexpr int kConsumerWGs = Traits::kConsumerWGs;
    const bool leader = (kGathers ? threadIdx.x : threadIdx.x % 32) == 0;

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
    // An e4m3 cache: the stage of the block whose rows are copied but not yet widened (-1: none),
    // and its widening, by each thread of its own chunks, once they have landed.
    int widening = -1;
    auto widen = [&](auto dim, auto layout, auto& pipe, auto& buffer) {
      using Gather = PagedRowGather<typename Traits::Element, typename Traits::Cache, kBlockN,
                                    decltype(dim)::value, decltype(layout)>;
      Gather::widen(cast_smem_ptr_to_uint(buffer.begin()), widening, threadIdx.x);
      pipe.producer_commit_written(widening);
    };
    auto widen_k = [&] {
      if constexpr (Traits::kWidensCache)
        widen(Int<Traits::kHeadDim>{}, typename Traits::SmemLayoutK{}, smem.pipe_k, smem.k);
    };
    auto widen_v = [&] {
      if constexpr (Traits::kWidensCache)
        widen(Int<Traits::kHeadDimV>{}, typename Traits::SmemLayoutV{}, smem.pipe_v, smem.v);
    };
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
      // Pages of no whole block but whole pieces: block n's pieces of kRows rows, each from its
      // page into its rows of the stage, lane i issuing piece i (one thread issuing them all
      // would wait a load's latency for each piece's page). K's load looks the lane's page up
      // before it waits for the stage; V's load of the same block, which always follows it,
      // takes it again.
      int piece_page = 0;
      auto look_up_piece = [&](int n) {
        const int lane = threadIdx.x % 32;
        if (lane < kBlockN / params.piece_rows)
          piece_page = params.page(t.seq.index,
                                   (n * kBlockN + lane * params.piece_rows) / params.page_size);
      };
      auto load_pieces = [&](auto rows, auto& tma_piece, auto dim, auto smem_tensor, int n,
                             uint64_t& barrier, int stage) {
        constexpr int kRows = decltype(rows)::value;
        constexpr int kDim = decltype(dim)::value;
        const int lane = threadIdx.x % 32;
        if (lane >= kBlockN / kRows) return;
        const int first_key = n * kBlockN + lane * kRows;
        auto cta = tma_piece.get_slice(0);
        Tensor m = tma_piece.get_tma_tensor(
            make_shape(params.page_size, kDim, params.heads_kv, params.num_pages));
        Tensor src = cta.partition_S(local_tile(m(_, _, head_kv, piece_page),
                                                Shape<Int<kRows>, Int<kDim>>{},
                                                make_coord(_, _0{})));  // (TMA, 1, 1, piece)
        Tensor dst = cta.partition_D(smem_tensor);                      // (TMA, piece, 1, stage)
        copy(tma_piece.with(barrier), src(_, _0{}, _0{}, (first_key % params.page_size) / kRows),
             dst(_, lane, _0{}, stage));
      };
      // K's or V's block n in pieces: wide ones where the launcher built them.
      auto load_in_pieces = [&](auto& piece, auto& wide_piece, auto dim, auto smem_tensor, int n,
                                uint64_t& barrier, int stage) {
        if constexpr (Traits::kTakesWidePieces) {
          if (params.piece_rows == kWidePieceRows) {
            load_pieces(Int<kWidePieceRows>{}, wide_piece, dim, smem_tensor, n, barrier, stage);
            return;
          }
        }
        load_pieces(Int<kPieceRows>{}, piece, dim, smem_tensor, n, barrier, stage);
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
      // K's (or V's) block n: by TMA from the tensor, a page of whole blocks or the block's
      // pieces, or gathered.
      auto load_k = [&](int n) {
        if constexpr (kGathers) {
          gather_block(Int<Traits::kHeadDim>{}, typename Traits::SmemLayoutK{}, smem.pipe_k,
                       params.k_pages, smem.k, n, true, widen_k);
        } else {
          if constexpr (Traits::kTakesPieces) {
            if (params.piece_rows > 0) look_up_piece(n);
          }
          smem.pipe_k.producer_acquire_by_warp(st, Traits::kBytesK);
          auto tma = params.tma_k.with(smem.pipe_k.full_barrier(st));
          if constexpr (!Traits::kFp8) {
            if (params.paged()) {
              if constexpr (Traits::kTakesPieces) {
                if (params.piece_rows > 0) {
                  load_in_pieces(params.tma_piece_k, params.tma_wide_piece_k,
                                 Int<Traits::kHeadDim>{}, sK, n, smem.pipe_k.full_barrier(st),
                                 st.index);
                  return;
                }
              }
              int in_page;
              const int page = params.page_of(t.seq.index, n, in_page);
              if (leader)
                copy(tma, page_tile(params.tma_k, mK, typename Traits::TileKV{}, page, in_page),
                     tKsK(_, st.index));
              return;
            }
          }
          if (leader) copy(tma, tKgK(_, n), tKsK(_, st.index));
        }
      };
      auto load_v = [&](int n) {
        if constexpr (kGathers) {
          gather_block(Int<Traits::kHeadDimV>{}, typename Traits::SmemLayoutV{}, smem.pipe_v,
                       params.v_pages, smem.v, n, false, widen_v);
        } else {
          smem.pipe_v.producer_acquire_by_warp(st, Traits::kBytesV);
          auto tma = params.tma_v.with(smem.pipe_v.full_barrier(st));
          if constexpr (!Traits::kFp8) {
            if (params.paged()) {
              if constexpr (Traits::kTakesPieces) {
                if (params.piece_rows > 0) {
                  load_in_pieces(params.tma_piece_v, params.tma_wide_piece_v,
                                 Int<Traits::kHeadDimV>{}, sV, n, smem.pipe_v.full_barrier(st),
                                 st.index);
                  return;
                }
              }
              int in_page;
              const int page = params.page_of(t.seq.index, n, in_page);
              if (leader)
                copy(tma, page_tile(params.tma_v, mV, typename Traits::TileV{}, page, in_page),
                     tVsV(_, st.index));
              return;
            }
          }
          if (leader) copy(tma, tVgV(_, n), tVsV(_, st.index));
        }
      };
      // The first K block first: with one Q buffer, Q waits for the last Q·Kᵀ of the tile before.
      load_k(t.n_max - 1);
      const bool gathered_q = kPartials && !Traits::kFp8 && params.group > 1;
      if (!kGathers || threadIdx.x / 32 == 0)
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
      if constexpr (Traits::kWidensCache) widening = st.index;
      st.advance();
      // Not unrolled: the producer lives in 24 registers.
#pragma unroll 1
      for (int n = t.n_max - 2; n >= t.n_min; --n) {
        load_k(n);
        load_v(n);
        if constexpr (Traits::kWidensCache) widening = st.index;
        st.advance();
      }
    }
    if constexpr (Traits::kWidensCache) {
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
