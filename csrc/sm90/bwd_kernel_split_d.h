// The sm_90a backward kernel for head dims 192 and 256, its two consumer warpgroups splitting
// the head dim.
//
// At d256 a warpgroup that owned 64 keys (bwd_kernel.h) would hold dK and dV as 256 f32
// registers per thread (at d192, 192). Here one CTA owns kBlockN = 64 keys and walks the 64-row query blocks
// that see them; each consumer warpgroup owns half of the head dim of dK, dV and dQ (FA3's
// layout at d256), 64 + 64 accumulator registers (48 + 48 at d192):
//   producer (WG 0): K and V once, then per query block Q (two stages) and dO (one) by TMA;
//   consumers (WG 1, WG 2): Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ for all 64 keys and half of the block's
//                    queries each (N = 32), Pᵀ and dSᵀ from them into shared memory (two
//                    stages); after one barrier, each warpgroup computes its columns of
//                    dQ = dS·K, dV += Pᵀ·dO and dK += dSᵀ·Q with every operand in shared memory.
//                    Each warpgroup's dQ columns leave in two 64-row f32 slabs (DqSlabs) through
//                    one shared buffer, by bulk reduce-adds: the first under dK, the second
//                    after the next block's score GEMMs (DqSlabPair). (Per-thread vector reductions, the
//                    first version, saturated the LSU and L2: in ncu many stall samples on REDG
//                    and a busy L2, benchmarks/README.md; the two slabs back to back waited on
//                    the first one's read.)
//                    At d256 the buffer's 32 KiB come from single-buffering dO (as FA3);
//                    d192 has room for two dO buffers.
// V, dO and dV take V's head dim (kHeadDimV; DeepSeek's (192, 128) takes the keys-as-N kernel,
// bwd_kernel_keys_n.h): dPᵀ runs over V's columns and each warpgroup owns half of dV's.
// setmaxnreg moves registers from the producer (24) to the consumers (240). kDeterministic: as
// bwd_kernel.h's, each (query block, warpgroup)'s two slabs added in key-block order through a
// semaphore, GQA dK/dV per query head; kSoftcap as bwd_kernel.h's.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/reg_reconfig.h>

#include "../common/bwd_passes.h"
#include "bwd_dq_handover.h"
#include "bwd_tile.h"
#include "wgmma.h"
#include "softmax.h"

namespace flashattn::sm90 {

using namespace cute;

// kHeadDim: of Q and K (and dQ, dK); kHeadDimV: of V, O and dO (and dV).
template <class Element_, int kHeadDim_, int kHeadDimV_>
struct BwdSplitDLayouts {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kHeadDimV = kHeadDimV_;
  using Tile = BwdTile<kHeadDim, kHeadDimV>;
  static_assert(Tile::kSplitHeadDim, "a tile of this kernel");
  static constexpr int kBlockM = Tile::kBlockM;  // query rows per block
  static constexpr int kBlockN = Tile::kBlockN;  // keys per CTA (the score GEMMs' M)
  static constexpr int kConsumerWGs = 2;
  static constexpr int kQueriesPerWG = kBlockM / kConsumerWGs;  // the score GEMMs' N
  static constexpr int kColsPerWG = kHeadDim / kConsumerWGs;    // of dK and dQ
  static constexpr int kColsPerWGV = kHeadDimV / kConsumerWGs;  // of dV
  static constexpr int kKeyTiles = 1;
  static constexpr int kStages = Tile::kStages;      // Q, Pᵀ and dSᵀ buffers
  static constexpr int kStagesdO = Tile::kStagesdO;  // shared memory: 227 KiB per CTA
  static constexpr int kDqSlabCols = kColsPerWG / 2;  // dQ leaves in two slabs per warpgroup
  static constexpr int kThreads = 128 * (1 + kConsumerWGs);
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;
  static_assert(kQueriesPerWG == 32, "LSE and D: one row per lane");

