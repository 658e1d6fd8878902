// The FP8 forward's quantize step: bf16/fp16 Q, K or V to e4m3 with one scale per block of rows
// of one head, optionally after the random-sign Hadamard transform along head_dim (incoherent
// processing). V is written key-major for the FP8 P·V GEMM (both WGMMA operands K-major), with
// the keys of every 32-key group permuted to match the register order of P and its rows (head
// dims) in the order that lets O leave by 16-byte stores (fp8_layout.h, fp8_v_rows.h).
// The host definition it must agree with, bit for bit: src/fp8.rs.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cfloat>

#include <cstdint>

#include "../common/e4m3_convert.h"
#include "../common/half_convert.h"
#include "../common/sequences.h"
#include "../common/status.h"
#include "../flash_api.h"
#include "fp8_layout.h"
#include "fp8_quantize.h"

namespace flashattn::sm90 {

namespace {

constexpr int kWarps = 8;
constexpr float kE4M3Max = 448.f;

using flashattn::to_float;
__device__ __forceinline__ float to_float(__nv_fp8_e4m3 x) { return float(x); }

template <int kBytes> struct Word;
template <> struct Word<1> { using type = uint8_t; };
template <> struct Word<2> { using type = uint16_t; };
template <> struct Word<4> { using type = uint32_t; };
template <> struct Word<8> { using type = uint2; };
template <> struct Word<16> { using type = uint4; };

// A lane's kBytes contiguous bytes at a multiple of kBytes (lane·kBytes from an aligned row),
// moved as the widest word that divides kBytes, once or (3 or 6 elements a lane, at d96 and
// d192) in pieces: the widest such word is the alignment the offset guarantees.
template <int kBytes>
struct LaneBytes {
  static constexpr int kWord = kBytes % 16 == 0  ? 16
                               : kBytes % 8 == 0 ? 8
                               : kBytes % 4 == 0 ? 4
                               : kBytes % 2 == 0 ? 2
                                                 : 1;
  using W = typename Word<kWord>::type;
  W words[kBytes / kWord];

  __device__ __forceinline__ void load(const void* src) {
#pragma unroll
    for (int i = 0; i < kBytes / kWord; ++i) words[i] = static_cast<const W*>(src)[i];
  }
  __device__ __forceinline__ void store(void* dst) const {
#pragma unroll
    for (int i = 0; i < kBytes / kWord; ++i) static_cast<W*>(dst)[i] = words[i];
  }
};

// One row of head_dim values as a warp holds it: lane l has the kPerLane contiguous elements
// from l·kPerLane.
template <class In, int kPerLane>
__device__ __forceinline__ void load_row(const In* row, int lane, float (&x)[kPerLane]) {
  union {
    LaneBytes<kPerLane * sizeof(In)> bytes;
    In elem[kPerLane];
  } u;
  u.bytes.load(row + lane * kPerLane);
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) x[i] = to_float(u.elem[i]);
}

// x ← H·D·x / √d along the row, the same operations in the same order as the host's fwht (the
// low index bits first: inside a lane, then across lanes), so that the results are identical.
template <int kPerLane>
__device__ __forceinline__ void hadamard_row(float (&x)[kPerLane], uint32_t lane_signs, int lane,
                                             float norm) {
#pragma unroll
  for (int i = 0; i < kPerLane; ++i)
    if ((lane_signs >> i) & 1) x[i] = -x[i];
#pragma unroll
  for (int h = 1; h < kPerLane; h *= 2)
#pragma unroll
    for (int i = 0; i < kPerLane; ++i)
      if ((i & h) == 0) {
        const float a = x[i], b = x[i + h];
        x[i] = __fadd_rn(a, b);
        x[i + h] = __fsub_rn(a, b);
      }
#pragma unroll
  for (int m = 1; m < 32; m *= 2)
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const float other = __shfl_xor_sync(0xffffffff, x[i], m);
      x[i] = (lane & m) ? __fsub_rn(other, x[i]) : __fadd_rn(x[i], other);
    }
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) x[i] = __fmul_rn(x[i], norm);
}

// amax ↦ 448, as src/fp8.rs scale_for: 1 for a block with no positive normal amax.
__device__ __forceinline__ float scale_for(float amax) {
  const float s = __fdiv_rn(amax, kE4M3Max);
  return s >= 1.17549435e-38f && s <= 3.40282347e38f ? s : 1.f;
}

// Where one CTA's block lies: its first row in the source (and rows-layout output), its rows, the
// index of its descale and the first column of its key-major output.
struct QuantizeBlock {
  int64_t batch;  // on the tensors' batch axis (0 when packed)
  int row_begin, rows;
  int64_t descale_index, column;
};

