// The backward's passes around the main kernel that every kernel family shares: D = rowsum(dO ∘ O)
// with LSE·log2(e) before it, and f32 sums to the element type after it.
#pragma once

#include <cutlass/array.h>

#include <cmath>
#include <cstdint>

namespace flashattn {

// What the preprocess reads and writes. LSE·log2(e) and D have dq_rows rows per (batch, head):
// seqlen_q rounded up to whole query blocks, +inf and 0 in the padding, so that the main kernel
// loads whole blocks and padded rows give P = 0.
struct BwdRowsParams {
  const void* o;
  const void* dout;
  const float* lse;  // the forward's (batch, heads_q, seqlen_q)
  float* lse_log2;   // (batch, heads_q, dq_rows)
  float* softmax_d;  // (batch, heads_q, dq_rows)
  int64_t o_batch_stride, o_row_stride, o_head_stride;
  int64_t do_batch_stride, do_row_stride, do_head_stride;
  int batch, heads_q, seqlen_q, dq_rows;
};

// One warp per (batch, head, row), 16-byte loads.
template <class Element, int kHeadDim>
__global__ void __launch_bounds__(256) bwd_preprocess(__grid_constant__ const BwdRowsParams p) {
  const int64_t row_id = int64_t(blockIdx.x) * 8 + threadIdx.x / 32;
  const int64_t rows = int64_t(p.batch) * p.heads_q * p.dq_rows;
  if (row_id >= rows) return;
  const int row = int(row_id % p.dq_rows);
  const int64_t bh = row_id / p.dq_rows;
  const int head = int(bh % p.heads_q);
  const int batch = int(bh / p.heads_q);
  const int lane = threadIdx.x % 32;
  const bool in = row < p.seqlen_q;
  constexpr int kChunks = kHeadDim / 8;
  float sum = 0.f;
  if (in && lane < kChunks) {
    auto o = static_cast<const Element*>(p.o) + batch * p.o_batch_stride +
             head * p.o_head_stride + row * p.o_row_stride + lane * 8;
    auto dout = static_cast<const Element*>(p.dout) + batch * p.do_batch_stride +
                head * p.do_head_stride + row * p.do_row_stride + lane * 8;
    cutlass::Array<Element, 8> a = *reinterpret_cast<const cutlass::Array<Element, 8>*>(o);
    cutlass::Array<Element, 8> b = *reinterpret_cast<const cutlass::Array<Element, 8>*>(dout);
#pragma unroll
    for (int i = 0; i < 8; ++i) sum += float(a[i]) * float(b[i]);
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffff, sum, off);
  if (lane == 0) {
    p.softmax_d[row_id] = sum;
    p.lse_log2[row_id] = in ? p.lse[bh * p.seqlen_q + row] * float(M_LOG2E) : INFINITY;
  }
}

// Where 8-float chunk `chunk` of row `row` of an f32 accumulator lives when the chunks of each
// row are permuted by the row (chunk c at c ^ row % 8): the sm90 backward's dQ tile
// (and so its global accumulator, which bulk adds copy tile for tile), so that the 8 rows one
// accumulator store touches fall on different shared-memory banks.
__host__ __device__ constexpr int permuted_chunk(int row, int chunk) { return chunk ^ (row % 8); }

// f32 sums to the element type, times `scale`: packed (batch, heads·group, src_rows, kHeadDim),
// the `group` consecutive heads of each output head summed in order -> the first `seqlen` rows of
// each head, strided (batch, seqlen, heads). kPermuted: chunks placed as permuted_chunk says
// (rows of a head start on multiples of 8). One thread per 8 elements.
template <class Element, int kHeadDim, bool kPermuted = false>
__global__ void __launch_bounds__(256)
    bwd_convert(const float* src, int src_rows, int group, void* dst, int64_t b_stride,
                int64_t row_stride, int64_t h_stride, int batch, int heads, int seqlen,
                float scale) {
  const int64_t chunk = int64_t(blockIdx.x) * 256 + threadIdx.x;
  constexpr int kChunks = kHeadDim / 8;
  if (chunk >= int64_t(batch) * heads * seqlen * kChunks) return;
  const int64_t row_id = chunk / kChunks;  // (batch, head, row) packed
  const int c = int(chunk % kChunks);
  const int row = int(row_id % seqlen);
  const int head = int(row_id / seqlen % heads);
  const int b = int(row_id / seqlen / heads);
  float sum[8] = {};
  for (int g = 0; g < group; ++g) {
    const float* s = src + ((int64_t(b) * heads + head) * group + g) * src_rows * kHeadDim +
                     int64_t(row) * kHeadDim + (kPermuted ? permuted_chunk(row, c) : c) * 8;
#pragma unroll
    for (int i = 0; i < 8; ++i) sum[i] += s[i];
  }
  cutlass::Array<Element, 8> out;
#pragma unroll
  for (int i = 0; i < 8; ++i) out[i] = Element(sum[i] * scale);
  *reinterpret_cast<cutlass::Array<Element, 8>*>(static_cast<Element*>(dst) + b * b_stride +
                                                 head * h_stride + row * row_stride + c * 8) = out;
}

}  // namespace flashattn
