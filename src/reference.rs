//! What the backends are checked against (the correctness rule of docs/ARCHITECTURE.md):
//!
//! - the **reference**: attention in f64 over the same dtype-rounded inputs
//!   ([`reference_forward`], [`reference_backward`], and [`reference_row`] for one query row of
//!   a shape too large to compute whole);
//! - the **baseline**: standard attention computed the way a framework does it in the low
//!   precision `T`: every matrix product accumulated in f32 and rounded to `T`, the softmax in
//!   f32 rounded to `T` ([`baseline_forward`], [`baseline_backward`]);
//! - the **rule** ([`compare`]): `max|got − ref| ≤ 2·max|baseline − ref| + 1e-5`.
//!
//! All of them follow the crate's semantics: masks from [`crate::config::Mask::key_range`],
//! softcap `cap·tanh(s·scale/cap)` before masking, GQA (query head `h` reads kv head
//! `h / group`), and fully masked rows giving `O = 0`, `LSE = +inf` and zero gradients.
//! Outputs are packed: O and dQ as `(batch, seqlen_q, heads_q, head_dim)`, dK and dV as
//! `(batch, seqlen_k, heads_kv, head_dim)`, LSE as `(batch, heads_q, seqlen_q)`.
//!
//! These are test utilities: they panic (with the crate's validation error) on operands that
//! [`crate::forward`] would refuse.

use std::fmt;

use rayon::prelude::*;

use crate::config::{AttentionConfig, Mask};
use crate::error::Operand;
use crate::tensor::{Element, Problem, TensorRef};

/// f64 reference forward: O `(b, s_q, h_q, d)` and LSE `(b, h_q, s_q)`, natural log.
#[derive(Clone, Debug)]
pub struct ReferenceForward {
    pub out: Vec<f64>,
    pub lse: Vec<f64>,
}

/// f64 reference gradients, packed like Q (dq) and K/V (dk, dv).
#[derive(Clone, Debug)]
pub struct ReferenceGrads {
    pub dq: Vec<f64>,
    pub dk: Vec<f64>,
    pub dv: Vec<f64>,
}

/// Baseline forward: O with values representable in `T` (held as f32), LSE in f32.
#[derive(Clone, Debug)]
pub struct BaselineForward {
    pub out: Vec<f32>,
    pub lse: Vec<f32>,
}

/// Baseline gradients, values representable in `T` (held as f32).
#[derive(Clone, Debug)]
pub struct BaselineGrads {
    pub dq: Vec<f32>,
    pub dk: Vec<f32>,
    pub dv: Vec<f32>,
}

/// The outcome of [`compare`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Comparison {
    /// `max|got − reference|` (infinite when infinities disagree).
    pub max_err: f64,
    /// `max|baseline − reference|` over entries where it is finite.
    pub baseline_err: f64,
    /// `2·baseline_err + 1e-5`.
    pub allowed: f64,
    /// `max_err / allowed`: at most 1 to pass.
    pub ratio: f64,
    pub pass: bool,
    /// NaN entries in `got` (any fails).
    pub nan_count: usize,
}

impl fmt::Display for Comparison {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} ratio {:.3} (err {:.3e}, baseline {:.3e}, allowed {:.3e}, NaN {})",
            if self.pass { "pass" } else { "FAIL" },
            self.ratio,
            self.max_err,
            self.baseline_err,
            self.allowed,
            self.nan_count
        )
    }
}

/// Absolute difference where equal values (including equal infinities) differ by 0.
fn diff(x: f64, r: f64) -> f64 {
    if x == r {
        0.0
    } else {
        (x - r).abs()
    }
}

