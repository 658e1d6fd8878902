// The KV cache's append step (kvcache_append.cu), for the C entry point.
#pragma once

#include <cuda_runtime.h>

#include "flash_api.h"

namespace flashattn {

flashattn_result_t run_kvcache_append(const flashattn_kvcache_append_t& p, cudaStream_t stream);

}  // namespace flashattn
