// Entry points of the C ABI: validate the parameters, pick the instantiation by arch, dtype and
// head dim, launch on the caller's stream. The Rust side validates first; these checks are the
// second line so that a wrong call from C is refused rather than faulting.
#include <cuda_runtime.h>

#include <cstring>

#include "common/status.h"
#include "flash_api.h"
#include "sm80/bwd_instantiations.h"
#include "sm80/fwd_instantiations.h"
#include "sm90/bwd_instantiations.h"
#include "sm90/fp8_layout.h"
#include "sm90/fwd_instantiations.h"

namespace {

using flashattn::status;

bool valid_tensor(const flashattn_tensor_t& t) { return t.ptr != nullptr; }

// Checks every launcher shares: sizes, GQA ratio, element type, head dim.
flashattn_result_t validate_common(const flashattn_params_t* p) {
  if (p == nullptr) return status(FLASHATTN_INVALID_ARGUMENT);
  if (p->batch <= 0 || p->seqlen_q <= 0 || p->seqlen_k <= 0 || p->heads_q <= 0 ||
      p->heads_kv <= 0 || p->head_dim <= 0)
    return status(FLASHATTN_INVALID_ARGUMENT);
  if (p->heads_q % p->heads_kv != 0) return status(FLASHATTN_INVALID_ARGUMENT);
  if (!(p->softmax_scale > 0.f)) return status(FLASHATTN_INVALID_ARGUMENT);
  if (p->dtype != FLASHATTN_F16 && p->dtype != FLASHATTN_BF16 && p->dtype != FLASHATTN_E4M3)
    return status(FLASHATTN_UNSUPPORTED);
  if (p->head_dim != 64 && p->head_dim != 128 && p->head_dim != 256)
    return status(FLASHATTN_UNSUPPORTED);
  return flashattn::ok();
}

flashattn_result_t validate_fwd(const flashattn_params_t* p) {
  flashattn_result_t r = validate_common(p);
  if (r.status != FLASHATTN_OK) return r;
  if (!valid_tensor(p->q) || !valid_tensor(p->k) || !valid_tensor(p->v) || !valid_tensor(p->o) ||
      p->lse == nullptr)
    return status(FLASHATTN_INVALID_ARGUMENT);
  return flashattn::ok();
}

// FP8 forward: descales, an output type, and no softcap (not built).
flashattn_result_t validate_fp8(const flashattn_params_t& p) {
  if (p.q_descale == nullptr || p.k_descale == nullptr || p.v_descale == nullptr)
    return status(FLASHATTN_INVALID_ARGUMENT);
  if (p.out_dtype != FLASHATTN_F16 && p.out_dtype != FLASHATTN_BF16)
    return status(FLASHATTN_INVALID_ARGUMENT);
  if (p.softcap != 0.f) return status(FLASHATTN_UNSUPPORTED);
  return flashattn::ok();
}

flashattn_result_t validate_bwd(const flashattn_params_t* p) {
  flashattn_result_t r = validate_fwd(p);
  if (r.status != FLASHATTN_OK) return r;
  if (p->dtype == FLASHATTN_E4M3) return status(FLASHATTN_UNSUPPORTED);
  if (!valid_tensor(p->dout) || !valid_tensor(p->dq) || !valid_tensor(p->dk) ||
      !valid_tensor(p->dv))
    return status(FLASHATTN_INVALID_ARGUMENT);
  return flashattn::ok();
}

}  // namespace

extern "C" uint32_t flashattn_built_kernels(void) {
  // Kernel families land here as they are written (csrc/sm90, csrc/sm80).
  return FLASHATTN_KERNEL_SM90_SELFTEST | FLASHATTN_KERNEL_SM90_FWD | FLASHATTN_KERNEL_SM90_BWD |
         FLASHATTN_KERNEL_SM80_FWD | FLASHATTN_KERNEL_SM80_BWD | FLASHATTN_KERNEL_SM90_FP8_FWD;
}

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
  const flashattn_params_t& p = *params;
  if (p.softcap < 0.f) return status(FLASHATTN_INVALID_ARGUMENT);
  flashattn::sm90::FwdOptions o;
  o.pingpong = !(p.sm90_flags & FLASHATTN_SM90_NO_PINGPONG);
  o.intra_wg_overlap = !(p.sm90_flags & FLASHATTN_SM90_NO_INTRA_WG_OVERLAP);
  const bool bf16 = p.dtype == FLASHATTN_BF16;
  // The variant without intra-warpgroup overlap exists for d128 bf16 only (ablation).
  if (!o.intra_wg_overlap && !(bf16 && p.head_dim == 128)) return status(FLASHATTN_UNSUPPORTED);
  auto s = static_cast<cudaStream_t>(stream);
  using namespace flashattn::sm90;
  if (p.dtype == FLASHATTN_E4M3) {
    if (flashattn_result_t v = validate_fp8(p); v.status != FLASHATTN_OK) return v;
    switch (p.head_dim) {
      case 64: return run_fwd_fp8_d64(p, o, s);
      case 128: return run_fwd_fp8_d128(p, o, s);
      case 256: return run_fwd_fp8_d256(p, o, s);
      default: return status(FLASHATTN_UNSUPPORTED);
    }
  }
  switch (p.head_dim) {
    case 64: return bf16 ? run_fwd_d64_bf16(p, o, s) : run_fwd_d64_fp16(p, o, s);
    case 128: return bf16 ? run_fwd_d128_bf16(p, o, s) : run_fwd_d128_fp16(p, o, s);
    case 256: return bf16 ? run_fwd_d256_bf16(p, o, s) : run_fwd_d256_fp16(p, o, s);
    default: return status(FLASHATTN_UNSUPPORTED);
  }
}

