// The FlashAttention-3-style backward kernel for sm_90a.
//
// One CTA owns a block of kBlockN = 128 keys of one (entry, head) and walks the query blocks
// (kBlockM = 64 rows, 128 at d64) that see them. Three warpgroups:
//   producer (WG 0): one elected thread loads K and V once, then per query block Q and dO into
//                    two-stage mbarrier pipelines by TMA;
//   consumers (WG 1, WG 2): 64 keys each. Scores are computed transposed, Sᵀ = K·Qᵀ and
//                    dPᵀ = V·dOᵀ (keys down the WGMMA's M), so that Pᵀ and dSᵀ come out of the
//                    accumulators already as the register A operands of dV += Pᵀ·dO and
//                    dK += dSᵀ·Q. dS also goes to shared memory (two stages): once both
//                    warpgroups' dS are there, each computes dQ = dS·K for all 128 keys and
//                    its share of the block: half of its rows (d64), of the head dim (d128), or
//                    two and one of three 32-column slabs (d96), into f32 slabs (DqSlabs) that
//                    one thread adds to the global dQ accumulator with a bulk reduce-add. Deterministic mode: the producer's warps 1 and 2 add the
//                    slabs, in key-block order, and convert each query block's dQ once its
//                    last key block has added (bwd_write_dq).
//                    The rows' LSE·log2(e) and D = rowsum(dO ∘ O) come from global memory.
// dK·scale and dV leave at the end through the K/V tiles by 16-byte stores (StagedRows; GQA: f32
// atomics from registers into per-KV-head sums).
// setmaxnreg moves registers from the producer (24) to the consumers (240).
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

