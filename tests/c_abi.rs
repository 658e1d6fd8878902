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
        dtype: FLASHATTN_BF16 as i32,
        softmax_scale: 0.125,
        softcap: 0.0,
        causal: 1,
        window_left: -1,
        window_right: -1,
        deterministic: 0,
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

/// Every forward and backward entry point refuses `p` with `status`.
fn refused_everywhere(p: &flashattn_params_t, status: i32, why: &str) {
    for (name, entry) in FORWARDS.iter().chain(&BACKWARDS) {
        expect(name, *entry, p, status, why);
    }
}

/// The base parameters pass every check: where no driver can be loaded, the FlashAttention-2
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
    let p = params();
    for (family, entry) in [
        (Family::Sm80Fwd, flashattn_fwd_sm80 as Entry),
        (Family::Sm80Bwd, flashattn_bwd_sm80),
    ] {
        let built = find(family, 64, KernelDtype::Bf16).unwrap().built();
        let want = if built {
            FLASHATTN_CUDA_ERROR
        } else {
            FLASHATTN_UNSUPPORTED
        };
        // SAFETY: refused at the first CUDA call, or by the dispatch, before any pointer is used.
        let r = unsafe { entry(&p, null_mut()) };
        assert_eq!(r.status, want as i32, "{family:?}: base parameters refused");
    }
}

#[test]
fn the_rust_limits_are_the_c_limits() {
    assert_eq!(
        flashattn::tensor::MAX_GPU_SEQLEN,
        FLASHATTN_MAX_SEQLEN as usize
    );
}

#[test]
fn null_params_and_null_operands() {
    for (name, entry) in FORWARDS.iter().chain(&BACKWARDS) {
        // SAFETY: a null params pointer is what is being refused.
        let r = unsafe { entry(std::ptr::null(), null_mut()) };
        assert_eq!(r.status, INVALID, "{name}: null params");
    }
    type Edit = fn(&mut flashattn_params_t);
    let nulls: [(&str, Edit, bool); 10] = [
        ("q", |p| p.q.ptr = null_mut(), true),
        ("k", |p| p.k.ptr = null_mut(), true),
        ("v", |p| p.v.ptr = null_mut(), true),
        ("o", |p| p.o.ptr = null_mut(), true),
        ("lse", |p| p.lse = null_mut(), true),
        ("dout", |p| p.dout.ptr = null_mut(), false),
        ("dq", |p| p.dq.ptr = null_mut(), false),
        ("dk", |p| p.dk.ptr = null_mut(), false),
        ("dv", |p| p.dv.ptr = null_mut(), false),
        ("workspace", |p| p.workspace = null_mut(), false),
    ];
    for (what, edit, forward_too) in nulls {
        let mut p = params();
        edit(&mut p);
        for (name, entry) in &BACKWARDS {
            expect(name, *entry, &p, INVALID, &format!("null {what}"));
        }
        if forward_too {
            for (name, entry) in &FORWARDS {
                expect(name, *entry, &p, INVALID, &format!("null {what}"));
            }
        }
    }
    let mut p = params();
    p.workspace_bytes = 0;
    for (name, entry) in &BACKWARDS {
        expect(name, *entry, &p, INVALID, "no workspace");
    }
}

#[test]
fn bad_strides_and_pointers() {
    type Edit = fn(&mut flashattn_params_t);
    let cases: [(&str, Edit); 9] = [
        ("negative o batch stride", |p| p.o.batch_stride = -64),
        ("negative q row stride", |p| p.q.row_stride = -256),
        ("q pointer misaligned by 2 bytes", |p| {
            p.q.ptr = (p.q.ptr as usize + 2) as *mut c_void
        }),
        ("q row stride of 7 elements", |p| p.q.row_stride = 7),
        ("k head stride of 1 TiB", |p| p.k.head_stride = 1 << 39),
        ("v batch stride that overflows the span", |p| {
            p.v.batch_stride = i64::MAX / 2 + 8
        }),
        ("o rows on top of each other", |p| p.o.row_stride = 0),
        ("o on top of q", |p| p.o = p.q),
        ("lse inside o", |p| {
            p.lse = (p.o.ptr as usize + 4096) as *mut f32
        }),
    ];
    for (what, edit) in cases {
        let mut p = params();
        edit(&mut p);
        for (name, entry) in &FORWARDS {
            expect(name, *entry, &p, INVALID, what);
        }
    }
    let bwd_cases: [(&str, Edit); 5] = [
        ("dk and dv the same", |p| p.dv = p.dk),
        ("dq over dout", |p| {
            p.dq.ptr = (p.dout.ptr as usize + 128) as *mut c_void
        }),
        ("workspace over dq", |p| p.workspace = p.dq.ptr),
        ("dq heads half over each other", |p| p.dq.head_stride = 32),
        ("dv with a negative head stride", |p| p.dv.head_stride = -64),
    ];
    for (what, edit) in bwd_cases {
        let mut p = params();
        edit(&mut p);
        for (name, entry) in &BACKWARDS {
            expect(name, *entry, &p, INVALID, what);
        }
    }
}

