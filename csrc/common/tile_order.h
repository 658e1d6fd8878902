// The order in which CTAs take (tile, batch·head) work items. The hardware starts CTAs in
// linear block-index order, one as another finishes: when tiles cost different amounts (causal:
// a query block's keys grow with its index), a costly tile started last leaves the other SMs
// idle at the end (the tail). Heaviest-first over all heads (longest processing time first)
// bounds that tail by the lightest tile; heads are taken in groups whose working set fits in L2,
// so that tiles of a head still reuse its K/V (forward) or Q/dO (backward) from L2.
#pragma once

#include <cstdint>

namespace flashattn {

struct TileOrder {
  int tiles;        // tiles per (batch, head)
  int heads_total;  // batch · heads
  int group;        // heads per group; 0: natural order (one head's tiles after another's)

  // Heads per group for `bytes_per_head` of data the tiles of one head share: a quarter of an
  // H100's L2 (the rest holds what other SMs stream), at least one head.
  static int heads_per_group(int64_t bytes_per_head) {
    constexpr int64_t kBudget = int64_t(12) << 20;
    const int64_t g = bytes_per_head > 0 ? kBudget / bytes_per_head : 1;
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

}  // namespace flashattn
