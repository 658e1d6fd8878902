// The FlashAttention-3-style forward kernel for sm_90a.
//
// One CTA computes a kBlockM = 128 row tile of O for one (batch, head): three warpgroups.
//   producer (WG 0): one elected thread issues TMA loads — Q into a kQStages-deep ring, K and V
//                    blocks into two kStages-deep mbarrier pipelines, walking key blocks last to
//                    first so that only the first block visited needs the sequence-end mask;
//   consumers (WG 1, WG 2): 64 query rows each; S = Q·Kᵀ by WGMMA from shared memory,
//                    online softmax in registers, O += P·V by WGMMA with P from registers.
// Intra-warpgroup overlap (template): the next block's Q·Kᵀ is issued with this block's P·V,
// before the softmax that needs only the former; with two Q buffers this runs on across tiles
// (the next tile's first Q·Kᵀ goes out beside this tile's last P·V, and this tile's O is stored
// while the next tile's first softmax waits on nothing). Whether the softmax also runs beside
// the P·V is where ptxas puts the wait for it (sass_report.py 'EX2 before wait'): it does in the
// FP8 d64/d128 kernels; in the 16-bit and FP8 d256 ones the wait lands above the softmax (FP8
// d256: 4-11% faster so; 16-bit: moving it below with a vote and a branch cost 1-8%;
// benchmarks/README.md, 2026-11-30). Ping-pong (runtime flag):
// two named barriers hand the tensor cores back and forth between the consumer warpgroups, so
// that one warpgroup's softmax hides under the other's GEMMs. Key blocks that need no mask may
// run a copy of the loop without the mask and softcap tests (Tile::kUnmaskedLoop). setmaxnreg
// moves registers from the producer (24) to the consumers (240). Persistent: each CTA walks a
// share of the tiles.
// Epilogue: O and LSE straight from registers, O by 16-byte stores.
// FP8 (Element = e4m3, from the quantize step): Q·Kᵀ and P·V by QGMMA, the Q and K descales
// folded into each key block's softmax scale, V's descale into O's rescale factor, P converted to
// e4m3 in registers (V's keys ordered to match, fp8_layout.h), O written in bf16 or fp16 (V's
// head dims ordered so that each thread holds whole 16-byte chunks of O, fp8_v_rows.h).
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/numeric_conversion.h>
#include <cuda_fp8.h>

#include "../common/block_range.h"
#include "fp8_v_rows.h"
#include "fwd_tail.h"
#include "fwd_timeline.h"
#include "grid_dependency.h"
#include "pipeline.h"
#include "softmax.h"
#include "tma_tensor.h"

namespace flashattn::sm90 {

using namespace cute;

// The consumer's lambdas run at several call sites; an outlined call would put the accumulators
// on a local-memory stack.
#define FLASHATTN_INLINE __attribute__((always_inline))

// Tile: kBlockN (keys per block), kStages (K/V pipeline depth), kQStages (Q buffers), and the
// code-shape choices kUnmaskedLoop, kTailSplit and, FP8 tiles only, kIeeeDescaleRatio (below).
template <class Element_, int kHeadDim_, class Tile, bool kIntraWGOverlap_>
struct FwdTraits {
  using Element = Element_;  // of Q, K and V
  static constexpr bool kFp8 = sizeof(Element) == 1;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = 128;  // two consumer warpgroups of 64 rows
  static constexpr int kRowsPerWG = 64;
  static constexpr int kBlockN = Tile::kBlockN;
  static constexpr int kStages = Tile::kStages;
  static constexpr int kQStages = Tile::kQStages;
  static constexpr bool kIntraWGOverlap = kIntraWGOverlap_;
  // A second copy of the key-block loop for the blocks that need no mask or softcap, so that
  // their loop has none of those tests (branches) in it; which kernels gain is measured.
  static constexpr bool kUnmaskedLoop = Tile::kUnmaskedLoop;
  // FP8: the V-descale ratio by IEEE division, whose slow path moves ptxas's P·V wait (below).
  static constexpr bool kIeeeDescaleRatio = [] {
    if constexpr (kFp8) {
      return Tile::kIeeeDescaleRatio;
    } else {
      return false;
    }
  }();
  // Calls whose tiles all visit the same key blocks may split the last partial wave's tiles by
  // key blocks (fwd_tail.h): a second instantiation of the kernel, so not in the overlap
  // ablation.
  static constexpr bool kTailSplit = Tile::kTailSplit && kIntraWGOverlap_;
  // The next tile's first Q·Kᵀ beside this tile's last P·V: needs the next Q in its own buffer.
  static constexpr bool kCrossTileOverlap = kIntraWGOverlap && kQStages > 1;
  static constexpr int kConsumerWGs = kBlockM / kRowsPerWG;
  static constexpr int kThreads = 128 * (1 + kConsumerWGs);
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;

