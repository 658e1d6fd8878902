// The C ABI of flashattn's CUDA kernels: the only header bindgen reads.
// Plain C, no CUDA includes: streams and device pointers are void*, sizes fixed-width.
// Every symbol is prefixed `flashattn_` so that linking beside other attention libraries is safe.
#ifndef FLASHATTN_API_H
#define FLASHATTN_API_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  FLASHATTN_OK = 0,
  FLASHATTN_INVALID_ARGUMENT = 1,  // a parameter the caller should have validated
  FLASHATTN_UNSUPPORTED = 2,       // a path not built (yet) or not available on this device
  FLASHATTN_CUDA_ERROR = 3,        // see flashattn_result_t.cuda_error
} flashattn_status_t;

typedef struct {
  int32_t status;      // flashattn_status_t
  int32_t cuda_error;  // cudaError_t when status == FLASHATTN_CUDA_ERROR, else 0
} flashattn_result_t;

typedef enum {
  FLASHATTN_F16 = 0,
  FLASHATTN_BF16 = 1,
  FLASHATTN_E4M3 = 2,
} flashattn_dtype_t;

// Kernel families that can be compiled in (bit flags of flashattn_built_kernels()).
typedef enum {
  FLASHATTN_KERNEL_SM90_FWD = 1,
  FLASHATTN_KERNEL_SM90_BWD = 2,
  FLASHATTN_KERNEL_SM80_FWD = 4,
  FLASHATTN_KERNEL_SM80_BWD = 8,
  FLASHATTN_KERNEL_SM90_FP8_FWD = 16,
  FLASHATTN_KERNEL_SM90_SELFTEST = 32,
  FLASHATTN_KERNEL_SM90_FP8_CACHE_FWD = 64,
  FLASHATTN_KERNEL_SM80_FP8_CACHE_FWD = 128,
} flashattn_kernel_t;

// Scheduling switches of the sm90 forward (0 = the defaults).
typedef enum {
  FLASHATTN_SM90_NO_PINGPONG = 1,
  FLASHATTN_SM90_NO_INTRA_WG_OVERLAP = 2,
  FLASHATTN_SM90_PERSISTENT_CAUSAL = 4,  // persistent schedule also for causal/windows
  // The tile table's Masked tile (narrow key blocks) where the head dim has one; the caller
  // chooses it (the Rust planner: causal and windowed calls, short keys).
  FLASHATTN_SM90_MASKED_TILE = 8,
  FLASHATTN_SM90_NO_SPLIT_TAIL = 16,     // the last partial wave's tiles run whole (fwd_tail.h)
  FLASHATTN_SM90_SPLIT_TAIL_ALWAYS = 32, // split it wherever it can be, paying or not
  // With num_splits 0, key splits where the launcher predicts they pay (where the tail split does
  // not apply and the tiles leave SMs idle): a KV cache's decoding.
  FLASHATTN_SM90_PLAN_KEY_SPLITS = 64,
} flashattn_sm90_flag_t;

// Longest sequence (queries or keys) a call takes: the kernels number rows and blocks with 32-bit
// integers, and this leaves every such number room. For the same reason a call is refused where
// batch · heads_q passes 2^31 - 1, (max(seqlen_q, seqlen_k) / 64 + 1) · batch · heads_q passes
// 2^31 - 1, max(seqlen_q, seqlen_k) · batch · heads_q · head_dim passes 2^42, or a left window
// narrower than seqlen_k - 1 plus seqlen_k passes 2^31 - 513; the sm80 entry points also take at
// most 65535 batch entries and query heads (their grid's y and z).
#define FLASHATTN_MAX_SEQLEN 1073741824  // 2^30

// One strided 4-d operand (batch, seqlen, heads, head_dim); strides in elements, head_dim unit.
// ptr and every stride of a dimension longer than 1 must be 16-byte aligned (TMA loads, 16-byte
// stores), non-negative and below 2^40 bytes; outputs must reach each element once (no zero or
// overlapping strides) and share no element with an input or another output. Every entry point
// checks this and returns FLASHATTN_INVALID_ARGUMENT otherwise.
typedef struct {
  void* ptr;
  int64_t batch_stride;
  int64_t row_stride;
  int64_t head_stride;
} flashattn_tensor_t;

