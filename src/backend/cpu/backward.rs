//! The backward pass: dK and dV per (batch, kv head, key tile), dQ per (batch, query head,
//! query block), each recomputing P tile by tile from the forward's LSE (which, after a forward
//! with attention sinks, holds them: dQ, dK and dV need nothing else). Where the sinks' gradient
//! is asked for, the dQ tasks also sum `D_i = Σ_j P_ij·dP_ij` of their rows from the recomputed
//! P and dP, which the gradient is summed from afterwards.

use rayon::prelude::*;

use super::arith::{dot, probs_row, transpose, Arith};
use super::{store_rows, Ctx, TileForm, Tiles, LOG2_E};
use crate::config::AttentionConfig;
use crate::tensor::{Element, Problem};
use crate::{BackwardInputs, GradientsMut};

/// Per query block: Q (`br × dp`), dO (`br × dvp`), LSE in the base-2 domain and
/// `D = rowsum(dO∘O)` (over V's head dim).
struct QSide {
    q: Vec<f32>,
    dout: Vec<f32>,
    lse2: Vec<f32>,
    dd: Vec<f32>,
}

/// Everything the backward tasks read, converted to f32 once.
pub(super) struct BwdCtx<'a, T> {
    pub(super) base: Ctx<'a, T>,
    /// Per (b, h_q, query block).
    qside: Vec<QSide>,
    kt: Tiles,
    vt: Tiles,
    kr: Tiles,
}

/// Scratch of one backward tile: P and dS (`br × bc`) and, with softcap, tanh of the scores.
struct BwdScratch {
    p: Vec<f32>,
    ds: Vec<f32>,
    th: Vec<f32>,
}

impl BwdScratch {
    fn new<T>(c: &Ctx<T>) -> Self {
        let n = c.br * c.bc;
        BwdScratch {
            p: vec![0.0; n],
            ds: vec![0.0; n],
            th: if c.softcap.is_some() {
                vec![0.0; n]
            } else {
                Vec::new()
            },
        }
    }
}

impl<'a, T: Element> BwdCtx<'a, T> {
    pub(super) fn new(cfg: &AttentionConfig, p: &Problem, inputs: BackwardInputs<'a, T>) -> Self {
        let base = Ctx::new(cfg, p, inputs.q, inputs.k, inputs.v);
        let nqb = base.q_blocks();
        let qside = (0..p.batch * p.heads_q * nqb)
            .into_par_iter()
            .map(|t| {
                let (bh, qb) = (t / nqb, t % nqb);
                let (b, h, i0) = (bh / p.heads_q, bh % p.heads_q, qb * base.br);
                let dout = base.load_rows(&inputs.dout, b, h, i0, base.br);
                let o = base.load_rows(&inputs.out, b, h, i0, base.br);
                let dd = dout
                    .chunks_exact(base.dvp)
                    .zip(o.chunks_exact(base.dvp))
                    .map(|(x, y)| dot(x, y))
                    .collect();
                let lse2 = (i0..i0 + base.br)
                    .map(|i| match inputs.lse.get(bh * p.seqlen_q + i) {
                        Some(&l) if i < p.seqlen_q => l * LOG2_E,
                        _ => f32::INFINITY,
                    })
                    .collect();
                QSide {
                    q: base.load_rows(&base.q, b, h, i0, base.br),
                    dout,
                    lse2,
                    dd,
                }
            })
            .collect();
        BwdCtx {
            kt: base.tiles(&base.k, base.bc, TileForm::Cols),
            vt: base.tiles(&base.v, base.bc, TileForm::Cols),
            kr: base.tiles(&base.k, base.bc, TileForm::Rows),
            qside,
            base,
        }
    }

    fn qside(&self, b: usize, h: usize, qb: usize) -> &QSide {
        let c = &self.base;
        &self.qside[(b * c.heads_q + h) * c.q_blocks() + qb]
    }