// Dense: block x of batch entry z. Packed: block x of sequence z, clamped into the rows by the
// forward's own Sequences::at, numbered from its packed_block (common/sequences.h); rows 0 when
// the sequence ends before it.
__device__ QuantizeBlock quantize_block(const flashattn_fp8_quantize_t& p, int head) {
  const int block = blockIdx.x, z = blockIdx.z;
  if (p.cu_seqlens == nullptr) {
    const int row_begin = block * p.block_rows;
    return {z, row_begin, min(p.block_rows, p.seqlen - row_begin),
            (int64_t(z) * p.heads + head) * gridDim.x + block, row_begin};
  }
  // The one axis's offsets as both of a Sequences' (its query side is read).
  Sequences seqs;
  seqs.cu_q = seqs.cu_k = p.cu_seqlens;
  seqs.rows_q = seqs.rows_k = p.seqlen;
  seqs.max_q = seqs.max_k = p.max_seqlen;
  const Sequences::Entry e = seqs.at(z);
  const int start = e.q_start, len = e.seqlen_q;
  const int64_t index = packed_block(start, z, p.block_rows) + block;
  const int in_block = block * p.block_rows;
  return {0, start + in_block, max(0, min(p.block_rows, len - in_block)),
          int64_t(head) * packed_blocks(p.seqlen, p.batch, p.block_rows) + index,
          index * p.block_rows};
}

// One CTA per (row block, head, batch entry or sequence). Pass 1 finds the block's largest
// finite magnitude (when a descale is to be written); pass 2 reads the rows again (from L2),
// transforms and quantizes.
template <class In, int kHeadDim>
__global__ void __launch_bounds__(kWarps * 32)
    quantize_kernel(const flashattn_fp8_quantize_t p) {
  constexpr int kPerLane = kHeadDim / 32;
  // The transform needs a power-of-two head dim; the host refuses it at the others.
  constexpr bool kHadamard = (kHeadDim & (kHeadDim - 1)) == 0;
  extern __shared__ uint8_t tile[];  // key-major output: the block's rows, quantized
  __shared__ float warp_amax[kWarps];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int head = blockIdx.y;
  const QuantizeBlock at = quantize_block(p, head);
  if (at.rows == 0) return;  // a packed sequence's blocks past its end
  const int row_begin = at.row_begin, rows = at.rows;
  const In* src = static_cast<const In*>(p.src.ptr) + at.batch * p.src.batch_stride +
                  head * p.src.head_stride;
  uint32_t lane_signs = 0;
  if (kHadamard && p.hadamard) {
    const int first = lane * kPerLane;
    lane_signs = uint32_t(p.hadamard_signs[first / 64] >> (first % 64)) & ((1u << kPerLane) - 1);
  }
  // 1/√d as the host computes it (a rounded square root, then a rounded division).
  const float norm = __fdiv_rn(1.f, __fsqrt_rn(float(kHeadDim)));
  auto transformed = [&](int r, float(&x)[kPerLane]) {
    load_row<In, kPerLane>(src + int64_t(row_begin + r) * p.src.row_stride, lane, x);
    if constexpr (kHadamard) {
      if (p.hadamard) hadamard_row(x, lane_signs, lane, norm);
    }
  };

  float scale = 1.f;
  if (p.descale != nullptr) {
    float amax = 0.f;
    for (int r = warp; r < rows; r += kWarps) {
      float x[kPerLane];
      transformed(r, x);
#pragma unroll
      for (int i = 0; i < kPerLane; ++i)
        if (isfinite(x[i])) amax = fmaxf(amax, fabsf(x[i]));
    }
#pragma unroll
    for (int m = 16; m > 0; m /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffff, amax, m));
    if (lane == 0) warp_amax[warp] = amax;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < kWarps; ++w) amax = fmaxf(amax, warp_amax[w]);
    scale = scale_for(amax);
    if (threadIdx.x == 0) p.descale[at.descale_index] = scale;
  }

  const float inv_scale = __fdiv_rn(1.f, scale);
  // Row r of the block quantized, this lane's kPerLane bytes; rows past the sequence are zeros.
  using RowBytes = LaneBytes<kPerLane>;
  auto quantized = [&](int r) {
    float x[kPerLane] = {};
    if (r < rows) transformed(r, x);
    union {
      RowBytes bytes;
      uint8_t byte[kPerLane];
    } u;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) u.byte[i] = to_e4m3(x[i], inv_scale);
    return u.bytes;
  };
  uint8_t* dst = static_cast<uint8_t*>(p.dst) + at.batch * p.dst_batch_stride +
                 head * p.dst_head_stride;
  if (p.layout == FLASHATTN_FP8_ROWS) {
    for (int r = warp; r < rows; r += kWarps)
      quantized(r).store(dst + int64_t(row_begin + r) * p.dst_row_stride + lane * kPerLane);
    return;
  }
  // Key-major: the block's rows quantized into shared memory as they are (each lane's bytes
  // contiguous, no bank conflicts), then gathered column by column: lane d of a warp takes the
  // bytes of head-dim index fp8_v_row_head_dim(d) (the order in which O leaves the kernel) for 32
  // consecutive key positions (fp8_key_at: the keys of a 32-key group in P's register order) and
  // writes them to output row d as two 16-byte stores. Keys past seqlen are zeros (P is 0 there,
  // and 0·NaN would not be).
  for (int r = warp; r < p.block_rows; r += kWarps)
    quantized(r).store(tile + r * kHeadDim + lane * kPerLane);
  __syncthreads();
  const int groups = p.block_rows / 32;  // 32-key groups (a key block is a multiple of 32)
  for (int w = threadIdx.x; w < kHeadDim * groups; w += kWarps * 32) {
    const int d = w % kHeadDim, g = w / kHeadDim, column = fp8_v_row_head_dim(d);
    uint32_t packed[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      uint32_t word = 0;
#pragma unroll
      for (int b = 0; b < 4; ++b)  // the permutation stays within the group: constant offsets
        word |= uint32_t(tile[(32 * g + fp8_key_at(4 * k + b)) * kHeadDim + column]) << (8 * b);
      packed[k] = word;
    }
    uint4* out = reinterpret_cast<uint4*>(dst + int64_t(d) * p.dst_row_stride + at.column + 32 * g);
    out[0] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
    out[1] = make_uint4(packed[4], packed[5], packed[6], packed[7]);
  }
}

