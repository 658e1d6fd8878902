//! What the backends are checked against (the correctness rule of docs/ARCHITECTURE.md):
//!
//! - the **reference**: attention in f64 over the same dtype-rounded inputs
//!   ([`reference_forward`], [`reference_backward`], and [`reference_row`] for one query row of
//!   a shape too large to compute whole);
//! - the **baseline**: standard attention computed the way a framework does it in the low
//!   precision `T`: every matrix product accumulated in f32 and rounded to `T`, the softmax in
//!   f32 rounded to `T` ([`baseline_forward`], [`baseline_backward`]);
//! - the **rule** ([`compare`]): `max|got − ref| ≤ 2·max|baseline − ref| + 1e-5`; for the
//!   gradients of packed batches, whose sequences may have a few keys, FlashAttention-3's form
//!   of it ([`compare_gradient`]).
//!
//! All of them follow the crate's semantics: masks from [`crate::config::KeyRule::key_range`],
//! softcap `cap·tanh(s·scale/cap)` before masking, GQA (query head `h` reads kv head
//! `h / group`), and fully masked rows giving `O = 0`, `LSE = +inf` and zero gradients.
//! V's head dim may differ from Q's and K's (`head_dim_v`): the scores and the default scale
//! take Q's, O, dO and dV V's. Outputs are packed: dQ as `(batch, seqlen_q, heads_q, head_dim)`,
//! O as `(batch, seqlen_q, heads_q, head_dim_v)`, dK as `(batch, seqlen_k, heads_kv, head_dim)`,
//! dV as `(batch, seqlen_k, heads_kv, head_dim_v)`, LSE as `(batch, heads_q, seqlen_q)`.
//!
//! The `_sinks` variants add learnable attention sinks (GPT-OSS style): one f32 logit per query
//! head that joins every row's softmax beside the (scaled, capped) scores but carries no value
//! row, `LSE_i = log(exp(sink_h) + Σ_j exp(s_ij))`; a row that sees no key gives `O = 0` and
//! `LSE = sink_h`. Their backwards also return the gradient with respect to each sink (one per
//! query head, summed over the batch), `−Σ_{b,i} exp(sink_h − LSE_i)·(dO_i·O_i)`. The functions
//! without `_sinks` run the same code with no sink column, bit for bit the attention without
//! one.
//!
//! These are test utilities: they panic (with the crate's validation error) on operands that
//! [`crate::forward`] would refuse.

use rayon::prelude::*;

use crate::config::{AttentionConfig, KeyRule};
use crate::error::Operand;
use crate::tensor::{Element, Problem, TensorRef};

mod baseline;
mod oracle;
mod rule;

pub use baseline::{
    baseline_backward, baseline_backward_sinks, baseline_forward, baseline_forward_sinks,
    baseline_row, baseline_row_sinks, BaselineForward, BaselineGrads,
};
pub use oracle::{
    reference_backward, reference_backward_sinks, reference_forward, reference_forward_sinks,
    reference_row, reference_row_sinks, ReferenceForward, ReferenceGrads,
};
pub use rule::{compare, compare_gradient, Comparison};

/// Elements converted to f32.
pub fn to_f32<T: Element>(x: &[T]) -> Vec<f32> {
    x.iter().map(|v| v.to_f32()).collect()
}

/// A tensor of any strides gathered into packed `(b, s, h, d)` f32.
pub fn pack_f32<T: Element>(t: TensorRef<T>) -> Vec<f32> {
    let [nb, ns, nh, nd] = t.layout.shape;
    let mut v = Vec::with_capacity(nb * ns * nh * nd);
    for b in 0..nb {
        for s in 0..ns {
            for h in 0..nh {
                let off = t.layout.offset(b, s, h, 0);
                v.extend(t.data[off..off + nd].iter().map(|x| x.to_f32()));
            }
        }
    }
    v
}

fn problem<T: Element>(q: &TensorRef<T>, k: &TensorRef<T>, v: &TensorRef<T>) -> Problem {
    let checked = q
        .check(Operand::Q)
        .and(k.check(Operand::K))
        .and(v.check(Operand::V))
        .and_then(|_| Problem::from_layouts(&q.layout, &k.layout, &v.layout, T::DTYPE));
    checked.unwrap_or_else(|e| panic!("invalid reference operands: {e}"))
}

/// Checks that `sinks`, where given, hold one logit per query head.
fn check_sinks(sinks: Option<&[f32]>, p: &Problem) {
    if let Some(s) = sinks {
        assert_eq!(
            s.len(),
            p.heads_q,
            "sinks: one logit per query head (heads_q = {})",
            p.heads_q
        );
    }
}

/// Head `h` of batch `b` of `t` as packed `(seqlen, d)` rows, converted by `conv`.
fn head<T: Element, U>(t: &TensorRef<T>, b: usize, h: usize, conv: impl Fn(T) -> U) -> Vec<U> {
    let (s, d) = (t.layout.seqlen(), t.layout.head_dim());
    let mut out = Vec::with_capacity(s * d);
    for i in 0..s {
        let off = t.layout.offset(b, i, h, 0);
        out.extend(t.data[off..off + d].iter().map(|&x| conv(x)));
    }
    out
}

