// The FlashAttention-2-style forward kernel (sm_80 and later: mma.sync, ldmatrix, cp.async).
//
// One CTA computes a kBlockM-row tile of O for one (batch, head); its warps split the rows (16
// per MMA atom), so every row's softmax stays inside one warp (a quad of lanes) and no
// cross-warp reduction is needed. Key blocks are walked last to first, so that only the first
// block visited needs the sequence-end mask. Q, K and V come by cp.async into 128-byte swizzled
// shared memory (rows past the sequence zero-filled), loaded kStages − 1 key blocks ahead (or,
// with one stage, V under Q·Kᵀ and the next K under the softmax and P·V). Fragments come from
// shared memory by ldmatrix (transposed for V; Q's once per tile where Traits::kQInRegs).
// Online softmax with exp2 and one division at the end; LSE straight from registers, O through
// shared memory. V and O may have another head dim than Q and K (kHeadDimV: V's tiles, P·V's N,
// O's). K and V may come from a paged e4m3 cache, widened to Q's type in shared memory.
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/copy_atom.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cutlass/float8.h>
#include <cutlass/numeric_conversion.h>
#include <cutlass/numeric_types.h>

#include <type_traits>

#include "../common/block_range.h"
#include "../common/e4m3_convert.h"
#include "../common/online_softmax.h"
#include "../common/page_table.h"
#include "../common/sequences.h"
#include "../common/tile_order.h"

namespace flashattn::sm80 {

using namespace cute;

// kHeadDim: of Q and K; kHeadDimV: of V and O.
template <class Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kWarps_, int kStages_ = 1,
          bool kQInRegs_ = false, int kHeadDimV_ = kHeadDim_>
struct FwdTraits {
  using Element = Element_;
  // K/V buffers in shared memory (see fwd_kernel's main loop for the two schedules).
  static constexpr int kStages = kStages_;
  // Q's fragments loaded from shared memory once, not for every key block.
  static constexpr bool kQInRegs = kQInRegs_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kHeadDimV = kHeadDimV_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kWarps = kWarps_;
  static constexpr int kThreads = kWarps * 32;
  static_assert(kHeadDim % 32 == 0 && kHeadDimV % 32 == 0 && kBlockM % (16 * kWarps) == 0 &&
                kBlockN % 16 == 0);

  using MmaOp = std::conditional_t<std::is_same_v<Element, cutlass::half_t>,
                                   SM80_16x8x16_F32F16F16F32_TN, SM80_16x8x16_F32BF16BF16F32_TN>;
  // Warps stacked along M; each repeats down the tile (kBlockM / (16·kWarps) atoms per warp).
  using TiledMma = TiledMMA<MMA_Atom<MmaOp>, Layout<Shape<Int<kWarps>, _1, _1>>,
                            Tile<Int<16 * kWarps>, _16, _16>>;

  // Rows of 64 elements (128 bytes) in 8-row swizzled atoms, or of 32 (64 bytes) where a head
  // dim is no multiple of 64: ldmatrix reads without bank conflicts, cp.async writes 16 bytes
  // per thread. One atom for both head dims, so that one copy layout serves every tile.
  static constexpr int kAtomCols = kHeadDim % 64 == 0 && kHeadDimV % 64 == 0 ? 64 : 32;
  using SmemAtom =
      decltype(composition(Swizzle<kAtomCols == 64 ? 3 : 2, 3, 3>{},
                           Layout<Shape<_8, Int<kAtomCols>>, Stride<Int<kAtomCols>, _1>>{}));
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  // O on its way out, in the Q buffer (fwd_kernel's epilogue).
  using SmemLayoutO = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDimV>>{}));
  using SmemLayoutK = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  using SmemLayoutV = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockN>, Int<kHeadDimV>>{}));
  // Vᵀ as the (head_dim_v, kBlockN) B operand of P·V: the same bytes, read with ldmatrix.trans.
  using SmemLayoutVt = decltype(composition(
      SmemLayoutV{}, make_layout(Shape<Int<kHeadDimV>, Int<kBlockN>>{}, GenRowMajor{})));

  // Global -> shared: a thread per 8 elements (16 bytes) of an atom's row.
  static constexpr int kThreadsPerRow = kAtomCols / 8;
  using GmemCopy = decltype(make_tiled_copy(
      Copy_Atom<SM80_CP_ASYNC_CACHEGLOBAL<cute::uint128_t>, Element>{},
      Layout<Shape<Int<kThreads / kThreadsPerRow>, Int<kThreadsPerRow>>,
             Stride<Int<kThreadsPerRow>, _1>>{},
      Layout<Shape<_1, _8>>{}));
  using SmemCopyAtom = Copy_Atom<SM75_U32x4_LDSM_N, Element>;
  using SmemCopyAtomTransposed = Copy_Atom<SM75_U16x8_LDSM_T, Element>;

  static constexpr int kStageElemsK = cosize_v<SmemLayoutK>;
  static constexpr int kStageElemsV = cosize_v<SmemLayoutV>;
  struct SharedStorage {
    ArrayEngine<Element, cute::max(cosize_v<SmemLayoutQ>, cosize_v<SmemLayoutO>)> q;  // and O
    ArrayEngine<Element, kStageElemsK * kStages> k;
    ArrayEngine<Element, kStageElemsV * kStages> v;
  };
};