template <class Element_, int kHeadDim_>
struct BwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kHeadDimV = kHeadDim;  // one head dim (bwd_kernel_split_d.h takes two)
  using Tile = BwdTile<kHeadDim>;
  // Query rows per block (the tile table): 128 at d64 (FA3's tile there), so that the score
  // GEMMs run with N = 128 and the per-block costs (waits, barriers, stats) spread over twice
  // the FLOPs.
  static constexpr int kBlockM = Tile::kBlockM;
  static constexpr int kKeysPerWG = 64;   // keys per consumer warpgroup (the WGMMA's M)
  static constexpr int kConsumerWGs = 2;
  static constexpr int kBlockN = kKeysPerWG * kConsumerWGs;
  static_assert(Tile::kBlockN == kBlockN && !Tile::kSplitHeadDim && !Tile::kKeysAsN,
                "a tile of this kernel");
  static constexpr int kKeyTiles = kConsumerWGs;  // K and V as one TileK per warpgroup
  static constexpr int kStages = Tile::kStages;  // Q, dO and dS buffers
  static constexpr int kStagesdO = Tile::kStagesdO;
  // dQ = dS·K over the block's 128 keys is split between the warpgroups in slabs of kDqRows ×
  // kDqCols: by query rows when there are 128 (d64), else by columns of the head dim, one 64 ×
  // 64 slab each at d128; at d96, whose halves would start inside a swizzle atom (48 columns of
  // 64-byte rows, SmemAtom), three 32-column slabs, two for the first warpgroup. A warpgroup's
  // slabs are neighbours, in shared memory and in the accumulator (DqSlabs).
  static constexpr bool kDqSplitRows = kBlockM == 128;
  static constexpr int kDqRows = kDqSplitRows ? kBlockM / kConsumerWGs : kBlockM;
  static constexpr int kDqCols = kDqSplitRows                ? kHeadDim
                                 : kHeadDim % (64 * kConsumerWGs) == 0 ? kHeadDim / kConsumerWGs
                                                                       : 32;
  static constexpr int kDqSlabs = kDqSplitRows ? kConsumerWGs : kHeadDim / kDqCols;  // per block
  static constexpr int kDqSlabsPerWG = (kDqSlabs + kConsumerWGs - 1) / kConsumerWGs;  // at most
  static_assert(kHeadDim % kDqCols == 0 && kDqSlabs > (kConsumerWGs - 1) * kDqSlabsPerWG);
  __device__ static constexpr int dq_first_slab(int wg) { return wg * kDqSlabsPerWG; }
  __device__ static constexpr int dq_slabs(int wg) {
    if constexpr (kDqSlabs % kConsumerWGs == 0)
      return kDqSlabsPerWG;
    else
      return kDqSlabs - wg * kDqSlabsPerWG < kDqSlabsPerWG ? kDqSlabs - wg * kDqSlabsPerWG
                                                           : kDqSlabsPerWG;
  }
  static constexpr bool kEarlyDv = kBlockM == 64;  // dV issued before dPᵀ is read
  static constexpr bool kShuffledWarpGroup = !kDqSplitRows;  // the kernel's warpgroup index
  static constexpr int kThreads = 128 * (1 + kConsumerWGs);
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;

  using TileQ = Shape<Int<kBlockM>, Int<kHeadDim>>;
  using TileK = Shape<Int<kKeysPerWG>, Int<kHeadDim>>;  // one warpgroup's keys
  using TiledO = TileQ;
  using TileV = TileK;

  // Swizzled K-major rows for Q, dO, K, V (of 128 bytes, or of 64 where the head dim is no
  // multiple of 64 columns: d96); their transposed views are MN-major.
  using SmemAtom = conditional_t<kHeadDim % 64 == 0, GMMA::Layout_K_SW128_Atom<Element>,
                                 GMMA::Layout_K_SW64_Atom<Element>>;
  using SmemLayoutQ = decltype(tile_to_shape(  // Q and dO
      SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>, Int<kStages>>{}));
  using SmemLayoutdO = SmemLayoutQ;
  using SmemLayoutQt = decltype(composition(  // (d, queries, stage): B of dK and dV
      SmemLayoutQ{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockM>, Int<kStages>>{},
                                         Step<_2, _1, _3>{})));
  using SmemLayoutK = decltype(tile_to_shape(SmemAtom{}, TileK{}));  // per warpgroup: K and V
  using SmemLayoutV = SmemLayoutK;
  using SmemLayoutKt = decltype(composition(  // (d, keys): B of dQ
      SmemLayoutK{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kKeysPerWG>>{}, Step<_2, _1>{})));
  // One warpgroup's dS as the (queries, keys, stage) A operand of dQ, queries contiguous: the
  // pairs of neighbouring columns of the Sᵀ accumulator are neighbours here.
  using SmemLayoutdS = decltype(tile_to_shape(
      GMMA::Layout_MN_SW128_Atom<Element>{}, Shape<Int<kBlockM>, Int<kKeysPerWG>, Int<kStages>>{}));
  // The same as (keys, queries, stage), the shape of the dSᵀ accumulator, for its stores.
  using SmemLayoutdSt = decltype(composition(
      SmemLayoutdS{}, make_ordered_layout(Shape<Int<kKeysPerWG>, Int<kBlockM>, Int<kStages>>{},
                                          Step<_2, _1, _3>{})));
  using DqLayout = DqSlabs<kHeadDim, kDqRows, kHeadDim / kDqCols>;
  static constexpr int kDqSlabFloats = kDqRows * kDqCols;

  using MmaSdP = decltype(make_tiled_mma(  // Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ
      GMMA::ss_op_selector<Element, Element, float,
                           Shape<Int<kKeysPerWG>, Int<kBlockM>, Int<kHeadDim>>>()));
  using MmadKV = decltype(make_tiled_mma(  // dV += Pᵀ·dO, dK += dSᵀ·Q
      GMMA::rs_op_selector<Element, Element, float,
                           Shape<Int<kKeysPerWG>, Int<kHeadDim>, Int<kBlockM>>, GMMA::Major::K,
                           GMMA::Major::MN>()));
  using MmadQ = decltype(make_tiled_mma(  // one slab of dQ = dS·K, per 64 keys
      GMMA::ss_op_selector<Element, Element, float,
                           Shape<Int<kDqRows>, Int<kDqCols>, Int<kKeysPerWG>>, GMMA::Major::MN,
                           GMMA::Major::MN>()));
  static_assert(wgmma_atom_n<MmaSdP> == kBlockM && wgmma_atom_n<MmadKV> == kHeadDim &&
                    wgmma_atom_n<MmadQ> == kDqCols,
                "a WGMMA atom narrower than its GEMM (registry::extended_wgmma_n)");

  using TmaQ = BwdTmaLoad<Element, SmemLayoutQ, TileQ>;
  using TmadO = TmaQ;
  using TmaK = BwdTmaLoad<Element, SmemLayoutK, TileK>;
  using TmaV = TmaK;
  static constexpr uint32_t kBytesQ = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kBytesdO = kBytesQ;
  static constexpr uint32_t kBytesK = kKeysPerWG * kHeadDim * sizeof(Element);
  static constexpr uint32_t kBytesV = kBytesK;
  static constexpr uint32_t kBytesdQSlab = kDqSlabFloats * sizeof(float);

  struct SharedStorage {
    alignas(1024) ArrayEngine<Element, cosize_v<SmemLayoutK>> k[kConsumerWGs];
    alignas(1024) ArrayEngine<Element, cosize_v<SmemLayoutK>> v[kConsumerWGs];
    alignas(1024) ArrayEngine<Element, cosize_v<SmemLayoutQ>> q;
    alignas(1024) ArrayEngine<Element, cosize_v<SmemLayoutQ>> dout;
    alignas(1024) ArrayEngine<Element, cosize_v<SmemLayoutdS>> ds[kConsumerWGs];
    // Each warpgroup's slabs of dQ for the current query block, as in global memory.
    alignas(128) float dq[kConsumerWGs][kDqSlabsPerWG * kDqSlabFloats];
    // Deterministic mode: each dQ writer warp's copy of a complete slab (convert_dq_slab) and
    // the copy's barrier.
    alignas(128) float dq_staging[kConsumerWGs][kDqSlabFloats];
    uint64_t dq_staged[kConsumerWGs];
    uint64_t kv_full;
    TmaPipeline<kStages> pipe_q;
    TmaPipeline<kStages> pipe_do;
  };
  static_assert(sizeof(SharedStorage) <= 232448, "227 KiB of shared memory per CTA on sm_90");
  // dK and dV are staged in the K and V tiles (DkDvStage): each the CTA's keys × kHeadDim.
  static_assert(sizeof(SharedStorage::k) == kBlockN * kHeadDim * sizeof(Element) &&
                sizeof(SharedStorage::v) == sizeof(SharedStorage::k));
};

