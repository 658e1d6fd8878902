// The sm90 forward's epilogue: O·inv_sum and the LSE of a tile, straight from the consumer
// warpgroup's registers; rows past the entry's seqlen_q are skipped (in packed batches they are
// the next sequence's). O leaves the registers by 16-byte stores
// (the host checks O's alignment); staging it through shared memory instead was slower
// (docs/PERFORMANCE.md). In the tail launch a piece's O and LSE go, in f32, to its workspace
// slot (fwd_tail.h). O's accumulator column n holds head dim n, in the FP8 kernels
// fp8_v_row_head_dim(n) (V's rows come in that order), so that there each thread already holds
// whole 16-byte chunks; O is written in bf16 or fp16. The partial-results kernel writes key
// splits' O and LSE to their slots as the tail pieces', and pack-GQA tiles' rows to their
// (query row, query head) (packed_out_row, which the splits' merge shares).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>

#include "../common/online_softmax.h"
#include "fp8_v_rows.h"
#include "fwd_scheduler.h"
#include "fwd_tail.h"
#include "fwd_traits.h"
#include "softmax.h"

namespace flashattn::sm90 {

// Converts a float fragment to Element, same layout.
template <class Element, class Frag>
__device__ auto convert_fragment(Frag const& src) {
  using From = typename Frag::value_type;
  constexpr int N = decltype(size(src))::value;
  cutlass::NumericArrayConverter<Element, From, N> convert;
  auto frag = convert(*reinterpret_cast<cutlass::Array<From, N> const*>(src.data()));
  auto out = make_fragment_like<Element>(src.layout());
  *reinterpret_cast<cutlass::Array<Element, N>*>(out.data()) = frag;
  return out;
}

// Where a pack-GQA tile's row `row` goes (FwdParams::group > 1): its O row's offset in elements
// and its LSE's index.
struct OutRow {
  int64_t o, lse;
};
template <class Traits>
__device__ FLASHATTN_INLINE OutRow packed_out_row(const FwdParams<Traits>& p, const WorkTile& t,
                                                  int row) {
  const int q_row = row / p.group, head = t.head * p.group + row % p.group;
  return {t.seq.batch * p.o_batch_stride + int64_t(t.seq.q_start + q_row) * p.o_row_stride +
              int64_t(head) * p.o_head_stride,
          p.seqs.lse_offset(t.seq, head, p.heads_q, p.seqlen_q) + q_row};
}

// A piece's or split's O (normalized) and LSE, in f32, to workspace slot `slot` (fwd_tail.h):
// its first `rows` rows, the entry's (a decode step's pack-GQA tile holds 8 of 128).
template <int kHeadDimV, int kRows, class RowCol, class Coords, class HeadDimOf>
__device__ FLASHATTN_INLINE void store_slot(float* slot, int first_row, int rows,
                                            const RowCol& rowcol_O, const Coords& rowcol_cO,
                                            const float (&lse)[kRows], HeadDimOf head_dim_of) {
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int row = first_row + get<0>(rowcol_cO(r, 0));
    if (row >= rows) continue;  // past the entry's: no merge reads it
    if (get<1>(rowcol_cO(0, 0)) == 0) slot[kTailRows * kHeadDimV + row] = lse[r];
#pragma unroll
    for (int c = 0; c < size<1>(rowcol_O); c += 2)
      *reinterpret_cast<float2*>(slot + row * kHeadDimV + head_dim_of(get<1>(rowcol_cO(r, c)))) =
          make_float2(rowcol_O(r, c), rowcol_O(r, c + 1));
  }
}

template <class Traits, bool kPartials>
struct FwdEpilogue {
  using Element = typename Traits::Element;
  static constexpr int kRowsPerWG = Traits::kRowsPerWG;

  const FwdParams<Traits>& params;
  const int wg;   // consumer warpgroup
  const int tid;  // thread within the warpgroup

  __device__ static int head_dim_of(int n) {
    if constexpr (Traits::kFp8) {
      return fp8_v_row_head_dim(n);
    } else {
      return n;
    }
  }

