// sm90 backward, head dim 256, bf16.
#include <cutlass/bfloat16.h>

#include "bwd_launch.h"

namespace flashattn::sm90 {

flashattn_result_t run_bwd_d256_bf16(const flashattn_params_t& p, cudaStream_t stream) {
  return run_bwd<cutlass::bfloat16_t, 256>(p, stream);
}

}  // namespace flashattn::sm90
