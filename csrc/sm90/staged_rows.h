// A tile of rows staged in shared memory so that it leaves by 16-byte coalesced stores: WGMMA
// accumulators hold, per thread, pairs of neighbouring columns in 8 rows at once, so stores
// straight from them write 4 bytes per thread spread over 8 rows (4x the store instructions).
// Row-major, with 16-byte chunk c of row r at chunk c ^ (r % 8): the 8 rows one accumulator store
// spans fall in different banks, and a row reads back as one contiguous run. Rows of no multiple
// of 8 chunks (d96's 12) take chunk (c + r) % chunks instead, which stays within the row, at
// two-way conflicts where the XOR would leave the row.
#pragma once

#include <cutlass/array.h>

#include <cstdint>

namespace flashattn::sm90 {

template <int kCols, class Element>
struct StagedRows {
  static constexpr int kChunk = 16 / sizeof(Element);  // elements per 16-byte chunk
  static constexpr int kChunksPerRow = kCols / kChunk;
  static_assert(kCols % kChunk == 0 && kChunksPerRow >= 8, "8 chunks of a row to permute");

  __device__ static int chunk_at(int row, int chunk) {
    if constexpr (kChunksPerRow % 8 == 0)
      return chunk ^ (row % 8);
    else
      return (chunk + row) % kChunksPerRow;
  }
  __device__ static int at(int row, int col) {
    return row * kCols + chunk_at(row, col / kChunk) * kChunk + col % kChunk;
  }

  // Columns col, col + 1 of `row` (an accumulator's pair of neighbouring columns) as one word.
  __device__ static void put(Element* stage, int row, int col, Element a, Element b) {
    cutlass::Array<Element, 2> pair;
    pair[0] = a;
    pair[1] = b;
    *reinterpret_cast<cutlass::Array<Element, 2>*>(stage + at(row, col)) = pair;
  }

  // Column col of `row` alone (an accumulator that holds the rows across: dKᵀ, dVᵀ).
  __device__ static void put_one(Element* stage, int row, int col, Element a) {
    stage[at(row, col)] = a;
  }

  // `threads` threads, this one `thread` (0 .. threads - 1), copy rows [0, rows) of `stage` to
  // dst + row * row_stride, 16 bytes per store; rows from `end` on are not written.
  __device__ static void store(const Element* stage, Element* dst, int64_t row_stride, int rows,
                               int end, int thread, int threads) {
#pragma unroll 1
    for (int c = thread; c < rows * kChunksPerRow; c += threads) {
      const int row = c / kChunksPerRow, chunk = c % kChunksPerRow;
      if (row >= end) break;  // rows grow with c
      *reinterpret_cast<uint4*>(dst + row * row_stride + chunk * kChunk) =
          *reinterpret_cast<const uint4*>(stage + at(row, chunk * kChunk));
    }
  }
};

}  // namespace flashattn::sm90
