//! The reference: attention in f64 over the dtype-rounded inputs, whole or one query row.

use rayon::prelude::*;

use super::{check_sinks, forward_all_rows, forward_one_row, head, problem, scatter};
use crate::config::{AttentionConfig, KeyRule};
use crate::tensor::{Element, TensorRef};

/// f64 reference forward: O `(b, s_q, h_q, d_v)` and LSE `(b, h_q, s_q)`, natural log.
#[derive(Clone, Debug)]
pub struct ReferenceForward {
    pub out: Vec<f64>,
    pub lse: Vec<f64>,
}

/// f64 reference gradients, packed like Q (dq), K (dk) and V (dv).
#[derive(Clone, Debug)]
pub struct ReferenceGrads {
    pub dq: Vec<f64>,
    pub dk: Vec<f64>,
    pub dv: Vec<f64>,
}

fn f64_of<T: Element>(x: T) -> f64 {
    x.to_f32() as f64
}

// ---------------------------------------------------------------------------------------------
// f64 reference.

/// One query row's softmax in f64: visible key range, probabilities over it, tanh of the
/// scaled scores (softcap only), the sink's probability (0 without a sink) and the LSE (+inf
/// when no key is visible, the sink's logit when there is one).
struct RowF64 {
    lo: usize,
    p: Vec<f64>,
    th: Vec<f64>,
    p_sink: f64,
    lse: f64,
}

fn row_f64(
    cfg: &AttentionConfig,
    mask: &KeyRule,
    q: &[f64],
    k: &[f64],
    i: usize,
    sink: Option<f32>,
) -> RowF64 {
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
    // A sink of −inf takes no part, as no sink (the kernels' convention: a row without keys
    // keeps LSE = +inf).
    let sink = sink.map(f64::from).filter(|x| *x != f64::NEG_INFINITY);
    if s.is_empty() {
        // The sink alone (when there is one) makes up the row's sum, and it has no value row.
        return RowF64 {
            lo,
            p: s,
            th,
            p_sink: if sink.is_some() { 1.0 } else { 0.0 },
            lse: sink.unwrap_or(f64::INFINITY),
        };
    }
    let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let m = sink.map_or(m, |x| m.max(x));
    let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
    let e_sink = sink.map_or(0.0, |x| (x - m).exp());
    // Adding the 0 of no sink leaves the (positive) sum exactly as it was.
    let l: f64 = e.iter().sum::<f64>() + e_sink;
    RowF64 {
        lo,
        p: e.iter().map(|x| x / l).collect(),
        th,
        p_sink: e_sink / l,
        lse: m + l.ln(),
    }
}

/// `Σ_j p_j · v[lo + j]` over V's `d` columns.
fn weighted_rows(p: &[f64], lo: usize, v: &[f64], d: usize) -> Vec<f64> {
    let mut o = vec![0f64; d];
    for (j, &pj) in p.iter().enumerate() {
        for (x, y) in o.iter_mut().zip(&v[(lo + j) * d..(lo + j + 1) * d]) {
            *x += pj * y;
        }
    }
    o
}

/// The output row and LSE of one row's f64 softmax (`dv`: V's head dim).
fn out_f64(
    cfg: &AttentionConfig,
    mask: &KeyRule,
    (qi, kh, vh): (&[f64], &[f64], &[f64]),
    dv: usize,
    i: usize,
    sink: Option<f32>,
) -> (Vec<f64>, f64) {
    let row = row_f64(cfg, mask, qi, kh, i, sink);
    (weighted_rows(&row.p, row.lo, vh, dv), row.lse)
}

fn row_impl<T: Element>(
    cfg: &AttentionConfig,
    (q, k, v): (TensorRef<T>, TensorRef<T>, TensorRef<T>),
    sinks: Option<&[f32]>,
    bhi: (usize, usize, usize),
) -> (Vec<f64>, f64) {
    forward_one_row(
        cfg,
        &q,
        &k,
        &v,
        sinks,
        bhi,
        f64_of,
        |mask, qi, kh, (vh, dv), i, sink| out_f64(cfg, mask, (qi, kh, vh), dv, i, sink),
    )
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
    row_impl(cfg, (q, k, v), None, (b, h, i))
}

/// [`reference_row`] with attention sinks: `sinks[h]` is query head `h`'s logit (see the module
/// documentation).
///
/// # Panics
/// On invalid operands, indices out of range, or `sinks.len() != heads_q`.
#[allow(clippy::too_many_arguments)]
pub fn reference_row_sinks<T: Element>(
    cfg: &AttentionConfig,
    q: TensorRef<T>,
    k: TensorRef<T>,
    v: TensorRef<T>,
    sinks: &[f32],
    b: usize,
    h: usize,
    i: usize,
) -> (Vec<f64>, f64) {
    row_impl(cfg, (q, k, v), Some(sinks), (b, h, i))
}

fn forward_impl<T: Element>(
    cfg: &AttentionConfig,
    (q, k, v): (TensorRef<T>, TensorRef<T>, TensorRef<T>),
    sinks: Option<&[f32]>,
) -> ReferenceForward {
    let (out, lse) = forward_all_rows(
        cfg,
        &q,
        &k,
        &v,
        sinks,
        f64_of,
        |mask, qi, kh, (vh, dv), i, sink| out_f64(cfg, mask, (qi, kh, vh), dv, i, sink),
    );
    ReferenceForward { out, lse }
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
    forward_impl(cfg, (q, k, v), None)
}

