// TileOrder::at must give every CTA of a grid its own (tile, batch·head) work item: a bijection
// of [0, tiles · heads_total) onto [0, tiles) × [0, heads_total), for every group size the
// launchers can make, in the heavy-first and the natural order. Built by tests/c_abi/main.rs with
// the system's C++ compiler (at() is host-callable there); exits non-zero on the first failure.
#include <cstdint>
#include <cstdio>
#include <vector>

#include "common/tile_order.h"

using flashattn::TileOrder;

static bool bijective(const TileOrder& o) {
  const int64_t n = int64_t(o.tiles) * o.heads_total;
  std::vector<bool> seen(size_t(n), false);
  for (int64_t linear = 0; linear < n; ++linear) {
    int rank = -1, bh = -1;
    o.at(int(linear), rank, bh);
    if (rank < 0 || rank >= o.tiles || bh < 0 || bh >= o.heads_total) {
      std::printf("tiles %d heads %d group %d: CTA %lld -> (%d, %d) out of range\n", o.tiles,
                  o.heads_total, o.group, (long long)linear, rank, bh);
      return false;
    }
    const size_t item = size_t(bh) * size_t(o.tiles) + size_t(rank);
    if (seen[item]) {
      std::printf("tiles %d heads %d group %d: (%d, %d) twice\n", o.tiles, o.heads_total,
                  o.group, rank, bh);
      return false;
    }
    seen[item] = true;
  }
  return true;
}

int main() {
  int cases = 0;
  for (int tiles : {1, 2048, 65536, 104858, 1 << 24})
    for (int heads : {1, 7, 64}) {
      if (int64_t(tiles) * heads > (int64_t(1) << 26)) continue;  // keep the run short
      // Bytes per head and L2 budgets that give groups of 1, some, all, and more than all heads
      // (clamped), and the natural order.
      for (int64_t budget : {int64_t(0), int64_t(3), int64_t(20) << 20, int64_t(1) << 62})
        for (bool heavy_first : {true, false}) {
          const TileOrder o = TileOrder::make(tiles, heads, heavy_first, 1 << 20, budget);
          if (heavy_first && (o.group < 1 || o.group > heads)) {
            std::printf("make gave group %d for %d heads\n", o.group, heads);
            return 1;
          }
          if (!bijective(o)) return 1;
          ++cases;
        }
    }
  // The review's case: a causal backward of one head over 13.4M keys (104858 key blocks), whose
  // unclamped group of 40960 heads made the 32-bit span wrap. Clamped to the one head there is,
  // and, built by hand with the old group, still mapped in range by the 64-bit span.
  const TileOrder review = TileOrder::make(104858, 1, true, 1536, int64_t(20) << 20);
  if (review.group != 1 || !bijective(review)) return 1;
  if (!bijective(TileOrder{104858, 1, 40960})) return 1;
  std::printf("tile order: %d orders bijective\n", cases + 2);
  return 0;
}
