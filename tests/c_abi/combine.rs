//! The combine entry point: its counts, layouts, and the merged O and LSE as outputs (no input
//! may share an element with them).

use std::ptr::null_mut;

use crate::ffi::*;
use crate::{addr, packed};

/// Three parts of (2, 37, 4, 64) bf16 with their LSE in the dense layout, merged into separate
/// buffers: valid but for what each case breaks.
fn base() -> flashattn_combine_t {
    let (s, h, d) = (37, 4, 64);
    let none = flashattn_tensor_t {
        ptr: null_mut(),
        batch_stride: 0,
        row_stride: 0,
        head_stride: 0,
    };
    let mut p = flashattn_combine_t {
        dtype: FLASHATTN_BF16 as i32,
        parts: 3,
        batch: 2,
        seqlen_q: s as i32,
        heads: h as i32,
        head_dim_v: d as i32,
        lse_packed: 0,
        part_o: [none; FLASHATTN_MAX_COMBINE_PARTS as usize],
        part_lse: [std::ptr::null(); FLASHATTN_MAX_COMBINE_PARTS as usize],
        o: packed(addr(0), s, h, d),
        lse: addr(1) as *mut f32,
    };
    for k in 0..3 {
        p.part_o[k] = packed(addr(2 + 2 * k), s, h, d);
        p.part_lse[k] = addr(3 + 2 * k) as *const f32;
    }
    p
}

#[test]
fn combine_refuses_what_it_cannot_do_in_bounds() {
    type Edit = fn(&mut flashattn_combine_t);
    let cases: [(&str, Edit); 15] = [
        ("e4m3", |p| p.dtype = FLASHATTN_E4M3 as i32),
        ("no parts", |p| p.parts = 0),
        ("more parts than the table holds", |p| {
            p.parts = FLASHATTN_MAX_COMBINE_PARTS as i32 + 1
        }),
        ("a part without its O", |p| p.part_o[2].ptr = null_mut()),
        ("a part without its LSE", |p| {
            p.part_lse[1] = std::ptr::null()
        }),
        ("no rows", |p| p.seqlen_q = 0),
        ("an LSE layout of neither kind", |p| p.lse_packed = 2),
        ("O over a part's O", |p| p.o.ptr = p.part_o[1].ptr),
        ("the LSE over a part's LSE", |p| {
            p.lse = p.part_lse[0] as *mut f32
        }),
        ("O's rows overlapping (a zero row stride)", |p| {
            p.o.row_stride = 0
        }),
        ("O misaligned", |p| {
            p.o.ptr = (p.o.ptr as usize + 2) as *mut _
        }),
        ("a part's rows misaligned", |p| p.part_o[1].row_stride += 1),
        ("O over a part's LSE", |p| p.o.ptr = p.part_lse[2] as *mut _),
        ("the LSE over O", |p| p.lse = p.o.ptr as *mut f32),
        ("more elements than the grid covers", |p| {
            (p.batch, p.seqlen_q, p.heads, p.head_dim_v) = (1 << 16, 1 << 16, 64, 64)
        }),
    ];
    crate::refused_edits("combine", flashattn_combine, base, &cases);
}
