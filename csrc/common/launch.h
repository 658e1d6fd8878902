// Host helpers every kernel family's launcher shares: the key range of a call and the one-time
// opt-in to large dynamic shared memory.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "../flash_api.h"
#include "block_range.h"

namespace flashattn {

// Windows wider than both sequences are unbounded; causal is a window with right = 0.
inline KeyRange key_range(const flashattn_params_t& p) {
  KeyRange keys{p.seqlen_q, p.seqlen_k, p.window_left, p.window_right};
  const int64_t span = int64_t(p.seqlen_q) + p.seqlen_k;
  if (keys.window_left >= span) keys.window_left = -1;
  if (keys.window_right >= span) keys.window_right = -1;
  if (p.causal) keys.window_right = 0;
  return keys;
}

// Opts kKernel into more than 48 KiB of dynamic shared memory once per device: the attribute
// sticks to the function, and setting it costs a driver round trip that every call would pay.
// Each kernel keeps its own record (this instantiation's), so no two can share one.
template <auto kKernel>
cudaError_t allow_dynamic_smem(int smem_bytes) {
  static std::atomic<uint64_t> devices_done{0};  // bit d: device ordinal d is set up
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  const uint64_t bit = device < 64 ? uint64_t(1) << device : 0;
  if (bit != 0 && (devices_done.load(std::memory_order_acquire) & bit)) return cudaSuccess;
  cudaError_t e =
      cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
  if (e == cudaSuccess) devices_done.fetch_or(bit, std::memory_order_release);
  return e;
}

}  // namespace flashattn