    /// P and dS (with respect to the raw dot products Q·Kᵀ, softcap included, scale not) of
    /// query block `qb` of head `h` against key tile `t` into `sc`; where `rowsums` is given,
    /// adds each row's `Σ_j P_ij·dP_ij` over the tile to it.
    #[inline(always)]
    fn tile_grads<A: Arith>(
        &self,
        (b, h, qb): (usize, usize, usize),
        t: usize,
        sc: &mut BwdScratch,
        mut rowsums: Option<&mut [f64]>,
    ) {
        let c = &self.base;
        let (br, bc, dvp) = (c.br, c.bc, c.dvp);
        let hk = h / c.group;
        let qs = self.qside(b, h, qb);
        let ranges = c.tile_ranges(&c.row_ranges(qb).0, t);
        let th = c.softcap.map(|_| sc.th.as_mut_slice());
        let mult = c.scores::<A>(&qs.q, self.kt.get(b, hk, t), &ranges, &mut sc.p, th);
        for (r, &(lo, hi)) in ranges.iter().enumerate() {
            let row = &mut sc.p[r * bc..(r + 1) * bc];
            // A row with LSE = +inf is fully masked (or had no keys): it contributes nothing. A
            // NaN LSE (a NaN input or sink) makes its probabilities NaN, as on the GPU.
            if lo >= hi || qs.lse2[r] == f32::INFINITY {
                row.fill(0.0);
            } else {
                probs_row(row, (lo, hi), mult, qs.lse2[r]);
            }
        }
        // dP = dO·Vᵀ, then dS = P∘(dP − D) (∘ (1 − tanh²) with softcap).
        let vt = self.vt.get(b, hk, t);
        A::gemm((br, bc, dvp), &qs.dout, dvp, vt, bc, &mut sc.ds, bc, false);
        for r in 0..br {
            let d = qs.dd[r];
            let (p, ds) = (&sc.p[r * bc..][..bc], &mut sc.ds[r * bc..][..bc]);
            if let Some(sums) = rowsums.as_deref_mut() {
                sums[r] += dot(p, ds) as f64;
            }
            for (x, &pv) in ds.iter_mut().zip(p) {
                *x = pv * (*x - d);
            }
            if c.softcap.is_some() {
                for (x, &t) in ds.iter_mut().zip(&sc.th[r * bc..][..bc]) {
                    *x *= 1.0 - t * t;
                }
            }
        }
    }

    /// dK (`bc × dp`, already scaled) and dV (`bc × dvp`) of key tile `t` of kv head `hk`,
    /// summed over the query heads of its group.
    #[inline(always)]
    pub(super) fn dkdv_block<A: Arith>(
        &self,
        b: usize,
        hk: usize,
        t: usize,
    ) -> (Vec<f32>, Vec<f32>) {
        let c = &self.base;
        let (br, bc, dp, dvp) = (c.br, c.bc, c.dp, c.dvp);
        let mut dk = vec![0f32; bc * dp];
        let mut dv = vec![0f32; bc * dvp];
        let mut sc = BwdScratch::new(c);
        let mut tr = vec![0f32; bc * br];
        // Query rows that see any key of this tile: contiguous, as both ends of the key range
        // are non-decreasing in the row index.
        let (c0, end) = (t * bc, ((t + 1) * bc).min(c.s_k));
        let sees = |i: usize| {
            let (lo, hi) = c.mask.key_range(i);
            lo < hi && lo < end && hi > c0
        };
        let Some(first) = (0..c.s_q).find(|&i| sees(i)) else {
            return (dk, dv);
        };
        let last = (first..c.s_q).rev().find(|&i| sees(i)).unwrap_or(first);
        for h in hk * c.group..(hk + 1) * c.group {
            for qb in first / br..=last / br {
                self.tile_grads::<A>((b, h, qb), t, &mut sc, None);
                let qs = self.qside(b, h, qb);
                // dV += Pᵀ·dO, dK += dSᵀ·Q.
                transpose(&sc.p, br, bc, &mut tr);
                A::gemm((bc, dvp, br), &tr, br, &qs.dout, dvp, &mut dv, dvp, true);
                transpose(&sc.ds, br, bc, &mut tr);
                A::gemm((bc, dp, br), &tr, br, &qs.q, dp, &mut dk, dp, true);
            }
        }
        dk.iter_mut().for_each(|x| *x *= c.scale);
        (dk, dv)
    }