/// FlashAttention's rule: `max|got − ref| ≤ 2·max|baseline − ref| + 1e-5`, and no NaN in `got`.
/// Equal infinities (the LSE of fully masked rows) count as error 0; disagreeing infinities as
/// an infinite error. Baseline entries that are NaN or disagree in infinity are left out of
/// `baseline_err`, so a broken baseline never widens the allowance.
///
/// # Panics
/// If the three slices differ in length.
pub fn compare(got: &[f32], reference: &[f64], baseline: &[f32]) -> Comparison {
    assert_eq!(got.len(), reference.len(), "got vs reference length");
    assert_eq!(
        baseline.len(),
        reference.len(),
        "baseline vs reference length"
    );
    let mut max_err = 0f64;
    let mut baseline_err = 0f64;
    let mut nan_count = 0;
    for ((&g, &r), &b) in got.iter().zip(reference).zip(baseline) {
        if g.is_nan() {
            nan_count += 1;
        } else {
            max_err = max_err.max(diff(g as f64, r));
        }
        let e = diff(b as f64, r);
        if e.is_finite() {
            baseline_err = baseline_err.max(e);
        }
    }
    let allowed = 2.0 * baseline_err + 1e-5;
    Comparison {
        max_err,
        baseline_err,
        allowed,
        ratio: max_err / allowed,
        pass: nan_count == 0 && max_err <= allowed,
        nan_count,
    }
}

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

fn f64_of<T: Element>(x: T) -> f64 {
    x.to_f32() as f64
}

/// Rounds an f32 to the nearest `T` (identity for f32).
fn rt<T: Element>(x: f32) -> f32 {
    T::from_f32(x).to_f32()
}

/// Scatters per-(b, h) packed `(seqlen, d)` rows into a packed `(b, s, heads, d)` buffer.
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

/// The forward of every query row, `row_out(mask, q_row, k_head, v_head, i) -> (o_row, lse)`,
/// in parallel over (batch, head), elements converted by `conv`; O packed like Q, LSE packed
/// (b, h, s). Shared by the reference (f64) and the baseline (f32 rounded to `T`).
fn forward_all_rows<T: Element, U: Copy + Default + Send + Sync>(
    cfg: &AttentionConfig,
    q: &TensorRef<T>,
    k: &TensorRef<T>,
    v: &TensorRef<T>,
    conv: fn(T) -> U,
    row_out: impl Fn(&Mask, &[U], &[U], &[U], usize) -> (Vec<U>, U) + Sync,
) -> (Vec<U>, Vec<U>) {
    let p = problem(q, k, v);
    let (d, mask) = (p.head_dim, cfg.mask(p.seqlen_q, p.seqlen_k));
    let per_head: Vec<(Vec<U>, Vec<U>)> = (0..p.batch * p.heads_q)
        .into_par_iter()
        .map(|bh| {
            let (b, h) = (bh / p.heads_q, bh % p.heads_q);
            let qh = head(q, b, h, conv);
            let kh = head(k, b, h / p.group_size(), conv);
            let vh = head(v, b, h / p.group_size(), conv);
            let mut o = Vec::with_capacity(p.seqlen_q * d);
            let mut lse = Vec::with_capacity(p.seqlen_q);
            for i in 0..p.seqlen_q {
                let (row, l) = row_out(&mask, &qh[i * d..(i + 1) * d], &kh, &vh, i);
                o.extend(row);
                lse.push(l);
            }
            (o, lse)
        })
        .collect();
    let (o, lse): (Vec<_>, Vec<_>) = per_head.into_iter().unzip();
    (scatter(&o, p.q_shape()), lse.concat())
}

/// [`forward_all_rows`] for the single query row `i` of head `h`, batch `b`: needs only that
/// row of Q (and all of K, V).
fn forward_one_row<T: Element, U: Copy>(
    cfg: &AttentionConfig,
    q: &TensorRef<T>,
    k: &TensorRef<T>,
    v: &TensorRef<T>,
    (b, h, i): (usize, usize, usize),
    conv: fn(T) -> U,
    row_out: impl Fn(&Mask, &[U], &[U], &[U], usize) -> (Vec<U>, U),
) -> (Vec<U>, U) {
    let p = problem(q, k, v);
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
    row_out(&cfg.mask(p.seqlen_q, p.seqlen_k), &q_row, &kh, &vh, i)
}

// ---------------------------------------------------------------------------------------------
// f64 reference.

