// sm90 backward, head dim 64, bf16.
#include <cutlass/bfloat16.h>

#include "bwd_launch.h"

namespace flashattn::sm90 {

flashattn_result_t run_bwd_d64_bf16(const flashattn_params_t& p, cudaStream_t stream) {
  return run_bwd<cutlass::bfloat16_t, 64>(p, stream);
}

}  // namespace flashattn::sm90
