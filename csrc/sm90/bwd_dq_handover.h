// The sm90 backward's deterministic dQ: the hand-over between the CTAs that add into one dQ
// slab (FA3's semaphores, in key-block order), the dQ writer warps that run it in the kernel that
// splits the keys (d64, d96, d128), and their conversion of each finished slab to the element
// type.
#pragma once

#include "bwd_common.h"

namespace flashattn::sm90 {

using namespace cute;

// Deterministic mode's hand-over between the CTAs that add into one dQ slab; a negative count
// waits for nothing (no hand-over: hand_over_runs).
__device__ inline void wait_for_count(const int* counter, int count) {
  if (count < 0) return;
  int seen;
  do {
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(seen) : "l"(counter) : "memory");
  } while (seen != count);
}
// The issuing thread's bulk adds have reached global memory (and may be counted).
__device__ inline void finish_bulk_adds() {
  asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
}
// Counts one key block's completed adds into a dQ share; returns the count before this one.
__device__ inline int count_dq_adds(int* counter) {
  __threadfence();
  return atomicAdd(counter, 1);
}
// finish_bulk_adds, then count them: the next CTA in hand-over order may add.
__device__ inline void finish_bulk_adds_and_signal(int* counter) {
  finish_bulk_adds();
  count_dq_adds(counter);
}
// Whether the completed adds counted here were the last of the `adds` key blocks that add into
// the share: the caller then converts it, which holds every add once the acquiring fence has
// ordered the other CTAs' counted adds before its reads.
__device__ inline bool count_dq_adds_is_last(int* counter, int adds) {
  const bool last = count_dq_adds(counter) == adds - 1;
  if (last) __threadfence();
  return last;
}

// Deterministic mode: the semaphore of (query block m of kBlockM rows of the entry and head whose
// query workspace rows start at rows_base, consumer warpgroup wg), and how many key blocks of
// kBlockN keys add into that block's dQ before key block n_block does: the key blocks that see
// the rows are a contiguous run, from the first one row q0 sees to the last one the block's last
// row sees (both bounds of a row's keys grow with the row; `keys`: the entry's rule);
// keys_descending: the hand-over runs down from the diagonal, else up from the left.
template <int kBlockM, int kConsumerWGs, class Params>
__device__ int* dq_semaphore(Params const& params, int64_t rows_base, int m, int wg) {
  // The workspace and the preprocess's zeroing hold kConsumerWGs (2) ints per 64 rows; an
  // entry's rows start on a multiple of kDqRowAlign.
  static_assert(kBlockM >= 64 && kConsumerWGs <= 2 && kDqRowAlign % kBlockM == 0);
  const int64_t block = rows_base / kBlockM + m;
  return params.dq_semaphore + (block * kConsumerWGs + wg);
}
// Whether this call's dQ hand-over runs: not where the preprocess found packed offsets that
// break its layout, whose semaphores could then wait forever (the sums run in any order there).
template <class Params>
__device__ bool hand_over_runs(Params const& params) {
  return params.offsets_malformed == nullptr || *params.offsets_malformed == 0;
}
template <int kBlockN, int kBlockM>
__device__ int dq_adds_before(KeyRange const& keys, int q0, int n_block, bool keys_descending) {
  int n_min, n_max;
  keys.template blocks<kBlockN>(q0, q0 + kBlockM, n_min, n_max);
  return keys_descending ? n_max - 1 - n_block : n_block - n_min;
}
// The number of key blocks of kBlockN keys that add into the dQ of the query block from row q0.
template <int kBlockN, int kBlockM>
__device__ int dq_key_blocks(KeyRange const& keys, int q0) {
  int n_min, n_max;
  keys.template blocks<kBlockN>(q0, q0 + kBlockM, n_min, n_max);
  return n_max - n_min;
}
// One consumer warpgroup's dQ of each query block in two slabs of Traits::kDqSlabCols columns
// (Traits::DqLayout) through its shared buffer `sdq`, by bulk reduce-adds: in the kernels whose
// warpgroups split dQ's columns (bwd_kernel_split_d.h, bwd_kernel_keys_n.h), the first slab
// leaves after the dQ GEMM, the second once the next block's score GEMMs are issued (the
// accumulator holds it until the next dQ GEMM; the first one's bulk add has read the buffer by
// then). ptxas waits for those GEMMs before the second store, which reads an accumulator of the
// last loop pass, so the store follows them rather than running beside them (stored earlier in
// the keys-as-N kernel, it was no faster: docs/PERFORMANCE.md). `acc` is the warpgroup's dQ
// accumulator, `coords` each element's (query, column) within its columns.
template <class Traits, class Acc, class Coords>
struct DqSlabPair {
  BwdParams<Traits> const& params;
  Acc const& acc;
  Coords const& coords;
  float* sdq;
  int64_t rows_base;  // the entry's query workspace rows of this head
  int wg, tid;

