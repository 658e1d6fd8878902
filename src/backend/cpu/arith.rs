//! The arithmetic of the tile kernels: the [`Arith`] trait and its implementations (portable
//! with or without FMA, and AVX2+FMA intrinsics on x86-64), the register-blocked matrix
//! product, and the row helpers (exponential, max, dot product, probabilities, transpose).

// ---------------------------------------------------------------------------------------------
// Arithmetic kernels (#[inline(always)] so that they take the target features of the task
// function they are inlined into; the AVX2 matrix product has its own).

use super::NR;

/// The arithmetic of the tile kernels: the tile matrix product, by default the portable one
/// built on this type's multiply-add.
pub(super) trait Arith {
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
pub(super) struct Fused;
impl Arith for Fused {
    #[inline(always)]
    fn fma(a: f32, b: f32, c: f32) -> f32 {
        a.mul_add(b, c)
    }
}

/// Separate multiply and add (for targets without FMA, where `mul_add` is a library call).
#[cfg_attr(target_arch = "aarch64", allow(dead_code))]
pub(super) struct Split;
impl Arith for Split {
    #[inline(always)]
    fn fma(a: f32, b: f32, c: f32) -> f32 {
        a * b + c
    }
}

/// x86-64 with AVX2 and FMA: the matrix product through `std::arch` intrinsics.
#[cfg(target_arch = "x86_64")]
pub(super) struct Avx2;
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
pub(super) fn max_of(x: &[f32]) -> f32 {
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

pub(super) fn dot(x: &[f32], y: &[f32]) -> f32 {
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
pub(super) fn probs_row(row: &mut [f32], (lo, hi): (usize, usize), mult: f32, shift: f32) -> f32 {
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
pub(super) fn transpose(src: &[f32], rows: usize, cols: usize, dst: &mut [f32]) {
    for r in 0..rows {
        for c in 0..cols {
            dst[c * rows + r] = src[r * cols + c];
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