/// [`reference_forward`] with attention sinks: `sinks[h]` is query head `h`'s logit, in the
/// units of the scaled (and capped) scores. A row that sees no key gets `O = 0` and
/// `LSE = sinks[h]`.
///
/// # Panics
/// On invalid operands or `sinks.len() != heads_q`.
pub fn reference_forward_sinks<T: Element>(
    cfg: &AttentionConfig,
    q: TensorRef<T>,
    k: TensorRef<T>,
    v: TensorRef<T>,
    sinks: &[f32],
) -> ReferenceForward {
    forward_impl(cfg, (q, k, v), Some(sinks))
}

/// f64 gradients of `Σ dO∘O` with respect to Q, K, V (GQA: dK, dV summed over each group).
///
/// # Panics
/// On invalid operands or a `dout` not shaped like O.
pub fn reference_backward<T: Element>(
    cfg: &AttentionConfig,
    q: TensorRef<T>,
    k: TensorRef<T>,
    v: TensorRef<T>,
    dout: TensorRef<T>,
) -> ReferenceGrads {
    backward_impl(cfg, (q, k, v), dout, None).0
}

/// [`reference_backward`] with attention sinks, and the f64 gradient with respect to each sink
/// (one per query head): `d_sink[h] = −Σ_{b,i} P_sink,i·D_i` with `P_sink,i = exp(sink_h −
/// LSE_i)` and `D_i = Σ_j P_ij·dP_ij = dO_i·O_i`. dS keeps its form `P_ij(dP_ij − D_i)`: the
/// sink enters it only through the LSE that P is normalized by.
///
/// # Panics
/// On invalid operands, a `dout` not shaped like O, or `sinks.len() != heads_q`.
pub fn reference_backward_sinks<T: Element>(
    cfg: &AttentionConfig,
    q: TensorRef<T>,
    k: TensorRef<T>,
    v: TensorRef<T>,
    dout: TensorRef<T>,
    sinks: &[f32],
) -> (ReferenceGrads, Vec<f64>) {
    backward_impl(cfg, (q, k, v), dout, Some(sinks))
}

/// The backward, with the sinks' gradients (zeros without sinks).
fn backward_impl<T: Element>(
    cfg: &AttentionConfig,
    (q, k, v): (TensorRef<T>, TensorRef<T>, TensorRef<T>),
    dout: TensorRef<T>,
    sinks: Option<&[f32]>,
) -> (ReferenceGrads, Vec<f64>) {
    let p = problem(&q, &k, &v);
    assert_eq!(dout.layout.shape, p.o_shape(), "dout shape");
    check_sinks(sinks, &p);
    let (d, d_v, s_k) = (p.head_dim, p.head_dim_v, p.seqlen_k);
    let mask = cfg.key_rule(p.seqlen_q, p.seqlen_k);
    let scale = cfg.scale_for(d) as f64;
    // Per query head: dQ, this head's share of dK, dV, and its batch entry's share of d_sink.
    let per_head: Vec<([Vec<f64>; 3], f64)> = (0..p.batch * p.heads_q)
        .into_par_iter()
        .map(|bh| {
            let (b, h) = (bh / p.heads_q, bh % p.heads_q);
            let qh = head(&q, b, h, f64_of);
            let doh = head(&dout, b, h, f64_of);
            let kh = head(&k, b, h / p.group_size(), f64_of);
            let vh = head(&v, b, h / p.group_size(), f64_of);
            let mut dq = vec![0f64; p.seqlen_q * d];
            let mut dk = vec![0f64; s_k * d];
            let mut dv = vec![0f64; s_k * d_v];
            let sink = sinks.map(|s| s[h]);
            let mut d_sink = 0f64;
            for i in 0..p.seqlen_q {
                let (qi, doi) = (&qh[i * d..(i + 1) * d], &doh[i * d_v..(i + 1) * d_v]);
                let row = row_f64(cfg, &mask, qi, &kh, i, sink);
                let dp: Vec<f64> = (0..row.p.len())
                    .map(|j| {
                        let vj = &vh[(row.lo + j) * d_v..(row.lo + j + 1) * d_v];
                        doi.iter().zip(vj).map(|(a, b)| a * b).sum()
                    })
                    .collect();
                let dd: f64 = row.p.iter().zip(&dp).map(|(a, b)| a * b).sum();
                // The sink's column has no value, so its dP is 0 and its dS is P_sink(0 − D).
                d_sink -= row.p_sink * dd;
                for (j, &pj) in row.p.iter().enumerate() {
                    let kj = row.lo + j;
                    let mut ds = pj * (dp[j] - dd) * scale;
                    if cfg.softcap.is_some() {
                        ds *= 1.0 - row.th[j] * row.th[j];
                    }
                    for (x, &g) in dv[kj * d_v..(kj + 1) * d_v].iter_mut().zip(doi) {
                        *x += pj * g;
                    }
                    for x in 0..d {
                        dq[i * d + x] += ds * kh[kj * d + x];
                        dk[kj * d + x] += ds * qi[x];
                    }
                }
            }
            ([dq, dk, dv], d_sink)
        })
        .collect();
    // dK (which = 1, d wide) or dV (2, d_v wide) of each kv head, summed over its group.
    let group_sum = |which: usize, width: usize| -> Vec<Vec<f64>> {
        super::group_sum(&p, s_k * width, |bh| &per_head[bh].0[which][..])
    };
    let dq: Vec<Vec<f64>> = per_head.iter().map(|g| g.0[0].clone()).collect();
    let d_sink = (0..p.heads_q)
        .map(|h| (0..p.batch).map(|b| per_head[b * p.heads_q + h].1).sum())
        .collect();
    let grads = ReferenceGrads {
        dq: scatter(&dq, p.q_shape()),
        dk: scatter(&group_sum(1, d), p.kv_shape()),
        dv: scatter(&group_sum(2, d_v), p.v_shape()),
    };
    (grads, d_sink)
}
