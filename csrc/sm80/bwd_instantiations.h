// The sm80 backward instantiations, one translation unit each (bwd_d{64,128,256}_{bf16,fp16}.cu),
// the tile table they share, and the workspace layout.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../flash_api.h"

namespace flashattn::sm80 {

// Per head dim: query rows and keys per block, 8 warps laid out per GEMM (as FlashAttention-2's
// backward on A100): S/dP 2 warps down M, dK/dV 4 down N, dQ 2 down M. Registers: dK and dV
// accumulators kBlockN·d·2 over 256 threads plus S and dP kBlockM·kBlockN·2. Shared memory
// Q, dO (kBlockM·d each, kQStages buffers), K, V (kBlockN·d each), P, dS (kBlockM·kBlockN
// each): d64 96 KiB, d128 160 KiB, d256 144 KiB with one Q/dO buffer (two would pass A100's
// 163 KiB).
template <int kHeadDim> struct BwdTile;
template <> struct BwdTile<64> {
  static constexpr int kBlockM = 64, kBlockN = 128, kWarps = 8, kAtomMSdP = 2, kAtomNdKV = 4,
                       kAtomMdQ = 2, kQStages = 2;
};
template <> struct BwdTile<128> {
  static constexpr int kBlockM = 64, kBlockN = 128, kWarps = 8, kAtomMSdP = 2, kAtomNdKV = 4,
                       kAtomMdQ = 2, kQStages = 2;
};
template <> struct BwdTile<256> {
  static constexpr int kBlockM = 64, kBlockN = 64, kWarps = 8, kAtomMSdP = 2, kAtomNdKV = 4,
                       kAtomMdQ = 2, kQStages = 1;
};

// The caller's workspace (flashattn_params_t::workspace), byte offsets: the f32 dQ accumulator
// (batch, heads_q, seqlen_q, d), rowsum(dO ∘ O) (batch, heads_q, seqlen_q), and with GQA the f32
// dK and dV sums (batch, heads_kv, seqlen_k, d). src/backend/gpu.rs sizes it the same way.
struct BwdWorkspace {
  int64_t dq_accum, softmax_d, dk_accum, dv_accum, bytes;
};
inline BwdWorkspace bwd_workspace(const flashattn_params_t& p) {
  auto align = [](int64_t x) { return (x + 255) / 256 * 256; };
  const int64_t rows_q = int64_t(p.batch) * p.heads_q * p.seqlen_q;
  const int64_t rows_k = int64_t(p.batch) * p.heads_kv * p.seqlen_k;
  BwdWorkspace w;
  w.dq_accum = 0;
  w.softmax_d = align(rows_q * p.head_dim * 4);
  w.dk_accum = w.softmax_d + align(rows_q * 4);
  const bool gqa = p.heads_q != p.heads_kv;
  w.dv_accum = w.dk_accum + (gqa ? align(rows_k * p.head_dim * 4) : 0);
  w.bytes = w.dv_accum + (gqa ? align(rows_k * p.head_dim * 4) : 0);
  return w;
}

#define FLASHATTN_SM80_BWD(D, DTYPE) \
  flashattn_result_t run_bwd_d##D##_##DTYPE(const flashattn_params_t& p, cudaStream_t stream);
FLASHATTN_SM80_BWD(64, bf16)
FLASHATTN_SM80_BWD(128, bf16)
FLASHATTN_SM80_BWD(256, bf16)
FLASHATTN_SM80_BWD(64, fp16)
FLASHATTN_SM80_BWD(128, fp16)
FLASHATTN_SM80_BWD(256, fp16)
#undef FLASHATTN_SM80_BWD

}  // namespace flashattn::sm80
