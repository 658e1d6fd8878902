//! The CPU backend: FlashAttention-2's tiled algorithm on host memory.
//!
//! Forward: each task owns a block of query rows of one (batch, head) and walks the key blocks
//! that its rows can see, keeping a running row max `m` and running sum `l` (online softmax) and
//! an f32 output accumulator that is rescaled when the max grows; one division at the end.
//! Scores live in the base-2 domain (`log2(e)·scale` folded into one multiply) so that every
//! exponential is an `exp2`. An attention sink joins each row's softmax at that division, as one
//! more score without a value row.
//!
//! Backward: recomputes `P = exp(S·scale − LSE)` tile by tile. One parallel pass over
//! (batch, kv head, key block) accumulates dK and dV over every query head of the group and
//! every query block; a second pass over (batch, query head, query block) accumulates dQ. No
//! task writes another's rows, so the result does not depend on scheduling (deterministic).
//! The sinks' gradient, where asked for, is summed per head afterwards from each row's
//! `Σ P∘dP`, which the dQ pass adds up.
//!
//! V's head dim may differ from Q's and K's (`d_v`, DeepSeek's MLA trains with 192 and 128):
//! Q, K, dQ and dK are `d` wide, V, O, dO and dV `d_v`, each padded on its own.
//!
//! K and V (and, for the backward, the query side) are converted to f32 once, tile by tile,
//! zero-padded to whole micro-kernel blocks; all arithmetic is f32, and results are rounded to
//! `T` when written. Tasks return their blocks and one thread writes them, so outputs may have
//! any strides. On x86-64 the task functions are compiled a second time with AVX2+FMA, picked
//! at run time, and the tile matrix products run a 6×16 register-blocked intrinsics kernel.

use rayon::prelude::*;

use crate::config::{AttentionConfig, KeyRule};
use crate::tensor::{Element, Problem, TensorMut, TensorRef};
use arith::{transpose, Arith};

mod arith;

pub(crate) use backward::backward;
pub(crate) use forward::{forward, keyless_lse};

/// Query rows per tile (upper bound; small problems use fewer).
const BLOCK_Q: usize = 64;
/// Keys per tile (upper bound).
const BLOCK_K: usize = 64;
/// Query tiles are padded to a multiple of this (the matrix product takes rows in pairs).
const ROW_PAD: usize = 4;
/// Micro-kernel: columns of B per step (two AVX registers); key tiles and both head dims are
/// padded to a multiple of it.
const NR: usize = 16;

const LOG2_E: f32 = std::f32::consts::LOG2_E;

fn round_up(x: usize, to: usize) -> usize {
    x.div_ceil(to) * to
}

// ---------------------------------------------------------------------------------------------
// Problem-wide constants and tile loading.

struct Ctx<'a, T> {
    q: TensorRef<'a, T>,
    k: TensorRef<'a, T>,
    v: TensorRef<'a, T>,
    mask: KeyRule,
    group: usize,
    s_q: usize,
    s_k: usize,
    heads_q: usize,
    heads_kv: usize,
    /// head_dim (Q's and K's) rounded up to [`NR`]: the width of Q, K, dQ and dK rows.
    dp: usize,
    /// head_dim_v rounded up to [`NR`]: the width of V, O, dO and dV rows.
    dvp: usize,
    /// Query rows per tile for this problem.
    br: usize,
    /// Keys per tile for this problem.
    bc: usize,
    scale: f32,
    softcap: Option<f32>,
}

/// How a tile of a (b, s, h, d) tensor is laid out once converted to f32, with `w` its head dim
/// padded (`dp` or `dvp`).
#[derive(Clone, Copy)]
enum TileForm {
    /// `rows × w`, row-major.
    Rows,
    /// `w × rows`: the transpose (keys as columns for `Q·Kᵀ` and `dO·Vᵀ`).
    Cols,
}

/// The f32 tiles of one tensor, each converted once: tile `t` of head `h` of batch `b` covers
/// sequence positions `t·rows ..` (zero-padded past the end).
struct Tiles {
    tiles: Vec<Vec<f32>>,
    heads: usize,
    per_head: usize,
}

impl Tiles {
    fn get(&self, b: usize, h: usize, t: usize) -> &[f32] {
        &self.tiles[(b * self.heads + h) * self.per_head + t]
    }
}

