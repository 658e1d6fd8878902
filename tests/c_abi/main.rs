//! The C ABI (csrc/flash_api.h) driven directly with bad parameters: null pointers, negative
//! or misaligned strides, overflowing sizes, overlapping outputs, fields of paths not built.
//! Every call must come back with a status, before any launch, so these run on a machine
//! without a GPU (no pointer here is ever dereferenced: every call is refused by the checks,
//! and a call that is not would fail the test). Also compiles csrc's host-side tile order and
//! operand checks with the system's C++ compiler and runs their own exhaustive tests.
#![cfg(feature = "cuda")]
#![allow(
    non_camel_case_types,
    non_upper_case_globals,
    non_snake_case,
    dead_code,
    clippy::all
)]

// The library's objects are linked through the crate.
extern crate flashattn;

mod ffi {
    include!(concat!(env!("OUT_DIR"), "/bindings.rs"));
}

mod bad_params;
mod combine;
mod fp8;
mod kvcache_append;
mod kvcache_fp8;
mod rows;

use ffi::*;
use std::ffi::c_void;
use std::ptr::null_mut;

const INVALID: i32 = FLASHATTN_INVALID_ARGUMENT as i32;
const UNSUPPORTED: i32 = FLASHATTN_UNSUPPORTED as i32;

/// Distinct, 256-byte aligned addresses far apart: never dereferenced.
fn addr(slot: usize) -> *mut c_void {
    ((slot + 1) << 40) as *mut c_void
}

fn packed(ptr: *mut c_void, s: i64, h: i64, d: i64) -> flashattn_tensor_t {
    flashattn_tensor_t {
        ptr,
        batch_stride: s * h * d,
        row_stride: h * d,
        head_stride: d,
    }
}

/// A bf16 forward and backward of (2, 256, 4, 64) over separate buffers: valid but for what
/// each test breaks.
fn params() -> flashattn_params_t {
    let (b, s, h, d) = (2, 256, 4, 64);
    let t = |slot| packed(addr(slot), s, h, d);
    flashattn_params_t {
        q: t(0),
        k: t(1),
        v: t(2),
        o: t(3),
        lse: addr(4) as *mut f32,
        dout: t(5),
        dq: t(6),
        dk: t(7),
        dv: t(8),
        workspace: addr(9),
        workspace_bytes: 1 << 30,
        batch: b as i32,
        seqlen_q: s as i32,
        seqlen_k: s as i32,
        heads_q: h as i32,
        heads_kv: h as i32,
        head_dim: d as i32,
        head_dim_v: 0,
        dtype: FLASHATTN_BF16 as i32,
        softmax_scale: 0.125,
        softcap: 0.0,
        causal: 1,
        window_left: -1,
        window_right: -1,
        deterministic: 0,
        sinks: std::ptr::null(),
        dsinks: null_mut(),
        cu_seqlens_q: std::ptr::null(),
        cu_seqlens_k: std::ptr::null(),
        seqused_k: std::ptr::null(),
        max_seqlen_q: 0,
        max_seqlen_k: 0,
        page_table: std::ptr::null(),
        page_table_batch_stride: 0,
        page_size: 0,
        q_descale: std::ptr::null(),
        k_descale: std::ptr::null(),
        v_descale: std::ptr::null(),
        out_dtype: 0,
        sm_count: 132,
        sm90_flags: 0,
        num_pages: 0,
        lse_by_sequence: 0,
        pack_gqa: 0,
        num_splits: 0,
        kv_cache_e4m3: 0,
    }
}

/// A bf16 packed batch of 3 sequences in 512 query and 384 key rows (Q, K, V, O of one batch
/// entry), valid but for what each test breaks.
fn packed_params() -> flashattn_params_t {
    let mut p = params();
    let (h, d) = (4, 64);
    for t in [&mut p.q, &mut p.o, &mut p.dout, &mut p.dq] {
        *t = packed(t.ptr, 512, h, d);
    }
    for t in [&mut p.k, &mut p.v, &mut p.dk, &mut p.dv] {
        *t = packed(t.ptr, 384, h, d);
    }
    (p.batch, p.seqlen_q, p.seqlen_k) = (3, 512, 384);
    p.cu_seqlens_q = addr(20) as *const i32;
    p.cu_seqlens_k = addr(21) as *const i32;
    (p.max_seqlen_q, p.max_seqlen_k) = (300, 200);
    p
}

/// The packed batch's queries over a paged KV cache: 4 pages of 128 keys, 3 per sequence (384
/// keys each), every sequence's used keys given; valid for the sm90 forward but for what each
/// test breaks.
fn paged_params() -> flashattn_params_t {
    let mut p = packed_params();
    for t in [&mut p.k, &mut p.v] {
        *t = packed(t.ptr, 128, 4, 64);
    }
    p.cu_seqlens_k = std::ptr::null();
    p.seqused_k = addr(23) as *const i32;
    p.page_table = addr(22) as *const i32;
    (p.page_table_batch_stride, p.page_size, p.num_pages) = (3, 128, 4);
    (p.seqlen_k, p.max_seqlen_k) = (384, 384);
    p
}

type Entry = unsafe extern "C" fn(*const flashattn_params_t, *mut c_void) -> flashattn_result_t;