  using TileQ = Shape<Int<kBlockM>, Int<kHeadDim>>;
  using TiledO = Shape<Int<kBlockM>, Int<kHeadDimV>>;
  using TileK = Shape<Int<kBlockN>, Int<kHeadDim>>;
  using TileV = Shape<Int<kBlockN>, Int<kHeadDimV>>;

  // Swizzled K-major rows (transposed views are MN-major): of 128 bytes, or of 64 where a
  // warpgroup's columns of the head dim (which the dQ, dK and dV GEMMs take from the transposed
  // views) would start inside a 128-byte atom (d192: 96 columns each).
  template <int kCols>  // a warpgroup's columns
  using SmemAtomFor = conditional_t<kCols % 64 == 0, GMMA::Layout_K_SW128_Atom<Element>,
                                    GMMA::Layout_K_SW64_Atom<Element>>;
  // Pᵀ and dSᵀ: key and query blocks of 64.
  using SmemAtomP = GMMA::Layout_K_SW128_Atom<Element>;
  template <int kDim, int kBuffers>  // (queries, d, stage)
  using SmemLayoutRows = decltype(tile_to_shape(
      SmemAtomFor<kDim / kConsumerWGs>{}, Shape<Int<kBlockM>, Int<kDim>, Int<kBuffers>>{}));
  template <int kDim, int kBuffers>  // (d, queries, stage): B of dK and dV
  using SmemLayoutRowsT = decltype(composition(
      SmemLayoutRows<kDim, kBuffers>{},
      make_ordered_layout(Shape<Int<kDim>, Int<kBlockM>, Int<kBuffers>>{}, Step<_2, _1, _3>{})));
  using SmemLayoutQ = SmemLayoutRows<kHeadDim, kStages>;
  using SmemLayoutQt = SmemLayoutRowsT<kHeadDim, kStages>;
  using SmemLayoutdO = SmemLayoutRows<kHeadDimV, kStagesdO>;
  using SmemLayoutdOt = SmemLayoutRowsT<kHeadDimV, kStagesdO>;
  using SmemLayoutK = decltype(tile_to_shape(SmemAtomFor<kColsPerWG>{}, TileK{}));
  using SmemLayoutV = decltype(tile_to_shape(SmemAtomFor<kColsPerWGV>{}, TileV{}));
  using SmemLayoutKt = decltype(composition(  // (d, keys): B of dQ
      SmemLayoutK{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, Step<_2, _1>{})));
  // Pᵀ and dSᵀ as (keys, queries, stage), queries contiguous: the K-major A operands of dV and dK,
  // where the accumulator's neighbouring query columns are neighbours; dS as (queries, keys,
  // stage) is the MN-major A operand of dQ.
  using SmemLayoutPt = decltype(tile_to_shape(
      SmemAtomP{}, Shape<Int<kBlockN>, Int<kBlockM>, Int<kStages>>{}));
  using SmemLayoutP = decltype(composition(
      SmemLayoutPt{}, make_ordered_layout(Shape<Int<kBlockM>, Int<kBlockN>, Int<kStages>>{},
                                          Step<_2, _1, _3>{})));
  using DqLayout = DqSlabs<kHeadDim, kBlockM, kHeadDim / kDqSlabCols>;

  // Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ over this warpgroup's queries (the atom is the same over either
  // head dim: the K extent only counts the instructions).
  using MmaSdP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float,
                           Shape<Int<kBlockN>, Int<kQueriesPerWG>, Int<kHeadDim>>>()));
  template <int kCols>  // this warpgroup's columns of dK += dSᵀ·Q or dV += Pᵀ·dO
  using MmaKeyRows = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float,
                           Shape<Int<kBlockN>, Int<kCols>, Int<kBlockM>>, GMMA::Major::K,
                           GMMA::Major::MN>()));
  using MmadK = MmaKeyRows<kColsPerWG>;
  using MmadV = MmaKeyRows<kColsPerWGV>;
  using MmadQ = decltype(make_tiled_mma(  // this warpgroup's columns of dQ = dS·K
      GMMA::ss_op_selector<Element, Element, float,
                           Shape<Int<kBlockM>, Int<kColsPerWG>, Int<kBlockN>>, GMMA::Major::MN,
                           GMMA::Major::MN>()));
  static_assert(wgmma_atom_n<MmaSdP> == kQueriesPerWG && wgmma_atom_n<MmadK> == kColsPerWG &&
                    wgmma_atom_n<MmadV> == kColsPerWGV && wgmma_atom_n<MmadQ> == kColsPerWG,
                "a WGMMA atom narrower than its GEMM (registry::extended_wgmma_n)");
};
// The kernel's traits: its tiles and layouts, and the TMA loads and shared memory it shares with
// the keys-as-N kernel.
template <class Element, int kHeadDim, int kHeadDimV = kHeadDim>
struct BwdSplitDTraits : BwdSplitDLayouts<Element, kHeadDim, kHeadDimV>,
                         BwdSharedKeyBlock<BwdSplitDLayouts<Element, kHeadDim, kHeadDimV>> {};

