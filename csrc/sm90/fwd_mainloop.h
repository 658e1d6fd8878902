// The sm90 forward's mainloop: one consumer warpgroup's registers and the steps of a key block.
// S = Q·Kᵀ by WGMMA from shared memory; softcap, mask and the online softmax step on S in
// registers; P converted to the operand type; O += P·V by WGMMA with P from registers. The kernel
// shell (fwd_kernel.h) orders these steps against the pipelines; the mainloop owns no barrier
// but the ping-pong turns.
//
// FP8 (Element = e4m3, from the quantize step): Q·Kᵀ and P·V by QGMMA, the Q and K descales
// folded into each key block's softmax scale, V's descale into O's rescale factor, P converted to
// e4m3 in registers (V's keys ordered to match, fp8_layout.h).
//
// An e4m3 KV cache (Traits::kWidensCache; K and V widened to Element by the producer): its K
// descale, one per (sequence, KV head) and so per tile, folds into the tile's softmax scale (or
// softcap's pre-scale), its V descale into O's final rescale.
#pragma once

#include <utility>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_conversion.h>
#include <cuda_fp8.h>

#include "fwd_scheduler.h"
#include "fwd_traits.h"
#include "softmax.h"

namespace flashattn::sm90 {

// The softmax scale and (FP8) V descale of one key block.
struct BlockScales {
  float c, v;
};

// kPackable: the kernel may run pack-GQA tiles (FwdParams::group), whose rows' keys are their
// query rows' (tile row / group); else tile rows are query rows.
template <class Traits, bool kPackable = false>
struct FwdMainloop {
  using Element = typename Traits::Element;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kRowsPerWG = Traits::kRowsPerWG;
  using TileS = Shape<Int<kRowsPerWG>, Int<kBlockN>>;
  using MmaQK = typename Traits::MmaQK;
  using MmaPV = typename Traits::MmaPV;

  // The types of the per-thread operands and accumulators, as cute builds them.
  template <class SmemLayout>
  using SmemTensor = decltype(make_tensor(make_smem_ptr(std::declval<Element*>()), SmemLayout{}));
  using ThrQK = decltype(std::declval<MmaQK&>().get_thread_slice(0));
  using ThrPV = decltype(std::declval<MmaPV&>().get_thread_slice(0));
  using FragQ = decltype(std::declval<ThrQK&>().make_fragment_A(std::declval<ThrQK&>().partition_A(
      std::declval<SmemTensor<typename Traits::SmemLayoutQ>&>())));
  using FragK = decltype(std::declval<ThrQK&>().make_fragment_B(std::declval<ThrQK&>().partition_B(
      std::declval<SmemTensor<typename Traits::SmemLayoutK>&>())));
  using FragVt = decltype(std::declval<ThrPV&>().make_fragment_B(std::declval<ThrPV&>().partition_B(
      std::declval<SmemTensor<typename Traits::SmemLayoutVt>&>())));
  using FragO = decltype(partition_fragment_C(std::declval<MmaPV&>(), typename Traits::TileO{}));
  using FragS = decltype(partition_fragment_C(std::declval<MmaQK&>(), TileS{}));
  using CoordS = decltype(std::declval<ThrQK&>().partition_C(make_identity_tensor(TileS{})));
  static constexpr int kRows = decltype(size<0>(
      make_tensor(std::declval<FragS&>().data(), acc_rowcol(typename FragS::layout_type{}))))::value;
  // P (the exponentiated scores, in Element) as the register A operand of P·V. 16-bit: S's
  // layout reshaped. FP8: the k32 operand layout, ((4 keys, 2 rows, 2 halves), 1, kBlockN/32).
  using FragP = conditional_t<
      Traits::kFp8,
      decltype(make_tensor<Element>(Layout<Shape<Shape<_4, _2, _2>, _1, Int<kBlockN / 32>>>{})),
      decltype(make_tensor<Element>(acc_as_operand_a(typename FragS::layout_type{})))>;
  using Softmax = conditional_t<Traits::kFp8, ScaledOnlineSoftmax<kRows>, OnlineSoftmax<kRows>>;

