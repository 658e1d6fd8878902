// Where each batch entry's rows lie, for every kernel family. Dense calls: entry b is slice b of
// every tensor's batch axis, with seqlen_q query and seqlen_k key rows. Packed (varlen) calls:
// the tensors have one batch entry, and entry b owns the rows its offsets name (flash_api.h).
// The kernels ask `at(b)` once per work unit and then index every tensor, the LSE and the
// workspace from the Entry it returns, so that the main loops are the same for both.
#pragma once

#include <cstdint>

#include "../flash_api.h"
#include "block_range.h"

namespace flashattn {

struct Sequences {
  const int32_t* cu_q = nullptr;  // null: dense
  const int32_t* cu_k = nullptr;  // packed, null: keys in a paged cache (every entry's from 0)
  const int32_t* used_k = nullptr;
  int rows_q = 0, rows_k = 0;  // dense: every entry's lengths; packed: the tensors' rows
  int max_q = 0, max_k = 0;    // the longest entry the grids cover
  // Packed: 0 for the LSE over the packed rows, (heads, rows_q); else (batch, heads, lse_rows)
  // by entry (lse_rows = max_q).
  int lse_rows = 0;

  struct Entry {
    int index;             // the entry's number b, dense or packed
    int batch;             // index on the tensors' batch axis (0 when packed)
    int q_start, k_start;  // first row on the tensors' row axis
    int seqlen_q, seqlen_k;
    // Key rows the entry owns (its offsets' range, within the grid's maximum): seqlen_k and,
    // past a used-key count (seqused_k), the unused keys, whose dK and dV are zero.
    int keys_owned;
    // Offset of (row 0, head `head`) in a (batch, heads, rows) f32 array (the forward's LSE:
    // Sequences::lse_offset says which layout a call's takes): dense entry b's rows follow entry
    // b − 1's; packed, head h's rows are the tensors' rows.
    __host__ __device__ int64_t rows_offset(int head, int heads, int rows_total) const {
      return (int64_t(batch) * heads + head) * rows_total + q_start;
    }
    // The call's key rule (masks, windows) over this entry's lengths.
    __host__ __device__ KeyRange keys(KeyRange call) const {
      call.seqlen_q = seqlen_q;
      call.seqlen_k = seqlen_k;
      return call;
    }
  };

  __host__ __device__ bool packed() const { return cu_q != nullptr; }

  // Entry b. Packed offsets come from the caller's device arrays unchecked: each is clamped
  // into the tensors (start into [0, rows], end into [start, rows], length to the grid's
  // maximum, used keys into [0, length]), so a malformed array can give wrong rows but never
  // an index outside the buffers. A paged entry owns the keys its row of the page table
  // addresses (rows_k), and the kernel finds their pages.
  __device__ Entry at(int b) const {
    if (!packed()) return {b, b, 0, 0, rows_q, rows_k, rows_k};
    auto clamp = [](int x, int lo, int hi) { return x < lo ? lo : (x > hi ? hi : x); };
    const int q0 = clamp(cu_q[b], 0, rows_q), q1 = clamp(cu_q[b + 1], q0, rows_q);
    const int k0 = cu_k == nullptr ? 0 : clamp(cu_k[b], 0, rows_k);
    const int k1 = cu_k == nullptr ? rows_k : clamp(cu_k[b + 1], k0, rows_k);
    const int owned = k1 - k0 < max_k ? k1 - k0 : max_k;
    const int len_k = used_k != nullptr ? clamp(used_k[b], 0, owned) : owned;
    return {b, 0, q0, k0, q1 - q0 < max_q ? q1 - q0 : max_q, len_k, owned};
  }
  // Offset of entry e's (row 0, head `head`) in the forward's LSE: rows_offset, or with
  // lse_rows, (e, head)'s lse_rows of a (batch, heads, lse_rows) array.
  __host__ __device__ int64_t lse_offset(const Entry& e, int head, int heads,
                                         int rows_total) const {
    if (lse_rows > 0) return (int64_t(e.index) * heads + head) * lse_rows;
    return e.rows_offset(head, heads, rows_total);
  }
  // Entry b's first key row, as at(b) gives it, alone (packed keys in rows: not a paged call's).
  __device__ int k_start(int b) const {
    const int k0 = cu_k[b];
    return k0 < 0 ? 0 : (k0 > rows_k ? rows_k : k0);
  }
};

// Packed calls number each sequence's blocks of n rows per head along one axis, sequence b's
// from packed_block(start, b, n) on (start: its first row): as floor(s / n) + ceil(len / n) is
// at most floor((s + len) / n) + 1, no two sequences' blocks overlap when the offsets are well
// formed, and with any clamped ones (start + len within the rows) all lie below
// packed_blocks(rows, batch, n). The sm90 backward's key blocks and the FP8 forward's descale
// blocks (and V's key-major columns) are numbered so.
__host__ __device__ inline int64_t packed_block(int start, int b, int n) {
  return start / n + int64_t(b);
}
__host__ __device__ inline int64_t packed_blocks(int rows, int batch, int n) {
  return rows / n + int64_t(batch);
}

// The last b in [0, n) whose start(b) is at or before x (0 if none): a binary search, for starts
// that grow with b, as well-formed offsets give them. For malformed offsets it returns some b in
// [0, n), whose clamped Entry still keeps every access in bounds; the caller checks that x lies
// inside what b owns.
template <class Start>
__device__ int last_start_at_most(int n, int64_t x, Start start) {
  int lo = 0, hi = n;  // the answer lies in [lo, hi)
  while (hi - lo > 1) {
    const int mid = lo + (hi - lo) / 2;
    if (start(mid) <= x) lo = mid;
    else hi = mid;
  }
  return lo;
}

// The call's entries: dense, or packed by its offsets.
inline Sequences sequences(const flashattn_params_t& p) {
  Sequences s;
  s.rows_q = p.seqlen_q;
  s.rows_k = p.seqlen_k;
  if (p.cu_seqlens_q == nullptr) {
    s.max_q = p.seqlen_q;
    s.max_k = p.seqlen_k;
    return s;
  }
  s.cu_q = p.cu_seqlens_q;
  s.cu_k = p.cu_seqlens_k;
  s.used_k = p.seqused_k;
  s.max_q = p.max_seqlen_q;
  s.max_k = p.max_seqlen_k;
  s.lse_rows = p.lse_by_sequence ? p.max_seqlen_q : 0;
  return s;
}

}  // namespace flashattn
