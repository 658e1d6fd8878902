//! Null operands, bad strides and pointers, sizes and options out of range, each refused.

use std::ffi::c_void;
use std::ptr::null_mut;

use crate::ffi::*;
use crate::{
    addr, expect, packed, packed_params, paged_params, params, refused_everywhere, BACKWARDS,
    FORWARDS, INVALID, UNSUPPORTED,
};

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
    let invalid: [(&str, Edit); 38] = [
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
            // 2^30 (batch, head) pairs of two 64-row blocks each (64 keys, one query row), of
            // well-formed operands (head dim 8, one KV head): within every other bound, the
            // elements' 2^42 included.
            let (batch, heads) = (1i64 << 14, 1i64 << 16);
            for t in [&mut p.q, &mut p.o, &mut p.dout, &mut p.dq] {
                *t = packed(t.ptr, 1, heads, 8);
            }
            for t in [&mut p.k, &mut p.v, &mut p.dk, &mut p.dv] {
                *t = packed(t.ptr, 64, 1, 8);
            }
            (p.batch, p.heads_q, p.heads_kv) = (batch as i32, heads as i32, 1);
            (p.seqlen_q, p.seqlen_k, p.head_dim) = (1, 64, 8);
        }),
        ("a left window that passes int beside seqlen_k", |p| {
            (p.seqlen_k, p.window_left) = (FLASHATTN_MAX_SEQLEN as i32, (1 << 30) - 16)
        }),
        ("negative head dim of V", |p| p.head_dim_v = -64),
        ("head dim of V past 256", |p| p.head_dim_v = 320),
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
        ("a page table in a dense call", |p| {
            p.page_table = addr(22) as *const i32
        }),
        ("a page size without a table", |p| p.page_size = 128),
        ("paged, cu_seqlens_k beside the table", |p| {
            *p = paged_params();
            p.cu_seqlens_k = addr(21) as *const i32;
        }),
        ("paged, no seqused_k", |p| {
            *p = paged_params();
            p.seqused_k = std::ptr::null();
        }),
        ("paged, keys not whole pages", |p| {
            *p = paged_params();
            (p.seqlen_k, p.max_seqlen_k) = (300, 300);
        }),
        ("paged, a table row shorter than a sequence's pages", |p| {
            *p = paged_params();
            p.page_table_batch_stride = 2;
        }),
        ("paged, no pages", |p| {
            *p = paged_params();
            p.num_pages = 0;
        }),
        ("the LSE by sequence in a dense call", |p| {
            p.lse_by_sequence = 1
        }),
        ("lse_by_sequence 2", |p| {
            *p = packed_params();
            p.lse_by_sequence = 2;
        }),
        ("pack_gqa 2", |p| p.pack_gqa = 2),
        ("pack-GQA rows past the maximum", |p| {
            // Well-formed operands (2^28 query rows of 8 heads, 64 keys of one), so that the
            // rows times the group of 8 alone pass the bound.
            let rows = (FLASHATTN_MAX_SEQLEN / 4) as i64;
            for t in [&mut p.q, &mut p.o, &mut p.dout, &mut p.dq] {
                *t = packed(t.ptr, rows, 8, 64);
            }
            for t in [&mut p.k, &mut p.v, &mut p.dk, &mut p.dv] {
                *t = packed(t.ptr, 64, 1, 64);
            }
            (p.pack_gqa, p.heads_q, p.heads_kv) = (1, 8, 1);
            (p.seqlen_q, p.seqlen_k) = (rows as i32, 64);
        }),
        ("packed, rows · heads · head dim past int64", |p| {
            // 2^28 heads over 2^30 − 128 rows of keys that broadcast (zero strides), one query
            // row, entries of one row each: every bound on the entries holds, and the rows'
            // elements wrap int64 to 0 unless the product is checked.
            *p = packed_params();
            let heads = 1i64 << 28;
            for t in [&mut p.q, &mut p.o, &mut p.dout, &mut p.dq] {
                *t = packed(t.ptr, 1, heads, 64);
            }
            for t in [&mut p.k, &mut p.v, &mut p.dk, &mut p.dv] {
                (t.batch_stride, t.row_stride, t.head_stride) = (0, 0, 0);
            }
            (p.batch, p.heads_q, p.heads_kv) = (1, heads as i32, heads as i32);
            (p.seqlen_q, p.seqlen_k) = (1, (1 << 30) - 128);
            (p.max_seqlen_q, p.max_seqlen_k) = (1, 1);
        }),
        ("negative num_splits", |p| p.num_splits = -1),
        ("257 splits", |p| p.num_splits = 257),
    ];
    for (what, edit) in invalid {
        let mut p = params();
        edit(&mut p);
        refused_everywhere(&p, INVALID, what);
    }
    let unsupported: [(&str, Edit); 4] = [
        ("paged FP8", |p| {
            *p = paged_params();
            p.dtype = FLASHATTN_E4M3 as i32;
        }),
        ("head dim 80 (in no registry row)", |p| p.head_dim = 80),
        ("head dim of V 80 (in no registry row)", |p| {
            with_head_dim_v(p, 80)
        }),
        ("head dims (64, 128): a pair in no registry row", |p| {
            with_head_dim_v(p, 128)
        }),
    ];
    for (what, edit) in unsupported {
        let mut p = params();
        edit(&mut p);
        refused_everywhere(&p, UNSUPPORTED, what);
    }
    let mut p = params();
    p.dtype = 7;
    refused_everywhere(&p, UNSUPPORTED, "unknown dtype");
    // The backwards take no paged cache (its table is an input).
    let p = paged_params();
    for (name, entry) in BACKWARDS {
        expect(name, entry, &p, UNSUPPORTED, "paged backward");
    }
    // Pack-GQA and key splits are the sm90 16-bit forward's alone.
    for (what, edit) in [
        ("pack-GQA", (|p| p.pack_gqa = 1) as Edit),
        ("key splits", |p| p.num_splits = 2),
    ] {
        let mut p = packed_params();
        edit(&mut p);
        expect("fwd_sm80", flashattn_fwd_sm80, &p, UNSUPPORTED, what);
        for (name, entry) in BACKWARDS {
            expect(name, entry, &p, UNSUPPORTED, what);
        }
    }
    let mut p = packed_params();
    p.lse_by_sequence = 1;
    for (name, entry) in BACKWARDS {
        expect(
            name,
            entry,
            &p,
            UNSUPPORTED,
            "the LSE by sequence in a backward",
        );
    }
    let mut p = paged_params();
    p.page_table = p.o.ptr as *const i32;
    expect(
        "fwd_sm90",
        flashattn_fwd_sm90,
        &p,
        INVALID,
        "page table inside O",
    );
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

