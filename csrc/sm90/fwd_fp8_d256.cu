// sm90 FP8 (e4m3) forward, head dim 256.
#include "fwd_fp8_launch.h"

namespace flashattn::sm90 {

flashattn_result_t run_fwd_fp8_d256(const flashattn_params_t& p, FwdOptions o, cudaStream_t stream) {
  return run_fwd_fp8<256>(p, o, stream);
}

}  // namespace flashattn::sm90
