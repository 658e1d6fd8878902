// What the sm90 backward kernels share (bwd_kernel.h splits a CTA's keys between the consumer
// warpgroups, bwd_kernel_split_d.h the head dim, bwd_kernel_keys_n.h takes the keys as the GEMMs'
// N): the kernel parameters, the TMA loads and shared memory of the latter two, the named
// barriers, the WGMMA issue helpers, the TMA producer, the dQ bulk-add helpers and the dK/dV
// epilogue (the deterministic dQ hand-over: bwd_dq_handover.h).
#pragma once

#include <cute/tensor.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/numeric_conversion.h>

#include <climits>
#include <type_traits>

#include "../common/block_range.h"
#include "../common/bwd_workspace.h"
#include "../common/sequences.h"
#include "../common/tile_order.h"
#include "../common/online_softmax.h"
#include "pipeline.h"
#include "staged_rows.h"
#include "tma_tensor.h"

namespace flashattn::sm90 {

using namespace cute;

// The TMA load of one tile of a backward operand (Q and dO per query block, one stage of
// SmemLayout; K and V per key tile) from (seqlen, head_dim, heads, batch), head_dim contiguous.
template <class Element, class SmemLayout, class Tile>
using BwdTmaLoad = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor<Element>{},
                                          take<0, 2>(SmemLayout{}), Tile{}, _1{}));

// The TMA loads, their byte counts and the shared memory of the kernels whose consumer
// warpgroups share one key block and each query block (bwd_kernel_split_d.h,
// bwd_kernel_keys_n.h): K and V once, Q and dO in stages, P and dS (either way round) in stages,
// one dQ slab per warpgroup. `L`: the kernel's tiles and layouts, its traits' other base (this
// one declares no name that L declares, so that the traits inherit both unambiguously: Element
// is a template parameter here, not a member).
template <class L, class Element = typename L::Element>
struct BwdSharedKeyBlock {
  static_assert(std::is_same_v<Element, typename L::Element>);
  // One tile each of K and V: the byte counts below are the CTA's keys' (bwd_produce expects
  // kKeyTiles of them).
  static_assert(L::kKeyTiles == 1);
  using TmaQ = BwdTmaLoad<Element, typename L::SmemLayoutQ, typename L::TileQ>;
  using TmadO = BwdTmaLoad<Element, typename L::SmemLayoutdO, typename L::TiledO>;
  using TmaK = BwdTmaLoad<Element, typename L::SmemLayoutK, typename L::TileK>;
  using TmaV = BwdTmaLoad<Element, typename L::SmemLayoutV, typename L::TileV>;
  static constexpr uint32_t kBytesQ = L::kBlockM * L::kHeadDim * sizeof(Element);
  static constexpr uint32_t kBytesdO = L::kBlockM * L::kHeadDimV * sizeof(Element);
  static constexpr uint32_t kBytesK = L::kBlockN * L::kHeadDim * sizeof(Element);
  static constexpr uint32_t kBytesV = L::kBlockN * L::kHeadDimV * sizeof(Element);
  static constexpr uint32_t kBytesdQ = L::kBlockM * L::kDqSlabCols * sizeof(float);  // one slab

  struct SharedStorage {
    alignas(1024) ArrayEngine<Element, cosize_v<typename L::SmemLayoutK>> k[L::kKeyTiles];
    alignas(1024) ArrayEngine<Element, cosize_v<typename L::SmemLayoutV>> v[L::kKeyTiles];
    alignas(1024) ArrayEngine<Element, cosize_v<typename L::SmemLayoutQ>> q;
    alignas(1024) ArrayEngine<Element, cosize_v<typename L::SmemLayoutdO>> dout;
    alignas(1024) ArrayEngine<Element, cosize_v<typename L::SmemLayoutP>> p;
    alignas(1024) ArrayEngine<Element, cosize_v<typename L::SmemLayoutP>> ds;
    alignas(128) float dq[L::kConsumerWGs][L::kBlockM * L::kDqSlabCols];  // one per warpgroup
    uint64_t kv_full;
    TmaPipeline<L::kStages> pipe_q;
    TmaPipeline<L::kStagesdO> pipe_do;
  };
  static_assert(cosize_v<typename L::SmemLayoutP> == L::kBlockM * L::kBlockN * L::kStages,
                "P and dS: a block's queries × the CTA's keys, per stage");
  static_assert(sizeof(SharedStorage) <= 232448, "227 KiB of shared memory per CTA on sm_90");
  // dK and dV are staged in the K and V tiles (DkDvStage): the CTA's keys × their head dims.
  static_assert(sizeof(SharedStorage::k) == kBytesK && sizeof(SharedStorage::v) == kBytesV);
};

