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
// kClampedMax: the block's row maximum taken as max(0, ·) by clamped_row_max.
template <int kRows, bool kClampedMax>
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

  // max(0, the largest score of row r) by VIMNMX3 on the scores' bits as signed integers: two
  // scores per instruction, half the ALU instructions of an FMNMX chain. Non-negative floats
  // order as their bits do and every negative one (−inf of a masked key too) is a negative
  // integer, so a chain started from 0 gives the clamped maximum. As the reference of
  // P = 2^(s·c − max + kOffset), a maximum raised to 0 only scales P down (still ≤ 2^kOffset:
  // no e4m3 saturation), which cancels in O/sum and in the LSE; only where all of a row's
  // scores so far lie well below 0 do its smaller probabilities leave e4m3's normal range
  // sooner. A row that saw only masked keys gets max 0, P = 0 and sum 0, as with −inf.
  template <class Tensor>
  __device__ static float clamped_row_max(Tensor const& s, int r) {
    constexpr int kCols = decltype(size<1>(s))::value;
    static_assert(kCols % 4 == 0);
    int m[2] = {0, 0};  // two chains, two scores per step each
#pragma unroll
    for (int j = 0; j < kCols; j += 4) {
#pragma unroll
      for (int h = 0; h < 2; ++h)
        m[h] = __vimax3_s32(m[h], __float_as_int(s(r, j + 2 * h)),
                            __float_as_int(s(r, j + 2 * h + 1)));
    }
    return __int_as_float(max(m[0], m[1]));
  }

  // Replaces the scores in `s` (rows x cols) by P, updates max and sum, and returns in `factor`
  // what the running output must be multiplied by.
  template <class Tensor>
  __device__ void step(Tensor& s, float c, float (&factor)[kRows]) {
    static_assert(decltype(size<0>(s))::value == kRows);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      float m;
      if constexpr (kClampedMax) {
        m = clamped_row_max(s, r);
      } else {
        m = -INFINITY;
#pragma unroll
        for (int j = 0; j < size<1>(s); ++j) m = fmaxf(m, s(r, j));
      }
      m = fmaxf(row_max[r], OnlineSoftmax<kRows>::quad_max(m) * c);
      // A row that has seen only masked scores keeps max -inf: use 0 so that exp2 gives 0s.
      const float m_use = kClampedMax || m != -INFINITY ? m : 0.f;
      factor[r] = fast_exp2(row_max[r] - m_use);
      row_max[r] = m;
      const float bias = m_use - kOffset;
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < size<1>(s); ++j) {
        s(r, j) = fast_exp2(s(r, j) * c - bias);
        sum += s(r, j);
      }
      row_sum[r] = row_sum[r] * factor[r] + sum;
    }
  }

  // 1/sum per row (0 for rows that saw no key) and the natural-log LSE (+inf for those rows).
  __device__ void finalize(float (&inv_sum)[kRows], float (&lse)[kRows]) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const float sum = OnlineSoftmax<kRows>::quad_sum(row_sum[r]);
      const bool empty = sum == 0.f || sum != sum;
      inv_sum[r] = empty ? 0.f : 1.f / sum;
      lse[r] = empty ? INFINITY : (row_max[r] + log2f(sum) - kOffset) * float(M_LN2);
    }
  }
};

}  // namespace flashattn::sm90
