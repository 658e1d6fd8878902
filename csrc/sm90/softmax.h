// WGMMA accumulator layouts as the online softmax (common/online_softmax.h) and the P·V GEMM
// want them.
#pragma once

#include <cute/tensor.hpp>

#include "../common/online_softmax.h"

namespace flashattn::sm90 {

using namespace cute;

// ((2,2,N/8), MMA_M, MMA_N) accumulator layout -> ((2, MMA_M), (2, N/8, MMA_N)) rows x cols.
template <class Layout>
__device__ constexpr auto acc_rowcol(Layout l) {
  static_assert(decltype(rank<0>(l))::value == 3);
  return make_layout(make_layout(get<0, 1>(l), get<1>(l)),
                     make_layout(get<0, 0>(l), get<0, 2>(l), get<2>(l)));
}

// The fp32 accumulator of S = Q·Kᵀ, ((2,2,N/8), MMA_M, MMA_N), reused as the A operand of
// O += P·V: ((2,2,2), MMA_M, K/16), i.e. every two 8-column groups of S form one 16-wide K slice
// of P. MMA_N > 1 when the selected atom is narrower than the key block.
template <class Layout>
__device__ constexpr auto acc_as_operand_a(Layout l) {
  auto split = logical_divide(get<0>(l), Shape<Underscore, Underscore, _2>{});  // (2,2,(2,N/16))
  return make_layout(make_layout(get<0>(split), get<1>(split), get<2, 0>(split)), get<1>(l),
                     coalesce(make_layout(get<2, 1>(split), get<2>(l))));
}

// The online softmax of the FP8 forward. The scores' scale changes from key block to key block
// (Q and K descales), so the row maxima are kept already scaled (in the exp2 domain), and P is
// 2^(s·c − max + kOffset): up to 256, so that e4m3 keeps small probabilities in its normal
// range; the 2^kOffset cancels in O/sum and is taken out of the LSE. `c` must be positive.
template <int kRows>
struct ScaledOnlineSoftmax {
  static constexpr float kOffset = 8.f;
  float row_max[kRows];  // of s·c, over the keys seen
  float row_sum[kRows];  // of P (with its 2^kOffset), this thread's columns

  __device__ ScaledOnlineSoftmax() {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      row_max[r] = -INFINITY;
      row_sum[r] = 0.f;
    }
  }

  // Replaces the scores in `s` (rows x cols) by P, updates max and sum, and returns in `factor`
  // what the running output must be multiplied by.
  //
  // `never` is false, but not known to be so at compile time (the kernel passes batch < 0): a
  // select through it makes every row's exponentials wait for the last row's maximum. Without
  // it ptxas starts row 0's exponentials among row 1's max reductions, and the FP8 forward ran
  // slower at d128 and d256 (docs/PERFORMANCE.md).
  template <class Tensor>
  __device__ void step(Tensor& s, float c, float (&factor)[kRows], bool never) {
    static_assert(decltype(size<0>(s))::value == kRows);
    float bias[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      float m = -INFINITY;
#pragma unroll
      for (int j = 0; j < size<1>(s); ++j) m = fmaxf(m, s(r, j));
      m = fmaxf(row_max[r], OnlineSoftmax<kRows>::quad_max(m) * c);
      // A row that has seen only masked scores keeps max -inf: use 0 so that exp2 gives 0s.
      const float m_use = m == -INFINITY ? 0.f : m;
      factor[r] = fast_exp2(row_max[r] - m_use);
      row_max[r] = m;
      bias[r] = m_use - kOffset;
    }
    // The fence: every row's bias depends on the last row's maximum.
#pragma unroll
    for (int r = 0; r + 1 < kRows; ++r) bias[r] = never ? bias[kRows - 1] : bias[r];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < size<1>(s); ++j) {
        s(r, j) = fast_exp2(s(r, j) * c - bias[r]);
        sum += s(r, j);
      }
      row_sum[r] = row_sum[r] * factor[r] + sum;
    }
  }

  // 1/sum per row (0 for rows that saw no key) and the natural-log LSE (+inf for those rows;
  // NaN with O for a row with a NaN score, as OnlineSoftmax::finalize).
  __device__ void finalize(float (&inv_sum)[kRows], float (&lse)[kRows]) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const float sum = OnlineSoftmax<kRows>::quad_sum(row_sum[r]);
      const bool empty = sum == 0.f;
      inv_sum[r] = empty ? 0.f : 1.f / sum;
      lse[r] = empty ? INFINITY : (row_max[r] + log2f(sum) - kOffset) * float(M_LN2);
    }
  }
};

}  // namespace flashattn::sm90