// Everything a forward or backward launch needs. Fields a path does not use are ignored;
// pointers that are unused must be null.
typedef struct {
  // Forward operands. lse: f32 (batch, heads_q, seqlen_q), packed (varlen: below).
  flashattn_tensor_t q, k, v, o;
  float* lse;
  // Backward operands: dout like o; dq like q; dk, dv like k, v.
  flashattn_tensor_t dout, dq, dk, dv;
  // Workspace for the backward: f32 dQ accumulator, rowsum(dO*O) and, with GQA, f32 dK/dV sums
  // (layout and size: bwd_workspace in csrc/common/bwd_workspace.h; a smaller one is refused
  // with FLASHATTN_INVALID_ARGUMENT).
  void* workspace;
  int64_t workspace_bytes;

  int32_t batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim;
  int32_t dtype;  // flashattn_dtype_t

  float softmax_scale;  // finite, > 0
  float softcap;        // finite, >= 0; 0 = off
  int32_t causal;       // bottom-right aligned when seqlen_q != seqlen_k
  int32_t window_left;  // -1 = unbounded, as is any window >= seqlen_k - 1
  int32_t window_right; // -1 = unbounded, as is any window >= seqlen_q - 1
  int32_t deterministic;

  // Attention sinks (optional): one f32 logit per query head (heads_q, device memory) that joins
  // every row's softmax in the units of the scaled (and capped) scores and takes no value row:
  // LSE = log(exp(sink) + Σ exp(s)), so that a row that sees no key gets O = 0 and LSE = sink.
  // The forward adds them after its kernels, by one pass over O (which rounds O once more).
  // The backward takes the same sinks (its P comes from the forward's LSE, which holds them)
  // and, where dsinks (heads_q f32, device memory, overwritten) is not null, writes
  // d_sink = −Σ exp(sink − LSE)·Σ_j P_j·dP_j over every row of the head in every batch entry or
  // sequence, summed in a fixed order (bit-identical run to run); the sm90 backward refuses it
  // with softcap (FLASHATTN_UNSUPPORTED: the sm80 one has it). dsinks without sinks is refused
  // (FLASHATTN_INVALID_ARGUMENT). The workspace grows by bwd_sink_parts (bwd_workspace.h).
  const float* sinks;
  float* dsinks;

  // Packed (variable-length, "varlen") batches, where cu_seqlens_q is not null: the tensors
  // have one batch entry (batch strides ignored) of seqlen_q query rows and seqlen_k key rows,
  // in which `batch` sequences lie one after another; sequence b owns query rows
  // [cu_seqlens_q[b], cu_seqlens_q[b + 1]) and key rows [cu_seqlens_k[b], cu_seqlens_k[b + 1]),
  // of which it attends to the first seqused_k[b] (null: all). Offsets (batch + 1 each) and
  // seqused_k are int32 on the device; max_seqlen_q / max_seqlen_k (1 .. seqlen_q / seqlen_k)
  // bound every sequence's lengths and size the grids. lse is then f32 (heads_q, seqlen_q), or
  // with lse_by_sequence (the forward's alone: FLASHATTN_UNSUPPORTED in a backward) f32
  // (batch, heads_q, max_seqlen_q), sequence b's row i of head h at (b·heads_q + h)·max_seqlen_q
  // + i, as a KV cache's LSE (rows past a sequence's length are not written).
  // The offsets are read by the kernels only (no host synchronization), so they are not
  // checked here: the kernels clamp each sequence into the tensors (start into [0, seqlen],
  // end into [start, seqlen], length to max_seqlen, seqused_k into [0, length]), so that
  // malformed offsets give unspecified values in the rows they name but never an access outside
  // a buffer. Rows of the outputs (O, the LSE, dQ, dK, dV) that no sequence owns are not
  // written; key rows a sequence owns past seqused_k get dK = dV = 0. The sm90 kernels load whole
  // tiles, so rows beside a sequence (its keys past seqused_k, the next sequence's rows) must be
  // finite: masked to a zero weight, 0·NaN is still NaN. The FP8 forward takes packed batches
  // quantized with the same offsets (flashattn_fp8_quantize_t's cu_seqlens).
  const int32_t* cu_seqlens_q;
  const int32_t* cu_seqlens_k;
  const int32_t* seqused_k;
  int32_t max_seqlen_q, max_seqlen_k;

  // A paged KV cache (the 16-bit forwards; FLASHATTN_UNSUPPORTED elsewhere), where
  // page_table is not null: k and v are num_pages pages (their batch axis) of page_size rows,
  // and the call is a packed one whose cu_seqlens_k is null: sequence b's key j lies in row
  // j % page_size of page page_table[b * page_table_batch_stride + j / page_size] (int32 on the
  // device, each clamped into [0, num_pages)), and it attends to its first seqused_k[b] keys
  // (required). seqlen_k = max_seqlen_k is the keys a sequence's row of the table addresses, a
  // whole number of pages, at most page_table_batch_stride of them. Both forwards take
  // pages of any size: the sm90 forward loads pages of whole key blocks of its tile (128 at head
  // dims 64, 96, 128 and (192, 128)) a block at a time, pages of multiples of 16 rows in pieces
  // of 16 or 64 rows (one TMA copy each) and gathers other pages' rows, each from its page (an
  // e4m3 cache's pieces are staged and widened at head dims 64 and 128, its other pages
  // gathered); the sm80 forward looks up each copied row's page.
  // A dense cache read through a per-sequence entry index (flash-attn's cache_batch_idx) is such
  // a call: its entries the pages (page_size their rows), the index the table (stride 1).
  // Without a table these must be null and 0.
  const int32_t* page_table;
  int64_t page_table_batch_stride;
  int32_t page_size;

  // FP8 forward (dtype FLASHATTN_E4M3), operands from flashattn_fp8_quantize: q and k in rows,
  // v key-major (FLASHATTN_FP8_KEY_MAJOR; its row_stride is between head_dim rows); descales
  // f32 (batch, heads, blocks) packed, Q per flashattn_fp8_query_block() rows, K and V per
  // flashattn_fp8_key_block(head_dim) keys; o in out_dtype (FLASHATTN_BF16 or FLASHATTN_F16).
  // Packed calls: descales and v as flashattn_fp8_quantize writes them for packed sources (with
  // the same offsets: others give wrong rows, never an access outside the buffers).
  // Descales are read on the device only and must be normal numbers from 2^-126 to 2^126, as
  // flashattn_fp8_quantize writes them; flashattn_fp8_sanitize_descales turns others into NaN
  // (NaN rows out). Other calls pass null descales (else FLASHATTN_INVALID_ARGUMENT), but for an
  // e4m3 KV cache's K and V descales (kv_cache_e4m3 below).
  const float* q_descale;
  const float* k_descale;
  const float* v_descale;
  int32_t out_dtype;

  // The device's SM count (from flashattn_device_query), 1 .. 4096: grids are sized by it.
  int32_t sm_count;
  uint32_t sm90_flags;  // flashattn_sm90_flag_t bits

  // Head dim of V, O, dO and dV where it differs from Q's and K's (head_dim); 0 = the same.
  // Built for the pairs the kernel registry lists (src/registry.rs); others are refused with
  // FLASHATTN_UNSUPPORTED. Last, so that the fields before it keep their offsets.
  int32_t head_dim_v;
  // The paged KV cache's pages (page_table above); 0 without one.
  int32_t num_pages;
  // Packed calls: 1 for the LSE by sequence (cu_seqlens above), 0 over the packed rows.
  int32_t lse_by_sequence;
  // Pack-GQA (1; 0 = off; the sm90 16-bit forward only, FLASHATTN_UNSUPPORTED elsewhere): a
  // tile's rows are (query row, query head) pairs over the heads_q / heads_kv query heads of one
  // KV head, so that few query rows (a decode step's) still fill a tile and each K/V block is
  // read once per KV head, not once per query head. The results are the same. The tensors' query
  // rows times that group must be at most FLASHATTN_MAX_SEQLEN (else
  // FLASHATTN_INVALID_ARGUMENT).
  int32_t pack_gqa;
  // Key splits (split-KV) of the sm90 16-bit forward: 0 none (but the tail split, and with
  // FLASHATTN_SM90_PLAN_KEY_SPLITS the launcher's choice), 1 every tile whole (no tail split
  // either), n in 2 .. 256 each tile's key blocks cut into n ranges (at most the longest
  // sequence's key blocks, and fewer where their f32 partial results would pass 1 GiB) computed
  // apart and merged by their LSE, the partials in a workspace taken and given back in stream
  // order. Elsewhere 0 or 1 (else FLASHATTN_UNSUPPORTED); outside 0 .. 256 invalid.
  int32_t num_splits;
  // 1: K and V are an e4m3 paged cache (page_table required, else FLASHATTN_INVALID_ARGUMENT; a
  // dense cache runs as pages of its entries, the table then naming each sequence's entry),
  // read by the sm90 and sm80 16-bit forwards (dtype FLASHATTN_F16 or FLASHATTN_BF16: Q and
  // O; head dims the registry builds them for, else FLASHATTN_UNSUPPORTED, which the backwards
  // answer too), each row widened to dtype in shared memory. k_descale and v_descale are then f32
  // (batch, heads_kv), sequence b's KV head h at b·heads_kv + h (null: 1): K's multiplies the
  // scores (before softcap), V's the values, as flash-attn's k_descale and v_descale; q_descale
  // must be null. Read on the device only: finite and > 0 is the caller's to keep. 0: K and V
  // are in dtype.
  int32_t kv_cache_e4m3;
} flashattn_params_t;

