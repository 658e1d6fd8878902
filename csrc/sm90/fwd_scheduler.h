// The sm90 forward's tile scheduler: which tiles (or, in the tail launch, which pieces of tiles)
// each CTA computes, in order. The producer and the consumers walk the same sequence.
#pragma once

#include "fwd_tail.h"
#include "fwd_traits.h"
#include "grid_dependency.h"

namespace flashattn::sm90 {

// The schedule. A tile is one 128-row block of one (batch entry, head)'s rows (query rows, or
// with pack-GQA (FwdParams::group) (query row, query head) pairs of a KV head); a work unit is
// tiles_per_unit consecutive tiles, and CTA b of G takes units b, b + G, b + 2G, ... Tiles of one
// head are neighbours, so the CTAs running at one time share few heads' K/V in L2. Without a
// right bound on the keys (or with one query block per head) every tile costs the same: one tile
// per unit, query blocks in order. With one (causal), query block m sees about m + 1 key blocks:
// a unit is two tiles, the head's heaviest block left with its lightest (M−1 with 0, M−2 with 1,
// ...), so that every unit costs about M + 1 blocks and a static share is a balanced one.
// Packed batches: a tile's rows and keys are its entry's (Sequences::at, read on the device).
// The entries take consecutive query slots, one per 128-row block, longest first (ties, and
// beyond a chunk of kScheduleChunk entries, in the caller's order), and an entry's tiles are its
// slots of each head in turn, tile = heads·first_b + head·blocks_b + i: no entry pads to the
// longest one's blocks, and the heaviest work starts first. A pass before the forward
// (fwd_packed_schedule) writes each slot's entry and that entry's first slot. The pairs are
// made over the entry's own query blocks; a pair may straddle two heads or entries (a run's
// last tile, its middle block, beside the next run's heaviest), which costs about as much.
// With key splits (FwdParams::num_splits) a work unit is one split of one tile, and splits of a
// tile are neighbours.
struct WorkTile {
  int m_block;
  int head;              // the query head, or with pack-GQA the KV head
  Sequences::Entry seq;  // the tile's batch entry: where its rows lie, its lengths
  int rows;              // the entry's tile rows: seqlen_q, times the group with pack-GQA
  KeyRange keys;         // the call's, over the entry's lengths
  int n_min, n_max;      // key blocks visited, last to first
  int slot;              // a tail piece's or key split's workspace slot; -1: none
  __device__ int n_blocks() const { return n_max > n_min ? n_max - n_min : 0; }
};

// Query rows [q_begin, q_end) of tile rows [row_begin, row_end) (not empty), `group` tile rows
// per query row (pack-GQA; else 1): the rows whose keys the tile rows see.
__host__ __device__ inline void query_rows(int group, int row_begin, int row_end, int& q_begin,
                                           int& q_end) {
  q_begin = row_begin / group;
  q_end = (row_end - 1) / group + 1;
}

// Whether the tile has a row: not so a packed entry's tiles past its last row, which visit no
// key block (below) and store nothing.
template <class Traits>
__device__ bool has_rows(const WorkTile& t) {
  return t.m_block * Traits::kBlockM < t.rows;
}

// Work unit `unit`'s tile; kPartials: of the partial-results kernel, which may pack GQA and
// split keys (the whole-tile kernel's units are whole tiles of query rows).
template <class Traits, bool kPartials>
__device__ WorkTile decode_tile(const FwdParams<Traits>& p, int unit) {
  WorkTile t;
  const int splits = kPartials ? p.num_splits : 1, group = kPartials ? p.group : 1;
  const int tile = splits > 1 ? unit / splits : unit;
  const int heads = kPartials ? p.tile_heads() : p.heads_q;
  int i;  // position within the (entry, head)'s tiles
  if (p.slot_entries == nullptr) {
    i = tile % p.num_m_blocks;
    const int rest = tile / p.num_m_blocks;
    t.head = rest % heads;
    t.seq = p.seqs.at(rest / heads);
  } else {
    const PackedSlot slot = p.slot_entries[tile / heads];
    t.seq = slot.seq;
    const int blocks = (t.seq.seqlen_q * group + Traits::kBlockM - 1) / Traits::kBlockM;
    const int r = tile - heads * slot.first;  // in [0, heads·blocks) for a slot of the entry's
    if (r >= 0 && r < heads * blocks) {
      t.head = r / blocks;
      i = r % blocks;
    } else {
      t.head = 0;
      i = 0;
      t.seq.seqlen_q = 0;
    }
  }
  t.rows = t.seq.seqlen_q * group;
  if (p.tiles_per_unit == 1) {
    t.m_block = i;
  } else {  // pairs over the entry's own query blocks; a packed entry's past them are empty
    const int blocks = (t.rows + Traits::kBlockM - 1) / Traits::kBlockM;
    const int pair = i / 2, heavy = blocks - 1 - pair;
    t.m_block = i % 2 == 0 ? (pair <= heavy ? heavy : blocks) : (pair < heavy ? pair : blocks);
  }
  t.keys = t.seq.keys(p.keys);
  t.slot = -1;
  int q_begin, q_end;
  query_rows(group, t.m_block * Traits::kBlockM, (t.m_block + 1) * Traits::kBlockM, q_begin,
             q_end);
  t.keys.template blocks<Traits::kBlockN>(q_begin, q_end, t.n_min, t.n_max);
  if (!has_rows<Traits>(t)) t.n_max = t.n_min;
  if (splits > 1) {  // split `unit % splits` of the blocks, ⌈blocks / splits⌉ each
    const int blocks = t.n_blocks(), split = unit - tile * splits;
    const int per = (blocks + splits - 1) / splits;
    const int first = t.n_min;
    t.n_min = first + (split * per < blocks ? split * per : blocks);
    t.n_max = first + ((split + 1) * per < blocks ? (split + 1) * per : blocks);
    t.slot = unit;
  }
  return t;
}

// The tiles of this CTA's units, in order.
template <class Traits, bool kPartials>
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
    t = decode_tile<Traits, kPartials>(p, int(tile));
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
    // Key blocks [n_max − B, n_max), as every tail tile's.
    t = decode_tile<Traits, true>(p, s.first_tile + k);
    const int n_end = t.n_max;
    t.n_max = n_end - j0;
    t.n_min = n_end - j1;
    t.slot = FwdTail::slot(blockIdx.x, k);
    ++piece;
    return true;
  }
};

