// The backward's workspace, shared by both kernel families: the caller allocates
// flashattn_params_t::workspace of this size (src/backend/gpu.rs computes the same), the launchers
// carve it.
#pragma once

#include <cstdint>

#include "../flash_api.h"
#include "sequences.h"

namespace flashattn {

// The dQ accumulator's rows per (batch, head) are seqlen_q rounded up to this, so that a query
// block's atomics need no row predicate.
constexpr int kDqRowAlign = 128;
__host__ __device__ inline int dq_accum_rows(int seqlen_q) {
  return (seqlen_q + kDqRowAlign - 1) / kDqRowAlign * kDqRowAlign;
}

// Rows of the dQ accumulator, LSE·log2(e) and D, the "query workspace rows", per (tensor batch
// entry, head). Dense: dq_accum_rows(seqlen_q) per (batch, head). Packed: per head (the tensors'
// single batch entry) dq_accum_rows(seqlen_q) + kDqRowAlign · batch rows, in which sequence b's
// run of dq_accum_rows(its length) rows starts at round_down(q_start, kDqRowAlign) +
// kDqRowAlign · b (bwd_packed_run). That is the tensors' rows plus at most a pad per sequence,
// where a run per (sequence, head) as long as the longest sequence would take
// batch · max_seqlen_q. Each run stays clear of the next and of the end: with s = q_start and
// n = length, round_down(s) + round_up(n) <= round_down(s + n) + kDqRowAlign, and s + n is at
// most the next sequence's start (and at most seqlen_q), so run b ends by the next run's start,
// round_down(s + n) + kDqRowAlign · (b + 1), and the last by dq_accum_rows(seqlen_q) +
// kDqRowAlign · batch. Sequences::at clamps any offsets into that bound (malformed ones may
// overlap runs, never pass the end). Runs start on multiples of kDqRowAlign, so a query block
// (a divisor of it) never straddles two.
inline int64_t bwd_rows_per_head(const flashattn_params_t& p) {
  const int64_t rows = dq_accum_rows(p.seqlen_q);
  return p.cu_seqlens_q == nullptr ? rows : rows + int64_t(kDqRowAlign) * p.batch;
}

// Packed: where sequence b (first row q_start on the tensors' rows) starts within a head's query
// workspace rows.
__host__ __device__ inline int64_t bwd_packed_run(int q_start, int b) {
  return int64_t(q_start / kDqRowAlign * kDqRowAlign) + int64_t(kDqRowAlign) * b;
}

// Offset of (row 0, head `head`) of entry `b` (Sequences::at(b) is `e`) in the query workspace
// rows (`rows` per (tensor batch entry, head): bwd_rows_per_head).
__host__ __device__ inline int64_t bwd_rows_start(const Sequences& s, const Sequences::Entry& e,
                                                  int b, int head, int heads, int rows) {
  const int64_t at = (int64_t(e.batch) * heads + head) * rows;
  return s.packed() ? at + bwd_packed_run(e.q_start, b) : at;
}

// Packed calls: the sequence of `batch` whose run of query workspace rows (bwd_rows_start) holds
// row `w` of a head, as far as any does (a row before run 0 or past a run's dq_accum_rows(length)
// belongs to none: the caller checks).
__device__ inline int bwd_entry_of_row(const Sequences& s, int batch, int64_t w) {
  return last_start_at_most(batch, w, [&](int b) { return bwd_packed_run(s.at(b).q_start, b); });
}

// Rows of the GQA f32 dK/dV sums per (tensor batch entry, head): the key rows; sequence b's rows
// at its k_start (the main kernel writes them under a row predicate, so no pad is needed).
__host__ __device__ inline int64_t bwd_key_rows_start(const Sequences::Entry& e, int head,
                                                      int heads, int rows_k) {
  return (int64_t(e.batch) * heads + head) * rows_k + e.k_start;
}

// dQ slices in deterministic mode: as many CTAs per (batch, head) as fit in one wave on the SMs
// (a second, partial wave would double the time), one slice each, at most one per 128 keys of the
// longest entry (packed: max_seqlen_k). Atomic mode: one slice. src/backend/gpu.rs computes the
// same.
inline int bwd_dq_splits(const flashattn_params_t& p) {
  if (!p.deterministic) return 1;
  const int64_t heads = int64_t(p.batch) * p.heads_q;
  const int64_t fill = p.sm_count / heads;
  const int seqlen_k = p.cu_seqlens_q == nullptr ? p.seqlen_k : p.max_seqlen_k;
  const int64_t most = (seqlen_k + 127) / 128;
  return int(fill < 1 ? 1 : (fill > most ? most : fill));
}

// The caller's workspace (flashattn_params_t::workspace), byte offsets, with R =
// bwd_rows_per_head(p) query workspace rows per (tensor batch entry, head) and B the tensors'
// batch entries (dense: batch; packed: 1): the f32 dQ accumulator (`dq_slices` of
// (B, heads_q, R, d): the sm80 family's bwd_dq_splits, the sm90 family's one), LSE·log2(e) and
// rowsum(dO ∘ O) (B, heads_q, R) each, and with GQA the f32 dK and dV sums (B, heads_kv,
// seqlen_k, d and d_v), or in deterministic mode per query head (B, heads_q, seqlen_k, d and
// d_v); in deterministic mode the sm90 backward's dQ semaphores (an int per (B, heads_q, 64-row query
// block, warpgroup of 2)), and for packed calls in deterministic mode last the offsets' flag (an
// int, bwd_offsets_malformed); then for packed calls the entry tables (bwd_packed_entries): an
// int per kDqRowAlign rows of a head's query workspace rows, and one per packed key block of
// kMinKeyBlock keys (packed_blocks); where the call asks for the sinks' gradient, its parts
// (bwd_sink_parts floats). Each region starts on a multiple of 256 bytes.
// src/backend/gpu.rs sizes it the same way.
struct BwdWorkspace {
  int64_t dq_accum, lse_log2, softmax_d, dk_accum, dv_accum, dq_semaphore, offsets_flag,
      row_entries, key_entries, sink_parts, bytes;
};
// The smallest key block of the backward kernels: the sm90 family's packed key table and the
// sinks' parts are sized for it (the sm80 family builds the row table alone).
constexpr int kMinKeyBlock = 64;

// The sinks' gradient parts (bwd_sink_grad): kSinkWarps floats per key block of every entry and
// query head, or of the packed key blocks, where the call asks for the gradient.
constexpr int kSinkWarps = 8;  // at most so many warps of a CTA sum dS
inline int64_t bwd_sink_parts(const flashattn_params_t& p) {
  if (p.dsinks == nullptr) return 0;
  const bool packed = p.cu_seqlens_q != nullptr;
  const int64_t longest = packed ? p.max_seqlen_k : p.seqlen_k;
  int64_t blocks = p.batch * ((longest + kMinKeyBlock - 1) / kMinKeyBlock);
  if (packed) {
    const int64_t packed_keys = packed_blocks(p.seqlen_k, p.batch, kMinKeyBlock);
    blocks = blocks > packed_keys ? blocks : packed_keys;
  }
  return blocks * p.heads_q * kSinkWarps;
}
inline BwdWorkspace bwd_workspace(const flashattn_params_t& p, int dq_slices) {
  auto align = [](int64_t x) { return (x + 255) / 256 * 256; };
  const int64_t batch = p.cu_seqlens_q == nullptr ? p.batch : 1;
  const int64_t rows_dq = batch * p.heads_q * bwd_rows_per_head(p);
  const int64_t rows_k = batch * (p.deterministic ? p.heads_q : p.heads_kv) * p.seqlen_k;
  BwdWorkspace w;
  w.dq_accum = 0;
  w.lse_log2 = dq_slices * align(rows_dq * p.head_dim * 4);
  w.softmax_d = w.lse_log2 + align(rows_dq * 4);
  w.dk_accum = w.softmax_d + align(rows_dq * 4);
  const bool gqa = p.heads_q != p.heads_kv;
  w.dv_accum = w.dk_accum + (gqa ? align(rows_k * p.head_dim * 4) : 0);
  // (The launchers' parameters have head_dim_v filled in: flash_api.cu's normalized.)
  w.dq_semaphore = w.dv_accum + (gqa ? align(rows_k * p.head_dim_v * 4) : 0);
  w.offsets_flag = w.dq_semaphore + (p.deterministic ? align(rows_dq / 64 * 2 * 4) : 0);
  const bool packed = p.cu_seqlens_q != nullptr;
  w.row_entries = w.offsets_flag + (p.deterministic && packed ? 256 : 0);
  w.key_entries = w.row_entries + (packed ? align(bwd_rows_per_head(p) / kDqRowAlign * 4) : 0);
  w.sink_parts = w.key_entries +
                 (packed ? align(packed_blocks(p.seqlen_k, p.batch, kMinKeyBlock) * 4) : 0);
  w.bytes = w.sink_parts + align(bwd_sink_parts(p) * 4);
  return w;
}

// Whether packed offsets, as Sequences::at clamps them, break the layout that the sm90
// deterministic backward's dQ hand-over relies on, at sequence b and its successor: each
// sequence's run of query workspace rows must end by the next one's start (else two sequences
// share a semaphore), and its packed key blocks (of key_block keys) by the next one's first
// (else a CTA meant for it finds another sequence, and the key block it should add never adds).
// Well-formed offsets (non-decreasing, within the maxima) always pass; a failing pair turns the
// hand-over off (bwd_write_dq), so a malformed array gives wrong dQ rows but never a CTA that
// waits forever.
__device__ inline bool bwd_offsets_malformed(const Sequences& s, int batch, int b, int key_block) {
  if (b + 1 >= batch) return false;  // the last sequence's rows are clamped into the tensors
  const Sequences::Entry e = s.at(b), next = s.at(b + 1);
  const int64_t rows_end = bwd_packed_run(e.q_start, b) + dq_accum_rows(e.seqlen_q);
  const int64_t blocks_end = packed_block(e.k_start, b, key_block) +
                             (e.keys_owned + key_block - 1) / key_block;
  return rows_end > bwd_packed_run(next.q_start, b + 1) ||
         blocks_end > packed_block(next.k_start, b + 1, key_block);
}

}  // namespace flashattn
