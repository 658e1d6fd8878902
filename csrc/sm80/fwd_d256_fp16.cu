// sm80 forward, head dim 256, fp16.
#include <cutlass/half.h>

#include "fwd_launch.h"

namespace flashattn::sm80 {

flashattn_result_t run_fwd_d256_fp16(const flashattn_params_t& p, cudaStream_t stream) {
  return run_fwd<cutlass::half_t, 256>(p, stream);
}

}  // namespace flashattn::sm80
