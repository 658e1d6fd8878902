// Entry points of the C ABI: validate the parameters, then launch on the caller's stream the
// kernel of the registry (src/registry.rs; the dispatch on element type and head dim is generated
// into kernels.h) that this build holds. The Rust side validates first; these checks are the
// second line so that a wrong call from C is refused rather than faulting.
#include <cuda_runtime.h>

#include <cstring>

#include "common/sequences.h"
#include "common/status.h"
#include "common/views.h"
#include "combine.h"
#include "flash_api.h"
#include "kernels.h"
#include "kvcache_append.h"
#include "rows.h"
#include "sm90/fp8_layout.h"
#include "sm90/fp8_quantize.h"

namespace {

using flashattn::status;
using flashattn::View;

constexpr flashattn_result_t kInvalid = {FLASHATTN_INVALID_ARGUMENT, 0};
constexpr flashattn_result_t kUnsupported = {FLASHATTN_UNSUPPORTED, 0};
constexpr flashattn_result_t kOk = {FLASHATTN_OK, 0};

int elem_bytes(int32_t dtype) { return dtype == FLASHATTN_E4M3 ? 1 : 2; }

bool finite(float x) { return x == x && x - x == 0.f; }

// V's (and O's, dO's, dV's) head dim: head_dim_v, or head_dim where it is 0.
int head_dim_v(const flashattn_params_t& p) { return p.head_dim_v != 0 ? p.head_dim_v : p.head_dim; }

// Sizes every kernel family indexes with 32-bit integers; src/tensor.rs checks the same
// (Problem::check_gpu_limits).
// Packed batches: the entries' lengths are their bound, max_seqlen_q/k, and the tensors hold
// one entry of seqlen_q/k rows.
bool sizes_fit(const flashattn_params_t& p) {
  if (p.batch <= 0 || p.seqlen_q <= 0 || p.seqlen_k <= 0 || p.heads_q <= 0 || p.heads_kv <= 0 ||
      p.head_dim <= 0 || p.head_dim_v < 0)
    return false;
  const int widest = p.head_dim > head_dim_v(p) ? p.head_dim : head_dim_v(p);
  // Sequence lengths plus a block (or two) stay in int.
  if (p.seqlen_q > FLASHATTN_MAX_SEQLEN || p.seqlen_k > FLASHATTN_MAX_SEQLEN) return false;
  const bool packed = p.cu_seqlens_q != nullptr;
  const int entry_q = packed ? p.max_seqlen_q : p.seqlen_q;
  const int entry_k = packed ? p.max_seqlen_k : p.seqlen_k;
  // Work items (block of 64 or more rows, batch · head) are numbered with ints ...
  const int64_t heads = int64_t(p.batch) * p.heads_q;
  if (heads > INT32_MAX || widest > 256) return false;
  const int64_t longest = entry_q > entry_k ? entry_q : entry_k;
  if ((longest / 64 + 1) * heads > INT32_MAX) return false;
  // ... and so are the row passes' blocks of 2048 / head_dim rows (at most 2^42 elements); a
  // packed backward's row passes also cover a 128-row pad per sequence.
  const int64_t rows = packed ? (p.seqlen_q > p.seqlen_k ? p.seqlen_q : p.seqlen_k) +
                                    int64_t(128) * p.batch
                              : int64_t(p.batch) * longest;
  // (A packed call's rows are not bounded by its entries' lengths: the product is checked.)
  int64_t elements = 0;
  if (__builtin_mul_overflow(rows, int64_t(p.heads_q) * widest, &elements) ||
      elements > (int64_t(1) << 42))
    return false;
  // Grids sized by the SM count, whose products with each other stay in int.
  return p.sm_count >= 1 && p.sm_count <= 4096;
}

// The parameters as the launchers take them: V's head dim spelled out (head_dim_v), and windows
// that leave every row its whole key range unbounded (-1): the kernels then never add a window to
// a position, so no such sum can pass int. Left: row 0's diagonal is seqlen_k - seqlen_q and the
// last row's seqlen_k - 1, so a left window of seqlen_k - 1 reaches key 0 from every row; right:
// a right window of seqlen_q - 1 reaches the last key from row 0.
flashattn_params_t normalized(const flashattn_params_t& p) {
  flashattn_params_t q = p;
  q.head_dim_v = head_dim_v(p);
  if (q.window_left >= q.seqlen_k - 1) q.window_left = -1;
  if (q.window_right >= q.seqlen_q - 1) q.window_right = -1;
  return q;
}

// Checks every launcher shares: sizes, GQA ratio, element type, head dims, options, packed
// batches and paged caches.
flashattn_result_t validate_common(const flashattn_params_t* p) {
  if (p == nullptr) return kInvalid;
  if (!sizes_fit(*p) || p->heads_q % p->heads_kv != 0) return kInvalid;
  if (!(p->softmax_scale > 0.f) || !finite(p->softmax_scale)) return kInvalid;
  if (!(p->softcap >= 0.f) || !finite(p->softcap)) return kInvalid;
  if (p->window_left < -1 || p->window_right < -1) return kInvalid;
  // A left window is added to key positions in int: narrower than seqlen_k - 1 (wider is
  // unbounded), it must leave a block's room below 2^31.
  if (p->window_left >= 0 && p->window_left < p->seqlen_k - 1 &&
      int64_t(p->seqlen_k) + p->window_left > INT32_MAX - 512)
    return kInvalid;
  if (p->dtype != FLASHATTN_F16 && p->dtype != FLASHATTN_BF16 && p->dtype != FLASHATTN_E4M3)
    return kUnsupported;
  if (!flashattn::kernels::head_dim_known(p->head_dim) ||
      !flashattn::kernels::head_dim_known(head_dim_v(*p)))
    return kUnsupported;
  // Packed batches: both offset arrays (or a page table for the keys) and bounds within the
  // tensors' rows; dense: none of it.
  if (p->cu_seqlens_q != nullptr) {
    if ((p->cu_seqlens_k == nullptr) == (p->page_table == nullptr) || p->max_seqlen_q < 1 ||
        p->max_seqlen_q > p->seqlen_q || p->max_seqlen_k < 1 || p->max_seqlen_k > p->seqlen_k)
      return kInvalid;
  } else if (p->cu_seqlens_k != nullptr || p->seqused_k != nullptr || p->max_seqlen_q != 0 ||
             p->max_seqlen_k != 0) {
    return kInvalid;
  }
  if (p->lse_by_sequence != 0 && (p->lse_by_sequence != 1 || p->cu_seqlens_q == nullptr))
    return kInvalid;
  // Pack-GQA's tile rows (query rows times the group) are numbered with ints.
  if (p->pack_gqa != 0 && p->pack_gqa != 1) return kInvalid;
  if (p->pack_gqa && int64_t(p->seqlen_q) * (p->heads_q / p->heads_kv) > FLASHATTN_MAX_SEQLEN)
    return kInvalid;
  if (p->num_splits < 0 || p->num_splits > 256) return kInvalid;
  if (p->page_table == nullptr)
    return p->page_table_batch_stride == 0 && p->page_size == 0 && p->num_pages == 0 ? kOk
                                                                                      : kInvalid;
  // Paged: packed queries, every sequence's used keys, whole pages per table row.
  // The table's rows and the pages stay within the 2^42-element operands of sizes_fit (so that
  // no product here or in the kernels passes int64).
  if (p->cu_seqlens_q == nullptr || p->seqused_k == nullptr || p->page_size < 1 ||
      p->num_pages < 1 || p->max_seqlen_k != p->seqlen_k || p->seqlen_k % p->page_size != 0 ||
      p->page_table_batch_stride < p->seqlen_k / p->page_size ||
      p->page_table_batch_stride > INT32_MAX ||
      int64_t(p->num_pages) * p->page_size >
          (int64_t(1) << 42) / (int64_t(p->heads_kv) * (p->head_dim > head_dim_v(*p)
                                                            ? p->head_dim
                                                            : head_dim_v(*p))))
    return kInvalid;
  return p->dtype == FLASHATTN_E4M3 ? kUnsupported : kOk;
}

// The operands of one call: what it reads and what it writes.
struct Operands {
  View in[12];
  int n_in = 0;
  View out[6];
  int n_out = 0;
  void read(const View& v) { in[n_in++] = v; }
  void write(const View& v) { out[n_out++] = v; }

