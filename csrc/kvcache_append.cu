// The KV cache's append step: new keys and values copied into each sequence's cache rows after
// its cached ones, the keys (and Q) optionally rotated by rotary embedding on the way. One warp
// per (tensor, sequence, row, head) row: a decoding step appends one row per sequence, too few
// bytes for wide accesses to matter.
// The host definition it must agree with, bit for bit but for NaN payloads: src/kvcache.rs
// (append, Rotary).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/half_convert.h"
#include "common/page_table.h"
#include "common/status.h"
#include "flash_api.h"
#include "kvcache_append.h"

namespace flashattn {

namespace {

constexpr int kWarpsPerBlock = 4;


__device__ __forceinline__ int clamp(int x, int lo, int hi) { return x < lo ? lo : x > hi ? hi : x; }

// A sequence's cached keys, clamped into the cache's capacity.
__device__ __forceinline__ int cached(const flashattn_kvcache_append_t& p, int b, int capacity) {
  return clamp(p.cache_seqlens[b], 0, capacity);
}

// One head's row of `d` elements from `src` to `dst`, its first rotary_dim rotated to `position`
// when `rotate`: each pair (x0, x1) becomes (x0·cos − x1·sin, x0·sin + x1·cos), every product
// and sum rounded on its own (no fused multiply-add), as the host computes it.
template <class T>
__device__ void copy_row(const flashattn_kvcache_append_t& p, const T* src, T* dst, int d,
                         bool rotate, int position, int lane) {
  const int rotated = rotate ? p.rotary_dim : 0;
  if (rotate) {
    const int half = p.rotary_dim / 2;
    const int64_t at = int64_t(clamp(position, 0, p.rotary_positions - 1)) * half;
    for (int j = lane; j < half; j += 32) {
      const int a = p.rotary_interleaved ? 2 * j : j, b = p.rotary_interleaved ? 2 * j + 1 : j + half;
      const float x0 = to_float(src[a]), x1 = to_float(src[b]);
      const float c = p.rotary_cos[at + j], s = p.rotary_sin[at + j];
      dst[a] = from_float<T>(__fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s)));
      dst[b] = from_float<T>(__fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c)));
    }
  }
  for (int j = rotated + lane; j < d; j += 32) dst[j] = src[j];
}

// Rows in order: the new keys, the new values, then Q's, each (sequence, row, head) row-major;
// a grid-stride loop over warps.
template <class T>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    kvcache_append_kernel(const flashattn_kvcache_append_t p) {
  const bool paged = p.page_table != nullptr;
  const int capacity = paged ? p.max_pages * p.cache_rows : p.cache_rows;
  const int64_t kv_rows = int64_t(p.batch) * p.seqlen_new * p.heads_kv;
  const int64_t q_rows = p.q.ptr != nullptr ? int64_t(p.batch) * p.seqlen_q * p.heads_q : 0;
  const int64_t rows = 2 * kv_rows + q_rows;
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t(gridDim.x) * kWarpsPerBlock;
  for (int64_t w = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32; w < rows; w += warps) {
    if (w >= 2 * kv_rows) {  // a query row, rotated
      const int64_t r = w - 2 * kv_rows;
      const int h = int(r % p.heads_q), i = int(r / p.heads_q % p.seqlen_q);
      const int b = int(r / p.heads_q / p.seqlen_q);
      const int position = cached(p, b, capacity) + (p.q_same_position ? 0 : i);
      const int64_t src = b * p.q.batch_stride + i * p.q.row_stride + h * p.q.head_stride;
      const int64_t dst =
          b * p.q_out.batch_stride + i * p.q_out.row_stride + h * p.q_out.head_stride;
      copy_row(p, static_cast<const T*>(p.q.ptr) + src, static_cast<T*>(p.q_out.ptr) + dst,
               p.head_dim, true, position, lane);
      continue;
    }
    const bool key = w < kv_rows;
    const int64_t r = key ? w : w - kv_rows;
    const int h = int(r % p.heads_kv), i = int(r / p.heads_kv % p.seqlen_new);
    const int b = int(r / p.heads_kv / p.seqlen_new);
    const int row = cached(p, b, capacity) + i;
    if (row >= capacity) continue;  // past the cache: not written
    const int entry = paged ? table_page(p.page_table + int64_t(b) * p.max_pages,
                                         row / p.cache_rows, p.max_pages, p.entries)
                            : b;
    const int cache_row = paged ? row % p.cache_rows : row;
    const flashattn_tensor_t& in = key ? p.k_new : p.v_new;
    const flashattn_tensor_t& out = key ? p.k_cache : p.v_cache;
    const int64_t src = b * in.batch_stride + i * in.row_stride + h * in.head_stride;
    const int64_t dst = entry * out.batch_stride + cache_row * out.row_stride + h * out.head_stride;
    copy_row(p, static_cast<const T*>(in.ptr) + src, static_cast<T*>(out.ptr) + dst,
             key ? p.head_dim : p.head_dim_v, key && p.rotary_cos != nullptr, row, lane);
  }
  // The keys a forward then attends to.
  if (p.seqlens_out != nullptr && blockIdx.x == 0)
    for (int b = threadIdx.x; b < p.batch; b += blockDim.x) {
      const int ends = cached(p, b, capacity) + p.seqlen_new;
      p.seqlens_out[b] = ends < capacity ? ends : capacity;
    }
}

template <class T>
flashattn_result_t launch(const flashattn_kvcache_append_t& p, cudaStream_t stream) {
  const int64_t rows = 2 * int64_t(p.batch) * p.seqlen_new * p.heads_kv +
                       (p.q.ptr != nullptr ? int64_t(p.batch) * p.seqlen_q * p.heads_q : 0);
  const int64_t blocks = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  // At least one block (seqlens_out with no row to write), at most a few waves' worth.
  const int grid = int(blocks < 1 ? 1 : blocks > 4096 ? 4096 : blocks);
  kvcache_append_kernel<T><<<grid, kWarpsPerBlock * 32, 0, stream>>>(p);
  return check_launch();
}

}  // namespace

flashattn_result_t run_kvcache_append(const flashattn_kvcache_append_t& p, cudaStream_t stream) {
  switch (p.dtype) {
    case FLASHATTN_BF16: return launch<__nv_bfloat16>(p, stream);
    case FLASHATTN_F16: return launch<__half>(p, stream);
    default: return status(FLASHATTN_INVALID_ARGUMENT);
  }
}

}  // namespace flashattn
