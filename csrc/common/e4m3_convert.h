// f32 to e4m3 as src/fp8.rs quantize computes it, for the kernels that store e4m3.
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

namespace flashattn {

// x · inv_scale (the scale's reciprocal, rounded once) to the nearest e4m3: ±448 past the
// largest finite value, NaN kept.
__device__ __forceinline__ uint8_t to_e4m3(float x, float inv_scale) {
  return __nv_cvt_float_to_fp8(__fmul_rn(x, inv_scale), __NV_SATFINITE, __NV_E4M3);
}

}  // namespace flashattn