  using TileQ = Shape<Int<kRowsPerWG>, Int<kHeadDim>>;
  using TileKV = Shape<Int<kBlockN>, Int<kHeadDim>>;

  // K-major rows swizzled over 128 bytes (64 for e4m3 at d64: a row has no more).
  using SmemAtom = conditional_t<kHeadDim * sizeof(Element) % 128 == 0,
                                 GMMA::Layout_K_SW128_Atom<Element>,
                                 GMMA::Layout_K_SW64_Atom<Element>>;
  using SmemLayoutQ = decltype(tile_to_shape(  // per consumer WG
      SmemAtom{}, Shape<Int<kRowsPerWG>, Int<kHeadDim>, Int<kQStages>>{}));
  using SmemLayoutK = decltype(tile_to_shape(
      SmemAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
  // Vᵀ is the (head_dim, kBlockN) B operand of P·V. 16-bit: V is stored as it comes and Vᵀ is
  // the same bytes, MN-major. FP8 WGMMA takes K-major operands only: the quantize step wrote V
  // key-major (rows in fp8_v_row_head_dim order), and the TMA loads Vᵀ as it is.
  using SmemLayoutVtOfV = decltype(composition(
      SmemLayoutK{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{},
                                         Step<_2, _1, _3>{})));
  using SmemAtomVtFp8 =
      conditional_t<kBlockN % 128 == 0, GMMA::Layout_K_SW128_Atom<Element>,
                    conditional_t<kBlockN % 64 == 0, GMMA::Layout_K_SW64_Atom<Element>,
                                  GMMA::Layout_K_SW32_Atom<Element>>>;
  using SmemLayoutVtFp8 = decltype(tile_to_shape(
      SmemAtomVtFp8{}, Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{}));
  using SmemLayoutVt = conditional_t<kFp8, SmemLayoutVtFp8, SmemLayoutVtOfV>;
  using SmemLayoutV = conditional_t<kFp8, SmemLayoutVtFp8, SmemLayoutK>;  // as the TMA writes it
  using TileV = conditional_t<kFp8, Shape<Int<kHeadDim>, Int<kBlockN>>, TileKV>;

  using MmaQK = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float,
                           Shape<Int<kRowsPerWG>, Int<kBlockN>, Int<kHeadDim>>>()));
  using MmaPV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float,
                           Shape<Int<kRowsPerWG>, Int<kHeadDim>, Int<kBlockN>>,
                           GMMA::Major::K, kFp8 ? GMMA::Major::K : GMMA::Major::MN>()));

  // (seqlen, head_dim, heads, batch) with head_dim contiguous.
  using GmemTensor = sm90::GmemTensor<Element>;
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, take<0, 2>(SmemLayoutQ{}),
                                      TileQ{}, _1{}));
  using TmaKV = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{},
                                       take<0, 2>(SmemLayoutK{}), TileKV{}, _1{}));
  using TmaV = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, take<0, 2>(SmemLayoutV{}),
                                      TileV{}, _1{}));
  static constexpr uint32_t kBytesQ = kRowsPerWG * kHeadDim * sizeof(Element);
  static constexpr uint32_t kBytesKV = kBlockN * kHeadDim * sizeof(Element);

  struct SharedStorage {
    alignas(1024) ArrayEngine<Element, cosize_v<SmemLayoutQ>> q[kConsumerWGs];
    alignas(1024) ArrayEngine<Element, cosize_v<SmemLayoutK>> k;
    alignas(1024) ArrayEngine<Element, cosize_v<SmemLayoutV>> v;
    TmaPipeline<kQStages> pipe_q;
    TmaPipeline<kStages> pipe_k;
    TmaPipeline<kStages> pipe_v;
  };
  static_assert(sizeof(SharedStorage) <= 232448, "227 KiB of shared memory per CTA on sm_90");
};

