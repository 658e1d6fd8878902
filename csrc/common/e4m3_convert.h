// e4m3 to and from the wider types, as src/fp8.rs computes them, for the kernels that store or
// widen e4m3.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cutlass/half.h>

#include <cstdint>
#include <type_traits>

namespace flashattn {

// The CUDA type the widening conversions below produce for a 16-bit element type, CUDA's or
// CUTLASS's.
template <class T>
using CudaHalfOf =
    std::conditional_t<std::is_same_v<T, cutlass::half_t> || std::is_same_v<T, __half>, __half,
                       __nv_bfloat16>;

// x · inv_scale (the scale's reciprocal, rounded once) to the nearest e4m3: ±448 past the
// largest finite value, NaN kept.
__device__ __forceinline__ uint8_t to_e4m3(float x, float inv_scale) {
  return __nv_cvt_float_to_fp8(__fmul_rn(x, inv_scale), __NV_SATFINITE, __NV_E4M3);
}

// The four e4m3 values of `w` (lowest byte first) as T (__half or __nv_bfloat16), exactly, two
// in each word: each byte's magnitude bits shifted into T's exponent and mantissa fields, one
// packed multiply by the difference of the exponent biases (2^8 for half, 2^120 for bf16; exact,
// subnormals included), and NaN (magnitude 0x7F, which the shift makes a finite 480) set apart.
// Integer operations and one multiply: no conversion instruction, of which sm_80 has none for
// e4m3.
template <class T>
__device__ __forceinline__ uint2 widen_e4m3x4(uint32_t w) {
  constexpr bool kHalf = std::is_same_v<T, __half>;
  static_assert(kHalf || std::is_same_v<T, __nv_bfloat16>);
  constexpr int kShift = kHalf ? 1 : 4;  // e4m3's exponent field onto T's low exponent bits
  constexpr uint32_t kMagnitude = 0x7F007F00u >> kShift;
  constexpr uint32_t kNan = kHalf ? 0x7E00u : 0x7FC0u;
  // Bytes 0 and 1 (2 and 3) as the high bytes of a word's two halves.
  const uint32_t pairs[2] = {__byte_perm(w, 0, 0x1404), __byte_perm(w, 0, 0x3424)};
  uint32_t out[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const uint32_t t = pairs[i];
    const uint32_t bits = (t & 0x80008000u) | ((t >> kShift) & kMagnitude);
    // 0x8000 in each half whose magnitude is 0x7F.
    const uint32_t nan = (((t & 0x7F007F00u) + 0x01000100u) & 0x80008000u) >> 15;
    uint32_t scaled;
    if constexpr (kHalf) {
      const __half2 x = __hmul2(reinterpret_cast<const __half2&>(bits),
                                __half2half2(__ushort_as_half(0x5C00)));
      scaled = reinterpret_cast<const uint32_t&>(x);
    } else {
      const __nv_bfloat162 x = __hmul2(reinterpret_cast<const __nv_bfloat162&>(bits),
                                       __bfloat162bfloat162(__ushort_as_bfloat16(0x7B80)));
      scaled = reinterpret_cast<const uint32_t&>(x);
    }
    out[i] = scaled | nan * kNan;
  }
  return {out[0], out[1]};
}

// widen_e4m3x4 by the conversion instructions of sm_89 and later: each pair to f16x2 in one,
// and for bf16 through f32 (exact: every e4m3 value is an f16 and a bf16 value). NaN stays NaN.
template <class T>
__device__ __forceinline__ uint2 convert_e4m3x4(uint32_t w) {
  constexpr bool kHalf = std::is_same_v<T, __half>;
  static_assert(kHalf || std::is_same_v<T, __nv_bfloat16>);
  uint32_t out[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const uint16_t pair = uint16_t(w >> (16 * i));
    uint32_t halves;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(halves) : "h"(pair));
    if constexpr (kHalf) {
      out[i] = halves;
    } else {
      float lo, hi;
      asm("cvt.f32.f16 %0, %1;\n" : "=f"(lo) : "h"(uint16_t(halves)));
      asm("cvt.f32.f16 %0, %1;\n" : "=f"(hi) : "h"(uint16_t(halves >> 16)));
      asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(out[i]) : "f"(hi), "f"(lo));
    }
  }
  return {out[0], out[1]};
}

}  // namespace flashattn
