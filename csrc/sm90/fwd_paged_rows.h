// A paged cache whose pages hold neither whole key blocks nor whole pieces of 16 rows (which TMA
// boxes load: fwd_traits.h kPieceRows), loaded by the sm90 forward's producer warpgroup: its 128
// threads copy each key block's rows by cp.async, every row from its own page, into the stage's
// swizzled rows; each thread's arrival on the stage's full barrier completes when its copies have
// landed (TmaPipeline::producer_commit_copies).
// An e4m3 cache whose pages are not staged (fwd_cache_staging.h: pages of no whole pieces, and
// tiles without room for the slots) is gathered the same way, each 16-byte chunk of a row landing
// in the upper half of the 32 bytes it widens to; once its copies have landed each thread widens
// its own chunks in place (widen) and arrives (TmaPipeline::producer_commit_written). No thread
// touches another's bytes, so no barrier is needed between the copy and the widening.
#pragma once

#include <cute/tensor.hpp>

#include "../common/e4m3_convert.h"

namespace flashattn::sm90 {

using namespace cute;

constexpr int kGatherThreads = 128;  // the producer warpgroup

// Where a paged cache's K or V rows lie: row r of page p, KV head h at byte
// p·page_bytes + r·row_bytes + h·head_bytes of base.
struct PagedRows {
  const char* base;
  int64_t page_bytes, row_bytes, head_bytes;
};

// The pages of one key block as a warp sees them: lane i holds the page of the block's
// (first_column + i)-th page-table column, so that a row finds its page by a shuffle, and the
// block's page numbers take one load per lane (issued before the producer waits for the stage,
// and kept for V's block after K's).
struct BlockPages {
  int first_column;  // the block's first key's column, first_key / page_size
  int lane_page;     // the page of column first_column + lane
};

// kBlockN rows of kDim elements, a 16-byte chunk of the source (Cache) per cp.async.
// kThreadsPerRow threads take a row's chunks, a 128-byte line at a time (64 bytes where rows are
// not whole lines), and each thread the same chunks of kRowsPerThread consecutive rows.
// SmemLayout: the stages' swizzled (kBlockN, kDim, stage) layout of Element, whose swizzle acts
// on shared-memory byte addresses. Cache narrower than Element: the source is widened (see
// above).
template <class Element, class Cache, int kBlockN, int kDim, class SmemLayout>
struct PagedRowGather {
  static constexpr bool kWidens = sizeof(Cache) < sizeof(Element);
  static_assert(!kWidens || 2 * sizeof(Cache) == sizeof(Element), "e4m3 to 16 bits");
  static constexpr int kRowBytes = kDim * int(sizeof(Cache));
  static constexpr int kThreadsPerRow = kRowBytes % 128 == 0 ? 8 : 4;
  static constexpr int kChunkElems = 16 / int(sizeof(Cache));
  static constexpr int kChunksPerThread = kRowBytes / 16 / kThreadsPerRow;
  static constexpr int kRowsPerThread = kBlockN / (kGatherThreads / kThreadsPerRow);
  // Where a source chunk lands: its own place, or the upper half of the span it widens to.
  static constexpr int kLandingCol = kWidens ? kChunkElems / 2 : 0;
  static_assert(kRowBytes % (16 * kThreadsPerRow) == 0, "rows of whole chunks per thread");
  static_assert(kBlockN % (kGatherThreads / kThreadsPerRow) == 0, "whole rows per thread");

  // The shared-memory byte address of element (row, col) of a stage.
  __device__ static uint32_t smem_at(uint32_t smem, int row, int col, int stage) {
    constexpr auto swizzle = get_swizzle_portion(SmemLayout{});
    constexpr auto unswizzled = get_nonswizzle_portion(SmemLayout{});
    return swizzle(smem + uint32_t(unswizzled(row, col, stage)) * uint32_t(sizeof(Element)));
  }
  // This thread's first chunk column, and j-th chunk's first element.
  __device__ static int chunk_col(int tid, int j) {
    return (tid % kThreadsPerRow + j * kThreadsPerRow) * kChunkElems;
  }
  __device__ static int first_row(int tid) { return tid / kThreadsPerRow * kRowsPerThread; }

  // Keys [first_key, first_key + kBlockN) of KV head `head` into stage `stage` of the stages at
  // shared-memory address smem: key j's row is row j % page_size of the page of column
  // j / page_size, from `pages` where the block's columns fit a warp's lanes, else from
  // page_of(column) (pages of a few rows).
  template <class PageOf>
  __device__ static void load(uint32_t smem, int stage, const PagedRows& rows, int head,
                              int first_key, int page_size, BlockPages pages, PageOf page_of,
                              int tid) {
    const int row0 = first_row(tid);
    const int key = first_key + row0;
    int column = key / page_size;
    int in_page = key - column * page_size;
    const bool in_lanes = (first_key + kBlockN - 1) / page_size - pages.first_column < 32;
#pragma unroll 1
    for (int r = row0; r < row0 + kRowsPerThread; ++r) {
      // Every lane shuffles (a converged warp); rows whose columns the lanes do not hold load.
      int page = __shfl_sync(0xffffffff, pages.lane_page, (column - pages.first_column) & 31);
      if (!in_lanes) page = page_of(column);
      const char* src = rows.base + int64_t(page) * rows.page_bytes +
                        int64_t(head) * rows.head_bytes + int64_t(in_page) * rows.row_bytes +
                        tid % kThreadsPerRow * 16;
#pragma unroll
      for (int j = 0; j < kChunksPerThread; ++j) {
        const uint32_t dst = smem_at(smem, r, chunk_col(tid, j) + kLandingCol, stage);
        asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;\n" ::"r"(dst),
                     "l"(src + j * kThreadsPerRow * 16));
      }
      if (++in_page == page_size) {
        in_page = 0;
        ++column;
      }
    }
  }

  // After this thread's copies into `stage` have landed: each of its chunks widened to Element
  // over the 32 bytes whose upper half holds it.
  __device__ static void widen(uint32_t smem, int stage, int tid) {
    static_assert(kWidens, "only a narrower cache is widened");
#pragma unroll 1
    for (int r = first_row(tid); r < first_row(tid) + kRowsPerThread; ++r) {
#pragma unroll
      for (int j = 0; j < kChunksPerThread; ++j) {
        const uint32_t lo = smem_at(smem, r, chunk_col(tid, j), stage);
        const uint32_t hi = smem_at(smem, r, chunk_col(tid, j) + kLandingCol, stage);
        uint4 narrow;
        asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(narrow.x), "=r"(narrow.y), "=r"(narrow.z), "=r"(narrow.w)
                     : "r"(hi));
        using Widened = CudaHalfOf<Element>;
        const uint2 w0 = convert_e4m3x4<Widened>(narrow.x), w1 = convert_e4m3x4<Widened>(narrow.y);
        const uint2 w2 = convert_e4m3x4<Widened>(narrow.z), w3 = convert_e4m3x4<Widened>(narrow.w);
        asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(lo), "r"(w0.x),
                     "r"(w0.y), "r"(w1.x), "r"(w1.y));
        asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(hi), "r"(w2.x),
                     "r"(w2.y), "r"(w3.x), "r"(w3.y));
      }
    }
  }
};

}  // namespace flashattn::sm90
