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
  // The widening's threads: kChunksPerRow to a row (16 e4m3 a chunk), kRowsPerPass rows at once.
  static constexpr int kThreads = 128;
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kChunksPerRow = kDim / 16;
  static constexpr int kRowsPerPass = kThreads / kChunksPerRow;
  // An item's passes (of a thread's chunk each) at once, as many as the producer's registers
  // hold (FwdTraits::kProducerRegs).
  static constexpr int kPassesAtOnce = kItemRows / kRowsPerPass >= 2 ? 2 : 1;

  struct Storage {
    alignas(128) uint8_t rows[kSlots * kItemBytes];
    uint64_t full[kSlots];  // a slot's TMA bytes have landed
    uint64_t read[kSlots];  // every warp has widened the slot's item (one arrival a warp)
    // One thread initializes (full: one arrival, with the bytes; read: one a warp); the caller
    // fences and syncs.
    __device__ void init() {
      for (int s = 0; s < kSlots; ++s) {
        cutlass::arch::ClusterTransactionBarrier::init(&full[s], 1);
        cutlass::arch::ClusterBarrier::init(&read[s], kWarps);
      }
    }
    // The calling warp has read slot `slot`: its lanes' loads are done (the warp converges
    // first), and the TMA may write the slot once every warp has arrived.
    __device__ void mark_read(int slot) {
      __syncwarp();
      if (threadIdx.x % 32 == 0) cutlass::arch::ClusterBarrier::arrive(&read[slot]);
    }
  };

  using Widened = CudaHalfOf<Element>;

  // The shared-memory byte address of element (row, col) of stage `stage`.
  __device__ static uint32_t stage_at(uint32_t stages, int row, int col, int stage) {
    constexpr auto swizzle = get_swizzle_portion(SmemLayout{});
    constexpr auto unswizzled = get_nonswizzle_portion(SmemLayout{});
    return swizzle(stages + uint32_t(unswizzled(row, col, stage)) * uint32_t(sizeof(Element)));
  }

  // A pass's rows further on in the stage: whole swizzle periods (the swizzle takes the row's
  // low bits only), so that a thread's stage addresses move by this many bytes a pass.
  static constexpr int kPassBytes = int(get_nonswizzle_portion(SmemLayout{})(
                                        Int<kRowsPerPass>{}, _0{}, _0{})) *
                                    int(sizeof(Element));
  using Swizzle_ = decltype(get_swizzle_portion(SmemLayout{}));
  static constexpr int kSwizzlePeriod =
      1 << (Swizzle_::num_bits + Swizzle_::num_base + Swizzle_::num_shft);

  // Thread `tid`'s chunks of the item in the slot at shared-memory address `slot`, widened into
  // rows [first_row, first_row + kItemRows) of stage `stage` of the stages at `stages`.
  __device__ static void widen(uint32_t slot, uint32_t stages, int stage, int first_row,
                               int tid) {
    static_assert(kDim % 16 == 0 && kThreads % kChunksPerRow == 0, "rows of whole chunks");
    static_assert(kItemRows % kRowsPerPass == 0, "an item of whole passes");
    static_assert(kItemRows / kRowsPerPass % kPassesAtOnce == 0, "an item of whole pass groups");
    static_assert(kPassBytes % kSwizzlePeriod == 0 &&
                      int(get_nonswizzle_portion(SmemLayout{})(Int<2 * kRowsPerPass>{}, _0{},
                                                               _0{})) *
                              int(sizeof(Element)) ==
                          2 * kPassBytes,
                  "a pass moves the stage addresses by whole swizzle periods");
    const int chunk = tid % kChunksPerRow;
    const int row = tid / kChunksPerRow;
    uint32_t src = slot + uint32_t(row * kDim + chunk * 16);
    uint32_t dst = stage_at(stages, first_row + row, chunk * 16, stage);
    // The chunk's second 8 elements: the next 16 bytes of the row, swizzled apart.
    const uint32_t dst_hi = stage_at(stages, first_row + row, chunk * 16 + 8, stage) - dst;
    // kPassesAtOnce passes at a time, their loads first: their conversions interleave (one
    // warp a scheduler issues them, each waiting on the one before it otherwise).
#pragma unroll 1
    for (int pass = 0; pass < kItemRows / kRowsPerPass; pass += kPassesAtOnce) {
      uint4 narrow[kPassesAtOnce];
#pragma unroll
      for (int i = 0; i < kPassesAtOnce; ++i)
        asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(narrow[i].x), "=r"(narrow[i].y), "=r"(narrow[i].z), "=r"(narrow[i].w)
                     : "r"(src + uint32_t(i * kRowsPerPass * kDim)));
#pragma unroll
      for (int i = 0; i < kPassesAtOnce; ++i) {
        const uint32_t to = dst + uint32_t(i * kPassBytes);
        const uint2 w0 = convert_e4m3x4<Widened>(narrow[i].x),
                    w1 = convert_e4m3x4<Widened>(narrow[i].y);
        asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(to), "r"(w0.x),
                     "r"(w0.y), "r"(w1.x), "r"(w1.y));
        const uint2 w2 = convert_e4m3x4<Widened>(narrow[i].z),
                    w3 = convert_e4m3x4<Widened>(narrow[i].w);
        asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(to + dst_hi), "r"(w2.x),
                     "r"(w2.y), "r"(w3.x), "r"(w3.y));
      }
      src += uint32_t(kPassesAtOnce * kRowsPerPass * kDim);
      dst += uint32_t(kPassesAtOnce * kPassBytes);
    }
  }
};

}  // namespace flashattn::sm90