struct FwdParams {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  float* lse;  // (batch, heads_q, seqlen_q); packed: (heads_q, total_q), or by sequence
  int64_t q_batch_stride, q_row_stride, q_head_stride;
  int64_t k_batch_stride, k_row_stride, k_head_stride;
  int64_t v_batch_stride, v_row_stride, v_head_stride;
  int64_t o_batch_stride, o_row_stride, o_head_stride;
  int heads_q, heads_kv;
  Sequences seqs;
  int num_m_blocks;  // of the longest entry
  TileOrder order;  // heavy-first (rank 0 = last query block) when a right bound makes costs differ
  KeyRange keys;    // lengths set per entry
  float scale_log2;   // scale·log2(e), or softcap·log2(e) when softcap is on
  float softcap_pre;  // scale/softcap when softcap is on
  bool softcap;
  // A paged KV cache (fwd_kernel<Traits, true>): K and V are num_pages pages (their batch axis)
  // of page_size rows (any number); entry b's key j lies in row j % page_size of page
  // page_table[b · page_table_stride + j / page_size], of which its row has page_columns.
  const int32_t* page_table;
  int64_t page_table_stride;
  int page_size, page_columns, num_pages;
  // An e4m3 cache's descales (fwd_kernel<Traits, true, float_e4m3_t>): (sequences, heads_kv),
  // by sequence, or null (1).
  const float* k_descale;
  const float* v_descale;
};

// mma.sync accumulator ((2 cols, 2 rows), MMA_M, MMA_N) -> (rows, cols) = ((2, MMA_M), (2, MMA_N)).
template <class Layout>
__device__ constexpr auto acc_rowcol(Layout l) {
  return make_layout(make_layout(get<0, 1>(l), get<1>(l)), make_layout(get<0, 0>(l), get<2>(l)));
}

// The accumulator of S as the A operand of P·V (m16n8k16): two neighbouring n8 atoms of S are
// one k16 slice of P. ((2,2), MMA_M, MMA_N) -> ((2,2,2), MMA_M, MMA_N/2), storage unchanged.
template <class Layout>
__device__ constexpr auto acc_as_operand_a(Layout l) {
  auto split = logical_divide(l, Shape<Underscore, Underscore, _2>{});
  return make_layout(make_layout(get<0, 0>(split), get<0, 1>(split), get<2, 0>(split)),
                     get<1>(split), get<2, 1>(split));
}

