// The sm80 forward instantiations, one translation unit each (fwd_d{64,128,256}_{bf16,fp16}.cu),
// and the tile table they share.
#pragma once

#include <cuda_runtime.h>

#include "../flash_api.h"

namespace flashattn::sm80 {

// Per head dim: query rows and keys per block, warps (16 query rows per warp and MMA atom; at
// d64/d128 each warp has two row atoms, so every K/V fragment feeds two MMAs). The S
// (kBlockM·kBlockN) and O (kBlockM·d) accumulators over the CTA's threads plus fragments bound
// the key block at 255 registers per thread. Measured on the H200 since the zero-fill copies
// (runs of c6d7c84..cac6db2): d128 128×32 (no spills) 2–7% faster than 128×64 (228 bytes of
// ptxas spills) and than 128×48 on balance; d64 128×64 (none) beats 128×128 (416 bytes, equal
// at best) and 128×32 (−25%). Shared memory Q + K + V: d64 16 + 8 + 8 = 32 KiB, d128
// 32 + 8 + 8 = 48 KiB, d256 32 + 32 + 32 = 96 KiB, so that two d256 CTAs share an SM with
// 228 KiB (as FlashAttention-2 on H100): one's barriers and loads hide under the other's MMAs.
// kEarlyK: the next K block's load is issued before the softmax (FlashAttention-2's order) rather
// than after it: d256 +3%, d128 128×32 +1–7%; d64 0–3% slower.
template <int kHeadDim> struct FwdTile;
template <> struct FwdTile<64> {
  static constexpr int kBlockM = 128, kBlockN = 64, kWarps = 4;
  static constexpr bool kEarlyK = false;
};
template <> struct FwdTile<128> {
  static constexpr int kBlockM = 128, kBlockN = 32, kWarps = 4;
  static constexpr bool kEarlyK = true;
};
template <> struct FwdTile<256> {
  static constexpr int kBlockM = 64, kBlockN = 64, kWarps = 4;
  static constexpr bool kEarlyK = true;
};

#define FLASHATTN_SM80_FWD(D, DTYPE) \
  flashattn_result_t run_fwd_d##D##_##DTYPE(const flashattn_params_t& p, cudaStream_t stream);
FLASHATTN_SM80_FWD(64, bf16)
FLASHATTN_SM80_FWD(128, bf16)
FLASHATTN_SM80_FWD(256, bf16)
FLASHATTN_SM80_FWD(64, fp16)
FLASHATTN_SM80_FWD(128, fp16)
FLASHATTN_SM80_FWD(256, fp16)
#undef FLASHATTN_SM80_FWD

}  // namespace flashattn::sm80