  // The accumulator's first and second half of elements hold the warpgroup's first and second
  // kDqSlabCols columns (its 8-column groups in order, 4 elements each).
  static constexpr int kSlabElems = decltype(size(std::declval<Acc>()))::value / 2;
  static_assert(kSlabElems % 4 == 0);

  __device__ void store(int half) const {
#pragma unroll
    for (int j = 0; j < kSlabElems; j += 2) {  // elements i, i+1 are neighbouring columns
      const int i = half * kSlabElems + j;
      const int col = get<1>(coords(i)) % Traits::kDqSlabCols;
      const int at = Traits::DqLayout::in_slab(get<0>(coords(i)), col);
      *reinterpret_cast<float2*>(&sdq[at]) = make_float2(acc(i), acc(i + 1));
    }
    cutlass::arch::fence_view_async_shared();  // generic-proxy stores -> bulk-copy reads
    consumers_sync(BwdBarrier::DqReady, 128, wg);
  }
  // Deterministic mode: the hand-over semaphore of query block m's slabs of this warpgroup.
  __device__ int* semaphore(int m) const {
    return dq_semaphore<Traits::kBlockM, Traits::kConsumerWGs>(params, rows_base, m, wg);
  }
  __device__ void add(int m, int half) const {  // one thread: the slab into global dQ
    const int slab = wg * 2 + half;  // DqSlabs: a query block's slabs in column order
    bulk_reduce_add_f32(params.dq_accum + (rows_base + m * Traits::kBlockM) * Traits::kHeadDim +
                            slab * Traits::kBlockM * Traits::kDqSlabCols,
                        sdq, Traits::kBytesdQ);
    tma_store_arrive();
  }
  __device__ void second(int m) const {
    if (tid == 0) tma_store_wait<0>();
    consumers_sync(BwdBarrier::DqReady, 128, wg);
    store(1);
    if (tid == 0) add(m, 1);
  }
};
template <class Traits, class Acc, class Coords>
__device__ DqSlabPair<Traits, Acc, Coords> dq_slab_pair(BwdParams<Traits> const& params,
                                                       Acc const& acc, Coords const& coords,
                                                       float* sdq, int64_t rows_base, int wg,
                                                       int tid) {
  return {params, acc, coords, sdq, rows_base, wg, tid};
}

