// The sm_90a backward kernel whose GEMMs over a CTA's keys take them as N: for DeepSeek's
// (192, 128).
//
// The head-dim-split kernel (bwd_kernel_split_d.h) owns 64 keys per CTA, so every 64-row query
// block brings its Q, dO and a dQ reduce-add through L2 for 64 keys' work, which at (192, 128)
// bounds it. More keys do not fit with the keys as M: a warpgroup's WGMMA tile has 64 rows, and
// dK and dV of 128 keys beside both score tiles pass 240 registers. Here a CTA owns 96 keys and
// each consumer warpgroup 48 of them, as the N of every GEMM over them (FA3's swapped operands):
//   producer (WG 0): K and V once, then per query block Q (two stages) and dO (two) by TMA;
//   consumers (WG 1, WG 2), each over its 48 keys: S = Q·Kᵀ and dP = dO·Vᵀ for the block's 64
//                    queries, P and dS into shared memory (two stages), dVᵀ += dOᵀ·P and
//                    dKᵀ += Qᵀ·dS with the head dims as M; after one barrier dQ = dS·K over all
//                    96 keys for half of dQ's columns, which leave in two slabs per warpgroup as
//                    in the head-dim-split kernel. dKᵀ and dVᵀ leave through the K and V tiles.
// setmaxnreg moves registers from the producer (24) to the consumers (240). kDeterministic,
// kSoftcap, kSinkParts as bwd_kernel.h's.
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
struct BwdKeysNLayouts {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kHeadDimV = kHeadDimV_;
  using Tile = BwdTile<kHeadDim, kHeadDimV>;
  static_assert(Tile::kKeysAsN, "a tile of this kernel");
  static constexpr int kBlockM = Tile::kBlockM;  // query rows per block (the score GEMMs' M)
  static constexpr int kBlockN = Tile::kBlockN;  // keys per CTA
  static constexpr int kConsumerWGs = 2;
  static constexpr int kKeysPerWG = kBlockN / kConsumerWGs;  // every key GEMM's N
  static constexpr int kColsPerWG = kHeadDim / kConsumerWGs;  // of dQ
  static constexpr int kKeyTiles = 1;
  static constexpr int kStages = Tile::kStages;      // Q, P and dS buffers
  static constexpr int kStagesdO = Tile::kStagesdO;  // shared memory: 227 KiB per CTA
  static constexpr int kDqSlabCols = kColsPerWG / 2;  // dQ leaves in two slabs per warpgroup
  static constexpr int kThreads = 128 * (1 + kConsumerWGs);
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;
  static_assert(kBlockM == 64 && kKeysPerWG % 16 == 0 && kHeadDim % 64 == 0 &&
                    kHeadDimV % 64 == 0,
                "64-row query blocks, whole 16-key groups, and head dims of whole 64-column "
                "atoms (dKᵀ's and dVᵀ's M)");

  using TileQ = Shape<Int<kBlockM>, Int<kHeadDim>>;
  using TiledO = Shape<Int<kBlockM>, Int<kHeadDimV>>;
  using TileK = Shape<Int<kBlockN>, Int<kHeadDim>>;
  using TileV = Shape<Int<kBlockN>, Int<kHeadDimV>>;