// kDeterministic: dQ through the semaphores (params.dq_semaphore), GQA dK/dV per query head. Its
// own instantiation: the branches cost the atomic path registers (ptxas spills, slower at d128).
// kSoftcap: scores capped (bwd_probabilities, bwd_ds); its own instantiation too, as a run-time
// test around the score loops slowed the plain kernels (benchmarks/README.md). kSinkParts: sums
// the sinks' gradient parts where the call has them (bwd_sink_grad; not with softcap, whose dS
// holds the cap's derivative: the launcher refuses that gradient); the plain kernel has an
// instantiation without, so that calls without sinks run its code as it was.
template <class Traits, bool kDeterministic, bool kSoftcap, bool kSinkParts>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    bwd_kernel(__grid_constant__ const BwdParams<Traits> params) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using Element = typename Traits::Element;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kKeysPerWG = Traits::kKeysPerWG;
  constexpr int kStages = Traits::kStages;
  constexpr int kConsumerWGs = Traits::kConsumerWGs;
  using SharedStorage = typename Traits::SharedStorage;
  extern __shared__ __align__(1024) char smem_raw[];
  SharedStorage& smem = *reinterpret_cast<SharedStorage*>(smem_raw);

  // Deterministic with a right bound (causal): the key blocks run lightest first and hand each
  // dQ slab downwards, from the block nearest the diagonal (the first to reach a query block)
  // to block 0; the hand-over order follows the launch order, so no CTA waits on one that may
  // not have started.
  const bool keys_descending = kDeterministic && params.keys.window_right >= 0;
  const BwdCtaWork work = bwd_cta_work<kBlockN, kBlockM>(params, keys_descending);
  if (!work.exists) return;
  const int n_block = work.n_block, m_first = work.m_first, m_end = work.m_end;
  const int col_begin = n_block * kBlockN;
  const int64_t rows_base = work.rows_base;  // the entry's LSE, D and dQ rows of this head

  // Warp-uniform by a shuffle (CUTLASS's canonical index), which ptxas can see, at d96 and d128:
  // from threadIdx.x / 128 it compiled them to more instructions (and spilled at d128 softcap)
  // and ran them slower; d64 ran faster from threadIdx.x (benchmarks/README.md).
  const int warp_group = Traits::kShuffledWarpGroup ? cutlass::canonical_warp_group_idx()
                                                    : int(threadIdx.x / 128);
  bwd_init_barriers(smem, 4 * kConsumerWGs, [&] {
#pragma unroll
    for (int w = 0; w < kConsumerWGs; ++w)
      cutlass::arch::ClusterTransactionBarrier::init(&smem.dq_staged[w], 1);
  });

  // The slabs of dQ: slab j of query block m in the accumulator, and where its rows and columns
  // start within the block.
  constexpr bool kSplitRows = Traits::kDqSplitRows;
  constexpr int kDqRows = Traits::kDqRows, kDqCols = Traits::kDqCols;
  auto slab_of = [&](int m, int j) {
    return params.dq_accum + (rows_base + m * kBlockM) * kHeadDim + j * Traits::kDqSlabFloats;
  };

  if (warp_group == 0) {  // producer: setmaxnreg gives its registers to the consumers
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
    const int warp = threadIdx.x / 32;
    if (warp == 0) {
      bwd_produce(params, smem, work);
    } else if (kDeterministic && warp <= kConsumerWGs) {  // dQ writer of warpgroup warp - 1
      const int wg = warp - 1;
      int phase = 0;  // of the staging copy's barrier
      auto semaphore = [&](int m) {
        return dq_semaphore<kBlockM, kConsumerWGs>(params, rows_base, m, wg);
      };
      // The entry's dQ rows of this head.
      Element* dq = params.dq + work.seq.batch * params.dq_batch_stride +
                    work.head * params.dq_head_stride +
                    int64_t(work.seq.q_start) * params.dq_row_stride;
      const int first_slab = Traits::dq_first_slab(wg), slabs = Traits::dq_slabs(wg);
      bwd_write_dq(
          smem.dq[wg], slabs * Traits::kBytesdQSlab, wg, m_first, m_end,
          [&](int m) { return slab_of(m, first_slab); },
          semaphore,
          [&](int m) { return dq_key_blocks<kBlockN, kBlockM>(work.keys, m * kBlockM); },
          [&, hand_over = hand_over_runs(params)](int m) {
            return hand_over ? dq_adds_before<kBlockN, kBlockM>(work.keys, m * kBlockM, n_block,
                                                                keys_descending)
                             : -1;
          },
          [&](int m) {
#pragma unroll 1
            for (int j = first_slab; j < first_slab + slabs; ++j)
              convert_dq_slab<Traits>(params, slab_of(m, j), smem.dq_staging[wg],
                                      &smem.dq_staged[wg], phase, dq, work.seq.seqlen_q,
                                      m * kBlockM + (kSplitRows ? j * kDqRows : 0),
                                      kSplitRows ? 0 : j * kDqCols);
          });
    }
    return;
  }

  // ---------------- consumers ----------------
  cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
  const int wg = warp_group - 1;
  const int tid = threadIdx.x % 128;
  const int key0 = col_begin + wg * kKeysPerWG;  // this warpgroup's first key

  Tensor sK = make_tensor(make_smem_ptr(smem.k[wg].begin()), typename Traits::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(smem.v[wg].begin()), typename Traits::SmemLayoutK{});
  Tensor sQ = make_tensor(make_smem_ptr(smem.q.begin()), typename Traits::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(smem.dout.begin()), typename Traits::SmemLayoutQ{});
  Tensor sQt = make_tensor(make_smem_ptr(smem.q.begin()), typename Traits::SmemLayoutQt{});
  Tensor sdOt = make_tensor(make_smem_ptr(smem.dout.begin()), typename Traits::SmemLayoutQt{});
  Tensor sdS = make_tensor(make_smem_ptr(smem.ds[wg].begin()), typename Traits::SmemLayoutdS{});
  // This warpgroup's share of dQ: its rows of warpgroup w's dS; slab b's columns of w's keys.
  const int first_slab = Traits::dq_first_slab(wg), slabs = Traits::dq_slabs(wg);
  auto sdS_of = [&](int w) {
    return local_tile(
        make_tensor(make_smem_ptr(smem.ds[w].begin()), typename Traits::SmemLayoutdS{}),
        Shape<Int<kDqRows>, Int<kKeysPerWG>, Int<kStages>>{},
        make_coord(Traits::kDqSplitRows ? wg : 0, _0{}, _0{}));
  };
  auto sKt_of = [&](int w, int b) {
    const int slab = first_slab + b < Traits::kDqSlabs ? first_slab + b : Traits::kDqSlabs - 1;
    return local_tile(
        make_tensor(make_smem_ptr(smem.k[w].begin()), typename Traits::SmemLayoutKt{}),
        Shape<Int<kDqCols>, Int<kKeysPerWG>>{}, make_coord(Traits::kDqSplitRows ? 0 : slab, _0{}));
  };

  typename Traits::MmaSdP mma_sdp;
  typename Traits::MmadKV mma_dkv;
  typename Traits::MmadQ mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(tid);
  auto thr_dkv = mma_dkv.get_thread_slice(tid);
  auto thr_dq = mma_dq.get_thread_slice(tid);
  Tensor tSrK = thr_sdp.make_fragment_A(thr_sdp.partition_A(sK));     // (MMA, 1, K)
  Tensor tSrV = thr_sdp.make_fragment_A(thr_sdp.partition_A(sV));
  Tensor tSrQ = thr_sdp.make_fragment_B(thr_sdp.partition_B(sQ));     // (MMA, 1, K, stage)
  Tensor tSrdO = thr_sdp.make_fragment_B(thr_sdp.partition_B(sdO));
  Tensor tdKrQt = thr_dkv.make_fragment_B(thr_dkv.partition_B(sQt));  // (MMA, N, K, stage)
  Tensor tdVrdOt = thr_dkv.make_fragment_B(thr_dkv.partition_B(sdOt));
  // dQ's operands per 64 keys: dS (MMA, 1, K, stage) and slab b's Kᵀ (MMA, 1, K).
  Tensor tdQrdS0 = thr_dq.make_fragment_A(thr_dq.partition_A(sdS_of(0)));
  Tensor tdQrdS1 = thr_dq.make_fragment_A(thr_dq.partition_A(sdS_of(1)));
  auto tdQrKt_of = [&](int w, int b) {
    return thr_dq.make_fragment_B(thr_dq.partition_B(sKt_of(w, b)));
  };
  static_assert(kConsumerWGs == 2);

  using TileS = Shape<Int<kKeysPerWG>, Int<kBlockM>>;
  Tensor acc_s = partition_fragment_C(mma_sdp, TileS{});  // Sᵀ, then Pᵀ
  Tensor acc_dp = partition_fragment_C(mma_sdp, TileS{});  // dPᵀ, then dSᵀ
  Tensor acc_dk = partition_fragment_C(mma_dkv, typename Traits::TileK{});
  Tensor acc_dv = partition_fragment_C(mma_dkv, typename Traits::TileK{});
  using AccDq = decltype(partition_fragment_C(mma_dq, Shape<Int<kDqRows>, Int<kDqCols>>{}));
  AccDq acc_dq[Traits::kDqSlabsPerWG];  // the warpgroup's slabs; the first `slabs` stored
  clear(acc_dk);
  clear(acc_dv);
  Tensor rowcol_s = make_tensor(acc_s.data(), acc_rowcol(acc_s.layout()));
  Tensor rowcol_dp = make_tensor(acc_dp.data(), acc_rowcol(acc_dp.layout()));
  // (key, query) of every Sᵀ element within the warpgroup's tile.
  Tensor cS = thr_sdp.partition_C(make_identity_tensor(TileS{}));
  Tensor rowcol_cS = make_tensor(cS.data(), acc_rowcol(cS.layout()));
  // Pᵀ and dSᵀ in Element as the register A operands of dV and dK.
  auto rP = make_tensor<Element>(acc_as_operand_a(acc_s.layout()));
  // Pᵀ in 16 bits is made before dS where dV is issued early; at d64 there are no registers to
  // hold it that long.
  constexpr CapSlope kCap = !kSoftcap           ? CapSlope::kNone
                            : Traits::kEarlyDv ? CapSlope::kFolded
                                               : CapSlope::kFromP;
  // Folded, acc_s holds P·(1 − t²) after bwd_probabilities: rP must come from there only.
  static_assert(kCap != CapSlope::kFolded || Traits::kEarlyDv);
  auto rdS = make_tensor<Element>(acc_as_operand_a(acc_dp.layout()));
  float* sdq = smem.dq[wg];

  // The sinks' gradient: this thread's share over the CTA's keys (bwd_sink_grad).
  static_assert(!kSinkParts || kCap == CapSlope::kNone);
  const bool sink_grad = kSinkParts && params.sink_parts != nullptr;
  float sink_part = 0.f;
  PipelineState<kStages> st;
  if (m_end > m_first) cutlass::arch::ClusterTransactionBarrier::wait(&smem.kv_full, 0);
  // The rows' LSE and D straight from global memory (the preprocess wrote them before this
  // launch; padded to whole blocks), a block ahead so that the exponentials do not wait on the
  // loads. Each thread needs 16 of the 64 rows; held as 64 registers they spilled (ptxas), and
  // the spill store waited on the load. So lane L holds rows L, L + 32, …, and a shuffle hands
  // each use its row.
  constexpr int kHeld = kBlockM / 32;
  float lse_next[kHeld], dsum_next[kHeld];
  auto load_rows = [&](int m) {
    const int64_t rows_at = rows_base + m * kBlockM + tid % 32;
#pragma unroll
    for (int i = 0; i < kHeld; ++i) {
      lse_next[i] = params.lse_log2[rows_at + 32 * i];
      dsum_next[i] = params.softmax_d[rows_at + 32 * i];
    }
  };
  if (m_end > m_first) load_rows(m_first);