impl<'a, T: Element> Ctx<'a, T> {
    fn new(
        cfg: &AttentionConfig,
        p: &Problem,
        q: TensorRef<'a, T>,
        k: TensorRef<'a, T>,
        v: TensorRef<'a, T>,
    ) -> Self {
        Ctx {
            q,
            k,
            v,
            mask: cfg.key_rule(p.seqlen_q, p.seqlen_k),
            group: p.group_size(),
            s_q: p.seqlen_q,
            s_k: p.seqlen_k,
            heads_q: p.heads_q,
            heads_kv: p.heads_kv,
            dp: round_up(p.head_dim, NR),
            dvp: round_up(p.head_dim_v, NR),
            br: BLOCK_Q.min(round_up(p.seqlen_q, ROW_PAD)),
            bc: BLOCK_K.min(round_up(p.seqlen_k, NR)),
            scale: cfg.scale_for(p.head_dim),
            softcap: cfg.softcap,
        }
    }

    fn q_blocks(&self) -> usize {
        self.s_q.div_ceil(self.br)
    }

    fn k_tiles(&self) -> usize {
        self.s_k.div_ceil(self.bc)
    }

    /// Key range `[lo, hi)` of each row of query block `qb` (padding rows and fully masked
    /// rows get an empty range), and the union of the non-empty ones.
    fn row_ranges(&self, qb: usize) -> (Vec<(usize, usize)>, (usize, usize)) {
        let mut union = (usize::MAX, 0);
        let i0 = qb * self.br;
        let ranges = (i0..i0 + self.br)
            .map(|i| {
                if i >= self.s_q {
                    return (0, 0);
                }
                let (lo, hi) = self.mask.key_range(i);
                if lo < hi {
                    union = (union.0.min(lo), union.1.max(hi));
                }
                (lo, hi)
            })
            .collect();
        (ranges, union)
    }

    /// Key tiles that a union of key ranges touches.
    fn tiles_of(&self, (lo, hi): (usize, usize)) -> std::ops::Range<usize> {
        if lo >= hi {
            return 0..0;
        }
        lo / self.bc..hi.div_ceil(self.bc)
    }

    /// Ranges of `rows` relative to key tile `kt`, clipped to its valid keys.
    fn tile_ranges(&self, rows: &[(usize, usize)], kt: usize) -> Vec<(usize, usize)> {
        let c0 = kt * self.bc;
        let end = (c0 + self.bc).min(self.s_k);
        rows.iter()
            .map(|&(lo, hi)| {
                let (lo, hi) = (lo.clamp(c0, end) - c0, hi.clamp(c0, end) - c0);
                if lo < hi {
                    (lo, hi)
                } else {
                    (0, 0)
                }
            })
            .collect()
    }

    /// `rows × w` f32 block of positions `i0..` of head `h` of `t`, with `w` its head dim
    /// rounded up to [`NR`] (`dp` for Q and K, `dvp` for V, O and dO; zero padding).
    fn load_rows(&self, t: &TensorRef<T>, b: usize, h: usize, i0: usize, rows: usize) -> Vec<f32> {
        let (d, seqlen) = (t.layout.head_dim(), t.layout.seqlen());
        let w = round_up(d, NR);
        let mut buf = vec![0f32; rows * w];
        for (r, dst) in buf.chunks_exact_mut(w).enumerate() {
            let i = i0 + r;
            if i >= seqlen {
                break;
            }
            let src = &t.data[t.layout.offset(b, i, h, 0)..][..d];
            for (x, y) in dst.iter_mut().zip(src) {
                *x = y.to_f32();
            }
        }
        buf
    }

    /// Every tile of `rows` positions of `t` in f32 (as wide as [`Ctx::load_rows`] makes them),
    /// converted in parallel.
    fn tiles(&self, t: &TensorRef<T>, rows: usize, form: TileForm) -> Tiles {
        let [batch, seqlen, heads, d] = t.layout.shape;
        let w = round_up(d, NR);
        let per_head = seqlen.div_ceil(rows);
        let tiles = (0..batch * heads * per_head)
            .into_par_iter()
            .map(|i| {
                let (bh, tile) = (i / per_head, i % per_head);
                let buf = self.load_rows(t, bh / heads, bh % heads, tile * rows, rows);
                match form {
                    TileForm::Rows => buf,
                    TileForm::Cols => {
                        let mut tr = vec![0f32; buf.len()];
                        transpose(&buf, rows, w, &mut tr);
                        tr
                    }
                }
            })
            .collect();
        Tiles {
            tiles,
            heads,
            per_head,
        }
    }

