// Which keys a query row may see, and which key blocks a tile of query rows must visit.
// The one place for the causal / sliding-window index arithmetic on the device, mirroring
// `Mask::key_range` in src/config.rs: causal is bottom-right aligned (row i sits on key diagonal
// i + seqlen_k - seqlen_q) and is a window with right = 0; -1 means unbounded.
#pragma once

#include <cstdint>

namespace flashattn {

struct KeyRange {
  int seqlen_q, seqlen_k;
  int window_left, window_right;  // -1 = unbounded

  // 32-bit throughout (64-bit index math cost the d256 kernel registers it spilled): with
  // 0 <= row < seqlen_q, diag = row + seqlen_k - seqlen_q lies in [-seqlen_q, seqlen_k), and each
  // window is compared against the distance to the bound before it is added.

  // First visible key of row `row` (may exceed seqlen_k: then the row sees nothing).
  __host__ __device__ int lo(int row) const {
    if (window_left < 0) return 0;
    const int diag = row + (seqlen_k - seqlen_q);
    return diag <= window_left ? 0 : diag - window_left;  // in (0, seqlen_k)
  }
  // One past the last visible key of row `row`.
  __host__ __device__ int hi(int row) const {
    if (window_right < 0) return seqlen_k;
    const int diag = row + (seqlen_k - seqlen_q);
    if (window_right >= seqlen_k - 1 - diag) return seqlen_k;
    return diag + window_right + 1 < 0 ? 0 : diag + window_right + 1;
  }

  // Key blocks [n_min, n_max) that rows [row_begin, row_end) touch; empty when n_max <= n_min.
  template <int kBlockN>
  __host__ __device__ void blocks(int row_begin, int row_end, int& n_min, int& n_max) const {
    if (row_end > seqlen_q) row_end = seqlen_q;
    int first = lo(row_begin);
    int last = hi(row_end - 1);
    n_min = first / kBlockN;
    n_max = (last + kBlockN - 1) / kBlockN;
  }

  // Does key block `n` need an element mask for rows [row_begin, row_end)? Blocks fully inside
  // every row's range and below seqlen_k do not.
  template <int kBlockN>
  __host__ __device__ bool block_needs_mask(int n, int row_begin, int row_end) const {
    if (row_end > seqlen_q) row_end = seqlen_q;
    int col_begin = n * kBlockN, col_end = col_begin + kBlockN;
    if (col_end > seqlen_k) return true;
    if (window_right >= 0 && col_end > hi(row_begin)) return true;
    if (window_left >= 0 && col_begin < lo(row_end - 1)) return true;
    return false;
  }

  // The key blocks that block_needs_mask passes for rows [row_begin, row_end): exactly
  // [first, last] (empty when last < first), since its tests are monotone in n.
  template <int kBlockN>
  __host__ __device__ void unmasked_blocks(int row_begin, int row_end, int& first,
                                           int& last) const {
    if (row_end > seqlen_q) row_end = seqlen_q;
    int end = seqlen_k;  // (n + 1)·kBlockN <= end
    if (window_right >= 0 && hi(row_begin) < end) end = hi(row_begin);
    last = end / kBlockN - 1;
    first = window_left >= 0 ? (lo(row_end - 1) + kBlockN - 1) / kBlockN : 0;  // lo >= 0
  }

  // Query rows [row_lo, row_hi) that see any key of [col_begin, col_end): both bounds of a row's
  // keys grow with the row.
  __host__ __device__ void rows_seeing(int col_begin, int col_end, int& row_lo,
                                       int& row_hi) const {
    const int64_t shift = int64_t(seqlen_k) - seqlen_q;  // row r sits on key r + shift
    int64_t first = 0, last = seqlen_q;
    if (window_right >= 0) first = col_begin - window_right - shift;  // hi(r) > col_begin
    if (window_left >= 0) last = col_end + window_left - shift;       // lo(r) < col_end
    row_lo = int(first < 0 ? 0 : (first > seqlen_q ? seqlen_q : first));
    row_hi = int(last < row_lo ? row_lo : (last > seqlen_q ? seqlen_q : last));
  }

  __host__ __device__ bool visible(int row, int col) const {
    return col < seqlen_k && col >= lo(row) && col < hi(row);
  }
};

}  // namespace flashattn
