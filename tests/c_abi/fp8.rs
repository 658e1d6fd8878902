//! The FP8 entry points: the forward's descales and output type, quantize and descale-copy sizes.

use std::ptr::null_mut;

use crate::ffi::*;
use crate::{addr, expect, packed, params, INVALID, UNSUPPORTED};

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
    let cases: [(&str, Edit, i32); 7] = [
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
            "packed batch longer than its rows",
            |p| {
                (p.cu_seqlens_q, p.cu_seqlens_k) = (addr(20) as *const i32, addr(21) as *const i32);
                (p.max_seqlen_q, p.max_seqlen_k) = (512, 128);
            },
            INVALID,
        ),
        (
            // 11,184,811 one-row sequences: V's keys per row, (64 / 192 + batch) · 192, pass the
            // 32-bit extent of the kernel's TMA tensor (everything else about the call fits).
            "packed V wider than 2^31 keys",
            |p| {
                let (batch, keys) = (11_184_811i64, 11_184_811i64 * 192);
                (p.batch, p.seqlen_q, p.seqlen_k) = (batch as i32, 64, 64);
                (p.cu_seqlens_q, p.cu_seqlens_k) = (addr(20) as *const i32, addr(21) as *const i32);
                (p.max_seqlen_q, p.max_seqlen_k) = (1, 1);
                (p.q, p.k, p.o) = (
                    packed(addr(0), 64, 4, 64),
                    packed(addr(1), 64, 4, 64),
                    packed(addr(3), 64, 4, 64),
                );
                p.v = flashattn_tensor_t {
                    ptr: addr(2),
                    batch_stride: 4 * 64 * keys,
                    row_stride: keys,
                    head_stride: 64 * keys,
                };
            },
            INVALID,
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
        cu_seqlens: std::ptr::null(),
        max_seqlen: 0,
    };
    // Packed: one batch entry of 256 rows, two sequences, so 256 / 128 + 2 blocks per head
    // (each sequence's last one partial): key-major rows of 512 keys.
    fn packed_source(p: &mut flashattn_fp8_quantize_t) {
        (p.dst_batch_stride, p.dst_row_stride, p.dst_head_stride) = (4 * 256 * 512, 512, 256 * 512);
        (p.cu_seqlens, p.max_seqlen) = (addr(3) as *const i32, 200);
    }
    type Edit = fn(&mut flashattn_fp8_quantize_t);
    let cases: [(&str, Edit, i32); 16] = [
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
        ("head dim 80", |p| p.head_dim = 80, UNSUPPORTED),
        // The transform is defined at power-of-two head dims only.
        (
            "Hadamard at head dim 96",
            |p| (p.head_dim, p.hadamard) = (96, 1),
            UNSUPPORTED,
        ),
        (
            "Hadamard at head dim 192",
            |p| (p.head_dim, p.hadamard) = (192, 1),
            UNSUPPORTED,
        ),
        ("dense with a max_seqlen", |p| p.max_seqlen = 256, INVALID),
        (
            "packed, max_seqlen past the rows",
            |p| {
                packed_source(p);
                p.max_seqlen = 257;
            },
            INVALID,
        ),
        (
            "packed, max_seqlen 0",
            |p| {
                packed_source(p);
                p.max_seqlen = 0;
            },
            INVALID,
        ),
        (
            "packed, misaligned offsets",
            |p| {
                packed_source(p);
                p.cu_seqlens = (addr(3) as usize + 2) as *const i32;
            },
            INVALID,
        ),
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