// Where flashattn_fp8_quantize writes: rows like the source, (batch, seqlen, heads, head_dim)
// with the dst strides; or key-major, (batch, heads, head_dim, keys) with dst_row_stride between
// head_dim rows, keys padded with zeros to whole blocks (packed sources: every sequence's own
// blocks; blocks no sequence owns are not written) and ordered within each 32-key group as
// the FP8 forward's P, and row r holding head dim fp8_v_row_head_dim(r), a permutation within
// each 32 rows (csrc/sm90/fp8_v_rows.h) that lets O leave by 16-byte stores (the layout the
// kernel's V operand needs; build it with flashattn_fp8_quantize).
typedef enum {
  FLASHATTN_FP8_ROWS = 0,
  FLASHATTN_FP8_KEY_MAJOR = 1,
} flashattn_fp8_layout_t;

// One tensor's quantize step: e4m3 = round(x · (1 / descale)), one descale per block_rows rows of
// one head (amax ↦ 448), after the random-sign Hadamard transform along head_dim if `hadamard`
// (bit i of hadamard_signs set: column i negated first; power-of-two head dims only,
// FLASHATTN_UNSUPPORTED at 96 and 192). An E4M3 source with descale null is copied unscaled
// into the layout.
typedef struct {
  flashattn_tensor_t src;  // (batch, seqlen, heads, head_dim)
  int32_t src_dtype;       // flashattn_dtype_t
  void* dst;
  int64_t dst_batch_stride, dst_row_stride, dst_head_stride;  // bytes
  float* descale;          // (batch, heads, ceil(seqlen / block_rows)) or null; packed below
  int32_t batch, seqlen, heads, head_dim;
  int32_t block_rows;      // 1..4096; a multiple of 32 with head_dim·block_rows <= 32768 for
                           // FLASHATTN_FP8_KEY_MAJOR
  int32_t layout;          // flashattn_fp8_layout_t
  int32_t hadamard;
  uint64_t hadamard_signs[4];
  // Packed (varlen) sources: `batch` sequences whose batch + 1 i32 offsets (device memory, as
  // the forward's cu_seqlens_q or cu_seqlens_k, clamped as it clamps them) are cu_seqlens, each
  // at most max_seqlen rows; src and rows-layout dst then have one batch entry of `seqlen` rows
  // (the total), and every sequence is quantized in blocks of its own, numbered per head with
  // P = seqlen / block_rows + batch blocks, sequence b's from cu_seqlens[b] / block_rows + b on:
  // descale (heads, P), key-major dst (heads, head_dim, P · block_rows). Null: dense.
  const int32_t* cu_seqlens;
  int32_t max_seqlen;
} flashattn_fp8_quantize_t;