    /// dQ (`br × dp`, scaled) of query block `qb` of head `h`, and where `rowsums` is set, its
    /// rows' `D_i = Σ_j P_ij·dP_ij` (`br`, summed over the key tiles in order; 0 for rows that
    /// see no key).
    #[inline(always)]
    pub(super) fn dq_block<A: Arith>(
        &self,
        b: usize,
        h: usize,
        qb: usize,
        rowsums: bool,
    ) -> (Vec<f32>, Option<Vec<f64>>) {
        let c = &self.base;
        let (br, bc, dp) = (c.br, c.bc, c.dp);
        let mut dq = vec![0f32; br * dp];
        let mut sums = rowsums.then(|| vec![0f64; br]);
        let mut sc = BwdScratch::new(c);
        for t in c.tiles_of(c.row_ranges(qb).1) {
            self.tile_grads::<A>((b, h, qb), t, &mut sc, sums.as_deref_mut());
            let k = self.kr.get(b, h / c.group, t);
            A::gemm((br, dp, bc), &sc.ds, bc, k, dp, &mut dq, dp, true);
        }
        dq.iter_mut().for_each(|x| *x *= c.scale);
        (dq, sums)
    }
}

#[inline(always)]
fn dkdv_block<T: Element, A: Arith>(
    ctx: &BwdCtx<T>,
    b: usize,
    hk: usize,
    t: usize,
) -> (Vec<f32>, Vec<f32>) {
    ctx.dkdv_block::<A>(b, hk, t)
}
simd_dispatch!(pub(super) fn dkdv_simd(ctx: &BwdCtx<T>, b: usize, hk: usize, t: usize) -> (Vec<f32>, Vec<f32>) = dkdv_block);

#[inline(always)]
fn dq_block<T: Element, A: Arith>(
    ctx: &BwdCtx<T>,
    b: usize,
    h: usize,
    qb: usize,
    rowsums: bool,
) -> (Vec<f32>, Option<Vec<f64>>) {
    ctx.dq_block::<A>(b, h, qb, rowsums)
}
simd_dispatch!(pub(super) fn dq_simd(ctx: &BwdCtx<T>, b: usize, h: usize, qb: usize, rowsums: bool) -> (Vec<f32>, Option<Vec<f64>>) = dq_block);

/// One backward task: a key tile's dK and dV, or a query block's dQ.
enum BwdTask {
    KeyTile { b: usize, hk: usize, t: usize },
    QueryBlock { b: usize, h: usize, qb: usize },
}

/// What a [`BwdTask`] gives: `dk` (`bc × dp`) and `dv` (`bc × dvp`) of a key tile, or `dq`
/// (`br × dp`) and, where asked for, the rows' `Σ P∘dP` of a query block.
enum BwdBlock {
    KeyTile {
        dk: Vec<f32>,
        dv: Vec<f32>,
    },
    QueryBlock {
        dq: Vec<f32>,
        rowsums: Option<Vec<f64>>,
    },
}