template <class In, int kHeadDim>
flashattn_result_t launch(const flashattn_fp8_quantize_t& p, cudaStream_t stream) {
  const int rows = p.cu_seqlens != nullptr ? p.max_seqlen : p.seqlen;
  const dim3 grid((rows + p.block_rows - 1) / p.block_rows, p.heads, p.batch);
  const int smem = p.layout == FLASHATTN_FP8_KEY_MAJOR ? kHeadDim * p.block_rows : 0;
  quantize_kernel<In, kHeadDim><<<grid, kWarps * 32, smem, stream>>>(p);
  return check_launch();
}

template <class In>
flashattn_result_t launch_dim(const flashattn_fp8_quantize_t& p, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64: return launch<In, 64>(p, stream);
    case 96: return launch<In, 96>(p, stream);
    case 128: return launch<In, 128>(p, stream);
    case 192: return launch<In, 192>(p, stream);
    case 256: return launch<In, 256>(p, stream);
    default: return status(FLASHATTN_UNSUPPORTED);
  }
}

// Descales the FP8 forward can use are normal numbers from 2^-126 to 2^126 (its row maxima
// assume a positive score scale; V's enters as a divisor, whose fast form returns 0 for one past
// 2^126, and a subnormal one makes the ratio of two blocks' infinite); any other becomes NaN, so
// that the rows it touches are NaN rather than silently wrong. The quantize step's are within.
__global__ void sanitize_descales_kernel(const float* src, float* dst, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float x = src[i];
    dst[i] = x >= FLT_MIN && x <= 0x1p126f ? x : __int_as_float(0x7fffffff);
  }
}

}  // namespace

flashattn_result_t run_fp8_sanitize_descales(const float* src, float* dst, int64_t n,
                                             cudaStream_t stream) {
  const int64_t blocks = (n + 255) / 256;
  sanitize_descales_kernel<<<int(blocks < 1024 ? blocks : 1024), 256, 0, stream>>>(src, dst, n);
  return check_launch();
}

flashattn_result_t run_fp8_quantize(const flashattn_fp8_quantize_t& p, cudaStream_t stream) {
  switch (p.src_dtype) {
    case FLASHATTN_BF16: return launch_dim<__nv_bfloat16>(p, stream);
    case FLASHATTN_F16: return launch_dim<__half>(p, stream);
    case FLASHATTN_E4M3: return launch_dim<__nv_fp8_e4m3>(p, stream);
    default: return status(FLASHATTN_UNSUPPORTED);
  }
}

}  // namespace flashattn::sm90
