// The KV cache's append step: new keys and values copied into each sequence's cache rows after
// its cached ones (or quantized into an e4m3 cache by their descales), the keys (and Q)
// optionally rotated by rotary embedding on the way. One warp per (tensor, sequence, row, head)
// row: a decoding step appends one row per sequence, too few bytes for wide accesses to matter.
// The host definition it must agree with, bit for bit but for NaN payloads: src/kvcache.rs
// (append, append_fp8, Rotary).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>

#include "common/e4m3_convert.h"
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

// How a row's elements reach their destination: as they are (a cache of their type, or Q's
// rotated copy).
template <class T>
struct StoreAsIs {
  __device__ __forceinline__ T operator()(T x) const { return x; }
};

// Into an e4m3 cache: x · (1 / descale), as src/kvcache.rs append_fp8 stores it.
template <class T>
struct StoreE4m3 {
  float inv_scale;
  __device__ __forceinline__ __nv_fp8_e4m3 operator()(T x) const {
    __nv_fp8_e4m3 y;
    y.__x = to_e4m3(to_float(x), inv_scale);
    return y;
  }
};

// The store into a cache of `Cache` for one (sequence, head) row: e4m3 ones by the reciprocal of
// its descale (null: 1), NaN where that descale is not a positive normal number (the host
// refuses such descales; the device cannot, so it makes them visible).
template <class T, class Cache>
struct CacheStore {
  using type = StoreAsIs<T>;
  __device__ static type of(const float*, int64_t) { return {}; }
};
template <class T>
struct CacheStore<T, __nv_fp8_e4m3> {
  using type = StoreE4m3<T>;
  __device__ static type of(const float* descales, int64_t at) {
    if (descales == nullptr) return {1.f};
    const float d = descales[at];
    return {d >= FLT_MIN && d <= FLT_MAX ? __fdiv_rn(1.f, d) : __int_as_float(0x7fffffff)};
  }
};

// One head's row of `d` elements from `src` to `dst`, each through `store`, its first
// rotary_dim rotated to `position` when `rotate`: each pair (x0, x1) becomes (x0·cos − x1·sin,
// x0·sin + x1·cos), every product and sum rounded on its own (no fused multiply-add) and the
// result to T, as the host computes it.
template <class T, class Out, class Store>
__device__ void copy_row(const flashattn_kvcache_append_t& p, const T* src, Out* dst, int d,
                         bool rotate, int position, int lane, Store store) {
  const int rotated = rotate ? p.rotary_dim : 0;
  if (rotate) {
    const int half = p.rotary_dim / 2;
    const int64_t at = int64_t(clamp(position, 0, p.rotary_positions - 1)) * half;
    for (int j = lane; j < half; j += 32) {
      const int a = p.rotary_interleaved ? 2 * j : j, b = p.rotary_interleaved ? 2 * j + 1 : j + half;
      const float x0 = to_float(src[a]), x1 = to_float(src[b]);
      const float c = p.rotary_cos[at + j], s = p.rotary_sin[at + j];
      dst[a] = store(from_float<T>(__fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s))));
      dst[b] = store(from_float<T>(__fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c))));
    }
  }
  for (int j = rotated + lane; j < d; j += 32) dst[j] = store(src[j]);
}

// Rows in order: the new keys, the new values, then Q's, each (sequence, row, head) row-major;
// a grid-stride loop over warps. The cache holds `Cache`: T, or e4m3.
template <class T, class Cache>
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
               p.head_dim, true, position, lane, StoreAsIs<T>{});
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
    const auto store = CacheStore<T, Cache>::of(key ? p.k_descale : p.v_descale,
                                                int64_t(b) * p.heads_kv + h);
    copy_row(p, static_cast<const T*>(in.ptr) + src, static_cast<Cache*>(out.ptr) + dst,
             key ? p.head_dim : p.head_dim_v, key && p.rotary_cos != nullptr, row, lane, store);
  }
  // The keys a forward then attends to.
  if (p.seqlens_out != nullptr && blockIdx.x == 0)
    for (int b = threadIdx.x; b < p.batch; b += blockDim.x) {
      const int ends = cached(p, b, capacity) + p.seqlen_new;
      p.seqlens_out[b] = ends < capacity ? ends : capacity;
    }
}

template <class T, class Cache>
flashattn_result_t launch(const flashattn_kvcache_append_t& p, cudaStream_t stream) {
  const int64_t rows = 2 * int64_t(p.batch) * p.seqlen_new * p.heads_kv +
                       (p.q.ptr != nullptr ? int64_t(p.batch) * p.seqlen_q * p.heads_q : 0);
  const int64_t blocks = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  // At least one block (seqlens_out with no row to write), at most a few waves' worth.
  const int grid = int(blocks < 1 ? 1 : blocks > 4096 ? 4096 : blocks);
  kvcache_append_kernel<T, Cache><<<grid, kWarpsPerBlock * 32, 0, stream>>>(p);
  return check_launch();
}

}  // namespace

flashattn_result_t run_kvcache_append(const flashattn_kvcache_append_t& p, cudaStream_t stream) {
  switch (p.dtype) {
    case FLASHATTN_BF16:
      return p.cache_e4m3 ? launch<__nv_bfloat16, __nv_fp8_e4m3>(p, stream)
                          : launch<__nv_bfloat16, __nv_bfloat16>(p, stream);
    case FLASHATTN_F16:
      return p.cache_e4m3 ? launch<__half, __nv_fp8_e4m3>(p, stream)
                          : launch<__half, __half>(p, stream);
    default: return status(FLASHATTN_INVALID_ARGUMENT);
  }
}

}  // namespace flashattn