  // Q, dO, V: swizzled K-major rows of 128 bytes; their transposed views (dKᵀ's and dVᵀ's A) are
  // MN-major with the head dim in whole atoms. K: of 64 bytes where a warpgroup's columns of dQ
  // (the transposed view's N) would start inside a 128-byte atom (d192: 96 each).
  using SmemAtom = GMMA::Layout_K_SW128_Atom<Element>;
  using SmemAtomK = conditional_t<kColsPerWG % 64 == 0, GMMA::Layout_K_SW128_Atom<Element>,
                                  GMMA::Layout_K_SW64_Atom<Element>>;
  template <int kDim, int kBuffers>  // (queries, d, stage)
  using SmemLayoutRows = decltype(tile_to_shape(
      SmemAtom{}, Shape<Int<kBlockM>, Int<kDim>, Int<kBuffers>>{}));
  template <int kDim, int kBuffers>  // (d, queries, stage): A of dKᵀ and dVᵀ
  using SmemLayoutRowsT = decltype(composition(
      SmemLayoutRows<kDim, kBuffers>{},
      make_ordered_layout(Shape<Int<kDim>, Int<kBlockM>, Int<kBuffers>>{}, Step<_2, _1, _3>{})));
  using SmemLayoutQ = SmemLayoutRows<kHeadDim, kStages>;
  using SmemLayoutQt = SmemLayoutRowsT<kHeadDim, kStages>;
  using SmemLayoutdO = SmemLayoutRows<kHeadDimV, kStagesdO>;
  using SmemLayoutdOt = SmemLayoutRowsT<kHeadDimV, kStagesdO>;
  using SmemLayoutK = decltype(tile_to_shape(SmemAtomK{}, TileK{}));
  using SmemLayoutV = decltype(tile_to_shape(SmemAtom{}, TileV{}));
  using SmemLayoutKt = decltype(composition(  // (d, keys): B of dQ
      SmemLayoutK{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, Step<_2, _1>{})));
  // P and dS as (queries, keys, stage), keys contiguous: the K-major A of dQ, where the
  // accumulator's neighbouring key columns are neighbours; as (keys, queries, stage) the MN-major
  // B of dVᵀ and dKᵀ, whose warpgroup's 48 keys start on a whole atom of 16.
  using SmemAtomP = GMMA::Layout_K_SW32_Atom<Element>;
  using SmemLayoutP = decltype(tile_to_shape(
      SmemAtomP{}, Shape<Int<kBlockM>, Int<kBlockN>, Int<kStages>>{}));
  using SmemLayoutPt = decltype(composition(
      SmemLayoutP{}, make_ordered_layout(Shape<Int<kBlockN>, Int<kBlockM>, Int<kStages>>{},
                                         Step<_2, _1, _3>{})));
  using DqLayout = DqSlabs<kHeadDim, kBlockM, kHeadDim / kDqSlabCols>;

  // S = Q·Kᵀ and dP = dO·Vᵀ over this warpgroup's keys (the atom is the same over either head
  // dim: the K extent only counts the instructions).
  using MmaSdP = decltype(make_tiled_mma(
      ss_atom<Element, Shape<Int<kBlockM>, Int<kKeysPerWG>, Int<kHeadDim>>>()));
  template <int kDim>  // dKᵀ += Qᵀ·dS or dVᵀ += dOᵀ·P over this warpgroup's keys
  using MmaKeyCols = decltype(make_tiled_mma(
      ss_atom<Element, Shape<Int<kDim>, Int<kKeysPerWG>, Int<kBlockM>>, GMMA::Major::MN,
              GMMA::Major::MN>()));
  using MmadK = MmaKeyCols<kHeadDim>;
  using MmadV = MmaKeyCols<kHeadDimV>;
  using MmadQ = decltype(make_tiled_mma(  // this warpgroup's columns of dQ = dS·K
      GMMA::ss_op_selector<Element, Element, float,
                           Shape<Int<kBlockM>, Int<kColsPerWG>, Int<kBlockN>>, GMMA::Major::K,
                           GMMA::Major::MN>()));
  static_assert(wgmma_atom_n<MmaSdP> == kKeysPerWG && wgmma_atom_n<MmadK> == kKeysPerWG &&
                    wgmma_atom_n<MmadV> == kKeysPerWG && wgmma_atom_n<MmadQ> == kColsPerWG,
                "a WGMMA atom narrower than its GEMM (registry::extended_wgmma_n)");
};
// The kernel's traits: its tiles and layouts, and the TMA loads and shared memory it shares with
// the head-dim-split kernel.
template <class Element, int kHeadDim, int kHeadDimV>
struct BwdKeysNTraits : BwdKeysNLayouts<Element, kHeadDim, kHeadDimV>,
                        BwdSharedKeyBlock<BwdKeysNLayouts<Element, kHeadDim, kHeadDimV>> {};

