//! The CPU backend: FlashAttention-2's tiled algorithm on host memory.
//!
//! Forward: each task owns a block of query rows of one (batch, head) and walks the key blocks
//! that its rows can see, keeping a running row max `m` and running sum `l` (online softmax) and
//! an f32 output accumulator that is rescaled when the max grows; one division at the end.
//! Scores live in the base-2 domain (`log2(e)·scale` folded into one multiply) so that every
//! exponential is an `exp2`.
//!
//! Backward: recomputes `P = exp(S·scale − LSE)` tile by tile. One parallel pass over
//! (batch, kv head, key block) accumulates dK and dV over every query head of the group and
//! every query block; a second pass over (batch, query head, query block) accumulates dQ. No
//! task writes another's rows, so the result does not depend on scheduling (deterministic).
//!
//! K and V (and, for the backward, the query side) are converted to f32 once, tile by tile,
//! zero-padded to whole micro-kernel blocks; all arithmetic is f32, and results are rounded to
//! `T` when written. Tasks return their blocks and one thread writes them, so outputs may have
//! any strides. On x86-64 the task functions are compiled a second time with AVX2+FMA, picked
//! at run time, and the tile matrix products run a 6×16 register-blocked intrinsics kernel.

use rayon::prelude::*;

use crate::config::{AttentionConfig, Mask};
use crate::tensor::{Element, Problem, TensorMut, TensorRef};

/// Everything [`backward`] reads besides the configuration.
pub(crate) struct BackwardInputs<'a, T> {
    pub q: TensorRef<'a, T>,
    pub k: TensorRef<'a, T>,
    pub v: TensorRef<'a, T>,
    /// The forward output O (used for `D = rowsum(dO∘O)`).
    pub out: TensorRef<'a, T>,
    pub dout: TensorRef<'a, T>,
    /// The forward LSE, (batch, heads_q, seqlen_q) natural log.
    pub lse: &'a [f32],
}

/// Query rows per tile (upper bound; small problems use fewer).
const BLOCK_Q: usize = 64;
/// Keys per tile (upper bound).
const BLOCK_K: usize = 64;
/// Query tiles are padded to a multiple of this (the matrix product takes rows in pairs).
const ROW_PAD: usize = 4;
/// Micro-kernel: columns of B per step (two AVX registers); key tiles and head_dim are padded
/// to a multiple of it.
const NR: usize = 16;

const LOG2_E: f32 = std::f32::consts::LOG2_E;

fn round_up(x: usize, to: usize) -> usize {
    x.div_ceil(to) * to
}

// ---------------------------------------------------------------------------------------------
// Arithmetic kernels (#[inline(always)] so that they take the target features of the task
// function they are inlined into; the AVX2 matrix product has its own).

/// The arithmetic of the tile kernels: the tile matrix product, by default the portable one
/// built on this type's multiply-add.
trait Arith {
    /// `a·b + c`, fused or not.
    fn fma(a: f32, b: f32, c: f32) -> f32;

    /// `C[m×n] (+)= A[m×k] · B[k×n]`, all row-major with leading dimensions `lda`, `ldb`,
    /// `ldc`; `m` must be even and `n` a multiple of [`NR`] (tiles are zero-padded so).
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn gemm(
        dims: (usize, usize, usize),
        a: &[f32],
        lda: usize,
        b: &[f32],
        ldb: usize,
        c: &mut [f32],
        ldc: usize,
        accumulate: bool,
    ) {
        gemm_portable::<Self>(dims, a, lda, b, ldb, c, ldc, accumulate)
    }
}

/// Fused multiply-add (one rounding), for targets where FMA is baseline.
#[cfg_attr(not(target_arch = "aarch64"), allow(dead_code))]
struct Fused;
impl Arith for Fused {
    #[inline(always)]
    fn fma(a: f32, b: f32, c: f32) -> f32 {
        a.mul_add(b, c)
    }
}

/// Separate multiply and add (for targets without FMA, where `mul_add` is a library call).
#[cfg_attr(target_arch = "aarch64", allow(dead_code))]
struct Split;
impl Arith for Split {
    #[inline(always)]
    fn fma(a: f32, b: f32, c: f32) -> f32 {
        a * b + c
    }
}