  const FwdParams<Traits>& params;
  const int tid;  // thread within the warpgroup
  MmaQK mma_qk;
  MmaPV mma_pv;
  FragQ tSrQ;   // (MMA, 1, K, q stage)
  FragK tSrK;   // (MMA, N, K, stage)
  FragVt tOrV;  // (MMA, N, K, stage)
  FragO tOrO;   // O accumulator
  FragS tSrS;   // S, then P in f32
  CoordS cS;    // (row, col) of every S element within the warpgroup's tile
  FragP tOrP;
  // Ping-pong: each GEMM issue point waits for this warpgroup's turn, issues, hands the turn
  // over (turn_wait, turn_pass). Both warpgroups issue equally often on every tile, so the
  // alternation runs on across tiles. WG1 gives WG0 the first turn as it starts; WG0 takes
  // WG1's last hand-over at the end (take_last_turn), so no arrival is left pending at exit.
  const bool pingpong;
  const FwdBarrier my_turn, their_turn, v_tail_done;
  Softmax softmax;
  float factor[kRows];  // what O is rescaled by after a softmax step
  KeyRange keys;        // the tile's (its entry's lengths)
  // FP8: the tile's softmax scale with its Q descale, its K/V descales by key block, and the V
  // descale whose units O's accumulator is in (that of the last block whose P was converted).
  float tile_scale_log2;
  const float* k_descale = nullptr;
  const float* v_descale = nullptr;
  float v_unit = 1.f;
  // An e4m3 cache: softcap's pre-scale with the tile's K descale; and the softmax scale and V
  // descale of the tile whose last P·V is pending (cross-tile overlap), which is finished after
  // the next tile's begin_tile has replaced them.
  float tile_softcap_pre;
  float pending_scale_log2 = 0.f, pending_v_unit = 1.f;
  // Of the next V stage this warpgroup multiplies by, the rows that hold its entry's keys: a
  // tile's first-visited block may end past them, where a KV cache holds whatever it holds, and
  // P·V would make a NaN there every row's NaN (0·NaN); the rest are zeroed first (by each
  // warpgroup that holds rows of the tile, writing the same zeros). 16-bit V only (the FP8
  // forward reads no cache).
  int v_rows_with_keys = kBlockN;

  __device__ FwdMainloop(const FwdParams<Traits>& p, typename Traits::SharedStorage& smem, int wg,
                         int tid_)
      : params(p),
        tid(tid_),
        tSrQ(thr_qk().make_fragment_A(thr_qk().partition_A(
            make_tensor(make_smem_ptr(smem.q[wg].begin()), typename Traits::SmemLayoutQ{})))),
        tSrK(thr_qk().make_fragment_B(thr_qk().partition_B(
            make_tensor(make_smem_ptr(smem.k.begin()), typename Traits::SmemLayoutK{})))),
        tOrV(thr_pv().make_fragment_B(thr_pv().partition_B(
            make_tensor(make_smem_ptr(smem.v.begin()), typename Traits::SmemLayoutVt{})))),
        cS(thr_qk().partition_C(make_identity_tensor(TileS{}))),
        pingpong(give_first_turn(p.pingpong, wg)),
        my_turn(wg == 0 ? FwdBarrier::TurnWG0 : FwdBarrier::TurnWG1),
        their_turn(wg == 0 ? FwdBarrier::TurnWG1 : FwdBarrier::TurnWG0),
        v_tail_done(wg == 0 ? FwdBarrier::VTailWG0 : FwdBarrier::VTailWG1),
        tile_scale_log2(p.scale_log2),
        tile_softcap_pre(p.softcap_pre) {}
  FwdMainloop(const FwdMainloop&) = delete;

  __device__ ThrQK thr_qk() { return mma_qk.get_thread_slice(tid); }
  __device__ ThrPV thr_pv() { return mma_pv.get_thread_slice(tid); }
  __device__ auto rowcol_S() { return make_tensor(tSrS.data(), acc_rowcol(tSrS.layout())); }
  __device__ auto rowcol_O() { return make_tensor(tOrO.data(), acc_rowcol(tOrO.layout())); }

