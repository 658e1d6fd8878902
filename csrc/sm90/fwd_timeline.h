// A debugging aid, off by default: a timeline of the forward's main loop. With
// FLASHATTN_FWD_TIMELINE defined to 1 before fwd_launch.h is included (e.g. at the top of
// fwd_fp8_launch.h), thread 0 of each consumer warpgroup of CTA 0 stamps the SM clock at eight
// points of its first 64 iterations of the intra-warpgroup-overlap loop (fwd_kernel.h:
// FwdTimeline::stamp; a tile's first key block is not stamped), and the 10th launch from that
// translation unit prints them (one line per iteration and warpgroup) from a second kernel, so
// that no printf call sits in the forward itself (it would serialize its WGMMAs). Stamping lane
// 0 of every warp instead (the recording thread tid % 32 == 0, a warp index in the array) shows
// the skew between a warpgroup's warps, at the price of a slower forward (d128 -13%).
// Points: 0 loop top, 1 K/V ready, 2 GEMM turn taken, 3 GEMMs issued, 4 S ready, 5 softmax
// done, 6 P·V done, 7 P converted. It slows the FP8 d128 forward by about 6% (H200).
#pragma once

#include <cstdio>

#ifndef FLASHATTN_FWD_TIMELINE
#define FLASHATTN_FWD_TIMELINE 0
#endif

namespace flashattn::sm90 {
// Internal linkage: units built with the timeline and units without it define these differently.
namespace {

#if FLASHATTN_FWD_TIMELINE
__device__ unsigned g_fwd_timeline[2][64][8];

__global__ void print_fwd_timeline() {
  for (int i = 0; i < 64; ++i)
    for (int w = 0; w < 2; ++w) {
      const unsigned* t = g_fwd_timeline[w][i];
      printf("timeline iteration %d warpgroup %d: %u %u %u %u %u %u %u %u\n", i, w, t[0], t[1],
             t[2], t[3], t[4], t[5], t[6], t[7]);
    }
}

// Called after each launch: prints the 10th launch's timeline (after warm-up).
inline void after_fwd_launch(cudaStream_t stream) {
  static int launches = 0;
  if (++launches == 10) print_fwd_timeline<<<1, 1, 0, stream>>>();
}

// One consumer thread's stamps: `stamp(point)` records the SM clock for the current iteration
// where this thread records (thread 0 of a consumer warpgroup of CTA 0), `next()` moves on.
struct FwdTimeline {
  int wg, iteration = 0;
  bool recording;
  __device__ FwdTimeline(int warpgroup, int thread_in_wg)
      : wg(warpgroup), recording(blockIdx.x == 0 && thread_in_wg == 0) {}
  __device__ void stamp(int point) const {
    unsigned now;
    asm volatile("mov.u32 %0, %%clock;" : "=r"(now)::"memory");
    if (recording && iteration < 64) g_fwd_timeline[wg][iteration][point] = now;
  }
  __device__ void next() { ++iteration; }
};
#else
inline void after_fwd_launch(cudaStream_t) {}

struct FwdTimeline {
  __device__ FwdTimeline(int, int) {}
  __device__ void stamp(int) const {}
  __device__ void next() {}
};
#endif

}  // namespace
}  // namespace flashattn::sm90