extern "C" flashattn_result_t flashattn_bwd_sm90(const flashattn_params_t* params,
                                                 void* stream) {
  flashattn_result_t r = validate_bwd(params);
  if (r.status != FLASHATTN_OK) return r;
  const flashattn_params_t& p = *params;
  if (p.softcap < 0.f) return status(FLASHATTN_INVALID_ARGUMENT);
  // Softcap is not built for sm90: the dispatcher sends those calls to the sm80 backward.
  if (p.softcap > 0.f) return status(FLASHATTN_UNSUPPORTED);
  const bool bf16 = p.dtype == FLASHATTN_BF16;
  auto s = static_cast<cudaStream_t>(stream);
  using namespace flashattn::sm90;
  switch (p.head_dim) {
    case 64: return bf16 ? run_bwd_d64_bf16(p, s) : run_bwd_d64_fp16(p, s);
    case 128: return bf16 ? run_bwd_d128_bf16(p, s) : run_bwd_d128_fp16(p, s);
    case 256: return bf16 ? run_bwd_d256_bf16(p, s) : run_bwd_d256_fp16(p, s);
    default: return status(FLASHATTN_UNSUPPORTED);
  }
}

extern "C" flashattn_result_t flashattn_fwd_sm80(const flashattn_params_t* params,
                                                 void* stream) {
  flashattn_result_t r = validate_fwd(params);
  if (r.status != FLASHATTN_OK) return r;
  const flashattn_params_t& p = *params;
  if (p.softcap < 0.f) return status(FLASHATTN_INVALID_ARGUMENT);
  if (p.dtype == FLASHATTN_E4M3) return status(FLASHATTN_UNSUPPORTED);  // FP8 is sm90 only
  const bool bf16 = p.dtype == FLASHATTN_BF16;
  auto s = static_cast<cudaStream_t>(stream);
  using namespace flashattn::sm80;
  switch (p.head_dim) {
    case 64: return bf16 ? run_fwd_d64_bf16(p, s) : run_fwd_d64_fp16(p, s);
    case 128: return bf16 ? run_fwd_d128_bf16(p, s) : run_fwd_d128_fp16(p, s);
    case 256: return bf16 ? run_fwd_d256_bf16(p, s) : run_fwd_d256_fp16(p, s);
    default: return status(FLASHATTN_UNSUPPORTED);
  }
}

extern "C" flashattn_result_t flashattn_bwd_sm80(const flashattn_params_t* params,
                                                 void* stream) {
  flashattn_result_t r = validate_bwd(params);
  if (r.status != FLASHATTN_OK) return r;
  const flashattn_params_t& p = *params;
  if (p.softcap < 0.f) return status(FLASHATTN_INVALID_ARGUMENT);
  const bool bf16 = p.dtype == FLASHATTN_BF16;
  auto s = static_cast<cudaStream_t>(stream);
  using namespace flashattn::sm80;
  switch (p.head_dim) {
    case 64: return bf16 ? run_bwd_d64_bf16(p, s) : run_bwd_d64_fp16(p, s);
    case 128: return bf16 ? run_bwd_d128_bf16(p, s) : run_bwd_d128_fp16(p, s);
    case 256: return bf16 ? run_bwd_d256_bf16(p, s) : run_bwd_d256_fp16(p, s);
    default: return status(FLASHATTN_UNSUPPORTED);
  }
}

extern "C" int32_t flashattn_fp8_query_block(void) { return flashattn::sm90::kFp8QueryBlock; }

extern "C" int32_t flashattn_fp8_key_block(int32_t head_dim) {
  return flashattn::sm90::fp8_key_block(head_dim);
}

extern "C" flashattn_result_t flashattn_fp8_quantize(const flashattn_fp8_quantize_t* params,
                                                     void* stream) {
  if (params == nullptr) return status(FLASHATTN_INVALID_ARGUMENT);
  const flashattn_fp8_quantize_t& p = *params;
  if (p.src.ptr == nullptr || p.dst == nullptr || p.batch <= 0 || p.seqlen <= 0 ||
      p.heads <= 0 || p.block_rows <= 0 || p.batch > 65535 || p.heads > 65535)
    return status(FLASHATTN_INVALID_ARGUMENT);
  if (p.head_dim != 64 && p.head_dim != 128 && p.head_dim != 256)
    return status(FLASHATTN_UNSUPPORTED);
  if (p.layout == FLASHATTN_FP8_KEY_MAJOR) {
    // Whole 32-key groups, and the block's quantized rows in 32 KiB of shared memory (the
    // kernel's static shared memory on top must stay within the 48 KiB it gets without opt-in).
    if (p.block_rows % 32 != 0 || p.head_dim * p.block_rows > 32 * 1024)
      return status(FLASHATTN_INVALID_ARGUMENT);
  } else if (p.layout != FLASHATTN_FP8_ROWS) {
    return status(FLASHATTN_INVALID_ARGUMENT);
  }
  return flashattn::sm90::run_fp8_quantize(p, static_cast<cudaStream_t>(stream));
}
