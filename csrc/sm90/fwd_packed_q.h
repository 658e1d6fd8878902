// Pack-GQA's Q (FwdParams::group > 1): a tile's rows are (query row, query head) pairs, which no
// TMA box describes, so each consumer warpgroup gathers its own rows into its Q buffer: 16-byte
// loads, consecutive threads along a row, stored in the buffer's swizzled layout (every swizzle
// it takes moves whole 16-byte chunks), zeros for rows past the entry's. The stores are then
// made visible to the async proxy (WGMMA) and the warpgroup meets before its first Q·Kᵀ. The
// buffer is free: this warpgroup's last Q·Kᵀ that read it has completed.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "fwd_mainloop.h"
#include "fwd_scheduler.h"
#include "fwd_traits.h"

namespace flashattn::sm90 {

template <class Traits>
__device__ FLASHATTN_INLINE void gather_packed_q(const FwdParams<Traits>& p, const WorkTile& t,
                                                 typename Traits::SharedStorage& smem, int wg,
                                                 int tid, int q_stage) {
  using Element = typename Traits::Element;
  constexpr int kChunks = Traits::kHeadDim / 8;  // 16-byte chunks of a row
  constexpr int kRows = Traits::kRowsPerWG;
  constexpr int kPerThread = kRows * kChunks / 128;
  static_assert(kRows * kChunks % 128 == 0, "whole chunks per thread");
  // Loads in flight per thread at a time: the registers of the pending tile's O are live here.
  constexpr int kBatch = kPerThread % 4 == 0 ? 4 : 2;
  static_assert(kPerThread % kBatch == 0, "whole batches");
  Tensor sQ = make_tensor(make_smem_ptr(smem.q[wg].begin()), typename Traits::SmemLayoutQ{});
  const Element* q = static_cast<const Element*>(p.q) + t.seq.batch * p.q_batch_stride +
                     int64_t(t.seq.q_start) * p.q_row_stride;
  const int row0 = t.m_block * Traits::kBlockM + wg * kRows;
#pragma unroll
  for (int b = 0; b < kPerThread; b += kBatch) {
    uint4 chunk[kBatch];
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const int x = tid + 128 * (b + k), row = row0 + x / kChunks;
      chunk[k] = make_uint4(0, 0, 0, 0);
      if (row < t.rows) {
        const int head = t.head * p.group + row % p.group;
        chunk[k] = *reinterpret_cast<const uint4*>(q + int64_t(row / p.group) * p.q_row_stride +
                                                   int64_t(head) * p.q_head_stride +
                                                   8 * (x % kChunks));
      }
    }
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const int x = tid + 128 * (b + k);
      *reinterpret_cast<uint4*>(&sQ(x / kChunks, 8 * (x % kChunks), q_stage)) = chunk[k];
    }
  }
  cutlass::arch::fence_view_async_shared();  // generic-proxy stores -> WGMMA reads
  named_sync(wg == 0 ? FwdBarrier::QRowsWG0 : FwdBarrier::QRowsWG1, 128);
}

}  // namespace flashattn::sm90
