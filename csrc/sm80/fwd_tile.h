// The sm80 forward's tile struct. The units build.rs generates define each head dim's tile from
// the tile table in src/registry.rs.
#pragma once

#include <cuda_runtime.h>

#include "../flash_api.h"

namespace flashattn::sm80 {

// Per head dim of Q and K (and of V and O where it differs): query rows and keys per block,
// warps (16 query rows per warp and MMA atom; each warp has kBlockM / (16·kWarps) row atoms, so
// every K/V fragment feeds that many MMAs) and K/V stages. Two CTAs share an SM where registers
// allow (255 per thread; shared memory Q + stages·(K + V): d64 16 + 2·16 = 48 KiB, d128
// 32 + 2·32 = 96 KiB, d256 32 + 64 = 96 KiB of the 228), so that one's barriers and loads hide
// under the other's MMAs; d192's eight warps fill an SM's registers alone. With two stages a K/V
// load has a whole block to land and each block costs one barrier (fwd_kernel); d256 has no
// room for a second.
// Measured (bench_table, the same call for every variant; benchmarks/README.md): d128 128×64
// with two stages (some ptxas spills) faster than 128×32 with one stage (no spills) or with
// three stages; d64 128×64 with two stages faster than with one stage and than 128×96 or
// 128×128 with two stages.
// kQInRegs: Q's fragments (32 registers at d64) loaded once instead of per key block, a third of
// the Q·Kᵀ ldmatrix traffic, measured faster at d64 (docs/PERFORMANCE.md); at d128 they would
// take 64 registers beside a kernel that already spills.
template <int kHeadDim, int kHeadDimV = kHeadDim> struct FwdTile;

}  // namespace flashattn::sm80
