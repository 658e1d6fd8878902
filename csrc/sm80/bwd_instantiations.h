// The sm80 backward instantiations, one translation unit each (bwd_d{64,128,256}_{bf16,fp16}.cu),
// the tile table they share, and the workspace layout.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../flash_api.h"

namespace flashattn::sm80 {

// Per head dim: query rows and keys per block, 8 warps laid out per GEMM: S/dP kAtomMSdP warps
// down M, dK/dV kAtomNdKV down N, dQ kAtomMdQ down M (FlashAttention-2's choices for GPUs with
// 144 KiB of shared memory or more). Registers: dK and dV accumulators kBlockN·d·2 over 256
// threads plus S and dP kBlockM·kBlockN·2; ptxas spills d64 ~280 bytes, d128 24, d256 none
// (d64 128×128 still ran 8% faster on the H200 than 64×128, which spills nothing). Shared
// memory: K, V (kBlockN·d each), P, dS (kBlockM·kBlockN each), then per Q/dO buffer kBlockM·d·2
// (+ LSE, D): with two buffers d64 162 KiB, d128 159 KiB, d256 209 KiB; d256 takes one buffer
// (145 KiB) where the device offers less (A100: 163 KiB).
template <int kHeadDim> struct BwdTile;
template <> struct BwdTile<64> {
  static constexpr int kBlockM = 128, kBlockN = 128, kWarps = 8, kAtomMSdP = 4, kAtomNdKV = 4,
                       kAtomMdQ = 4;
};
template <> struct BwdTile<128> {
  static constexpr int kBlockM = 64, kBlockN = 128, kWarps = 8, kAtomMSdP = 2, kAtomNdKV = 4,
                       kAtomMdQ = 2;
};
template <> struct BwdTile<256> {
  static constexpr int kBlockM = 64, kBlockN = 64, kWarps = 8, kAtomMSdP = 4, kAtomNdKV = 2,
                       kAtomMdQ = 2;
};

// The dQ accumulator's rows per (batch, head) are seqlen_q rounded up to this, so that a query
// block's atomics need no row predicate.
constexpr int kDqRowAlign = 128;
inline int dq_accum_rows(int seqlen_q) {
  return (seqlen_q + kDqRowAlign - 1) / kDqRowAlign * kDqRowAlign;
}

// dQ slices in deterministic mode: as many CTAs per (batch, head) as fit in one wave on the SMs
// (a second, partial wave would double the time), one slice each, at most one per 128 keys.
// Atomic mode: one slice. src/backend/gpu.rs computes the same.
inline int bwd_dq_splits(const flashattn_params_t& p) {
  if (!p.deterministic) return 1;
  const int64_t heads = int64_t(p.batch) * p.heads_q;
  const int64_t fill = p.sm_count / heads;
  const int64_t most = (p.seqlen_k + 127) / 128;
  return int(fill < 1 ? 1 : (fill > most ? most : fill));
}

// The caller's workspace (flashattn_params_t::workspace), byte offsets: the f32 dQ accumulator
// (bwd_dq_splits slices of (batch, heads_q, dq_accum_rows(seqlen_q), d)), LSE·log2(e) and
// rowsum(dO ∘ O) (batch, heads_q, dq_accum_rows(seqlen_q)) each, and with GQA the f32 dK and dV
// sums (batch, heads_kv, seqlen_k, d), or in deterministic mode per query head (batch, heads_q,
// seqlen_k, d); in deterministic mode last the sm90 backward's dQ semaphores (an int per
// (batch, heads_q, 64-row query block, warpgroup of 2)). src/backend/gpu.rs sizes it the same way.
struct BwdWorkspace {
  int64_t dq_accum, lse_log2, softmax_d, dk_accum, dv_accum, dq_semaphore, bytes;
};
inline BwdWorkspace bwd_workspace(const flashattn_params_t& p) {
  auto align = [](int64_t x) { return (x + 255) / 256 * 256; };
  const int64_t rows_dq = int64_t(p.batch) * p.heads_q * dq_accum_rows(p.seqlen_q);
  const int64_t rows_k =
      int64_t(p.batch) * (p.deterministic ? p.heads_q : p.heads_kv) * p.seqlen_k;
  BwdWorkspace w;
  w.dq_accum = 0;
  w.lse_log2 = bwd_dq_splits(p) * align(rows_dq * p.head_dim * 4);
  w.softmax_d = w.lse_log2 + align(rows_dq * 4);
  w.dk_accum = w.softmax_d + align(rows_dq * 4);
  const bool gqa = p.heads_q != p.heads_kv;
  w.dv_accum = w.dk_accum + (gqa ? align(rows_k * p.head_dim * 4) : 0);
  w.dq_semaphore = w.dv_accum + (gqa ? align(rows_k * p.head_dim * 4) : 0);
  w.bytes = w.dq_semaphore + (p.deterministic ? align(rows_dq / 64 * 2 * 4) : 0);
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
