// Partial attention results merged by their log-sum-exp (flashattn_combine_t): one thread per
// element of O, each reading its row's LSE of every part (the same few values for a row's
// threads, from L1) and its element of every part's O. The host definition it must agree with
// to within f32 rounding: src/combine.rs (combine_into, which merges in f64).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "combine.h"
#include "common/half_convert.h"
#include "common/status.h"
#include "flash_api.h"

namespace flashattn {

namespace {

constexpr int kThreads = 256;


template <class T>
__global__ void __launch_bounds__(kThreads) combine_kernel(const __grid_constant__ flashattn_combine_t p) {
  const int64_t d = p.head_dim_v;
  const int64_t e = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (e >= int64_t(p.batch) * p.seqlen_q * p.heads * d) return;
  const int64_t c = e % d, r = e / d;  // r: (b, i, h), O's row order
  const int64_t h = r % p.heads, i = r / p.heads % p.seqlen_q, b = r / p.heads / p.seqlen_q;
  const int64_t at = p.lse_packed ? (h * p.batch + b) * p.seqlen_q + i
                                  : (b * p.heads + h) * p.seqlen_q + i;
  auto element = [&](const flashattn_tensor_t& t) {
    return b * t.batch_stride + i * t.row_stride + h * t.head_stride + c;
  };
  // Parts that saw no key of the row (+inf) weigh nothing; a NaN makes the row NaN.
  float max = -INFINITY;
  bool nan = false;
  for (int k = 0; k < p.parts; ++k) {
    const float l = p.part_lse[k][at];
    if (l != l)
      nan = true;
    else if (l != INFINITY)
      max = fmaxf(max, l);
  }
  T* o = static_cast<T*>(p.o.ptr) + element(p.o);
  const bool first = c == 0;
  if (nan) {
    *o = from_float<T>(NAN);
    if (first) p.lse[at] = NAN;
    return;
  }
  if (max == -INFINITY) {  // no part saw a key of the row
    *o = from_float<T>(0.f);
    if (first) p.lse[at] = INFINITY;
    return;
  }
  float sum = 0.f, acc = 0.f;
  for (int k = 0; k < p.parts; ++k) {
    const float l = p.part_lse[k][at];
    const float w = l == INFINITY ? 0.f : expf(l - max);
    acc += w * to_float(static_cast<const T*>(p.part_o[k].ptr)[element(p.part_o[k])]);
    sum += w;
  }
  *o = from_float<T>(acc / sum);
  if (first) p.lse[at] = max + logf(sum);
}

}  // namespace

flashattn_result_t run_combine(const flashattn_combine_t& p, cudaStream_t stream) {
  const int64_t elements = int64_t(p.batch) * p.seqlen_q * p.heads * p.head_dim_v;
  const unsigned blocks = unsigned((elements + kThreads - 1) / kThreads);
  if (p.dtype == FLASHATTN_BF16)
    combine_kernel<__nv_bfloat16><<<blocks, kThreads, 0, stream>>>(p);
  else
    combine_kernel<__half><<<blocks, kThreads, 0, stream>>>(p);
  return check_launch();
}

}  // namespace flashattn