template <class Traits>
struct BwdParams {
  typename Traits::TmaQ tma_q;
  typename Traits::TmadO tma_do;
  typename Traits::TmaK tma_k;
  typename Traits::TmaV tma_v;
  // The query workspace rows (bwd_rows_start): dq_rows per (tensor batch entry, head).
  float* dq_accum;         // (B, heads_q, dq_rows, d) in Traits::DqLayout, zeroed
  const float* lse_log2;   // (B, heads_q, dq_rows): LSE·log2(e), +inf in the padding
  const float* softmax_d;  // (B, heads_q, dq_rows): rowsum(dO ∘ O), 0 in the padding
  typename Traits::Element* dq;  // written here in deterministic mode (bwd_write_dq; not d192/256)
  typename Traits::Element* dk;
  typename Traits::Element* dv;
  int64_t dq_batch_stride, dq_row_stride, dq_head_stride;
  int64_t dk_batch_stride, dk_row_stride, dk_head_stride;
  int64_t dv_batch_stride, dv_row_stride, dv_head_stride;
  // GQA: (B, heads_kv, seqlen_k, d) for dK and d_v for dV, zeroed (deterministic: heads_q), else
  // null.
  float* dk_accum;
  float* dv_accum;
  // Deterministic mode: per (query block of the query workspace rows, warpgroup) the number of
  // key blocks whose dQ adds have completed, zeroed by the preprocess; each CTA adds its slab when
  // the key blocks before it have (FA3's semaphore), so the sums run in key-block order, and in
  // the kernel that splits the keys (d64, d96, d128) the CTA whose count completes a block
  // converts its share of dQ. Null otherwise.
  int* dq_semaphore;
  // Packed calls in deterministic mode: nonzero where the preprocess found the offsets malformed
  // (bwd_offsets_malformed), which turns the hand-over off; else null.
  const int* offsets_malformed;
  // Packed calls: the sequence of each packed key block, -1 for none (bwd_packed_entries).
  const int* key_entries;
  // The sinks' gradient (not with softcap): the sinks, and each CTA's kSinkWarps parts at
  // BwdCtaWork::sink_slot (bwd_sink_grad); else null.
  const float* sinks;
  float* sink_parts;
  int batch;               // entries (packed: sequences)
  int heads_q, heads_kv;
  int seqlen_q, seqlen_k;  // the tensors' rows (packed: all sequences')
  int dq_rows;
  // Dense: (key block, batch·head) of each CTA, heavy-first under a right bound. Packed: (packed
  // key block, head), bwd_cta_work.
  TileOrder order;
  Sequences seqs;  // where each entry's rows lie (packed: the caller's offsets)
  KeyRange keys;   // the call's rule; each entry's is keys over its lengths (Entry::keys)
  float scale;        // softmax scale
  float scale_log2;   // scale·log2(e), or softcap·log2(e) when softcap is on
  float softcap_pre;  // scale/softcap with softcap (the kernels' kSoftcap): scores become
                      // tanh(s·scale/softcap)

  // Entries on the tensors' batch axis (B): one when the sequences are packed along the rows.
  __host__ __device__ int tensor_batch() const { return seqs.packed() ? 1 : batch; }
};

// Named barriers per consumer warpgroup (CUTLASS's NamedBarrier adds its reserved offset).
enum class BwdBarrier : uint32_t {
  DsReady = 0,  // both consumer warpgroups: dS stored, previous bulk adds done reading their slabs
  DqReady = 1,  // + warpgroup: the dQ slab stored
  // + warpgroup, between it and its dQ writer warp (kDqSlabThreads, bwd_write_dq):
  DqFull = 3,   // its dQ slab stored in its shared buffer
  DqEmpty = 5,  // the writer's bulk add has read the buffer
  // + warpgroup, in the keys-as-N kernel: its P stored for its dVᵀ. DqFull's ids, which only the
  // dQ writer warps of the kernel that splits the keys take.
  PReady = DqFull,
};
constexpr int kDqSlabThreads = 128 + 32;