// Global -> shared of a (rows, head_dim) tile, 16 bytes per cp.async, rows at and past `rows_left`
// zero-filled by the copy itself (source size 0: nothing is read), so that masked keys multiply
// zeros, never stale bytes. One instruction per chunk: a predicated copy with separate zero stores
// issues about 8 (the stores and the ordering no-ops ptxas puts between them and the cp.async).
// `shift(row)`: how many elements from `src`'s row `row` that row's source lies (a paged cache's
// rows lie in their pages); none by default.
template <class Src, class Dst, class Coord, class Shift>
__device__ void copy_rows(Src const& src, Dst& dst, Coord const& coord, int rows_left,
                          Shift const& shift) {
  static_assert(decltype(size<0>(dst))::value * sizeof(typename Dst::value_type) == 16);
#pragma unroll
  for (int m = 0; m < size<1>(dst); ++m) {
    const int row = get<0>(coord(0, m, 0));
    const int64_t row_shift = shift(row);
#pragma unroll
    for (int k = 0; k < size<2>(dst); ++k) {
      SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>::copy(
          *reinterpret_cast<const cute::uint128_t*>(raw_pointer_cast(&src(0, m, k)) + row_shift),
          *reinterpret_cast<cute::uint128_t*>(raw_pointer_cast(&dst(0, m, k))), row < rows_left);
    }
  }
}
template <class Src, class Dst, class Coord>
__device__ void copy_rows(Src const& src, Dst& dst, Coord const& coord, int rows_left) {
  copy_rows(src, dst, coord, rows_left, [](int) { return int64_t(0); });
}

// copy_rows from an e4m3 source: each chunk's 8 e4m3 elements (8 bytes) land in the upper half
// of the 16 bytes they widen to (widen_rows), rows at and past `rows_left` zero-filled.
template <class Src, class Dst, class Coord, class Shift>
__device__ void copy_rows_narrow(Src const& src, Dst& dst, Coord const& coord, int rows_left,
                                 Shift const& shift) {
  static_assert(sizeof(typename Src::value_type) == 1 &&
                decltype(size<0>(dst))::value * sizeof(typename Dst::value_type) == 16);
#pragma unroll
  for (int m = 0; m < size<1>(dst); ++m) {
    const int row = get<0>(coord(0, m, 0));
    const int64_t row_shift = shift(row);
#pragma unroll
    for (int k = 0; k < size<2>(dst); ++k) {
      SM80_CP_ASYNC_CACHEALWAYS_ZFILL<uint64_t>::copy(
          *reinterpret_cast<const uint64_t*>(raw_pointer_cast(&src(0, m, k)) + row_shift),
          reinterpret_cast<uint64_t*>(raw_pointer_cast(&dst(0, m, k)))[1], row < rows_left);
    }
  }
}

// The chunks copy_rows_narrow copied, once landed, widened in place by the thread that copied
// them: 8 e4m3 elements from each chunk's upper half to 8 of Dst's over the whole chunk.
template <class Dst>
__device__ void widen_rows(Dst& dst) {
  using T = CudaHalfOf<typename Dst::value_type>;
#pragma unroll
  for (int m = 0; m < size<1>(dst); ++m) {
#pragma unroll
    for (int k = 0; k < size<2>(dst); ++k) {
      uint4* chunk = reinterpret_cast<uint4*>(raw_pointer_cast(&dst(0, m, k)));
      const uint2 narrow = reinterpret_cast<const uint2*>(chunk)[1];
      const uint2 lo = widen_e4m3x4<T>(narrow.x), hi = widen_e4m3x4<T>(narrow.y);
      *chunk = make_uint4(lo.x, lo.y, hi.x, hi.y);
    }
  }
}

// acc += A·B over the K extent, B (and A unless kAInRegs: it is there already) from shared
// memory, the next k slice's ldmatrix issued before the current slice's MMAs.
template <bool kAInRegs = false, class Mma, class RA, class RB, class SA, class SB, class CopyA,
          class CopyB, class Acc>
__device__ void gemm_smem(Mma& mma, Acc& acc, RA& rA, RB& rB, SA const& sA, SB const& sB,
                          CopyA const& copy_a, CopyB const& copy_b) {
  auto rA_view = copy_a.get_thread_slice(threadIdx.x).retile_D(rA);
  auto rB_view = copy_b.get_thread_slice(threadIdx.x).retile_D(rB);
  if constexpr (!kAInRegs) copy(copy_a, sA(_, _, 0), rA_view(_, _, 0));
  copy(copy_b, sB(_, _, 0), rB_view(_, _, 0));
#pragma unroll
  for (int k = 0; k < size<2>(rA); ++k) {
    if (k + 1 < size<2>(rA)) {
      if constexpr (!kAInRegs) copy(copy_a, sA(_, _, k + 1), rA_view(_, _, k + 1));
      copy(copy_b, sB(_, _, k + 1), rB_view(_, _, k + 1));
    }
    gemm(mma, rA(_, _, k), rB(_, _, k), acc);
  }
}

