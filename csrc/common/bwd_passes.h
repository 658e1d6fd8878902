// The backward's passes around the main kernel that every kernel family shares: D = rowsum(dO ∘ O)
// with LSE·log2(e) and the zeroed dQ accumulator before it, and f32 sums to the element type
// after it.
#pragma once

#include <cuda_runtime.h>
#include <cutlass/array.h>

#include <cmath>
#include <cstdint>

#include "block_range.h"
#include "bwd_workspace.h"
#include "sequences.h"

namespace flashattn {

// What the preprocess reads and writes. LSE·log2(e) and D have dq_rows rows per (batch, head):
// seqlen_q rounded up to whole query blocks, +inf and 0 in the padding, so that the main kernel
// loads whole blocks and padded rows give P = 0. The f32 dQ accumulator (dq_slices slices of
// (batch, heads_q, dq_rows, head_dim) floats, dq_slice_stride apart) is zeroed here too, instead
// of by a memset of its own: one pass over memory fewer before the main kernel.
// Packed calls (seqs.packed()): `batch` sequences, seqlen_q the tensors' rows, and dq_rows rows
// per head in the packed layout of bwd_rows_start (batch 1 in the shapes below); rows of a head
// that no sequence's run holds are written as padding too.
struct BwdRowsParams {
  const void* o;
  const void* dout;
  const float* lse;  // the forward's (batch, heads_q, seqlen_q)
  float* lse_log2;   // (batch, heads_q, dq_rows)
  float* softmax_d;  // (batch, heads_q, dq_rows)
  int64_t o_batch_stride, o_row_stride, o_head_stride;
  int64_t do_batch_stride, do_row_stride, do_head_stride;
  int batch, heads_q, seqlen_q, dq_rows;
  float* dq_accum;
  int64_t dq_slice_stride;
  int dq_slices;
  // Where the main kernel converts dQ itself (the sm90 deterministic mode of the kernel that
  // splits the keys), dQ, written
  // as 0 here for the rows that see no key: the main kernel converts a query block once its last
  // key block has added, so rows that no key block visits are not written there. Else null.
  void* dq;
  int64_t dq_batch_stride, dq_row_stride, dq_head_stride;
  KeyRange keys;
  // The sm90 deterministic backward's dQ semaphores (an int per 32 rows of (batch, heads_q,
  // dq_rows)), zeroed here instead of by a memset of their own; else null.
  int* dq_counters = nullptr;
  Sequences seqs = Sequences{};  // default: dense
  // Packed calls of the sm90 deterministic backward: a flag the launcher zeroed, set here where
  // the offsets break the hand-over's layout (bwd_offsets_malformed, with key blocks of
  // `key_block` keys); else null.
  int* offsets_malformed = nullptr;
  int key_block = 0;
  // Packed calls: the sequence of each kDqRowAlign rows of a head's query workspace rows
  // (bwd_packed_entries, -1: none).
  const int* row_entries = nullptr;
};

// Packed calls: which sequence owns each kDqRowAlign-row block of a head's query workspace rows
// (row_entries, row_blocks of them; its run holds the block's first row) and each packed key
// block of kKeyBlock keys (key_entries, key_blocks of them; none where kKeyBlock is 0), -1 for
// none. The binary searches over the offsets run here once per block, one thread each, so that
// the kernels after this one read an int where they would search per thread or per CTA (and wait
// on a chain of dependent loads before their first useful one).
template <int kKeyBlock>
__global__ void __launch_bounds__(256)
    bwd_packed_entries(Sequences seqs, int batch, int row_blocks, int* row_entries,
                       int key_blocks, int* key_entries) {
  const int i = blockIdx.x * 256 + threadIdx.x;
  if (i < row_blocks) {
    const int64_t w = int64_t(i) * kDqRowAlign;
    const int b = bwd_entry_of_row(seqs, batch, w);
    const Sequences::Entry e = seqs.at(b);
    const int64_t r = w - bwd_packed_run(e.q_start, b);
    row_entries[i] = r >= 0 && r < e.seqlen_q ? b : -1;
  }
  if constexpr (kKeyBlock > 0) {
    if (i < key_blocks) {
      const int b = last_start_at_most(
          batch, i, [&](int j) { return packed_block(seqs.k_start(j), j, kKeyBlock); });
      const Sequences::Entry e = seqs.at(b);
      const int64_t n = i - packed_block(e.k_start, b, kKeyBlock);
      key_entries[i] = n >= 0 && n * kKeyBlock < e.keys_owned ? b : -1;
    }
  }
}

// The launch of bwd_packed_entries for call `p` (packed) into workspace `ws` at `base`; kKeyBlock
// 0: the row table alone.
template <int kKeyBlock>
cudaError_t launch_bwd_packed_entries(const flashattn_params_t& p, const BwdWorkspace& ws,
                                      char* base, cudaStream_t stream) {
  static_assert(kKeyBlock == 0 || kKeyBlock >= kMinKeyBlock, "the key table's size");
  const int64_t row_blocks = bwd_rows_per_head(p) / kDqRowAlign;
  const int64_t key_blocks =
      kKeyBlock > 0 ? packed_blocks(p.seqlen_k, p.batch, kKeyBlock) : 0;
  const int64_t threads = row_blocks > key_blocks ? row_blocks : key_blocks;
  bwd_packed_entries<kKeyBlock><<<unsigned((threads + 255) / 256), 256, 0, stream>>>(
      sequences(p), p.batch, int(row_blocks), reinterpret_cast<int*>(base + ws.row_entries),
      int(key_blocks), reinterpret_cast<int*>(base + ws.key_entries));
  return cudaGetLastError();
}

// Threads per row of the backward's row passes: one per 8 columns, rounded up to a power of two
// so that a row's threads share a warp (head dims 96 and 192 leave 4 and 8 of 16 and 32 idle).
template <int kHeadDim>
constexpr int bwd_threads_per_row() {
  int n = 1;
  while (n < kHeadDim / 8) n *= 2;
  return n;
}

// bwd_threads_per_row threads per (batch, head, row), 8 columns each (of the wider of the two
// head dims: O and dO have kHeadDimV columns, the dQ accumulator kHeadDim): O and dO as 8-element
// arrays (4-byte loads: cutlass::Array is aligned to its element; 16-byte ones made the whole
// backward no faster, benchmarks/README.md), the row's sum over its threads by shuffles, and
// the row's 8-float chunks of the dQ accumulator zeroed (whatever the accumulator's layout within
// a head, a head's rows are dq_rows · head_dim contiguous floats, so row r's chunk c at
// r · head_dim + 8c covers them all). Every lane of a warp is busy at the power-of-two head dims,
// which one warp per row was not.
template <int kHeadDim, int kHeadDimV>
constexpr int bwd_preprocess_threads_per_row() {
  return bwd_threads_per_row<(kHeadDim > kHeadDimV ? kHeadDim : kHeadDimV)>();
}

template <class Element, int kHeadDim, int kHeadDimV>
__global__ void __launch_bounds__(256) bwd_preprocess(__grid_constant__ const BwdRowsParams p) {
  constexpr int kThreadsPerRow = bwd_preprocess_threads_per_row<kHeadDim, kHeadDimV>();
  static_assert(kThreadsPerRow <= 32 && kHeadDim % 8 == 0 && kHeadDimV % 8 == 0);
  const int64_t row_id = (int64_t(blockIdx.x) * 256 + threadIdx.x) / kThreadsPerRow;
  const int chunk = threadIdx.x % kThreadsPerRow;
  // Else a lane that pads the row's threads, or one past the narrower head dim's columns.
  const bool has_columns = chunk < kHeadDim / 8;
  const bool has_columns_v = chunk < kHeadDimV / 8;
  const int64_t rows = int64_t(p.seqs.packed() ? 1 : p.batch) * p.heads_q * p.dq_rows;
  // Threads past the last row stay for the shuffles (a row's threads share a warp) and store
  // nothing.
  const bool live = row_id < rows;
  const int w = int(row_id % p.dq_rows);  // row within the (batch entry, head)'s dq_rows
  const int64_t bh = row_id / p.dq_rows;
  const int head = int(bh % p.heads_q);
  // The row's entry: dense, (batch, head) bh's; packed, the sequence whose run holds w, and the
  // row within it (seqlen_q or more for padding and for rows of no run).
  int batch = int(bh / p.heads_q), row = w, seqlen_q = p.seqlen_q, q_start = 0;
  int64_t lse_at = bh * p.seqlen_q;  // the forward's LSE of (row 0, head)
  KeyRange keys = p.keys;
  if (p.seqs.packed()) {
    const int b = p.row_entries[w / kDqRowAlign];
    const Sequences::Entry e = p.seqs.at(b < 0 ? 0 : b);
    const int64_t r = w - bwd_rows_start(p.seqs, e, b, 0, p.heads_q, p.dq_rows);
    seqlen_q = b < 0 ? 0 : e.seqlen_q;
    row = r >= 0 && r < seqlen_q ? int(r) : seqlen_q;
    batch = e.batch;
    q_start = e.q_start;
    lse_at = p.seqs.lse_offset(e, head, p.heads_q, p.seqlen_q);
    keys = e.keys(keys);
  }
  const int64_t at_row = int64_t(q_start) + row;  // on the tensors' row axis
  float sum = 0.f;
  if (live && has_columns_v && row < seqlen_q) {
    auto o = static_cast<const Element*>(p.o) + batch * p.o_batch_stride +
             head * p.o_head_stride + at_row * p.o_row_stride + chunk * 8;
    auto dout = static_cast<const Element*>(p.dout) + batch * p.do_batch_stride +
                head * p.do_head_stride + at_row * p.do_row_stride + chunk * 8;
    cutlass::Array<Element, 8> a = *reinterpret_cast<const cutlass::Array<Element, 8>*>(o);
    cutlass::Array<Element, 8> b = *reinterpret_cast<const cutlass::Array<Element, 8>*>(dout);
#pragma unroll
    for (int i = 0; i < 8; ++i) sum += float(a[i]) * float(b[i]);
  }
#pragma unroll
  for (int off = kThreadsPerRow / 2; off > 0; off /= 2)
    sum += __shfl_xor_sync(0xffffffff, sum, off);
  if (!live) return;
  for (int s = 0; s < p.dq_slices && has_columns; ++s) {
    float4* dq = reinterpret_cast<float4*>(p.dq_accum + s * p.dq_slice_stride +
                                           row_id * kHeadDim + chunk * 8);
    dq[0] = make_float4(0.f, 0.f, 0.f, 0.f);
    dq[1] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  if (p.dq != nullptr && has_columns && row < seqlen_q && keys.lo(row) >= keys.hi(row)) {
    auto dq = static_cast<Element*>(p.dq) + batch * p.dq_batch_stride +
              head * p.dq_head_stride + at_row * p.dq_row_stride + chunk * 8;
    *reinterpret_cast<cutlass::Array<Element, 8>*>(dq) = cutlass::Array<Element, 8>{};
  }
  if (p.dq_counters != nullptr && chunk == 0 && row_id % 32 == 0) p.dq_counters[row_id / 32] = 0;
  // One thread per sequence (the rows outnumber the sequences: each has a 128-row pad).
  if (p.offsets_malformed != nullptr && chunk == 0 && row_id < p.batch &&
      bwd_offsets_malformed(p.seqs, p.batch, int(row_id), p.key_block))
    *p.offsets_malformed = 1;
  if (chunk == 0) {
    p.softmax_d[row_id] = sum;
    p.lse_log2[row_id] = row < seqlen_q ? p.lse[lse_at + row] * float(M_LOG2E) : INFINITY;
  }
}

template <class Element, int kHeadDim, int kHeadDimV = kHeadDim>
cudaError_t launch_bwd_preprocess(const BwdRowsParams& p, cudaStream_t stream) {
  constexpr int kRowsPerBlock = 256 / bwd_preprocess_threads_per_row<kHeadDim, kHeadDimV>();
  const int64_t rows = int64_t(p.seqs.packed() ? 1 : p.batch) * p.heads_q * p.dq_rows;
  bwd_preprocess<Element, kHeadDim, kHeadDimV>
      <<<unsigned((rows + kRowsPerBlock - 1) / kRowsPerBlock), 256, 0, stream>>>(p);
  return cudaGetLastError();
}

// The attention sinks' gradient, d_sink = −Σ_i w_i·D*_i over a head's rows i, with w_i =
// exp(sink − LSE_i) the sink's share of row i and D*_i = Σ_j P_ij·dP_ij. D_i = rowsum(dO ∘ O),
// which dS takes, equals D*_i only up to O's rounding to 16 bits, which summed over every row
// would dominate d_sink's error. But as Σ_j P_ij = 1 − w_i and the same D_i is inside every
// dS_ij = P_ij·(dP_ij − D_i), D*_i = Σ_j dS_ij + (1 − w_i)·D_i, in which the rounding cancels:
// so each main-kernel CTA sums Σ_i w_i·Σ_j dS_ij over its keys, warp by warp, into its parts
// (BwdSinkParts), and bwd_sink_grad adds them to Σ_i w_i·(1 − w_i)·D_i. With softcap, whose dS
// holds the cap's derivative, the sm80 kernels sum Σ_j P_ij·(dP_ij − D_i) instead, the same
// value (the sm90 softcap kernels refuse the gradient).

// Where the main kernels leave their parts (BwdWorkspace::sink_parts): for query head h,
// `groups` runs of `run` floats, run g at (g·heads_q + h)·run, each a CTA's kSinkWarps warp sums
// after the other. Zeroed before the main kernel: CTAs with no rows leave theirs.
struct BwdSinkParts {
  float* parts = nullptr;  // null: the call asks for no gradient
  int groups = 0;
  int64_t run = 0;
};

// The call's parts, zeroed on `stream`: per query head `groups` runs of `blocks` key blocks of
// kSinkWarps floats; null where the call asks for no gradient. A layout that would pass the
// workspace's region is refused.
inline cudaError_t zeroed_sink_parts(const flashattn_params_t& p, const BwdWorkspace& ws,
                                     char* base, int groups, int64_t blocks, cudaStream_t stream,
                                     BwdSinkParts& parts) {
  parts = BwdSinkParts{};
  if (p.dsinks == nullptr) return cudaSuccess;
  const int64_t floats = int64_t(groups) * p.heads_q * blocks * kSinkWarps;
  if (floats > bwd_sink_parts(p)) return cudaErrorInvalidValue;
  parts = {reinterpret_cast<float*>(base + ws.sink_parts), groups, blocks * kSinkWarps};
  return cudaMemsetAsync(parts.parts, 0, floats * sizeof(float), stream);
}

// A warp's sum of its lanes' `part` into slot `warp` of its CTA's run of parts (a fixed shuffle
// order: the same bits every call).
__device__ inline void store_sink_part(float* cta_parts, int warp, float part) {
#pragma unroll
  for (int lane_mask = 16; lane_mask > 0; lane_mask /= 2)
    part += __shfl_xor_sync(0xffffffffu, part, lane_mask);
  if (threadIdx.x % 32 == 0) cta_parts[warp] = part;
}

// One CTA per head: its threads stride the rows and the parts in f64, then a tree in shared
// memory, so that the sum runs in the same order every call (bit-identical run to run, in either
// mode). Padding rows have LSE +inf and D 0, and add nothing.
// A template: both families' units include this header, and a plain kernel defined here would be
// defined twice at link time.
template <int kThreads>
__global__ void __launch_bounds__(kThreads)
    bwd_sink_grad(const float* lse_log2, const float* softmax_d, const float* sinks,
                  BwdSinkParts parts, float* dsinks, int entries, int heads_q, int dq_rows) {
  const int head = blockIdx.x;
  const float sink_log2 = sinks[head] * float(M_LOG2E);
  double sum = 0.0;
  for (int b = 0; b < entries; ++b) {
    const int64_t base = (int64_t(b) * heads_q + head) * dq_rows;
    for (int r = threadIdx.x; r < dq_rows; r += kThreads) {
      const double w = exp2f(sink_log2 - lse_log2[base + r]);
      sum += w * (1.0 - w) * double(softmax_d[base + r]);
    }
  }
  for (int g = 0; g < parts.groups; ++g) {
    const float* run = parts.parts + (int64_t(g) * heads_q + head) * parts.run;
    for (int64_t i = threadIdx.x; i < parts.run; i += kThreads) sum += double(run[i]);
  }
  __shared__ double part[kThreads];
  part[threadIdx.x] = sum;
  __syncthreads();
#pragma unroll
  for (int s = kThreads / 2; s > 0; s /= 2) {
    if (threadIdx.x < s) part[threadIdx.x] += part[threadIdx.x + s];
    __syncthreads();
  }
  if (threadIdx.x == 0) dsinks[head] = float(-part[0]);
}

// d_sink into `dsinks` where the call asks for it (null: nothing to do), after the main kernel.
inline cudaError_t launch_bwd_sink_grad(const BwdRowsParams& p, const float* sinks,
                                        const BwdSinkParts& parts, float* dsinks,
                                        cudaStream_t stream) {
  if (dsinks == nullptr) return cudaSuccess;
  constexpr int kThreads = 256;
  bwd_sink_grad<kThreads><<<unsigned(p.heads_q), kThreads, 0, stream>>>(
      p.lse_log2, p.softmax_d, sinks, parts, dsinks, p.seqs.packed() ? 1 : p.batch, p.heads_q,
      p.dq_rows);
  return cudaGetLastError();
}

// A blocked f32 dQ accumulator (the sm90 backward's): per block of kRows query rows, kParts slabs
// of kRows × (kHeadDim / kParts) floats, slab p holding columns [p·w, (p+1)·w). Each consumer
// warpgroup owns one slab, so its bulk add is one contiguous run. Within a slab row the 8-float
// chunks are permuted by the row (chunk c at c ^ row % chunks, at most 8; where the chunks are no
// power of two, at (c + row / 2) % chunks, which stays within the row), so that the 8 rows one
// accumulator store touches (a 32-byte chunk each) fall on the four 32-byte bank groups twice
// each: rows of 6 chunks (48 columns) start two groups apart, and with the chunk advanced by
// every row, 8 rows met one group 3 times. Offset of (row, col) from the head's first row; rows
// of a head start on a multiple of kRows.
template <int kHeadDim, int kRows, int kParts>
struct DqSlabs {
  static constexpr int kSlabRows = kRows;
  static constexpr int kCols = kHeadDim / kParts;
  static constexpr int kChunks = kCols / 8;
  static_assert(kCols % 8 == 0 && kRows % 8 == 0);
  __host__ __device__ static constexpr int chunk_at(int row, int chunk) {
    if constexpr ((kChunks & (kChunks - 1)) == 0)
      return chunk ^ (row % (kChunks < 8 ? kChunks : 8));
    else
      return (chunk + row / 2) % kChunks;
  }
  __host__ __device__ static constexpr int in_slab(int row, int col) {  // row < kRows, col < kCols
    return row * kCols + chunk_at(row, col / 8) * 8 + col % 8;
  }
  __host__ __device__ static constexpr int64_t offset(int64_t row, int col) {
    return ((row / kRows) * kParts + col / kCols) * (kRows * kCols) +
           in_slab(int(row % kRows), col % kCols);
  }
};

// Plain row-major (row, col) of an f32 accumulator with rows of kHeadDim.
template <int kHeadDim>
struct DqRowMajor {
  __host__ __device__ static constexpr int64_t offset(int64_t row, int col) {
    return row * kHeadDim + col;
  }
};

// The `group` consecutive heads of f32 sums from `src` (head g's (row, 0) at
// src + g · head_floats + Layout::offset(row, 0)), summed in order, times `scale`, to 8 elements
// of the element type at `dst`: columns [8c, 8c + 8).
template <class Element, int kHeadDim, class Layout>
__device__ void convert_chunk(const float* src, int64_t head_floats, int group, int64_t row,
                              int c, Element* dst, float scale) {
  float sum[8] = {};
  for (int g = 0; g < group; ++g) {
    const float* s = src + g * head_floats + Layout::offset(row, c * 8);
#pragma unroll
    for (int i = 0; i < 8; ++i) sum[i] += s[i];
  }
  cutlass::Array<Element, 8> out;
#pragma unroll
  for (int i = 0; i < 8; ++i) out[i] = Element(sum[i] * scale);
  *reinterpret_cast<cutlass::Array<Element, 8>*>(dst) = out;
}

// f32 sums to the element type, times `scale`: packed (batch, heads·group, src_rows, kHeadDim) in
// the layout `Layout` gives (8 columns from a multiple of 8 are contiguous), the `group`
// consecutive heads of each output head summed in order -> the first `seqlen` rows of each head,
// strided (batch, seqlen, heads). One thread per 8 elements.
template <class Element, int kHeadDim, class Layout = DqRowMajor<kHeadDim>>
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
  const int64_t head_floats = int64_t(src_rows) * kHeadDim;
  convert_chunk<Element, kHeadDim, Layout>(
      src + (int64_t(b) * heads + head) * group * head_floats, head_floats, group, row, c,
      static_cast<Element*>(dst) + b * b_stride + head * h_stride + row * row_stride + c * 8,
      scale);
}

// bwd_convert for packed calls: from the f32 sums (`src_rows` rows per head, in `Layout`, the
// `group` consecutive heads of each output head summed in order) to `dst` (heads, strided; the
// batch stride is ignored), every row that a sequence of `batch` owns. Query rows (kQueryRows,
// dQ): the threads walk the sums' rows, the query workspace rows, whose sequence row_entries
// names per kDqRowAlign rows: row r of sequence b's run goes to row q_start + r, if r <
// seqlen_q. Key rows (GQA dK, dV): the threads walk the tensors' `src_rows` key rows, and each
// of sequence b's keys_owned rows from k_start goes out as the same row (past its used keys
// they hold the zeros nothing added to). Rows that no sequence owns are not written. One
// thread per 8 elements.
template <class Element, int kHeadDim, class Layout, bool kQueryRows>
__global__ void __launch_bounds__(256)
    bwd_convert_packed(const float* src, int src_rows, int group, void* dst, int64_t row_stride,
                       int64_t h_stride, int heads, Sequences seqs, int batch,
                       const int* row_entries, float scale) {
  const int64_t chunk = int64_t(blockIdx.x) * 256 + threadIdx.x;
  constexpr int kChunks = kHeadDim / 8;
  if (chunk >= int64_t(heads) * src_rows * kChunks) return;
  const int64_t row_id = chunk / kChunks;  // (head, row of the sums) packed
  const int c = int(chunk % kChunks);
  const int row = int(row_id % src_rows);
  const int head = int(row_id / src_rows);
  int64_t out_row = row;
  if constexpr (kQueryRows) {
    const int b = row_entries[row / kDqRowAlign];
    if (b < 0) return;
    const Sequences::Entry e = seqs.at(b);
    const int64_t r = row - bwd_packed_run(e.q_start, b);
    if (r < 0 || r >= e.seqlen_q) return;
    out_row = e.q_start + r;
  } else {
    const int b = last_start_at_most(batch, row, [&](int i) { return seqs.k_start(i); });
    const Sequences::Entry e = seqs.at(b);
    if (row < e.k_start || row - e.k_start >= e.keys_owned) return;
  }
  const int64_t head_floats = int64_t(src_rows) * kHeadDim;
  convert_chunk<Element, kHeadDim, Layout>(
      src + int64_t(head) * group * head_floats, head_floats, group, row, c,
      static_cast<Element*>(dst) + head * h_stride + out_row * row_stride + c * 8, scale);
}

template <class Element, int kHeadDim, class Layout, bool kQueryRows>
cudaError_t launch_bwd_convert_packed(const float* src, int src_rows, int group,
                                      const flashattn_tensor_t& dst, int heads,
                                      const Sequences& seqs, int batch, const int* row_entries,
                                      float scale, cudaStream_t stream) {
  const int64_t chunks = int64_t(heads) * src_rows * (kHeadDim / 8);
  bwd_convert_packed<Element, kHeadDim, Layout, kQueryRows>
      <<<unsigned((chunks + 255) / 256), 256, 0, stream>>>(src, src_rows, group, dst.ptr,
                                                           dst.row_stride, dst.head_stride,
                                                           heads, seqs, batch, row_entries,
                                                           scale);
  return cudaGetLastError();
}

}  // namespace flashattn