__device__ inline void consumers_sync(BwdBarrier b, int threads, int wg = 0) {
  cutlass::arch::NamedBarrier::sync(threads, static_cast<uint32_t>(b) + wg);
}
__device__ inline void barrier_arrive(BwdBarrier b, int threads, int wg = 0) {
  cutlass::arch::NamedBarrier::arrive(threads, static_cast<uint32_t>(b) + wg);
}

// dst[i] += src[i] for `bytes` bytes of f32, by the TMA unit (one thread issues it).
__device__ inline void bulk_reduce_add_f32(float* dst, const float* src, uint32_t bytes) {
  const uint32_t smem = cast_smem_ptr_to_uint(src);
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(
                   dst),
               "r"(smem), "r"(bytes)
               : "memory");
}

// dst[0..1] += (a, b), one vector reduction (sm_90).
__device__ inline void red_add_f32x2(float* dst, float a, float b) {
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(dst), "f"(a), "f"(b) : "memory");
}

// dst[0] += a, one reduction.
__device__ inline void red_add_f32(float* dst, float a) {
  asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(dst), "f"(a) : "memory");
}

// A CTA's work: its key block of kBlockN keys of one (entry, head), the entry's rows and key rule,
// where the entry's query workspace rows of the head start, and the query blocks [m_first,
// m_end) of kBlockM rows that see any of its keys. Dense: the key block and (batch, head) come
// from the tile order. Packed: the tile order's tiles are a head's packed key blocks
// (packed_block): sequence b's from packed_block(k_start, b, kBlockN) on, so that the
// grid covers the keys rather than batch × the longest sequence; a CTA on none of a sequence's
// key blocks (with well-formed offsets at most one per sequence) has no work (`exists` false).
// The block's sequence comes
// from the table the launcher built before (bwd_packed_entries). keys_descending: an
// entry's key blocks run in reverse launch order (the deterministic causal hand-over).
struct BwdCtaWork {
  int n_block, head;
  int batch;  // the entry's index among the call's (packed: the sequence's); seq.batch is its
              // index on the tensors' batch axis
  int head_kv, m_first, m_end;
  bool exists;
  Sequences::Entry seq;
  KeyRange keys;
  int64_t rows_base;
  int64_t sink_slot;  // the CTA's parts of the sinks' gradient: (batch·head, key block) of order
};
template <int kBlockN, int kBlockM, class Params>
__device__ BwdCtaWork bwd_cta_work(Params const& params, bool keys_descending) {
  BwdCtaWork w;
  int block, bh, blocks;  // blocks: the entry's key blocks
  params.order.at(blockIdx.x, block, bh);
  w.head = bh % params.heads_q;
  w.sink_slot = (int64_t(bh) * params.order.tiles + block) * kSinkWarps;
  if (params.seqs.packed()) {
    const int b = params.key_entries[block];
    w.batch = b < 0 ? 0 : b;
    w.seq = params.seqs.at(w.batch);
    w.n_block = b < 0 ? -1 : block - int(packed_block(w.seq.k_start, w.batch, kBlockN));
    blocks = (w.seq.keys_owned + kBlockN - 1) / kBlockN;
  } else {
    w.batch = bh / params.heads_q;
    w.seq = params.seqs.at(w.batch);
    w.n_block = block;
    blocks = params.order.tiles;
  }
  w.exists = w.n_block >= 0 && w.n_block < blocks;
  if (keys_descending) w.n_block = blocks - 1 - w.n_block;
  w.head_kv = w.head / (params.heads_q / params.heads_kv);
  w.keys = w.seq.keys(params.keys);
  w.rows_base =
      bwd_rows_start(params.seqs, w.seq, w.batch, w.head, params.heads_q, params.dq_rows);
  int row_lo, row_hi;
  w.keys.rows_seeing(w.n_block * kBlockN, (w.n_block + 1) * kBlockN, row_lo, row_hi);
  w.m_first = row_lo / kBlockM;
  // A packed entry's key blocks past its used keys see no row (rows_seeing knows the windows).
  const bool seen = row_hi > row_lo && w.n_block * kBlockN < w.seq.seqlen_k;
  w.m_end = seen ? (row_hi - 1) / kBlockM + 1 : w.m_first;
  return w;
}

