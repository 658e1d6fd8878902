// The C ABI's operand checks: what memory a strided view touches, whether the kernels can
// address it, and whether two views share an element. Host code only; the entry points in
// flash_api.cu run these before any launch, so that a bad view from C is refused rather than read
// or written out of bounds.
#pragma once

#include <cstdint>

#include "../flash_api.h"

namespace flashattn {

// A strided view of up to four dimensions over `elem_bytes`-byte elements; strides in elements.
// Dimensions of extent 1 never use their stride.
struct View {
  const void* ptr = nullptr;
  int elem_bytes = 1;
  int align = 16;  // bytes the pointer must be aligned to
  int rank = 0;
  int64_t extent[4] = {1, 1, 1, 1};
  int64_t stride[4] = {0, 0, 0, 0};

  // A (batch, seqlen, heads, head_dim) operand with a unit head_dim stride.
  static View of(const flashattn_tensor_t& t, int elem_bytes, int64_t batch, int64_t seqlen,
                 int64_t heads, int64_t head_dim) {
    View v;
    v.ptr = t.ptr;
    v.elem_bytes = elem_bytes;
    v.rank = 4;
    const int64_t extent[4] = {batch, seqlen, heads, head_dim};
    const int64_t stride[4] = {t.batch_stride, t.row_stride, t.head_stride, 1};
    for (int i = 0; i < 4; ++i) {
      v.extent[i] = extent[i];
      v.stride[i] = stride[i];
    }
    return v;
  }
  // `count` packed elements at a pointer aligned to `align` bytes.
  static View packed(const void* ptr, int elem_bytes, int64_t count, int align) {
    View v;
    v.ptr = ptr;
    v.elem_bytes = elem_bytes;
    v.align = align;
    v.rank = 1;
    v.extent[0] = count;
    v.stride[0] = 1;
    return v;
  }

  // The largest element offset, or -1 when a stride is negative or the offset overflows int64.
  int64_t last_offset() const {
    int64_t last = 0;
    for (int i = 0; i < rank; ++i) {
      if (extent[i] < 1) return -1;
      if (extent[i] == 1) continue;
      if (stride[i] < 0) return -1;
      int64_t term = 0;
      if (__builtin_mul_overflow(extent[i] - 1, stride[i], &term) ||
          __builtin_add_overflow(last, term, &last))
        return -1;
    }
    return last;
  }
  // Bytes from ptr to the end of the last element, or -1 on overflow.
  int64_t span_bytes() const {
    const int64_t last = last_offset();
    int64_t bytes = 0;
    if (last < 0 || __builtin_mul_overflow(last + 1, int64_t(elem_bytes), &bytes)) return -1;
    return bytes;
  }

  // A non-null pointer aligned to `align`, 16-byte multiples as strides (TMA and the 16-byte
  // vector accesses) below 2^40 bytes (TMA's limit), and a span that fits in int64 bytes.
  bool addressable() const {
    if (ptr == nullptr || reinterpret_cast<uintptr_t>(ptr) % align != 0) return false;
    if (rank < 1 || stride[rank - 1] != 1) return false;  // the innermost dimension is packed
    for (int i = 0; i + 1 < rank; ++i) {
      if (extent[i] == 1) continue;
      if (stride[i] < 0 || stride[i] >= (int64_t(1) << 40)) return false;
      const int64_t bytes = stride[i] * elem_bytes;  // below 2^43: no overflow
      if (bytes % 16 != 0 || bytes >= (int64_t(1) << 40)) return false;
    }
    return span_bytes() >= 0;
  }

