//! Merging partial attention results by their log-sum-exp: the outputs of calls over disjoint
//! sets of keys (a cache split into chunks, the shards of a ring across GPUs), each with its O and
//! LSE, give the output over all the keys:
//! `LSE = log Σᵢ exp(LSEᵢ)` and `O = Σᵢ exp(LSEᵢ − LSE) · Oᵢ`, row by row.
//!
//! A part whose row saw no key (LSE = +inf, this crate's convention, with O = 0) adds nothing to
//! that row (its O is weighted by 0, so a NaN there still makes that element NaN); a row no part saw gets O = 0 and LSE = +inf, as one call over all the keys gives it
//! (whatever the parts' O hold there). Otherwise a part's NaN LSE makes the row NaN, a NaN in its
//! O that element. Each part's O comes rounded to its type, and that rounding enters the merge
//! (f32 parts merge to within f32 rounding of a single call); the merge itself runs in f64.
//! Attention sinks belong to one part only (or to none, added after the merge), since each
//! part's LSE already counts the sinks it was given. The LSE comes in a dense (or KV-cache) call's
//! order or a packed (varlen) call's ([`LseLayout`]); every part's and the result's share it.
//!
//! ```
//! use flashattn::combine::{self, LseLayout};
//! use flashattn::{AttentionConfig, ForwardInputs, TensorRef};
//!
//! fn t(d: &[f32], s: usize) -> TensorRef<'_, f32> {
//!     TensorRef::contiguous(d, [1, s, 2, 8])
//! }
//! // 16 keys in two calls of 8, merged, against one call over all of them.
//! let x = |n: usize, f: f32| -> Vec<f32> { (0..n).map(|i| (i as f32 * f).sin()).collect() };
//! let (q, k, v) = (x(4 * 2 * 8, 0.37), x(16 * 2 * 8, 0.21), x(16 * 2 * 8, 0.53));
//! let cfg = AttentionConfig::new();
//! let (k0, k1) = k.split_at(128);
//! let (v0, v1) = v.split_at(128);
//! let a = flashattn::forward(&cfg, ForwardInputs::new(t(&q, 4), t(k0, 8), t(v0, 8)))?;
//! let b = flashattn::forward(&cfg, ForwardInputs::new(t(&q, 4), t(k1, 8), t(v1, 8)))?;
//! let parts = [
//!     (TensorRef::contiguous(&a.out, [1, 4, 2, 8]), &a.lse[..]),
//!     (TensorRef::contiguous(&b.out, [1, 4, 2, 8]), &b.lse[..]),
//! ];
//! let merged = combine::combine(&parts, LseLayout::Dense)?;
//! let whole = flashattn::forward(&cfg, ForwardInputs::new(t(&q, 4), t(&k, 16), t(&v, 16)))?;
//! assert!(merged.out.iter().zip(&whole.out).all(|(m, w)| (m - w).abs() < 1e-5));
//! # Ok::<(), flashattn::Error>(())
//! ```

use crate::alloc;
use crate::error::{Error, Operand, Result};
use crate::tensor::{self, Element, Layout, TensorMut, TensorRef};

/// The order of an LSE's values for O `(batch, seqlen_q, heads, head_dim_v)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LseLayout {
    /// `(batch, heads, seqlen_q)`: a dense call's ([`crate::forward`], [`crate::kvcache`]).
    Dense,
    /// `(heads, batch · seqlen_q)`: a packed call's ([`crate::varlen`], whose O's rows are the
    /// batch's rows one after another).
    Packed,
}

impl LseLayout {
    /// Where row `i` of entry `b`, head `h` lies.
    fn index(self, [batch, seqlen_q, heads]: [usize; 3], b: usize, h: usize, i: usize) -> usize {
        match self {
            LseLayout::Dense => (b * heads + h) * seqlen_q + i,
            LseLayout::Packed => h * batch * seqlen_q + b * seqlen_q + i,
        }
    }
}

/// The merged output: O `(batch, seqlen_q, heads, head_dim_v)` and its LSE in the parts'
/// [`LseLayout`].
#[derive(Debug)]
pub struct Combined<T> {
    pub out: Vec<T>,
    pub lse: Vec<f32>,
}