// One thread initializes the K/V barrier and the Q and dO pipelines (one arrival per consumer
// warp), and whatever else `init` does; every thread of the CTA then syncs.
struct NoMoreInit {
  __device__ void operator()() const {}
};
template <class Smem, class Init = NoMoreInit>
__device__ void bwd_init_barriers(Smem& smem, int consumer_warps, Init const& init = {}) {
  if (threadIdx.x == 0) {
    cutlass::arch::ClusterTransactionBarrier::init(&smem.kv_full, 1);
    smem.pipe_q.init(consumer_warps);
    smem.pipe_do.init(consumer_warps);
    init();
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
}

// One WGMMA batch: acc = A·B (SS, both from shared memory) or acc += A·B (RS, A in registers),
// committed as one group for warpgroup_wait.
template <class Mma, class A, class B, class Acc>
__device__ void gemm_ss(Mma& mma, A const& a, B const& b, Acc& acc) {
  mma.accumulate_ = GMMA::ScaleOut::Zero;
  warpgroup_fence_operand(acc);
  warpgroup_arrive();
#pragma unroll
  for (int k = 0; k < size<2>(a); ++k) {
    gemm(mma, a(_, _, k), b(_, _, k), acc);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  warpgroup_fence_operand(acc);
}
template <class Mma, class A, class B, class Acc>
__device__ void gemm_accumulate(Mma& mma, A const& a, B const& b, Acc& acc) {
  warpgroup_fence_operand(acc);
  warpgroup_arrive();
#pragma unroll
  for (int k = 0; k < size<2>(a); ++k) gemm(mma, a(_, _, k), b(_, _, k), acc);
  warpgroup_commit_batch();
  warpgroup_fence_operand(acc);
}

// An f32 register fragment converted into a same-sized Element fragment.
template <class Acc, class Dst>
__device__ void convert_fragment(Acc const& acc, Dst& dst) {
  using Element = typename Dst::value_type;
  constexpr int N = decltype(size(acc))::value;
  cutlass::NumericArrayConverter<Element, float, N> conv;
  *reinterpret_cast<cutlass::Array<Element, N>*>(dst.data()) =
      conv(*reinterpret_cast<cutlass::Array<float, N> const*>(acc.data()));
}

// How a backward kernel applies softcap's derivative 1 − t² (t = tanh(s·softcap_pre)) to dS.
enum class CapSlope {
  kNone,    // no softcap
  kFolded,  // bwd_probabilities writes Pᵀ in 16 bits (dV's operand) and keeps Pᵀ·(1 − t²)
  kFromP,   // bwd_ds takes t back from P by a logarithm: for kernels without registers to hold
            // Pᵀ in 16 bits before dS (128-query blocks at d64)
};

// On a transposed score tile (keys down the rows, queries across; `coords` gives each element's
// (key, query) within the tile): Pᵀ = exp2(Sᵀ·scale_log2 − LSE·log2 e) in place, lse_of(c) being
// column c's LSE·log2(e). Rows past seqlen_q have LSE +inf (P = 0), and every tile that reaches
// past seqlen_k is `masked` (KeyRange::block_needs_mask), so only those tiles need the key range
// of each query; key0 and q0 are the tile's first key and query.
// With softcap Sᵀ is first capped to t = tanh(Sᵀ·softcap_pre), as the forward did. kFolded:
// Pᵀ goes to `p16` (the 16-bit A operand of dV, element for element as the accumulator) and the
// tile keeps Pᵀ·(1 − t²), the factor dS takes, which saves the logarithm of kFromP. Until its P
// exists, the derivative of each pair of neighbouring scores waits in their p16 register as an
// f16 pair: in registers of its own beside t and P it spilled several times more (ptxas).
// Otherwise `p16` is not written.
template <CapSlope kCap, class RowCol, class Coords, class LseOf, class Frag16>
__device__ void bwd_probabilities(RowCol& s, Coords const& coords, LseOf const& lse_of,
                                  KeyRange const& keys, int key0, int q0, float scale_log2,
                                  float softcap_pre, bool masked, Frag16& p16) {
  constexpr int kRows = decltype(size<0>(s))::value;
  constexpr int kCols = decltype(size<1>(s))::value;
  constexpr int kPairs = kRows * kCols / 2;
  static_assert(decltype(size(p16))::value == kRows * kCols &&
                sizeof(typename Frag16::value_type) == sizeof(__half));
  float* acc = raw_pointer_cast(s.data());  // the accumulator's registers in order
  using Pair16 = cutlass::Array<typename Frag16::value_type, 2>;
  Pair16* pairs16 = reinterpret_cast<Pair16*>(raw_pointer_cast(p16.data()));
  if constexpr (kCap != CapSlope::kNone) {
#pragma unroll
    for (int j = 0; j < kPairs; ++j) {
      const float t0 = fast_tanh(acc[2 * j] * softcap_pre);
      const float t1 = fast_tanh(acc[2 * j + 1] * softcap_pre);
      acc[2 * j] = t0;
      acc[2 * j + 1] = t1;
      if constexpr (kCap == CapSlope::kFolded)
        reinterpret_cast<__half2&>(pairs16[j]) = __floats2half2_rn(1.f - t0 * t0, 1.f - t1 * t1);
    }
  }
  if (masked) {
    // Row q sees key k when k - q lies in [shift - window_left, shift + window_right] and
    // k < seqlen_k (KeyRange::lo/hi with k >= 0; shift = seqlen_k - seqlen_q): bounds on the
    // tile's own (key - query), formed once per tile instead of per column. Formed in 64 bits
    // and clamped to int, which keeps every comparison with the tile's small differences.
    const int64_t shift = int64_t(keys.seqlen_k) - keys.seqlen_q - (int64_t(key0) - q0);
    auto to_int = [](int64_t x) {
      return int(x < INT_MIN ? int64_t(INT_MIN) : (x > INT_MAX ? int64_t(INT_MAX) : x));
    };
    const int d_lo = keys.window_left < 0 ? INT_MIN : to_int(shift - keys.window_left);
    const int d_hi = keys.window_right < 0 ? INT_MAX : to_int(shift + keys.window_right);
    const int key_end = keys.seqlen_k - key0;
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const float lse = lse_of(c);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int key = get<0>(coords(r, c)), d = key - get<1>(coords(r, c));
        s(r, c) = d >= d_lo && d <= d_hi && key < key_end
                      ? fast_exp2(s(r, c) * scale_log2 - lse)
                      : 0.f;
      }
    }
  } else {
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const float lse = lse_of(c);
#pragma unroll
      for (int r = 0; r < kRows; ++r) s(r, c) = fast_exp2(s(r, c) * scale_log2 - lse);
    }
  }
  if constexpr (kCap == CapSlope::kFolded) {
    cutlass::NumericArrayConverter<typename Frag16::value_type, float, 2> to16;
#pragma unroll
    for (int j = 0; j < kPairs; ++j) {
      const float2 slope = __half22float2(reinterpret_cast<__half2 const&>(pairs16[j]));
      pairs16[j] = to16(*reinterpret_cast<cutlass::Array<float, 2> const*>(&acc[2 * j]));
      acc[2 * j] *= slope.x;
      acc[2 * j + 1] *= slope.y;
    }
  }
}

