// The merges of partial results (in f32 workspace slots, fwd_tail.h's layout) into O and the
// LSE: the tail split's third launch (each tail tile's pieces) and the key splits' last pass
// (each tile's splits).
//
// One thread per row and 4 columns of a tile, reading the parts' slots row-major:
// LSE = log Σ exp(LSE_p), O = Σ exp(LSE_p − LSE) · O_p, over the parts' maximum LSE. A
// part with LSE +inf saw no key of the row: its O is 0, or NaN where V holds a NaN or inf at a
// key the row does not see (0·NaN), which is added, as the whole-tile kernel's O would carry it.
// A row that sees no key at all gets O = 0 and LSE = +inf. A part with a NaN score has LSE and
// O NaN, which pass on to the row's O and LSE.
#pragma once

#include <cutlass/array.h>

#include "fwd_epilogue.h"
#include "fwd_scheduler.h"
#include "fwd_tail.h"
#include "grid_dependency.h"

namespace flashattn::sm90 {

constexpr int kMergeThreads = 256;

// One row's 4 columns over `count` parts in consecutive slots from `first` (tail_slot_floats
// of kHeadDim each): row `row`, columns 4·chunk on. Two passes, the LSE maximum and then the
// weighted sum, each over loads that do not wait for one another (unrolled): one running
// maximum would chain every part's load behind the last one's arithmetic, and the merge of many
// key splits would wait out one memory latency per split.
template <int kHeadDim>
struct RowMerge {
  float max_lse = -INFINITY, sum = 0.f;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);

  __device__ RowMerge(const float* first, int count, int row, int chunk) {
    constexpr int64_t kSlot = tail_slot_floats(kHeadDim);
    const float* lse_at = first + kTailRows * kHeadDim + row;
#pragma unroll 8
    for (int p = 0; p < count; ++p) {
      const float lse = lse_at[p * kSlot];
      if (lse != INFINITY) max_lse = fmaxf(max_lse, lse);  // NaN: it passes on below
    }
#pragma unroll 8
    for (int p = 0; p < count; ++p) {
      const float lse = lse_at[p * kSlot];
      const float4 o = *reinterpret_cast<const float4*>(first + p * kSlot + row * kHeadDim +
                                                        chunk * 4);
      const float w = lse == INFINITY ? 1.f : expf(lse - max_lse);  // +inf: O is 0 (or NaN)
      acc.x += w * o.x, acc.y += w * o.y, acc.z += w * o.z, acc.w += w * o.w;
      if (lse != INFINITY) sum += w;
    }
  }
  // The merged columns, in Out, and the row's LSE.
  template <class Out>
  __device__ cutlass::Array<Out, 4> o() const {
    const float inv = sum == 0.f ? 0.f : 1.f / sum;
    cutlass::Array<Out, 4> out;
    out[0] = Out(acc.x * inv), out[1] = Out(acc.y * inv), out[2] = Out(acc.z * inv);
    out[3] = Out(acc.w * inv);
    return out;
  }
  __device__ float lse() const { return sum == 0.f ? INFINITY : max_lse + logf(sum); }
};

template <class Out>
struct TailMergeParams {
  FwdTail tail;
  Out* o;
  int64_t o_batch_stride, o_row_stride, o_head_stride;
  float* lse;
  int heads_q, seqlen_q, num_m_blocks;
};

template <int kHeadDim, class Out>
__global__ void __launch_bounds__(kMergeThreads) fwd_tail_merge(const TailMergeParams<Out> p) {
  wait_for_prior_grids();  // the pieces' slots
  constexpr int kChunks = kHeadDim / 4;
  const int64_t i = int64_t(blockIdx.x) * kMergeThreads + threadIdx.x;
  const int chunk = int(i % kChunks);
  const int row = int(i / kChunks % kTailRows);
  const int k = int(i / (kChunks * kTailRows));
  const FwdTail& s = p.tail;
  if (k >= s.tiles) return;
  const int tile = s.first_tile + k;  // tiles_per_unit 1: query blocks in order
  const int m_block = tile % p.num_m_blocks, bh = tile / p.num_m_blocks;
  const int q_row = m_block * kTailRows + row;
  if (q_row >= p.seqlen_q) return;

  // Pieces of consecutive CTAs: consecutive slots (FwdTail::slot).
  const int c0 = s.owner(k * s.blocks), c1 = s.owner((k + 1) * s.blocks - 1);
  const RowMerge<kHeadDim> m(s.partials + s.slot(c0, k) * tail_slot_floats(kHeadDim),
                             c1 - c0 + 1, row, chunk);
  Out* o_row = p.o + (bh / p.heads_q) * p.o_batch_stride + (bh % p.heads_q) * p.o_head_stride +
               q_row * p.o_row_stride;
  *reinterpret_cast<cutlass::Array<Out, 4>*>(o_row + chunk * 4) = m.template o<Out>();
  if (chunk == 0) p.lse[int64_t(bh) * p.seqlen_q + q_row] = m.lse();
}

// The key splits' merge: tile k's splits are the num_splits slots from k·num_splits on
// (decode_tile), its rows go where the whole tile's would (packed_out_row with pack-GQA).
template <class Traits, class Out>
__global__ void __launch_bounds__(kMergeThreads)
    fwd_split_merge(const __grid_constant__ FwdParams<Traits> p) {
  wait_for_prior_grids();  // the splits' slots
  constexpr int kHeadDim = Traits::kHeadDimV;
  constexpr int kChunks = kHeadDim / 4;
  const int64_t i = int64_t(blockIdx.x) * kMergeThreads + threadIdx.x;
  const int chunk = int(i % kChunks);
  const int row = int(i / kChunks % kTailRows);
  const int64_t k = i / (kChunks * kTailRows);
  if (k * p.num_splits >= p.num_tiles) return;
  const WorkTile t = decode_tile<Traits, true>(p, int(k * p.num_splits));
  const int tile_row = t.m_block * Traits::kBlockM + row;
  if (tile_row >= t.rows) return;

  const RowMerge<kHeadDim> m(p.tail.partials + k * p.num_splits * tail_slot_floats(kHeadDim),
                             p.num_splits, row, chunk);
  Out* o = static_cast<Out*>(p.o);
  float* lse;
  if (p.group > 1) {
    const OutRow out = packed_out_row(p, t, tile_row);
    o += out.o;
    lse = p.lse + out.lse;
  } else {
    o += t.seq.batch * p.o_batch_stride + int64_t(t.seq.q_start + tile_row) * p.o_row_stride +
         int64_t(t.head) * p.o_head_stride;
    lse = p.lse + p.seqs.lse_offset(t.seq, t.head, p.heads_q, p.seqlen_q) + tile_row;
  }
  *reinterpret_cast<cutlass::Array<Out, 4>*>(o + chunk * 4) = m.template o<Out>();
  if (chunk == 0) *lse = m.lse();
}

}  // namespace flashattn::sm90