  // Every view addressable, outputs one-to-one, and no output sharing an element with an input
  // or another output.
  bool valid() const {
    for (int i = 0; i < n_in; ++i)
      if (!in[i].addressable()) return false;
    for (int i = 0; i < n_out; ++i)
      if (!out[i].addressable() || !out[i].one_to_one()) return false;
    for (int i = 0; i < n_out; ++i) {
      for (int j = 0; j < n_in; ++j)
        if (flashattn::overlap(out[i], in[j])) return false;
      for (int j = i + 1; j < n_out; ++j)
        if (flashattn::overlap(out[i], out[j])) return false;
    }
    return true;
  }
};

bool packed(const flashattn_params_t& p) { return p.cu_seqlens_q != nullptr; }

// Entries on the tensors' batch axis: one when the sequences are packed along the rows.
int tensor_batch(const flashattn_params_t& p) { return packed(p) ? 1 : p.batch; }

// K or V in its rows, or in pages of a paged cache.
View kv_view(const flashattn_params_t& p, const flashattn_tensor_t& t, int elem, int d) {
  return p.page_table != nullptr ? View::of(t, elem, p.num_pages, p.page_size, p.heads_kv, d)
                                 : View::of(t, elem, tensor_batch(p), p.seqlen_k, p.heads_kv, d);
}

View lse_view(const flashattn_params_t& p) {
  if (p.lse_by_sequence) return View::packed(p.lse, 4, int64_t(p.batch) * p.heads_q * p.max_seqlen_q, 4);
  return View::packed(p.lse, 4, int64_t(tensor_batch(p)) * p.heads_q * p.seqlen_q, 4);
}

bool paged(const flashattn_params_t& p) { return p.page_table != nullptr; }

// A packed call's offsets and used-key counts (or its page table), read by the kernels.
void read_sequences(const flashattn_params_t& p, Operands& ops) {
  if (!packed(p)) return;
  ops.read(View::packed(p.cu_seqlens_q, 4, int64_t(p.batch) + 1, 4));
  if (paged(p)) {
    const int64_t rows = (int64_t(p.batch) - 1) * p.page_table_batch_stride;
    ops.read(View::packed(p.page_table, 4, rows + p.seqlen_k / p.page_size, 4));
  } else {
    ops.read(View::packed(p.cu_seqlens_k, 4, int64_t(p.batch) + 1, 4));
  }
  if (p.seqused_k != nullptr) ops.read(View::packed(p.seqused_k, 4, p.batch, 4));
}

// The sinks, one f32 per query head, where the call has them.
void read_sinks(const flashattn_params_t& p, Operands& ops) {
  if (p.sinks != nullptr) ops.read(View::packed(p.sinks, 4, p.heads_q, 4));
}

// Pack-GQA or key splits asked for: the sm90 16-bit forward's alone.
bool packs_or_splits(const flashattn_params_t& p) { return p.pack_gqa != 0 || p.num_splits > 1; }

// The 16-bit forward's operands, or the FP8 forward's (V key-major over whole key blocks).
flashattn_result_t validate_fwd(const flashattn_params_t* p) {
  if (flashattn_result_t r = validate_common(p); r.status != FLASHATTN_OK) return r;
  const int e = elem_bytes(p->dtype);
  // An e4m3 cache: paged, under 16-bit Q, with K's and V's descales alone.
  if (p->kv_cache_e4m3 != 0 &&
      (p->kv_cache_e4m3 != 1 || p->dtype == FLASHATTN_E4M3 || p->page_table == nullptr ||
       p->q_descale != nullptr))
    return kInvalid;
  const int kv_e = p->kv_cache_e4m3 ? 1 : e;
  Operands ops;
  ops.read(View::of(p->q, e, tensor_batch(*p), p->seqlen_q, p->heads_q, p->head_dim));
  ops.read(kv_view(*p, p->k, kv_e, p->head_dim));
  if (p->dtype == FLASHATTN_E4M3) {
    const int key_block = flashattn::sm90::fp8_key_block(p->head_dim);
    if (key_block <= 0) return kUnsupported;
    // Descale blocks per head (and V's key blocks): packed, every sequence's from its
    // packed_block on (common/sequences.h).
    const auto blocks = [&](int rows, int block) {
      return packed(*p) ? flashattn::packed_blocks(rows, p->batch, block)
                        : (int64_t(rows) + block - 1) / block;
    };
    const int64_t kv_blocks = blocks(p->seqlen_k, key_block);
    const int64_t q_blocks = blocks(p->seqlen_q, flashattn::sm90::kFp8QueryBlock);
    // V's keys per row are the TMA tensor's (32-bit) extent.
    if (kv_blocks * key_block > INT32_MAX) return kInvalid;
    const int batch = tensor_batch(*p);
    ops.read(View::of(p->v, 1, batch, p->head_dim, p->heads_kv, kv_blocks * key_block));
    const int64_t kv_descales = int64_t(batch) * p->heads_kv * kv_blocks;
    if (p->q_descale == nullptr || p->k_descale == nullptr || p->v_descale == nullptr)
      return kInvalid;
    ops.read(View::packed(p->q_descale, 4, int64_t(batch) * p->heads_q * q_blocks, 4));
    ops.read(View::packed(p->k_descale, 4, kv_descales, 4));
    ops.read(View::packed(p->v_descale, 4, kv_descales, 4));
    if (p->out_dtype != FLASHATTN_F16 && p->out_dtype != FLASHATTN_BF16) return kInvalid;
    if (head_dim_v(*p) != p->head_dim) return kUnsupported;
    ops.write(View::of(p->o, 2, tensor_batch(*p), p->seqlen_q, p->heads_q, p->head_dim));
  } else {
    const int dv = head_dim_v(*p);
    ops.read(kv_view(*p, p->v, kv_e, dv));
    ops.write(View::of(p->o, e, tensor_batch(*p), p->seqlen_q, p->heads_q, dv));
  }
  if (p->kv_cache_e4m3) {  // its descales
    for (const float* descale : {p->k_descale, p->v_descale})
      if (descale != nullptr)
        ops.read(View::packed(descale, 4, int64_t(p->batch) * p->heads_kv, 4));
  } else if (p->dtype != FLASHATTN_E4M3 &&
             (p->q_descale != nullptr || p->k_descale != nullptr || p->v_descale != nullptr)) {
    return kInvalid;
  }
  read_sequences(*p, ops);
  read_sinks(*p, ops);
  ops.write(lse_view(*p));
  return ops.valid() ? kOk : kInvalid;
}

// The backward's operands; the workspace's size is checked by the launchers, which carve it.
flashattn_result_t validate_bwd(const flashattn_params_t* p) {
  if (flashattn_result_t r = validate_common(p); r.status != FLASHATTN_OK) return r;
  if (p->dtype == FLASHATTN_E4M3 || p->page_table != nullptr || p->lse_by_sequence ||
      p->kv_cache_e4m3 != 0 || packs_or_splits(*p))
    return kUnsupported;
  const int e = elem_bytes(p->dtype);
  // Q-like and K-like views with head dim d: Q, dQ, K, dK take head_dim; V, dV, O, dO V's.
  const auto q_like = [&](const flashattn_tensor_t& t, int d) {
    return View::of(t, e, tensor_batch(*p), p->seqlen_q, p->heads_q, d);
  };
  const auto kv_like = [&](const flashattn_tensor_t& t, int d) {
    return View::of(t, e, tensor_batch(*p), p->seqlen_k, p->heads_kv, d);
  };
  const int d = p->head_dim, dv = head_dim_v(*p);
  Operands ops;
  ops.read(q_like(p->q, d));
  ops.read(kv_like(p->k, d));
  ops.read(kv_like(p->v, dv));
  ops.read(q_like(p->o, dv));
  ops.read(q_like(p->dout, dv));
  ops.read(lse_view(*p));
  read_sequences(*p, ops);
  read_sinks(*p, ops);
  if (p->dsinks != nullptr) {
    if (p->sinks == nullptr) return kInvalid;
    ops.write(View::packed(p->dsinks, 4, p->heads_q, 4));
  }
  ops.write(q_like(p->dq, d));
  ops.write(kv_like(p->dk, d));
  ops.write(kv_like(p->dv, dv));
  if (p->workspace_bytes <= 0) return kInvalid;
  ops.write(View::packed(p->workspace, 1, p->workspace_bytes, 16));
  return ops.valid() ? kOk : kInvalid;
}

// The FlashAttention-2 kernels put heads and batch entries on grid y and z.
bool fits_sm80_grid(const flashattn_params_t& p) { return p.batch <= 65535 && p.heads_q <= 65535; }

}  // namespace

