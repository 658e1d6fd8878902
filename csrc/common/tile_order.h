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
  int group;        // heads per group, 1 .. heads_total; 0: natural order (one head's tiles after
                    // another's)

  // The order of `tiles` tiles for each of `heads_total` heads: heavy-first when `heavy_first`,
  // with as many heads per group as fit `bytes_per_head` of shared data within `budget` bytes of
  // L2 (at least one head, at most all of them). The launchers' budgets were chosen by
  // measurement (benchmarks/README.md).
  static TileOrder make(int tiles, int heads_total, bool heavy_first, int64_t bytes_per_head,
                        int64_t budget) {
    if (!heavy_first) return {tiles, heads_total, 0};
    int64_t g = bytes_per_head > 0 ? budget / bytes_per_head : 1;
    if (g > heads_total) g = heads_total;
    if (g < 1) g = 1;
    return {tiles, heads_total, int(g)};
  }

  // Work item of CTA `linear` (< tiles · heads_total): `rank` 0 is the heaviest tile in the
  // heavy-first order (the caller maps rank to its tile index) and tile index itself in the
  // natural order. A group's span, group · tiles, can pass 2^31 where the grid does not (one
  // group of many heads over long sequences), so it is 64-bit.
  __device__ void at(int linear, int& rank, int& bh) const {
    if (group == 0) {
      rank = linear % tiles;
      bh = linear / tiles;
      return;
    }
    const int64_t span = int64_t(group) * tiles;
    const int g = int(linear / span);
    const int first = g * group;
    const int size = heads_total - first < group ? heads_total - first : group;
    const int r = int(linear - g * span);
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
