// Rows of f32 and of a 16-bit type, added and rounded (rows.cu), for the C entry points.
#pragma once

#include <cuda_runtime.h>

#include "flash_api.h"

namespace flashattn {

flashattn_result_t run_rows_add(const flashattn_rows_t& p, cudaStream_t stream);
flashattn_result_t run_rows_round(const flashattn_rows_t& p, cudaStream_t stream);

}  // namespace flashattn