/// One query row's softmax in f64: visible key range, probabilities over it, tanh of the
/// scaled scores (softcap only), and the LSE (+inf when no key is visible).
struct RowF64 {
    lo: usize,
    p: Vec<f64>,
    th: Vec<f64>,
    lse: f64,
}

fn row_f64(cfg: &AttentionConfig, mask: &Mask, q: &[f64], k: &[f64], i: usize) -> RowF64 {
    let d = q.len();
    let scale = cfg.scale_for(d) as f64;
    let (lo, hi) = mask.key_range(i);
    let mut th = Vec::new();
    let s: Vec<f64> = (lo..hi)
        .map(|j| {
            let raw: f64 = q
                .iter()
                .zip(&k[j * d..(j + 1) * d])
                .map(|(a, b)| a * b)
                .sum();
            match cfg.softcap {
                None => raw * scale,
                Some(cap) => {
                    let t = (raw * scale / cap as f64).tanh();
                    th.push(t);
                    cap as f64 * t
                }
            }
        })
        .collect();
    if s.is_empty() {
        return RowF64 {
            lo,
            p: s,
            th,
            lse: f64::INFINITY,
        };
    }
    let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
    let l: f64 = e.iter().sum();
    RowF64 {
        lo,
        p: e.iter().map(|x| x / l).collect(),
        th,
        lse: m + l.ln(),
    }
}

/// `Σ_j p_j · v[lo + j]` over d columns.
fn weighted_rows(p: &[f64], lo: usize, v: &[f64], d: usize) -> Vec<f64> {
    let mut o = vec![0f64; d];
    for (j, &pj) in p.iter().enumerate() {
        for (x, y) in o.iter_mut().zip(&v[(lo + j) * d..(lo + j + 1) * d]) {
            *x += pj * y;
        }
    }
    o
}

/// f64 attention of row `i` of query head `h`, batch `b`: its output row and LSE. Needs only
/// that row of Q and all of K, V, so it checks samples of shapes too large to compute whole.
///
/// # Panics
/// On invalid operands or indices out of range.
pub fn reference_row<T: Element>(
    cfg: &AttentionConfig,
    q: TensorRef<T>,
    k: TensorRef<T>,
    v: TensorRef<T>,
    b: usize,
    h: usize,
    i: usize,
) -> (Vec<f64>, f64) {
    forward_one_row(cfg, &q, &k, &v, (b, h, i), f64_of, |mask, qi, kh, vh, i| {
        let row = row_f64(cfg, mask, qi, kh, i);
        (weighted_rows(&row.p, row.lo, vh, qi.len()), row.lse)
    })
}

/// f64 attention forward over the dtype-rounded inputs.
///
/// # Panics
/// On invalid operands.
pub fn reference_forward<T: Element>(
    cfg: &AttentionConfig,
    q: TensorRef<T>,
    k: TensorRef<T>,
    v: TensorRef<T>,
) -> ReferenceForward {
    let (out, lse) = forward_all_rows(cfg, &q, &k, &v, f64_of, |mask, qi, kh, vh, i| {
        let row = row_f64(cfg, mask, qi, kh, i);
        (weighted_rows(&row.p, row.lo, vh, qi.len()), row.lse)
    });
    ReferenceForward { out, lse }
}