// A KV cache's append step (flash_attn_with_kvcache's k, v and rotary arguments): row i of
// sequence b of k_new and v_new is written to the cache's row cache_seqlens[b] + i, of entry b
// of a dense cache, or with page_table (not null) of page page_table[b * max_pages + row /
// cache_rows] at row (row % cache_rows) of a paged one; with rotary_cos (not null) the new keys'
// first rotary_dim elements rotated to that position first, and q (where q.ptr is not null)
// rotated into q_out, row i at position cache_seqlens[b] + i (or cache_seqlens[b] for every row
// with q_same_position: calls whose mask bounds no key, a left window of capacity - 1 or more
// and a right one of seqlen_q - 1 or more counting as none, as FlashAttention-3 has it). Rotary
// embedding as flash-attn applies it: pairs (2j, 2j + 1) with rotary_interleaved, else
// (j, j + rotary_dim / 2); the angles rotary_cos and rotary_sin f32 (rotary_positions,
// rotary_dim / 2), row-major.
// seqlens_out (optional, batch i32) gets cache_seqlens[b] + seqlen_new: the keys a forward over
// the cache then attends to. cache_seqlens is read on the device only: each value is clamped
// into [0, capacity] (capacity: cache_rows, or max_pages · cache_rows paged), rows past the
// capacity are not written (nor counted in seqlens_out), page numbers are clamped into
// [0, entries) and positions into [0, rotary_positions): a malformed value gives wrong rows,
// never an access outside a buffer. The tensors are checked as flashattn_tensor_t says; the
// cache, q_out and seqlens_out are outputs. Any sm_80 or later device.
// With cache_e4m3 1 the cache holds e4m3 (k_new, v_new and q dtype): each new element x of
// sequence b's KV head h is stored as x · (1 / k_descale[b * heads_kv + h]) (values by v_descale)
// rounded to the nearest e4m3, ±448 past its largest finite value, as a forward with
// kv_cache_e4m3 and the same descales reads it back (the keys rotated first, rounded to dtype).
// k_descale and v_descale are f32 (batch, heads_kv), or null (1); a descale that is not a
// positive normal number stores NaN in the rows it scales. With cache_e4m3 0 they must be null.
typedef struct {
  flashattn_tensor_t k_new, v_new;      // (batch, seqlen_new, heads_kv, head_dim / head_dim_v)
  flashattn_tensor_t k_cache, v_cache;  // (entries, cache_rows, heads_kv, head_dim / head_dim_v)
  int32_t dtype;                        // FLASHATTN_F16 or FLASHATTN_BF16
  int32_t batch, seqlen_new, heads_kv, head_dim, head_dim_v;
  int32_t entries, cache_rows;  // dense: batch entries (at least batch) of cache_rows rows;
                                // paged: num_pages pages of page_size rows
  const int32_t* cache_seqlens;  // batch values
  const int32_t* page_table;     // paged: (batch, max_pages), row-major; null: dense
  int32_t max_pages;             // paged: at least 1; dense: 0
  int32_t* seqlens_out;          // null, or batch values
  const float* rotary_cos;       // null: no rotary embedding
  const float* rotary_sin;
  int32_t rotary_dim;            // even, 2 .. head_dim
  int32_t rotary_positions;      // at least 1
  int32_t rotary_interleaved;
  flashattn_tensor_t q, q_out;   // (batch, seqlen_q, heads_q, head_dim); q.ptr null: none
  int32_t seqlen_q, heads_q, q_same_position;
  int32_t cache_e4m3;
  const float* k_descale;
  const float* v_descale;
} flashattn_kvcache_append_t;