#[test]
fn sizes_and_options_out_of_range() {
    type Edit = fn(&mut flashattn_params_t);
    let invalid: [(&str, Edit); 22] = [
        ("zero batch", |p| p.batch = 0),
        ("negative heads", |p| p.heads_q = -4),
        ("heads_q not a multiple of heads_kv", |p| p.heads_kv = 3),
        ("seqlen_q past the maximum", |p| {
            p.seqlen_q = FLASHATTN_MAX_SEQLEN as i32 + 1
        }),
        ("seqlen_k past the maximum", |p| {
            p.seqlen_k = FLASHATTN_MAX_SEQLEN as i32 + 1
        }),
        (
            "batch · heads past 2^31 (products past int64 further on)",
            |p| {
                (p.batch, p.heads_q, p.heads_kv) = (65_691_503, 47_936_370, 47_936_370);
                (p.seqlen_q, p.seqlen_k, p.head_dim) = (1, 19_767_456, 128);
            },
        ),
        ("2^31 work items", |p| {
            (p.batch, p.heads_q, p.heads_kv) = (1 << 16, 1 << 15, 1 << 15)
        }),
        ("a left window that passes int beside seqlen_k", |p| {
            (p.seqlen_k, p.window_left) = (FLASHATTN_MAX_SEQLEN as i32, (1 << 30) - 16)
        }),
        ("window below -1", |p| p.window_left = -2),
        ("infinite scale", |p| p.softmax_scale = f32::INFINITY),
        ("NaN scale", |p| p.softmax_scale = f32::NAN),
        ("zero scale", |p| p.softmax_scale = 0.0),
        ("NaN softcap", |p| p.softcap = f32::NAN),
        ("infinite softcap", |p| p.softcap = f32::INFINITY),
        ("no SM count", |p| p.sm_count = 0),
        // Packed batches: both offset arrays and both bounds, or none of them.
        ("cu_seqlens_q alone", |p| {
            p.cu_seqlens_q = addr(20) as *const i32
        }),
        ("cu_seqlens_k alone", |p| {
            p.cu_seqlens_k = addr(21) as *const i32
        }),
        ("max_seqlen_k alone", |p| p.max_seqlen_k = 256),
        ("seqused_k alone", |p| p.seqused_k = addr(23) as *const i32),
        ("packed, max_seqlen_q 0", |p| {
            *p = packed_params();
            p.max_seqlen_q = 0;
        }),
        ("packed, max_seqlen_k past the rows", |p| {
            *p = packed_params();
            p.max_seqlen_k = p.seqlen_k + 1;
        }),
        ("packed, no cu_seqlens_k", |p| {
            *p = packed_params();
            p.cu_seqlens_k = std::ptr::null();
        }),
    ];
    for (what, edit) in invalid {
        let mut p = params();
        edit(&mut p);
        refused_everywhere(&p, INVALID, what);
    }
    let unsupported: [(&str, Edit); 3] = [
        ("page_table", |p| p.page_table = addr(22) as *const i32),
        ("page_size", |p| p.page_size = 16),
        ("head dim 96", |p| p.head_dim = 96),
    ];
    for (what, edit) in unsupported {
        let mut p = params();
        edit(&mut p);
        refused_everywhere(&p, UNSUPPORTED, what);
    }
    let mut p = params();
    p.dtype = 7;
    refused_everywhere(&p, UNSUPPORTED, "unknown dtype");
    // The offsets are inputs: a call's outputs must not overlap them.
    let mut p = packed_params();
    p.cu_seqlens_k = p.o.ptr as *const i32;
    for (name, entry) in FORWARDS {
        expect(name, entry, &p, INVALID, "offsets inside O");
    }
    let mut p = packed_params();
    p.seqused_k = p.dk.ptr as *const i32;
    for (name, entry) in BACKWARDS {
        expect(name, entry, &p, INVALID, "used-key counts inside dK");
    }
    // The FlashAttention-2 grid holds 65535 batch entries (the Hopper kernels take more).
    let mut p = params();
    (p.batch, p.seqlen_q, p.seqlen_k) = (70_000, 64, 64);
    for (name, entry) in [FORWARDS[1], BACKWARDS[1]] {
        expect(name, entry, &p, INVALID, "batch past grid z");
    }
}