extern "C" uint32_t flashattn_built_kernels(void) { return flashattn::kernels::built_families(); }

extern "C" flashattn_result_t flashattn_device_query(int32_t ordinal,
                                                     flashattn_device_info_t* info) {
  if (info == nullptr) return status(FLASHATTN_INVALID_ARGUMENT);
  cudaDeviceProp prop;
  FLASHATTN_TRY_CUDA(cudaGetDeviceProperties(&prop, ordinal));
  info->major = prop.major;
  info->minor = prop.minor;
  info->sm_count = prop.multiProcessorCount;
  info->max_smem_per_block_optin = static_cast<int64_t>(prop.sharedMemPerBlockOptin);
  info->l2_bytes = prop.l2CacheSize;
  info->total_mem_bytes = static_cast<int64_t>(prop.totalGlobalMem);
  std::strncpy(info->name, prop.name, sizeof(info->name) - 1);
  info->name[sizeof(info->name) - 1] = '\0';
  return flashattn::ok();
}

extern "C" const char* flashattn_cuda_error_name(int32_t code) {
  return cudaGetErrorName(static_cast<cudaError_t>(code));
}

extern "C" flashattn_result_t flashattn_fwd_sm90(const flashattn_params_t* params,
                                                 void* stream) {
  flashattn_result_t r = validate_fwd(params);
  if (r.status != FLASHATTN_OK) return r;
  const flashattn_params_t p = normalized(*params);
  flashattn::sm90::FwdOptions o;
  o.pingpong = !(p.sm90_flags & FLASHATTN_SM90_NO_PINGPONG);
  o.intra_wg_overlap = !(p.sm90_flags & FLASHATTN_SM90_NO_INTRA_WG_OVERLAP);
  auto s = static_cast<cudaStream_t>(stream);
  if (p.dtype == FLASHATTN_E4M3) {
    if (p.softcap != 0.f || packs_or_splits(p)) return kUnsupported;  // not built for FP8
    return flashattn::kernels::sm90_fp8_fwd(p, o, s);
  }
  if (p.kv_cache_e4m3) {  // built with intra-warpgroup overlap only
    if (!o.intra_wg_overlap) return kUnsupported;
    return flashattn::kernels::sm90_fwd_fp8_cache(p, o, s);
  }
  return flashattn::kernels::sm90_fwd(p, o, s);
}