// Partial attention results merged by their log-sum-exp (flashattn_combine): `parts` outputs
// part_o[i] (batch, seqlen_q, heads, head_dim_v) in dtype (FLASHATTN_F16 or FLASHATTN_BF16), each
// with its f32 LSE part_lse[i], contiguous (batch, heads, seqlen_q) (a dense call's), or with
// lse_packed 1 (heads, batch * seqlen_q) (a packed call's); o and lse take the merged ones in the
// same layouts: LSE = log sum_i exp(LSE_i) and O = sum_i exp(LSE_i - LSE) * O_i, row by row, in
// f32. A part with LSE +inf saw no key of the row and weighs 0 (its O, 0 by convention, is still
// multiplied: a NaN or inf there makes the element NaN); a row no part saw gets O = 0 and LSE =
// +inf; a NaN LSE makes its row NaN. Entries past `parts` are ignored. The outputs share no
// element with an input or each other.
#define FLASHATTN_MAX_COMBINE_PARTS 64
typedef struct {
  int32_t dtype;
  int32_t parts;  // 1 ..= FLASHATTN_MAX_COMBINE_PARTS
  int32_t batch, seqlen_q, heads, head_dim_v;
  int32_t lse_packed;
  flashattn_tensor_t part_o[FLASHATTN_MAX_COMBINE_PARTS];
  const float* part_lse[FLASHATTN_MAX_COMBINE_PARTS];
  flashattn_tensor_t o;
  float* lse;
} flashattn_combine_t;

