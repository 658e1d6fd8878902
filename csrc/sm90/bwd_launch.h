// Host side of the sm90 backward: TMA descriptors and workspace carving, then the launches
// (preprocess, main, dQ conversion, and for GQA the dK/dV conversion), all on one stream.
// Packed (varlen) calls take the same kernels after one more pass, the entry tables
// (bwd_packed_entries): the grid covers a head's packed key blocks (bwd_cta_work), each CTA reads
// its sequence from the table and finds the workspace's packed rows (bwd_rows_start) in its
// prologue, and the conversions map the workspace's or the tensors' rows to their sequences. A packed call writes
// dQ for each sequence's query rows [q_start, q_start + seqlen_q) and dK, dV for its key rows
// [k_start, k_start + its cu_seqlens_k length), zeros past its used keys (seqused_k); rows that
// no sequence owns (before the first offset, past the last, or past a sequence's max_seqlen
// bound) are left as they were.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <type_traits>
#include <utility>

#include "../common/bwd_passes.h"
#include "../common/bwd_workspace.h"
#include "../common/launch.h"
#include "../common/status.h"
#include "../flash_api.h"
#include "bwd_kernel.h"
#include "bwd_kernel_keys_n.h"
#include "bwd_kernel_split_d.h"
#include "tma_tensor.h"