template <class Traits>
struct FwdParams {
  typename Traits::TmaQ tma_q;
  typename Traits::TmaKV tma_k;
  typename Traits::TmaV tma_v;
  void* o;  // Element, or for FP8 bf16 (o_bf16) or fp16
  int64_t o_batch_stride, o_row_stride, o_head_stride;
  float* lse;  // (batch, heads_q, seqlen_q)
  // `batch < 0` is the FP8 softmax's run-time false (ScaledOnlineSoftmax::step): never let the
  // compiler know batch is positive.
  int batch, heads_q, heads_kv, seqlen_q, seqlen_k;
  int num_m_blocks, num_tiles;
  int tiles_per_unit;  // 2 with a right bound on the keys over several query blocks, else 1
  KeyRange keys;
  float scale_log2;   // scale·log2(e), or softcap·log2(e) when softcap is on
  float softcap_pre;  // scale/softcap when softcap is on (scores become tanh(s·scale/softcap))
  bool softcap;
  bool pingpong;
  // FP8: descales (batch, heads, blocks): Q per query tile, K and V per key block.
  const float* q_descale;
  const float* k_descale;
  const float* v_descale;
  int num_n_blocks;  // key blocks per head (V's key-major rows hold num_n_blocks·kBlockN keys)
  bool o_bf16;
  FwdTail tail;  // the tail launch's pieces (fwd_tail.h)
};

// Named barriers (CUTLASS reserves the first ids; NamedBarrier adds that offset).
enum class FwdBarrier : uint32_t {
  TurnWG0 = 0,  // ping-pong: consumer WG0 may issue its GEMMs
  TurnWG1 = 1,  // ping-pong: consumer WG1 may issue its GEMMs
};

__device__ inline void named_sync(FwdBarrier b, uint32_t threads) {
  cutlass::arch::NamedBarrier::sync(threads, static_cast<uint32_t>(b));
}
__device__ inline void named_arrive(FwdBarrier b, uint32_t threads) {
  cutlass::arch::NamedBarrier::arrive(threads, static_cast<uint32_t>(b));
}

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

// The schedule. A tile is one 128-row query block of one (batch, head); a work unit is
// tiles_per_unit consecutive tiles, and CTA b of G takes units b, b + G, b + 2G, ... Tiles of one
// head are neighbours, so the CTAs running at one time share few heads' K/V in L2. Without a
// right bound on the keys (or with one query block per head) every tile costs the same: one tile
// per unit, query blocks in order. With one (causal), query block m sees about m + 1 key blocks:
// a unit is two tiles, the head's heaviest block left with its lightest (M−1 with 0, M−2 with 1,
// ...), so that every unit costs about M + 1 blocks and a static share is a balanced one.
struct WorkTile {
  int m_block, head, batch;
  int n_min, n_max;  // key blocks visited, last to first
  int slot;          // a tail piece's workspace slot
  __device__ int n_blocks() const { return n_max > n_min ? n_max - n_min : 0; }
};