    /// Scores of a `br × bc` tile into `s`; returns the factor `mult` that takes them to the
    /// base-2 domain (`x·mult` is `s·scale·log2(e)`, or its softcapped value). Without softcap
    /// the raw dot products are left as they are; with it, each row's range holds the capped
    /// base-2 scores (`mult` = 1) and `th` receives their `tanh` for the backward's chain rule.
    /// Entries outside each row's range are never read.
    #[inline(always)]
    fn scores<A: Arith>(
        &self,
        q: &[f32],
        kt: &[f32],
        ranges: &[(usize, usize)],
        s: &mut [f32],
        mut th: Option<&mut [f32]>,
    ) -> f32 {
        let bc = self.bc;
        A::gemm((self.br, bc, self.dp), q, self.dp, kt, bc, s, bc, false);
        let Some(cap) = self.softcap else {
            return self.scale * LOG2_E;
        };
        let (inner, outer) = (self.scale / cap, cap * LOG2_E);
        for (r, &(lo, hi)) in ranges.iter().enumerate() {
            for (j, x) in s[r * bc + lo..r * bc + hi].iter_mut().enumerate() {
                let t = (*x * inner).tanh();
                if let Some(th) = th.as_deref_mut() {
                    th[r * bc + lo + j] = t;
                }
                *x = t * outer;
            }
        }
        1.0
    }
}

/// Writes `rows × w` f32 rows (the first `d` columns, `d` being `t`'s head dim and `w` its
/// padded width, `dp` or `dvp`) into head `h` of `t` from row `i0` on, stopping at the tensor's
/// seqlen.
fn store_rows<T: Element>(
    t: &mut TensorMut<T>,
    b: usize,
    h: usize,
    i0: usize,
    src: &[f32],
    w: usize,
) {
    let (d, seqlen) = (t.layout.head_dim(), t.layout.seqlen());
    for (r, row) in src.chunks_exact(w).enumerate() {
        let i = i0 + r;
        if i >= seqlen {
            break;
        }
        let off = t.layout.offset(b, i, h, 0);
        for (x, y) in t.data[off..off + d].iter_mut().zip(row) {
            *x = T::from_f32(*y);
        }
    }
}

/// The [`Arith`] used where AVX2+FMA are not detected at run time (aarch64 always has FMA).
#[cfg(target_arch = "aarch64")]
type Portable = arith::Fused;
#[cfg(not(target_arch = "aarch64"))]
type Portable = arith::Split;

/// Defines `$name`, which runs the `#[inline(always)]` generic `$f::<T, A>` with `A` the
/// fastest [`Arith`] this CPU has: on x86-64 with AVX2 and FMA detected at run time, through a
/// copy compiled with those features enabled.
macro_rules! simd_dispatch {
    ($vis:vis fn $name:ident($($arg:ident: $ty:ty),*) -> $ret:ty = $f:ident) => {
        $vis fn $name<T: Element>($($arg: $ty),*) -> $ret {
            #[cfg(target_arch = "x86_64")]
            {
                /// # Safety
                /// Only called after AVX2 and FMA were detected.
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2<T: Element>($($arg: $ty),*) -> $ret {
                    $f::<T, $crate::backend::cpu::arith::Avx2>($($arg),*)
                }
                if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                    // SAFETY: the features were just detected.
                    return unsafe { avx2::<T>($($arg),*) };
                }
            }
            $f::<T, $crate::backend::cpu::Portable>($($arg),*)
        }
    };
}

// The passes, after `simd_dispatch!`, which they use.
mod backward;
mod forward;

#[cfg(test)]
mod tests {
    use super::arith::Split;
    use super::backward::{dkdv_simd, dq_simd, BwdCtx};
    use super::forward::{fwd_block, fwd_block_simd};
    use super::*;
    use crate::{BackwardInputs, ForwardInputs};

    /// The portable task code (what runs without AVX2) against the dispatched one, on every
    /// block of a problem with GQA, a window, softcap and ragged tiles, with V's head dim equal
    /// to Q's, wider and narrower.
    #[test]
    fn portable_path_matches_dispatched_path() {
        for dv in [40, 72, 24] {
            portable_matches_dispatched(40, dv);
        }
    }

