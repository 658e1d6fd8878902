// Online softmax over accumulator fragments viewed as (rows, cols) per thread, for every
// kernel family whose MMA layout spreads a row over the 4 threads of a quad (WGMMA on sm90,
// mma.sync on sm80): the row max is reduced with two shuffles; the row sum stays per thread
// until `finalize`. Scores enter as raw Q·Kᵀ values (or tanh-capped ones); `scale_log2` folds
// the softmax scale and log2(e) so that each element costs one FFMA and one EX2.
#pragma once

#include <cute/tensor.hpp>
#include <cmath>

namespace flashattn {

using namespace cute;

// 2^x by the hardware's approximate EX2 (flush-to-zero): exp2f without fast-math adds a
// denormal-range fix-up of several instructions per element, and a masked score (−inf) still
// gives exactly 0.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// tanh by the hardware's MUFU.TANH (relative error about 2^-11, below bf16/fp16 rounding of the
// scores it caps): the libm tanhf is some fifteen instructions per score.
__device__ __forceinline__ float fast_tanh(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Row r of `s` over this thread's columns reduced by `op` (max or sum), as four interleaved
// partial results: a single running max (or sum) is a chain of dependent instructions as long as
// the row, each waiting out the previous one's latency.
template <class Tensor, class Op>
__device__ __forceinline__ float thread_row_reduce(Tensor const& s, int r, Op op) {
  constexpr int kCols = decltype(size<1>(s))::value;
  constexpr int kParts = kCols >= 4 ? 4 : 1;
  float part[kParts];
#pragma unroll
  for (int i = 0; i < kParts; ++i) part[i] = s(r, i);
#pragma unroll
  for (int c = kParts; c < kCols; ++c) part[c % kParts] = op(part[c % kParts], s(r, c));
#pragma unroll
  for (int i = 1; i < kParts; ++i) part[0] = op(part[0], part[i]);
  return part[0];
}

// kTreeReduce: row max and sum by thread_row_reduce. Measured faster in the sm80 forward at d128
// and neutral at d64; in the sm90 forwards, whose two warpgroups hide each other's softmax, mixed
// and slower for FP8 (benchmarks/README.md), so they keep the running chain.
template <int kRows, bool kTreeReduce = false>
struct OnlineSoftmax {
  float row_max[kRows];
  float row_sum[kRows];

  __device__ OnlineSoftmax() {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      row_max[r] = -INFINITY;
      row_sum[r] = 0.f;
    }
  }

  __device__ static float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
  }
  __device__ static float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffff, x, 1);
    return x + __shfl_xor_sync(0xffffffff, x, 2);
  }

  // Replaces the scores in `s` (rows x cols) by exp2(s·c − max·c), updates max and sum, and
  // returns in `factor` what the running output must be multiplied by.
  template <class Tensor>
  __device__ void step(Tensor& s, float scale_log2, float (&factor)[kRows]) {
    static_assert(decltype(size<0>(s))::value == kRows);
    [[maybe_unused]] auto max_of = [](float x, float y) { return fmaxf(x, y); };
    [[maybe_unused]] auto sum_of = [](float x, float y) { return x + y; };
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      float m = row_max[r];
      if constexpr (kTreeReduce) {
        m = fmaxf(m, thread_row_reduce(s, r, max_of));
      } else {
#pragma unroll
        for (int c = 0; c < size<1>(s); ++c) m = fmaxf(m, s(r, c));
      }
      m = quad_max(m);
      // A row that has seen only masked scores keeps max -inf: use 0 so that exp2 gives 0s
      // instead of NaN.
      const float m_scaled = m == -INFINITY ? 0.f : m * scale_log2;
      factor[r] = fast_exp2(row_max[r] * scale_log2 - m_scaled);
      row_max[r] = m;
      float sum = 0.f;
#pragma unroll
      for (int c = 0; c < size<1>(s); ++c) {
        s(r, c) = fast_exp2(s(r, c) * scale_log2 - m_scaled);
        if constexpr (!kTreeReduce) sum += s(r, c);
      }
      if constexpr (kTreeReduce) sum = thread_row_reduce(s, r, sum_of);
      row_sum[r] = row_sum[r] * factor[r] + sum;
    }
  }

  // 1/sum per row (0 for rows that saw no key) and the natural-log LSE (+inf for those rows,
  // so that a backward pass computes exp(s − lse) = 0). A NaN score makes the sum NaN, and with
  // it 1/sum (so O) and the LSE, as in the reference.
  __device__ void finalize(float scale_log2, float (&inv_sum)[kRows], float (&lse)[kRows]) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const float sum = quad_sum(row_sum[r]);
      const bool empty = sum == 0.f;
      inv_sum[r] = empty ? 0.f : 1.f / sum;
      lse[r] = empty ? INFINITY : (row_max[r] * scale_log2 + log2f(sum)) * float(M_LN2);
    }
  }
};

template <class Tensor, int kRows>
__device__ void scale_rows(Tensor& t, const float (&factor)[kRows]) {
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int c = 0; c < size<1>(t); ++c) t(r, c) *= factor[r];
}

}  // namespace flashattn
