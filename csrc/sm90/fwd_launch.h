// Host side of the sm90 forward: TMA descriptors from the C ABI params, then the launch.
// Included by one small .cu per (head dim, dtype) instantiation.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

#include "../common/fwd_sinks.h"
#include "../common/launch.h"
#include "../common/sequences.h"
#include "../common/status.h"
#include "../common/workspace_pool.h"
#include "../flash_api.h"
#include "fwd_tile.h"
#include "fwd_kernel.h"
#include "fwd_merge.h"
#include "tma_tensor.h"

namespace flashattn::sm90 {


// A launch that may start before the kernel ahead of it in the stream ends (grid_dependency.h).
template <class... Params>
cudaError_t launch_dependent(void (*kernel)(Params...), int grid, int threads, int smem_bytes,
                             cudaStream_t stream, Params... params) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = 1;
  const cudaError_t e = cudaLaunchKernelEx(&config, kernel, params...);
  if (e != cudaSuccess) (void)cudaGetLastError();  // returned here, not left for the next check
  return e;
}

// A stream-ordered workspace given back after the launches that use it: their result, else the
// free's (whose error is then taken off the thread, so that the next call does not report it).
inline flashattn_result_t freed_after(flashattn_result_t launched, void* workspace,
                                      cudaStream_t stream) {
  const cudaError_t freed = cudaFreeAsync(workspace, stream);
  if (freed != cudaSuccess) (void)cudaGetLastError();
  return launched.status == FLASHATTN_OK ? cuda_status(freed) : launched;
}

// The forward with its tail split (fwd_tail.h): the whole waves, the pieces, their merge; then
// the pieces' workspace (tail.partials, taken by the caller in stream order) is given back.
template <class Traits>
flashattn_result_t run_fwd_split_tail(const flashattn_params_t& p, FwdParams<Traits> params,
                                      const FwdTail& tail, cudaStream_t stream) {
  const int smem_bytes = sizeof(typename Traits::SharedStorage);
  params.tail = tail;
  flashattn_result_t launched = ok();
  if (tail.first_tile > 0) {  // whole waves, tiles_per_unit 1
    params.num_tiles = tail.first_tile;
    fwd_kernel<Traits><<<p.sm_count, Traits::kThreads, smem_bytes, stream>>>(params);
    launched = check_launch();
  }
  constexpr auto pieces = &fwd_kernel<Traits, true>;
  if (launched.status == FLASHATTN_OK)
    launched = cuda_status(allow_dynamic_smem<pieces>(smem_bytes));
  if (launched.status == FLASHATTN_OK) {
    if (tail.first_tile > 0) {  // beside the whole waves' last CTAs: it reads nothing they write
      launched = cuda_status(
          launch_dependent(pieces, tail.ctas, Traits::kThreads, smem_bytes, stream, params));
    } else {  // plainly after whatever came before (its Q, K and V, maybe)
      pieces<<<tail.ctas, Traits::kThreads, smem_bytes, stream>>>(params);
      launched = check_launch();
    }
  }
  if (launched.status == FLASHATTN_OK) {
    auto merge = [&](auto* o) {
      using Out = remove_pointer_t<decltype(o)>;
      const TailMergeParams<Out> m{tail,           o,     p.o.batch_stride, p.o.row_stride,
                                   p.o.head_stride, p.lse, p.heads_q,        p.seqlen_q,
                                   params.num_m_blocks};
      const int64_t threads = int64_t(tail.tiles) * kTailRows * (Traits::kHeadDimV / 4);
      const int grid = int((threads + kMergeThreads - 1) / kMergeThreads);
      return cuda_status(launch_dependent(fwd_tail_merge<Traits::kHeadDimV, Out>, grid,
                                          kMergeThreads, 0, stream, m));
    };
    if constexpr (Traits::kFp8) {
      launched = params.o_bf16 ? merge(static_cast<cutlass::bfloat16_t*>(p.o.ptr))
                               : merge(static_cast<cutlass::half_t*>(p.o.ptr));
    } else {
      launched = merge(static_cast<typename Traits::Element*>(p.o.ptr));
    }
  }
  return freed_after(launched, tail.partials, stream);
}

