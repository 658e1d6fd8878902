// The backward's workspace, shared by both kernel families: the caller allocates
// flashattn_params_t::workspace of this size (src/backend/gpu.rs computes the same), the launchers
// carve it.
#pragma once

#include <cstdint>

#include "../flash_api.h"

namespace flashattn {

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
// (`dq_slices` of (batch, heads_q, dq_accum_rows(seqlen_q), d): the sm80 family's
// bwd_dq_splits, the sm90 family's one), LSE·log2(e) and
// rowsum(dO ∘ O) (batch, heads_q, dq_accum_rows(seqlen_q)) each, and with GQA the f32 dK and dV
// sums (batch, heads_kv, seqlen_k, d), or in deterministic mode per query head (batch, heads_q,
// seqlen_k, d); in deterministic mode last the sm90 backward's dQ semaphores (an int per
// (batch, heads_q, 64-row query block, warpgroup of 2)). src/backend/gpu.rs sizes it the same way.
struct BwdWorkspace {
  int64_t dq_accum, lse_log2, softmax_d, dk_accum, dv_accum, dq_semaphore, bytes;
};
inline BwdWorkspace bwd_workspace(const flashattn_params_t& p, int dq_slices) {
  auto align = [](int64_t x) { return (x + 255) / 256 * 256; };
  const int64_t rows_dq = int64_t(p.batch) * p.heads_q * dq_accum_rows(p.seqlen_q);
  const int64_t rows_k =
      int64_t(p.batch) * (p.deterministic ? p.heads_q : p.heads_kv) * p.seqlen_k;
  BwdWorkspace w;
  w.dq_accum = 0;
  w.lse_log2 = dq_slices * align(rows_dq * p.head_dim * 4);
  w.softmax_d = w.lse_log2 + align(rows_dq * 4);
  w.dk_accum = w.softmax_d + align(rows_dq * 4);
  const bool gqa = p.heads_q != p.heads_kv;
  w.dv_accum = w.dk_accum + (gqa ? align(rows_k * p.head_dim * 4) : 0);
  w.dq_semaphore = w.dv_accum + (gqa ? align(rows_k * p.head_dim * 4) : 0);
  w.bytes = w.dq_semaphore + (p.deterministic ? align(rows_dq / 64 * 2 * 4) : 0);
  return w;
}

}  // namespace flashattn