/// Checks the parts against each other (each part O's layout, the elements its buffer holds and
/// its LSE's length; the host's and the device's alike): at least one, every O within its buffer
/// and of the first one's shape, every LSE at least `batch · heads · seqlen_q` values long (the
/// first that many are read, as of the merged LSE). Returns that shape and that count.
pub(crate) fn check_part_shapes(
    parts: impl IntoIterator<Item = (Layout, usize, usize)>,
) -> Result<([usize; 4], usize)> {
    let mut parts = parts.into_iter().peekable();
    let Some(&(first, _, _)) = parts.peek() else {
        return Err(Error::InvalidConfig(
            "combine needs at least one part".into(),
        ));
    };
    let shape = first.shape;
    let [batch, seqlen_q, heads, _] = shape;
    let lse_len = batch
        .checked_mul(seqlen_q)
        .and_then(|n| n.checked_mul(heads))
        .ok_or(Error::IndexOverflow {
            operand: Operand::Lse,
            detail: format!("{batch} × {seqlen_q} × {heads} rows"),
        })?;
    for (layout, len, lse) in parts {
        tensor::check_len(Operand::Out, &layout, len)?;
        if layout.shape != shape {
            return Err(Error::ShapeMismatch {
                operand: Operand::Out,
                expected: shape,
                found: layout.shape,
            });
        }
        if lse < lse_len {
            return Err(Error::BufferTooSmall {
                operand: Operand::Lse,
                needed: lse_len,
                len: lse,
            });
        }
    }
    Ok((shape, lse_len))
}

/// Checks the merged outputs against the parts' `shape` and LSE count: O (over `len` elements)
/// of that shape, each element reached once, and an LSE at least that long.
pub(crate) fn check_merged(
    (shape, lse_len): ([usize; 4], usize),
    out: &Layout,
    len: usize,
    lse: usize,
) -> Result<()> {
    tensor::check_output_len(Operand::Out, out, len)?;
    if out.shape != shape {
        return Err(Error::ShapeMismatch {
            operand: Operand::Out,
            expected: shape,
            found: out.shape,
        });
    }
    if lse < lse_len {
        return Err(Error::BufferTooSmall {
            operand: Operand::Lse,
            needed: lse_len,
            len: lse,
        });
    }
    Ok(())
}

/// [`check_part_shapes`] of host parts.
fn check_parts<T>(parts: &[(TensorRef<'_, T>, &[f32])]) -> Result<([usize; 4], usize)> {
    check_part_shapes(parts.iter().map(|(o, l)| (o.layout, o.data.len(), l.len())))
}

/// Merges `parts` (each an O `(batch, seqlen_q, heads, head_dim_v)` and its LSE in
/// `lse_layout`) into `out` (O's shape, each element reached once) and `lse` (the same layout,
/// at least as long).
pub fn combine_into<T: Element>(
    parts: &[(TensorRef<'_, T>, &[f32])],
    lse_layout: LseLayout,
    out: TensorMut<T>,
    lse: &mut [f32],
) -> Result<()> {
    let (shape, lse_len) = check_parts(parts)?;
    let [batch, seqlen_q, heads, d] = shape;
    check_merged((shape, lse_len), &out.layout, out.data.len(), lse.len())?;
    // Rows a part saw no key of (+inf) weigh nothing; NaN stays NaN.
    let seen = |l: f32| {
        if l == f32::INFINITY {
            f64::NEG_INFINITY
        } else {
            f64::from(l)
        }
    };
    let os = out.layout.strides;
    let mut weights = vec![0f64; parts.len()];
    let mut row = vec![0f64; d];
    for b in 0..batch {
        for h in 0..heads {
            for i in 0..seqlen_q {
                let at = lse_layout.index([batch, seqlen_q, heads], b, h, i);
                let mut max = f64::NEG_INFINITY;
                for (_, l) in parts {
                    let x = seen(l[at]);
                    max = if x.is_nan() || max.is_nan() {
                        f64::NAN
                    } else {
                        max.max(x)
                    };
                }
                let dst = b * os[0] + i * os[1] + h * os[2];
                let dst = &mut out.data[dst..dst + d];
                if max == f64::NEG_INFINITY {
                    lse[at] = f32::INFINITY;
                    dst.fill(T::from_f32(0.0));
                    continue;
                }
                let mut sum = 0f64;
                for (w, (_, l)) in weights.iter_mut().zip(parts) {
                    *w = (seen(l[at]) - max).exp();
                    sum += *w;
                }
                row.fill(0.0);
                for (w, (o, _)) in weights.iter().zip(parts) {
                    let s = o.layout.strides;
                    let src = b * s[0] + i * s[1] + h * s[2];
                    for (r, x) in row.iter_mut().zip(&o.data[src..src + d]) {
                        *r += w * f64::from(x.to_f32());
                    }
                }
                lse[at] = (max + sum.ln()) as f32;
                for (y, r) in dst.iter_mut().zip(&row) {
                    *y = T::from_f32((r / sum) as f32);
                }
            }
        }
    }
    Ok(())
}

/// [`combine_into`], allocating the outputs.
pub fn combine<T: Element>(
    parts: &[(TensorRef<'_, T>, &[f32])],
    lse_layout: LseLayout,
) -> Result<Combined<T>> {
    let (shape, lse_len) = check_parts(parts)?;
    let mut out = alloc::<T>(Layout::contiguous(shape).numel(Operand::Out)?)?;
    let mut lse = alloc::<f32>(lse_len)?;
    combine_into(
        parts,
        lse_layout,
        TensorMut::contiguous(&mut out, shape),
        &mut lse,
    )?;
    Ok(Combined { out, lse })
}
