// The FP8 forward's quantize step and its descale copy (fp8_quantize.cu), for the C entry
// points.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../flash_api.h"

namespace flashattn::sm90 {

flashattn_result_t run_fp8_quantize(const flashattn_fp8_quantize_t& p, cudaStream_t stream);
flashattn_result_t run_fp8_sanitize_descales(const float* src, float* dst, int64_t n,
                                             cudaStream_t stream);

}  // namespace flashattn::sm90
