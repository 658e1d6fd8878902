// The sm80 backward's dQ conversion kernel (after the main kernel, bwd_kernel.h).
#pragma once

#include "bwd_traits.h"

namespace flashattn::sm80 {

// dQ from the main kernel's accumulator (MMA order per query block; its slices summed in order)
// to the element type, times `scale`: one CTA per query block of the workspace rows (grid: per
// (batch, head), or packed per head), with the main kernel's dQ thread layout. Packed, the block's
// sequence is the one whose run holds it; blocks past a sequence's rows, or of no sequence's run,
// write nothing.
template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads)
    bwd_convert_dq(__grid_constant__ const BwdParams p) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kHeadDim = Traits::kHeadDim;
  int m = blockIdx.x, batch = blockIdx.z;
  const int head = blockIdx.y;
  const int tid = threadIdx.x;
  Sequences::Entry e;
  if (p.seqs.packed()) {
    const int64_t w = int64_t(m) * kBlockM;  // first row within the head's workspace rows
    batch = bwd_entry_of_row(p.seqs, p.batch, w);
    e = p.seqs.at(batch);
    const int64_t r = w - bwd_rows_start(p.seqs, e, batch, 0, p.heads_q, p.dq_rows);
    if (r < 0 || r >= e.seqlen_q) return;
    m = int(r / kBlockM);  // runs start on multiples of kBlockM (kDqRowAlign)
  } else {
    e = p.seqs.at(batch);
  }
  const float* src =
      p.dq_accum +
      (bwd_rows_start(p.seqs, e, batch, head, p.heads_q, p.dq_rows) + int64_t(m) * kBlockM) *
          kHeadDim;
  Element* dst = static_cast<Element*>(p.dq) + e.batch * p.dq_batch_stride +
                 head * p.dq_head_stride + int64_t(e.q_start) * p.dq_row_stride;
  typename Traits::MmadQ mma;
  Tensor c = mma.get_thread_slice(tid).partition_C(
      make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
#pragma unroll
  for (int i = 0; i < size(c); i += 2) {  // elements i, i+1 are neighbouring columns
    const int row = m * kBlockM + get<0>(c(i));
    if (row >= e.seqlen_q) continue;
    float sum0 = 0.f, sum1 = 0.f;
    for (int s = 0; s < p.dq_splits; ++s) {  // fixed order
      sum0 += src[s * p.dq_split_stride + i * Traits::kThreads + tid];
      sum1 += src[s * p.dq_split_stride + (i + 1) * Traits::kThreads + tid];
    }
    cutlass::Array<Element, 2> pair;
    pair[0] = Element(sum0 * p.scale);
    pair[1] = Element(sum1 * p.scale);
    *reinterpret_cast<cutlass::Array<Element, 2>*>(dst + row * p.dq_row_stride + get<1>(c(i))) =
        pair;
  }
}

}  // namespace flashattn::sm80
