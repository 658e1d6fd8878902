//! The forward pass: one task per (batch, query head, query block), with the online softmax
//! over the key tiles its rows can see, and the head's attention sink, where there is one, as
//! one more score without a value row when the rows are finalized.

use rayon::prelude::*;

use super::arith::{max_of, probs_row, Arith};
use super::{store_rows, Ctx, TileForm, Tiles};
use crate::config::AttentionConfig;
use crate::tensor::{Element, Problem, TensorMut};
use crate::ForwardInputs;

/// Output rows (`br × dvp`, f32, already divided by the row sums) and the LSE of one task.
pub(super) struct FwdBlock {
    pub(super) o: Vec<f32>,
    pub(super) lse: Vec<f32>,
}

/// One task's rows; `sink` is head `h`'s attention sink logit (`None`: no sink).
#[inline(always)]
pub(super) fn fwd_block<T: Element, A: Arith>(
    ctx: &Ctx<T>,
    (kt, v): (&Tiles, &Tiles),
    b: usize,
    h: usize,
    qb: usize,
    sink: Option<f32>,
) -> FwdBlock {
    let (br, bc, dvp) = (ctx.br, ctx.bc, ctx.dvp);
    let hk = h / ctx.group;
    let q = ctx.load_rows(&ctx.q, b, h, qb * br, br);
    let (rows, union) = ctx.row_ranges(qb);
    let mut m = vec![f32::NEG_INFINITY; br];
    let mut l = vec![0f32; br];
    let mut acc = vec![0f32; br * dvp];
    let mut s = vec![0f32; br * bc];
    for t in ctx.tiles_of(union) {
        let ranges = ctx.tile_ranges(&rows, t);
        let mult = ctx.scores::<A>(&q, kt.get(b, hk, t), &ranges, &mut s, None);
        for (r, &(lo, hi)) in ranges.iter().enumerate() {
            let row = &mut s[r * bc..(r + 1) * bc];
            if lo >= hi {
                row.fill(0.0);
                continue;
            }
            // mult > 0, so the max of the scaled scores is the scaled max.
            let m_new = m[r].max(max_of(&row[lo..hi]) * mult);
            let alpha = (m[r] - m_new).exp2();
            l[r] = l[r] * alpha + probs_row(row, (lo, hi), mult, m_new);
            m[r] = m_new;
            if alpha != 1.0 {
                acc[r * dvp..(r + 1) * dvp]
                    .iter_mut()
                    .for_each(|x| *x *= alpha);
            }
        }
        A::gemm(
            (br, dvp, bc),
            &s,
            bc,
            v.get(b, hk, t),
            dvp,
            &mut acc,
            dvp,
            true,
        );
    }
    let sink_log2 = sink_log2(sink);
    let mut lse = vec![f32::INFINITY; br];
    for r in 0..br {
        let row = &mut acc[r * dvp..(r + 1) * dvp];
        if let Some(sink_log2) = sink_log2 {
            let (inv, row_lse) = sink_share(m[r], l[r], sink_log2);
            if l[r] != 0.0 {
                row.iter_mut().for_each(|x| *x *= inv);
            } else {
                // No key: O = 0 (NaN where the sink made the LSE NaN), whatever the value rows
                // of the tiles it skipped held.
                row.fill(0.0 * inv);
            }
            lse[r] = row_lse;
            continue;
        }
        // Rows that saw no key: O = 0, LSE = +inf. A NaN score makes l NaN, and O and the LSE
        // with it.
        if l[r] != 0.0 {
            let inv = 1.0 / l[r];
            row.iter_mut().for_each(|x| *x *= inv);
            lse[r] = ((m[r] as f64 + (l[r] as f64).log2()) * std::f64::consts::LN_2) as f32;
        } else {
            row.fill(0.0);
        }
    }
    FwdBlock { o: acc, lse }
}

/// A row's softmax with an attention sink, in f64: the row's
/// running max `m` and sum `l` (of `2^(s − m)` over its keys; `l` = 0 and `m` = −inf where it
/// saw none) and the sink's logit in the same base-2 units, both rescaled to the larger of the
/// max and the sink so that neither overflows. Returns what the row's accumulator (kept against
/// `m`) is multiplied by and the natural-log LSE over the keys and the sink. A row that saw no
/// key gets a factor of 0 (O = 0) and LSE = the sink; a NaN score or sink makes both NaN.
fn sink_share(m: f32, l: f32, sink_log2: f64) -> (f32, f32) {
    // f64::max, like fmaxf, leaves the sink where the max is NaN (the sum is NaN then).
    let top = (m as f64).max(sink_log2);
    let keep = (m as f64 - top).exp2();
    let total = l as f64 * keep + (sink_log2 - top).exp2();
    let lse = (top + total.log2()) * std::f64::consts::LN_2;
    ((keep / total) as f32, lse as f32)
}

/// A sink's logit in base-2 units, `None` for no sink or one of −inf, which weighs nothing: the
/// rows are finalized as without one (as on the GPU).
fn sink_log2(sink: Option<f32>) -> Option<f64> {
    sink.map(|x| x as f64 * std::f64::consts::LOG2_E)
        .filter(|&x| x != f64::NEG_INFINITY)
}

/// The LSE of a row that sees no key, as [`fwd_block`] finalizes it: +inf without a sink, the
/// sink's logit with one (NaN for +inf or NaN). For callers that skip such rows' blocks.
pub(crate) fn keyless_lse(sink: Option<f32>) -> f32 {
    sink_log2(sink).map_or(f32::INFINITY, |s| sink_share(f32::NEG_INFINITY, 0.0, s).1)
}

simd_dispatch!(pub(super) fn fwd_block_simd(ctx: &Ctx<T>, kv: (&Tiles, &Tiles), b: usize, h: usize, qb: usize, sink: Option<f32>) -> FwdBlock = fwd_block);

/// Forward pass: writes `out` (like Q, with V's head dim) and `lse` (batch, heads_q, seqlen_q).
/// `inputs.sinks`, where given, holds (at least) one attention sink logit per query head.
/// Operands must have been validated (see [`crate::forward_into`]).
pub(crate) fn forward<T: Element>(
    cfg: &AttentionConfig,
    p: &Problem,
    inputs: ForwardInputs<T>,
    mut out: TensorMut<T>,
    lse: &mut [f32],
) {
    let ForwardInputs { q, k, v, sinks } = inputs;
    let ctx = Ctx::new(cfg, p, q, k, v);
    let kt = ctx.tiles(&ctx.k, ctx.bc, TileForm::Cols);
    let vr = ctx.tiles(&ctx.v, ctx.bc, TileForm::Rows);
    let nqb = ctx.q_blocks();
    let blocks: Vec<FwdBlock> = (0..p.batch * p.heads_q * nqb)
        .into_par_iter()
        .map(|t| {
            let (bh, qb) = (t / nqb, t % nqb);
            let (b, h) = (bh / p.heads_q, bh % p.heads_q);
            fwd_block_simd(&ctx, (&kt, &vr), b, h, qb, sinks.map(|s| s[h]))
        })
        .collect();
    // Outputs reach each element once, but may interleave with any strides: one thread writes.
    for (t, blk) in blocks.iter().enumerate() {
        let (bh, qb) = (t / nqb, t % nqb);
        let i0 = qb * ctx.br;
        let n = ctx.br.min(p.seqlen_q - i0);
        store_rows(
            &mut out,
            bh / p.heads_q,
            bh % p.heads_q,
            i0,
            &blk.o,
            ctx.dvp,
        );
        lse[bh * p.seqlen_q + i0..][..n].copy_from_slice(&blk.lse[..n]);
    }
}
