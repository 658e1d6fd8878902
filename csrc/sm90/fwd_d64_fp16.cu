// sm90 forward, head dim 64, fp16.
#include <cutlass/half.h>

#include "fwd_launch.h"

namespace flashattn::sm90 {

flashattn_result_t run_fwd_d64_fp16(const flashattn_params_t& p, FwdOptions o,
                                  cudaStream_t stream) {
  return run_fwd_tiled<cutlass::half_t, 64>(p, o, stream);
}

}  // namespace flashattn::sm90