/// x86-64 with AVX2 and FMA: the matrix product through `std::arch` intrinsics.
#[cfg(target_arch = "x86_64")]
struct Avx2;
#[cfg(target_arch = "x86_64")]
impl Arith for Avx2 {
    #[inline(always)]
    fn fma(a: f32, b: f32, c: f32) -> f32 {
        a.mul_add(b, c)
    }

    #[inline(always)]
    fn gemm(
        dims: (usize, usize, usize),
        a: &[f32],
        lda: usize,
        b: &[f32],
        ldb: usize,
        c: &mut [f32],
        ldc: usize,
        accumulate: bool,
    ) {
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            // SAFETY: the features were just detected; gemm_avx2 checks the bounds.
            unsafe { avx2::gemm(dims, a, lda, b, ldb, c, ldc, accumulate) }
        } else {
            gemm_portable::<Split>(dims, a, lda, b, ldb, c, ldc, accumulate)
        }
    }
}

/// [`Arith::gemm`] in plain Rust: rows of A go through the micro-kernel six at a time (then
/// four or two), sixteen columns of B at a time.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn gemm_portable<A: Arith + ?Sized>(
    (m, n, k): (usize, usize, usize),
    a: &[f32],
    lda: usize,
    b: &[f32],
    ldb: usize,
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
) {
    assert!(m % 2 == 0 && n % NR == 0);
    let mut i = 0;
    while i < m {
        let (a, c) = (&a[i * lda..], &mut c[i * ldc..]);
        i += match m - i {
            2 => panel::<A, 2>((n, k), a, lda, b, ldb, c, ldc, accumulate),
            4 => panel::<A, 4>((n, k), a, lda, b, ldb, c, ldc, accumulate),
            _ => panel::<A, 6>((n, k), a, lda, b, ldb, c, ldc, accumulate),
        };
    }
}

/// `R` rows of [`gemm_portable`]; returns `R`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn panel<A: Arith + ?Sized, const R: usize>(
    (n, k): (usize, usize),
    a: &[f32],
    lda: usize,
    b: &[f32],
    ldb: usize,
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
) -> usize {
    let rows: [&[f32]; R] = std::array::from_fn(|r| &a[r * lda..][..k]);
    for j in (0..n).step_by(NR) {
        let mut acc = [[0f32; NR]; R];
        if accumulate {
            for (r, row) in acc.iter_mut().enumerate() {
                row.copy_from_slice(&c[r * ldc + j..][..NR]);
            }
        }
        for p in 0..k {
            let bp: &[f32; NR] = b[p * ldb + j..][..NR].try_into().unwrap();
            for r in 0..R {
                let av = rows[r][p];
                for x in 0..NR {
                    acc[r][x] = A::fma(av, bp[x], acc[r][x]);
                }
            }
        }
        for (r, row) in acc.iter().enumerate() {
            c[r * ldc + j..][..NR].copy_from_slice(row);
        }
    }
    R
}

