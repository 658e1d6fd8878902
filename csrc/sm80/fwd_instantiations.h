// The sm80 forward instantiations, one translation unit each (fwd_d{64,128,256}_{bf16,fp16}.cu),
// and the tile table they share.
#pragma once

#include <cuda_runtime.h>

#include "../flash_api.h"

namespace flashattn::sm80 {

// Per head dim: query rows and keys per block, warps (16 query rows per warp and MMA atom), as
// FlashAttention-2 on A100. Shared memory Q + K + V: d64 16 + 16 + 16 = 48 KiB, d128 32 + 16 + 16
// = 64 KiB, d256 64 + 32 + 32 = 128 KiB. Registers: S (kBlockM·kBlockN) and O (kBlockM·d)
// accumulators over the CTA's threads, ≤ 255 per thread with no local memory (ptxas report).
template <int kHeadDim> struct FwdTile;
template <> struct FwdTile<64> { static constexpr int kBlockM = 128, kBlockN = 128, kWarps = 4; };
template <> struct FwdTile<128> { static constexpr int kBlockM = 128, kBlockN = 64, kWarps = 4; };
template <> struct FwdTile<256> { static constexpr int kBlockM = 128, kBlockN = 64, kWarps = 8; };

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