namespace flashattn::sm90 {

// The consumer warpgroups split the CTA's keys, or (the tile says) its head dim, or its keys as
// the GEMMs' N; only the last two take V's head dim apart from Q's.
template <class Element, int kHeadDim, int kHeadDimV>
using BwdTraitsFor = std::conditional_t<
    BwdTile<kHeadDim, kHeadDimV>::kKeysAsN, BwdKeysNTraits<Element, kHeadDim, kHeadDimV>,
    std::conditional_t<BwdTile<kHeadDim, kHeadDimV>::kSplitHeadDim,
                       BwdSplitDTraits<Element, kHeadDim, kHeadDimV>,
                       BwdTraits<Element, kHeadDim>>>;

template <class Element, int kHeadDim, int kHeadDimV = kHeadDim>
flashattn_result_t run_bwd(const flashattn_params_t& p, cudaStream_t stream) {
  using Traits = BwdTraitsFor<Element, kHeadDim, kHeadDimV>;
  static_assert(Traits::kHeadDimV == kHeadDimV, "a kernel of one head dim for two");
  using Tile = BwdTile<kHeadDim, kHeadDimV>;
  constexpr bool kSplitKeys = !Tile::kSplitHeadDim && !Tile::kKeysAsN;
  // The workspace's sinks' parts and packed key table are sized for key blocks of this or more.
  static_assert(Traits::kBlockN >= kMinKeyBlock);
  const bool softcap = p.softcap > 0.f;
  // Softcap's kernels have no deterministic mode, and no sums for the sinks' gradient (their dS
  // holds the cap's derivative, and the kernels of d96 and up hold P·(1 − t²) in place of P):
  // the sm80 backward has both.
  if (softcap && (p.deterministic || p.dsinks != nullptr)) return status(FLASHATTN_UNSUPPORTED);
  const Sequences seqs = sequences(p);
  // Tiles of the tile order per head: dense, the key blocks of each (batch, head); packed, a
  // head's packed key blocks. The CTA index and a head's query workspace rows are ints.
  const int64_t tiles = seqs.packed() ? packed_blocks(p.seqlen_k, p.batch, Traits::kBlockN)
                                      : (p.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN;
  const int64_t heads_total = seqs.packed() ? p.heads_q : int64_t(p.heads_q) * p.batch;
  if (tiles * heads_total > INT_MAX || bwd_rows_per_head(p) > INT_MAX)
    return status(FLASHATTN_UNSUPPORTED);
  // One dQ accumulator (B, heads_q, dq_rows, d) in slabs (Traits::DqLayout), in either mode.
  const BwdWorkspace ws = bwd_workspace(p, 1);
  if (p.workspace == nullptr || p.workspace_bytes < ws.bytes)
    return status(FLASHATTN_INVALID_ARGUMENT);
  char* base = static_cast<char*>(p.workspace);
  const int dq_rows = int(bwd_rows_per_head(p));
  static_assert(kDqRowAlign % Traits::kBlockM == 0);

  BwdParams<Traits> params;
  params.seqs = seqs;
  params.batch = p.batch;
  // One tile of an operand of head dim kDim (V and dO: kHeadDimV) from its tensor.
  auto load = [&](auto kDim, const flashattn_tensor_t& t, int seqlen, int heads, auto smem_layout,
                  auto tile) {
    return make_tma_copy(SM90_TMA_LOAD{},
                         gmem_tensor<Traits, decltype(kDim)::value>(
                             static_cast<Element const*>(t.ptr), t, seqlen, heads,
                             params.tensor_batch()),
                         take<0, 2>(smem_layout), tile, _1{});
  };
  using DimQK = Int<kHeadDim>;
  using DimV = Int<kHeadDimV>;
  params.tma_q = load(DimQK{}, p.q, p.seqlen_q, p.heads_q, typename Traits::SmemLayoutQ{},
                      typename Traits::TileQ{});
  params.tma_do = load(DimV{}, p.dout, p.seqlen_q, p.heads_q, typename Traits::SmemLayoutdO{},
                       typename Traits::TiledO{});
  params.tma_k = load(DimQK{}, p.k, p.seqlen_k, p.heads_kv, typename Traits::SmemLayoutK{},
                      typename Traits::TileK{});
  params.tma_v = load(DimV{}, p.v, p.seqlen_k, p.heads_kv, typename Traits::SmemLayoutV{},
                      typename Traits::TileV{});
  params.dq_accum = reinterpret_cast<float*>(base + ws.dq_accum);
  float* lse_log2 = reinterpret_cast<float*>(base + ws.lse_log2);
  float* softmax_d = reinterpret_cast<float*>(base + ws.softmax_d);
  params.lse_log2 = lse_log2;
  params.softmax_d = softmax_d;
  params.dq = static_cast<Element*>(p.dq.ptr);
  params.dq_batch_stride = p.dq.batch_stride;
  params.dq_row_stride = p.dq.row_stride;
  params.dq_head_stride = p.dq.head_stride;
  params.dk = static_cast<Element*>(p.dk.ptr);
  params.dv = static_cast<Element*>(p.dv.ptr);
  params.dk_batch_stride = p.dk.batch_stride;
  params.dk_row_stride = p.dk.row_stride;
  params.dk_head_stride = p.dk.head_stride;
  params.dv_batch_stride = p.dv.batch_stride;
  params.dv_row_stride = p.dv.row_stride;
  params.dv_head_stride = p.dv.head_stride;
  const bool gqa = p.heads_q != p.heads_kv;
  params.dk_accum = gqa ? reinterpret_cast<float*>(base + ws.dk_accum) : nullptr;
  params.dv_accum = gqa ? reinterpret_cast<float*>(base + ws.dv_accum) : nullptr;
  params.dq_semaphore = p.deterministic ? reinterpret_cast<int*>(base + ws.dq_semaphore) : nullptr;
  int* offsets_malformed = p.deterministic && seqs.packed()
                               ? reinterpret_cast<int*>(base + ws.offsets_flag)
                               : nullptr;
  params.offsets_malformed = offsets_malformed;
  // Packed: each packed key block's and each query workspace row block's sequence, found once
  // before the other passes (bwd_packed_entries).
  const int* row_entries =
      seqs.packed() ? reinterpret_cast<const int*>(base + ws.row_entries) : nullptr;
  params.key_entries =
      seqs.packed() ? reinterpret_cast<const int*>(base + ws.key_entries) : nullptr;
  // The sinks' gradient: the kernels leave each CTA's parts, in tile-order slots.
  BwdSinkParts sink_parts;
  FLASHATTN_TRY_CUDA(
      zeroed_sink_parts(p, ws, base, seqs.packed() ? 1 : p.batch, tiles, stream, sink_parts));
  params.sinks = p.sinks;
  params.sink_parts = sink_parts.parts;
  params.heads_q = p.heads_q;
  params.heads_kv = p.heads_kv;
  params.seqlen_q = p.seqlen_q;
  params.seqlen_k = p.seqlen_k;
  params.dq_rows = dq_rows;
  params.keys = key_range(p);
  params.scale = p.softmax_scale;
  params.softcap_pre = softcap ? p.softmax_scale / p.softcap : 0.f;
  params.scale_log2 = (softcap ? p.softcap : p.softmax_scale) * float(M_LOG2E);
  // Causal (any right bound): key block 0 sees the most query rows, so heaviest first, heads
  // grouped by the Q, dO and dQ accumulator they share within a third of the L2 (causal: faster
  // than half at d256, equal at d64/d128; all heads in one group slower; benchmarks/README.md).
  // Packed: a head's key blocks run sequence by sequence, in packing order (heaviest first within
  // a sequence, not across them); those of one sequence share its rows, at most max_seqlen_q.
  const int64_t q_bytes =
      int64_t(seqs.max_q) * ((kHeadDim + kHeadDimV) * sizeof(Element) + kHeadDim * sizeof(float));
  params.order = TileOrder::make(int(tiles), int(heads_total), params.keys.window_right >= 0,
                                 q_bytes, l2_bytes() / 3);

  if (gqa)
    FLASHATTN_TRY_CUDA(
        cudaMemsetAsync(base + ws.dk_accum, 0, ws.dq_semaphore - ws.dk_accum, stream));
  // Deterministic, the writer warps of the kernel that splits the keys convert dQ (bwd_write_dq).
  const bool dq_in_kernel = p.deterministic && kSplitKeys;
  BwdRowsParams rows{p.o.ptr, p.dout.ptr, p.lse, lse_log2, softmax_d,
                     p.o.batch_stride, p.o.row_stride, p.o.head_stride,
                     p.dout.batch_stride, p.dout.row_stride, p.dout.head_stride,
                     p.batch, p.heads_q, p.seqlen_q, dq_rows,
                     params.dq_accum, 0, 1,
                     dq_in_kernel ? p.dq.ptr : nullptr,
                     p.dq.batch_stride, p.dq.row_stride, p.dq.head_stride, params.keys};
  rows.dq_counters = params.dq_semaphore;  // deterministic: zeroed there
  rows.seqs = seqs;
  rows.offsets_malformed = offsets_malformed;
  rows.key_block = Traits::kBlockN;
  rows.row_entries = row_entries;
  if (seqs.packed())
    FLASHATTN_TRY_CUDA(launch_bwd_packed_entries<Traits::kBlockN>(p, ws, base, stream));
  if (offsets_malformed != nullptr)
    FLASHATTN_TRY_CUDA(cudaMemsetAsync(offsets_malformed, 0, sizeof(int), stream));
  FLASHATTN_TRY_CUDA((launch_bwd_preprocess<Element, kHeadDim, kHeadDimV>(rows, stream)));

  const int smem_bytes = sizeof(typename Traits::SharedStorage);
  const unsigned ctas = unsigned(tiles * heads_total);
  // Four instantiations: plain, plain with the sinks' gradient parts, deterministic (parts where
  // the call has them), softcap (whose deterministic mode and sinks' gradient are refused above).
  auto launch = [&](auto deterministic, auto capped, auto sink_parts_summed) {
    constexpr bool kDeterministic = decltype(deterministic)::value;
    constexpr bool kSoftcap = decltype(capped)::value;
    constexpr bool kSinkParts = decltype(sink_parts_summed)::value;
    constexpr auto kernel = [] {
      if constexpr (Tile::kKeysAsN)
        return bwd_kernel_keys_n<Traits, kDeterministic, kSoftcap, kSinkParts>;
      else if constexpr (Tile::kSplitHeadDim)
        return bwd_kernel_split_d<Traits, kDeterministic, kSoftcap, kSinkParts>;
      else
        return bwd_kernel<Traits, kDeterministic, kSoftcap, kSinkParts>;
    }();
    FLASHATTN_TRY_CUDA(allow_dynamic_smem<kernel>(smem_bytes));
    kernel<<<ctas, Traits::kThreads, smem_bytes, stream>>>(params);
    return ok();
  };
  const flashattn_result_t launched =
      softcap           ? launch(std::false_type{}, std::true_type{}, std::false_type{})
      : p.deterministic ? launch(std::true_type{}, std::false_type{}, std::true_type{})
      : sink_parts.parts != nullptr
          ? launch(std::false_type{}, std::false_type{}, std::true_type{})
          : launch(std::false_type{}, std::false_type{}, std::false_type{});
  if (launched.status != FLASHATTN_OK) return launched;
  FLASHATTN_TRY_CUDA(cudaGetLastError());
  FLASHATTN_TRY_CUDA(launch_bwd_sink_grad(rows, p.sinks, sink_parts, p.dsinks, stream));

  // GQA dK/dV: per KV head, or in deterministic mode per query head, summed here in head order.
  const int kv_group = p.deterministic ? p.heads_q / p.heads_kv : 1;
  auto convert = [&](auto kDim, const float* src, const flashattn_tensor_t& dst, int heads,
                     int seqlen, float scale) {
    constexpr int d = decltype(kDim)::value;
    if (seqs.packed())
      return launch_bwd_convert_packed<Element, d, DqRowMajor<d>, false>(
          src, seqlen, kv_group, dst, heads, seqs, p.batch, nullptr, scale, stream);
    const int64_t chunks = int64_t(p.batch) * heads * seqlen * (d / 8);
    bwd_convert<Element, d><<<unsigned((chunks + 255) / 256), 256, 0, stream>>>(
        src, seqlen, kv_group, dst.ptr, dst.batch_stride, dst.row_stride, dst.head_stride,
        p.batch, heads, seqlen, scale);
    return cudaGetLastError();
  };
  using DqLayout = typename Traits::DqLayout;
  if (!dq_in_kernel && seqs.packed()) {
    FLASHATTN_TRY_CUDA((launch_bwd_convert_packed<Element, kHeadDim, DqLayout, true>(
        params.dq_accum, dq_rows, 1, p.dq, p.heads_q, seqs, p.batch, row_entries, p.softmax_scale,
        stream)));
  } else if (!dq_in_kernel) {
    const int64_t dq_chunks = int64_t(p.batch) * p.heads_q * p.seqlen_q * (kHeadDim / 8);
    bwd_convert<Element, kHeadDim, DqLayout>
        <<<unsigned((dq_chunks + 255) / 256), 256, 0, stream>>>(
            params.dq_accum, dq_rows, 1, p.dq.ptr, p.dq.batch_stride, p.dq.row_stride,
            p.dq.head_stride, p.batch, p.heads_q, p.seqlen_q, p.softmax_scale);
    FLASHATTN_TRY_CUDA(cudaGetLastError());
  }
  if (gqa) {
    FLASHATTN_TRY_CUDA(
        convert(DimQK{}, params.dk_accum, p.dk, p.heads_kv, p.seqlen_k, p.softmax_scale));
    FLASHATTN_TRY_CUDA(convert(DimV{}, params.dv_accum, p.dv, p.heads_kv, p.seqlen_k, 1.f));
  }
  return ok();
}

}  // namespace flashattn::sm90