// dSᵀ = Pᵀ ∘ (dPᵀ − D) in place over dPᵀ, dsum_of(c) being column c's D = rowsum(dO ∘ O). kFolded:
// `p` holds Pᵀ·(1 − t²) already. kFromP: times 1 − t², t back from P itself,
// log2(P) = t·scale_log2 − LSE·log2 e (lse_of(c) as in bwd_probabilities); P = 0 (masked, or
// underflowed) gives dS = 0 as without the cap.
template <CapSlope kCap, class RowCol, class DsumOf, class LseOf>
__device__ void bwd_ds(RowCol const& p, RowCol& dp, DsumOf const& dsum_of, LseOf const& lse_of,
                       float scale_log2) {
  constexpr int kRows = decltype(size<0>(p))::value;
  constexpr int kCols = decltype(size<1>(p))::value;
  if constexpr (kCap == CapSlope::kFromP) {
    const float inv_scale_log2 = 1.f / scale_log2;
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const float dsum = dsum_of(c), lse = lse_of(c);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const float t = (__log2f(p(r, c)) + lse) * inv_scale_log2;
        dp(r, c) = p(r, c) > 0.f ? p(r, c) * (dp(r, c) - dsum) * (1.f - t * t) : 0.f;
      }
    }
  } else {
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const float dsum = dsum_of(c);
#pragma unroll
      for (int r = 0; r < kRows; ++r) dp(r, c) = p(r, c) * (dp(r, c) - dsum);
    }
  }
}

