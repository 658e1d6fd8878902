// The tail split's third launch (fwd_tail.h): each tail tile's pieces merged into its O and LSE.
//
// One thread per row and 4 columns of a tail tile, reading the pieces' slots row-major:
// LSE = log Σ exp(LSE_p), O = Σ exp(LSE_p − LSE) · O_p, in one pass with a running maximum. A
// piece with LSE +inf saw no key of the row: its O is 0, or NaN where V holds a NaN or inf at a
// key the row does not see (0·NaN), which is added, as the whole-tile kernel's O would carry it.
// A row that sees no key at all gets O = 0 and LSE = +inf. A piece with a NaN score has LSE and
// O NaN, which pass on to the row's O and LSE.
#pragma once

#include <cutlass/array.h>

#include "fwd_tail.h"
#include "grid_dependency.h"

namespace flashattn::sm90 {

template <class Out>
struct TailMergeParams {
  FwdTail tail;
  Out* o;
  int64_t o_batch_stride, o_row_stride, o_head_stride;
  float* lse;
  int heads_q, seqlen_q, num_m_blocks;
};

constexpr int kTailMergeThreads = 256;

template <int kHeadDim, class Out>
__global__ void __launch_bounds__(kTailMergeThreads) fwd_tail_merge(const TailMergeParams<Out> p) {
  wait_for_prior_grids();  // the pieces' slots
  constexpr int kChunks = kHeadDim / 4;
  const int64_t i = int64_t(blockIdx.x) * kTailMergeThreads + threadIdx.x;
  const int chunk = int(i % kChunks);
  const int row = int(i / kChunks % kTailRows);
  const int k = int(i / (kChunks * kTailRows));
  const FwdTail& s = p.tail;
  if (k >= s.tiles) return;
  const int tile = s.first_tile + k;  // tiles_per_unit 1: query blocks in order
  const int m_block = tile % p.num_m_blocks, bh = tile / p.num_m_blocks;
  const int q_row = m_block * kTailRows + row;
  if (q_row >= p.seqlen_q) return;

  float max_lse = -INFINITY, sum = 0.f;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  const int last = s.owner((k + 1) * s.blocks - 1);
  for (int c = s.owner(k * s.blocks); c <= last; ++c) {
    const float* slot = s.partials + s.slot(c, k) * tail_slot_floats(kHeadDim);
    const float lse = slot[kTailRows * kHeadDim + row];
    const float4 o = *reinterpret_cast<const float4*>(slot + row * kHeadDim + chunk * 4);
    if (lse == INFINITY) {
      acc.x += o.x, acc.y += o.y, acc.z += o.z, acc.w += o.w;
      continue;
    }
    if (lse > max_lse) {  // rescale what came before to the new maximum
      const float r = expf(max_lse - lse);
      acc.x *= r, acc.y *= r, acc.z *= r, acc.w *= r, sum *= r;
      max_lse = lse;
    }
    const float w = expf(lse - max_lse);
    acc.x += w * o.x, acc.y += w * o.y, acc.z += w * o.z, acc.w += w * o.w, sum += w;
  }
  const float inv = sum == 0.f ? 0.f : 1.f / sum;
  cutlass::Array<Out, 4> out;
  out[0] = Out(acc.x * inv), out[1] = Out(acc.y * inv), out[2] = Out(acc.z * inv);
  out[3] = Out(acc.w * inv);
  Out* o_row = p.o + (bh / p.heads_q) * p.o_batch_stride + (bh % p.heads_q) * p.o_head_stride +
               q_row * p.o_row_stride;
  *reinterpret_cast<cutlass::Array<Out, 4>*>(o_row + chunk * 4) = out;
  if (chunk == 0)
    p.lse[int64_t(bh) * p.seqlen_q + q_row] = sum == 0.f ? INFINITY : max_lse + logf(sum);
}

}  // namespace flashattn::sm90
