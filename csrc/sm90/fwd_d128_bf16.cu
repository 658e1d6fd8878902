// sm90 forward, head dim 128, bf16. Also holds the variant without intra-warpgroup overlap,
// kept for the ablation benchmark.
#include <cutlass/bfloat16.h>

#include "fwd_launch.h"

namespace flashattn::sm90 {

flashattn_result_t run_fwd_d128_bf16(const flashattn_params_t& p, FwdOptions o,
                                     cudaStream_t stream) {
  if (!o.intra_wg_overlap) {
    return run_fwd<FwdTraits<cutlass::bfloat16_t, 128, FwdTile<128>, false>>(p, o.pingpong,
                                                                           stream);
  }
  return run_fwd_tiled<cutlass::bfloat16_t, 128>(p, o, stream);
}

}  // namespace flashattn::sm90