#pragma unroll 1
  for (int m = m_first; m < m_end; ++m) {
    const int q0 = m * kBlockM;
    float lse_held[kHeld], dsum_held[kHeld];
#pragma unroll
    for (int i = 0; i < kHeld; ++i) {
      lse_held[i] = lse_next[i];
      dsum_held[i] = dsum_next[i];
    }
    // Column c's query lies in the same 32 for every lane (the column's 8-query group is
    // uniform), so the lane that holds it offers the same register.
    auto row_value = [&](const float (&held)[kHeld], int c) {
      const int q = get<1>(rowcol_cS(0, c));
      return __shfl_sync(0xffffffffu, held[q / 32], q % 32);
    };
    smem.pipe_q.consumer_wait(st);
    gemm_ss(mma_sdp, tSrK, tSrQ(_, _, _, st.index), acc_s);
    smem.pipe_do.consumer_wait(st);
    gemm_ss(mma_sdp, tSrV, tSrdO(_, _, _, st.index), acc_dp);
    warpgroup_wait<1>();  // Sᵀ ready
    bwd_probabilities<kCap>(
        rowcol_s, rowcol_cS, [&](int c) { return row_value(lse_held, c); }, work.keys, key0, q0,
        params.scale_log2, params.softcap_pre,
        work.keys.template block_needs_mask<kKeysPerWG>(n_block * kConsumerWGs + wg, q0,
                                                        q0 + kBlockM),
        rP);
    // dV as soon as Pᵀ is ready, under dPᵀ; with 128-query blocks that holds Pᵀ twice (f32 for
    // dS, Element for dV) beside both score accumulators, too many registers: dV after dS then.
    if constexpr (Traits::kEarlyDv) {
      if constexpr (kCap != CapSlope::kFolded) convert_fragment(acc_s, rP);
      gemm_accumulate(mma_dkv, rP, tdVrdOt(_, _, _, st.index), acc_dv);
      warpgroup_wait<1>();  // dPᵀ ready (dV may still run)
    } else {
      warpgroup_wait<0>();  // dPᵀ ready
    }
    bwd_ds<kCap>(
        rowcol_s, rowcol_dp, [&](int c) { return row_value(dsum_held, c); },
        [&](int c) { return row_value(lse_held, c); }, params.scale_log2);
    if constexpr (kSinkParts)
      if (sink_grad)
        sink_part += bwd_sink_share(rowcol_dp, [&](int c) { return row_value(lse_held, c); },
                                    params.sinks[work.head] * float(M_LOG2E));
    if constexpr (!Traits::kEarlyDv) convert_fragment(acc_s, rP);
    convert_fragment(acc_dp, rdS);

    // dS to shared memory as (query, key) in this block's stage. The other warpgroup read the
    // stage two blocks ago (its dQ GEMM completed before it passed the barrier below last
    // block); the slabs must be free: the previous block's bulk add has read them once its
    // thread's wait returns (deterministic: the writer warp's DqEmpty, below).
    if (!kDeterministic && tid == 0) tma_store_wait<0>();
    // rdS holds dSᵀ register for register like the accumulator, stored by stmatrix: each
    // 16-byte row of 8 neighbouring queries of one key (the accumulator's column direction) is
    // contiguous in the queries-contiguous dS layout (fewer instructions in the d64 loop). Only
    // deterministic d64 spilled in its loop that way (ptxas): there one pair of neighbouring
    // queries at a time, indexed as (key, query).
    if constexpr (!kDeterministic || kHeadDim > 64) {
      auto r2s_ds = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_sdp);
      auto thr_r2s_ds = r2s_ds.get_thread_slice(tid);
      Tensor tdSsdS = thr_r2s_ds.partition_D(as_position_independent_swizzle_tensor(
          make_tensor(make_smem_ptr(smem.ds[wg].begin()), typename Traits::SmemLayoutdSt{})));
      copy(r2s_ds, thr_r2s_ds.retile_S(make_tensor(rdS.data(), acc_dp.layout())),
           tdSsdS(_, _, _, st.index));
    } else {
      Tensor rowcol_rdS = make_tensor(rdS.data(), acc_rowcol(acc_dp.layout()));
      constexpr int kCols = decltype(size<1>(rowcol_rdS))::value;
#pragma unroll
      for (int r = 0; r < size<0>(rowcol_rdS); ++r)
#pragma unroll
        for (int c = 0; c < kCols; c += 2) {  // columns c, c+1 are neighbouring queries
          cutlass::Array<Element, 2> pair;
          pair[0] = rowcol_rdS(r, c);
          pair[1] = rowcol_rdS(r, c + 1);
          *reinterpret_cast<cutlass::Array<Element, 2>*>(
              &sdS(get<1>(rowcol_cS(r, c)), get<0>(rowcol_cS(r, c)), st.index)) = pair;
        }
    }
    if constexpr (!Traits::kEarlyDv)
      gemm_accumulate(mma_dkv, rP, tdVrdOt(_, _, _, st.index), acc_dv);
    cutlass::arch::fence_view_async_shared();  // generic-proxy stores -> WGMMA reads
    consumers_sync(BwdBarrier::DsReady, 128 * kConsumerWGs);

    // This warpgroup's dQ slabs over both warpgroups' keys, then dK; dQ leaves under dK. A
    // warpgroup with fewer slabs than kDqSlabsPerWG (d96's second) computes its last one again
    // rather than branch around the GEMMs: WGMMAs on a path that ptxas cannot prove uniform are
    // serialized, every one in the kernel (C7520). The copy is never stored, and costs the
    // tensor cores a slab's GEMM, not the block: the other warpgroup is then at its second slab.
