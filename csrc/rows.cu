// Gradients summed over calls in f32 (a ring's dQ over the key shards, dK and dV over the query
// shards they meet): each call's 16-bit rows added into f32 rows, and the sums rounded once at
// the end. One warp per (batch, row, head) row, lanes over its elements: the rows are few and
// short beside the attention calls they follow.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/half_convert.h"
#include "common/status.h"
#include "flash_api.h"
#include "rows.h"

namespace flashattn {

namespace {

constexpr int kWarpsPerBlock = 8;

// Element `c` of row `r` ((batch, row, head) row-major) of `t`.
__device__ __forceinline__ int64_t at(const flashattn_tensor_t& t, const flashattn_rows_t& p,
                                      int64_t r, int c) {
  const int64_t h = r % p.heads, i = r / p.heads % p.seqlen, b = r / p.heads / p.seqlen;
  return b * t.batch_stride + i * t.row_stride + h * t.head_stride + c;
}

// acc += x (kAdd), or x = acc rounded to the nearest T.
template <class T, bool kAdd>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) rows_kernel(const flashattn_rows_t p) {
  const int64_t rows = int64_t(p.batch) * p.seqlen * p.heads;
  const int64_t warps = int64_t(gridDim.x) * kWarpsPerBlock;
  const int lane = threadIdx.x % 32;
  float* acc = static_cast<float*>(p.acc.ptr);
  for (int64_t r = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32; r < rows; r += warps) {
    for (int c = lane; c < p.head_dim; c += 32) {
      const int64_t a = at(p.acc, p, r, c), e = at(p.x, p, r, c);
      if constexpr (kAdd)
        acc[a] += to_float(static_cast<const T*>(p.x.ptr)[e]);
      else
        static_cast<T*>(p.x.ptr)[e] = from_float<T>(acc[a]);
    }
  }
}

template <class T, bool kAdd>
flashattn_result_t launch(const flashattn_rows_t& p, cudaStream_t stream) {
  const int64_t rows = int64_t(p.batch) * p.seqlen * p.heads;
  const int64_t blocks = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  const int grid = int(blocks > 4096 ? 4096 : blocks);
  rows_kernel<T, kAdd><<<grid, kWarpsPerBlock * 32, 0, stream>>>(p);
  return check_launch();
}

template <bool kAdd>
flashattn_result_t run(const flashattn_rows_t& p, cudaStream_t stream) {
  switch (p.dtype) {
    case FLASHATTN_BF16: return launch<__nv_bfloat16, kAdd>(p, stream);
    case FLASHATTN_F16: return launch<__half, kAdd>(p, stream);
    default: return status(FLASHATTN_INVALID_ARGUMENT);
  }
}

}  // namespace

flashattn_result_t run_rows_add(const flashattn_rows_t& p, cudaStream_t stream) {
  return run<true>(p, stream);
}

flashattn_result_t run_rows_round(const flashattn_rows_t& p, cudaStream_t stream) {
  return run<false>(p, stream);
}

}  // namespace flashattn
