//! The sm90 and sm80 forwards over an e4m3 KV cache (`kv_cache_e4m3`): paged only, under 16-bit
//! Q, with per-(sequence, KV head) descales that are inputs like any other; the backwards refuse
//! the field.

use std::ptr::null_mut;

use crate::ffi::*;
use crate::{addr, expect, paged_params, params, BACKWARDS, INVALID, UNSUPPORTED};

/// The paged call of `paged_params` over an e4m3 cache with both descales.
fn fp8_cache() -> flashattn_params_t {
    let mut p = paged_params();
    p.kv_cache_e4m3 = 1;
    p.k_descale = addr(24) as *const f32;
    p.v_descale = addr(25) as *const f32;
    p
}

#[test]
fn an_e4m3_cache_is_refused_where_it_is_not_built_for() {
    type Case = (&'static str, fn(&mut flashattn_params_t));
    let invalid: &[Case] = &[
        ("a dense e4m3 cache (no page table)", |p| {
            *p = params();
            p.kv_cache_e4m3 = 1;
        }),
        ("kv_cache_e4m3 2", |p| p.kv_cache_e4m3 = 2),
        ("a Q descale with an e4m3 cache", |p| {
            p.q_descale = addr(26) as *const f32
        }),
        ("the K descales inside O", |p| {
            p.k_descale = p.o.ptr as *const f32
        }),
        ("the V descales inside the LSE", |p| p.v_descale = p.lse),
        ("K descales in a 16-bit cache's call", |p| {
            p.kv_cache_e4m3 = 0;
            p.v_descale = std::ptr::null();
        }),
    ];
    for (what, breaks) in invalid {
        let mut p = fp8_cache();
        breaks(&mut p);
        expect("fwd_sm90", flashattn_fwd_sm90, &p, INVALID, what);
        expect("fwd_sm80", flashattn_fwd_sm80, &p, INVALID, what);
    }
    // The FP8 forward takes no paged cache, of any element type.
    let mut p = fp8_cache();
    p.dtype = FLASHATTN_E4M3 as i32;
    expect(
        "fwd_sm90",
        flashattn_fwd_sm90,
        &p,
        UNSUPPORTED,
        "e4m3 Q over an e4m3 cache",
    );
    // Built for the sm90 forward with intra-warpgroup overlap alone.
    let mut p = fp8_cache();
    p.sm90_flags = FLASHATTN_SM90_NO_INTRA_WG_OVERLAP;
    expect(
        "fwd_sm90",
        flashattn_fwd_sm90,
        &p,
        UNSUPPORTED,
        "without the overlap",
    );
    let mut p = params();
    p.kv_cache_e4m3 = 1;
    for (name, entry) in BACKWARDS {
        expect(name, entry, &p, UNSUPPORTED, "an e4m3 cache in a backward");
    }
}

/// The cache's views are of 1-byte elements: O may begin right after K's pages, which would
/// overlap them were K's elements 2 bytes. Where no driver can be loaded the call passes every
/// check and reaches the dispatch (unsupported in a build without the kernels) or its first
/// CUDA call (with a GPU present it would launch on these unreal addresses, so it is left to
/// the machines without one, such as CI's).
#[test]
fn an_e4m3_cache_is_read_in_bytes() {
    use flashattn::registry::{find, Family, KernelDtype};
    if flashattn::cuda::driver_present() {
        return;
    }
    let mut p = fp8_cache();
    let k_bytes = p.num_pages as usize * p.k.batch_stride as usize;
    p.o.ptr = (p.k.ptr as usize + k_bytes) as *mut std::ffi::c_void;
    for (name, entry, family) in [
        (
            "fwd_sm90",
            flashattn_fwd_sm90 as crate::Entry,
            Family::Sm90Fp8CacheFwd,
        ),
        ("fwd_sm80", flashattn_fwd_sm80, Family::Sm80Fp8CacheFwd),
    ] {
        let built = find(family, 64, 64, KernelDtype::Bf16).unwrap().built();
        let want = if built {
            FLASHATTN_CUDA_ERROR
        } else {
            FLASHATTN_UNSUPPORTED
        };
        // SAFETY: refused by the dispatch or at the first CUDA call, before any pointer is used.
        let r = unsafe { entry(&p, null_mut()) };
        assert_eq!(
            r.status, want as i32,
            "{name}: an e4m3 cache's call refused"
        );
    }
    // The same bytes as a 16-bit cache overlap O.
    p.kv_cache_e4m3 = 0;
    (p.k_descale, p.v_descale) = (std::ptr::null(), std::ptr::null());
    expect(
        "fwd_sm90",
        flashattn_fwd_sm90,
        &p,
        INVALID,
        "O inside a 16-bit K",
    );
}
