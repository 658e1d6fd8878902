// A paged cache whose pages hold no whole key block, loaded by the sm90 forward's producer
// warpgroup: its 128 threads copy each key block's rows by cp.async, every row from its own
// page, into the stage's swizzled rows; each thread's arrival on the stage's full barrier
// completes when its copies have landed (TmaPipeline::producer_commit_copies). One TMA box per
// page piece would issue a box for every few rows of a block.
#pragma once

#include <cute/tensor.hpp>

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

// kBlockN rows of kDim elements, a 16-byte chunk per cp.async. kThreadsPerRow threads take a
// row's chunks, a 128-byte line at a time (64 bytes where rows are not whole lines), and each
// thread the same chunks of kRowsPerThread consecutive rows. SmemLayout: the stages' swizzled
// (kBlockN, kDim, stage) layout, whose swizzle acts on shared-memory byte addresses.
template <class Element, int kBlockN, int kDim, class SmemLayout>
struct PagedRowGather {
  static constexpr int kRowBytes = kDim * int(sizeof(Element));
  static constexpr int kThreadsPerRow = kRowBytes % 128 == 0 ? 8 : 4;
  static constexpr int kChunkElems = 16 / int(sizeof(Element));
  static constexpr int kChunksPerThread = kRowBytes / 16 / kThreadsPerRow;
  static constexpr int kRowsPerThread = kBlockN / (kGatherThreads / kThreadsPerRow);
  static_assert(kRowBytes % (16 * kThreadsPerRow) == 0, "rows of whole chunks per thread");
  static_assert(kBlockN % (kGatherThreads / kThreadsPerRow) == 0, "whole rows per thread");

  // Keys [first_key, first_key + kBlockN) of KV head `head` into stage `stage` of the stages at
  // shared-memory address smem: key j's row is row j % page_size of the page of column
  // j / page_size, from `pages` where the block's columns fit a warp's lanes, else from
  // page_of(column) (pages of a few rows).
  template <class PageOf>
  __device__ static void load(uint32_t smem, int stage, const PagedRows& rows, int head,
                              int first_key, int page_size, BlockPages pages, PageOf page_of,
                              int tid) {
    constexpr auto swizzle = get_swizzle_portion(SmemLayout{});
    constexpr auto unswizzled = get_nonswizzle_portion(SmemLayout{});
    const int chunk = tid % kThreadsPerRow;
    const int first_row = tid / kThreadsPerRow * kRowsPerThread;
    const int key = first_key + first_row;
    int column = key / page_size;
    int in_page = key - column * page_size;
    const bool in_lanes = (first_key + kBlockN - 1) / page_size - pages.first_column < 32;
#pragma unroll 1
    for (int r = first_row; r < first_row + kRowsPerThread; ++r) {
      // Every lane shuffles (a converged warp); rows whose columns the lanes do not hold load.
      int page = __shfl_sync(0xffffffff, pages.lane_page, (column - pages.first_column) & 31);
      if (!in_lanes) page = page_of(column);
      const char* src = rows.base + int64_t(page) * rows.page_bytes +
                        int64_t(head) * rows.head_bytes + int64_t(in_page) * rows.row_bytes +
                        chunk * 16;
#pragma unroll
      for (int j = 0; j < kChunksPerThread; ++j) {
        const int col = (chunk + j * kThreadsPerRow) * kChunkElems;
        const uint32_t dst =
            swizzle(smem + uint32_t(unswizzled(r, col, stage)) * uint32_t(sizeof(Element)));
        asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;\n" ::"r"(dst),
                     "l"(src + j * kThreadsPerRow * 16));
      }
      if (++in_page == page_size) {
        in_page = 0;
        ++column;
      }
    }
  }
};

}  // namespace flashattn::sm90