// This thread's share of Σ_i w_i·Σ_j dS_ij (bwd_sink_grad) over its elements of dSᵀ (keys ×
// queries): w_i = 2^(sink_log2 − LSE_i·log2 e), lse_of(c) giving column c's LSE·log2 e.
template <class RowCol, class LseOf>
__device__ float bwd_sink_share(RowCol const& ds, LseOf const& lse_of, float sink_log2) {
  float share = 0.f;
#pragma unroll
  for (int c = 0; c < size<1>(ds); ++c) {
    float column = 0.f;
#pragma unroll
    for (int r = 0; r < size<0>(ds); ++r) column += ds(r, c);
    share += exp2f(sink_log2 - lse_of(c)) * column;
  }
  return share;
}

// The producer warpgroup's first warp (the caller has given the warpgroup's registers to the
// consumers by setmaxnreg): its elected thread loads K and V once (Traits::kKeyTiles tiles of
// TileK rows), then Q and dO of
// every query block [m_first, m_end) into their pipelines (kStages and kStagesdO buffers).
template <class Traits, class Smem>
__device__ void bwd_produce(BwdParams<Traits> const& params, Smem& smem, BwdCtaWork const& work) {
  if (threadIdx.x / 32 != 0 || work.m_end == work.m_first || !cute::elect_one_sync()) return;
  const int n_block = work.n_block, head = work.head, head_kv = work.head_kv;
  const int batch = work.seq.batch, m_first = work.m_first, m_end = work.m_end;
  constexpr int kKeyTiles = Traits::kKeyTiles;
  // The entry's rows of one head, from row `start` of the tensors' rows (0 in dense calls).
  // Blocks reaching past the entry's end read the next sequence's rows (or its own keys past its
  // used ones), or zeros past the tensor's end (TMA): keys there are masked, and query rows
  // there have LSE +inf, so P = dS = 0 on them; such rows must be finite all the same, since
  // the GEMMs multiply them by those zeros (0·NaN is NaN).
  // kDim: the tensor's head dim (V and dO: kHeadDimV).
  auto entry_rows = [&](auto const& tma, auto kDim, int rows, int heads, int h, int start) {
    Tensor m = tma.get_tma_tensor(make_shape(rows, int(kDim), heads, params.tensor_batch()));
    return domain_offset(make_coord(start, _0{}), m(_, _, h, batch));
  };
  using DimQK = Int<Traits::kHeadDim>;
  using DimV = Int<Traits::kHeadDimV>;
  Tensor mK = entry_rows(params.tma_k, DimQK{}, params.seqlen_k, params.heads_kv, head_kv,
                         work.seq.k_start);
  Tensor mV = entry_rows(params.tma_v, DimV{}, params.seqlen_k, params.heads_kv, head_kv,
                         work.seq.k_start);
  cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(
      &smem.kv_full, kKeyTiles * (Traits::kBytesK + Traits::kBytesV));
#pragma unroll
  for (int t = 0; t < kKeyTiles; ++t) {
    Tensor sK = make_tensor(make_smem_ptr(smem.k[t].begin()), typename Traits::SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(smem.v[t].begin()), typename Traits::SmemLayoutV{});
    const auto block = make_coord(n_block * kKeyTiles + t, _0{});
    auto cta_k = params.tma_k.get_slice(0);
    auto cta_v = params.tma_v.get_slice(0);
    copy(params.tma_k.with(smem.kv_full),
         cta_k.partition_S(local_tile(mK, typename Traits::TileK{}, block)),
         cta_k.partition_D(sK));
    copy(params.tma_v.with(smem.kv_full),
         cta_v.partition_S(local_tile(mV, typename Traits::TileV{}, block)),
         cta_v.partition_D(sV));
  }

  Tensor mQ = entry_rows(params.tma_q, DimQK{}, params.seqlen_q, params.heads_q, head,
                         work.seq.q_start);
  Tensor mdO = entry_rows(params.tma_do, DimV{}, params.seqlen_q, params.heads_q, head,
                          work.seq.q_start);
  Tensor sQ = make_tensor(make_smem_ptr(smem.q.begin()), typename Traits::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(smem.dout.begin()), typename Traits::SmemLayoutdO{});
  auto cta_q = params.tma_q.get_slice(0);
  auto cta_do = params.tma_do.get_slice(0);
  Tensor tQgQ = group_modes<0, 3>(cta_q.partition_S(  // (TMA, query block)
      local_tile(mQ, typename Traits::TileQ{}, make_coord(_, _0{}))));
  Tensor tdOgdO = group_modes<0, 3>(cta_do.partition_S(
      local_tile(mdO, typename Traits::TiledO{}, make_coord(_, _0{}))));
  Tensor tQsQ = group_modes<0, 3>(cta_q.partition_D(sQ));  // (TMA, stage)
  Tensor tdOsdO = group_modes<0, 3>(cta_do.partition_D(sdO));
  PipelineState<Traits::kStages> st;
  PipelineState<Traits::kStagesdO> st_do;
#pragma unroll 1
  for (int m = m_first; m < m_end; ++m) {
    smem.pipe_q.producer_acquire(st, Traits::kBytesQ);
    copy(params.tma_q.with(smem.pipe_q.full_barrier(st)), tQgQ(_, m), tQsQ(_, st.index));
    smem.pipe_do.producer_acquire(st_do, Traits::kBytesdO);
    copy(params.tma_do.with(smem.pipe_do.full_barrier(st_do)), tdOgdO(_, m),
         tdOsdO(_, st_do.index));
    st.advance();
    st_do.advance();
  }
}

