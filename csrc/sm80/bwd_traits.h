// The sm80 backward's compile-time shape (BwdTraits: tile, warp layouts, shared memory, copies)
// and its run-time parameters (BwdParams), shared by the main kernel (bwd_kernel.h) and the dQ
// conversion (bwd_convert.h).
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/copy_atom.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cutlass/numeric_conversion.h>
#include <cutlass/numeric_types.h>

#include "../common/block_range.h"
#include "../common/bwd_passes.h"
#include "../common/bwd_workspace.h"
#include "../common/sequences.h"
#include "../common/tile_order.h"
#include "fwd_kernel.h"  // copy_rows, gemm_smem, acc_rowcol, the MMA choice

namespace flashattn::sm80 {

using namespace cute;

// kWarps warps; each GEMM family lays them out its own way: S/dP (kBlockM × kBlockN) with
// kAtomMSdP warps down M, dK/dV (kBlockN × d, kBlockN × d_v) with kAtomNdKV down N, dQ
// (kBlockM × d) with kAtomMdQ down M (as FlashAttention-2's backward). kHeadDim: of Q, K, dQ and
// dK; kHeadDimV: of V, O, dO and dV (dP = dO·Vᵀ sums over it).
template <class Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kWarps_, int kAtomMSdP,
          int kAtomNdKV, int kAtomMdQ, int kHeadDimV_ = kHeadDim_>
struct BwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kHeadDimV = kHeadDimV_;
  // dV's accumulator shares dK's loops and shared-memory staging (bwd_kernel's epilogue).
  static_assert(kHeadDimV <= kHeadDim, "V's head dim at most Q's");
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kWarps = kWarps_;
  static constexpr int kThreads = kWarps * 32;
  static_assert(kHeadDim % 32 == 0 && kHeadDimV % 32 == 0 && kBlockN % 64 == 0 &&
                kBlockM % 64 == 0);

  using MmaOp = typename FwdTraits<Element, 64, 64, 64, 4>::MmaOp;
  template <int kWarpsM>
  using Mma = TiledMMA<MMA_Atom<MmaOp>, Layout<Shape<Int<kWarpsM>, Int<kWarps / kWarpsM>, _1>>,
                       Tile<Int<16 * kWarpsM>, Int<16 * kWarps / kWarpsM>, _16>>;
  using MmaSdP = Mma<kAtomMSdP>;
  using MmadKV = Mma<kAtomNdKV>;
  using MmadQ = Mma<kAtomMdQ>;

  // Tiles with head-dim rows (Q, dO, K, V) take the forward's atom for the head dims (rows of
  // 32 elements where one is no multiple of 64); P and dS rows are key blocks, multiples of 64.
  using HeadDimRows = FwdTraits<Element, kHeadDim, 64, 64, 4, 1, false, kHeadDimV>;
  using SmemAtom = typename HeadDimRows::SmemAtom;
  using SmemAtomP = typename FwdTraits<Element, 64, 64, 64, 4>::SmemAtom;
  template <int kRows, int kCols, class Atom = SmemAtom>
  using Smem = decltype(tile_to_shape(Atom{}, Shape<Int<kRows>, Int<kCols>>{}));
  // (cols, rows) view of a (rows, cols) tile: the same bytes, read with ldmatrix.trans.
  template <class L, int kRows, int kCols>
  using Transposed = decltype(composition(
      L{}, make_layout(Shape<Int<kCols>, Int<kRows>>{}, GenRowMajor{})));
  using SmemLayoutQ = Smem<kBlockM, kHeadDim>;
  using SmemLayoutdO = Smem<kBlockM, kHeadDimV>;
  using SmemLayoutK = Smem<kBlockN, kHeadDim>;
  using SmemLayoutV = Smem<kBlockN, kHeadDimV>;
  using SmemLayoutP = Smem<kBlockM, kBlockN, SmemAtomP>;  // P and dS
  using SmemLayoutQt = Transposed<SmemLayoutQ, kBlockM, kHeadDim>;
  using SmemLayoutdOt = Transposed<SmemLayoutdO, kBlockM, kHeadDimV>;
  using SmemLayoutKt = Transposed<SmemLayoutK, kBlockN, kHeadDim>;
  using SmemLayoutPt = Transposed<SmemLayoutP, kBlockM, kBlockN>;

