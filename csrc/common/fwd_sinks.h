// Attention sinks in the forward, as a pass after the kernels of every family. A sink is one more
// score per query head with no value row, so adding it to a finished row only rescales the row:
// LSE' = log(e^LSE + e^sink) and O' = O·e^(LSE − LSE'). Done here rather than in the kernels'
// finalize, which runs wherever a tile ends and is inlined there: its sink step lengthened every
// forward kernel and slowed calls without sinks (benchmarks/README.md). Here a call without sinks
// pays nothing; one with sinks pays a pass over O and one more rounding of it.
//
// A row that saw no key (LSE +inf, O 0) gets LSE = sink and keeps O; a sink of −inf is none (the
// row is left as it is); a sink of +inf or NaN, or a NaN LSE, makes the row's LSE and O NaN.
#pragma once

#include <cuda_runtime.h>
#include <cutlass/array.h>

#include <cmath>
#include <cstdint>

#include "../flash_api.h"
#include "sequences.h"

namespace flashattn {

struct FwdSinksParams {
  void* o;
  int64_t o_batch_stride, o_row_stride, o_head_stride;  // elements
  float* lse;  // the forward's (batch, heads_q, rows) layout, dense or packed
  const float* sinks;
  Sequences seqs;  // each entry's rows (packed: as the kernels clamp its offsets)
  int64_t units;   // entries · heads_q · the longest entry's rows
  int heads_q, head_dim;
};

constexpr int kFwdSinksThreads = 256;

// One warp per (entry, head, row of the entry): rows no entry owns (a packed batch's rows outside
// every sequence) are left as the kernels left them. Every lane reads the old LSE before lane 0
// writes the new one, and the lanes share the row's 8-element chunks of O (16-byte aligned: the
// C ABI checks O's pointer and strides).
template <class Element>
__global__ void __launch_bounds__(kFwdSinksThreads) fwd_add_sinks(
    __grid_constant__ const FwdSinksParams p) {
  constexpr int kWarps = kFwdSinksThreads / 32;
  const int lane = threadIdx.x % 32;
  for (int64_t unit = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32; unit < p.units;
       unit += int64_t(gridDim.x) * kWarps) {
    const int r = int(unit % p.seqs.max_q);
    const int64_t entry_head = unit / p.seqs.max_q;
    const int head = int(entry_head % p.heads_q);
    const Sequences::Entry e = p.seqs.at(int(entry_head / p.heads_q));
    if (r >= e.seqlen_q) continue;
    float* lse_at = p.lse + p.seqs.lse_offset(e, head, p.heads_q, p.seqs.rows_q) + r;
    const float sink = p.sinks[head];
    const float lse = *lse_at;
    __syncwarp();
    if (sink == -INFINITY) continue;
    float new_lse, factor;
    if (sink == INFINITY || sink != sink) {  // the sink takes everything: NaN, as the reference
      new_lse = factor = NAN;
    } else if (lse == INFINITY) {  // no key: the sink alone
      new_lse = sink, factor = 1.f;
    } else {
      const bool row_on_top = lse > sink;  // false for a NaN LSE, which the sum then carries
      const float top = row_on_top ? lse : sink, low = row_on_top ? sink : lse;
      new_lse = top + log1pf(expf(low - top));
      factor = expf(lse - new_lse);
    }
    auto o = static_cast<Element*>(p.o) + e.batch * p.o_batch_stride +
             (int64_t(e.q_start) + r) * p.o_row_stride + head * p.o_head_stride;
    for (int c = lane; c < p.head_dim / 8; c += 32) {
      auto& chunk = *reinterpret_cast<cutlass::Array<Element, 8>*>(o + c * 8);
      cutlass::Array<Element, 8> v = chunk;
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = Element(float(v[i]) * factor);
      chunk = v;
    }
    if (lane == 0) *lse_at = new_lse;
  }
}

// The sinks into a finished forward's O (of type Element, V's head dim) and LSE, where the call
// has them. Each family's launcher calls it, so that the pass is built for the architectures its
// kernels are.
template <class Element>
cudaError_t launch_fwd_add_sinks(const flashattn_params_t& p, cudaStream_t stream) {
  if (p.sinks == nullptr) return cudaSuccess;
  FwdSinksParams s;
  s.o = p.o.ptr;
  s.o_batch_stride = p.o.batch_stride;
  s.o_row_stride = p.o.row_stride;
  s.o_head_stride = p.o.head_stride;
  s.lse = p.lse;
  s.sinks = p.sinks;
  s.seqs = sequences(p);
  s.heads_q = p.heads_q;
  s.head_dim = p.head_dim_v != 0 ? p.head_dim_v : p.head_dim;
  s.units = int64_t(p.batch) * p.heads_q * s.seqs.max_q;
  if (s.units == 0) return cudaSuccess;
  constexpr int kWarps = kFwdSinksThreads / 32;
  const int64_t blocks = (s.units + kWarps - 1) / kWarps;
  const unsigned grid = unsigned(blocks < (int64_t(1) << 20) ? blocks : (int64_t(1) << 20));
  fwd_add_sinks<Element><<<grid, kFwdSinksThreads, 0, stream>>>(s);
  return cudaGetLastError();
}

}  // namespace flashattn
