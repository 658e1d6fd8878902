//! The baseline: standard attention computed in the low precision `T` the way a framework
//! does it, whose error against the reference sets the allowance of the rule.

use rayon::prelude::*;

use super::{check_sinks, forward_all_rows, forward_one_row, head, problem, scatter};
use crate::config::{AttentionConfig, KeyRule};
use crate::tensor::{Element, TensorRef};

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

/// Rounds an f32 to the nearest `T` (identity for f32).
fn rt<T: Element>(x: f32) -> f32 {
    T::from_f32(x).to_f32()
}

// ---------------------------------------------------------------------------------------------
// Dtype-emulating baseline.

/// One query row of the baseline in `T`: visible range, P (rounded to `T`), the tanh values
/// (rounded to `T`, softcap only), the sink's probability in f32 (0 without a sink) and the
/// f32 LSE.
struct RowLow {
    lo: usize,
    p: Vec<f32>,
    th: Vec<f32>,
    p_sink: f32,
    lse: f32,
}

/// The sink, where there is one, is one more column of the f32 softmax, taken as given: it is
/// an f32 parameter, which a framework promotes the scores to rather than rounding it to `T`
/// (and so a row that sees no key has exactly the sink's logit as its LSE).
fn row_low<T: Element>(
    cfg: &AttentionConfig,
    mask: &KeyRule,
    q: &[f32],
    k: &[f32],
    i: usize,
    sink: Option<f32>,
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
    // A sink of −inf takes no part, as no sink (as in the reference).
    let sink = sink.filter(|x| *x != f32::NEG_INFINITY);
    if s.is_empty() {
        return RowLow {
            lo,
            p: Vec::new(),
            th,
            p_sink: if sink.is_some() { 1.0 } else { 0.0 },
            lse: sink.unwrap_or(f32::INFINITY),
        };
    }
    // Softmax in f32, rounded to T (the sink's column is dropped before anything reads it in T).
    let m = s.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let m = sink.map_or(m, |x| m.max(x));
    let e: Vec<f32> = s.iter().map(|x| (x - m).exp()).collect();
    let e_sink = sink.map_or(0.0, |x| (x - m).exp());
    // Adding the 0 of no sink leaves the (positive) sum exactly as it was.
    let l: f32 = e.iter().sum::<f32>() + e_sink;
    RowLow {
        lo,
        p: e.iter().map(|x| rt::<T>(x / l)).collect(),
        th,
        p_sink: e_sink / l,
        lse: m + l.ln(),
    }
}

/// A baseline output row: `P·V` over V's `d` columns, accumulated in f32, rounded to `T`.
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

/// The output row and LSE of one row of the baseline (`dv`: V's head dim).
fn out_low<T: Element>(
    cfg: &AttentionConfig,
    mask: &KeyRule,
    (qi, kh, vh): (&[f32], &[f32], &[f32]),
    dv: usize,
    i: usize,
    sink: Option<f32>,
) -> (Vec<f32>, f32) {
    let row = row_low::<T>(cfg, mask, qi, kh, i, sink);
    (low_out_row::<T>(&row, vh, dv), row.lse)
}

fn forward_impl<T: Element>(
    cfg: &AttentionConfig,
    (q, k, v): (TensorRef<T>, TensorRef<T>, TensorRef<T>),
    sinks: Option<&[f32]>,
) -> BaselineForward {
    let (out, lse) = forward_all_rows(
        cfg,
        &q,
        &k,
        &v,
        sinks,
        T::to_f32,
        |mask, qi, kh, (vh, dv), i, sink| out_low::<T>(cfg, mask, (qi, kh, vh), dv, i, sink),
    );
    BaselineForward { out, lse }
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
    forward_impl(cfg, (q, k, v), None)
}

/// [`baseline_forward`] with attention sinks: `sinks[h]` joins query head `h`'s f32 softmax as
/// one more column that has no value row. A row that sees no key gets `O = 0` and
/// `LSE = sinks[h]`.
///
/// # Panics
/// On invalid operands or `sinks.len() != heads_q`.
pub fn baseline_forward_sinks<T: Element>(
    cfg: &AttentionConfig,
    q: TensorRef<T>,
    k: TensorRef<T>,
    v: TensorRef<T>,
    sinks: &[f32],
) -> BaselineForward {
    forward_impl(cfg, (q, k, v), Some(sinks))
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
    row_impl(cfg, (q, k, v), None, (b, h, i))
}

/// [`baseline_row`] with attention sinks, as [`baseline_forward_sinks`] computes it.
///
/// # Panics
/// On invalid operands, indices out of range, or `sinks.len() != heads_q`.
#[allow(clippy::too_many_arguments)]
pub fn baseline_row_sinks<T: Element>(
    cfg: &AttentionConfig,
    q: TensorRef<T>,
    k: TensorRef<T>,
    v: TensorRef<T>,
    sinks: &[f32],
    b: usize,
    h: usize,
    i: usize,
) -> (Vec<f32>, f32) {
    row_impl(cfg, (q, k, v), Some(sinks), (b, h, i))
}

fn row_impl<T: Element>(
    cfg: &AttentionConfig,
    (q, k, v): (TensorRef<T>, TensorRef<T>, TensorRef<T>),
    sinks: Option<&[f32]>,
    bhi: (usize, usize, usize),
) -> (Vec<f32>, f32) {
    forward_one_row(
        cfg,
        &q,
        &k,
        &v,
        sinks,
        bhi,
        T::to_f32,
        |mask, qi, kh, (vh, dv), i, sink| out_low::<T>(cfg, mask, (qi, kh, vh), dv, i, sink),
    )
}