// The template parameters are bwd_kernel's (bwd_kernel.h).
template <class Traits, bool kDeterministic, bool kSoftcap, bool kSinkParts>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    bwd_kernel_keys_n(__grid_constant__ const BwdParams<Traits> params) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using Element = typename Traits::Element;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kHeadDimV = Traits::kHeadDimV;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kStages = Traits::kStages;
  constexpr int kConsumerWGs = Traits::kConsumerWGs;
  constexpr int kKeysPerWG = Traits::kKeysPerWG;
  constexpr int kColsPerWG = Traits::kColsPerWG;
  using SharedStorage = typename Traits::SharedStorage;
  extern __shared__ __align__(1024) char smem_raw[];
  SharedStorage& smem = *reinterpret_cast<SharedStorage*>(smem_raw);

  // Deterministic with a right bound: the hand-over runs down from the diagonal (bwd_kernel.h).
  const bool keys_descending = kDeterministic && params.keys.window_right >= 0;
  const BwdCtaWork work = bwd_cta_work<kBlockN, kBlockM>(params, keys_descending);
  if (!work.exists) return;
  const int n_block = work.n_block, m_first = work.m_first, m_end = work.m_end;
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
  const int key0 = n_block * kBlockN + wg * kKeysPerWG;  // this warpgroup's first key

  Tensor sK = make_tensor(make_smem_ptr(smem.k[0].begin()), typename Traits::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(smem.v[0].begin()), typename Traits::SmemLayoutV{});
  Tensor sKt = make_tensor(make_smem_ptr(smem.k[0].begin()), typename Traits::SmemLayoutKt{});
  Tensor sQ = make_tensor(make_smem_ptr(smem.q.begin()), typename Traits::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(smem.dout.begin()), typename Traits::SmemLayoutdO{});
  Tensor sQt = make_tensor(make_smem_ptr(smem.q.begin()), typename Traits::SmemLayoutQt{});
  Tensor sdOt = make_tensor(make_smem_ptr(smem.dout.begin()), typename Traits::SmemLayoutdOt{});
  Tensor sPt = make_tensor(make_smem_ptr(smem.p.begin()), typename Traits::SmemLayoutPt{});
  Tensor sdS = make_tensor(make_smem_ptr(smem.ds.begin()), typename Traits::SmemLayoutP{});
  Tensor sdSt = make_tensor(make_smem_ptr(smem.ds.begin()), typename Traits::SmemLayoutPt{});
  using MyKeysOfK = Shape<Int<kKeysPerWG>, Int<kHeadDim>>;
  using MyKeysOfV = Shape<Int<kKeysPerWG>, Int<kHeadDimV>>;
  using MyKeysT = Shape<Int<kKeysPerWG>, Int<kBlockM>, Int<kStages>>;  // of Pᵀ and dSᵀ
  auto mine = make_coord(wg, _0{});

  typename Traits::MmaSdP mma_sdp;
  typename Traits::MmadK mma_dk;
  typename Traits::MmadV mma_dv;
  typename Traits::MmadQ mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(tid);
  auto thr_dk = mma_dk.get_thread_slice(tid);
  auto thr_dv = mma_dv.get_thread_slice(tid);
  auto thr_dq = mma_dq.get_thread_slice(tid);
  Tensor tSrQ = thr_sdp.make_fragment_A(thr_sdp.partition_A(sQ));  // (MMA, 1, K, stage)
  Tensor tSrdO = thr_sdp.make_fragment_A(thr_sdp.partition_A(sdO));
  Tensor tSrK = thr_sdp.make_fragment_B(thr_sdp.partition_B(local_tile(sK, MyKeysOfK{}, mine)));
  Tensor tSrV = thr_sdp.make_fragment_B(thr_sdp.partition_B(local_tile(sV, MyKeysOfV{}, mine)));
  Tensor tdVrdOt = thr_dv.make_fragment_A(thr_dv.partition_A(sdOt));  // (MMA, M, K, stage)
  Tensor tdKrQt = thr_dk.make_fragment_A(thr_dk.partition_A(sQt));
  Tensor tdVrPt = thr_dv.make_fragment_B(  // (MMA, 1, K, stage)
      thr_dv.partition_B(local_tile(sPt, MyKeysT{}, make_coord(wg, _0{}, _0{}))));
  Tensor tdKrdSt =
      thr_dk.make_fragment_B(thr_dk.partition_B(local_tile(sdSt, MyKeysT{}, make_coord(wg, _0{}, _0{}))));
  Tensor tdQrdS = thr_dq.make_fragment_A(thr_dq.partition_A(sdS));  // (MMA, 1, K, stage)
  Tensor tdQrKt = thr_dq.make_fragment_B(thr_dq.partition_B(  // (MMA, N, K)
      local_tile(sKt, Shape<Int<kColsPerWG>, Int<kBlockN>>{}, mine)));

  using TileS = Shape<Int<kBlockM>, Int<kKeysPerWG>>;
  using TiledKt = Shape<Int<kHeadDim>, Int<kKeysPerWG>>;
  using TiledVt = Shape<Int<kHeadDimV>, Int<kKeysPerWG>>;
  using TiledQ = Shape<Int<kBlockM>, Int<kColsPerWG>>;
  Tensor acc_s = partition_fragment_C(mma_sdp, TileS{});   // S, then P
  Tensor acc_dp = partition_fragment_C(mma_sdp, TileS{});  // dP, then dS
  Tensor acc_dk = partition_fragment_C(mma_dk, TiledKt{});  // dKᵀ
  Tensor acc_dv = partition_fragment_C(mma_dv, TiledVt{});  // dVᵀ
  Tensor acc_dq = partition_fragment_C(mma_dq, TiledQ{});
  clear(acc_dk);
  clear(acc_dv);
  // The score tiles as the shared softmax steps take them: keys down the rows, queries across
  // (each thread's queries are its accumulator rows), with each element's (key, query).
  Tensor cS = thr_sdp.partition_C(make_identity_tensor(TileS{}));  // (query, key)
  Tensor rowcol_cS = make_tensor(cS.data(), acc_rowcol(cS.layout()));
  auto keys_down = [](auto& t) {
    return make_tensor(t.data(), select<1, 0>(acc_rowcol(t.layout())));
  };
  Tensor st_s = keys_down(acc_s);
  Tensor st_dp = keys_down(acc_dp);
  auto key_query = [&](int r, int c) {
    return make_tuple(get<1>(rowcol_cS(c, r)), get<0>(rowcol_cS(c, r)));
  };
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
  // LSE·log2(e) and D of this thread's query rows (the preprocess padded them to whole blocks),
  // loaded a block ahead, under the dQ/dV/dK GEMMs, so that the exponentials do not wait on
  // global memory.
  constexpr int kRowsHeld = decltype(size<0>(rowcol_cS))::value;
  float lse_next[kRowsHeld], dsum_next[kRowsHeld];
  auto load_rows = [&](int m) {
#pragma unroll
    for (int r = 0; r < kRowsHeld; ++r) {
      const int64_t row = rows_base + m * kBlockM + get<0>(rowcol_cS(r, 0));
      lse_next[r] = params.lse_log2[row];
      dsum_next[r] = params.softmax_d[row];
    }
  };
  if (m_end > m_first) load_rows(m_first);
