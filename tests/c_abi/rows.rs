//! The gradient sums' entry points (flashattn_rows_add, flashattn_rows_round): their sizes, the
//! element type, and the output (acc for the add, x for the rounding) sharing no element with
//! the input.

use crate::ffi::*;
use crate::{addr, packed};

/// Rows of (2, 48, 4, 64): x in bf16 and acc in f32, in separate buffers.
fn base() -> flashattn_rows_t {
    let (s, h, d) = (48, 4, 64);
    flashattn_rows_t {
        dtype: FLASHATTN_BF16 as i32,
        batch: 2,
        seqlen: s as i32,
        heads: h as i32,
        head_dim: d as i32,
        x: packed(addr(0), s, h, d),
        acc: packed(addr(1), s, h, d),
    }
}

#[test]
fn gradient_sums_refuse_what_they_cannot_do_in_bounds() {
    type Edit = fn(&mut flashattn_rows_t);
    let cases: [(&str, Edit); 6] = [
        ("e4m3 rows", |p| p.dtype = FLASHATTN_E4M3 as i32),
        ("no batch entry", |p| p.batch = 0),
        ("a head dim of 0", |p| p.head_dim = 0),
        ("no x", |p| p.x.ptr = std::ptr::null_mut()),
        ("acc over x's bytes", |p| p.acc.ptr = p.x.ptr),
        // A head stride of 0 puts a row's four heads on the same 64 f32 of the output.
        ("acc's heads on one place", |p| p.acc.head_stride = 0),
    ];
    crate::refused_edits("rows_add", flashattn_rows_add, base, &cases);
    // Rounding reads acc (any strides) and writes x.
    let mut round = cases[..5].to_vec();
    round.push(("x's heads on one place", |p| p.x.head_stride = 0));
    crate::refused_edits("rows_round", flashattn_rows_round, base, &round);
}
