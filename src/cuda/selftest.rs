//! The toolchain's self-test: one TMA load and one WGMMA on sm_90a, checked against the CPU.
//! Research apparatus, reached through [`crate::unstable`].

use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};

use super::{driver_error, Device};
use crate::config::Backend;
use crate::error::{CallPart, Error, Result};
use crate::ffi;

/// Result of the toolchain self-test.
#[derive(Clone, Debug)]
pub struct SelfTestReport {
    /// Largest |gpu − cpu| over the 64×64 product.
    pub max_abs_err: f32,
    /// Largest |cpu| (for scale).
    pub max_abs_ref: f32,
    /// Elements still holding the poison value after the kernel.
    pub unwritten: usize,
}

impl SelfTestReport {
    pub fn passed(&self) -> bool {
        self.unwritten == 0 && self.max_abs_err <= 1e-4 * self.max_abs_ref.max(1.0)
    }
}

/// Runs the sm_90a TMA + WGMMA self-test kernel on `stream` and checks it against the CPU:
/// A (64×16) and B (64×16) bf16 from a seeded generator, C = A·Bᵀ in f32.
pub fn selftest_tma_wgmma(device: &Device, stream: &Arc<CudaStream>) -> Result<SelfTestReport> {
    const M: usize = 64;
    const N: usize = 64;
    const K: usize = 16;
    if device.info().compute_capability() != (9, 0) {
        return Err(Error::BackendUnavailable {
            backend: Backend::Sm90,
            reason: format!(
                "device {} is not compute capability 9.0",
                device.info().name
            ),
        });
    }
    // A small deterministic generator: values are exact in bf16 and products exact in f32.
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        ((state >> 40) % 17) as f32 / 4.0 - 2.0
    };
    let a: Vec<half::bf16> = (0..M * K).map(|_| half::bf16::from_f32(next())).collect();
    let b: Vec<half::bf16> = (0..N * K).map(|_| half::bf16::from_f32(next())).collect();
    let poison = f32::NAN;

    device.check_same_context(stream, std::iter::empty::<(CallPart, _)>())?;
    let err = driver_error;
    let a_dev = stream.clone_htod(&a).map_err(err)?;
    let b_dev = stream.clone_htod(&b).map_err(err)?;
    let mut c_dev = stream.clone_htod(&vec![poison; M * N]).map_err(err)?;
    {
        let (a_ptr, _ga) = a_dev.device_ptr(stream);
        let (b_ptr, _gb) = b_dev.device_ptr(stream);
        let (c_ptr, _gc) = c_dev.device_ptr_mut(stream);
        device.context().bind_to_thread().map_err(err)?;
        // SAFETY: the three buffers are live device allocations of the sizes the kernel reads
        // and writes; their guards outlive the launch.
        let r = unsafe {
            ffi::flashattn_selftest_tma_wgmma(
                a_ptr as *const std::ffi::c_void,
                b_ptr as *const std::ffi::c_void,
                c_ptr as *mut f32,
                stream.cu_stream() as *mut std::ffi::c_void,
            )
        };
        ffi::check(r, Backend::Sm90, "TMA + WGMMA self-test")?;
    }
    let c = stream.clone_dtoh(&c_dev).map_err(err)?;
    stream.synchronize().map_err(err)?;

    let mut report = SelfTestReport {
        max_abs_err: 0.0,
        max_abs_ref: 0.0,
        unwritten: 0,
    };
    for i in 0..M {
        for j in 0..N {
            let want: f32 = (0..K)
                .map(|kk| a[i * K + kk].to_f32() * b[j * K + kk].to_f32())
                .sum();
            let got = c[i * N + j];
            if got.is_nan() {
                report.unwritten += 1;
                continue;
            }
            report.max_abs_err = report.max_abs_err.max((got - want).abs());
            report.max_abs_ref = report.max_abs_ref.max(want.abs());
        }
    }
    Ok(report)
}