#pragma unroll 1
  for (int m = m_first; m < m_end; ++m) {
    const int q0 = m * kBlockM;
    float lse_held[kRowsHeld], dsum_held[kRowsHeld];
#pragma unroll
    for (int r = 0; r < kRowsHeld; ++r) {
      lse_held[r] = lse_next[r];
      dsum_held[r] = dsum_next[r];
    }
    auto lse_of = [&](int c) { return lse_held[c]; };
    auto dsum_of = [&](int c) { return dsum_held[c]; };
    smem.pipe_q.consumer_wait(st);
    gemm_ss(mma_sdp, tSrQ(_, _, _, st.index), tSrK, acc_s);
    smem.pipe_do.consumer_wait(st_do);
    gemm_ss(mma_sdp, tSrdO(_, _, _, st_do.index), tSrV, acc_dp);
    if (m > m_first) dq_slabs.second(m - 1);  // once this block's score GEMMs are done
    warpgroup_wait<1>();  // S ready
    bwd_probabilities<kCap>(st_s, key_query, lse_of, work.keys, key0, q0, params.scale_log2,
                            params.softcap_pre,
                            work.keys.template block_needs_mask<kKeysPerWG>(
                                n_block * kConsumerWGs + wg, q0, q0 + kBlockM),
                            rP);
    if constexpr (kCap != CapSlope::kFolded) convert_fragment(acc_s, rP);
    // P and then dS into this block's stage, as (query, key). Both warpgroups' GEMMs read the
    // stage two blocks ago and completed before they passed the barrier below last block.
    // By stmatrix: each 16-byte row of 8 neighbouring keys of one query (the accumulators'
    // column direction) is contiguous in the keys-contiguous layout.
    auto r2s = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_sdp);
    auto thr_r2s = r2s.get_thread_slice(tid);
    auto my_keys = [&](auto* tiles) {  // (queries, this warpgroup's keys, stage)
      return thr_r2s.partition_D(local_tile(
          as_position_independent_swizzle_tensor(
              make_tensor(make_smem_ptr(tiles), typename Traits::SmemLayoutP{})),
          Shape<Int<kBlockM>, Int<kKeysPerWG>, Int<kStages>>{}, make_coord(_0{}, wg, _0{})));
    };
    copy(r2s, thr_r2s.retile_S(rP), my_keys(smem.p.begin())(_, _, _, st.index));
    // dVᵀ over this warpgroup's own P as soon as it is stored, under dS and the barrier below.
    cutlass::arch::fence_view_async_shared();  // generic-proxy stores -> WGMMA reads
    consumers_sync(BwdBarrier::PReady, 128, wg);
    gemm_accumulate(mma_dv, tdVrdOt(_, _, _, st_do.index), tdVrPt(_, _, _, st.index), acc_dv);
    warpgroup_wait<1>();  // dP ready (dVᵀ may still run)
    bwd_ds<kCap>(st_s, st_dp, dsum_of, lse_of, params.scale_log2);
    if constexpr (kSinkParts)
      if (sink_grad)
        sink_part += bwd_sink_share(st_dp, lse_of, params.sinks[work.head] * float(M_LOG2E));
    convert_fragment(acc_dp, rdS);
    copy(r2s, thr_r2s.retile_S(rdS), my_keys(smem.ds.begin())(_, _, _, st.index));
    // The dQ slab is free once the last block's second bulk add has read it. Deterministic: once
    // both of its adds have completed, the next key block may add into that query block.
    if (tid == 0) {
      if (kDeterministic && m > m_first)
        finish_bulk_adds_and_signal(dq_slabs.semaphore(m - 1));
      else
        tma_store_wait<0>();
    }
    cutlass::arch::fence_view_async_shared();
    consumers_sync(BwdBarrier::DsReady, 128 * kConsumerWGs);

    // dQ, whose bulk adds run under dKᵀ.
    gemm_ss(mma_dq, tdQrdS(_, _, _, st.index), tdQrKt, acc_dq);
    gemm_accumulate(mma_dk, tdKrQt(_, _, _, st.index), tdKrdSt(_, _, _, st.index), acc_dk);
    if (m + 1 < m_end) load_rows(m + 1);
    warpgroup_wait<2>();  // dVᵀ done: dO's last reader
    smem.pipe_do.consumer_release(st_do);
    warpgroup_wait<1>();  // dQ ready
    dq_slabs.store(0);
    if (tid == 0) {
      if constexpr (kDeterministic)  // after the key blocks before this one in hand-over order
        if (hand_over_runs(params))
          wait_for_count(dq_slabs.semaphore(m), dq_adds_before<kBlockN, kBlockM>(
                                                 work.keys, q0, n_block, keys_descending));
      dq_slabs.add(m, 0);
    }
    warpgroup_wait<0>();  // dKᵀ done: Q's last reader
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
  // dKᵀ and dVᵀ: (column, key) for each element, neighbouring registers neighbouring keys.
  Tensor cKt = thr_dk.partition_C(make_identity_tensor(TiledKt{}));
  Tensor cVt = thr_dv.partition_C(make_identity_tensor(TiledVt{}));
  if (m_end > m_first || params.dk_accum == nullptr)
    bwd_store_dkdv<kDeterministic, kHeadDim, kHeadDimV, Element>(
        params, key_cols_acc(acc_dk, cKt), key_cols_acc(acc_dv, cVt), key0, work,
        DkDvStage<kBlockN, Element>{smem.k[0].begin(), smem.v[0].begin(), wg * kKeysPerWG});
#endif
}

}  // namespace flashattn::sm90