/// f64 gradients of `Σ dO∘O` with respect to Q, K, V (GQA: dK, dV summed over each group).
///
/// # Panics
/// On invalid operands or a `dout` not shaped like Q.
pub fn reference_backward<T: Element>(
    cfg: &AttentionConfig,
    q: TensorRef<T>,
    k: TensorRef<T>,
    v: TensorRef<T>,
    dout: TensorRef<T>,
) -> ReferenceGrads {
    let p = problem(&q, &k, &v);
    assert_eq!(dout.layout.shape, p.q_shape(), "dout shape");
    let (d, s_k, mask) = (p.head_dim, p.seqlen_k, cfg.mask(p.seqlen_q, p.seqlen_k));
    let scale = cfg.scale_for(d) as f64;
    // Per query head: dQ, and this head's share of dK, dV.
    let per_head: Vec<[Vec<f64>; 3]> = (0..p.batch * p.heads_q)
        .into_par_iter()
        .map(|bh| {
            let (b, h) = (bh / p.heads_q, bh % p.heads_q);
            let qh = head(&q, b, h, f64_of);
            let doh = head(&dout, b, h, f64_of);
            let kh = head(&k, b, h / p.group_size(), f64_of);
            let vh = head(&v, b, h / p.group_size(), f64_of);
            let mut dq = vec![0f64; p.seqlen_q * d];
            let mut dk = vec![0f64; s_k * d];
            let mut dv = vec![0f64; s_k * d];
            for i in 0..p.seqlen_q {
                let (qi, doi) = (&qh[i * d..(i + 1) * d], &doh[i * d..(i + 1) * d]);
                let row = row_f64(cfg, &mask, qi, &kh, i);
                let dp: Vec<f64> = (0..row.p.len())
                    .map(|j| {
                        let vj = &vh[(row.lo + j) * d..(row.lo + j + 1) * d];
                        doi.iter().zip(vj).map(|(a, b)| a * b).sum()
                    })
                    .collect();
                let dd: f64 = row.p.iter().zip(&dp).map(|(a, b)| a * b).sum();
                for (j, &pj) in row.p.iter().enumerate() {
                    let kj = row.lo + j;
                    let mut ds = pj * (dp[j] - dd) * scale;
                    if cfg.softcap.is_some() {
                        ds *= 1.0 - row.th[j] * row.th[j];
                    }
                    for x in 0..d {
                        dv[kj * d + x] += pj * doi[x];
                        dq[i * d + x] += ds * kh[kj * d + x];
                        dk[kj * d + x] += ds * qi[x];
                    }
                }
            }
            [dq, dk, dv]
        })
        .collect();
    let group_sum = |which: usize| -> Vec<Vec<f64>> {
        (0..p.batch * p.heads_kv)
            .map(|bhk| {
                let (b, hk) = (bhk / p.heads_kv, bhk % p.heads_kv);
                let mut acc = vec![0f64; s_k * d];
                for h in hk * p.group_size()..(hk + 1) * p.group_size() {
                    for (a, x) in acc.iter_mut().zip(&per_head[b * p.heads_q + h][which]) {
                        *a += x;
                    }
                }
                acc
            })
            .collect()
    };
    let dq: Vec<Vec<f64>> = per_head.iter().map(|g| g[0].clone()).collect();
    ReferenceGrads {
        dq: scatter(&dq, p.q_shape()),
        dk: scatter(&group_sum(1), p.kv_shape()),
        dv: scatter(&group_sum(2), p.kv_shape()),
    }
}

// ---------------------------------------------------------------------------------------------
// Dtype-emulating baseline.

/// One query row of the baseline in `T`: visible range, P (rounded to `T`), the tanh values
/// (rounded to `T`, softcap only) and the f32 LSE.
struct RowLow {
    lo: usize,
    p: Vec<f32>,
    th: Vec<f32>,
    lse: f32,
}

fn row_low<T: Element>(
    cfg: &AttentionConfig,
    mask: &Mask,
    q: &[f32],
    k: &[f32],
    i: usize,
) -> RowLow {
    let d = q.len();
    let scale = cfg.scale_for(d);
    let (lo, hi) = mask.key_range(i);
    let mut th = Vec::new();
    let s: Vec<f32> = (lo..hi)
        .map(|j| {
            // S = Q·Kᵀ in T, then S·scale in T, then softcap as three ops in T.
            let raw: f32 = q
                .iter()
                .zip(&k[j * d..(j + 1) * d])
                .map(|(a, b)| a * b)
                .sum();
            let s = rt::<T>(rt::<T>(raw) * scale);
            match cfg.softcap {
                None => s,
                Some(cap) => {
                    let t = rt::<T>(rt::<T>(s / cap).tanh());
                    th.push(t);
                    rt::<T>(t * cap)
                }
            }
        })
        .collect();
    if s.is_empty() {
        return RowLow {
            lo,
            p: Vec::new(),
            th,
            lse: f32::INFINITY,
        };
    }
    // Softmax in f32, rounded to T.
    let m = s.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f32> = s.iter().map(|x| (x - m).exp()).collect();
    let l: f32 = e.iter().sum();
    RowLow {
        lo,
        p: e.iter().map(|x| rt::<T>(x / l)).collect(),
        th,
        lse: m + l.ln(),
    }
}