// The partial-results kernel's work (fwd_kernel<Traits, true>): the tail launch's pieces where
// the call has a tail split, else its tiles (pack-GQA) or their key splits.
template <class Traits>
struct PartialsWalk {
  TailPieceWalk<Traits> pieces;
  TileWalk<Traits, true> tiles;
  __device__ explicit PartialsWalk(const FwdParams<Traits>& p) : pieces{p}, tiles{p} {}
  __device__ bool next(WorkTile& t) {
    return pieces.p.tail.tiles > 0 ? pieces.next(t) : tiles.next(t);
  }
};

// Entries the packed schedule orders longest first at a time (one CTA's sort).
constexpr int kScheduleChunk = 1024;

// Packed calls: the schedule decode_tile reads, a PackedSlot for each of `slots` query slots.
// CTA c of a power of two threads n (at most kScheduleChunk) orders entries [c·n, (c + 1)·n) by
// blocks (more first, ties in order) with a bitonic network in shared memory; their slots follow
// those of every entry before the chunk (which the CTA counts for itself), and each slot finds its
// entry by a binary search over the chunk's sorted first slots. Malformed offsets give clamped
// entries whose blocks may add up past `slots`: the slots past it are not written (their tiles
// never run).
// `group`: tile rows per query row (pack-GQA; else 1).
template <int kBlockM>
__global__ void __launch_bounds__(kScheduleChunk)
    fwd_packed_schedule(Sequences seqs, int group, int batch, int slots, PackedSlot* table) {
  __shared__ uint64_t order[kScheduleChunk];     // (blocks descending, entry) keys
  __shared__ int64_t first[kScheduleChunk + 1];  // the sorted entries' first slots, and the end
  __shared__ unsigned long long before;          // slots of the entries before the chunk
  // The forward may start now: it waits for the table before its first tile (fwd_kernel).
  launch_dependent_grids();
  const int n = blockDim.x, t = threadIdx.x, base = blockIdx.x * n;
  auto blocks_of = [&](int b) { return (seqs.at(b).seqlen_q * group + kBlockM - 1) / kBlockM; };
  if (t == 0) before = 0;
  __syncthreads();
  unsigned long long mine_before = 0;
  for (int b = t; b < base; b += n) mine_before += blocks_of(b);
  atomicAdd(&before, mine_before);
  const int b = base + t;
  const int blocks = b < batch ? blocks_of(b) : 0;
  order[t] = (uint64_t(uint32_t(INT32_MAX - blocks)) << 32) | uint32_t(b);
  __syncthreads();
  for (int k = 2; k <= n; k *= 2) {
    for (int j = k / 2; j > 0; j /= 2) {
      const int partner = t ^ j;
      if (partner > t) {
        const uint64_t x = order[t], y = order[partner];
        if ((x > y) == ((t & k) == 0)) {
          order[t] = y;
          order[partner] = x;
        }
      }
      __syncthreads();
    }
  }
  // Inclusive sums of the sorted blocks in first[1..n] (Hillis-Steele), first[0] = 0.
  first[t + 1] = uint32_t(order[t]) < uint32_t(batch) ? INT32_MAX - int(order[t] >> 32) : 0;
  if (t == 0) first[0] = 0;
  __syncthreads();
  for (int step = 1; step < n; step *= 2) {
    const int64_t add = t + 1 > step ? first[t + 1 - step] : 0;
    __syncthreads();
    first[t + 1] += add;
    __syncthreads();
  }
  const int64_t done = int64_t(before), chunk_slots = first[n];
  for (int64_t s = t; s < chunk_slots && done + s < slots; s += n) {
    const int k = last_start_at_most(n, s, [&](int i) { return first[i]; });
    table[done + s] = {seqs.at(int(uint32_t(order[k]))), int(done + first[k])};
  }
  if (blockIdx.x == gridDim.x - 1)
    for (int64_t s = done + chunk_slots + t; s < slots; s += n) table[s] = PackedSlot{};
}

// kPartials: the partial-results kernel's work; else whole tiles.
template <class Traits, bool kPartials>
using FwdTileScheduler = conditional_t<kPartials, PartialsWalk<Traits>, TileWalk<Traits, false>>;

}  // namespace flashattn::sm90
