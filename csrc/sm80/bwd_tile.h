// The sm80 backward's tile struct. The units build.rs generates define each head dim's tile from
// the tile table in src/registry.rs.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../common/bwd_workspace.h"
#include "../flash_api.h"

namespace flashattn::sm80 {

// Per head dim of Q and K (and of V where it differs): query rows and keys per block, 8 warps
// laid out per GEMM: S/dP kAtomMSdP warps down M, dK/dV kAtomNdKV down N, dQ kAtomMdQ down M
// (FlashAttention-2's choices for GPUs with 144 KiB of shared memory or more). Registers: dK and
// dV accumulators kBlockN·d·2 over 256 threads plus S and dP kBlockM·kBlockN·2; ptxas spills at
// d64, a little at d128, none at d256 (d64 128×128 still measured faster than 64×128, which
// spills nothing: benchmarks/README.md). Shared memory: K, V (kBlockN·d each), P, dS
// (kBlockM·kBlockN each), then per Q/dO buffer kBlockM·d·2 (+ LSE, D): with two buffers d64
// 162 KiB, d128 159 KiB, d256 209 KiB; d256 takes one buffer (145 KiB) where the device offers
// less (A100: 163 KiB). V's head dim, where it differs, sizes V and dO instead of d.
template <int kHeadDim, int kHeadDimV = kHeadDim> struct BwdTile;

}  // namespace flashattn::sm80
