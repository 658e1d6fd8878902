//! The KV-cache append entry point: its counts, rotary angles, Q's rotation and the cache as an
//! output (no input may share an element with it).

use crate::ffi::*;
use crate::{addr, packed};

/// Two sequences appending 3 rows of (4 heads, 64) into a dense bf16 cache of 2 entries of 256
/// rows, with rotary embedding of the keys and of one query row each: valid but for what each
/// case breaks.
fn base() -> flashattn_kvcache_append_t {
    let (h, d) = (4, 64);
    flashattn_kvcache_append_t {
        k_new: packed(addr(0), 3, h, d),
        v_new: packed(addr(1), 3, h, d),
        k_cache: packed(addr(2), 256, h, d),
        v_cache: packed(addr(3), 256, h, d),
        dtype: FLASHATTN_BF16 as i32,
        batch: 2,
        seqlen_new: 3,
        heads_kv: h as i32,
        head_dim: d as i32,
        head_dim_v: d as i32,
        entries: 2,
        cache_rows: 256,
        cache_seqlens: addr(4) as *const i32,
        page_table: std::ptr::null(),
        max_pages: 0,
        seqlens_out: addr(5) as *mut i32,
        rotary_cos: addr(6) as *const f32,
        rotary_sin: addr(7) as *const f32,
        rotary_dim: 64,
        rotary_positions: 259,
        rotary_interleaved: 0,
        q: packed(addr(8), 1, 4 * h, d),
        q_out: packed(addr(9), 1, 4 * h, d),
        seqlen_q: 1,
        heads_q: 4 * h as i32,
        q_same_position: 0,
        cache_e4m3: 0,
        k_descale: std::ptr::null(),
        v_descale: std::ptr::null(),
    }
}

/// The base append into an e4m3 cache, with descales.
fn e4m3_base() -> flashattn_kvcache_append_t {
    flashattn_kvcache_append_t {
        cache_e4m3: 1,
        k_descale: addr(11) as *const f32,
        v_descale: addr(12) as *const f32,
        ..base()
    }
}

#[test]
fn kvcache_append_refuses_what_it_cannot_do_in_bounds() {
    type Edit = fn(&mut flashattn_kvcache_append_t);
    let cases: [(&str, Edit); 14] = [
        ("e4m3", |p| p.dtype = FLASHATTN_E4M3 as i32),
        ("cache_e4m3 neither 0 nor 1", |p| p.cache_e4m3 = 2),
        ("descales of a 16-bit cache", |p| {
            p.k_descale = addr(11) as *const f32
        }),
        ("fewer entries than sequences", |p| p.entries = 1),
        ("no cached counts", |p| p.cache_seqlens = std::ptr::null()),
        ("a dense cache with max_pages", |p| p.max_pages = 2),
        ("a paged cache without max_pages", |p| {
            p.page_table = addr(10) as *const i32
        }),
        ("an odd rotary dim", |p| p.rotary_dim = 63),
        ("a rotary dim past the head", |p| p.rotary_dim = 66),
        ("cos without sin", |p| p.rotary_sin = std::ptr::null()),
        ("Q rotated without rotary angles", |p| {
            (p.rotary_cos, p.rotary_sin) = (std::ptr::null(), std::ptr::null())
        }),
        ("new keys inside the cache", |p| p.k_new.ptr = p.k_cache.ptr),
        ("rotated Q over the cached counts", |p| {
            p.q_out.ptr = p.cache_seqlens as *mut _
        }),
        // 2^31 rows of capacity pass the kernel's 32-bit row numbers.
        ("rows past i32", |p| {
            // One page of 32768 rows (the cache views valid) in 65536 table slots a sequence.
            (p.page_table, p.max_pages, p.cache_rows) = (addr(10) as *const i32, 65_536, 32_768);
            p.entries = 1;
        }),
    ];
    crate::refused_edits("append", flashattn_kvcache_append, base, &cases);
}

#[test]
fn an_e4m3_append_refuses_what_it_cannot_do_in_bounds() {
    type Edit = fn(&mut flashattn_kvcache_append_t);
    let cases: [(&str, Edit); 3] = [
        ("e4m3 new rows", |p| p.dtype = FLASHATTN_E4M3 as i32),
        ("K's descales inside the cache", |p| {
            p.k_descale = p.k_cache.ptr as *const f32
        }),
        ("V's descales inside the rotated Q", |p| {
            p.v_descale = p.q_out.ptr as *const f32
        }),
    ];
    crate::refused_edits("e4m3 append", flashattn_kvcache_append, e4m3_base, &cases);
}

/// An e4m3 cache's views are of 1-byte elements: V's cache may begin right after K's bytes,
/// which would overlap K's were its elements 2 bytes. Left to machines without a driver (with
/// one the accepted call would launch on these unreal addresses).
#[test]
fn an_e4m3_append_writes_bytes() {
    if flashattn::cuda::driver_present() {
        return;
    }
    let mut p = e4m3_base();
    let k_bytes = p.entries as usize * p.k_cache.batch_stride as usize;
    p.v_cache.ptr = (p.k_cache.ptr as usize + k_bytes) as *mut std::ffi::c_void;
    // SAFETY: the launch fails for want of a driver before any pointer is used.
    let r = unsafe { flashattn_kvcache_append(&p, std::ptr::null_mut()) };
    assert_eq!(
        r.status, FLASHATTN_CUDA_ERROR as i32,
        "an e4m3 append refused"
    );
    p.cache_e4m3 = 0;
    (p.k_descale, p.v_descale) = (std::ptr::null(), std::ptr::null());
    // SAFETY: refused by the checks before any pointer is used.
    let r = unsafe { flashattn_kvcache_append(&p, std::ptr::null_mut()) };
    assert_eq!(r.status, crate::INVALID, "V's 16-bit cache inside K's");
}