const FORWARDS: [(&str, Entry); 2] = [
    ("fwd_sm90", flashattn_fwd_sm90),
    ("fwd_sm80", flashattn_fwd_sm80),
];
const BACKWARDS: [(&str, Entry); 2] = [
    ("bwd_sm90", flashattn_bwd_sm90),
    ("bwd_sm80", flashattn_bwd_sm80),
];

/// Calls `entry` with `p` and checks the status.
fn expect(name: &str, entry: Entry, p: &flashattn_params_t, status: i32, why: &str) {
    // SAFETY: `p` lives across the call; the entry point refuses it before using a pointer.
    let r = unsafe { entry(p, null_mut()) };
    assert_eq!(
        (r.status, r.cuda_error),
        (status, 0),
        "{name}: {why}: status {} (cuda error {})",
        r.status,
        r.cuda_error
    );
}

/// An entry point of its own parameter struct `P` (the merge, the KV-cache append): `base()`
/// passes every check (without a driver its launch is what fails; with one it would launch on
/// these unreal addresses, so that is left to machines without a GPU), null parameters are
/// refused, and so is `base()` after each edit of `cases`, before any launch.
fn refused_edits<P>(
    name: &str,
    entry: unsafe extern "C" fn(*const P, *mut c_void) -> flashattn_result_t,
    base: fn() -> P,
    cases: &[(&str, fn(&mut P))],
) {
    if !flashattn::cuda::driver_present() {
        // SAFETY: the launch fails for want of a driver before any pointer is used.
        let r = unsafe { entry(&base(), null_mut()) };
        assert_eq!(
            r.status, FLASHATTN_CUDA_ERROR as i32,
            "{name}: base parameters refused"
        );
    }
    // SAFETY (every call below): the params outlive the call; each is refused before launch.
    let r = unsafe { entry(std::ptr::null(), null_mut()) };
    assert_eq!(r.status, INVALID, "{name}: null params");
    for (what, edit) in cases {
        let mut p = base();
        edit(&mut p);
        let r = unsafe { entry(&p, null_mut()) };
        assert_eq!((r.status, r.cuda_error), (INVALID, 0), "{name}: {what}");
    }
}

/// Every forward and backward entry point refuses `p` with `status`.
fn refused_everywhere(p: &flashattn_params_t, status: i32, why: &str) {
    for (name, entry) in FORWARDS.iter().chain(&BACKWARDS) {
        expect(name, *entry, p, status, why);
    }
}

/// The base parameters, dense and packed, pass every check: where no driver can be loaded, the FlashAttention-2
/// entry points (whose first CUDA call is a plain runtime query) get as far as that call and
/// report its error, or, in a build without those kernels, as far as the dispatch, which says
/// unsupported. (With a GPU present this would launch on these unreal addresses, so it is left
/// to the machines without one, such as CI's.)
#[test]
fn the_base_parameters_are_valid() {
    use flashattn::registry::{find, Family, KernelDtype};
    if flashattn::cuda::driver_present() {
        return;
    }
    for (what, p) in [("dense", params()), ("packed", packed_params())] {
        for (family, entry) in [
            (Family::Sm80Fwd, flashattn_fwd_sm80 as Entry),
            (Family::Sm80Bwd, flashattn_bwd_sm80),
        ] {
            let built = find(family, 64, 64, KernelDtype::Bf16).unwrap().built();
            let want = if built {
                FLASHATTN_CUDA_ERROR
            } else {
                FLASHATTN_UNSUPPORTED
            };
            // SAFETY: refused at the first CUDA call, or by the dispatch, before any pointer
            // is used.
            let r = unsafe { entry(&p, null_mut()) };
            assert_eq!(
                r.status, want as i32,
                "{family:?}: {what} base parameters refused"
            );
        }
    }
}

#[test]
fn the_rust_limits_are_the_c_limits() {
    assert_eq!(
        flashattn::tensor::MAX_GPU_SEQLEN,
        FLASHATTN_MAX_SEQLEN as usize
    );
}

/// Compiles one of tests/host/*.cpp against csrc with the system's C++ compiler and runs it.
fn run_host_test(name: &str) {
    let root = env!("CARGO_MANIFEST_DIR");
    let exe = std::env::temp_dir().join(format!("flashattn-host-{name}-{}", std::process::id()));
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let out = std::process::Command::new(&cxx)
        .args(["-std=c++17", "-O2", "-w"])
        .arg(format!("-I{root}/csrc"))
        .arg(format!("-I{}", env!("FLASHATTN_CUDA_INCLUDE")))
        .arg(format!("{root}/tests/host/{name}.cpp"))
        .arg("-o")
        .arg(&exe)
        .output()
        .unwrap_or_else(|e| panic!("running {cxx}: {e}"));
    assert!(
        out.status.success(),
        "{name}.cpp did not compile:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let run = std::process::Command::new(&exe).output().unwrap();
    let _ = std::fs::remove_file(&exe);
    println!("{}", String::from_utf8_lossy(&run.stdout));
    assert!(
        run.status.success(),
        "{name}: {}",
        String::from_utf8_lossy(&run.stdout)
    );
}

#[test]
fn tile_order_maps_every_cta_to_its_own_work_item() {
    run_host_test("tile_order");
}

#[test]
fn operand_checks_tell_interleaved_from_overlapping_views() {
    run_host_test("views");
}
