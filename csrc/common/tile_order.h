// The order in which CTAs take (tile, batch·head) work items. The hardware starts CTAs in
// linear block-index order, one as another finishes: when tiles cost different amounts (causal:
// a query block's keys grow with its index), a costly tile started last leaves the other SMs
// idle at the end (the tail). Heaviest-first over all heads (longest processing time first)
// bounds that tail by the lightest tile; heads are taken in groups whose working set fits in L2,
// so that tiles of a head still reuse its K/V (forward) or Q/dO (backward) from L2.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>

namespace flashattn {

struct TileOrder {
  int tiles;        // tiles per (batch, head)
  int heads_total;  // batch · heads
  int group;        // heads per group; 0: natural order (one head's tiles after another's)

  // Heads per group for `bytes_per_head` of data the tiles of one head share, within `budget`
  // bytes of L2; at least one head. Budgets measured on the H200 (60 MiB L2), causal bf16: the
  // forward runs 5–11% faster at d128/d256 with 48 MiB than with 12 (d64 ±2%); the sm90
  // backward best with 20 (a third of the L2) of 12, 20, 30, 50 and 100 (d128 within 0.3% of
  // 30), the sm80 backward with 20 over 30 (the two sizes measured).
  static int heads_per_group(int64_t bytes_per_head, int64_t budget) {
    const int64_t g = bytes_per_head > 0 ? budget / bytes_per_head : 1;
    return g < 1 ? 1 : (g > (1 << 20) ? (1 << 20) : int(g));
  }

  // Work item of CTA `linear`: `rank` 0 is the heaviest tile in the heavy-first order (the
  // caller maps rank to its tile index) and tile index itself in the natural order.
  __device__ void at(int linear, int& rank, int& bh) const {
    if (group == 0) {
      rank = linear % tiles;
      bh = linear / tiles;
      return;
    }
    const int span = group * tiles;
    const int g = linear / span;
    const int first = g * group;
    const int size = heads_total - first < group ? heads_total - first : group;
    const int r = linear - g * span;
    rank = r / size;
    bh = first + r % size;
  }
};

// The L2 size the tile order plans head groups with: the device's, or FLASHATTN_L2_MIB; settled
// once per device (the launchers are on the per-call path).
inline int64_t l2_bytes() {
  static std::atomic<int64_t> sizes[64] = {};  // by device ordinal; 0 = not settled yet
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) return int64_t(40) << 20;
  int64_t bytes = sizes[device].load(std::memory_order_relaxed);
  if (bytes == 0) {
    int l2 = 0;
    if (cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device) != cudaSuccess || l2 <= 0)
      l2 = 40 << 20;
    bytes = l2;
    if (const char* mib = std::getenv("FLASHATTN_L2_MIB"); mib && std::atoi(mib) > 0)
      bytes = int64_t(std::atoi(mib)) << 20;
    sizes[device].store(bytes, std::memory_order_relaxed);
  }
  return bytes;
}

}  // namespace flashattn