template <class Traits>
__device__ WorkTile decode_tile(const FwdParams<Traits>& p, int tile) {
  WorkTile t;
  const int i = tile % p.num_m_blocks;  // position within the head's tiles
  const int rest = tile / p.num_m_blocks;
  t.m_block = p.tiles_per_unit == 1 ? i : (i % 2 == 0 ? p.num_m_blocks - 1 - i / 2 : i / 2);
  t.head = rest % p.heads_q;
  t.batch = rest / p.heads_q;
  t.slot = -1;
  p.keys.template blocks<Traits::kBlockN>(t.m_block * Traits::kBlockM,
                                          (t.m_block + 1) * Traits::kBlockM, t.n_min, t.n_max);
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

// kTailPieces: the tail launch (fwd_tail.h), pieces of tiles whose O and LSE go to workspace
// slots; else whole tiles.
template <class Traits, bool kTailPieces = false>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    fwd_kernel(__grid_constant__ const FwdParams<Traits> params) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using Walk = conditional_t<kTailPieces, TailPieceWalk<Traits>, TileWalk<Traits>>;
  using Element = typename Traits::Element;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kRowsPerWG = Traits::kRowsPerWG;
  constexpr int kStages = Traits::kStages;
  constexpr int kQStages = Traits::kQStages;
  constexpr int kConsumerWGs = Traits::kConsumerWGs;
  using SharedStorage = typename Traits::SharedStorage;

  extern __shared__ __align__(1024) char smem_raw[];
  SharedStorage& smem = *reinterpret_cast<SharedStorage*>(smem_raw);

  // The tail launches may start as SMs free up (fwd_tail.h); no launch of anyone else's.
  if constexpr (Traits::kTailSplit) {
    if (params.tail.tiles > 0) launch_dependent_grids();
  }
  const int warp_group = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    // One arrival per consumer warp releases a stage (see TmaPipeline::consumer_release).
    smem.pipe_q.init(4 * kConsumerWGs);
    smem.pipe_k.init(4 * kConsumerWGs);
    smem.pipe_v.init(4 * kConsumerWGs);
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  if (warp_group == 0) {
    // ---------------- producer: warp 0, one elected lane issues ----------------
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
    if (threadIdx.x / 32 != 0) return;
    if (!cute::elect_one_sync()) return;

    Tensor mQ = params.tma_q.get_tma_tensor(
        make_shape(params.seqlen_q, int(Traits::kHeadDim), params.heads_q, params.batch));
    Tensor mK = params.tma_k.get_tma_tensor(
        make_shape(params.seqlen_k, int(Traits::kHeadDim), params.heads_kv, params.batch));
    Tensor mV = [&] {
      if constexpr (Traits::kFp8) {
        return params.tma_v.get_tma_tensor(make_shape(
            int(Traits::kHeadDim), params.num_n_blocks * kBlockN, params.heads_kv, params.batch));
      } else {
        return params.tma_v.get_tma_tensor(
            make_shape(params.seqlen_k, int(Traits::kHeadDim), params.heads_kv, params.batch));
      }
    }();
    auto cta_q = params.tma_q.get_slice(0);
    auto cta_k = params.tma_k.get_slice(0);
    auto cta_v = params.tma_v.get_slice(0);
    Tensor sK = make_tensor(make_smem_ptr(smem.k.begin()), typename Traits::SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(smem.v.begin()), typename Traits::SmemLayoutV{});
    Tensor tKsK = group_modes<0, 3>(cta_k.partition_D(sK));  // (TMA, stage)
    Tensor tVsV = group_modes<0, 3>(cta_v.partition_D(sV));

    PipelineState<kStages> st;
    PipelineState<kQStages> st_q;
    WorkTile t;
#pragma unroll 1
    for (Walk walk{params}; walk.next(t);) {
      if (t.n_blocks() == 0) continue;  // the consumers zero-fill it alone
      const int head_kv = t.head / (params.heads_q / params.heads_kv);
      Tensor tKgK = group_modes<0, 3>(cta_k.partition_S(local_tile(
          mK(_, _, head_kv, t.batch), typename Traits::TileKV{}, make_coord(_, _0{}))));
      Tensor tVgV = [&] {
        if constexpr (Traits::kFp8) {  // (head_dim, keys): key blocks along mode 1
          return group_modes<0, 3>(cta_v.partition_S(local_tile(
              mV(_, _, head_kv, t.batch), typename Traits::TileV{}, make_coord(_0{}, _))));
        } else {
          return group_modes<0, 3>(cta_v.partition_S(local_tile(
              mV(_, _, head_kv, t.batch), typename Traits::TileKV{}, make_coord(_, _0{}))));
        }
      }();
      auto load_k = [&](int n) {
        smem.pipe_k.producer_acquire(st, Traits::kBytesKV);
        copy(params.tma_k.with(smem.pipe_k.full_barrier(st)), tKgK(_, n), tKsK(_, st.index));
      };
      auto load_v = [&](int n) {
        smem.pipe_v.producer_acquire(st, Traits::kBytesKV);
        copy(params.tma_v.with(smem.pipe_v.full_barrier(st)), tVgV(_, n), tVsV(_, st.index));
      };
      // The first K block first: with one Q buffer, Q waits for the last Q·Kᵀ of the tile before.
      load_k(t.n_max - 1);
      smem.pipe_q.producer_acquire(st_q, Traits::kBytesQ * kConsumerWGs);
#pragma unroll
      for (int wg = 0; wg < kConsumerWGs; ++wg) {
        Tensor gQ = local_tile(mQ(_, _, t.head, t.batch), typename Traits::TileQ{},
                               make_coord(t.m_block * kConsumerWGs + wg, _0{}));
        Tensor sQ = make_tensor(make_smem_ptr(smem.q[wg].begin()), typename Traits::SmemLayoutQ{});
        copy(params.tma_q.with(smem.pipe_q.full_barrier(st_q)), cta_q.partition_S(gQ),
             cta_q.partition_D(sQ(_, _, st_q.index)));
      }
      st_q.advance();
      load_v(t.n_max - 1);
      st.advance();
      // Not unrolled: the producer lives in 24 registers.
#pragma unroll 1
      for (int n = t.n_max - 2; n >= t.n_min; --n) {
        load_k(n);
        load_v(n);
        st.advance();
      }
    }
    // The pieces read nothing of the whole waves', which run beside them; this keeps the pieces'
    // launch from completing before those.
    if constexpr (kTailPieces) wait_for_prior_grids();
    return;
  }

  // ---------------- consumers ----------------
  cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
  const int wg = warp_group - 1;      // 0 or 1
  const int tid = threadIdx.x % 128;  // thread within the warpgroup

  Tensor sQ = make_tensor(make_smem_ptr(smem.q[wg].begin()), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(smem.k.begin()), typename Traits::SmemLayoutK{});
  Tensor sVt = make_tensor(make_smem_ptr(smem.v.begin()), typename Traits::SmemLayoutVt{});

  typename Traits::MmaQK mma_qk;
  typename Traits::MmaPV mma_pv;
  auto thr_qk = mma_qk.get_thread_slice(tid);
  auto thr_pv = mma_pv.get_thread_slice(tid);
  Tensor tSrQ = thr_qk.make_fragment_A(thr_qk.partition_A(sQ));   // (MMA, 1, K, q stage)
  Tensor tSrK = thr_qk.make_fragment_B(thr_qk.partition_B(sK));   // (MMA, N, K, stage)
  Tensor tOrV = thr_pv.make_fragment_B(thr_pv.partition_B(sVt));  // (MMA, N, K, stage)

  Tensor tOrO = partition_fragment_C(mma_pv, typename Traits::TileQ{});  // O accumulator
  Tensor tSrS = partition_fragment_C(mma_qk, Shape<Int<kRowsPerWG>, Int<kBlockN>>{});
  Tensor rowcol_S = make_tensor(tSrS.data(), acc_rowcol(tSrS.layout()));
  Tensor rowcol_O = make_tensor(tOrO.data(), acc_rowcol(tOrO.layout()));
  // (row, col) of every S and O element within the warpgroup's tile.
  Tensor cS = thr_qk.partition_C(make_identity_tensor(Shape<Int<kRowsPerWG>, Int<kBlockN>>{}));
  Tensor rowcol_cS = make_tensor(cS.data(), acc_rowcol(cS.layout()));
  Tensor cO = thr_pv.partition_C(make_identity_tensor(typename Traits::TileQ{}));
  Tensor rowcol_cO = make_tensor(cO.data(), acc_rowcol(cO.layout()));
  constexpr int kRows = decltype(size<0>(rowcol_S))::value;
  static_assert(decltype(size<2>(tSrS))::value == 1, "the mask assumes one WGMMA atom spans N");
  // P (the exponentiated scores, in Element) as the register A operand of P·V. 16-bit: tSrS's
  // layout reshaped. FP8: the k32 operand layout, ((4 keys, 2 rows, 2 halves), 1, kBlockN/32).
  auto tOrP = [&] {
    if constexpr (Traits::kFp8) {
      return make_tensor<Element>(Layout<Shape<Shape<_4, _2, _2>, _1, Int<kBlockN / 32>>>{});
    } else {
      return make_tensor<Element>(acc_as_operand_a(tSrS.layout()));
    }
  }();

  auto gemm_qk = [&](int q_stage, int stage) FLASHATTN_INLINE {
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
  };
  auto gemm_pv = [&](int stage) FLASHATTN_INLINE {
    warpgroup_fence_operand(tOrO);
    warpgroup_arrive();
#pragma unroll
    for (int k = 0; k < size<2>(tOrP); ++k) {
      gemm(mma_pv, tOrP(_, _, k), tOrV(_, _, k, stage), tOrO);
    }
    warpgroup_commit_batch();
    warpgroup_fence_operand(tOrO);
  };
  auto convert_p = [&]() FLASHATTN_INLINE {
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
  };

  // Ping-pong: each GEMM issue point waits for this warpgroup's turn, issues, hands the turn
  // over. Both warpgroups issue equally often on every tile, so the alternation runs on across
  // tiles. WG1 gives WG0 the first turn; WG0 takes WG1's last hand-over after the loop, so no
  // arrival is left pending at exit.
  const bool pingpong = params.pingpong;
  const FwdBarrier my_turn = wg == 0 ? FwdBarrier::TurnWG0 : FwdBarrier::TurnWG1;
  const FwdBarrier their_turn = wg == 0 ? FwdBarrier::TurnWG1 : FwdBarrier::TurnWG0;
  auto turn_wait = [&]() FLASHATTN_INLINE {
    if (pingpong) named_sync(my_turn, 256);
  };
  auto turn_pass = [&]() FLASHATTN_INLINE {
    if (pingpong) named_arrive(their_turn, 256);
  };
  if (pingpong && wg == 1) named_arrive(FwdBarrier::TurnWG0, 256);

  using Softmax = conditional_t<Traits::kFp8, ScaledOnlineSoftmax<kRows>, OnlineSoftmax<kRows>>;
  Softmax softmax;
  float factor[kRows];  // what O is rescaled by after a softmax step
  // FP8: the tile's softmax scale with its Q descale, its K/V descales by key block, and the V
  // descale whose units O's accumulator is in (that of the last block whose P was converted).
  float tile_scale_log2 = params.scale_log2;
  const float* k_descale = nullptr;
  const float* v_descale = nullptr;
  float v_unit = 1.f;
  auto finalize = [&](float(&inv_sum)[kRows], float(&lse)[kRows]) FLASHATTN_INLINE {
    if constexpr (Traits::kFp8) {
      softmax.finalize(inv_sum, lse);
#pragma unroll
      for (int r = 0; r < kRows; ++r) inv_sum[r] *= v_unit;
    } else {
      softmax.finalize(params.scale_log2, inv_sum, lse);
    }
  };

  // The softmax scale and (FP8) V descale of key block n. FP8 at d128/d256 loads them ahead of
  // the waits before their use, so that the load's latency hides under them (H200, 16k tokens:
  // d256 s8k 1129 → 1174 TFLOP/s, d128 equal); at d64 that cost 16% (s8k 540 → 454), so there
  // they are loaded where they are used.
  constexpr bool kScalesEarly = Traits::kFp8 && Traits::kHeadDim >= 128;
  struct BlockScales {
    float c, v;
  };
  auto block_scales = [&](int n) FLASHATTN_INLINE {
    if constexpr (Traits::kFp8) {
      return BlockScales{tile_scale_log2 * k_descale[n], v_descale[n]};
    } else {
      return BlockScales{params.scale_log2, 1.f};
    }
  };

  // Softcap and masks (unless `plain`: the caller knows there are none), then the online
  // softmax step on S of key block n for rows from row0.
  auto softmax_step = [&](int n, int row0, BlockScales early, auto plain) FLASHATTN_INLINE {
    constexpr bool kPlain = decltype(plain)::value;
    if (!kPlain && params.softcap) {
#pragma unroll
      for (int i = 0; i < size(tSrS); ++i) tSrS(i) = fast_tanh(tSrS(i) * params.softcap_pre);
    }
    if (!kPlain && params.keys.template block_needs_mask<kBlockN>(n, row0, row0 + kRowsPerWG)) {
      // Accumulator column c of this thread is key 8·(c/2) + c%2 + 2·(tid%4) of the block: a
      // compile-time offset plus a per-thread one, so each test is one compare.
      const int thread_col = 2 * (tid % 4);
#pragma unroll
      for (int r = 0; r < size<0>(rowcol_S); ++r) {
        const int row = row0 + get<0>(rowcol_cS(r, 0));
        const int lo = params.keys.lo(row) - n * kBlockN - thread_col;
        const int hi = params.keys.hi(row) - n * kBlockN - thread_col;
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
      // is measured per kernel (Tile::kIeeeDescaleRatio; H200, 16k tokens: IEEE at d64 s8k 508
      // -> 545, d128 s8k 878 -> 892 TFLOP/s; approximate, valid for the positive normal
      // descales, at d256 s8k 1194 -> 1243, causal s2k 807 -> 898). scripts/sass_report.py,
      // 'EX2 before wait', shows which way each kernel went.
      const float ratio = Traits::kIeeeDescaleRatio ? v_unit / scales.v
                                                    : __fdividef(v_unit, scales.v);
      v_unit = scales.v;
#pragma unroll
      for (int r = 0; r < kRows; ++r) factor[r] *= ratio;
    } else {
      softmax.step(rowcol_S, params.scale_log2, factor);
    }
  };

  // Epilogue of tile t: O·inv_sum and the LSE; rows past seqlen_q are skipped. O leaves the
  // registers by 16-byte stores (the host checks O's alignment): staged through shared memory
  // instead, FP8 d256 ran 1.5-4% slower (H200, 2026-12-01) and FP8 d128 spilled.
  // O's accumulator column n holds head dim n, in the FP8 kernels fp8_v_row_head_dim(n) (V's
  // rows come in that order), so that there each thread already holds whole 16-byte chunks.
  auto head_dim_of = [](int n) FLASHATTN_INLINE {
    if constexpr (Traits::kFp8) {
      return fp8_v_row_head_dim(n);
    } else {
      return n;
    }
  };
  auto store_tile = [&](const WorkTile& t, const float (&inv_sum)[kRows],
                        const float (&lse)[kRows]) FLASHATTN_INLINE {
    const int row0 = t.m_block * Traits::kBlockM + wg * kRowsPerWG;
    scale_rows(rowcol_O, inv_sum);
    if constexpr (kTailPieces) {  // a piece: O and LSE in f32 to its slot (fwd_tail.h)
      float* slot = params.tail.partials + t.slot * tail_slot_floats(Traits::kHeadDim);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int row = wg * kRowsPerWG + get<0>(rowcol_cO(r, 0));
        if (get<1>(rowcol_cO(0, 0)) == 0) slot[kTailRows * Traits::kHeadDim + row] = lse[r];
#pragma unroll
        for (int c = 0; c < size<1>(rowcol_O); c += 2)
          *reinterpret_cast<float2*>(slot + row * Traits::kHeadDim +
                                     head_dim_of(get<1>(rowcol_cO(r, c)))) =
              make_float2(rowcol_O(r, c), rowcol_O(r, c + 1));
      }
      return;
    }
    // LSE: the thread holding column 0 of a row's quad writes it.
    if (get<1>(rowcol_cO(0, 0)) == 0) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int row = row0 + get<0>(rowcol_cO(r, 0));
        if (row < params.seqlen_q)
          params.lse[(int64_t(t.batch) * params.heads_q + t.head) * params.seqlen_q + row] = lse[r];
      }
    }
    auto store = [&](auto* o) FLASHATTN_INLINE {
      using Out = remove_pointer_t<decltype(o)>;
      Tensor rO = convert_fragment<Out>(tOrO);
      Tensor rowcol_rO = make_tensor(rO.data(), acc_rowcol(rO.layout()));
      o += t.batch * params.o_batch_stride + t.head * params.o_head_stride;
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
          if (row >= params.seqlen_q) continue;
          Out* o_row = o + row * params.o_row_stride;
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
          Out* o_row = o + row * params.o_row_stride;
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
            if (row < params.seqlen_q)
              *reinterpret_cast<uint4*>(o_row + 8 * (4 * g + q)) = chunk;
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
  };

  PipelineState<kStages> st_k, st_v;  // carried across tiles, like the producer's
  PipelineState<kQStages> st_q;
  // Cross-tile overlap: the tile whose last P·V is not issued yet (its P is in tOrP).
  bool pending = false;
  WorkTile pending_tile{};
  auto finish_pending = [&]() FLASHATTN_INLINE {
    smem.pipe_v.consumer_wait(st_v);
    turn_wait();
    gemm_pv(st_v.index);
    turn_pass();
    warpgroup_wait<0>();
    smem.pipe_v.consumer_release(st_v);
    st_v.advance();
    float inv_sum[kRows], lse[kRows];
    finalize(inv_sum, lse);
    store_tile(pending_tile, inv_sum, lse);
    pending = false;
  };

  FwdTimeline timeline(wg, tid);  // off unless FLASHATTN_FWD_TIMELINE (fwd_timeline.h)
  WorkTile t;