/// The AVX2+FMA matrix product: a 6×16 block of C lives in twelve registers while `k`
/// broadcast-multiply-adds stream through it.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::NR;
    use std::arch::x86_64::*;

    /// [`super::Arith::gemm`]; panics unless the slices hold the extents the dimensions and
    /// leading dimensions imply.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn gemm(
        (m, n, k): (usize, usize, usize),
        a: &[f32],
        lda: usize,
        b: &[f32],
        ldb: usize,
        c: &mut [f32],
        ldc: usize,
        accumulate: bool,
    ) {
        assert!(m % 2 == 0 && n % NR == 0);
        if m == 0 || n == 0 {
            return;
        }
        assert!(k <= lda && n <= ldb && n <= ldc);
        assert!(a.len() >= (m - 1) * lda + k);
        assert!(k == 0 || b.len() >= (k - 1) * ldb + n);
        assert!(c.len() >= (m - 1) * ldc + n);
        let (a, b, c) = (a.as_ptr(), b.as_ptr(), c.as_mut_ptr());
        let mut i = 0;
        while i < m {
            // SAFETY: rows i.. of A and C are in bounds by the asserts above.
            let (a, c) = unsafe { (a.add(i * lda), c.add(i * ldc)) };
            // SAFETY: panel reads R rows of A (k each), k rows of B (n each) and writes R
            // rows of C (n each), all within the extents asserted above.
            i += unsafe {
                match m - i {
                    2 => panel::<2>((n, k), a, lda, b, ldb, c, ldc, accumulate),
                    4 => panel::<4>((n, k), a, lda, b, ldb, c, ldc, accumulate),
                    _ => panel::<6>((n, k), a, lda, b, ldb, c, ldc, accumulate),
                }
            };
        }
    }

    /// `R` rows; returns `R`.
    ///
    /// # Safety
    /// AVX2+FMA; `a` readable for `R` rows of `k` at stride `lda`, `b` for `k` rows of `n` at
    /// stride `ldb`, `c` writable for `R` rows of `n` at stride `ldc`.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn panel<const R: usize>(
        (n, k): (usize, usize),
        a: *const f32,
        lda: usize,
        b: *const f32,
        ldb: usize,
        c: *mut f32,
        ldc: usize,
        accumulate: bool,
    ) -> usize {
        for j in (0..n).step_by(NR) {
            let mut lo = [_mm256_setzero_ps(); R];
            let mut hi = [_mm256_setzero_ps(); R];
            if accumulate {
                for r in 0..R {
                    lo[r] = unsafe { _mm256_loadu_ps(c.add(r * ldc + j)) };
                    hi[r] = unsafe { _mm256_loadu_ps(c.add(r * ldc + j + 8)) };
                }
            }
            let mut bp = unsafe { b.add(j) };
            for p in 0..k {
                let (b0, b1) = unsafe { (_mm256_loadu_ps(bp), _mm256_loadu_ps(bp.add(8))) };
                for r in 0..R {
                    let av = unsafe { _mm256_broadcast_ss(&*a.add(r * lda + p)) };
                    lo[r] = _mm256_fmadd_ps(av, b0, lo[r]);
                    hi[r] = _mm256_fmadd_ps(av, b1, hi[r]);
                }
                bp = bp.wrapping_add(ldb);
            }
            for r in 0..R {
                unsafe {
                    _mm256_storeu_ps(c.add(r * ldc + j), lo[r]);
                    _mm256_storeu_ps(c.add(r * ldc + j + 8), hi[r]);
                }
            }
        }
        R
    }
}

/// `2^x` to about 1e-7 relative, branch-free so loops over it vectorize; `x < -126` gives 0
/// (so `-inf` gives exactly 0) and NaN stays NaN.
#[inline(always)]
fn exp2_approx(x: f32) -> f32 {
    const SHIFTER: f32 = 12_582_912.0; // 1.5·2^23: adding it rounds to an integer
    let xc = x.clamp(-126.0, 127.0); // NaN stays NaN
    let t = xc + SHIFTER;
    let n = t - SHIFTER;
    let f = xc - n; // in [-0.5, 0.5]
    let ni = t.to_bits() as i32 - SHIFTER.to_bits() as i32;
    // Taylor series of e^(f·ln2) to degree 7: truncation error < 1e-8 on |f| <= 0.5.
    const C: [f32; 8] = [
        1.0,
        std::f32::consts::LN_2,
        0.240_226_5,
        0.055_504_11,
        0.009_618_129,
        0.001_333_355_8,
        0.000_154_035_3,
        0.000_015_252_734,
    ];
    let mut p = C[7];
    for &c in C[..7].iter().rev() {
        p = p * f + c;
    }
    let r = p * f32::from_bits(((ni + 127) as u32) << 23);
    if x < -126.0 {
        0.0
    } else {
        r
    }
}

#[inline(always)]
fn max_of(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 8];
    let chunks = x.chunks_exact(8);
    let rest = chunks.remainder();
    for ch in chunks {
        for i in 0..8 {
            acc[i] = if ch[i] > acc[i] { ch[i] } else { acc[i] };
        }
    }
    rest.iter()
        .chain(acc.iter())
        .fold(f32::NEG_INFINITY, |m, &v| m.max(v))
}

fn dot(x: &[f32], y: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (xc, yc) = (x.chunks_exact(8), y.chunks_exact(8));
    let rest: f32 = xc
        .remainder()
        .iter()
        .zip(yc.remainder())
        .map(|(a, b)| a * b)
        .sum();
    for (a, b) in xc.zip(yc) {
        for i in 0..8 {
            acc[i] += a[i] * b[i];
        }
    }
    acc.iter().sum::<f32>() + rest
}