extern "C" flashattn_result_t flashattn_bwd_sm90(const flashattn_params_t* params,
                                                 void* stream) {
  flashattn_result_t r = validate_bwd(params);
  if (r.status != FLASHATTN_OK) return r;
  const flashattn_params_t p = normalized(*params);
  return flashattn::kernels::sm90_bwd(p, static_cast<cudaStream_t>(stream));
}

extern "C" flashattn_result_t flashattn_fwd_sm80(const flashattn_params_t* params,
                                                 void* stream) {
  flashattn_result_t r = validate_fwd(params);
  if (r.status != FLASHATTN_OK) return r;
  if (packs_or_splits(*params)) return kUnsupported;
  if (!fits_sm80_grid(*params)) return kInvalid;
  const flashattn_params_t p = normalized(*params);
  const auto s = static_cast<cudaStream_t>(stream);
  if (p.kv_cache_e4m3) return flashattn::kernels::sm80_fwd_fp8_cache(p, s);
  return flashattn::kernels::sm80_fwd(p, s);
}

extern "C" flashattn_result_t flashattn_bwd_sm80(const flashattn_params_t* params,
                                                 void* stream) {
  flashattn_result_t r = validate_bwd(params);
  if (r.status != FLASHATTN_OK) return r;
  if (!fits_sm80_grid(*params)) return kInvalid;
  const flashattn_params_t p = normalized(*params);
  return flashattn::kernels::sm80_bwd(p, static_cast<cudaStream_t>(stream));
}

