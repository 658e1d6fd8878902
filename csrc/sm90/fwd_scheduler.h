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
// Packed batches: a tile's rows and keys are its entry's (Sequences::at, read on the device).
// Each entry b takes span_b consecutive query slots (packed_block numbering, sequences.h: its
// blocks and at most one slot past them), and its tiles are the span_b slots of each head in
// turn, tile = heads·first_b + head·span_b + slot, so that no entry pads to the longest one's
// blocks (all the empty tiles of a call are at most one per entry and head). The pairs are made
// over the entry's own query blocks; a pair may straddle two heads or entries, and costs about
// the same then (the light block of one run beside the heavy one of the next).
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
  int i;  // position within the (entry, head)'s tiles
  if (p.slot_entries == nullptr) {
    i = tile % p.num_m_blocks;
    const int rest = tile / p.num_m_blocks;
    t.head = rest % p.heads_q;
    t.seq = p.seqs.at(rest / p.heads_q);
  } else {
    // Malformed offsets may give a span that does not hold the tile: then it is empty.
    const int b = p.slot_entries[tile / p.heads_q];
    const int first = int(packed_block(p.seqs.q_start(b), b, Traits::kBlockM));
    const int next = b + 1 < p.batch
                         ? int(packed_block(p.seqs.q_start(b + 1), b + 1, Traits::kBlockM))
                         : p.num_slots;
    const int span = next - first, r = tile - p.heads_q * first;
    t.seq = p.seqs.at(b);
    if (span > 0 && r >= 0 && r < p.heads_q * span) {
      t.head = r / span;
      i = r % span;
    } else {  // malformed offsets: a span that does not hold the tile; it is left empty
      t.head = 0;
      i = 0;
      t.seq.seqlen_q = 0;
    }
  }
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

// Packed calls: the entry whose query slots (blocks of kBlockM rows, packed_block numbering) hold
// slot i, for each of `slots`: computed on the stream before the forward, so that each tile reads
// one int where it would search the offsets.
template <int kBlockM>
__global__ void __launch_bounds__(256)
    fwd_slot_entries(Sequences seqs, int batch, int slots, int* entries) {
  const int i = blockIdx.x * 256 + threadIdx.x;
  if (i < slots)
    entries[i] = last_start_at_most(
        batch, i, [&](int b) { return packed_block(seqs.q_start(b), b, kBlockM); });
}

// kTailPieces: the tail launch's pieces (fwd_tail.h); else whole tiles.
template <class Traits, bool kTailPieces>
using FwdTileScheduler = conditional_t<kTailPieces, TailPieceWalk<Traits>, TileWalk<Traits>>;

}  // namespace flashattn::sm90
