//! The bindgen output for csrc/flash_api.h, and the conversion of its results into [`Error`].
#![allow(
    non_camel_case_types,
    non_upper_case_globals,
    non_snake_case,
    dead_code
)]

include!(concat!(env!("OUT_DIR"), "/bindings.rs"));

use crate::dispatch::BuiltKernels;
use crate::error::Error;

/// Turns a C ABI result into `Ok(())` or a typed error naming `backend`.
pub(crate) fn check(r: flashattn_result_t, backend: &'static str, what: &str) -> crate::Result<()> {
    match r.status as u32 {
        x if x == FLASHATTN_OK => Ok(()),
        x if x == FLASHATTN_UNSUPPORTED => Err(Error::Unsupported {
            what: what.to_string(),
            backend,
        }),
        x if x == FLASHATTN_CUDA_ERROR => Err(cuda_error(r.cuda_error)),
        _ => Err(Error::InvalidConfig(format!(
            "{backend} refused {what}: invalid argument (status {})",
            r.status
        ))),
    }
}

pub(crate) fn cuda_error(code: i32) -> Error {
    // SAFETY: returns a pointer to a static string owned by the CUDA runtime (or null).
    let name = unsafe {
        let p = flashattn_cuda_error_name(code);
        if p.is_null() {
            "unknown".to_string()
        } else {
            std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    };
    Error::Cuda { code, name }
}

pub(crate) fn built_kernels() -> BuiltKernels {
    // SAFETY: a pure function of the compiled library.
    let bits = unsafe { flashattn_built_kernels() };
    BuiltKernels {
        sm90_fwd: bits & FLASHATTN_KERNEL_SM90_FWD != 0,
        sm90_bwd: bits & FLASHATTN_KERNEL_SM90_BWD != 0,
        sm80_fwd: bits & FLASHATTN_KERNEL_SM80_FWD != 0,
        sm80_bwd: bits & FLASHATTN_KERNEL_SM80_BWD != 0,
        sm90_fp8_fwd: bits & FLASHATTN_KERNEL_SM90_FP8_FWD != 0,
    }
}