extern "C" int32_t flashattn_fp8_query_block(void) { return flashattn::sm90::kFp8QueryBlock; }

extern "C" int32_t flashattn_fp8_key_block(int32_t head_dim) {
  return flashattn::sm90::fp8_key_block(head_dim);
}

extern "C" flashattn_result_t flashattn_fp8_quantize(const flashattn_fp8_quantize_t* params,
                                                     void* stream) {
  if (params == nullptr) return kInvalid;
  const flashattn_fp8_quantize_t& p = *params;
  // One CTA per (block, head, batch entry or sequence): grid y and z are at most 65535.
  if (p.batch <= 0 || p.seqlen <= 0 || p.heads <= 0 || p.batch > 65535 || p.heads > 65535 ||
      p.seqlen > FLASHATTN_MAX_SEQLEN || p.block_rows <= 0 || p.block_rows > 4096)
    return kInvalid;
  const bool packed = p.cu_seqlens != nullptr;
  if (packed ? p.max_seqlen < 1 || p.max_seqlen > p.seqlen : p.max_seqlen != 0) return kInvalid;
  if (p.src_dtype != FLASHATTN_F16 && p.src_dtype != FLASHATTN_BF16 &&
      p.src_dtype != FLASHATTN_E4M3)
    return kInvalid;
  if (p.head_dim != 64 && p.head_dim != 96 && p.head_dim != 128 && p.head_dim != 192 &&
      p.head_dim != 256)
    return kUnsupported;
  // The Hadamard transform is defined at power-of-two lengths only.
  if (p.hadamard && (p.head_dim & (p.head_dim - 1)) != 0) return kUnsupported;
  // Blocks per head and batch entry: packed, every sequence's from its packed_block on.
  const int64_t blocks = packed ? flashattn::packed_blocks(p.seqlen, p.batch, p.block_rows)
                                : (int64_t(p.seqlen) + p.block_rows - 1) / p.block_rows;
  const int batch = packed ? 1 : p.batch;
  flashattn_tensor_t dst{p.dst, p.dst_batch_stride, p.dst_row_stride, p.dst_head_stride};
  Operands ops;
  ops.read(View::of(p.src, elem_bytes(p.src_dtype), batch, p.seqlen, p.heads, p.head_dim));
  if (packed) ops.read(View::packed(p.cu_seqlens, 4, int64_t(p.batch) + 1, 4));
  if (p.layout == FLASHATTN_FP8_ROWS) {
    ops.write(View::of(dst, 1, batch, p.seqlen, p.heads, p.head_dim));
  } else if (p.layout == FLASHATTN_FP8_KEY_MAJOR) {
    // Whole 32-key groups, and the block's quantized rows in 32 KiB of shared memory (the
    // kernel's static shared memory on top must stay within the 48 KiB it gets without opt-in).
    if (p.block_rows % 32 != 0 || int64_t(p.head_dim) * p.block_rows > 32 * 1024) return kInvalid;
    ops.write(View::of(dst, 1, batch, p.head_dim, p.heads, blocks * p.block_rows));
  } else {
    return kInvalid;
  }
  if (p.descale != nullptr)
    ops.write(View::packed(p.descale, 4, int64_t(batch) * p.heads * blocks, 4));
  if (!ops.valid()) return kInvalid;
  return flashattn::sm90::run_fp8_quantize(p, static_cast<cudaStream_t>(stream));
}