#pragma unroll
    for (int b = 0; b < Traits::kDqSlabsPerWG; ++b) warpgroup_fence_operand(acc_dq[b]);
    warpgroup_arrive();
#pragma unroll
    for (int b = 0; b < Traits::kDqSlabsPerWG; ++b) {
      Tensor tdQrKt0 = tdQrKt_of(0, b), tdQrKt1 = tdQrKt_of(1, b);
      mma_dq.accumulate_ = GMMA::ScaleOut::Zero;
#pragma unroll
      for (int k = 0; k < size<2>(tdQrKt0); ++k) {
        gemm(mma_dq, tdQrdS0(_, _, k, st.index), tdQrKt0(_, _, k), acc_dq[b]);
        mma_dq.accumulate_ = GMMA::ScaleOut::One;
      }
#pragma unroll
      for (int k = 0; k < size<2>(tdQrKt1); ++k)
        gemm(mma_dq, tdQrdS1(_, _, k, st.index), tdQrKt1(_, _, k), acc_dq[b]);
    }
    warpgroup_commit_batch();
#pragma unroll
    for (int b = 0; b < Traits::kDqSlabsPerWG; ++b) warpgroup_fence_operand(acc_dq[b]);
    gemm_accumulate(mma_dkv, rdS, tdKrQt(_, _, _, st.index), acc_dk);
    if (m + 1 < m_end) load_rows(m + 1);
    warpgroup_wait<1>();  // dV and dQ done: dO's last reader
    smem.pipe_do.consumer_release(st);
    Tensor cdQ = thr_dq.partition_C(make_identity_tensor(Shape<Int<kDqRows>, Int<kDqCols>>{}));
    if constexpr (kDeterministic) consumers_sync(BwdBarrier::DqEmpty, kDqSlabThreads, wg);