#[test]
fn fp8_forward_checks_its_descales_and_output_type() {
    let fp8 = || {
        let mut p = params();
        p.dtype = FLASHATTN_E4M3 as i32;
        p.out_dtype = FLASHATTN_BF16 as i32;
        let (s, h, d) = (256, 4, 64);
        p.q = packed(addr(0), s, h, d);
        p.k = packed(addr(1), s, h, d);
        p.q_descale = addr(10) as *const f32;
        p.k_descale = addr(11) as *const f32;
        p.v_descale = addr(12) as *const f32;
        p
    };
    type Edit = fn(&mut flashattn_params_t);
    let cases: [(&str, Edit, i32); 6] = [
        ("no Q descale", |p| p.q_descale = std::ptr::null(), INVALID),
        (
            "V descales inside O",
            |p| p.v_descale = p.o.ptr as *const f32,
            INVALID,
        ),
        (
            "e4m3 output",
            |p| p.out_dtype = FLASHATTN_E4M3 as i32,
            INVALID,
        ),
        ("softcap", |p| p.softcap = 30.0, UNSUPPORTED),
        (
            "packed batch",
            |p| {
                (p.cu_seqlens_q, p.cu_seqlens_k) = (addr(20) as *const i32, addr(21) as *const i32);
                (p.max_seqlen_q, p.max_seqlen_k) = (128, 128);
            },
            UNSUPPORTED,
        ),
        (
            "misaligned descale",
            |p| p.k_descale = (addr(11) as usize + 2) as *const f32,
            INVALID,
        ),
    ];
    for (what, edit, status) in cases {
        let mut p = fp8();
        edit(&mut p);
        expect("fwd_sm90 fp8", flashattn_fwd_sm90, &p, status, what);
    }
    let p = fp8();
    expect(
        "fwd_sm80 fp8",
        flashattn_fwd_sm80,
        &p,
        UNSUPPORTED,
        "FP8 on sm80",
    );
    expect(
        "bwd_sm90 fp8",
        flashattn_bwd_sm90,
        &p,
        UNSUPPORTED,
        "FP8 backward",
    );
}

#[test]
fn fp8_quantize_and_descale_copy_refuse_bad_sizes() {
    let base = || flashattn_fp8_quantize_t {
        src: packed(addr(0), 256, 4, 256),
        src_dtype: FLASHATTN_BF16 as i32,
        dst: addr(1),
        dst_batch_stride: 4 * 256 * 256,
        dst_row_stride: 256,
        dst_head_stride: 256 * 256,
        descale: addr(2) as *mut f32,
        batch: 2,
        seqlen: 256,
        heads: 4,
        head_dim: 256,
        block_rows: 128,
        layout: FLASHATTN_FP8_KEY_MAJOR as i32,
        hadamard: 0,
        hadamard_signs: [0; 4],
    };
    type Edit = fn(&mut flashattn_fp8_quantize_t);
    let cases: [(&str, Edit, i32); 10] = [
        (
            "block_rows 2^24 (head_dim · block_rows wraps to 0)",
            |p| p.block_rows = 1 << 24,
            INVALID,
        ),
        (
            "block_rows 2^24 + 32",
            |p| p.block_rows = (1 << 24) + 32,
            INVALID,
        ),
        (
            "block_rows not whole 32-key groups",
            |p| p.block_rows = 100,
            INVALID,
        ),
        ("batch past grid z", |p| p.batch = 65536, INVALID),
        ("heads past grid y", |p| p.heads = 65536, INVALID),
        ("unknown layout", |p| p.layout = 7, INVALID),
        ("unknown source type", |p| p.src_dtype = 9, INVALID),
        ("no destination", |p| p.dst = null_mut(), INVALID),
        (
            "negative source stride",
            |p| p.src.row_stride = -1024,
            INVALID,
        ),
        ("head dim 96", |p| p.head_dim = 96, UNSUPPORTED),
    ];
    // SAFETY (every call below): the params outlive the call; each is refused before launch.
    let r = unsafe { flashattn_fp8_quantize(std::ptr::null(), null_mut()) };
    assert_eq!(r.status, INVALID, "null params");
    for (what, edit, status) in cases {
        let mut p = base();
        edit(&mut p);
        let r = unsafe { flashattn_fp8_quantize(&p, null_mut()) };
        assert_eq!((r.status, r.cuda_error), (status, 0), "quantize: {what}");
    }
    let (a, b) = (addr(3) as *mut f32, addr(4) as *mut f32);
    for (what, src, dst, count) in [
        ("no descales", a as *const f32, b, 0),
        ("misaligned source", (a as usize + 2) as *const f32, b, 16),
        (
            "overlapping, not in place",
            a as *const f32,
            (a as usize + 16) as *mut f32,
            16,
        ),
        ("null destination", a as *const f32, null_mut(), 16),
    ] {
        let r = unsafe { flashattn_fp8_sanitize_descales(src, dst, count, null_mut()) };
        assert_eq!(r.status, INVALID, "descale copy: {what}");
    }
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