#pragma unroll 1
  for (Walk walk{params}; walk.next(t);) {
    const int row0 = t.m_block * Traits::kBlockM + wg * kRowsPerWG;  // first query row of this WG
    if constexpr (Traits::kFp8) {
      const int head_kv = t.head / (params.heads_q / params.heads_kv);
      tile_scale_log2 =
          params.scale_log2 *
          params.q_descale[(int64_t(t.batch) * params.heads_q + t.head) * params.num_m_blocks +
                           t.m_block];
      const int64_t kv = (int64_t(t.batch) * params.heads_kv + head_kv) * params.num_n_blocks;
      k_descale = params.k_descale + kv;
      v_descale = params.v_descale + kv;
    }

    if (t.n_blocks() == 0) {  // no key for any row: O = 0, LSE = +inf
      if (pending) finish_pending();
      softmax = Softmax();
      clear(tOrO);
      float inv_sum[kRows], lse[kRows];
      finalize(inv_sum, lse);
      store_tile(t, inv_sum, lse);
      continue;
    }

    smem.pipe_q.consumer_wait(st_q);
    if constexpr (Traits::kIntraWGOverlap) {
      // First block of the tile, with the last P·V of the tile before when one is pending. The
      // two paths share no GEMM in flight (ptxas would serialize the WGMMAs of a join).
      auto release_k_first = [&]() FLASHATTN_INLINE {
        smem.pipe_k.consumer_release(st_k);
        st_k.advance();
        if (t.n_blocks() == 1) {  // also the tile's last Q·Kᵀ
          smem.pipe_q.consumer_release(st_q);
          st_q.advance();
        }
        softmax = Softmax();
      };
      const BlockScales first = block_scales(t.n_max - 1);
      smem.pipe_k.consumer_wait(st_k);
      if (pending) {
        smem.pipe_v.consumer_wait(st_v);
        turn_wait();
        gemm_qk(st_q.index, st_k.index);
        gemm_pv(st_v.index);
        turn_pass();
        warpgroup_wait<1>();
        float inv_sum[kRows], lse[kRows];
        finalize(inv_sum, lse);  // the tile before: all keys seen
        release_k_first();
        softmax_step(t.n_max - 1, row0, first, std::false_type{});
        warpgroup_wait<0>();
        smem.pipe_v.consumer_release(st_v);
        st_v.advance();
        store_tile(pending_tile, inv_sum, lse);
        pending = false;
      } else {
        turn_wait();
        gemm_qk(st_q.index, st_k.index);
        turn_pass();
        warpgroup_wait<0>();
        release_k_first();
        softmax_step(t.n_max - 1, row0, first, std::false_type{});
      }
      clear(tOrO);
      convert_p();
      // One key block after the first. With kUnmaskedLoop, the blocks that need no mask (and
      // no softcap, and are not the tile's last) run a copy of it without those tests.
      auto key_block = [&](int n, auto plain) FLASHATTN_INLINE {
        constexpr bool kPlain = decltype(plain)::value;
        timeline.stamp(0);
        const BlockScales scales = block_scales(n);
        smem.pipe_k.consumer_wait(st_k);
        smem.pipe_v.consumer_wait(st_v);
        timeline.stamp(1);
        turn_wait();
        timeline.stamp(2);
        gemm_qk(st_q.index, st_k.index);
        gemm_pv(st_v.index);
        turn_pass();
        timeline.stamp(3);
        warpgroup_wait<1>();  // S of block n is ready; P·V of the previous block still runs
        timeline.stamp(4);
        smem.pipe_k.consumer_release(st_k);
        st_k.advance();
        if (!kPlain && n == t.n_min) {  // the tile's last Q·Kᵀ: its Q buffer may take a later
          smem.pipe_q.consumer_release(st_q);  // tile's Q
          st_q.advance();
        }
        softmax_step(n, row0, scales, plain);
        timeline.stamp(5);
        warpgroup_wait<0>();
        timeline.stamp(6);
        smem.pipe_v.consumer_release(st_v);
        st_v.advance();
        scale_rows(rowcol_O, factor);
        convert_p();
        timeline.stamp(7);
        timeline.next();
      };
      // The blocks [plain_lo, plain_hi] for the copy (none without it). From the tile's rows,
      // not this warpgroup's: bounds that ptxas sees as uniform keep the loop's pipeline state in
      // uniform registers (per warpgroup they were slower than no copy at all: FP8 d128 s8k −9%,
      // bf16 −3%).
      int plain_lo = 0, plain_hi = -1;
      if (Traits::kUnmaskedLoop && !params.softcap) {
        params.keys.template unmasked_blocks<kBlockN>(t.m_block * Traits::kBlockM,
                                                      (t.m_block + 1) * Traits::kBlockM,
                                                      plain_lo, plain_hi);
        if (plain_lo <= t.n_min) plain_lo = t.n_min + 1;
      }
#pragma unroll 1
      for (int n = t.n_max - 2; n >= t.n_min;) {
        if constexpr (Traits::kUnmaskedLoop) {
          if (n <= plain_hi && n >= plain_lo) {
#pragma unroll 1
            for (; n >= plain_lo; --n) key_block(n, std::true_type{});
            continue;
          }
        }
        key_block(n, std::false_type{});
        --n;
      }
      pending = true;
      pending_tile = t;
      if constexpr (!Traits::kCrossTileOverlap) finish_pending();
    } else {
      // The ablation's loop: each block's GEMMs wait on its softmax; ping-pong turns per GEMM.
      softmax = Softmax();
      clear(tOrO);
#pragma unroll 1
      for (int n = t.n_max - 1; n >= t.n_min; --n) {
        const BlockScales scales = block_scales(n);
        smem.pipe_k.consumer_wait(st_k);
        turn_wait();
        gemm_qk(st_q.index, st_k.index);
        turn_pass();
        warpgroup_wait<0>();
        smem.pipe_k.consumer_release(st_k);
        st_k.advance();
        if (n == t.n_min) {
          smem.pipe_q.consumer_release(st_q);
          st_q.advance();
        }
        softmax_step(n, row0, scales, std::false_type{});
        scale_rows(rowcol_O, factor);
        convert_p();
        smem.pipe_v.consumer_wait(st_v);
        turn_wait();
        gemm_pv(st_v.index);
        turn_pass();
        warpgroup_wait<0>();
        smem.pipe_v.consumer_release(st_v);
        st_v.advance();
      }
      float inv_sum[kRows], lse[kRows];
      finalize(inv_sum, lse);
      store_tile(t, inv_sum, lse);
    }
  }
  if (pending) finish_pending();
  if (pingpong && wg == 0) turn_wait();
#endif
}

}  // namespace flashattn::sm90
