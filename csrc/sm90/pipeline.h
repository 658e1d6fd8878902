// A TMA -> WGMMA shared-memory pipeline: per stage a "full" transaction barrier (the producer's
// TMA bytes land, or its threads' cp.async copies) and an "empty" barrier (every consumer warp is
// done reading).
#pragma once

#include <cutlass/arch/barrier.h>

namespace flashattn::sm90 {

template <int kStages>
struct PipelineState {
  int index = 0;
  uint32_t phase = 0;
  __device__ void advance() {
    if (++index == kStages) {
      index = 0;
      phase ^= 1;
    }
  }
};

template <int kStages>
struct TmaPipeline {
  using Full = cutlass::arch::ClusterTransactionBarrier;
  using Empty = cutlass::arch::ClusterBarrier;
  uint64_t full[kStages];
  uint64_t empty[kStages];

  // One thread initializes; the caller fences and syncs the block afterwards. A stage is full
  // when producer_arrivals producer threads have arrived: one with the bytes its TMA loads
  // bring, or each copying thread (producer_commit_copies).
  __device__ void init(uint32_t consumer_warps, uint32_t producer_arrivals = 1) {
    for (int s = 0; s < kStages; ++s) {
      Full::init(&full[s], producer_arrivals);
      Empty::init(&empty[s], consumer_warps);
    }
  }

  // Producer: wait until the stage is free, then announce the bytes its TMA loads will bring.
  // A fresh barrier completes "phase 1" at once, so the first pass does not block.
  __device__ void producer_acquire(PipelineState<kStages> st, uint32_t bytes) {
    Empty::wait(&empty[st.index], st.phase ^ 1);
    Full::arrive_and_expect_tx(&full[st.index], bytes);
  }
  // producer_acquire by a whole warp that walks the tiles together: each lane waits for the
  // stage, lane 0 arrives with its bytes, before lane 0 issues the loads.
  __device__ void producer_acquire_by_warp(PipelineState<kStages> st, uint32_t bytes) {
    Empty::wait(&empty[st.index], st.phase ^ 1);
    if (threadIdx.x % 32 == 0) Full::arrive_and_expect_tx(&full[st.index], bytes);
    __syncwarp();
  }
  __device__ uint64_t& full_barrier(PipelineState<kStages> st) { return full[st.index]; }
  // Producer threads that fill a stage by cp.async: each waits until the stage is free, issues
  // its copies, then arrives once they have all landed (this thread's cp.asyncs so far). The
  // consumers' WGMMAs read the stage after their wait on the full barrier with no proxy fence,
  // as CUTLASS's sm90 cp.async + GMMA mainloop and FlashAttention-3's paged gather do.
  __device__ void producer_wait(PipelineState<kStages> st) {
    Empty::wait(&empty[st.index], st.phase ^ 1);
  }
  __device__ void producer_commit_copies(PipelineState<kStages> st) {
    cutlass::arch::cpasync_barrier_arrive_noinc(&full[st.index]);
  }
  // Producer threads that wrote stage `stage` by plain shared-memory stores (an e4m3 cache
  // widened): each makes its stores visible to the async proxy, which the consumers' WGMMAs
  // read through, and arrives.
  __device__ void producer_commit_written(int stage) {
    cutlass::arch::fence_view_async_shared();
    Full::arrive(&full[stage]);
  }

  __device__ void consumer_wait(PipelineState<kStages> st) { Full::wait(&full[st.index], st.phase); }
  // Called by every consumer thread after its warpgroup_wait: the WGMMAs that read the stage
  // have completed for the whole warpgroup, so one lane per warp arrives (less barrier traffic
  // than one arrival per thread).
  __device__ void consumer_release(PipelineState<kStages> st) {
    __syncwarp();
    if (threadIdx.x % 32 == 0) Empty::arrive(&empty[st.index]);
  }
};

}  // namespace flashattn::sm90