// The template parameters are bwd_kernel's (bwd_kernel.h).
template <class Traits, bool kDeterministic, bool kSoftcap, bool kSinkParts>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    bwd_kernel_split_d(__grid_constant__ const BwdParams<Traits> params) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using Element = typename Traits::Element;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kStages = Traits::kStages;
  constexpr int kConsumerWGs = Traits::kConsumerWGs;
  constexpr int kQueriesPerWG = Traits::kQueriesPerWG;
  constexpr int kColsPerWG = Traits::kColsPerWG;
  constexpr int kColsPerWGV = Traits::kColsPerWGV;
  using SharedStorage = typename Traits::SharedStorage;
  extern __shared__ __align__(1024) char smem_raw[];
  SharedStorage& smem = *reinterpret_cast<SharedStorage*>(smem_raw);

  // Deterministic with a right bound: the hand-over runs down from the diagonal (bwd_kernel.h).
  const bool keys_descending = kDeterministic && params.keys.window_right >= 0;
  const BwdCtaWork work = bwd_cta_work<kBlockN, kBlockM>(params, keys_descending);
  if (!work.exists) return;
  const int n_block = work.n_block, m_first = work.m_first, m_end = work.m_end;
  const int key0 = n_block * kBlockN;
  const int64_t rows_base = work.rows_base;  // the entry's LSE, D and dQ rows of this head

  const int warp_group = threadIdx.x / 128;
  bwd_init_barriers(smem, 4 * kConsumerWGs);

  if (warp_group == 0) {  // producer: setmaxnreg gives its registers to the consumers
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
    bwd_produce(params, smem, work);
    return;
  }

  // ---------------- consumers ----------------
  cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
  const int wg = warp_group - 1;
  const int tid = threadIdx.x % 128;
  const int q_off = wg * kQueriesPerWG;  // this warpgroup's queries within the block
  const int col0 = wg * kColsPerWG;      // and its columns of dK and dQ
  const int col0_v = wg * kColsPerWGV;   // and of dV

  Tensor sK = make_tensor(make_smem_ptr(smem.k[0].begin()), typename Traits::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(smem.v[0].begin()), typename Traits::SmemLayoutV{});
  Tensor sKt = make_tensor(make_smem_ptr(smem.k[0].begin()), typename Traits::SmemLayoutKt{});
  Tensor sQ = make_tensor(make_smem_ptr(smem.q.begin()), typename Traits::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(smem.dout.begin()), typename Traits::SmemLayoutdO{});
  Tensor sQt = make_tensor(make_smem_ptr(smem.q.begin()), typename Traits::SmemLayoutQt{});
  Tensor sdOt = make_tensor(make_smem_ptr(smem.dout.begin()), typename Traits::SmemLayoutdOt{});
  Tensor sPt = make_tensor(make_smem_ptr(smem.p.begin()), typename Traits::SmemLayoutPt{});
  Tensor sdSt = make_tensor(make_smem_ptr(smem.ds.begin()), typename Traits::SmemLayoutPt{});
  Tensor sdS = make_tensor(make_smem_ptr(smem.ds.begin()), typename Traits::SmemLayoutP{});
  using RowsOfQ = Shape<Int<kQueriesPerWG>, Int<kHeadDim>, Int<kStages>>;
  using RowsOfdO = Shape<Int<kQueriesPerWG>, Int<Traits::kHeadDimV>, Int<Traits::kStagesdO>>;
  using ColsOfQt = Shape<Int<kColsPerWG>, Int<kBlockM>, Int<kStages>>;
  using ColsOfdOt = Shape<Int<kColsPerWGV>, Int<kBlockM>, Int<Traits::kStagesdO>>;
  auto mine = make_coord(wg, _0{}, _0{});

  typename Traits::MmaSdP mma_sdp;
  typename Traits::MmadK mma_dk;
  typename Traits::MmadV mma_dv;
  typename Traits::MmadQ mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(tid);
  auto thr_dk = mma_dk.get_thread_slice(tid);
  auto thr_dv = mma_dv.get_thread_slice(tid);
  auto thr_dq = mma_dq.get_thread_slice(tid);
  Tensor tSrK = thr_sdp.make_fragment_A(thr_sdp.partition_A(sK));  // (MMA, 1, K)
  Tensor tSrV = thr_sdp.make_fragment_A(thr_sdp.partition_A(sV));
  Tensor tSrQ =  // (MMA, 1, K, stage)
      thr_sdp.make_fragment_B(thr_sdp.partition_B(local_tile(sQ, RowsOfQ{}, mine)));
  Tensor tSrdO = thr_sdp.make_fragment_B(thr_sdp.partition_B(local_tile(sdO, RowsOfdO{}, mine)));
  Tensor tdVrPt = thr_dv.make_fragment_A(thr_dv.partition_A(sPt));  // (MMA, 1, K, stage)
  Tensor tdKrdSt = thr_dk.make_fragment_A(thr_dk.partition_A(sdSt));
  Tensor tdVrdOt =  // (MMA, N, K, stage)
      thr_dv.make_fragment_B(thr_dv.partition_B(local_tile(sdOt, ColsOfdOt{}, mine)));
  Tensor tdKrQt = thr_dk.make_fragment_B(thr_dk.partition_B(local_tile(sQt, ColsOfQt{}, mine)));
  Tensor tdQrdS = thr_dq.make_fragment_A(thr_dq.partition_A(sdS));  // (MMA, 1, K, stage)
  Tensor tdQrKt = thr_dq.make_fragment_B(thr_dq.partition_B(  // (MMA, N, K)
      local_tile(sKt, Shape<Int<kColsPerWG>, Int<kBlockN>>{}, make_coord(wg, _0{}))));

  using TileS = Shape<Int<kBlockN>, Int<kQueriesPerWG>>;
  using TiledK = Shape<Int<kBlockN>, Int<kColsPerWG>>;
  using TiledV = Shape<Int<kBlockN>, Int<kColsPerWGV>>;
  using TiledQ = Shape<Int<kBlockM>, Int<kColsPerWG>>;
  Tensor acc_s = partition_fragment_C(mma_sdp, TileS{});   // Sᵀ, then Pᵀ
  Tensor acc_dp = partition_fragment_C(mma_sdp, TileS{});  // dPᵀ, then dSᵀ
  Tensor acc_dk = partition_fragment_C(mma_dk, TiledK{});
  Tensor acc_dv = partition_fragment_C(mma_dv, TiledV{});
  Tensor acc_dq = partition_fragment_C(mma_dq, TiledQ{});
  clear(acc_dk);
  clear(acc_dv);
  Tensor rowcol_s = make_tensor(acc_s.data(), acc_rowcol(acc_s.layout()));
  Tensor rowcol_dp = make_tensor(acc_dp.data(), acc_rowcol(acc_dp.layout()));
  // (key, query) of every Sᵀ element within the warpgroup's tile.
  Tensor cS = thr_sdp.partition_C(make_identity_tensor(TileS{}));
  Tensor rowcol_cS = make_tensor(cS.data(), acc_rowcol(cS.layout()));
  Tensor rP = make_tensor<Element>(acc_s.layout());
  constexpr CapSlope kCap = kSoftcap ? CapSlope::kFolded : CapSlope::kNone;
  Tensor rdS = make_tensor<Element>(acc_dp.layout());
  Tensor cdQ = thr_dq.partition_C(make_identity_tensor(TiledQ{}));

  const auto dq_slabs = dq_slab_pair(params, acc_dq, cdQ, smem.dq[wg], rows_base, wg, tid);
  static_assert(kColsPerWG == 2 * Traits::kDqSlabCols);

  // The sinks' gradient: this thread's share over the CTA's keys (bwd_sink_grad).
  static_assert(!kSinkParts || kCap == CapSlope::kNone);
  const bool sink_grad = kSinkParts && params.sink_parts != nullptr;
  float sink_part = 0.f;
  PipelineState<kStages> st;
  PipelineState<Traits::kStagesdO> st_do;
  if (m_end > m_first) cutlass::arch::ClusterTransactionBarrier::wait(&smem.kv_full, 0);
  // LSE·log2(e) and D of the warpgroup's 32 queries, lane L holding query q0 + L; a shuffle hands
  // each use its row (the preprocess padded them to whole blocks). Loaded a block ahead, under
  // the dQ/dV/dK GEMMs, so that the exponentials do not wait on global memory.
  auto row_at = [&](int m) { return rows_base + m * kBlockM + q_off + tid % 32; };
  float lse_next = 0.f, dsum_next = 0.f;
  if (m_end > m_first) {
    lse_next = params.lse_log2[row_at(m_first)];
    dsum_next = params.softmax_d[row_at(m_first)];
  }