/// `p` with V, O, dO and dV of head dim `dv` (packed, as `params` lays them out).
fn with_head_dim_v(p: &mut flashattn_params_t, dv: i64) {
    p.head_dim_v = dv as i32;
    let (s, h) = (p.seqlen_q as i64, p.heads_q as i64);
    for (t, slot) in [
        (&mut p.v, 2),
        (&mut p.o, 3),
        (&mut p.dout, 5),
        (&mut p.dv, 8),
    ] {
        *t = packed(addr(slot), s, h, dv);
    }
}

/// Attention sinks: their gradient without them, misaligned, or sharing bytes with an output.
#[test]
fn bad_sinks() {
    let mut p = params();
    p.dsinks = addr(10) as *mut f32;
    for (name, entry) in &BACKWARDS {
        expect(name, *entry, &p, INVALID, "dsinks without sinks");
    }
    let mut p = params();
    p.sinks = (addr(10) as usize + 2) as *const f32;
    refused_everywhere(&p, INVALID, "sinks not 4-byte aligned");
    let mut p = params();
    p.sinks = p.lse; // the forward writes the LSE over them
    for (name, entry) in &FORWARDS {
        expect(name, *entry, &p, INVALID, "sinks inside the LSE");
    }
    let mut p = params();
    p.sinks = addr(10) as *const f32;
    p.dsinks = (addr(10) as usize + 8) as *mut f32; // heads_q = 4: bytes 8..16 of the sinks
    for (name, entry) in &BACKWARDS {
        expect(name, *entry, &p, INVALID, "dsinks over the sinks");
    }
}
