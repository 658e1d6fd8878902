//! The rule: a result passes when its error against the reference is at most twice the
//! baseline's, plus `1e-5`.

use std::fmt;

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

/// [`compare`] against whichever of `baselines` errs more: the rule for gradients, whose
/// baseline is either autograd's backward or FlashAttention's (the two ways of forming the
/// softmax's row sum in the low precision, [`super::baseline_backward`] and
/// [`super::baseline_backward_of_output`]); a result within twice either's error is as exact as
/// that standard computation.
///
/// # Panics
/// If the slices differ in length, or `baselines` is empty.
pub fn compare_worse_baseline(got: &[f32], reference: &[f64], baselines: &[&[f32]]) -> Comparison {
    baselines
        .iter()
        .map(|b| compare(got, reference, b))
        .max_by(|a, b| a.allowed.total_cmp(&b.allowed))
        .expect("at least one baseline")
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
        // Against two baselines the one that errs more sets the allowance.
        let wide = [1.004f32, 2.0, f32::INFINITY];
        let c = compare_worse_baseline(&[1.007, 2.0, f32::INFINITY], &r, &[&base, &wide]);
        assert!(c.pass && (c.baseline_err - 4e-3).abs() < 1e-6, "{c}");
        let c = compare_worse_baseline(&[1.01, 2.0, f32::INFINITY], &r, &[&wide, &base]);
        assert!(!c.pass, "{c}");
    }
}