    fn portable_matches_dispatched(d: usize, dv: usize) {
        use crate::tensor::Layout;
        let (b, sq, sk, hq, hkv) = (2, 70, 90, 4, 2);
        let gen = |n: usize, f: f32| -> Vec<f32> { (0..n).map(|i| (i as f32 * f).sin()).collect() };
        let (q, k, v, dout) = (
            gen(b * sq * hq * d, 0.37),
            gen(b * sk * hkv * d, 0.71),
            gen(b * sk * hkv * dv, 0.13),
            gen(b * sq * hq * dv, 0.29),
        );
        let (lq, lk, lv, lo) = (
            Layout::contiguous([b, sq, hq, d]),
            Layout::contiguous([b, sk, hkv, d]),
            Layout::contiguous([b, sk, hkv, dv]),
            Layout::contiguous([b, sq, hq, dv]),
        );
        let p = Problem::from_layouts(&lq, &lk, &lv, crate::tensor::DType::F32).unwrap();
        let cfg = AttentionConfig::new()
            .window(Some(30), Some(5))
            .softcap(4.0);
        let (tq, tk, tv) = (
            TensorRef::new(&q[..], lq),
            TensorRef::new(&k[..], lk),
            TensorRef::new(&v[..], lv),
        );
        let close = |x: &[f32], y: &[f32]| {
            assert_eq!(x.len(), y.len());
            for (a, b) in x.iter().zip(y) {
                assert!(
                    a == b || (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                    "{a} vs {b}"
                );
            }
        };
        let ctx = Ctx::new(&cfg, &p, tq, tk, tv);
        let kt = ctx.tiles(&ctx.k, ctx.bc, TileForm::Cols);
        let vr = ctx.tiles(&ctx.v, ctx.bc, TileForm::Rows);
        let mut out = vec![0f32; dout.len()];
        let mut lse = vec![0f32; p.lse_len().unwrap()];
        for (bi, h, qb) in (0..b)
            .flat_map(|x| (0..hq).map(move |h| (x, h)))
            .flat_map(|(x, h)| (0..ctx.q_blocks()).map(move |qb| (x, h, qb)))
        {
            for sink in [None, Some(1.5)] {
                let fast = fwd_block_simd(&ctx, (&kt, &vr), bi, h, qb, sink);
                let slow = fwd_block::<f32, Split>(&ctx, (&kt, &vr), bi, h, qb, sink);
                close(&slow.o, &fast.o);
                assert_eq!(slow.lse.len(), fast.lse.len());
                close(&slow.lse, &fast.lse);
            }
        }
        forward(
            &cfg,
            &p,
            ForwardInputs::new(tq, tk, tv),
            TensorMut::new(&mut out, lo),
            &mut lse,
        );
        let inputs = BackwardInputs {
            q: tq,
            k: tk,
            v: tv,
            out: TensorRef::new(&out[..], lo),
            dout: TensorRef::new(&dout[..], lo),
            lse: &lse,
            sinks: None,
        };
        let ctx = BwdCtx::new(&cfg, &p, inputs);
        for bi in 0..b {
            for hk in 0..hkv {
                for t in 0..ctx.base.k_tiles() {
                    let (dk, dv) = dkdv_simd(&ctx, bi, hk, t);
                    let (dk2, dv2) = ctx.dkdv_block::<Split>(bi, hk, t);
                    close(&dk2, &dk);
                    close(&dv2, &dv);
                }
            }
            for h in 0..hq {
                for qb in 0..ctx.base.q_blocks() {
                    let (slow, slow_d) = ctx.dq_block::<Split>(bi, h, qb, true);
                    let (fast, fast_d) = dq_simd(&ctx, bi, h, qb, true);
                    close(&slow, &fast);
                    let [slow_d, fast_d] = [slow_d, fast_d]
                        .map(|d| d.unwrap().into_iter().map(|x| x as f32).collect::<Vec<_>>());
                    close(&slow_d, &fast_d);
                    assert_eq!(ctx.dq_block::<Split>(bi, h, qb, false).1, None);
                }
            }
        }
        assert!(lse.iter().all(|x| x.is_finite()) && out.iter().any(|&x| x != 0.0));
    }
}
