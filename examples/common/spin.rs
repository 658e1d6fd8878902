//! A one-thread kernel that holds the stream for a given time: what `torch.cuda._sleep` does
//! before the peers' timed loops (benchmarks/peers_common.py's `head_ms`). The GPU stays nearly
//! idle meanwhile, so a cold measurement of ours starts from the same rest as the peers', and the
//! host queues the timed calls behind it.

use std::ffi::{c_void, CString};
use std::sync::{Arc, OnceLock};

use cudarc::driver::{result, sys};
use flashattn::cuda::CudaStream;

/// Spins until `ns` nanoseconds of the global timer have passed since it started.
const SPIN_PTX: &str = "
.version 7.0
.target sm_80
.address_size 64
.visible .entry flashattn_bench_spin(.param .u64 ns)
{
  .reg .u64 %start, %now, %passed, %limit;
  .reg .pred %more;
  ld.param.u64 %limit, [ns];
  mov.u64 %start, %globaltimer;
WAIT:
  mov.u64 %now, %globaltimer;
  sub.u64 %passed, %now, %start;
  setp.lt.u64 %more, %passed, %limit;
  @%more bra WAIT;
  ret;
}
";

/// The loaded kernel and the context it was loaded in (the examples use one device).
struct Spin {
    context: sys::CUcontext,
    function: sys::CUfunction,
}

// The handles are the driver's, valid from any thread of the process.
unsafe impl Send for Spin {}
unsafe impl Sync for Spin {}

static SPIN: OnceLock<Spin> = OnceLock::new();

/// Queues `ms` milliseconds of the spin kernel on `stream`.
pub fn hold(stream: &Arc<CudaStream>, ms: f64) {
    let context = stream.context();
    context.bind_to_thread().unwrap();
    let spin = SPIN.get_or_init(|| {
        let src = CString::new(SPIN_PTX).unwrap();
        // SAFETY: the context is bound to this thread; the image is a NUL-terminated PTX text.
        let module = unsafe { result::module::load_data(src.as_ptr() as *const c_void) }.unwrap();
        let name = CString::new("flashattn_bench_spin").unwrap();
        // SAFETY: the module was just loaded and holds that entry.
        let function = unsafe { result::module::get_function(module, name) }.unwrap();
        Spin {
            context: context.cu_ctx(),
            function,
        }
    });
    assert_eq!(
        spin.context,
        context.cu_ctx(),
        "the spin kernel serves one context"
    );
    let mut ns: u64 = (ms.max(0.0) * 1e6) as u64;
    let mut params = [&mut ns as *mut u64 as *mut c_void];
    // SAFETY: one u64 parameter, as the entry declares; the stream belongs to the context.
    unsafe {
        result::launch_kernel(
            spin.function,
            (1, 1, 1),
            (1, 1, 1),
            0,
            stream.cu_stream(),
            &mut params,
        )
    }
    .unwrap();
}