/// Scatters per-(b, h) packed `(seqlen, d)` rows into a packed `(b, s, heads, d)` buffer.
/// GQA: each (batch entry, KV head)'s sum of its query heads' `of(b·heads_q + h)` (dK or dV of
/// one query head, `len` values), in head order.
fn group_sum<'a, U: Copy + Default + std::ops::AddAssign + 'a>(
    p: &Problem,
    len: usize,
    of: impl Fn(usize) -> &'a [U],
) -> Vec<Vec<U>> {
    (0..p.batch * p.heads_kv)
        .map(|bhk| {
            let (b, hk) = (bhk / p.heads_kv, bhk % p.heads_kv);
            let mut acc = vec![U::default(); len];
            for h in hk * p.group_size()..(hk + 1) * p.group_size() {
                for (a, &x) in acc.iter_mut().zip(of(b * p.heads_q + h)) {
                    *a += x;
                }
            }
            acc
        })
        .collect()
}

fn scatter<U: Copy + Default>(blocks: &[Vec<U>], shape: [usize; 4]) -> Vec<U> {
    let [nb, ns, nh, nd] = shape;
    let mut out = vec![U::default(); nb * ns * nh * nd];
    for (bh, blk) in blocks.iter().enumerate() {
        let (b, h) = (bh / nh, bh % nh);
        for (i, row) in blk.chunks_exact(nd).enumerate() {
            out[((b * ns + i) * nh + h) * nd..][..nd].copy_from_slice(row);
        }
    }
    out
}

/// The forward of every query row,
/// `row_out(mask, q_row, k_head, (v_head, d_v), i, sink) -> (o_row, lse)` with `d_v` V's head
/// dim and `sink` the row's head's logit (`None` without sinks), in parallel over (batch, head),
/// elements converted by `conv`; O packed `(b, s_q, h_q, d_v)`, LSE packed (b, h, s). Shared by
/// the reference (f64) and the baseline (f32 rounded to `T`).
fn forward_all_rows<T: Element, U: Copy + Default + Send + Sync>(
    cfg: &AttentionConfig,
    q: &TensorRef<T>,
    k: &TensorRef<T>,
    v: &TensorRef<T>,
    sinks: Option<&[f32]>,
    conv: fn(T) -> U,
    row_out: impl Fn(&KeyRule, &[U], &[U], (&[U], usize), usize, Option<f32>) -> (Vec<U>, U) + Sync,
) -> (Vec<U>, Vec<U>) {
    let p = problem(q, k, v);
    check_sinks(sinks, &p);
    let (d, dv, mask) = (
        p.head_dim,
        p.head_dim_v,
        cfg.key_rule(p.seqlen_q, p.seqlen_k),
    );
    let per_head: Vec<(Vec<U>, Vec<U>)> = (0..p.batch * p.heads_q)
        .into_par_iter()
        .map(|bh| {
            let (b, h) = (bh / p.heads_q, bh % p.heads_q);
            let qh = head(q, b, h, conv);
            let kh = head(k, b, h / p.group_size(), conv);
            let vh = head(v, b, h / p.group_size(), conv);
            let mut o = Vec::with_capacity(p.seqlen_q * dv);
            let mut lse = Vec::with_capacity(p.seqlen_q);
            let sink = sinks.map(|s| s[h]);
            for i in 0..p.seqlen_q {
                let (row, l) = row_out(&mask, &qh[i * d..(i + 1) * d], &kh, (&vh, dv), i, sink);
                o.extend(row);
                lse.push(l);
            }
            (o, lse)
        })
        .collect();
    let (o, lse): (Vec<_>, Vec<_>) = per_head.into_iter().unzip();
    (scatter(&o, p.o_shape()), lse.concat())
}

