// The sm90 backward instantiations, one translation unit each (bwd_d{64,128,256}_{bf16,fp16}.cu).
// Softcap is not built for sm90: the dispatcher sends those calls to the sm80 backward.
#pragma once

#include <cuda_runtime.h>

#include "../flash_api.h"

namespace flashattn::sm90 {

#define FLASHATTN_SM90_BWD(D, DTYPE) \
  flashattn_result_t run_bwd_d##D##_##DTYPE(const flashattn_params_t& p, cudaStream_t stream);
FLASHATTN_SM90_BWD(64, bf16)
FLASHATTN_SM90_BWD(128, bf16)
FLASHATTN_SM90_BWD(256, bf16)
FLASHATTN_SM90_BWD(64, fp16)
FLASHATTN_SM90_BWD(128, fp16)
FLASHATTN_SM90_BWD(256, fp16)
#undef FLASHATTN_SM90_BWD

}  // namespace flashattn::sm90
