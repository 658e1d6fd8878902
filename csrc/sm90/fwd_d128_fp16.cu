// sm90 forward, head dim 128, fp16.
#include <cutlass/half.h>

#include "fwd_instantiations.h"
#include "fwd_launch.h"

namespace flashattn::sm90 {

flashattn_result_t run_fwd_d128_fp16(const flashattn_params_t& p, FwdOptions o,
                                     cudaStream_t stream) {
  using Tile = FwdTile<128>;
  return run_fwd<FwdTraits<cutlass::half_t, 128, Tile::kBlockN, Tile::kStages, true>>(p, o.pingpong,
                                                                            stream);
}

}  // namespace flashattn::sm90