/// [`forward_all_rows`] for the single query row `i` of head `h`, batch `b`: needs only that
/// row of Q (and all of K, V).
#[allow(clippy::too_many_arguments)]
fn forward_one_row<T: Element, U: Copy>(
    cfg: &AttentionConfig,
    q: &TensorRef<T>,
    k: &TensorRef<T>,
    v: &TensorRef<T>,
    sinks: Option<&[f32]>,
    (b, h, i): (usize, usize, usize),
    conv: fn(T) -> U,
    row_out: impl Fn(&KeyRule, &[U], &[U], (&[U], usize), usize, Option<f32>) -> (Vec<U>, U),
) -> (Vec<U>, U) {
    let p = problem(q, k, v);
    check_sinks(sinks, &p);
    assert!(
        b < p.batch && h < p.heads_q && i < p.seqlen_q,
        "row out of range"
    );
    let off = q.layout.offset(b, i, h, 0);
    let q_row: Vec<U> = q.data[off..off + p.head_dim]
        .iter()
        .map(|&x| conv(x))
        .collect();
    let kh = head(k, b, h / p.group_size(), conv);
    let vh = head(v, b, h / p.group_size(), conv);
    let mask = cfg.key_rule(p.seqlen_q, p.seqlen_k);
    let sink = sinks.map(|s| s[h]);
    row_out(&mask, &q_row, &kh, (&vh, p.head_dim_v), i, sink)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_match_whole_computations() {
        let (b, s, h, d) = (2, 7, 4, 8);
        let x: Vec<f32> = (0..b * s * h * d)
            .map(|i| (i as f32 * 0.61).sin())
            .collect();
        let kv: Vec<f32> = (0..b * 5 * 2 * d)
            .map(|i| (i as f32 * 0.29).cos())
            .collect();
        let q = TensorRef::contiguous(&x, [b, s, h, d]);
        let k = TensorRef::contiguous(&kv, [b, 5, 2, d]);
        let cfg = AttentionConfig::new().causal(true).softcap(3.0);
        let full = reference_forward(&cfg, q, k, k);
        for (bi, hi, i) in [(0, 0, 0), (1, 3, 6), (1, 2, 3)] {
            let (o, lse) = reference_row(&cfg, q, k, k, bi, hi, i);
            assert_eq!(lse, full.lse[(bi * h + hi) * s + i]);
            assert_eq!(o, full.out[((bi * s + i) * h + hi) * d..][..d]);
        }
        let base = baseline_forward::<f32>(&cfg, q, k, k);
        for (bi, hi, i) in [(0, 0, 0), (1, 3, 6), (1, 2, 3)] {
            let (o, lse) = baseline_row(&cfg, q, k, k, bi, hi, i);
            assert_eq!(lse, base.lse[(bi * h + hi) * s + i]);
            assert_eq!(o, base.out[((bi * s + i) * h + hi) * d..][..d]);
        }
        // Causal with s_q > s_k: the first two rows see nothing.
        let (o, lse) = baseline_row(&cfg, q, k, k, 0, 1, 1);
        assert_eq!(lse, f32::INFINITY);
        assert!(o.iter().all(|&x| x == 0.0));
        let (o, lse) = reference_row(&cfg, q, k, k, 0, 1, 1);
        assert_eq!(lse, f64::INFINITY);
        assert!(o.iter().all(|&x| x == 0.0));
    }

    /// One row, as the row functions compute it, against the whole computation, with V of
    /// another head dim than Q and K (narrower and wider): O's rows are V's width.
    #[test]
    fn rows_match_whole_computations_with_v_head_dim_apart() {
        let (b, sq, sk, h, hkv, d) = (2, 7, 5, 4, 2, 8);
        let gen = |n: usize, f: f32| -> Vec<f32> { (0..n).map(|i| (i as f32 * f).sin()).collect() };
        let (x, kv) = (gen(b * sq * h * d, 0.61), gen(b * sk * hkv * d, 0.29));
        let q = TensorRef::contiguous(&x, [b, sq, h, d]);
        let k = TensorRef::contiguous(&kv, [b, sk, hkv, d]);
        let cfg = AttentionConfig::new().window(Some(3), Some(1)).softcap(3.0);
        for dv in [3, 12] {
            let vv = gen(b * sk * hkv * dv, 0.47);
            let v = TensorRef::contiguous(&vv, [b, sk, hkv, dv]);
            let full = reference_forward(&cfg, q, k, v);
            let base = baseline_forward::<f32>(&cfg, q, k, v);
            assert_eq!(full.out.len(), b * sq * h * dv);
            for (bi, hi, i) in [(0, 0, 0), (1, 3, 6), (1, 2, 3)] {
                let at = ((bi * sq + i) * h + hi) * dv;
                let (o, lse) = reference_row(&cfg, q, k, v, bi, hi, i);
                assert_eq!(lse, full.lse[(bi * h + hi) * sq + i]);
                assert_eq!(o, full.out[at..][..dv]);
                let (o, lse) = baseline_row(&cfg, q, k, v, bi, hi, i);
                assert_eq!(lse, base.lse[(bi * h + hi) * sq + i]);
                assert_eq!(o, base.out[at..][..dv]);
            }
        }
    }

    #[test]
    fn baseline_f32_is_close_to_reference() {
        let (s, d) = (9, 16);
        let x: Vec<f32> = (0..s * d).map(|i| (i as f32 * 0.37).sin()).collect();
        let t = TensorRef::contiguous(&x, [1, s, 1, d]);
        let cfg = AttentionConfig::new();
        let r = reference_forward(&cfg, t, t, t);
        let bl = baseline_forward(&cfg, t, t, t);
        let c = compare(&bl.out, &r.out, &bl.out);
        assert!(c.max_err < 1e-5 && c.max_err > 0.0, "{c}");
        let rb = reference_backward(&cfg, t, t, t, t);
        let bb = baseline_backward(&cfg, t, t, t, t);
        let c = compare(&bb.dq, &rb.dq, &bb.dq);
        assert!(c.max_err < 1e-5, "{c}");
    }
}
