// The sm90 forward's tail split: the last partial wave of equal tiles, cut by key blocks.
//
// With no window at all, or with one query block per head under any mask, every tile visits the
// same B key blocks, and T tiles on G CTAs take ⌈T/G⌉ tile times for T/G tiles' work (16k
// tokens at d128: 2048 tiles on 132 SMs, 16 for 15.5).
// The first ⌊T/G⌋·G tiles run whole, as always; the key blocks of the other T mod G (the tail)
// are dealt to S ≤ G CTAs of a second launch in contiguous shares, so that a tile may be
// computed in pieces by consecutive CTAs. Tail iteration x is key block n_max − 1 − (x mod B)
// of tail tile ⌊x/B⌋; CTA c takes iterations [⌊cU/S⌋, ⌊(c+1)U/S⌋) of U. Each piece leaves its
// rows' O (normalized) and LSE in f32 in a workspace slot, and a third launch merges a tile's
// pieces. A share is never longer than a tile (S ≥ tail tiles), so a CTA has at most two
// pieces. CTA c's piece of tail tile k takes slot c + k: shares are contiguous and in order, so
// no two pieces meet there, and S + tiles − 1 slots hold them all. The pieces (after
// whole waves) and the merge are programmatic dependents (griddepcontrol), so that the pieces
// may take each SM as the whole waves leave it, and the merge be resident before the pieces end.
#pragma once

#include <cstdint>
#include <climits>

namespace flashattn::sm90 {

// A slot: O, (128 rows, head_dim) row-major, then the rows' LSE.
constexpr int kTailRows = 128;
constexpr int64_t tail_slot_floats(int head_dim) { return int64_t(kTailRows) * (head_dim + 1); }

struct FwdTail {
  int first_tile = 0;  // tiles [first_tile, num_tiles) are the tail
  int tiles = 0;       // 0: no split
  int blocks = 0;      // B, key blocks per tile
  int ctas = 0;        // S
  int iters = 0;       // U = tiles · B < 2³¹
  int share_q = 0, share_r = 0;  // U = qS + r
  // The partial-results kernel's f32 slots: the tail pieces', or with key splits (no tail
  // then) the splits' (fwd_launch.h).
  float* partials = nullptr;

  // ⌊cU/S⌋ = cq + ⌊cr/S⌋ in 32 bits (cr < S²): a 64-bit division is a call in the kernel.
  __host__ __device__ int share_begin(int c) const { return c * share_q + c * share_r / ctas; }
  // The CTA whose share holds iteration x: the largest c with share_begin(c) <= x.
  __host__ __device__ int owner(int x) const {
    return int(((int64_t(x) + 1) * ctas - 1) / iters);
  }
  // The slot of CTA c's piece of tail tile k, and how many there are.
  __host__ __device__ static int slot(int c, int k) { return c + k; }
  __host__ __device__ int slots() const { return ctas + tiles - 1; }
};

// The split's model, in key blocks of the busiest CTA, fitted to ncu's kernel durations
// (docs/PERFORMANCE.md, split-KV): a partial last wave runs its tiles in about 4/5 of the time a
// full one takes (inferred from the time of the whole waves with and without it); serialized
// (ncu), the pieces' launch and the merge take time beyond their key blocks', which the
// programmatic launches may partly hide (not measured apart); charged as kTailPieceCost key
// blocks, that cost predicts the split's A/Bs. Below the predicted gain kTailMinGainPercent the
// tail runs whole.
constexpr int kTailPieceCost = 10;
constexpr int kTailMinGainPercent = 2;

// The tail split for `tiles` tiles of `blocks` key blocks each on `ctas` CTAs, or tiles = 0
// when it does not pay (unless `always`): the tail costs ⌈U/S⌉ + kTailPieceCost split, 4B/5
// whole, after ⌊T/G⌋·B.
inline FwdTail plan_tail(int tiles, int blocks, int ctas, bool always) {
  FwdTail s;
  if (ctas <= 1 || blocks <= 1) return s;
  const int64_t waves = tiles / ctas, rest = tiles % ctas;
  if (rest == 0) return s;
  const int64_t iters = rest * blocks;
  const int64_t sharers = iters < ctas ? iters : ctas;  // no share empty
  const int64_t split5 = 5 * ((iters + sharers - 1) / sharers + kTailPieceCost);
  const int64_t whole5 = 4 * blocks, total5 = 5 * waves * blocks + whole5;  // all times 5
  if ((!always && (whole5 - split5) * 100 < kTailMinGainPercent * total5) || iters > INT32_MAX)
    return s;
  s.first_tile = int(waves * ctas);
  s.tiles = int(rest);
  s.blocks = blocks;
  s.ctas = int(sharers);  // >= rest: no share longer than a tile
  s.iters = int(iters);
  s.share_q = s.iters / s.ctas;
  s.share_r = s.iters % s.ctas;
  return s;
}

// Key splits (FwdParams::num_splits), planned where the caller asks for them (a KV cache's
// calls: FLASHATTN_SM90_PLAN_KEY_SPLITS) and the tail split does not apply: each tile's key
// blocks are cut into equal ranges run as units
// of their own, and a last pass merges them (fwd_merge.h). For `tiles` tiles of at most
// `blocks` key blocks on `ctas` SMs: none where the tiles fill most of a wave (four fifths) or
// have one block; else the fewest splits whose waves are filled at least kSplitFill percent as
// well as the best count's, counts up to kMaxSplits and the blocks (and whose ranges are shorter
// than the next fewer splits' ranges) considered.
constexpr int kMaxSplits = 128;
constexpr int kSplitFill = 85;
// The most f32 partial results key splits may take (a call asking for more gets fewer splits).
constexpr int64_t kMaxSplitBytes = int64_t(1) << 30;

inline int plan_splits(int64_t tiles, int blocks, int ctas) {
  if (tiles <= 0 || ctas <= 0 || tiles * 5 >= int64_t(ctas) * 4 || blocks <= 1) return 1;
  const int most = blocks < kMaxSplits ? blocks : kMaxSplits;
  // A count's fill, in percent: its units over whole waves of ctas.
  auto fill = [&](int s) {
    const int64_t units = tiles * s, waves = (units + ctas - 1) / ctas;
    return units * 100 / (waves * ctas);
  };
  auto shortens = [&](int s) {  // ranges shorter than s − 1 splits' ranges
    return s == 1 || (blocks + s - 1) / s < (blocks + s - 2) / (s - 1);
  };
  int64_t best = 0;
  for (int s = 1; s <= most; ++s)
    if (shortens(s) && fill(s) > best) best = fill(s);
  for (int s = 1; s <= most; ++s)
    if (shortens(s) && fill(s) * 100 >= best * kSplitFill) return s;
  return 1;
}

}  // namespace flashattn::sm90