#pragma unroll
    for (int b = 0; b < Traits::kDqSlabsPerWG; ++b) {
      if (b >= slabs) break;
#pragma unroll
      for (int i = 0; i < size(acc_dq[b]); i += 2) {  // elements i, i+1: neighbouring columns
        const int at = b * Traits::kDqSlabFloats +
                       Traits::DqLayout::in_slab(get<0>(cdQ(i)), get<1>(cdQ(i)));
        *reinterpret_cast<float2*>(&sdq[at]) = make_float2(acc_dq[b](i), acc_dq[b](i + 1));
      }
    }
    cutlass::arch::fence_view_async_shared();  // generic-proxy stores -> bulk-copy reads
    if constexpr (kDeterministic) {  // to the writer warp
      barrier_arrive(BwdBarrier::DqFull, kDqSlabThreads, wg);
    } else {
      consumers_sync(BwdBarrier::DqReady, 128, wg);
      if (tid == 0) {  // the slabs of a query block follow each other (DqSlabs)
        bulk_reduce_add_f32(slab_of(m, first_slab), sdq, slabs * Traits::kBytesdQSlab);
        tma_store_arrive();  // commit the bulk group
      }
    }
    warpgroup_wait<0>();  // dK done: Q's last reader
    smem.pipe_q.consumer_release(st);
    st.advance();
  }
  if (!kDeterministic && tid == 0) tma_store_wait<0>();  // the slab stays until the add read it

  static_assert(Traits::kConsumerWGs * 4 <= kSinkWarps);
  if (kSinkParts && sink_grad)
    store_sink_part(params.sink_parts + work.sink_slot, wg * 4 + tid / 32, sink_part);

  // ---------------- dK·scale and dV ----------------
  Tensor cKV = thr_dkv.partition_C(make_identity_tensor(typename Traits::TileK{}));
  if (m_end > m_first || params.dk_accum == nullptr)
    bwd_store_dkdv<kDeterministic, kHeadDim, kHeadDim, Element>(
        params, key_rows_acc(acc_dk, cKV, 0), key_rows_acc(acc_dv, cKV, 0), key0, work,
        DkDvStage<kBlockN, Element>{smem.k[0].begin(), smem.v[0].begin(), wg * kKeysPerWG});
#endif
}

}  // namespace flashattn::sm90
