// Partial attention results merged by their log-sum-exp (combine.cu), for the C entry point.
#pragma once

#include <cuda_runtime.h>

#include "flash_api.h"

namespace flashattn {

flashattn_result_t run_combine(const flashattn_combine_t& p, cudaStream_t stream);

}  // namespace flashattn