extern "C" flashattn_result_t flashattn_kvcache_append(const flashattn_kvcache_append_t* params,
                                                       void* stream) {
  if (params == nullptr) return kInvalid;
  const flashattn_kvcache_append_t& p = *params;
  if (p.dtype != FLASHATTN_F16 && p.dtype != FLASHATTN_BF16) return kInvalid;
  if (p.cache_e4m3 != 0 && p.cache_e4m3 != 1) return kInvalid;
  if (!p.cache_e4m3 && (p.k_descale != nullptr || p.v_descale != nullptr)) return kInvalid;
  if (p.batch < 1 || p.seqlen_new < 0 || p.seqlen_new > FLASHATTN_MAX_SEQLEN || p.heads_kv < 1 ||
      p.head_dim < 1 || p.head_dim > 512 || p.head_dim_v < 1 || p.head_dim_v > 512 ||
      p.entries < 1 || p.cache_rows < 1)
    return kInvalid;
  const bool paged = p.page_table != nullptr;
  if (paged ? p.max_pages < 1 : p.max_pages != 0 || p.entries < p.batch) return kInvalid;
  // Every row number and position (cached keys, at most the capacity, plus a new or query row)
  // within int32.
  const int64_t capacity = paged ? int64_t(p.max_pages) * p.cache_rows : p.cache_rows;
  const bool with_q = p.q.ptr != nullptr;
  const int64_t furthest = capacity + (with_q && p.seqlen_q > p.seqlen_new ? p.seqlen_q : p.seqlen_new);
  if (furthest > INT32_MAX) return kInvalid;
  const bool rotary = p.rotary_cos != nullptr;
  if (rotary ? p.rotary_sin == nullptr || p.rotary_dim < 2 || p.rotary_dim % 2 != 0 ||
                   p.rotary_dim > p.head_dim || p.rotary_positions < 1
             : p.rotary_sin != nullptr)
    return kInvalid;
  // Q is only rotated: without rotary embedding there is nothing to do to it.
  if (with_q && (!rotary || p.seqlen_q < 1 || p.seqlen_q > FLASHATTN_MAX_SEQLEN || p.heads_q < 1))
    return kInvalid;
  // The kernel's rows (new keys, new values, Q's) numbered in int64 without overflow.
  int64_t kv_rows = 0, q_rows = 0;
  if (__builtin_mul_overflow(int64_t(p.batch) * p.seqlen_new, int64_t(p.heads_kv), &kv_rows) ||
      (with_q &&
       __builtin_mul_overflow(int64_t(p.batch) * p.seqlen_q, int64_t(p.heads_q), &q_rows)) ||
      kv_rows > INT32_MAX || q_rows > INT32_MAX)
    return kInvalid;
  Operands ops;
  const int elem = elem_bytes(p.dtype);
  if (p.seqlen_new > 0) {
    ops.read(View::of(p.k_new, elem, p.batch, p.seqlen_new, p.heads_kv, p.head_dim));
    ops.read(View::of(p.v_new, elem, p.batch, p.seqlen_new, p.heads_kv, p.head_dim_v));
  }
  ops.read(View::packed(p.cache_seqlens, 4, p.batch, 4));
  if (paged) ops.read(View::packed(p.page_table, 4, int64_t(p.batch) * p.max_pages, 4));
  if (rotary) {
    const int64_t angles = int64_t(p.rotary_positions) * (p.rotary_dim / 2);
    ops.read(View::packed(p.rotary_cos, 4, angles, 4));
    ops.read(View::packed(p.rotary_sin, 4, angles, 4));
  }
  if (with_q) {
    ops.read(View::of(p.q, elem, p.batch, p.seqlen_q, p.heads_q, p.head_dim));
    ops.write(View::of(p.q_out, elem, p.batch, p.seqlen_q, p.heads_q, p.head_dim));
  }
  for (const float* descale : {p.k_descale, p.v_descale})
    if (descale != nullptr) ops.read(View::packed(descale, 4, int64_t(p.batch) * p.heads_kv, 4));
  const int cache_elem = p.cache_e4m3 ? 1 : elem;
  ops.write(View::of(p.k_cache, cache_elem, p.entries, p.cache_rows, p.heads_kv, p.head_dim));
  ops.write(View::of(p.v_cache, cache_elem, p.entries, p.cache_rows, p.heads_kv, p.head_dim_v));
  if (p.seqlens_out != nullptr) ops.write(View::packed(p.seqlens_out, 4, p.batch, 4));
  if (!ops.valid()) return kInvalid;
  return flashattn::run_kvcache_append(p, static_cast<cudaStream_t>(stream));
}