// Where dK and dV are staged for their stores without GQA: the CTA's K and V tiles (kTileRows
// keys × their head dims each, free once every consumer's GEMMs are done), as StagedRows.
template <int kTileRows, class Element>
struct DkDvStage {
  static constexpr int kRows = kTileRows;
  Element* k;
  Element* v;
  int row0;  // this warpgroup's first key within the tile
};

// One warpgroup's accumulator of dK or dV with each element's (key, column) within its tile
// (`coords`) and the tile's first column in the head dim (`col0`); neighbouring registers hold
// neighbouring columns.
template <class Acc, class Coords>
struct KeyRowsAcc {
  static constexpr bool kKeysAcross = false;
  Acc const& acc;
  Coords const& coords;
  int col0;
  __device__ int key(int i) const { return get<0>(coords(i)); }
  __device__ int col(int i) const { return col0 + get<1>(coords(i)); }
};
template <class Acc, class Coords>
__device__ KeyRowsAcc<Acc, Coords> key_rows_acc(Acc const& acc, Coords const& coords, int col0) {
  return {acc, coords, col0};
}

// One warpgroup's accumulator of dKᵀ or dVᵀ (the head dim down, its keys across:
// bwd_kernel_keys_n.h) with each element's (column, key) within it (`coords`); neighbouring
// registers hold neighbouring keys.
template <class Acc, class Coords>
struct KeyColsAcc {
  static constexpr bool kKeysAcross = true;
  Acc const& acc;
  Coords const& coords;
  __device__ int key(int i) const { return get<1>(coords(i)); }
  __device__ int col(int i) const { return get<0>(coords(i)); }
};
template <class Acc, class Coords>
__device__ KeyColsAcc<Acc, Coords> key_cols_acc(Acc const& acc, Coords const& coords) {
  return {acc, coords};
}

// dK·scale and dV (kHeadDim and kHeadDimV columns) of one warpgroup's accumulators for the CTA's
// `work` from key key0. Without GQA into dK and dV through shared memory (`stage`; both consumer
// warpgroups call this), 16 bytes per store: the accumulators' own layout stores 4 bytes per
// thread across 8 rows, four times the store instructions; every key row the entry owns is
// written (past its used keys the accumulators hold zeros). GQA: f32 atomics into the KV head's
// sums, or in deterministic mode plain stores into the query head's own rows, which the
// conversion sums over the group in head order; rows past the used keys keep the zeros the
// launcher wrote.
template <bool kDeterministic, int kHeadDim, int kHeadDimV, class Element, class Params,
          class DK, class DV, class Stage>