// acc += A·B with A already in registers (P), B from shared memory one k slice at a time (a
// second slice in flight would not fit beside the O accumulator at d128).
template <class Mma, class RA, class RB, class SB, class CopyB, class Acc>
__device__ void gemm_reg_smem(Mma& mma, Acc& acc, RA const& rA, RB& rB, SB const& sB,
                              CopyB const& copy_b) {
  auto rB_view = copy_b.get_thread_slice(threadIdx.x).retile_D(rB);
#pragma unroll
  for (int k = 0; k < size<2>(rA); ++k) {
    copy(copy_b, sB(_, _, k), rB_view(_, _, k));
    gemm(mma, rA(_, _, k), rB(_, _, k), acc);
  }
}

// kPaged: K and V in a paged cache, each copied row at its key's page (FwdParams::page_table),
// so that pages of any size serve. A kernel of its own: the dense kernel steps one pointer per
// copy back a block at a time, and at d128 any other addressing of its copies costs it spills.
// Cache: the paged cache's element type, Q's or e4m3; an e4m3 cache's rows are widened in the
// stages by the threads that copied them, once landed and before the barrier that publishes the
// block, and its descales (one per CTA: its sequence and KV head) fold into the scores' scale
// (K's) and O's final scale (V's).
template <class Traits, bool kPaged, class Cache = typename Traits::Element>
__global__ void __launch_bounds__(Traits::kThreads)
    fwd_kernel(__grid_constant__ const FwdParams params) {
  using Element = typename Traits::Element;
  constexpr bool kWidens = !std::is_same_v<Cache, Element>;
  static_assert(!kWidens || (kPaged && std::is_same_v<Cache, cutlass::float_e4m3_t>));
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kHeadDimV = Traits::kHeadDimV;
  using SharedStorage = typename Traits::SharedStorage;
  extern __shared__ __align__(128) char smem_raw[];
  SharedStorage& smem = *reinterpret_cast<SharedStorage*>(smem_raw);

  int rank, bh;
  params.order.at(blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z), rank, bh);
  const int m_block = params.order.group != 0 ? params.num_m_blocks - 1 - rank : rank;
  const int head = bh % params.heads_q, batch = bh / params.heads_q;
  const int head_kv = head / (params.heads_q / params.heads_kv);
  const int tid = threadIdx.x;
  const int row_begin = m_block * kBlockM;
  // The grid covers the longest entry: a packed batch's shorter ones leave blocks with no rows.
  const Sequences::Entry seq = params.seqs.at(batch);
  if (row_begin >= seq.seqlen_q) return;
  const KeyRange keys = seq.keys(params.keys);
  int n_min, n_max;
  keys.template blocks<kBlockN>(row_begin, row_begin + kBlockM, n_min, n_max);

  // Rows of `cols` (a head dim) from row `start`.
  auto gmem = [&](const void* ptr, int64_t b_stride, int64_t h_stride, int64_t row_stride, int h,
                  int start, int seqlen, auto cols) {
    auto base = static_cast<const Element*>(ptr) + seq.batch * b_stride + h * h_stride +
                start * row_stride;
    return make_tensor(make_gmem_ptr(base), make_shape(seqlen, cols),
                       make_stride(row_stride, _1{}));
  };
  Tensor mQ = gmem(params.q, params.q_batch_stride, params.q_head_stride, params.q_row_stride,
                   head, seq.q_start, seq.seqlen_q, Int<kHeadDim>{});
  Tensor mK = gmem(params.k, params.k_batch_stride, params.k_head_stride, params.k_row_stride,
                   head_kv, seq.k_start, seq.seqlen_k, Int<kHeadDim>{});
  Tensor mV = gmem(params.v, params.v_batch_stride, params.v_head_stride, params.v_row_stride,
                   head_kv, seq.k_start, seq.seqlen_k, Int<kHeadDimV>{});
  Tensor gQ = local_tile(mQ, Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m_block, 0));
  // The first key block visited; the copies step one block back per iteration by moving the
  // pointer (per-block slices would keep a 64-bit address per copy alive across the loop).
  Tensor gK = local_tile(mK, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_max - 1, 0));
  Tensor gV = local_tile(mV, Shape<Int<kBlockN>, Int<kHeadDimV>>{}, make_coord(n_max - 1, 0));

  constexpr int kStages = Traits::kStages;
  // Stage `stage` of the K and V buffers (Vᵀ: the same bytes as P·V's B operand).
  auto stage_k = [&](int stage) {
    return make_tensor(make_smem_ptr(smem.k.begin() + stage * Traits::kStageElemsK),
                       typename Traits::SmemLayoutK{});
  };
  auto stage_v = [&](int stage) {
    return make_tensor(make_smem_ptr(smem.v.begin() + stage * Traits::kStageElemsV),
                       typename Traits::SmemLayoutV{});
  };
  auto stage_vt = [&](int stage) {
    return make_tensor(make_smem_ptr(smem.v.begin() + stage * Traits::kStageElemsV),
                       typename Traits::SmemLayoutVt{});
  };
  Tensor sQ = make_tensor(make_smem_ptr(smem.q.begin()), typename Traits::SmemLayoutQ{});

  typename Traits::GmemCopy gmem_copy;
  auto thr_gmem = gmem_copy.get_thread_slice(tid);
  Tensor tQgQ = thr_gmem.partition_S(gQ);
  Tensor tQsQ = thr_gmem.partition_D(sQ);
  // O on its way out, in the Q buffer (the epilogue).
  Tensor sO = make_tensor(make_smem_ptr(smem.q.begin()), typename Traits::SmemLayoutO{});
  Tensor tOsO = thr_gmem.partition_D(sO);
  Tensor tKgK = thr_gmem.partition_S(gK);  // (CPY, CPY_N, CPY_K)
  Tensor tVgV = thr_gmem.partition_S(gV);
  // Row coordinates of each thread's copies, for the sequence-end predicate: Q's serve O's and
  // K's serve V's, whose copies have the same rows whatever their columns (a second coordinate
  // tensor of the same rows is not merged with the first, and costs registers).
  Tensor tQcQ = thr_gmem.partition_S(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor tKVc = thr_gmem.partition_S(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));

  typename Traits::TiledMma mma;
  auto thr_mma = mma.get_thread_slice(tid);
  Tensor tSrQ = thr_mma.partition_fragment_A(sQ);
  Tensor tSrK = thr_mma.partition_fragment_B(stage_k(0));
  Tensor tOrVt = thr_mma.partition_fragment_B(stage_vt(0));
  Tensor tOrO = partition_fragment_C(mma, Shape<Int<kBlockM>, Int<kHeadDimV>>{});
  Tensor tSrS = partition_fragment_C(mma, Shape<Int<kBlockM>, Int<kBlockN>>{});

  auto copy_q = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, mma);
  auto copy_k = make_tiled_copy_B(typename Traits::SmemCopyAtom{}, mma);
  auto copy_v = make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, mma);
  Tensor tSsQ = copy_q.get_thread_slice(tid).partition_S(sQ);

  Tensor rowcol_S = make_tensor(tSrS.data(), acc_rowcol(tSrS.layout()));
  Tensor rowcol_O = make_tensor(tOrO.data(), acc_rowcol(tOrO.layout()));
  Tensor cS = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor rowcol_cS = make_tensor(cS.data(), acc_rowcol(cS.layout()));
  Tensor cO = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDimV>>{}));
  Tensor rowcol_cO = make_tensor(cO.data(), acc_rowcol(cO.layout()));
  constexpr int kRows = decltype(size<0>(rowcol_S))::value;

  OnlineSoftmax<kRows, /*kTreeReduce=*/true> softmax;
  clear(tOrO);
  // Over an e4m3 cache K's descale multiplies every score (before softcap): the scores' scales
  // with it folded in. The 16-bit kernels read params' at each use (a copy kept live across the
  // loop would cost them registers).
  float cache_scale_log2 = params.scale_log2, cache_softcap_pre = params.softcap_pre;
  if constexpr (kWidens) {
    const int64_t at = int64_t(seq.index) * params.heads_kv + head_kv;
    const float k_descale = params.k_descale != nullptr ? params.k_descale[at] : 1.f;
    if (params.softcap)
      cache_softcap_pre *= k_descale;
    else
      cache_scale_log2 *= k_descale;
  }
  const auto scale_log2 = [&] { return kWidens ? cache_scale_log2 : params.scale_log2; };
  const auto softcap_pre = [&] { return kWidens ? cache_softcap_pre : params.softcap_pre; };

  if (n_max > n_min) {
    copy_rows(tQgQ, tQsQ, tQcQ, seq.seqlen_q - row_begin);
    // K and V blocks are loaded in the order they are visited (n_max − 1 down to n_min), each
    // copy stepping its global pointer one block back.
    const int64_t k_step = int64_t(kBlockN) * params.k_row_stride;
    const int64_t v_step = int64_t(kBlockN) * params.v_row_stride;
    // Paged: block n's rows of `cols` columns, each at its key's page (the table column clamped
    // into the entry's row of the table, the page number into the cache). Addressed as if every
    // row lay in page 0 at its row of the block, then each row moved to its page and its row
    // there; rows at and past `rows_left` are zero-filled (their clamped addresses unread).
    const int32_t* table_row =
        kPaged ? params.page_table + int64_t(seq.index) * params.page_table_stride : nullptr;
    auto copy_paged = [&](const void* ptr, int64_t page_stride, int64_t h_stride,
                          int64_t row_stride, int n, auto cols, auto& dst) {
      Tensor src = thr_gmem.partition_S(make_tensor(
          make_gmem_ptr(static_cast<const Cache*>(ptr) + head_kv * h_stride),
          make_shape(Int<kBlockN>{}, cols), make_stride(row_stride, _1{})));
      auto shift = [&](int row) {
        const int key = n * kBlockN + row;
        const int column = key / params.page_size;
        const int page = table_page(table_row, column, params.page_columns, params.num_pages);
        return page * page_stride + int64_t(key - column * params.page_size - row) * row_stride;
      };
      if constexpr (kWidens)
        copy_rows_narrow(src, dst, tKVc, seq.seqlen_k - n * kBlockN, shift);
      else
        copy_rows(src, dst, tKVc, seq.seqlen_k - n * kBlockN, shift);
    };
    // An e4m3 cache's block in stage `stage`, once this thread's copies of it have landed.
    auto widen_k = [&](int stage) {
      if constexpr (kWidens) {
        Tensor dst = thr_gmem.partition_D(stage_k(stage));
        widen_rows(dst);
      }
    };
    auto widen_v = [&](int stage) {
      if constexpr (kWidens) {
        Tensor dst = thr_gmem.partition_D(stage_v(stage));
        widen_rows(dst);
      }
    };
    auto load_k = [&](int n, int stage) {
      Tensor dst = thr_gmem.partition_D(stage_k(stage));
      if constexpr (kPaged)
        copy_paged(params.k, params.k_batch_stride, params.k_head_stride, params.k_row_stride, n,
                   Int<kHeadDim>{}, dst);
      else
        copy_rows(tKgK, dst, tKVc, seq.seqlen_k - n * kBlockN);
    };
    auto load_v = [&](int n, int stage) {
      Tensor dst = thr_gmem.partition_D(stage_v(stage));
      if constexpr (kPaged)
        copy_paged(params.v, params.v_batch_stride, params.v_head_stride, params.v_row_stride, n,
                   Int<kHeadDimV>{}, dst);
      else
        copy_rows(tVgV, dst, tKVc, seq.seqlen_k - n * kBlockN);
    };
    auto step_k = [&]() {
      if constexpr (!kPaged) tKgK.data() = tKgK.data() + (-k_step);
    };
    auto step_v = [&]() {
      if constexpr (!kPaged) tVgV.data() = tVgV.data() + (-v_step);
    };
    auto load_kv = [&](int n, int stage) {
      load_k(n, stage);
      step_k();
      load_v(n, stage);
      step_v();
    };
    // Two schedules. One stage (d256, where two CTAs per SM leave no room for more): V(n) is
    // loaded under S = Q·K(n)ᵀ and K(n−1) under the softmax and P·V — two barriers per block.
    // kStages ≥ 2: K and V of block n − (kStages − 1) are loaded while block n is computed, so
    // a load has kStages − 1 whole blocks to land and each block costs one barrier. Every
    // iteration commits one cp.async group (empty past the last block) so that
    // wait<kStages − 2> always means "this block's group has landed".
    if constexpr (kStages == 1) {
      load_k(n_max - 1, 0);
      cp_async_fence();
    } else {
#pragma unroll
      for (int s = 0; s < kStages - 1; ++s) {
        if (n_max - 1 - s >= n_min) load_kv(n_max - 1 - s, s);
        cp_async_fence();
      }
    }

    if constexpr (Traits::kQInRegs) {
      static_assert(kStages >= 2);
      cp_async_wait<kStages - 2>();  // the first group: Q and the first K/V block
      __syncthreads();
      copy(copy_q, tSsQ, copy_q.get_thread_slice(tid).retile_D(tSrQ));
    }
    float factor[kRows];
    int stage = 0;
#pragma unroll 1
    for (int n = n_max - 1; n >= n_min; --n) {
      if constexpr (kStages == 1) {
        cp_async_wait<0>();
        widen_k(0);
        __syncthreads();  // K(n) and Q landed; every warp is done with V(n+1)
        load_v(n, 0);
        step_v();
        cp_async_fence();
      } else {
        cp_async_wait<kStages - 2>();
        widen_k(stage);
        widen_v(stage);
        __syncthreads();  // K(n), V(n) (and Q) landed; every warp is done with block n+1
        const int n_load = n - (kStages - 1);
        const int stage_load = stage == 0 ? kStages - 1 : stage - 1;  // block n+1's
        if (n_load >= n_min) load_kv(n_load, stage_load);
        cp_async_fence();
      }

      clear(tSrS);
      gemm_smem<Traits::kQInRegs>(mma, tSrS, tSrQ, tSrK, tSsQ,
                                  copy_k.get_thread_slice(tid).partition_S(stage_k(stage)),
                                  copy_q, copy_k);
      if constexpr (kStages == 1) {
        cp_async_wait<0>();
        widen_v(0);
        __syncthreads();  // V(n) landed; every warp is done with K(n)
        if (n > n_min) {
          step_k();
          load_k(n - 1, 0);
          cp_async_fence();
        }
      }
      // Softcap and masks in their own copy of the code: folded into the common path, ptxas
      // predicates them and issues them on every block.
      auto cap_and_mask = [&]() {
        if (params.softcap) {
#pragma unroll
          for (int i = 0; i < size(tSrS); ++i) tSrS(i) = fast_tanh(tSrS(i) * softcap_pre());
        }
#pragma unroll
        for (int r = 0; r < size<0>(rowcol_S); ++r) {
          const int row = row_begin + get<0>(rowcol_cS(r, 0));
          const int lo = keys.lo(row) - n * kBlockN;
          const int hi = keys.hi(row) - n * kBlockN;
#pragma unroll
          for (int c = 0; c < size<1>(rowcol_S); ++c) {
            const int col = get<1>(rowcol_cS(r, c));
            if (col < lo || col >= hi) rowcol_S(r, c) = -INFINITY;
          }
        }
        softmax.step(rowcol_S, scale_log2(), factor);
      };
      float max_before[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r) max_before[r] = softmax.row_max[r];
      if (params.softcap ||
          keys.template block_needs_mask<kBlockN>(n, row_begin, row_begin + kBlockM)) {
        cap_and_mask();
      } else {
        softmax.step(rowcol_S, scale_log2(), factor);
      }
      // Most blocks of a long row leave every row max of the warp unchanged (the factor is 1 up
      // to the rounding of exp2(max·c − max·c)): skip the multiply then.
      bool rescale = false;
#pragma unroll
      for (int r = 0; r < kRows; ++r) rescale |= softmax.row_max[r] != max_before[r];
      if (__any_sync(0xffffffff, rescale)) scale_rows(rowcol_O, factor);

      // P in Element, register for register, then viewed as the A operand.
      constexpr int N = decltype(size(tSrS))::value;
      cutlass::NumericArrayConverter<Element, float, N> convert;
      auto rP = make_tensor<Element>(tSrS.layout());
      *reinterpret_cast<cutlass::Array<Element, N>*>(rP.data()) =
          convert(*reinterpret_cast<cutlass::Array<float, N> const*>(tSrS.data()));
      Tensor tOrP = make_tensor(rP.data(), acc_as_operand_a(rP.layout()));
      gemm_reg_smem(mma, tOrO, tOrP, tOrVt,
                    copy_v.get_thread_slice(tid).partition_S(stage_vt(stage)), copy_v);
      if constexpr (kStages > 1) stage = stage + 1 == kStages ? 0 : stage + 1;
    }
  }

  // ---------------- epilogue: O·(1/sum) and LSE ----------------
  float inv_sum[kRows], lse[kRows];
  softmax.finalize(scale_log2(), inv_sum, lse);
  if constexpr (kWidens) {  // V's descale multiplies every value
    if (params.v_descale != nullptr) {
      const float v_descale = params.v_descale[int64_t(seq.index) * params.heads_kv + head_kv];
#pragma unroll
      for (int r = 0; r < kRows; ++r) inv_sum[r] *= v_descale;
    }
  }
  scale_rows(rowcol_O, inv_sum);
  if (tid % 4 == 0) {  // the thread holding column 0 of its rows' quads
    float* lse_head = params.lse + params.seqs.lse_offset(seq, head, params.heads_q, params.seqs.rows_q);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int row = row_begin + get<0>(rowcol_cO(r, 0));
      if (row < seq.seqlen_q) lse_head[row] = lse[r];
    }
  }
  // O through shared memory (the Q buffer: free once every warp is past its last Q·Kᵀ), so
  // that each global store is a 16-byte piece of a row, not a 4-byte pair spread over 8 rows.
  __syncthreads();
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int row = get<0>(rowcol_cO(r, 0));
#pragma unroll
    for (int c = 0; c < size<1>(rowcol_O); c += 2) {  // columns c, c+1 are neighbours
      cutlass::Array<Element, 2> pair;
      pair[0] = Element(rowcol_O(r, c));
      pair[1] = Element(rowcol_O(r, c + 1));
      *reinterpret_cast<cutlass::Array<Element, 2>*>(&sO(row, get<1>(rowcol_cO(r, c)))) = pair;
    }
  }
  __syncthreads();
  Element* o = static_cast<Element*>(params.o) + seq.batch * params.o_batch_stride +
               head * params.o_head_stride + seq.q_start * params.o_row_stride;
  Tensor gO = local_tile(make_tensor(make_gmem_ptr(o), make_shape(seq.seqlen_q, Int<kHeadDimV>{}),
                                     make_stride(params.o_row_stride, _1{})),
                         Shape<Int<kBlockM>, Int<kHeadDimV>>{}, make_coord(m_block, 0));
  Tensor tOgO = thr_gmem.partition_D(gO);
#pragma unroll
  for (int m = 0; m < size<1>(tOgO); ++m) {
    if (get<0>(tQcQ(0, m, 0)) >= seq.seqlen_q - row_begin) continue;
#pragma unroll
    for (int k = 0; k < size<2>(tOgO); ++k) {
      *reinterpret_cast<cute::uint128_t*>(raw_pointer_cast(&tOgO(0, m, k))) =
          *reinterpret_cast<const cute::uint128_t*>(raw_pointer_cast(&tOsO(0, m, k)));
    }
  }
}

}  // namespace flashattn::sm80