extern "C" flashattn_result_t flashattn_combine(const flashattn_combine_t* params, void* stream) {
  if (params == nullptr) return kInvalid;
  const flashattn_combine_t& p = *params;
  if (p.dtype != FLASHATTN_F16 && p.dtype != FLASHATTN_BF16) return kInvalid;
  if (p.parts < 1 || p.parts > FLASHATTN_MAX_COMBINE_PARTS || p.batch < 1 || p.seqlen_q < 1 ||
      p.heads < 1 || p.head_dim_v < 1 || (p.lse_packed != 0 && p.lse_packed != 1))
    return kInvalid;
  // O's elements numbered in int64, one thread each in a grid of at most 2^31 - 1 blocks of 256.
  int64_t rows = 0, elements = 0;
  if (__builtin_mul_overflow(int64_t(p.batch) * p.seqlen_q, int64_t(p.heads), &rows) ||
      __builtin_mul_overflow(rows, int64_t(p.head_dim_v), &elements) ||
      elements > int64_t(INT32_MAX) * 256)
    return kInvalid;
  const View o = View::of(p.o, 2, p.batch, p.seqlen_q, p.heads, p.head_dim_v);
  const View lse = View::packed(p.lse, 4, rows, 4);
  if (!o.addressable() || !o.one_to_one() || !lse.addressable() || flashattn::overlap(o, lse))
    return kInvalid;
  for (int k = 0; k < p.parts; ++k) {
    const View in[2] = {View::of(p.part_o[k], 2, p.batch, p.seqlen_q, p.heads, p.head_dim_v),
                        View::packed(p.part_lse[k], 4, rows, 4)};
    for (const View& v : in)
      if (!v.addressable() || flashattn::overlap(v, o) || flashattn::overlap(v, lse))
        return kInvalid;
  }
  return flashattn::run_combine(p, static_cast<cudaStream_t>(stream));
}

