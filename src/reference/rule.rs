//! The rule: a result passes when its error against the reference is at most twice the
//! baseline's, plus `1e-5`.

use std::fmt;

use crate::tensor::Element;

/// The outcome of [`compare`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Comparison {
    /// `max|got − reference|` (infinite when infinities disagree).
    pub max_err: f64,
    /// `max|baseline − reference|` over entries where it is finite.
    pub baseline_err: f64,
    /// `2·baseline_err + 1e-5` ([`compare_gradient`] adds its rounding term).
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
    compare_allowing(got, reference, baseline, 0.0)
}

/// [`compare`] with `extra` added to the allowance.
fn compare_allowing(got: &[f32], reference: &[f64], baseline: &[f32], extra: f64) -> Comparison {
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
    let allowed = 2.0 * baseline_err + 1e-5 + extra;
    Comparison {
        max_err,
        baseline_err,
        allowed,
        ratio: max_err / allowed,
        pass: nan_count == 0 && max_err <= allowed,
        nan_count,
    }
}

/// FlashAttention-3's rule for gradients: [`compare`]'s allowance plus twice the largest error
/// that adding and taking away 0.3 in `T` makes of the rounded reference values, that is about
/// one unit in the last place of `T` at the larger of 0.3 and the gradients. The
/// FlashAttention-family backwards form the softmax's row sum from the stored output, `D = rowsum(dO∘O)`, where
/// autograd (the baseline) forms it from the rounded P and dP; on rows of a few keys `dP − D` is
/// small and O's roundings alone move dQ and dK by more than twice the baseline's error,
/// identically in FlashAttention-2's and cuDNN's backwards (benchmarks/rule_probe.py).
///
/// # Panics
/// If the three slices differ in length.
pub fn compare_gradient<T: Element>(
    got: &[f32],
    reference: &[f64],
    baseline: &[f32],
) -> Comparison {
    let rounding = reference
        .iter()
        .filter(|r| r.is_finite())
        .map(|&r| {
            let r = T::from_f32(r as f32);
            let there = T::from_f32(r.to_f32() + 0.3);
            let back = T::from_f32(there.to_f32() - 0.3);
            (back.to_f32() as f64 - r.to_f32() as f64).abs()
        })
        // A reference past T's range rounds to an infinity: no allowance from it.
        .filter(|e| e.is_finite())
        .fold(0f64, f64::max);
    compare_allowing(got, reference, baseline, 2.0 * rounding)
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
    fn compare_gradient_adds_a_unit_at_the_values_magnitude() {
        use half::f16;
        // In f16, 0.25 + 0.3 rounds to 0.5498046875 and back to 0.24975586 (2^-12 off): the
        // allowance grows by twice that over the exact baseline's 1e-5.
        let (r, base) = ([0.25f64, 0.0], [0.25f32, 0.0]);
        let strict = compare(&[0.2503, 0.0], &r, &base);
        assert!(!strict.pass, "{strict}");
        let c = compare_gradient::<f16>(&[0.2503, 0.0], &r, &base);
        assert!(
            c.pass && (c.allowed - (1e-5 + 2.0 / 4096.0)).abs() < 1e-9,
            "{c}"
        );
        assert!(!compare_gradient::<f16>(&[0.251, 0.0], &r, &base).pass);
    }
}