/// Backward pass: writes dQ (like Q), dK (like K) and dV (like V), and where `grads.dsinks` is
/// given, the attention sinks' gradient into it (see [`sink_grads`]). Operands must have been
/// validated (see [`crate::backward_into`]): `dsinks` comes with `inputs.sinks`, and both hold
/// at least heads_q values.
pub(crate) fn backward<T: Element>(
    cfg: &AttentionConfig,
    p: &Problem,
    inputs: BackwardInputs<T>,
    grads: GradientsMut<T>,
) {
    let GradientsMut {
        mut dq,
        mut dk,
        mut dv,
        dsinks,
    } = grads;
    let sinks = inputs.sinks.zip(dsinks);
    let ctx = BwdCtx::new(cfg, p, inputs);
    let c = &ctx.base;
    let rowsums = sinks.is_some();
    let mut tasks = Vec::new();
    for b in 0..p.batch {
        for hk in 0..c.heads_kv {
            tasks.extend((0..c.k_tiles()).map(|t| BwdTask::KeyTile { b, hk, t }));
        }
        for h in 0..p.heads_q {
            tasks.extend((0..c.q_blocks()).map(|qb| BwdTask::QueryBlock { b, h, qb }));
        }
    }
    let blocks: Vec<BwdBlock> = tasks
        .par_iter()
        .map(|task| match *task {
            BwdTask::KeyTile { b, hk, t } => {
                let (dk, dv) = dkdv_simd(&ctx, b, hk, t);
                BwdBlock::KeyTile { dk, dv }
            }
            BwdTask::QueryBlock { b, h, qb } => {
                let (dq, rowsums) = dq_simd(&ctx, b, h, qb, rowsums);
                BwdBlock::QueryBlock { dq, rowsums }
            }
        })
        .collect();
    // D of every row, (batch, heads_q, seqlen_q) packed like the LSE (where asked for).
    let mut dd = vec![0f64; if rowsums { inputs.lse.len() } else { 0 }];
    for (task, blk) in tasks.iter().zip(&blocks) {
        match (task, blk) {
            (&BwdTask::KeyTile { b, hk, t }, BwdBlock::KeyTile { dk: bk, dv: bv }) => {
                store_rows(&mut dk, b, hk, t * c.bc, bk, c.dp);
                store_rows(&mut dv, b, hk, t * c.bc, bv, c.dvp);
            }
            (&BwdTask::QueryBlock { b, h, qb }, BwdBlock::QueryBlock { dq: bq, rowsums }) => {
                store_rows(&mut dq, b, h, qb * c.br, bq, c.dp);
                if let Some(sums) = rowsums {
                    let i0 = qb * c.br;
                    let n = c.br.min(p.seqlen_q - i0);
                    dd[(b * p.heads_q + h) * p.seqlen_q + i0..][..n].copy_from_slice(&sums[..n]);
                }
            }
            _ => unreachable!("each task gives its own kind of block"),
        }
    }
    if let Some((sinks, dsinks)) = sinks {
        sink_grads(p, inputs.lse, &dd, sinks, dsinks);
    }
}

/// The attention sinks' gradient: `dsinks[h] = −Σ_{b,i} exp(sinks[h] − LSE_i)·D_i` over query
/// head `h`'s rows `i` of every batch entry `b`, with the forward's LSE (with the sinks) and
/// `D_i = Σ_j P_ij·dP_ij` (`= rowsum(dO_i ∘ O_i)` in exact arithmetic) as the dQ tasks summed it
/// from the recomputed f32 P and dP, rather than from O as stored: O rounded to a 16-bit type
/// would put its rounding error into every term. In f64, one task per head summing its rows in
/// order (batch entry, then row), so that the result does not depend on scheduling; rounded to
/// f32 once. Writes `dsinks[..heads_q]`.
fn sink_grads(p: &Problem, lse: &[f32], dd: &[f64], sinks: &[f32], dsinks: &mut [f32]) {
    let grads: Vec<f64> = (0..p.heads_q)
        .into_par_iter()
        .map(|h| {
            let sink = sinks[h] as f64;
            let mut sum = 0f64;
            for b in 0..p.batch {
                let rows = (b * p.heads_q + h) * p.seqlen_q..(b * p.heads_q + h + 1) * p.seqlen_q;
                for (&l, &d) in lse[rows.clone()].iter().zip(&dd[rows]) {
                    sum += (sink - l as f64).exp() * d;
                }
            }
            -sum
        })
        .collect();
    for (x, g) in dsinks[..p.heads_q].iter_mut().zip(grads) {
        *x = g as f32;
    }
}