#pragma unroll 1
  for (int m = m_first; m < m_end; ++m) {
    const int q0 = m * kBlockM + q_off;  // this warpgroup's first query
    const float lse_held = lse_next, dsum_held = dsum_next;
    auto row_value = [&](float held, int c) {
      return __shfl_sync(0xffffffffu, held, get<1>(rowcol_cS(0, c)));
    };
    smem.pipe_q.consumer_wait(st);
    gemm_ss(mma_sdp, tSrK, tSrQ(_, _, _, st.index), acc_s);
    smem.pipe_do.consumer_wait(st_do);
    gemm_ss(mma_sdp, tSrV, tSrdO(_, _, _, st_do.index), acc_dp);
    if (m > m_first) dq_slabs.second(m - 1);  // once this block's score GEMMs are done
    warpgroup_wait<1>();  // Sᵀ ready
    bwd_probabilities<kCap>(rowcol_s, rowcol_cS, [&](int c) { return row_value(lse_held, c); },
                      work.keys, key0, q0, params.scale_log2, params.softcap_pre,
                      work.keys.template block_needs_mask<kBlockN>(n_block, q0,
                                                                   q0 + kQueriesPerWG),
                      rP);
    warpgroup_wait<0>();  // dPᵀ ready
    bwd_ds<kCap>(
        rowcol_s, rowcol_dp, [&](int c) { return row_value(dsum_held, c); },
        [&](int c) { return row_value(lse_held, c); }, params.scale_log2);
    if constexpr (kSinkParts)
      if (sink_grad)
        sink_part += bwd_sink_share(rowcol_dp, [&](int c) { return row_value(lse_held, c); },
                                    params.sinks[work.head] * float(M_LOG2E));
    if constexpr (kCap != CapSlope::kFolded) convert_fragment(acc_s, rP);
    convert_fragment(acc_dp, rdS);
    // Pᵀ and dSᵀ into this block's stage, as (key, query). The other warpgroup's GEMMs read the
    // stage two blocks ago and completed before it passed the barrier below last block.
    // By stmatrix: each 16-byte row of 8 neighbouring queries of one key (the accumulators'
    // column direction) is contiguous in the queries-contiguous layout.
    {
      auto r2s = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_sdp);
      auto thr_r2s = r2s.get_thread_slice(tid);
      auto my_queries = [&](auto* tiles) {  // (keys, this warpgroup's queries, stage)
        return thr_r2s.partition_D(local_tile(
            as_position_independent_swizzle_tensor(
                make_tensor(make_smem_ptr(tiles), typename Traits::SmemLayoutPt{})),
            Shape<Int<kBlockN>, Int<kQueriesPerWG>, Int<kStages>>{}, make_coord(_0{}, wg, _0{})));
      };
      copy(r2s, thr_r2s.retile_S(rP), my_queries(smem.p.begin())(_, _, _, st.index));
      copy(r2s, thr_r2s.retile_S(rdS), my_queries(smem.ds.begin())(_, _, _, st.index));
    }
    // The dQ slab is free once the last block's second bulk add has read it. Deterministic: once
    // both of its adds have completed, the next key block may add into that query block.
    if (tid == 0) {
      if (kDeterministic && m > m_first)
        finish_bulk_adds_and_signal(dq_slabs.semaphore(m - 1));
      else
        tma_store_wait<0>();
    }
    cutlass::arch::fence_view_async_shared();  // generic-proxy stores -> WGMMA reads
    consumers_sync(BwdBarrier::DsReady, 128 * kConsumerWGs);

    // This warpgroup's columns: dV first, so that dO's buffer is released early for
    // the next block's load; then dQ, whose bulk adds run under dK.
    gemm_accumulate(mma_dv, tdVrPt(_, _, _, st.index), tdVrdOt(_, _, _, st_do.index), acc_dv);
    gemm_ss(mma_dq, tdQrdS(_, _, _, st.index), tdQrKt, acc_dq);
    gemm_accumulate(mma_dk, tdKrdSt(_, _, _, st.index), tdKrQt(_, _, _, st.index), acc_dk);
    if (m + 1 < m_end) {
      lse_next = params.lse_log2[row_at(m + 1)];
      dsum_next = params.softmax_d[row_at(m + 1)];
    }
    warpgroup_wait<2>();  // dV done: dO's last reader
    smem.pipe_do.consumer_release(st_do);
    warpgroup_wait<1>();  // dQ ready
    dq_slabs.store(0);
    if (tid == 0) {
      if constexpr (kDeterministic)  // after the key blocks before this one in hand-over order
        if (hand_over_runs(params))
          wait_for_count(dq_slabs.semaphore(m), dq_adds_before<kBlockN, kBlockM>(
                                                 work.keys, m * kBlockM, n_block, keys_descending));
      dq_slabs.add(m, 0);
    }
    warpgroup_wait<0>();  // dK done: Q's last reader
    smem.pipe_q.consumer_release(st);
    st.advance();
    st_do.advance();
  }

  if (m_end > m_first) dq_slabs.second(m_end - 1);
  if (tid == 0) {  // the slab must stay until the last bulk add read it
    if (kDeterministic && m_end > m_first)
      finish_bulk_adds_and_signal(dq_slabs.semaphore(m_end - 1));
    else
      tma_store_wait<0>();
  }

  static_assert(Traits::kConsumerWGs * 4 <= kSinkWarps);
  if (kSinkParts && sink_grad)
    store_sink_part(params.sink_parts + work.sink_slot, wg * 4 + tid / 32, sink_part);

  // ---------------- dK·scale and dV ----------------
  Tensor cK = thr_dk.partition_C(make_identity_tensor(TiledK{}));
  Tensor cV = thr_dv.partition_C(make_identity_tensor(TiledV{}));
  if (m_end > m_first || params.dk_accum == nullptr)
    bwd_store_dkdv<kDeterministic, kHeadDim, Traits::kHeadDimV, Element>(
        params, key_rows_acc(acc_dk, cK, col0), key_rows_acc(acc_dv, cV, col0_v), key0, work,
        DkDvStage<kBlockN, Element>{smem.k[0].begin(), smem.v[0].begin(), 0});
#endif
}

}  // namespace flashattn::sm90
