// Host side of the sm80 backward: workspace carving, kernel params, and the four launches
// (preprocess, main, dQ conversion, and for GQA the dK/dV conversion), all on one stream.
// Included by one small .cu per (head dims, dtype) instantiation. Packed (varlen) calls take the
// same kernels: each CTA finds its sequence (Sequences) and the workspace's packed rows
// (bwd_rows_start) in its prologue, and the grids cover the longest sequence (max_seqlen_q/k).
// A packed call writes dQ for each sequence's query rows [q_start, q_start + seqlen_q) and dK, dV
// for its key rows [k_start, k_start + its cu_seqlens_k length), zeros past its used keys
// (seqused_k); rows that no sequence owns (before the first offset, past the last, or past a
// sequence's max_seqlen bound) are left as they were.
#pragma once

#include <cuda_runtime.h>

#include <climits>

#include <cmath>
#include <type_traits>
#include <utility>

#include "../common/launch.h"
#include "../common/status.h"
#include "../flash_api.h"
#include "bwd_tile.h"
#include "bwd_convert.h"
#include "bwd_kernel.h"

namespace flashattn::sm80 {

// kHeadDim: of Q, K, dQ and dK; kHeadDimV: of V, O, dO and dV.
template <class Element, int kHeadDim, int kHeadDimV = kHeadDim>
flashattn_result_t run_bwd(const flashattn_params_t& p, cudaStream_t stream) {
  using Tile = BwdTile<kHeadDim, kHeadDimV>;
  using Traits = BwdTraits<Element, kHeadDim, Tile::kBlockM, Tile::kBlockN, Tile::kWarps,
                           Tile::kAtomMSdP, Tile::kAtomNdKV, Tile::kAtomMdQ, kHeadDimV>;
  const Sequences seqs = sequences(p);
  // Grid (key blocks of the longest entry, heads, batch): y and z stop at 65535; the tile order's
  // linear block index is an int, and so are the query workspace rows of a head.
  if (p.heads_q > 65535 || p.batch > 65535 ||
      int64_t(seqs.max_k / Traits::kBlockN + 1) * p.heads_q * p.batch > INT_MAX ||
      bwd_rows_per_head(p) > INT_MAX)
    return status(FLASHATTN_UNSUPPORTED);
  const BwdWorkspace ws = bwd_workspace(p, bwd_dq_splits(p));
  if (p.workspace == nullptr || p.workspace_bytes < ws.bytes)
    return status(FLASHATTN_INVALID_ARGUMENT);
  char* base = static_cast<char*>(p.workspace);

  BwdParams params;
  params.q = p.q.ptr;
  params.k = p.k.ptr;
  params.v = p.v.ptr;
  params.dout = p.dout.ptr;
  params.dq = p.dq.ptr;
  params.dk = p.dk.ptr;
  params.dv = p.dv.ptr;
  params.dq_accum = reinterpret_cast<float*>(base + ws.dq_accum);
  static_assert(kDqRowAlign % Traits::kBlockM == 0);
  params.dq_rows = int(bwd_rows_per_head(p));
  params.deterministic = p.deterministic != 0;
  params.dq_splits = bwd_dq_splits(p);
  params.dq_split_stride =
      (ws.lse_log2 - ws.dq_accum) / params.dq_splits / int64_t(sizeof(float));
  params.lse_log2 = reinterpret_cast<float*>(base + ws.lse_log2);
  params.softmax_d = reinterpret_cast<float*>(base + ws.softmax_d);
  const bool gqa = p.heads_q != p.heads_kv;
  params.dk_accum = gqa ? reinterpret_cast<float*>(base + ws.dk_accum) : nullptr;
  params.dv_accum = gqa ? reinterpret_cast<float*>(base + ws.dv_accum) : nullptr;
  auto strides = [](const flashattn_tensor_t& t, int64_t& b, int64_t& r, int64_t& h) {
    b = t.batch_stride;
    r = t.row_stride;
    h = t.head_stride;
  };
  strides(p.q, params.q_batch_stride, params.q_row_stride, params.q_head_stride);
  strides(p.k, params.k_batch_stride, params.k_row_stride, params.k_head_stride);
  strides(p.v, params.v_batch_stride, params.v_row_stride, params.v_head_stride);
  strides(p.dout, params.do_batch_stride, params.do_row_stride, params.do_head_stride);
  strides(p.dq, params.dq_batch_stride, params.dq_row_stride, params.dq_head_stride);
  strides(p.dk, params.dk_batch_stride, params.dk_row_stride, params.dk_head_stride);
  strides(p.dv, params.dv_batch_stride, params.dv_row_stride, params.dv_head_stride);
  params.batch = p.batch;
  params.heads_q = p.heads_q;
  params.heads_kv = p.heads_kv;
  params.seqlen_q = p.seqlen_q;
  params.seqlen_k = p.seqlen_k;
  params.keys = key_range(p);
  params.seqs = seqs;
  const float log2e = float(M_LOG2E);
  params.scale = p.softmax_scale;
  params.softcap = p.softcap > 0.f;
  params.softcap_pre = params.softcap ? p.softmax_scale / p.softcap : 0.f;
  params.scale_log2 = params.softcap ? p.softcap * log2e : p.softmax_scale * log2e;

  // Deterministic GQA sums are written whole (plain stores), the atomic ones accumulated.
  if (gqa && !params.deterministic)
    FLASHATTN_TRY_CUDA(cudaMemsetAsync(base + ws.dk_accum, 0, ws.bytes - ws.dk_accum, stream));

  if (seqs.packed()) FLASHATTN_TRY_CUDA(launch_bwd_packed_entries<0>(p, ws, base, stream));
  BwdRowsParams rows{p.o.ptr, p.dout.ptr, p.lse, params.lse_log2, params.softmax_d,
                     p.o.batch_stride, p.o.row_stride, p.o.head_stride,
                     p.dout.batch_stride, p.dout.row_stride, p.dout.head_stride,
                     p.batch, p.heads_q, p.seqlen_q, params.dq_rows,
                     params.dq_accum, params.dq_split_stride, params.dq_splits,
                     nullptr, 0, 0, 0, KeyRange{}, nullptr, seqs};  // dQ converted after
  if (seqs.packed()) rows.row_entries = reinterpret_cast<const int*>(base + ws.row_entries);
  FLASHATTN_TRY_CUDA((launch_bwd_preprocess<Element, kHeadDim, kHeadDimV>(rows, stream)));

  // Two Q/dO buffers where the device's shared memory holds them.
  int device = 0, smem_optin = 0;
  FLASHATTN_TRY_CUDA(cudaGetDevice(&device));
  FLASHATTN_TRY_CUDA(
      cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  params.q_stages = smem_optin >= Traits::smem_bytes(2) ? 2 : 1;
  const int smem_bytes = Traits::smem_bytes(params.q_stages);
  const int n_blocks = (seqs.max_k + Traits::kBlockN - 1) / Traits::kBlockN;
  // The sinks' gradient: the kernels leave each key block's parts.
  BwdSinkParts sink_parts;
  FLASHATTN_TRY_CUDA(zeroed_sink_parts(p, ws, base, p.batch, n_blocks, stream, sink_parts));
  params.sinks = p.sinks;
  params.sink_parts = sink_parts.parts;
  params.sink_blocks = n_blocks;
  // Three instantiations: plain, plain with the sinks' gradient parts, deterministic (parts where
  // the call has them).
  auto launch = [&](auto deterministic, auto sink_parts_summed, dim3 grid) {
    constexpr auto kernel = &bwd_kernel<Traits, decltype(deterministic)::value,
                                        decltype(sink_parts_summed)::value>;
    if (const cudaError_t e = allow_dynamic_smem<kernel>(smem_bytes); e != cudaSuccess)
      return e;
    kernel<<<grid, Traits::kThreads, smem_bytes, stream>>>(params);
    return cudaGetLastError();
  };
  if (params.deterministic) {
    FLASHATTN_TRY_CUDA(launch(std::true_type{}, std::true_type{},
                              dim3(params.dq_splits, p.heads_q, p.batch)));
  } else {
    // Causal (any right bound): key block 0 sees the most query rows, so heaviest first, heads
    // grouped by the Q, dO and dQ accumulator they share within a third of the L2 (measured
    // faster than half at several causal shapes, equal at the rest; benchmarks/README.md).
    const int64_t q_bytes = int64_t(seqs.max_q) * ((kHeadDim + kHeadDimV) * sizeof(Element) +
                                                   kHeadDim * sizeof(float));
    params.order = TileOrder::make(n_blocks, p.batch * p.heads_q, params.keys.window_right >= 0,
                                   q_bytes, l2_bytes() / 3);
    const dim3 grid(n_blocks, p.heads_q, p.batch);
    if (sink_parts.parts != nullptr)
      FLASHATTN_TRY_CUDA(launch(std::false_type{}, std::true_type{}, grid));
    else
      FLASHATTN_TRY_CUDA(launch(std::false_type{}, std::false_type{}, grid));
  }
  FLASHATTN_TRY_CUDA(cudaGetLastError());
  FLASHATTN_TRY_CUDA(launch_bwd_sink_grad(rows, p.sinks, sink_parts, p.dsinks, stream));

  // Per query block of each (batch, head)'s workspace rows; packed, of each head's (batch 1).
  bwd_convert_dq<Traits><<<dim3(params.dq_rows / Traits::kBlockM, p.heads_q,
                                seqs.packed() ? 1 : p.batch),
                           Traits::kThreads, 0, stream>>>(params);
  FLASHATTN_TRY_CUDA(cudaGetLastError());
  // GQA: the workspace sums per KV head, or in deterministic mode per query head (summed here);
  // dK's rows of kHeadDim, dV's of kHeadDimV (`cols`).
  const int group = params.deterministic ? p.heads_q / p.heads_kv : 1;
  auto convert = [&](auto cols, const float* src, const flashattn_tensor_t& dst, int heads,
                     int seqlen, float scale) {
    constexpr int kCols = decltype(cols)::value;
    if (seqs.packed())
      return launch_bwd_convert_packed<Element, kCols, DqRowMajor<kCols>, false>(
          src, seqlen, group, dst, heads, seqs, p.batch, nullptr, scale, stream);
    const int64_t chunks = int64_t(p.batch) * heads * seqlen * (kCols / 8);
    bwd_convert<Element, kCols><<<unsigned((chunks + 255) / 256), 256, 0, stream>>>(
        src, seqlen, group, dst.ptr, dst.batch_stride, dst.row_stride, dst.head_stride, p.batch, heads,
        seqlen, scale);
    return cudaGetLastError();
  };
  if (gqa) {
    FLASHATTN_TRY_CUDA(convert(Int<kHeadDim>{}, params.dk_accum, p.dk, p.heads_kv, p.seqlen_k,
                               p.softmax_scale));
    FLASHATTN_TRY_CUDA(
        convert(Int<kHeadDimV>{}, params.dv_accum, p.dv, p.heads_kv, p.seqlen_k, 1.f));
  }
  return ok();
}

}  // namespace flashattn::sm80