// One slab (Traits::DqLayout) of a query block's dQ, complete in the f32 accumulator,
// to the element type times the softmax scale by one warp, in place of a conversion pass over the
// whole accumulator (which read it back from HBM): rows [row0, row0 + slab rows) of an entry's
// head, whose row 0 is at `dq` and which has `seqlen_q` rows, columns [col0, col0 + slab
// columns). The slab comes into `staging` by one bulk copy (through
// L2, where the adds happened; the warp has 24 registers, too few to keep enough loads of its own
// in flight), whose completion `staged` counts (phase: its parity, flipped here); then eight
// elements per lane and store (as four 4-byte stores: cutlass::Array is aligned to its element),
// eight lanes per 128-byte row piece.
template <class Traits>
__device__ void convert_dq_slab(BwdParams<Traits> const& params, const float* slab,
                                float* staging, uint64_t* staged, int& phase,
                                typename Traits::Element* dq, int seqlen_q, int row0, int col0) {
  using Element = typename Traits::Element;
  using Layout = typename Traits::DqLayout;
  constexpr int kRows = Layout::kSlabRows, kChunks = Layout::kChunks;
  constexpr uint32_t kBytes = kRows * kChunks * 8 * sizeof(float);
  if (threadIdx.x % 32 == 0) {
    // The acquire (generic proxy) before the bulk copy's reads (async proxy).
    asm volatile("fence.proxy.async.global;\n" ::: "memory");
    cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(staged, kBytes);
    SM90_BULK_COPY_G2S::copy(slab, staged, staging, kBytes);
  }
  cutlass::arch::ClusterTransactionBarrier::wait(staged, phase);
  asm volatile("" ::: "memory");  // the reads of `staging` below stay after the wait
  phase ^= 1;
#pragma unroll 2
  for (int k = threadIdx.x % 32; k < kRows * kChunks; k += 32) {
    const int row = row0 + k / kChunks, c = k % kChunks;
    if (row >= seqlen_q) continue;
    const float4* src =
        reinterpret_cast<const float4*>(staging + Layout::in_slab(k / kChunks, c * 8));
    const float4 a = src[0], b = src[1];
    cutlass::Array<float, 8> sums;
    sums[0] = a.x, sums[1] = a.y, sums[2] = a.z, sums[3] = a.w;
    sums[4] = b.x, sums[5] = b.y, sums[6] = b.z, sums[7] = b.w;
#pragma unroll
    for (int i = 0; i < 8; ++i) sums[i] *= params.scale;
    *reinterpret_cast<cutlass::Array<Element, 8>*>(dq + int64_t(row) * params.dq_row_stride +
                                                   col0 + c * 8) =
        cutlass::NumericArrayConverter<Element, float, 8>{}(sums);
  }
  // Every lane's reads of `staging` (generic proxy) before the next bulk copy writes it.
  __syncwarp();
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Deterministic mode in the kernel that splits the keys: a dQ writer warp of the producer
// warpgroup, serving consumer warpgroup wg (FA3's dQ writer). For every query block
// [m_first, m_end) the warpgroup stores its slabs, slab_bytes together, into its shared buffer
// `sdq` (DqFull); once the key blocks before this one have counted theirs (adds_before(m) of
// them, counter(m)), the slabs are bulk-added into the
// accumulator at slab_dst(m) and the buffer handed back once read (DqEmpty); the add is counted
// once complete, and the warp whose count completes the block (key_blocks(m) key blocks) converts
// the warpgroup's share of it (convert(m), the whole warp), so that no conversion pass runs. The
// consumers never wait on the hand-over: faster than the deterministic mode with consumer thread 0
// waiting, but at d128 causal s2k slower until convert_dq_slab staged the slab by one bulk copy
// (faster again). Atomic mode keeps its adds on the consumers: with writer warps it ran slower
// (benchmarks/README.md).
template <class SlabDst, class Counter, class KeyBlocks, class AddsBefore, class Convert>
__device__ void bwd_write_dq(const float* sdq, uint32_t slab_bytes, int wg, int m_first, int m_end,
                             SlabDst const& slab_dst, Counter const& counter,
                             KeyBlocks const& key_blocks, AddsBefore const& adds_before,
                             Convert const& convert) {
  const bool leader = threadIdx.x % 32 == 0;
  if (m_end > m_first) barrier_arrive(BwdBarrier::DqEmpty, kDqSlabThreads, wg);
#pragma unroll 1
  for (int m = m_first; m < m_end; ++m) {
    consumers_sync(BwdBarrier::DqFull, kDqSlabThreads, wg);
    if (leader) {
      wait_for_count(counter(m), adds_before(m));
      bulk_reduce_add_f32(slab_dst(m), sdq, slab_bytes);
      tma_store_arrive();  // commit the bulk group
      tma_store_wait<0>();  // read
    }
    __syncwarp();
    if (m + 1 < m_end) barrier_arrive(BwdBarrier::DqEmpty, kDqSlabThreads, wg);
    bool last = false;
    if (leader) {
      finish_bulk_adds();
      last = count_dq_adds_is_last(counter(m), key_blocks(m));
    }
    if (__shfl_sync(0xffffffffu, last, 0)) {
      __syncwarp();  // the warp together, after the leader's acquire, for the conversion
      convert(m);
    }
  }
}

}  // namespace flashattn::sm90
