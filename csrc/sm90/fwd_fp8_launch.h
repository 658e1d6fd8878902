// Host side of the sm90 FP8 forward: its launch, included by the units holding FP8 kernels. Its
// tile (Fp8FwdTile, fwd_tile.h) comes from the tile table; the key block is also the block of K
// and V rows one descale covers, which the quantize step reads from fp8_layout.h.
#pragma once

#include <cutlass/float8.h>

#include "fp8_layout.h"
#include "fwd_launch.h"

namespace flashattn::sm90 {

template <int kHeadDim>
flashattn_result_t run_fwd_fp8(const flashattn_params_t& p, FwdOptions o, cudaStream_t stream) {
  using Tile = Fp8FwdTile<kHeadDim>;
  using Traits = FwdTraits<cutlass::float_e4m3_t, kHeadDim, Tile, Tile::kIntraWGOverlap>;
  static_assert(Traits::kBlockM == kFp8QueryBlock,
                "the query tile is the block of rows one Q descale covers");
  return run_fwd<Traits>(p, o.pingpong, stream);
}

}  // namespace flashattn::sm90