/// A baseline output row: `P·V` accumulated in f32, rounded to `T`.
fn low_out_row<T: Element>(row: &RowLow, v: &[f32], d: usize) -> Vec<f32> {
    let mut acc = vec![0f32; d];
    for (j, &pj) in row.p.iter().enumerate() {
        let vj = &v[(row.lo + j) * d..(row.lo + j + 1) * d];
        for (a, x) in acc.iter_mut().zip(vj) {
            *a += pj * x;
        }
    }
    acc.into_iter().map(rt::<T>).collect()
}

/// Standard attention the way a framework computes it in `T` (for `T = f32` the roundings
/// vanish and this is plain f32 attention). LSE is computed in f32.
///
/// # Panics
/// On invalid operands.
pub fn baseline_forward<T: Element>(
    cfg: &AttentionConfig,
    q: TensorRef<T>,
    k: TensorRef<T>,
    v: TensorRef<T>,
) -> BaselineForward {
    let (out, lse) = forward_all_rows(cfg, &q, &k, &v, T::to_f32, |mask, qi, kh, vh, i| {
        let row = row_low::<T>(cfg, mask, qi, kh, i);
        (low_out_row::<T>(&row, vh, qi.len()), row.lse)
    });
    BaselineForward { out, lse }
}

/// The baseline of one query row (as [`baseline_forward`] computes it): its output row and LSE,
/// for checking sampled rows of shapes too large to compute whole.
///
/// # Panics
/// On invalid operands or indices out of range.
pub fn baseline_row<T: Element>(
    cfg: &AttentionConfig,
    q: TensorRef<T>,
    k: TensorRef<T>,
    v: TensorRef<T>,
    b: usize,
    h: usize,
    i: usize,
) -> (Vec<f32>, f32) {
    forward_one_row(
        cfg,
        &q,
        &k,
        &v,
        (b, h, i),
        T::to_f32,
        |mask, qi, kh, vh, i| {
            let row = row_low::<T>(cfg, mask, qi, kh, i);
            (low_out_row::<T>(&row, vh, qi.len()), row.lse)
        },
    )
}

