//! The bindgen output for csrc/flash_api.h, and the conversion of its results into [`Error`].
#![allow(
    non_camel_case_types,
    non_upper_case_globals,
    non_snake_case,
    dead_code
)]

include!(concat!(env!("OUT_DIR"), "/bindings.rs"));

use crate::config::Backend;
use crate::error::Error;

/// Turns the C ABI's result of a call into `backend`'s kernels or helpers into `Ok(())` or a
/// typed error naming it.
pub(crate) fn check(r: flashattn_result_t, backend: Backend, what: &str) -> crate::Result<()> {
    if r.status as u32 == FLASHATTN_UNSUPPORTED {
        return Err(Error::Unsupported {
            what: what.to_string(),
            backend,
        });
    }
    check_status(r, &format!("{backend} {what}"))
}

/// [`check`] for a call of no backend's (the device query), which answers no "unsupported".
pub(crate) fn check_status(r: flashattn_result_t, what: &str) -> crate::Result<()> {
    match r.status as u32 {
        x if x == FLASHATTN_OK => Ok(()),
        x if x == FLASHATTN_CUDA_ERROR => Err(cuda_error(r.cuda_error)),
        _ => Err(Error::InvalidConfig(format!(
            "{what} refused: invalid argument (status {})",
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

#[cfg(test)]
mod tests {
    use crate::registry::{Family, KERNELS};

    /// The C library's families (generated from the registry by build.rs) are the ones the
    /// registry says this build holds.
    #[test]
    fn the_c_library_holds_what_the_registry_says() {
        // SAFETY: a pure function of the compiled library.
        let bits = unsafe { super::flashattn_built_kernels() };
        for (family, bit) in [
            (Family::Sm90Fwd, super::FLASHATTN_KERNEL_SM90_FWD),
            (Family::Sm90Fp8Fwd, super::FLASHATTN_KERNEL_SM90_FP8_FWD),
            (
                Family::Sm90Fp8CacheFwd,
                super::FLASHATTN_KERNEL_SM90_FP8_CACHE_FWD,
            ),
            (Family::Sm90Bwd, super::FLASHATTN_KERNEL_SM90_BWD),
            (Family::Sm80Fwd, super::FLASHATTN_KERNEL_SM80_FWD),
            (Family::Sm80Bwd, super::FLASHATTN_KERNEL_SM80_BWD),
            (
                Family::Sm80Fp8CacheFwd,
                super::FLASHATTN_KERNEL_SM80_FP8_CACHE_FWD,
            ),
        ] {
            let built = KERNELS.iter().any(|k| k.family == family && k.built());
            assert_eq!(bits & bit != 0, built, "{family:?}");
        }
        let selftest = bits & super::FLASHATTN_KERNEL_SM90_SELFTEST != 0;
        assert_eq!(selftest, cfg!(feature = "selftest"), "the self-test kernel");
    }
}
