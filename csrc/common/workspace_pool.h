// Stream-ordered scratch memory for workspaces the kernels take for themselves (the sm90
// forward's split-KV pieces), from a memory pool of this library's, one per device, that keeps up
// to kWorkspacePoolKeep bytes of freed memory for later calls. The device's default pool returns
// freed memory to the system whenever the stream synchronizes (release threshold 0), and mapping
// it again is paid by the next call: a decoded token synchronized after every call ran much
// slower with its workspace from there than from here (docs/PERFORMANCE.md, split-KV).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>
#include <unordered_map>

namespace flashattn {

// What the pool keeps across synchronizations: the largest workspace (35 MB, sm90 d256 with 131
// tail tiles on 132 SMs) for a few streams at once. Above it, memory goes back to the system.
constexpr uint64_t kWorkspacePoolKeep = uint64_t(128) << 20;

// The pools by device; nullptr where one could not be made (the default pool serves there). Never
// destroyed: calls may still come from other threads while the process exits.
struct WorkspacePools {
  std::mutex mutex;
  std::unordered_map<int, cudaMemPool_t> by_device;
};
inline WorkspacePools& workspace_pools() {
  static WorkspacePools* pools = new WorkspacePools;
  return *pools;
}

inline cudaMemPool_t make_workspace_pool(int device) {
  cudaMemPoolProps props{};
  props.allocType = cudaMemAllocationTypePinned;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = device;
  cudaMemPool_t pool = nullptr;
  if (cudaMemPoolCreate(&pool, &props) != cudaSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  uint64_t keep = kWorkspacePoolKeep;
  if (cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep) != cudaSuccess) {
    (void)cudaGetLastError();
    (void)cudaMemPoolDestroy(pool);
    return nullptr;
  }
  return pool;
}

// The device's pool, made on first use; nullptr where it cannot be made.
inline cudaMemPool_t workspace_pool(int device) {
  WorkspacePools& pools = workspace_pools();
  std::lock_guard<std::mutex> lock(pools.mutex);
  auto found = pools.by_device.find(device);
  if (found == pools.by_device.end())
    found = pools.by_device.emplace(device, make_workspace_pool(device)).first;
  return found->second;
}

// `bytes` in the order of `stream`; give them back with cudaFreeAsync on the same stream. While
// the stream is captured into a graph the allocation is the graph's whatever the pool, so the
// default pool serves (no pool is made inside a capture, where making one may be refused).
inline cudaError_t workspace_alloc(void** ptr, size_t bytes, cudaStream_t stream) {
  cudaStreamCaptureStatus capture;
  int device = 0;
  cudaError_t e = cudaStreamIsCapturing(stream, &capture);
  const bool eager = e == cudaSuccess && capture == cudaStreamCaptureStatusNone;
  if (eager) e = cudaGetDevice(&device);
  if (e != cudaSuccess) return e;
  const cudaMemPool_t pool = eager ? workspace_pool(device) : nullptr;
  return pool ? cudaMallocFromPoolAsync(ptr, bytes, pool, stream)
              : cudaMallocAsync(ptr, bytes, stream);
}

}  // namespace flashattn
