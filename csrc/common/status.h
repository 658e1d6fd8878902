// Turning CUDA runtime errors into flashattn_result_t values. Every CUDA call and every launch
// in the library goes through one of these; nothing exits or prints.
#pragma once

#include <cuda_runtime.h>

#include "../flash_api.h"

namespace flashattn {

inline flashattn_result_t ok() { return {FLASHATTN_OK, 0}; }
inline flashattn_result_t status(flashattn_status_t s) { return {s, 0}; }
inline flashattn_result_t cuda_status(cudaError_t e) {
  return e == cudaSuccess ? ok() : flashattn_result_t{FLASHATTN_CUDA_ERROR, static_cast<int32_t>(e)};
}

// The launch's own error (bad configuration) or an earlier asynchronous one.
inline flashattn_result_t check_launch() { return cuda_status(cudaGetLastError()); }

}  // namespace flashattn

// A failing runtime call also sets the thread's last error; it is cleared here, so that the next
// call's check_launch() does not report it a second time.
#define FLASHATTN_TRY_CUDA(expr)                          \
  do {                                                    \
    cudaError_t flashattn_err_ = (expr);                  \
    if (flashattn_err_ != cudaSuccess) {                  \
      (void)cudaGetLastError();                           \
      return ::flashattn::cuda_status(flashattn_err_);    \
    }                                                     \
  } while (0)
