// The sm90 forward's tile scheduler: which tiles (or, in the tail launch, which pieces of tiles)
// each CTA computes, in order. The producer and the consumers walk the same sequence.
#pragma once

#include "fwd_tail.h"
#include "fwd_traits.h"

namespace flashattn::sm90 {

// The schedule. A tile is one 128-row query block of one (batch entry, head); a work unit is
// tiles_per_unit consecutive tiles, and CTA b of G takes units b, b + G, b + 2G, ... Tiles of one
// head are neighbours, so the CTAs running at one time share few heads' K/V in L2. Without a
// right bound on the keys (or with one query block per head) every tile costs the same: one tile
// per unit, query blocks in order. With one (causal), query block m sees about m + 1 key blocks:
// a unit is two tiles, the head's heaviest block left with its lightest (M−1 with 0, M−2 with 1,
// ...), so that every unit costs about M + 1 blocks and a static share is a balanced one.
// Packed batches: M covers the longest sequence, a tile's rows and keys are its entry's
// (Sequences::at, read on the device), the pairs are made over the entry's own query blocks, and
// the tiles past them are empty.
struct WorkTile {
  int m_block, head;
  Sequences::Entry seq;  // the tile's batch entry: where its rows lie, its lengths
  KeyRange keys;         // the call's, over the entry's lengths
  int n_min, n_max;      // key blocks visited, last to first
  int slot;              // a tail piece's workspace slot
  __device__ int n_blocks() const { return n_max > n_min ? n_max - n_min : 0; }
};

// Whether the tile has a query row: not so a packed entry's tiles past its last row, which visit
// no key block (below) and store nothing.
template <class Traits>
__device__ bool has_rows(const WorkTile& t) {
  return t.m_block * Traits::kBlockM < t.seq.seqlen_q;
}

template <class Traits>
__device__ WorkTile decode_tile(const FwdParams<Traits>& p, int tile) {
  WorkTile t;
  const int i = tile % p.num_m_blocks;  // position within the head's tiles
  const int rest = tile / p.num_m_blocks;
  t.head = rest % p.heads_q;
  t.seq = p.seqs.at(rest / p.heads_q);
  if (p.tiles_per_unit == 1) {
    t.m_block = i;
  } else {  // pairs over the entry's own query blocks; a packed entry's past them are empty
    const int blocks = (t.seq.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM;
    const int pair = i / 2, heavy = blocks - 1 - pair;
    t.m_block = i % 2 == 0 ? (pair <= heavy ? heavy : blocks) : (pair < heavy ? pair : blocks);
  }
  t.keys = t.seq.keys(p.keys);
  t.slot = -1;
  t.keys.template blocks<Traits::kBlockN>(t.m_block * Traits::kBlockM,
                                          (t.m_block + 1) * Traits::kBlockM, t.n_min, t.n_max);
  if (!has_rows<Traits>(t)) t.n_max = t.n_min;
  return t;
}

// The tiles of this CTA's units, in order.
template <class Traits>
struct TileWalk {
  const FwdParams<Traits>& p;
  int64_t unit = blockIdx.x;
  int step = 0;  // tile within the unit
  __device__ bool next(WorkTile& t) {
    const int64_t tile = unit * p.tiles_per_unit + step;
    if (tile >= p.num_tiles) return false;  // later units start later still
    if (++step == p.tiles_per_unit) {
      step = 0;
      unit += gridDim.x;
    }
    t = decode_tile(p, int(tile));
    return true;
  }
};

// The tail launch's pieces of this CTA's share, in order (fwd_tail.h): at most two.
template <class Traits>
struct TailPieceWalk {
  const FwdParams<Traits>& p;
  int piece = 0;
  __device__ bool next(WorkTile& t) {
    const FwdTail& s = p.tail;
    const int B = s.blocks;
    const int begin = s.share_begin(blockIdx.x), end = s.share_begin(blockIdx.x + 1);
    const int x = piece == 0 ? begin : (begin / B + piece) * B;
    if (x >= end) return false;
    const int k = x / B;
    const int j0 = x - k * B;
    const int j1 = end - x < B - j0 ? j0 + (end - x) : B;
    t = decode_tile(p, s.first_tile + k);  // key blocks [n_max − B, n_max), as every tail tile
    const int n_end = t.n_max;
    t.n_max = n_end - j0;
    t.n_min = n_end - j1;
    t.slot = FwdTail::slot(blockIdx.x, k);
    ++piece;
    return true;
  }
};

// kTailPieces: the tail launch's pieces (fwd_tail.h); else whole tiles.
template <class Traits, bool kTailPieces>
using FwdTileScheduler = conditional_t<kTailPieces, TailPieceWalk<Traits>, TileWalk<Traits>>;

}  // namespace flashattn::sm90