// Rows of a (batch, seqlen, heads, head_dim) tensor held twice (head_dim at most 4096): x in
// dtype (FLASHATTN_F16 or FLASHATTN_BF16) and acc in f32, each with its strides (unit element
// stride). flashattn_rows_add adds x into acc element by element (acc += x, in f32);
// flashattn_rows_round writes acc rounded to the nearest dtype into x: gradients summed over
// several calls in f32 and rounded once. The views are checked as flashattn_tensor_t says (the
// output, acc or x, reaching each element once and sharing none with the other).
typedef struct {
  int32_t dtype;
  int32_t batch, seqlen, heads, head_dim;
  flashattn_tensor_t x;    // dtype
  flashattn_tensor_t acc;  // f32
} flashattn_rows_t;

typedef struct {
  int32_t major, minor;
  int32_t sm_count;
  int64_t max_smem_per_block_optin;
  int64_t l2_bytes;
  int64_t total_mem_bytes;
  char name[256];
} flashattn_device_info_t;

// Which kernel families this library was compiled with (flashattn_kernel_t flags).
uint32_t flashattn_built_kernels(void);

// Properties of device `ordinal` through the CUDA runtime.
flashattn_result_t flashattn_device_query(int32_t ordinal, flashattn_device_info_t* info);

// The short name of a cudaError_t ("cudaErrorInvalidValue").
const char* flashattn_cuda_error_name(int32_t code);

// Attention forward / backward on `stream` (a cudaStream_t). Validates, then launches; never
// synchronizes the stream. Returns FLASHATTN_UNSUPPORTED for paths not compiled in.
flashattn_result_t flashattn_fwd_sm90(const flashattn_params_t* params, void* stream);
flashattn_result_t flashattn_bwd_sm90(const flashattn_params_t* params, void* stream);
flashattn_result_t flashattn_fwd_sm80(const flashattn_params_t* params, void* stream);
flashattn_result_t flashattn_bwd_sm80(const flashattn_params_t* params, void* stream);

// The FP8 forward's descale blocks: query rows per Q descale, keys per K/V descale (0 for a head
// dim it does not build).
int32_t flashattn_fp8_query_block(void);
int32_t flashattn_fp8_key_block(int32_t head_dim);

// FP8 quantize step on `stream` (sm_90).
flashattn_result_t flashattn_fp8_quantize(const flashattn_fp8_quantize_t* params, void* stream);

// KV-cache append step on `stream` (flashattn_kvcache_append_t).
flashattn_result_t flashattn_kvcache_append(const flashattn_kvcache_append_t* params,
                                            void* stream);

// Partial results merged by their LSE on `stream` (flashattn_combine_t).
flashattn_result_t flashattn_combine(const flashattn_combine_t* params, void* stream);

// acc += x, and x = acc rounded, on `stream` (flashattn_rows_t).
flashattn_result_t flashattn_rows_add(const flashattn_rows_t* params, void* stream);
flashattn_result_t flashattn_rows_round(const flashattn_rows_t* params, void* stream);

// `count` FP8 descales from src to dst (in place when equal) on `stream`, every value that is not
// a normal number from 2^-126 to 2^126 replaced by NaN: the FP8 forward then gives NaN in the
// rows such a descale touches, instead of silently wrong numbers.
flashattn_result_t flashattn_fp8_sanitize_descales(const float* src, float* dst, int64_t count,
                                                   void* stream);

// Toolchain self-test on sm_90a: one TMA load of A (64x16) and B (64x16) bf16 tiles (K-major)
// into shared memory and one WGMMA computing C = A * B^T (64x64, f32), written to `c`.
flashattn_result_t flashattn_selftest_tma_wgmma(const void* a, const void* b, float* c,
                                                void* stream);

#ifdef __cplusplus
}
#endif

#endif  // FLASHATTN_API_H