  // No two index tuples reach the same element: ordered by stride, each dimension's stride
  // passes the furthest offset of the dimensions below it. (Writes of many CTAs to one element
  // would race.)
  bool one_to_one() const {
    int order[4];
    int n = 0;
    for (int i = 0; i < rank; ++i)
      if (extent[i] > 1) order[n++] = i;
    for (int a = 1; a < n; ++a)  // insertion sort by stride
      for (int b = a; b > 0 && stride[order[b]] < stride[order[b - 1]]; --b) {
        const int t = order[b];
        order[b] = order[b - 1];
        order[b - 1] = t;
      }
    int64_t reach = 0;  // furthest offset of the dimensions so far
    for (int a = 0; a < n; ++a) {
      const int i = order[a];
      if (stride[i] <= reach) return false;
      reach += (extent[i] - 1) * stride[i];  // bounded by last_offset(), checked by addressable()
    }
    return true;
  }
};

namespace detail {

// Is there a, b with a - b == delta, a in A's offsets and b in B's (same strides, dimensions
// sorted by falling stride from `i` on)? `reach_a[i]`, `reach_b[i]`: furthest offsets of
// dimensions i.. of A and of B. Where strides nest (each passes the reach below it) at most two
// digits fit each dimension; elsewhere the search gives up and answers yes.
inline bool reaches(int64_t delta, int i, int n, const int* order, const View& a, const View& b,
                    const int64_t* reach_a, const int64_t* reach_b) {
  if (i == n) return delta == 0;
  const int d = order[i];
  const int64_t s = a.stride[d];
  if (s <= 0) return true;
  const int64_t lo_rest = -reach_b[i + 1], hi_rest = reach_a[i + 1];
  // c · s + rest == delta with rest in [lo_rest, hi_rest] and c in [-(nb - 1), na - 1].
  auto floor_div = [](int64_t x, int64_t y) { return x / y - ((x % y != 0) && ((x < 0) != (y < 0))); };
  int64_t c_lo = -floor_div(-(delta - hi_rest), s);  // ceil((delta - hi_rest) / s)
  int64_t c_hi = floor_div(delta - lo_rest, s);
  if (c_lo < -(b.extent[d] - 1)) c_lo = -(b.extent[d] - 1);
  if (c_hi > a.extent[d] - 1) c_hi = a.extent[d] - 1;
  if (c_hi - c_lo > 1) return true;
  for (int64_t c = c_lo; c <= c_hi; ++c)
    if (reaches(delta - c * s, i + 1, n, order, a, b, reach_a, reach_b)) return true;
  return false;
}

}  // namespace detail

// Do two addressable views share a byte? Disjoint byte ranges never do; views with the same
// element size and strides (dQ, dK, dV interleaved in one packed buffer) are checked element by
// element; any other overlap of ranges counts as shared.
inline bool overlap(const View& a, const View& b) {
  const auto pa = reinterpret_cast<uintptr_t>(a.ptr), pb = reinterpret_cast<uintptr_t>(b.ptr);
  const auto ea = pa + uintptr_t(a.span_bytes()), eb = pb + uintptr_t(b.span_bytes());
  if (ea <= pb || eb <= pa) return false;
  if (a.rank != b.rank || a.elem_bytes != b.elem_bytes) return true;
  int order[4];
  int n = 0;
  for (int i = 0; i < a.rank; ++i) {
    if (a.stride[i] != b.stride[i] && (a.extent[i] > 1 || b.extent[i] > 1)) return true;
    if (a.extent[i] > 1 || b.extent[i] > 1) order[n++] = i;
  }
  for (int x = 1; x < n; ++x)  // by falling stride
    for (int y = x; y > 0 && a.stride[order[y]] > a.stride[order[y - 1]]; --y) {
      const int t = order[y];
      order[y] = order[y - 1];
      order[y - 1] = t;
    }
  int64_t reach_a[5] = {0, 0, 0, 0, 0}, reach_b[5] = {0, 0, 0, 0, 0};
  for (int i = n - 1; i >= 0; --i) {
    reach_a[i] = reach_a[i + 1] + (a.extent[order[i]] - 1) * a.stride[order[i]];
    reach_b[i] = reach_b[i + 1] + (b.extent[order[i]] - 1) * b.stride[order[i]];
  }
  const int64_t delta_bytes = int64_t(pb - pa);
  if (delta_bytes % a.elem_bytes != 0) return true;  // elements straddle each other
  return detail::reaches(delta_bytes / a.elem_bytes, 0, n, order, a, b, reach_a, reach_b);
}

}  // namespace flashattn