  // Global <-> shared: a thread per 8 elements of an atom's row.
  static constexpr int kThreadsPerRow = HeadDimRows::kAtomCols / 8;
  using GmemCopy = decltype(make_tiled_copy(
      Copy_Atom<SM80_CP_ASYNC_CACHEGLOBAL<cute::uint128_t>, Element>{},
      Layout<Shape<Int<kThreads / kThreadsPerRow>, Int<kThreadsPerRow>>,
             Stride<Int<kThreadsPerRow>, _1>>{},
      Layout<Shape<_1, _8>>{}));
  using LoadN = Copy_Atom<SM75_U32x4_LDSM_N, Element>;
  using LoadT = Copy_Atom<SM75_U16x8_LDSM_T, Element>;

  // Multiples of the swizzle period.
  static constexpr int kQElems = cosize_v<SmemLayoutQ>;
  static constexpr int kdOElems = cosize_v<SmemLayoutdO>;
  // One Q/dO buffer with its rows' LSE and D; a second one loads the next query block during
  // this one.
  struct alignas(128) QStage {
    ArrayEngine<Element, kQElems> q;
    ArrayEngine<Element, kdOElems> dout;
    alignas(16) float lse[kBlockM];  // log2 domain: LSE·log2(e); +inf for rows past seqlen_q
    alignas(16) float d[kBlockM];    // rowsum(dO ∘ O)
  };
  struct SharedStorage {
    ArrayEngine<Element, cosize_v<SmemLayoutK>> k;
    ArrayEngine<Element, cosize_v<SmemLayoutV>> v;
    ArrayEngine<Element, cosize_v<SmemLayoutP>> p;
    ArrayEngine<Element, cosize_v<SmemLayoutP>> ds;
    QStage stage[2];  // last: a one-buffer launch leaves stage[1] out of its shared memory
  };
  static constexpr int smem_bytes(int q_stages) {
    return int(sizeof(SharedStorage) - (2 - q_stages) * sizeof(QStage));
  }
};

// Shapes below are dense; packed calls (seqs.packed()) have one tensor batch entry of seqlen_q
// query and seqlen_k key rows (the tensors' rows), `batch` sequences, and dq_rows rows per head in
// the layout of bwd_rows_start.
struct BwdParams {
  const void *q, *k, *v, *dout;
  void *dq, *dk, *dv;
  // (dq_splits, batch, heads_q, dq_rows / kBlockM, MMA order of kBlockM × d), zeroed: key blocks
  // n ≡ s (mod dq_splits) add into slice s.
  float* dq_accum;
  float* lse_log2;    // (batch, heads_q, dq_rows): LSE·log2(e), +inf in the padding
  float* softmax_d;   // (batch, heads_q, dq_rows): rowsum(dO ∘ O), 0 in the padding
  int dq_rows;        // bwd_rows_per_head: seqlen_q rounded up to whole query blocks (dense)
  int q_stages;       // Q/dO buffers in shared memory: 1 or 2
  // Deterministic mode: CTA s of dq_splits walks key blocks s, s + dq_splits, ... alone in its dQ
  // slice (the same thread adds to an address in program order), GQA dK/dV go per query head
  // (plain stores), and the conversions sum slices and heads in a fixed order. Otherwise one CTA
  // per key block, dq_splits = 1, and dK/dV summed by atomics.
  bool deterministic;
  int dq_splits;
  int64_t dq_split_stride;  // floats between dQ slices
  TileOrder order;          // atomic mode: (key block, batch·head) of each CTA
  // The sinks' gradient: the sinks, and kSinkWarps parts per (entry, head,
  // key block of sink_blocks) (bwd_sink_grad); else null.
  const float* sinks;
  float* sink_parts;
  int sink_blocks;
  float* dk_accum;    // GQA only: (batch, heads_kv, seqlen_k, d) zeroed, or deterministic
                      // (batch, heads_q, seqlen_k, d); else null
  float* dv_accum;    // the same with d_v
  int64_t q_batch_stride, q_row_stride, q_head_stride;
  int64_t k_batch_stride, k_row_stride, k_head_stride;
  int64_t v_batch_stride, v_row_stride, v_head_stride;
  int64_t do_batch_stride, do_row_stride, do_head_stride;
  int64_t dq_batch_stride, dq_row_stride, dq_head_stride;
  int64_t dk_batch_stride, dk_row_stride, dk_head_stride;
  int64_t dv_batch_stride, dv_row_stride, dv_head_stride;
  int batch, heads_q, heads_kv, seqlen_q, seqlen_k;
  KeyRange keys;      // the call's; each entry's with its own lengths
  Sequences seqs;     // where each entry's rows lie
  float scale;        // softmax scale
  float scale_log2;   // scale·log2(e), or softcap·log2(e) when softcap is on
  float softcap_pre;  // scale/softcap when softcap is on
  bool softcap;
};

}  // namespace flashattn::sm80