/// Turns a row of scores into probabilities: `2^(x·mult − shift)` on `[lo, hi)`, 0 elsewhere;
/// returns their sum (the scaling, the exponential and the sum in one pass).
#[inline(always)]
fn probs_row(row: &mut [f32], (lo, hi): (usize, usize), mult: f32, shift: f32) -> f32 {
    row[..lo].fill(0.0);
    row[hi..].fill(0.0);
    let mut acc = [0f32; 8];
    let mut chunks = row[lo..hi].chunks_exact_mut(8);
    for ch in &mut chunks {
        for i in 0..8 {
            ch[i] = exp2_approx(ch[i] * mult - shift);
            acc[i] += ch[i];
        }
    }
    let mut rest = 0f32;
    for x in chunks.into_remainder() {
        *x = exp2_approx(*x * mult - shift);
        rest += *x;
    }
    acc.iter().sum::<f32>() + rest
}

/// `dst[c][r] = src[r][c]` for a `rows × cols` row-major `src`.
fn transpose(src: &[f32], rows: usize, cols: usize, dst: &mut [f32]) {
    for r in 0..rows {
        for c in 0..cols {
            dst[c * rows + r] = src[r * cols + c];
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Problem-wide constants and tile loading.

struct Ctx<'a, T> {
    q: TensorRef<'a, T>,
    k: TensorRef<'a, T>,
    v: TensorRef<'a, T>,
    mask: Mask,
    group: usize,
    s_q: usize,
    s_k: usize,
    heads_q: usize,
    heads_kv: usize,
    d: usize,
    /// head_dim rounded up to [`NR`].
    dp: usize,
    /// Query rows per tile for this problem.
    br: usize,
    /// Keys per tile for this problem.
    bc: usize,
    scale: f32,
    softcap: Option<f32>,
}

/// How a tile of a (b, s, h, d) tensor is laid out once converted to f32.
#[derive(Clone, Copy)]
enum TileForm {
    /// `rows × dp`, row-major.
    Rows,
    /// `dp × rows`: the transpose (keys as columns for `Q·Kᵀ` and `dO·Vᵀ`).
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
            mask: cfg.mask(p.seqlen_q, p.seqlen_k),
            group: p.group_size(),
            s_q: p.seqlen_q,
            s_k: p.seqlen_k,
            heads_q: p.heads_q,
            heads_kv: p.heads_kv,
            d: p.head_dim,
            dp: round_up(p.head_dim, NR),
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

    /// `rows × dp` f32 block of positions `i0..` of head `h` of `t` (zero padding).
    fn load_rows(&self, t: &TensorRef<T>, b: usize, h: usize, i0: usize, rows: usize) -> Vec<f32> {
        let mut buf = vec![0f32; rows * self.dp];
        let seqlen = t.layout.seqlen();
        for (r, dst) in buf.chunks_exact_mut(self.dp).enumerate() {
            let i = i0 + r;
            if i >= seqlen {
                break;
            }
            let src = &t.data[t.layout.offset(b, i, h, 0)..][..self.d];
            for (x, y) in dst.iter_mut().zip(src) {
                *x = y.to_f32();
            }
        }
        buf
    }

    /// Every tile of `rows` positions of `t` in f32, converted in parallel.
    fn tiles(&self, t: &TensorRef<T>, rows: usize, form: TileForm) -> Tiles {
        let [batch, seqlen, heads, _] = t.layout.shape;
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
                        transpose(&buf, rows, self.dp, &mut tr);
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

/// The [`Arith`] used where AVX2+FMA are not detected at run time (aarch64 always has FMA).
#[cfg(target_arch = "aarch64")]
type Portable = Fused;
#[cfg(not(target_arch = "aarch64"))]
type Portable = Split;

/// Defines `$name`, which runs the `#[inline(always)]` generic `$f::<T, A>` with `A` the
/// fastest [`Arith`] this CPU has: on x86-64 with AVX2 and FMA detected at run time, through a
/// copy compiled with those features enabled.
macro_rules! simd_dispatch {
    (fn $name:ident($($arg:ident: $ty:ty),*) -> $ret:ty = $f:ident) => {
        fn $name<T: Element>($($arg: $ty),*) -> $ret {
            #[cfg(target_arch = "x86_64")]
            {
                /// # Safety
                /// Only called after AVX2 and FMA were detected.
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2<T: Element>($($arg: $ty),*) -> $ret {
                    $f::<T, Avx2>($($arg),*)
                }
                if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                    // SAFETY: the features were just detected.
                    return unsafe { avx2::<T>($($arg),*) };
                }
            }
            $f::<T, Portable>($($arg),*)
        }
    };
}

// ---------------------------------------------------------------------------------------------
// Forward.

/// Output rows (`br × dp`, f32, already divided by the row sums) and the LSE of one task.
struct FwdBlock {
    o: Vec<f32>,
    lse: Vec<f32>,
}

#[inline(always)]
fn fwd_block<T: Element, A: Arith>(
    ctx: &Ctx<T>,
    (kt, v): (&Tiles, &Tiles),
    b: usize,
    h: usize,
    qb: usize,
) -> FwdBlock {
    let (br, bc, dp) = (ctx.br, ctx.bc, ctx.dp);
    let hk = h / ctx.group;
    let q = ctx.load_rows(&ctx.q, b, h, qb * br, br);
    let (rows, union) = ctx.row_ranges(qb);
    let mut m = vec![f32::NEG_INFINITY; br];
    let mut l = vec![0f32; br];
    let mut acc = vec![0f32; br * dp];
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
                acc[r * dp..(r + 1) * dp]
                    .iter_mut()
                    .for_each(|x| *x *= alpha);
            }
        }
        A::gemm(
            (br, dp, bc),
            &s,
            bc,
            v.get(b, hk, t),
            dp,
            &mut acc,
            dp,
            true,
        );
    }
    // Rows that saw no key: O = 0, LSE = +inf. A NaN score makes l NaN, and O and the LSE with it.
    let mut lse = vec![f32::INFINITY; br];
    for r in 0..br {
        let row = &mut acc[r * dp..(r + 1) * dp];
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

simd_dispatch!(fn fwd_block_simd(ctx: &Ctx<T>, kv: (&Tiles, &Tiles), b: usize, h: usize, qb: usize) -> FwdBlock = fwd_block);

/// Writes `rows × dp` f32 rows (the first `d` columns) into head `h` of `t` from row `i0` on,
/// stopping at the tensor's seqlen.
fn store_rows<T: Element>(
    t: &mut TensorMut<T>,
    b: usize,
    h: usize,
    i0: usize,
    src: &[f32],
    dp: usize,
) {
    let (d, seqlen) = (t.layout.head_dim(), t.layout.seqlen());
    for (r, row) in src.chunks_exact(dp).enumerate() {
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

/// Forward pass: writes `out` (like Q) and `lse` (batch, heads_q, seqlen_q). Operands must
/// have been validated (see [`crate::forward_into`]).
pub(crate) fn forward<T: Element>(
    cfg: &AttentionConfig,
    p: &Problem,
    q: TensorRef<T>,
    k: TensorRef<T>,
    v: TensorRef<T>,
    mut out: TensorMut<T>,
    lse: &mut [f32],
) {
    let ctx = Ctx::new(cfg, p, q, k, v);
    let kt = ctx.tiles(&ctx.k, ctx.bc, TileForm::Cols);
    let vr = ctx.tiles(&ctx.v, ctx.bc, TileForm::Rows);
    let nqb = ctx.q_blocks();
    let blocks: Vec<FwdBlock> = (0..p.batch * p.heads_q * nqb)
        .into_par_iter()
        .map(|t| {
            let (bh, qb) = (t / nqb, t % nqb);
            let (b, h) = (bh / p.heads_q, bh % p.heads_q);
            fwd_block_simd(&ctx, (&kt, &vr), b, h, qb)
        })
        .collect();
    // Outputs reach each element once, but may interleave with any strides: one thread writes.
    for (t, blk) in blocks.iter().enumerate() {
        let (bh, qb) = (t / nqb, t % nqb);
        let i0 = qb * ctx.br;
        let n = ctx.br.min(p.seqlen_q - i0);
        store_rows(&mut out, bh / p.heads_q, bh % p.heads_q, i0, &blk.o, ctx.dp);
        lse[bh * p.seqlen_q + i0..][..n].copy_from_slice(&blk.lse[..n]);
    }
}

// ---------------------------------------------------------------------------------------------
// Backward.

/// Per query block: Q, dO (`br × dp`), LSE in the base-2 domain and `D = rowsum(dO∘O)`.
struct QSide {
    q: Vec<f32>,
    dout: Vec<f32>,
    lse2: Vec<f32>,
    dd: Vec<f32>,
}

/// Everything the backward tasks read, converted to f32 once.
struct BwdCtx<'a, T> {
    base: Ctx<'a, T>,
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
    fn new(cfg: &AttentionConfig, p: &Problem, inputs: BackwardInputs<'a, T>) -> Self {
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
                    .chunks_exact(base.dp)
                    .zip(o.chunks_exact(base.dp))
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
    /// query block `qb` of head `h` against key tile `t` into `sc`.
    #[inline(always)]
    fn tile_grads<A: Arith>(
        &self,
        (b, h, qb): (usize, usize, usize),
        t: usize,
        sc: &mut BwdScratch,
    ) {
        let c = &self.base;
        let (br, bc, dp) = (c.br, c.bc, c.dp);
        let hk = h / c.group;
        let qs = self.qside(b, h, qb);
        let ranges = c.tile_ranges(&c.row_ranges(qb).0, t);
        let th = c.softcap.map(|_| sc.th.as_mut_slice());
        let mult = c.scores::<A>(&qs.q, self.kt.get(b, hk, t), &ranges, &mut sc.p, th);
        for (r, &(lo, hi)) in ranges.iter().enumerate() {
            let row = &mut sc.p[r * bc..(r + 1) * bc];
            // A row with LSE = +inf is fully masked (or had no keys): it contributes nothing.
            if lo >= hi || !qs.lse2[r].is_finite() {
                row.fill(0.0);
            } else {
                probs_row(row, (lo, hi), mult, qs.lse2[r]);
            }
        }
        // dP = dO·Vᵀ, then dS = P∘(dP − D) (∘ (1 − tanh²) with softcap).
        let vt = self.vt.get(b, hk, t);
        A::gemm((br, bc, dp), &qs.dout, dp, vt, bc, &mut sc.ds, bc, false);
        for r in 0..br {
            let d = qs.dd[r];
            let (p, ds) = (&sc.p[r * bc..][..bc], &mut sc.ds[r * bc..][..bc]);
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

    /// dK and dV (`bc × dp` each, dK already scaled) of key tile `t` of kv head `hk`, summed
    /// over the query heads of its group.
    #[inline(always)]
    fn dkdv_block<A: Arith>(&self, b: usize, hk: usize, t: usize) -> (Vec<f32>, Vec<f32>) {
        let c = &self.base;
        let (br, bc, dp) = (c.br, c.bc, c.dp);
        let mut dk = vec![0f32; bc * dp];
        let mut dv = vec![0f32; bc * dp];
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
                self.tile_grads::<A>((b, h, qb), t, &mut sc);
                let qs = self.qside(b, h, qb);
                // dV += Pᵀ·dO, dK += dSᵀ·Q.
                transpose(&sc.p, br, bc, &mut tr);
                A::gemm((bc, dp, br), &tr, br, &qs.dout, dp, &mut dv, dp, true);
                transpose(&sc.ds, br, bc, &mut tr);
                A::gemm((bc, dp, br), &tr, br, &qs.q, dp, &mut dk, dp, true);
            }
        }
        dk.iter_mut().for_each(|x| *x *= c.scale);
        (dk, dv)
    }

    /// dQ (`br × dp`, scaled) of query block `qb` of head `h`.
    #[inline(always)]
    fn dq_block<A: Arith>(&self, b: usize, h: usize, qb: usize) -> Vec<f32> {
        let c = &self.base;
        let (br, bc, dp) = (c.br, c.bc, c.dp);
        let mut dq = vec![0f32; br * dp];
        let mut sc = BwdScratch::new(c);
        for t in c.tiles_of(c.row_ranges(qb).1) {
            self.tile_grads::<A>((b, h, qb), t, &mut sc);
            let k = self.kr.get(b, h / c.group, t);
            A::gemm((br, dp, bc), &sc.ds, bc, k, dp, &mut dq, dp, true);
        }
        dq.iter_mut().for_each(|x| *x *= c.scale);
        dq
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
simd_dispatch!(fn dkdv_simd(ctx: &BwdCtx<T>, b: usize, hk: usize, t: usize) -> (Vec<f32>, Vec<f32>) = dkdv_block);

#[inline(always)]
fn dq_block<T: Element, A: Arith>(ctx: &BwdCtx<T>, b: usize, h: usize, qb: usize) -> Vec<f32> {
    ctx.dq_block::<A>(b, h, qb)
}
simd_dispatch!(fn dq_simd(ctx: &BwdCtx<T>, b: usize, h: usize, qb: usize) -> Vec<f32> = dq_block);

/// One backward task: a key tile's dK and dV, or a query block's dQ.
enum BwdTask {
    KeyTile { b: usize, hk: usize, t: usize },
    QueryBlock { b: usize, h: usize, qb: usize },
}

/// Backward pass: writes dQ (like Q), dK and dV (like K). Operands must have been validated
/// (see [`crate::backward`]).
pub(crate) fn backward<T: Element>(
    cfg: &AttentionConfig,
    p: &Problem,
    inputs: BackwardInputs<T>,
    mut dq: TensorMut<T>,
    mut dk: TensorMut<T>,
    mut dv: TensorMut<T>,
) {
    let ctx = BwdCtx::new(cfg, p, inputs);
    let c = &ctx.base;
    let mut tasks = Vec::new();
    for b in 0..p.batch {
        for hk in 0..c.heads_kv {
            tasks.extend((0..c.k_tiles()).map(|t| BwdTask::KeyTile { b, hk, t }));
        }
        for h in 0..p.heads_q {
            tasks.extend((0..c.q_blocks()).map(|qb| BwdTask::QueryBlock { b, h, qb }));
        }
    }
    let blocks: Vec<Vec<Vec<f32>>> = tasks
        .par_iter()
        .map(|task| match *task {
            BwdTask::KeyTile { b, hk, t } => {
                let (k, v) = dkdv_simd(&ctx, b, hk, t);
                vec![k, v]
            }
            BwdTask::QueryBlock { b, h, qb } => {
                vec![dq_simd(&ctx, b, h, qb)]
            }
        })
        .collect();
    for (task, blk) in tasks.iter().zip(&blocks) {
        match *task {
            BwdTask::KeyTile { b, hk, t } => {
                store_rows(&mut dk, b, hk, t * c.bc, &blk[0], c.dp);
                store_rows(&mut dv, b, hk, t * c.bc, &blk[1], c.dp);
            }
            BwdTask::QueryBlock { b, h, qb } => {
                store_rows(&mut dq, b, h, qb * c.br, &blk[0], c.dp);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp2_approx_matches_std() {
        let mut worst = 0f64;
        for i in -130_000..=20_000 {
            let x = i as f32 * 1e-3;
            let want = (x as f64).exp2();
            let got = exp2_approx(x) as f64;
            if x >= -126.0 {
                worst = worst.max(((got - want) / want).abs());
            } else {
                assert_eq!(got, 0.0, "x = {x}");
            }
        }
        assert!(worst < 3e-7, "relative error {worst}");
        assert_eq!(exp2_approx(f32::NEG_INFINITY), 0.0);
        assert!(exp2_approx(f32::NAN).is_nan());
        assert_eq!(exp2_approx(0.0), 1.0);
    }

    /// Every gemm this build can pick, on every row-panel remainder and strided operands.
    fn check_gemm<A: Arith>() {
        for (m, n, k) in [
            (2, 16, 1),
            (4, 32, 13),
            (6, 16, 8),
            (8, 48, 20),
            (10, 16, 64),
        ] {
            let (lda, ldb, ldc) = (k + 3, n + 16, n + 5);
            let a: Vec<f32> = (0..m * lda).map(|i| (i as f32 * 0.7).sin()).collect();
            let b: Vec<f32> = (0..k * ldb).map(|i| (i as f32 * 0.3).cos()).collect();
            let mut c = vec![1f32; m * ldc];
            A::gemm((m, n, k), &a, lda, &b, ldb, &mut c, ldc, true);
            for i in 0..m {
                for j in 0..ldc {
                    let dot = (0..k).map(|p| a[i * lda + p] * b[p * ldb + j]);
                    let want = if j < n { 1.0 + dot.sum::<f32>() } else { 1.0 };
                    let got = c[i * ldc + j];
                    assert!((got - want).abs() < 1e-4, "{m}x{n}x{k} ({i},{j})");
                }
            }
            let mut c2 = vec![f32::NAN; m * ldc];
            A::gemm((m, n, k), &a, lda, &b, ldb, &mut c2, ldc, false);
            for i in 0..m {
                for j in 0..n {
                    assert!((c2[i * ldc + j] + 1.0 - c[i * ldc + j]).abs() < 1e-4);
                }
            }
        }
    }

    #[test]
    fn gemm_matches_naive() {
        check_gemm::<Split>();
        // Avx2::gemm falls back to the portable kernel where AVX2 is missing.
        #[cfg(target_arch = "x86_64")]
        check_gemm::<Avx2>();
    }

    /// The portable task code (what runs without AVX2) against the dispatched one, on every
    /// block of a problem with GQA, a window, softcap and ragged tiles.
    #[test]
    fn portable_path_matches_dispatched_path() {
        use crate::tensor::Layout;
        let (b, sq, sk, hq, hkv, d) = (2, 70, 90, 4, 2, 40);
        let gen = |n: usize, f: f32| -> Vec<f32> { (0..n).map(|i| (i as f32 * f).sin()).collect() };
        let (q, k, v, dout) = (
            gen(b * sq * hq * d, 0.37),
            gen(b * sk * hkv * d, 0.71),
            gen(b * sk * hkv * d, 0.13),
            gen(b * sq * hq * d, 0.29),
        );
        let (lq, lk) = (
            Layout::contiguous([b, sq, hq, d]),
            Layout::contiguous([b, sk, hkv, d]),
        );
        let p = Problem::from_layouts(&lq, &lk, &lk, crate::tensor::DType::F32).unwrap();
        let cfg = AttentionConfig::new()
            .window(Some(30), Some(5))
            .softcap(4.0);
        let (tq, tk, tv) = (
            TensorRef::new(&q[..], lq),
            TensorRef::new(&k[..], lk),
            TensorRef::new(&v[..], lk),
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
        let mut out = vec![0f32; q.len()];
        let mut lse = vec![0f32; p.lse_len().unwrap()];
        for (bi, h, qb) in (0..b)
            .flat_map(|x| (0..hq).map(move |h| (x, h)))
            .flat_map(|(x, h)| (0..ctx.q_blocks()).map(move |qb| (x, h, qb)))
        {
            let fast = fwd_block_simd(&ctx, (&kt, &vr), bi, h, qb);
            let slow = fwd_block::<f32, Split>(&ctx, (&kt, &vr), bi, h, qb);
            close(&slow.o, &fast.o);
            assert_eq!(slow.lse.len(), fast.lse.len());
            close(&slow.lse, &fast.lse);
        }
        forward(&cfg, &p, tq, tk, tv, TensorMut::new(&mut out, lq), &mut lse);
        let inputs = BackwardInputs {
            q: tq,
            k: tk,
            v: tv,
            out: TensorRef::new(&out[..], lq),
            dout: TensorRef::new(&dout[..], lq),
            lse: &lse,
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
                    close(&ctx.dq_block::<Split>(bi, h, qb), &dq_simd(&ctx, bi, h, qb));
                }
            }
        }
        assert!(lse.iter().all(|x| x.is_finite()) && out.iter().any(|&x| x != 0.0));
    }

    #[test]
    fn reductions_handle_remainders() {
        let x: Vec<f32> = (0..19).map(|i| i as f32 - 9.5).collect();
        assert_eq!(max_of(&x), 8.5);
        let mut row = x.clone();
        let sum = probs_row(&mut row, (2, 13), 0.5, 1.0);
        assert!(row[..2].iter().chain(&row[13..]).all(|&p| p == 0.0));
        for (p, v) in row[2..13].iter().zip(&x[2..13]) {
            assert!((p - (v * 0.5 - 1.0).exp2()).abs() < 1e-6 * p);
        }
        assert!((sum - row.iter().sum::<f32>()).abs() < 1e-6 * sum);
        assert_eq!(dot(&x, &x), x.iter().map(|v| v * v).sum::<f32>());
        assert_eq!(max_of(&[]), f32::NEG_INFINITY);
    }
}