// The forward's kernels: the schedule, the tiles (whole, or the last wave split by key blocks and
// merged).
template <class Traits>
flashattn_result_t run_fwd_kernels(const flashattn_params_t& p, bool pingpong,
                                   cudaStream_t stream) {
  using Element = typename Traits::Element;
  FwdParams<Traits> params;
  params.batch = p.batch;
  params.seqlen_q = p.seqlen_q;
  params.seqlen_k = p.seqlen_k;
  params.seqs = sequences(p);
  // Packed: Q, K and V over all sequences' rows, one batch entry (its stride ignored).
  const int batch = params.tensor_batch();
  auto q = gmem_tensor<Traits>(static_cast<Element const*>(p.q.ptr), p.q, p.seqlen_q, p.heads_q,
                               batch);
  // A paged cache's pages (flash_api.h): whole key blocks or whole pieces loaded by TMA, or pages
  // of any size whose rows the producer gathers.
  params.page_table = p.page_table;
  params.page_table_stride = p.page_table_batch_stride;
  params.num_pages = p.num_pages;
  params.page_size = p.page_size;
  // An e4m3 cache's pages, of any size, are always staged or gathered (and widened).
  params.page_blocks = p.page_size % Traits::kBlockN == 0 && !Traits::kWidensCache
                           ? p.page_size / Traits::kBlockN
                           : 0;
  if (params.paged() && Traits::kFp8) return status(FLASHATTN_UNSUPPORTED);
  if (Traits::kWidensCache && !params.paged()) return status(FLASHATTN_INVALID_ARGUMENT);
  params.page_columns = params.paged() ? p.seqlen_k / p.page_size : 0;
  auto paged_rows = [](const flashattn_tensor_t& t) {
    constexpr int64_t e = sizeof(typename Traits::Cache);
    return PagedRows{static_cast<const char*>(t.ptr), t.batch_stride * e, t.row_stride * e,
                     t.head_stride * e};
  };
  params.k_pages = paged_rows(p.k);
  params.v_pages = paged_rows(p.v);
  // An e4m3 cache is never loaded by these (its pieces are, below): its K and V descriptors
  // describe Q instead, unused.
  const flashattn_tensor_t& k_tma = Traits::kWidensCache ? p.q : p.k;
  const flashattn_tensor_t& v_tma = Traits::kWidensCache ? p.q : p.v;
  const int kv_tma_rows = Traits::kWidensCache ? p.seqlen_q : params.kv_rows();
  const int kv_tma_heads = Traits::kWidensCache ? p.heads_q : p.heads_kv;
  const int kv_tma_batch = Traits::kWidensCache ? batch : params.kv_batch();
  auto k = gmem_tensor<Traits>(static_cast<Element const*>(k_tma.ptr), k_tma, kv_tma_rows,
                               kv_tma_heads, kv_tma_batch);
  // FP8: V key-major, (head_dim, keys padded to whole key blocks), as the quantize step wrote it;
  // packed, every sequence's keys from its packed_block on (sequences.h).
  const int num_n_blocks =
      params.seqs.packed() && Traits::kFp8
          ? int(packed_blocks(p.seqlen_k, p.batch, Traits::kBlockN))
          : (p.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN;
  auto v = [&] {
    if constexpr (Traits::kFp8) {
      constexpr int d = Traits::kHeadDim;
      return make_tensor(make_gmem_ptr(static_cast<Element const*>(p.v.ptr)),
                         make_shape(d, num_n_blocks * Traits::kBlockN, p.heads_kv, batch),
                         make_stride(int64_t(p.v.row_stride), _1{},
                                     tma_stride(p.v.head_stride, p.heads_kv, d),
                                     tma_stride(p.v.batch_stride, batch, d)));
    } else {
      return gmem_tensor<Traits, Traits::kHeadDimV>(static_cast<Element const*>(v_tma.ptr), v_tma,
                                                    kv_tma_rows, kv_tma_heads, kv_tma_batch);
    }
  }();
  params.tma_q = make_tma_copy(SM90_TMA_LOAD{}, q, take<0, 2>(typename Traits::SmemLayoutQ{}),
                               typename Traits::TileQ{}, _1{});
  params.tma_k = make_tma_copy(SM90_TMA_LOAD{}, k, take<0, 2>(typename Traits::SmemLayoutK{}),
                               typename Traits::TileKV{}, _1{});
  params.tma_v = make_tma_copy(SM90_TMA_LOAD{}, v, take<0, 2>(typename Traits::SmemLayoutV{}),
                               typename Traits::TileV{}, _1{});
  params.piece_rows = 0;
  if constexpr (Traits::kTakesPieces) {
    if (params.paged() && params.page_blocks == 0 && p.page_size % kPieceRows == 0) {
      // The cache's own pages (an e4m3 cache's too, where K's and V's TMA above describe Q).
      using Piece = typename Traits::PieceElement;
      auto k_pages = gmem_tensor<Traits>(static_cast<Piece const*>(p.k.ptr), p.k, p.page_size,
                                         p.heads_kv, p.num_pages);
      auto v_pages = gmem_tensor<Traits, Traits::kHeadDimV>(static_cast<Piece const*>(p.v.ptr),
                                                            p.v, p.page_size, p.heads_kv,
                                                            p.num_pages);
      auto piece_tmas = [&](auto rows, auto& tma_k, auto& tma_v) {
        constexpr int kRows = decltype(rows)::value;
        tma_k = make_tma_copy(
            SM90_TMA_LOAD{}, k_pages,
            typename Traits::template PieceSmemLayout<kRows, Traits::kHeadDim>{},
            typename Traits::template TilePieceK<kRows>{}, _1{});
        tma_v = make_tma_copy(
            SM90_TMA_LOAD{}, v_pages,
            typename Traits::template PieceSmemLayout<kRows, Traits::kHeadDimV>{},
            typename Traits::template TilePieceV<kRows>{}, _1{});
        params.piece_rows = kRows;
      };
      // The wide pieces where they divide both the pages and what the pieces fill.
      if constexpr (Traits::kTakesWidePieces) {
        if (p.page_size % kWidePieceRows == 0)
          piece_tmas(Int<kWidePieceRows>{}, params.tma_wide_piece_k, params.tma_wide_piece_v);
      }
      if (params.piece_rows == 0)
        piece_tmas(Int<kPieceRows>{}, params.tma_piece_k, params.tma_piece_v);
    }
  }
  params.o = p.o.ptr;
  params.o_batch_stride = p.o.batch_stride;
  params.o_row_stride = p.o.row_stride;
  params.o_head_stride = p.o.head_stride;
  params.lse = p.lse;
  params.heads_q = p.heads_q;
  params.heads_kv = p.heads_kv;
  params.keys = key_range(p);
  // Pack-GQA and key splits run on the 16-bit partial-results kernel (fwd_kernel<_, true>).
  constexpr bool kPackable = Traits::kTailSplit && !Traits::kFp8;
  if (!kPackable && (p.pack_gqa || p.num_splits > 1)) return status(FLASHATTN_UNSUPPORTED);
  params.group = p.pack_gqa ? p.heads_q / p.heads_kv : 1;
  params.q = p.q.ptr;
  params.q_batch_stride = p.q.batch_stride;
  params.q_row_stride = p.q.row_stride;
  params.q_head_stride = p.q.head_stride;
  params.num_splits = 1;
  // Tile rows (query rows, or pack-GQA's pairs: flash_api.cu bounds them to FLASHATTN_MAX_SEQLEN).
  const int tile_rows_max = params.seqs.max_q * params.group;
  params.num_m_blocks = (tile_rows_max + Traits::kBlockM - 1) / Traits::kBlockM;
  // Every entry padded to the longest one's blocks (dense calls, and packed ones without the
  // schedule's workspace); packed, each head's query slots (decode_tile): at most one per 128
  // tile rows and entry, and at most the padded count, as Sequences::at caps every length.
  const int64_t padded_tiles = int64_t(params.num_m_blocks) * params.tile_heads() * p.batch;
  const int64_t slots = std::min(packed_blocks(p.seqlen_q * params.group, p.batch, Traits::kBlockM),
                                 int64_t(params.num_m_blocks) * p.batch);
  if (padded_tiles > INT32_MAX) return status(FLASHATTN_UNSUPPORTED);
  params.num_tiles = int(params.seqs.packed() ? slots * params.tile_heads() : padded_tiles);
  params.slot_entries = nullptr;
  const float log2e = float(M_LOG2E);
  params.softcap = p.softcap > 0.f;
  params.softcap_pre = params.softcap ? p.softmax_scale / p.softcap : 0.f;
  params.scale_log2 = params.softcap ? p.softcap * log2e : p.softmax_scale * log2e;
  params.pingpong = pingpong;
  params.q_descale = p.q_descale;
  params.k_descale = p.k_descale;
  params.v_descale = p.v_descale;
  params.num_n_blocks = num_n_blocks;
  params.num_q_blocks = params.seqs.packed() && Traits::kFp8
                            ? int(packed_blocks(p.seqlen_q, p.batch, Traits::kBlockM))
                            : params.num_m_blocks;
  params.o_bf16 = p.out_dtype == FLASHATTN_BF16;

  // An e4m3 cache's kernel is the partial-results one alone (whole tiles too, as it runs them
  // where there are no pieces, splits or packed heads), which halves its instantiations.
  constexpr bool kPartialsOnly = Traits::kWidensCache;
  constexpr auto kernel = &fwd_kernel<Traits, kPartialsOnly>;
  const int smem_bytes = sizeof(typename Traits::SharedStorage);
  FLASHATTN_TRY_CUDA(allow_dynamic_smem<kernel>(smem_bytes));
  // Persistent: one CTA per SM (shared memory allows no more) walking its share of the work
  // units (see decode_tile); on request, with a right bound on the keys, one CTA per unit.
  const bool uniform = params.keys.window_right < 0;
  const bool packed = params.seqs.packed();
  // No pairs with one query block.
  params.tiles_per_unit = uniform || params.num_m_blocks == 1 ? 1 : 2;
  const bool persistent = uniform || (p.sm90_flags & FLASHATTN_SM90_PERSISTENT_CAUSAL);
  auto ctas_for = [&](int tiles) {
    const int units = (tiles + params.tiles_per_unit - 1) / params.tiles_per_unit;
    return persistent && p.sm_count > 0 && p.sm_count < units ? p.sm_count : units;
  };
  // Tiles that all visit the same key blocks: no window at all, or one query block per head
  // (decoding, short chunks) under any mask; never a packed batch's (their lengths differ).
  const bool equal_tiles =
      !packed && ((uniform && params.keys.window_left < 0) || params.num_m_blocks == 1);
  if constexpr (Traits::kTailSplit && !kPartialsOnly) {
    const bool tail_may_split = equal_tiles && params.group == 1 && p.num_splits == 0;
    if (tail_may_split && p.sm_count > 0 && !(p.sm90_flags & FLASHATTN_SM90_NO_SPLIT_TAIL)) {
      int n_min, n_max;
      params.keys.template blocks<Traits::kBlockN>(0, Traits::kBlockM, n_min, n_max);
      FwdTail tail = plan_tail(params.num_tiles, n_max - n_min, p.sm_count,
                               p.sm90_flags & FLASHATTN_SM90_SPLIT_TAIL_ALWAYS);
      if (tail.tiles > 0) {
        // The pieces' workspace (S + tiles − 1 slots of 128·(d + 1) floats: at most 35 MB, at
        // d256 with 131 tail tiles on 132 SMs), in stream order (workspace_pool.h). Without it
        // (out of memory, say) the call runs unsplit: the error is not this call's failure (a
        // sticky one shows at the launch below).
        const size_t bytes =
            size_t(tail.slots()) * tail_slot_floats(Traits::kHeadDimV) * sizeof(float);
        if (workspace_alloc(reinterpret_cast<void**>(&tail.partials), bytes, stream) ==
            cudaSuccess)
          return run_fwd_split_tail(p, params, tail, stream);
        (void)cudaGetLastError();
      }
    }
  }
  // Packed: the schedule first (fwd_packed_schedule), in a workspace taken and given back in
  // stream order; not where padding costs no tiles (the slots' bound from Q's rows reaches the
  // padded count, as when sequences that fill Q average num_m_blocks − 1 blocks or more), whose
  // padded walk in the caller's order has as many tiles and spares the pass and a load per
  // tile. Without the
  // workspace (out of memory, say) the call runs padded too: the error is not this call's
  // failure (a sticky one shows at the launch below).
  PackedSlot* schedule = nullptr;
  if (packed) {
    const bool padding_is_free = slots == int64_t(params.num_m_blocks) * p.batch;
    if (!padding_is_free && workspace_alloc(reinterpret_cast<void**>(&schedule),
                                            size_t(slots) * sizeof(PackedSlot), stream) !=
                                cudaSuccess) {
      (void)cudaGetLastError();
      schedule = nullptr;
    }
    if (schedule == nullptr) params.num_tiles = int(padded_tiles);
  }
  // Key splits: the caller's count, or asked to plan them, where the tail split does not apply,
  // the planned one. No more than the longest sequence's key blocks, nor partials past
  // kMaxSplitBytes; without their workspace (out of memory, say) the call runs unsplit.
  const int blocks = (params.seqs.max_k + Traits::kBlockN - 1) / Traits::kBlockN;
  int splits = p.num_splits;
  if (splits == 0 && (p.sm90_flags & FLASHATTN_SM90_PLAN_KEY_SPLITS) &&
      !(equal_tiles && params.group == 1))
    splits = plan_splits(params.num_tiles, blocks, p.sm_count);
  const int64_t slot_bytes = tail_slot_floats(Traits::kHeadDimV) * sizeof(float);
  const int64_t fitting = kMaxSplitBytes / (std::max(params.num_tiles, 1) * slot_bytes);
  splits = int(std::min<int64_t>({splits, blocks, fitting}));
  if (kPackable && splits > 1) {
    const int64_t units = int64_t(params.num_tiles) * splits;
    if (workspace_alloc(reinterpret_cast<void**>(&params.tail.partials),
                        size_t(units * slot_bytes), stream) == cudaSuccess) {
      params.num_splits = splits;
      params.num_tiles = int(units);
      params.tiles_per_unit = 1;
    } else {
      (void)cudaGetLastError();
      params.tail.partials = nullptr;
    }
  }
  flashattn_result_t launched = ok();
  if (schedule != nullptr) {
    params.slot_entries = schedule;
    int threads = 32;  // a power of two (the schedule's sort), one per entry up to kScheduleChunk
    while (threads < kScheduleChunk && threads < p.batch) threads *= 2;
    fwd_packed_schedule<Traits::kBlockM>
        <<<(p.batch + threads - 1) / threads, threads, 0, stream>>>(
            params.seqs, params.group, p.batch, int(slots), schedule);
    launched = check_launch();
  }
  // After the schedule, beside its end (the kernel waits for the table); else plainly.
  auto launch = [&](auto tiles_kernel) {
    const int ctas = ctas_for(params.num_tiles);
    if (schedule != nullptr)
      return cuda_status(launch_dependent(tiles_kernel, ctas, Traits::kThreads, smem_bytes,
                                          stream, params));
    tiles_kernel<<<ctas, Traits::kThreads, smem_bytes, stream>>>(params);
    return check_launch();
  };
  // Whole tiles, or with pack-GQA or key splits the partial-results kernel, whose splits the
  // merge then joins.
  auto tiles_kernel = kernel;
  if constexpr (kPackable) {
    if (params.group > 1 || params.num_splits > 1) {
      constexpr auto partials_kernel = &fwd_kernel<Traits, true>;
      tiles_kernel = partials_kernel;
      if (launched.status == FLASHATTN_OK)
        launched = cuda_status(allow_dynamic_smem<partials_kernel>(smem_bytes));
    }
  }
  if (launched.status == FLASHATTN_OK) launched = launch(tiles_kernel);
  if (params.num_splits > 1) {
    if (launched.status == FLASHATTN_OK) {
      const int64_t tiles = params.num_tiles / params.num_splits;
      const int64_t threads = tiles * kTailRows * (Traits::kHeadDimV / 4);
      launched = cuda_status(launch_dependent(
          fwd_split_merge<Traits, Element>, int((threads + kMergeThreads - 1) / kMergeThreads),
          kMergeThreads, 0, stream, params));
    }
    launched = freed_after(launched, params.tail.partials, stream);
  }
  return schedule != nullptr ? freed_after(launched, schedule, stream) : launched;
}

// The forward: its kernels, then the call's attention sinks (common/fwd_sinks.h) into O, whose
// type is Q's, or for FP8 the call's out_dtype.
template <class Traits>
flashattn_result_t run_fwd(const flashattn_params_t& p, bool pingpong, cudaStream_t stream) {
  const flashattn_result_t r = run_fwd_kernels<Traits>(p, pingpong, stream);
  if (r.status != FLASHATTN_OK || p.sinks == nullptr) return r;
  if constexpr (Traits::kFp8) {
    return cuda_status(p.out_dtype == FLASHATTN_BF16
                           ? launch_fwd_add_sinks<cutlass::bfloat16_t>(p, stream)
                           : launch_fwd_add_sinks<cutlass::half_t>(p, stream));
  } else {
    return cuda_status(launch_fwd_add_sinks<typename Traits::Element>(p, stream));
  }
}

// The tile table's instantiation the caller chose (FLASHATTN_SM90_MASKED_TILE), where the head
// dims have a Masked tile; else the Base one. A paged cache takes the Masked tile where only its
// key block divides the pages (whole blocks by TMA, not pieces), or where only its block takes
// wide pieces.
template <class Element, int kHeadDim, int kHeadDimV = kHeadDim>
flashattn_result_t run_fwd_tiled(const flashattn_params_t& p, FwdOptions o, cudaStream_t stream) {
  using Tile = FwdTile<kHeadDim, kHeadDimV>;
  using Masked = FwdTileMasked<kHeadDim, kHeadDimV>;
  if constexpr (Masked::kBlockN != Tile::kBlockN) {
    constexpr bool only_masked_takes_wide =
        Masked::kBlockN % kWidePieceRows == 0 && Tile::kBlockN % kWidePieceRows != 0;
    const bool pages_need_masked =
        p.page_table != nullptr && p.page_size % Tile::kBlockN != 0 &&
        (p.page_size % Masked::kBlockN == 0 ||
         (only_masked_takes_wide && p.page_size % kWidePieceRows == 0));
    if ((p.sm90_flags & FLASHATTN_SM90_MASKED_TILE) || pages_need_masked)
      return run_fwd<FwdTraits<Element, kHeadDim, Masked, Masked::kIntraWGOverlap, kHeadDimV>>(
          p, o.pingpong, stream);
  }
  return run_fwd<FwdTraits<Element, kHeadDim, Tile, Tile::kIntraWGOverlap, kHeadDimV>>(
      p, o.pingpong, stream);
}

// The forward over an e4m3 paged KV cache (flash_api.h kv_cache_e4m3) with Q and O in Element:
// the Masked tile (the Base one where there is none), whose stages hold the widened rows and
// whose narrower key blocks leave room for the staging slots (fwd_cache_staging.h).
template <class Element, int kHeadDim>
flashattn_result_t run_fwd_fp8_cache(const flashattn_params_t& p, FwdOptions o,
                                     cudaStream_t stream) {
  using Tile = FwdTileMasked<kHeadDim>;
  static_assert(Tile::kIntraWGOverlap && Tile::kTailSplit,
                "pack-GQA and key splits run on the overlapped partial-results kernel");
  return run_fwd<FwdTraits<Element, kHeadDim, Tile, true, kHeadDim, cutlass::float_e4m3_t>>(
      p, o.pingpong, stream);
}

}  // namespace flashattn::sm90