  // The tile's first-visited key block: its V rows past the entry's keys, to zero (zero_v_tail)
  // before its P·V, where a call with used-key counts (a KV cache's cache_seqlens, seqused_k)
  // may hold anything there: the entry's own rows past its count, or a dense cache's next
  // entry's rows, which may hold no key at all. Elsewhere they are the TMA box's zero fill past
  // the tensor or the next packed sequence's rows, which the caller keeps finite. Called once
  // the last tile's pending P·V has waited for its V.
  __device__ FLASHATTN_INLINE void mark_v_tail(const WorkTile& t) {
    if constexpr (!Traits::kFp8) {
      // An entry owns rows past its keys only with used-key counts (Sequences::at).
      const int rows = t.seq.seqlen_k - (t.n_max - 1) * kBlockN;
      if (params.seqs.used_k != nullptr && rows < kBlockN) v_rows_with_keys = rows > 0 ? rows : 0;
    }
  }
  // After the wait for V stage `stage`: its rows past the keys zeroed where mark_v_tail says so.
  __device__ FLASHATTN_INLINE void zero_v_tail(typename Traits::SharedStorage& smem, int stage) {
    if constexpr (!Traits::kFp8) {
      if (v_rows_with_keys < kBlockN) {
        constexpr int kDim = Traits::kHeadDimV;
        Tensor sV = make_tensor(make_smem_ptr(smem.v.begin()), typename Traits::SmemLayoutV{});
        for (int i = v_rows_with_keys * kDim + tid; i < kBlockN * kDim; i += 128)
          sV(i / kDim, i % kDim, stage) = Element(0);
        cutlass::arch::fence_view_async_shared();  // generic-proxy stores -> WGMMA reads
        named_sync(v_tail_done, 128);
        v_rows_with_keys = kBlockN;
      }
    }
  }

  // The tile's key range and (FP8) descales.
  __device__ FLASHATTN_INLINE void begin_tile(const WorkTile& t) {
    keys = t.keys;
    if constexpr (Traits::kFp8) {
      const int head_kv = t.head / (params.heads_q / params.heads_kv);
      // (batch, heads, blocks): a packed call's one batch entry holds every sequence's blocks,
      // sequence b's from its packed_block on (sequences.h), as the quantize step numbers them.
      // (One formula for both: a branch between two made ptxas schedule the dense loop worse.)
      const int b = params.seqs.packed() ? t.seq.index : 0;
      const int64_t q_block =
          (int64_t(t.seq.batch) * params.heads_q + t.head) * params.num_q_blocks +
          packed_block(t.seq.q_start, b, Traits::kBlockM);
      const int64_t kv_block =
          (int64_t(t.seq.batch) * params.heads_kv + head_kv) * params.num_n_blocks +
          packed_block(t.seq.k_start, b, kBlockN);
      // A packed entry's tiles past its last row store nothing: they read the descale slot of the
      // entry's first block (in bounds; an empty entry's belongs to no sequence, and is unused).
      const int m_block = t.m_block * Traits::kBlockM < t.seq.seqlen_q ? t.m_block : 0;
      tile_scale_log2 = params.scale_log2 * params.q_descale[q_block + m_block];
      k_descale = params.k_descale + kv_block;
      v_descale = params.v_descale + kv_block;
    } else if constexpr (Traits::kWidensCache) {
      // By sequence; a packed schedule's slots past the last sequence (no keys, nothing
      // stored) read sequence 0's.
      const int head_kv = group() > 1 ? t.head : t.head / (params.heads_q / params.heads_kv);
      const int b = t.seq.index < params.batch ? t.seq.index : 0;
      const int64_t i = int64_t(b) * params.heads_kv + head_kv;
      const float k_scale = params.k_descale != nullptr ? params.k_descale[i] : 1.f;
      v_unit = params.v_descale != nullptr ? params.v_descale[i] : 1.f;
      tile_scale_log2 = params.softcap ? params.scale_log2 : params.scale_log2 * k_scale;
      tile_softcap_pre = params.softcap_pre * k_scale;
    }
  }

  // The softmax scale (log2 units) and softcap's pre-scale of the tile's scores: the call's, or
  // with an e4m3 cache's K descale.
  __device__ float scale_log2() const {
    return Traits::kWidensCache ? tile_scale_log2 : params.scale_log2;
  }
  __device__ float softcap_pre() const {
    return Traits::kWidensCache ? tile_softcap_pre : params.softcap_pre;
  }