/// The baseline's backward, as a framework's autograd would run it in `T`: dV = Pᵀ·dO,
/// dP = dO·Vᵀ, the softmax backward dS = P∘(dP − rowsum(P∘dP)), the softcap and scale chain
/// rule one op at a time, dQ = dS·K and dK = dSᵀ·Q; each product accumulated in f32 and
/// rounded to `T`. GQA: each head's dK, dV rounded to `T`, then summed over the group in f32
/// and rounded again (the gradient of repeating the kv heads).
///
/// # Panics
/// On invalid operands or a `dout` not shaped like Q.
pub fn baseline_backward<T: Element>(
    cfg: &AttentionConfig,
    q: TensorRef<T>,
    k: TensorRef<T>,
    v: TensorRef<T>,
    dout: TensorRef<T>,
) -> BaselineGrads {
    let p = problem(&q, &k, &v);
    assert_eq!(dout.layout.shape, p.q_shape(), "dout shape");
    let (d, s_q, s_k) = (p.head_dim, p.seqlen_q, p.seqlen_k);
    let mask = cfg.mask(s_q, s_k);
    let scale = cfg.scale_for(d);
    let per_head: Vec<[Vec<f32>; 3]> = (0..p.batch * p.heads_q)
        .into_par_iter()
        .map(|bh| {
            let (b, h) = (bh / p.heads_q, bh % p.heads_q);
            let qh = head(&q, b, h, T::to_f32);
            let doh = head(&dout, b, h, T::to_f32);
            let kh = head(&k, b, h / p.group_size(), T::to_f32);
            let vh = head(&v, b, h / p.group_size(), T::to_f32);
            // G = gradient with respect to the raw Q·Kᵀ, rounded to T, full (s_q × s_k).
            let mut pm = vec![0f32; s_q * s_k];
            let mut g = vec![0f32; s_q * s_k];
            for i in 0..s_q {
                let (qi, doi) = (&qh[i * d..(i + 1) * d], &doh[i * d..(i + 1) * d]);
                let row = row_low::<T>(cfg, &mask, qi, &kh, i);
                let dp: Vec<f32> = (0..row.p.len())
                    .map(|j| {
                        let vj = &vh[(row.lo + j) * d..(row.lo + j + 1) * d];
                        rt::<T>(doi.iter().zip(vj).map(|(a, b)| a * b).sum())
                    })
                    .collect();
                let dd: f32 = row.p.iter().zip(&dp).map(|(a, b)| a * b).sum();
                for (j, &pj) in row.p.iter().enumerate() {
                    let mut gs = rt::<T>(pj * (dp[j] - dd));
                    if let Some(cap) = cfg.softcap {
                        let t = row.th[j];
                        gs = rt::<T>(rt::<T>(rt::<T>(gs * cap) * (1.0 - t * t)) / cap);
                    }
                    pm[i * s_k + row.lo + j] = pj;
                    g[i * s_k + row.lo + j] = rt::<T>(gs * scale);
                }
            }
            let mut dq = vec![0f32; s_q * d];
            let mut dk = vec![0f32; s_k * d];
            let mut dv = vec![0f32; s_k * d];
            for i in 0..s_q {
                for j in 0..s_k {
                    let (pij, gij) = (pm[i * s_k + j], g[i * s_k + j]);
                    for x in 0..d {
                        dq[i * d + x] += gij * kh[j * d + x];
                        dk[j * d + x] += gij * qh[i * d + x];
                        dv[j * d + x] += pij * doh[i * d + x];
                    }
                }
            }
            [dq, dk, dv].map(|t| t.into_iter().map(rt::<T>).collect())
        })
        .collect();
    let group_sum = |which: usize| -> Vec<Vec<f32>> {
        (0..p.batch * p.heads_kv)
            .map(|bhk| {
                let (b, hk) = (bhk / p.heads_kv, bhk % p.heads_kv);
                let mut acc = vec![0f32; s_k * d];
                for h in hk * p.group_size()..(hk + 1) * p.group_size() {
                    for (a, x) in acc.iter_mut().zip(&per_head[b * p.heads_q + h][which]) {
                        *a += x;
                    }
                }
                acc.into_iter().map(rt::<T>).collect()
            })
            .collect()
    };
    let dq: Vec<Vec<f32>> = per_head.iter().map(|g| g[0].clone()).collect();
    BaselineGrads {
        dq: scatter(&dq, p.q_shape()),
        dk: scatter(&group_sum(1), p.kv_shape()),
        dv: scatter(&group_sum(2), p.kv_shape()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compare_applies_the_rule() {
        let r = [1.0f64, 2.0, f64::INFINITY];
        let base = [1.001f32, 2.0, f32::INFINITY];
        let c = compare(&[1.0015, 2.0, f32::INFINITY], &r, &base);
        assert!(c.pass, "{c}");
        assert!((c.baseline_err - 1e-3).abs() < 1e-6);
        let c = compare(&[1.01, 2.0, f32::INFINITY], &r, &base);
        assert!(!c.pass && c.ratio > 1.0, "{c}");
        // Mismatched infinities and NaN fail.
        assert!(!compare(&[1.0, 2.0, 5.0], &r, &base).pass);
        let c = compare(&[f32::NAN, 2.0, f32::INFINITY], &r, &base);
        assert_eq!(c.nan_count, 1);
        assert!(!c.pass);
        // A baseline infinity mismatch does not widen the allowance.
        let c = compare(&[1.0, 2.0, f32::INFINITY], &r, &[1.0, 2.0, 0.0]);
        assert_eq!(c.baseline_err, 0.0);
    }

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
