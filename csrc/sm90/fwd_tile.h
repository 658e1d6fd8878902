// The sm90 forward's tile table and options, shared by the kernel units that build.rs generates
// from src/registry.rs.
#pragma once

#include <cuda_runtime.h>

#include "../flash_api.h"

namespace flashattn::sm90 {

// Per head dim: key block size, K/V pipeline depth and Q buffers (query tile: 128 rows, two
// warpgroups). Two Q buffers let the next tile's Q land while the current tile runs, so that its
// first Q·Kᵀ can be issued beside the current tile's last P·V (cross-tile overlap).
// Shared memory, ≤ 227 KiB: Q kQStages·128·d + (K + V) 2·kStages·kBlockN·d elements:
// d64 2·16 + 2·2·24 = 128 KiB; d128 2·32 + 2·2·40 = 224 KiB; d256 64 + 2·2·40 = 224 KiB (one Q
// buffer: two would leave no room for K/V blocks worth the name).
// Registers per consumer thread: O d/2, S kBlockN/2, P kBlockN/4; d128 with 160 keys fits the
// 240 of setmaxnreg with no local memory (ptxas report).
// Code shape (FwdTraits): the loop copy for unmasked blocks is measured faster at every head dim
// but for causal d64, which takes the narrow tile without it; O leaves every tile by 16-byte
// stores (fwd_epilogue.h). The measurements are in docs/PERFORMANCE.md.
struct FwdShape16 {
  static constexpr bool kUnmaskedLoop = true, kTailSplit = true;
};
template <int kHeadDim> struct FwdTile;
template <> struct FwdTile<64> : FwdShape16 {
  static constexpr int kBlockN = 192, kStages = 2, kQStages = 2;
};
template <> struct FwdTile<128> : FwdShape16 {
  static constexpr int kBlockN = 160, kStages = 2, kQStages = 2;
};
template <> struct FwdTile<256> : FwdShape16 {
  static constexpr int kBlockN = 80, kStages = 2, kQStages = 1;
};

// Causal and windowed calls: narrower key blocks waste less work on the masked diagonal blocks
// (as FlashAttention-3 at d64/d128). The same block at d256.
template <int kHeadDim> struct FwdTileMasked : FwdTile<kHeadDim> {};
template <> struct FwdTileMasked<64> : FwdShape16 {
  static constexpr int kBlockN = 128, kStages = 2, kQStages = 2;
  static constexpr bool kUnmaskedLoop = false;
};
template <> struct FwdTileMasked<128> : FwdShape16 {
  static constexpr int kBlockN = 128, kStages = 2, kQStages = 2;
};

struct FwdOptions {
  bool pingpong = true;
  bool intra_wg_overlap = true;
};

}  // namespace flashattn::sm90
