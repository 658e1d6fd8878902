// The sm90 forward's tile structs and options. The units build.rs generates define each head
// dim's tiles from the tile table in src/registry.rs; FwdTraits reads them.
#pragma once

#include <cuda_runtime.h>

#include "../flash_api.h"

namespace flashattn::sm90 {

// kBlockN (keys per block), kStages (K/V pipeline depth), kQStages (Q buffers), kUnmaskedLoop,
// kTailSplit, kIntraWGOverlap (off: fwd_serial.h's loop) and, read by the FP8 kernels
// alone, kIeeeDescaleRatio; per head dim of Q and K, and of V and O where it differs.
template <int kHeadDim, int kHeadDimV = kHeadDim> struct FwdTile;
// Causal and windowed calls (and calls asking for narrow key blocks): narrower key blocks waste
// less work on the masked diagonal blocks.
template <int kHeadDim, int kHeadDimV = kHeadDim> struct FwdTileMasked;
// The FP8 forward's tile (the same members).
template <int kHeadDim> struct Fp8FwdTile;

struct FwdOptions {
  bool pingpong = true;
  bool intra_wg_overlap = true;
};

}  // namespace flashattn::sm90