__device__ void bwd_store_dkdv(Params const& params, DK const& dk, DV const& dv, int key0,
                               BwdCtaWork const& work, Stage const& stage) {
  const Sequences::Entry& e = work.seq;
  // f(row, col, a, b, across) for each pair of neighbouring registers of `part`'s accumulator:
  // b at (row, col + 1), or where the accumulator has the keys across (`across`) at (row + 1,
  // col).
  auto for_pairs = [](auto const& part, auto&& f) {
    constexpr bool kAcross = std::decay_t<decltype(part)>::kKeysAcross;
#pragma unroll
    for (int i = 0; i < size(part.acc); i += 2)
      f(part.key(i), part.col(i), part.acc(i), part.acc(i + 1), bool_constant<kAcross>{});
  };
  if (params.dk_accum == nullptr) {
    using RowsK = StagedRows<kHeadDim, Element>;
    using RowsV = StagedRows<kHeadDimV, Element>;
    consumers_sync(BwdBarrier::DsReady, 256);  // every GEMM has read K and V
    const float scale = params.scale;
    auto put = [](auto rows, Element* tile, int row, int col, Element a, Element b, auto across) {
      using Rows = decltype(rows);
      if constexpr (decltype(across)::value) {
        Rows::put_one(tile, row, col, a);
        Rows::put_one(tile, row + 1, col, b);
      } else {
        Rows::put(tile, row, col, a, b);
      }
    };
    for_pairs(dk, [&](int row, int col, float a, float b, auto across) {
      put(RowsK{}, stage.k, stage.row0 + row, col, Element(a * scale), Element(b * scale), across);
    });
    for_pairs(dv, [&](int row, int col, float a, float b, auto across) {
      put(RowsV{}, stage.v, stage.row0 + row, col, Element(a), Element(b), across);
    });
    consumers_sync(BwdBarrier::DsReady, 256);
    const int tile_key0 = key0 - stage.row0;
    const int keys = e.keys_owned - tile_key0;
    const int thread = threadIdx.x - 128;  // of the two consumer warpgroups
    const int64_t row0 = int64_t(e.k_start) + tile_key0;
    Element* dk_rows = params.dk + e.batch * params.dk_batch_stride +
                       work.head * params.dk_head_stride + row0 * params.dk_row_stride;
    Element* dv_rows = params.dv + e.batch * params.dv_batch_stride +
                       work.head * params.dv_head_stride + row0 * params.dv_row_stride;
    RowsK::store(stage.k, dk_rows, params.dk_row_stride, Stage::kRows, keys, thread, 256);
    RowsV::store(stage.v, dv_rows, params.dv_row_stride, Stage::kRows, keys, thread, 256);
    return;
  }
  const int64_t base =
      kDeterministic ? bwd_key_rows_start(e, work.head, params.heads_q, params.seqlen_k)
                     : bwd_key_rows_start(e, work.head_kv, params.heads_kv, params.seqlen_k);
  auto add_into = [&](float* sums, int cols) {
    return [&, sums, cols](int row, int col, float a, float b, auto across) {
      if (key0 + row >= e.seqlen_k) return;
      float* at = sums + (base + key0 + row) * cols + col;
      if constexpr (decltype(across)::value) {  // b one key row on, if the entry has it
        const bool second = key0 + row + 1 < e.seqlen_k;
        if constexpr (kDeterministic) {
          at[0] = a;
          if (second) at[cols] = b;
        } else {
          red_add_f32(at, a);
          if (second) red_add_f32(at + cols, b);
        }
      } else if constexpr (kDeterministic) {
        *reinterpret_cast<float2*>(at) = make_float2(a, b);
      } else {
        red_add_f32x2(at, a, b);
      }
    };
  };
  for_pairs(dk, add_into(params.dk_accum, kHeadDim));
  for_pairs(dv, add_into(params.dv_accum, kHeadDimV));
}

}  // namespace flashattn::sm90