  // Tile rows per query row.
  __device__ int group() const {
    if constexpr (kPackable) {
      return params.group;
    } else {
      return 1;
    }
  }

  __device__ static bool give_first_turn(bool pingpong, int wg) {
    if (pingpong && wg == 1) named_arrive(FwdBarrier::TurnWG0, 256);
    return pingpong;
  }
  __device__ FLASHATTN_INLINE void take_last_turn(int wg) {
    if (pingpong && wg == 0) turn_wait();
  }

  __device__ FLASHATTN_INLINE void turn_wait() {
    if (pingpong) named_sync(my_turn, 256);
  }
  __device__ FLASHATTN_INLINE void turn_pass() {
    if (pingpong) named_arrive(their_turn, 256);
  }

  __device__ FLASHATTN_INLINE void gemm_qk(int q_stage, int stage) {
    mma_qk.accumulate_ = GMMA::ScaleOut::Zero;
    warpgroup_fence_operand(tSrS);
    warpgroup_arrive();
#pragma unroll
    for (int k = 0; k < size<2>(tSrQ); ++k) {
      gemm(mma_qk, tSrQ(_, _, k, q_stage), tSrK(_, _, k, stage), tSrS);
      mma_qk.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
    warpgroup_fence_operand(tSrS);
  }

  __device__ FLASHATTN_INLINE void gemm_pv(int stage) {
    warpgroup_fence_operand(tOrO);
    warpgroup_arrive();
#pragma unroll
    for (int k = 0; k < size<2>(tOrP); ++k) {
      gemm(mma_pv, tOrP(_, _, k), tOrV(_, _, k, stage), tOrO);
    }
    warpgroup_commit_batch();
    warpgroup_fence_operand(tOrO);
  }

  // P = S in Element, in the register layout of P·V's A operand.
  __device__ FLASHATTN_INLINE void convert_p() {
    if constexpr (Traits::kFp8) {
      // tSrS holds C[c + 2·row + 4·g] (g: 8-key group, c: key within this thread's pair); slice
      // kk of P takes, as word row + 2h, the keys of groups 4kk + 2h and 4kk + 2h + 1 of that
      // row: K index 4t + i + 16h holds key 16h + 8⌊i/2⌋ + 2t + i%2 (fp8_layout.h).
      uint32_t* p = reinterpret_cast<uint32_t*>(tOrP.data());
#pragma unroll
      for (int kk = 0; kk < kBlockN / 32; ++kk)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int row = 0; row < 2; ++row) {
            const int c = 2 * row + 4 * (4 * kk + 2 * h);
            const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(tSrS(c), tSrS(c + 1)),
                                                         __NV_SATFINITE, __NV_E4M3);
            const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(tSrS(c + 4), tSrS(c + 5)),
                                                         __NV_SATFINITE, __NV_E4M3);
            p[4 * kk + 2 * h + row] = lo | (hi << 16);
          }
    } else {
      // tOrP's layout reshapes tSrS's without permuting storage: register for register.
      constexpr int N = decltype(size(tSrS))::value;
      cutlass::NumericArrayConverter<Element, float, N> convert;
      *reinterpret_cast<cutlass::Array<Element, N>*>(tOrP.data()) =
          convert(*reinterpret_cast<cutlass::Array<float, N> const*>(tSrS.data()));
    }
  }

  // FP8 at d128/d256 loads a block's scales ahead of the waits before their use, so that the
  // load's latency hides under them; at d64 loading them early was slower (docs/PERFORMANCE.md),
  // so there they are loaded where they are used.
  static constexpr bool kScalesEarly = Traits::kFp8 && Traits::kHeadDim >= 128;

  __device__ FLASHATTN_INLINE BlockScales block_scales(int n) {
    if constexpr (Traits::kFp8) {
      return BlockScales{tile_scale_log2 * k_descale[n], v_descale[n]};
    } else {
      return BlockScales{params.scale_log2, 1.f};
    }
  }

  // Softcap and masks (unless kPlain: the caller knows there are none), then the online softmax
  // step on S of key block n for rows from row0; `factor` gets what O is to be rescaled by.
  template <bool kPlain>
  __device__ FLASHATTN_INLINE void softmax_step(int n, int row0, BlockScales early) {
    Tensor rowcol_S = this->rowcol_S();
    if (!kPlain && params.softcap) {
#pragma unroll
      for (int i = 0; i < size(tSrS); ++i) tSrS(i) = fast_tanh(tSrS(i) * softcap_pre());
    }
    int q_begin, q_end;  // this warpgroup's query rows
    query_rows(group(), row0, row0 + kRowsPerWG, q_begin, q_end);
    if (!kPlain && keys.template block_needs_mask<kBlockN>(n, q_begin, q_end)) {
      Tensor rowcol_cS = make_tensor(cS.data(), acc_rowcol(cS.layout()));
      // Accumulator column c of this thread is key 8·(c/2) + c%2 + 2·(tid%4) of the block: a
      // compile-time offset plus a per-thread one, so each test is one compare.
      const int thread_col = 2 * (tid % 4);
#pragma unroll
      for (int r = 0; r < size<0>(rowcol_S); ++r) {
        const int row = (row0 + get<0>(rowcol_cS(r, 0))) / group();
        const int lo = keys.lo(row) - n * kBlockN - thread_col;
        const int hi = keys.hi(row) - n * kBlockN - thread_col;
#pragma unroll
        for (int c = 0; c < size<1>(rowcol_S); ++c) {
          const int col = 8 * (c / 2) + c % 2;
          if (col < lo || col >= hi) rowcol_S(r, c) = -INFINITY;
        }
      }
    }
    if constexpr (Traits::kFp8) {
      const BlockScales scales = kScalesEarly ? early : block_scales(n);
      softmax.step(rowcol_S, scales.c, factor, /*never=*/params.batch < 0);
      // O holds P·V of the blocks after n in units of their V descale; block n's comes next.
      // Where the division is IEEE, its slow path (a call) ends the softmax's basic block, and
      // ptxas, which puts the caller's wait for P·V at the top of its block, leaves the wait
      // after the exponentials: the softmax runs beside this warpgroup's P·V. Which is faster
      // is measured per kernel (Tile::kIeeeDescaleRatio). scripts/sass_report.py, 'EX2 before
      // wait', shows which way each kernel went.
      const float ratio = Traits::kIeeeDescaleRatio ? v_unit / scales.v
                                                    : __fdividef(v_unit, scales.v);
      v_unit = scales.v;
#pragma unroll
      for (int r = 0; r < kRows; ++r) factor[r] *= ratio;
    } else {
      softmax.step(rowcol_S, scale_log2(), factor);
    }
  }

  // O is rescaled by `factor` before the next P·V accumulates into it.
  __device__ FLASHATTN_INLINE void rescale_o() {
    Tensor rowcol_O = this->rowcol_O();
    scale_rows(rowcol_O, factor);
  }

  // The tile whose last P·V is now pending: its scales, for finalize_pending.
  __device__ FLASHATTN_INLINE void hold_pending() {
    if constexpr (Traits::kWidensCache) {
      pending_scale_log2 = tile_scale_log2;
      pending_v_unit = v_unit;
    }
  }
  // finalize for the pending tile (hold_pending), once the next tile may have begun.
  __device__ FLASHATTN_INLINE void finalize_pending(float (&inv_sum)[kRows], float (&lse)[kRows]) {
    if constexpr (Traits::kWidensCache) {
      softmax.finalize(pending_scale_log2, inv_sum, lse);
#pragma unroll
      for (int r = 0; r < kRows; ++r) inv_sum[r] *= pending_v_unit;
    } else {
      finalize(inv_sum, lse);
    }
  }

  // All keys seen: what O's rows are multiplied by, and the LSE.
  __device__ FLASHATTN_INLINE void finalize(float (&inv_sum)[kRows], float (&lse)[kRows]) {
    if constexpr (Traits::kFp8) {
      softmax.finalize(inv_sum, lse);
#pragma unroll
      for (int r = 0; r < kRows; ++r) inv_sum[r] *= v_unit;
    } else {
      softmax.finalize(scale_log2(), inv_sum, lse);
      if constexpr (Traits::kWidensCache) {
#pragma unroll
        for (int r = 0; r < kRows; ++r) inv_sum[r] *= v_unit;
      }
    }
  }
};

}  // namespace flashattn::sm90
