//! The reference: attention in f64 over the dtype-rounded inputs, whole or one query row.

use rayon::prelude::*;

use super::{forward_all_rows, forward_one_row, head, problem, scatter};
use crate::config::{AttentionConfig, KeyRule};
use crate::tensor::{Element, TensorRef};

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

fn f64_of<T: Element>(x: T) -> f64 {
    x.to_f32() as f64
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

fn row_f64(cfg: &AttentionConfig, mask: &KeyRule, q: &[f64], k: &[f64], i: usize) -> RowF64 {
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
    let (d, s_k, mask) = (p.head_dim, p.seqlen_k, cfg.key_rule(p.seqlen_q, p.seqlen_k));
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
