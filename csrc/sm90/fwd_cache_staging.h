// An e4m3 KV cache whose pages hold whole pieces of 16 rows, loaded by the sm90 forward's
// producer in two steps: TMA boxes bring each half key block of e4m3 rows (an item: K's two
// halves, then V's, block after block) into a ring of kSlots staging slots, kSlots items ahead;
// the producer warpgroup then widens each item from its slot into the K or V stage. The TMA keeps
// several items of the cache in flight while the warpgroup widens; the row gather
// (fwd_paged_rows.h), which takes pages of any size, has each thread wait for its own copies
// before it widens them.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "../common/e4m3_convert.h"

namespace flashattn::sm90 {

using namespace cute;

// kBlockN keys of kDim e4m3 elements a block, Element (bf16 or fp16) in the stages, whose
// swizzled (kBlockN, kDim, stage) layout is SmemLayout.
template <class Element, int kBlockN, int kDim, class SmemLayout>
struct CacheStaging {
  static constexpr int kItemRows = kBlockN / 2;
  static constexpr int kSlots = 4;
  static constexpr int kItemBytes = kItemRows * kDim;  // e4m3: a byte an element
  // A slot's rows as the TMA writes them: row-major, unswizzled (the widening reads whole rows,
  // a 16-byte chunk a thread, so that a warp's loads cover each row's banks once).
  using SlotLayout = Layout<Shape<Int<kItemRows>, Int<kDim>>, Stride<Int<kDim>, _1>>;
  struct Storage {
    alignas(128) uint8_t rows[kSlots * kItemBytes];
    uint64_t full[kSlots];  // a slot's TMA bytes have landed
    // One thread initializes (one arrival, with the bytes); the caller fences and syncs.
    __device__ void init() {
      for (int s = 0; s < kSlots; ++s) cutlass::arch::ClusterTransactionBarrier::init(&full[s], 1);
    }
  };

  // The widening's threads: kChunksPerRow to a row (16 e4m3 a chunk), kRowsPerPass rows at once.
  static constexpr int kThreads = 128;
  static constexpr int kChunksPerRow = kDim / 16;
  static constexpr int kRowsPerPass = kThreads / kChunksPerRow;

  using Widened = CudaHalfOf<Element>;

  // The shared-memory byte address of element (row, col) of stage `stage`.
  __device__ static uint32_t stage_at(uint32_t stages, int row, int col, int stage) {
    constexpr auto swizzle = get_swizzle_portion(SmemLayout{});
    constexpr auto unswizzled = get_nonswizzle_portion(SmemLayout{});
    return swizzle(stages + uint32_t(unswizzled(row, col, stage)) * uint32_t(sizeof(Element)));
  }

  // Thread `tid`'s chunks of the item in the slot at shared-memory address `slot`, widened into
  // rows [first_row, first_row + kItemRows) of stage `stage` of the stages at `stages`.
  __device__ static void widen(uint32_t slot, uint32_t stages, int stage, int first_row,
                               int tid) {
    static_assert(kDim % 16 == 0 && kThreads % kChunksPerRow == 0, "rows of whole chunks");
    static_assert(kItemRows % kRowsPerPass == 0, "an item of whole passes");
    const int chunk = tid % kChunksPerRow;
    // Not unrolled: the producer lives in few registers (FwdTraits::kProducerRegs).
#pragma unroll 1
    for (int pass = 0; pass < kItemRows / kRowsPerPass; ++pass) {
      const int r = tid / kChunksPerRow + pass * kRowsPerPass;
      uint4 narrow;
      asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(narrow.x), "=r"(narrow.y), "=r"(narrow.z), "=r"(narrow.w)
                   : "r"(slot + uint32_t(r * kDim + chunk * 16)));
      const uint2 w0 = convert_e4m3x4<Widened>(narrow.x), w1 = convert_e4m3x4<Widened>(narrow.y);
      asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(
                       stage_at(stages, first_row + r, chunk * 16, stage)),
                   "r"(w0.x), "r"(w0.y), "r"(w1.x), "r"(w1.y));
      const uint2 w2 = convert_e4m3x4<Widened>(narrow.z), w3 = convert_e4m3x4<Widened>(narrow.w);
      asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(
                       stage_at(stages, first_row + r, chunk * 16 + 8, stage)),
                   "r"(w2.x), "r"(w2.y), "r"(w3.x), "r"(w3.y));
    }
  }
};

}  // namespace flashattn::sm90