/// The baseline's backward, as a framework's autograd would run it in `T`: dV = Pᵀ·dO,
/// dP = dO·Vᵀ, the softmax backward dS = P∘(dP − rowsum(P∘dP)), the softcap and scale chain
/// rule one op at a time, dQ = dS·K and dK = dSᵀ·Q; each product accumulated in f32 and
/// rounded to `T`. GQA: each head's dK, dV rounded to `T`, then summed over the group in f32
/// and rounded again (the gradient of repeating the kv heads).
///
/// # Panics
/// On invalid operands or a `dout` not shaped like O.
pub fn baseline_backward<T: Element>(
    cfg: &AttentionConfig,
    q: TensorRef<T>,
    k: TensorRef<T>,
    v: TensorRef<T>,
    dout: TensorRef<T>,
) -> BaselineGrads {
    backward_impl(cfg, (q, k, v), dout, None).0
}

/// [`baseline_backward`] with attention sinks, and the gradient with respect to each sink (one
/// per query head, f32 like the sinks), as autograd runs the softmax backward over the sink's
/// column: its dP is 0 (the column was dropped before P·V), so its dS is `−P_sink,i·D_i`, with
/// `P_sink` the f32 softmax's and `D_i = rowsum(P∘dP)` from the rounded P and dP; summed over
/// the batch and the rows in f32 (the gradient of broadcasting the sink).
///
/// # Panics
/// On invalid operands, a `dout` not shaped like O, or `sinks.len() != heads_q`.
pub fn baseline_backward_sinks<T: Element>(
    cfg: &AttentionConfig,
    q: TensorRef<T>,
    k: TensorRef<T>,
    v: TensorRef<T>,
    dout: TensorRef<T>,
    sinks: &[f32],
) -> (BaselineGrads, Vec<f32>) {
    backward_impl(cfg, (q, k, v), dout, Some(sinks))
}

/// The backward, with the sinks' gradients (zeros without sinks).
fn backward_impl<T: Element>(
    cfg: &AttentionConfig,
    (q, k, v): (TensorRef<T>, TensorRef<T>, TensorRef<T>),
    dout: TensorRef<T>,
    sinks: Option<&[f32]>,
) -> (BaselineGrads, Vec<f32>) {
    let p = problem(&q, &k, &v);
    assert_eq!(dout.layout.shape, p.o_shape(), "dout shape");
    check_sinks(sinks, &p);
    let (d, d_v, s_q, s_k) = (p.head_dim, p.head_dim_v, p.seqlen_q, p.seqlen_k);
    let mask = cfg.key_rule(s_q, s_k);
    let scale = cfg.scale_for(d);
    let per_head: Vec<([Vec<f32>; 3], f32)> = (0..p.batch * p.heads_q)
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
            let sink = sinks.map(|s| s[h]);
            let mut d_sink = 0f32;
            for i in 0..s_q {
                let (qi, doi) = (&qh[i * d..(i + 1) * d], &doh[i * d_v..(i + 1) * d_v]);
                let row = row_low::<T>(cfg, &mask, qi, &kh, i, sink);
                let dp: Vec<f32> = (0..row.p.len())
                    .map(|j| {
                        let vj = &vh[(row.lo + j) * d_v..(row.lo + j + 1) * d_v];
                        rt::<T>(doi.iter().zip(vj).map(|(a, b)| a * b).sum())
                    })
                    .collect();
                let dd: f32 = row.p.iter().zip(&dp).map(|(a, b)| a * b).sum();
                d_sink -= row.p_sink * dd;
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
            let mut dv = vec![0f32; s_k * d_v];
            for i in 0..s_q {
                for j in 0..s_k {
                    let (pij, gij) = (pm[i * s_k + j], g[i * s_k + j]);
                    for x in 0..d {
                        dq[i * d + x] += gij * kh[j * d + x];
                        dk[j * d + x] += gij * qh[i * d + x];
                    }
                    for x in 0..d_v {
                        dv[j * d_v + x] += pij * doh[i * d_v + x];
                    }
                }
            }
            let grads = [dq, dk, dv].map(|t| t.into_iter().map(rt::<T>).collect());
            (grads, d_sink)
        })
        .collect();
    // dK (which = 1, d wide) or dV (2, d_v wide) of each kv head, summed over its group.
    let group_sum = |which: usize, width: usize| -> Vec<Vec<f32>> {
        super::group_sum(&p, s_k * width, |bh| &per_head[bh].0[which][..])
            .into_iter()
            .map(|acc| acc.into_iter().map(rt::<T>).collect())
            .collect()
    };
    let dq: Vec<Vec<f32>> = per_head.iter().map(|g| g.0[0].clone()).collect();
    let d_sink = (0..p.heads_q)
        .map(|h| (0..p.batch).map(|b| per_head[b * p.heads_q + h].1).sum())
        .collect();
    let grads = BaselineGrads {
        dq: scatter(&dq, p.q_shape()),
        dk: scatter(&group_sum(1, d), p.kv_shape()),
        dv: scatter(&group_sum(2, d_v), p.v_shape()),
    };
    (grads, d_sink)
}