  template <class FragO, int kRows>
  __device__ FLASHATTN_INLINE void store(const WorkTile& t, FragO& tOrO,
                                         const float (&inv_sum)[kRows],
                                         const float (&lse)[kRows]) {
    Tensor rowcol_O = make_tensor(tOrO.data(), acc_rowcol(tOrO.layout()));
    Tensor cO = typename Traits::MmaPV{}.get_thread_slice(tid).partition_C(
        make_identity_tensor(typename Traits::TileO{}));
    Tensor rowcol_cO = make_tensor(cO.data(), acc_rowcol(cO.layout()));
    const int row0 = t.m_block * Traits::kBlockM + wg * kRowsPerWG;  // within the entry
    const int rows = t.rows;
    scale_rows(rowcol_O, inv_sum);
    // Pack-GQA (the 16-bit partial-results kernel's): rows to their (query row, query head).
    bool packed = false;
    if constexpr (kPartials) {
      if (t.slot >= 0) {  // a tail piece or a key split: O and LSE in f32 to its slot
        store_slot<Traits::kHeadDimV>(
            params.tail.partials + t.slot * tail_slot_floats(Traits::kHeadDimV), wg * kRowsPerWG,
            rows - t.m_block * Traits::kBlockM, rowcol_O, rowcol_cO, lse,
            [](int n) { return head_dim_of(n); });
        return;
      }
      if constexpr (!Traits::kFp8) packed = params.group > 1;
    }
    // LSE: the thread holding column 0 of a row's quad writes it.
    if (get<1>(rowcol_cO(0, 0)) == 0) {
      float* lse_rows =
          params.lse + params.seqs.lse_offset(t.seq, t.head, params.heads_q, params.seqlen_q);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int row = row0 + get<0>(rowcol_cO(r, 0));
        if (row >= rows) continue;
        if (packed) {
          params.lse[packed_out_row(params, t, row).lse] = lse[r];
        } else {
          lse_rows[row] = lse[r];
        }
      }
    }
    auto store = [&](auto* o) FLASHATTN_INLINE {
      using Out = remove_pointer_t<decltype(o)>;
      Tensor rO = convert_fragment<Out>(tOrO);
      Tensor rowcol_rO = make_tensor(rO.data(), acc_rowcol(rO.layout()));
      Out* const o_base = o;
      o += t.seq.batch * params.o_batch_stride + t.head * params.o_head_stride +
           t.seq.q_start * params.o_row_stride;
      auto o_row_of = [&](int row) FLASHATTN_INLINE {
        return packed ? o_base + packed_out_row(params, t, row).o : o + row * params.o_row_stride;
      };
      // Word j of row r: this thread's columns 2j, 2j + 1 of it, i.e. accumulator columns
      // 8j + 2q, 8j + 2q + 1 for quad thread q.
      auto word = [&](int r, int j) FLASHATTN_INLINE {
        cutlass::Array<Out, 2> pair;
        pair[0] = rowcol_rO(r, 2 * j);
        pair[1] = rowcol_rO(r, 2 * j + 1);
        return reinterpret_cast<const uint32_t&>(pair);
      };
      constexpr int kWords = decltype(size<1>(rowcol_rO))::value / 2;
      static_assert(kWords % 4 == 0, "whole 16-byte chunks");
      const int q = tid % 4;
      if constexpr (Traits::kFp8) {
        // Words 4g .. 4g + 3 of quad thread q are head dims 32g + 8q on (fp8_v_row_head_dim).
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          const int row = row0 + get<0>(rowcol_cO(r, 0));
          if (row >= rows) continue;
          Out* o_row = o_row_of(row);
#pragma unroll
          for (int g = 0; g < kWords / 4; ++g)
            *reinterpret_cast<uint4*>(o_row + 32 * g + 8 * q) = make_uint4(
                word(r, 4 * g), word(r, 4 * g + 1), word(r, 4 * g + 2), word(r, 4 * g + 3));
        }
      } else {
        // 16-bit: a 4x4 transpose of words within the quad, over groups 4g .. 4g + 3, leaves
        // thread q all 8 columns of group 4g + q: one 16-byte store. Every lane shuffles (a
        // warp's quads hold different rows); rows in range store.
        const bool hi = q & 2, odd = q & 1;
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          const int row = row0 + get<0>(rowcol_cO(r, 0));
          Out* o_row = o_row_of(row);
#pragma unroll
          for (int g = 0; g < kWords / 4; ++g) {
            const uint32_t a0 = word(r, 4 * g), a1 = word(r, 4 * g + 1), a2 = word(r, 4 * g + 2),
                           a3 = word(r, 4 * g + 3);
            // Threads 2 apart: the low one keeps words 0, 1 and takes the high one's 0, 1.
            const uint32_t x0 = __shfl_xor_sync(0xffffffff, hi ? a0 : a2, 2);
            const uint32_t x1 = __shfl_xor_sync(0xffffffff, hi ? a1 : a3, 2);
            const uint32_t b0 = hi ? x0 : a0, b1 = hi ? x1 : a1, b2 = hi ? a2 : x0,
                           b3 = hi ? a3 : x1;
            // Neighbours: the even one keeps words 0, 2, the odd one 1, 3.
            const uint32_t y0 = __shfl_xor_sync(0xffffffff, odd ? b0 : b1, 1);
            const uint32_t y1 = __shfl_xor_sync(0xffffffff, odd ? b2 : b3, 1);
            const uint4 chunk = odd ? make_uint4(y0, b1, y1, b3) : make_uint4(b0, y0, b2, y1);
            if (row < rows) *reinterpret_cast<uint4*>(o_row + 8 * (4 * g + q)) = chunk;
          }
        }
      }
    };
    if constexpr (Traits::kFp8) {
      if (params.o_bf16) {
        store(static_cast<cutlass::bfloat16_t*>(params.o));
      } else {
        store(static_cast<cutlass::half_t*>(params.o));
      }
    } else {
      store(static_cast<Element*>(params.o));
    }
  }
};

}  // namespace flashattn::sm90