namespace {

// The rows' sizes, and x and acc as inputs and outputs: `acc` written (add) or x (round).
bool valid_rows(const flashattn_rows_t& p, bool acc_written) {
  if (p.dtype != FLASHATTN_F16 && p.dtype != FLASHATTN_BF16) return false;
  if (p.batch < 1 || p.seqlen < 1 || p.heads < 1 || p.head_dim < 1 || p.head_dim > 4096)
    return false;
  const View x = View::of(p.x, elem_bytes(p.dtype), p.batch, p.seqlen, p.heads, p.head_dim);
  const View acc = View::of(p.acc, 4, p.batch, p.seqlen, p.heads, p.head_dim);
  Operands ops;
  ops.read(acc_written ? x : acc);
  ops.write(acc_written ? acc : x);
  return ops.valid();
}

}  // namespace

extern "C" flashattn_result_t flashattn_rows_add(const flashattn_rows_t* params, void* stream) {
  if (params == nullptr || !valid_rows(*params, true)) return kInvalid;
  return flashattn::run_rows_add(*params, static_cast<cudaStream_t>(stream));
}

extern "C" flashattn_result_t flashattn_rows_round(const flashattn_rows_t* params, void* stream) {
  if (params == nullptr || !valid_rows(*params, false)) return kInvalid;
  return flashattn::run_rows_round(*params, static_cast<cudaStream_t>(stream));
}

extern "C" flashattn_result_t flashattn_fp8_sanitize_descales(const float* src, float* dst,
                                                              int64_t count, void* stream) {
  if (count <= 0) return kInvalid;
  const View in = View::packed(src, 4, count, 4), out = View::packed(dst, 4, count, 4);
  // In place, or into a separate buffer.
  if (!in.addressable() || !out.addressable() || (src != dst && flashattn::overlap(in, out)))
    return kInvalid;
  return flashattn::sm90::run_fp8_sanitize_descales(src, dst, count,
                                                    static_cast<cudaStream_t>(stream));
}
