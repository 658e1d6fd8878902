//! What to compute: scale, mask, softcap, and which backend the caller wants.

use crate::error::{Error, Result};
use crate::unstable::Sm90Schedule;

/// Where a call runs. `Auto` lets the dispatcher choose (see [`crate::dispatch`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Backend {
    #[default]
    Auto,
    /// FlashAttention-3-style kernels (compute capability 9.0, sm_90a).
    Sm90,
    /// FlashAttention-2-style kernels (sm80..sm89, and forced on Hopper).
    Sm80,
    /// The CPU backend (host memory).
    Cpu,
}

impl Backend {
    /// The lower-case name errors and plans print (`"sm90"`, `"cpu"`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Backend::Auto => "auto",
            Backend::Sm90 => "sm90",
            Backend::Sm80 => "sm80",
            Backend::Cpu => "cpu",
        }
    }
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Which keys each query may see, in FlashAttention's convention: masks are aligned
/// bottom-right, so that when `seqlen_q != seqlen_k` the last query sits on the last key. Query
/// `i` lies on the key diagonal `i + seqlen_k - seqlen_q`; a window `{ left, right }` lets it see
/// keys `j` with `i + s_k - s_q - left <= j <= i + s_k - s_q + right`, `None` meaning unbounded
/// on that side.
///
/// `Causal` is the window `{ left: None, right: Some(0) }` and runs exactly as it does on every
/// backend; `Window { left: None, right: None }` is `Full`. A query row that sees no key gives
/// `O = 0` and `lse = +inf`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum AttentionMask {
    /// Every query sees every key.
    #[default]
    Full,
    /// No key past the query's diagonal.
    Causal,
    /// A band around the diagonal (sliding-window or local attention).
    Window {
        left: Option<usize>,
        right: Option<usize>,
    },
}

impl AttentionMask {
    /// The band `(left, right)` this mask stands for, `None` meaning unbounded: `Full` is
    /// `(None, None)`, `Causal` is `(None, Some(0))`.
    pub fn bounds(self) -> (Option<usize>, Option<usize>) {
        match self {
            AttentionMask::Full => (None, None),
            AttentionMask::Causal => (None, Some(0)),
            AttentionMask::Window { left, right } => (left, right),
        }
    }

    /// Whether no query sees a key past its diagonal: `Causal`, and every window whose right
    /// side is 0.
    pub fn is_causal(self) -> bool {
        self.bounds().1 == Some(0)
    }

    /// The keys each row sees for given sequence lengths.
    pub fn key_rule(self, seqlen_q: usize, seqlen_k: usize) -> KeyRule {
        let (left, right) = self.bounds();
        KeyRule {
            seqlen_q,
            seqlen_k,
            left,
            right,
        }
    }
}

/// Options of one attention call, following FlashAttention's conventions (see
/// [`AttentionMask`] for what each query sees).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct AttentionConfig {
    /// Multiplies Q·Kᵀ before the softmax; `None` means `1/sqrt(head_dim)`.
    pub softmax_scale: Option<f32>,
    /// Which keys each query sees.
    pub mask: AttentionMask,
    /// `softcap * tanh(s / softcap)` applied to the scaled scores; `None` = off.
    pub softcap: Option<f32>,
    /// Ask for a fixed accumulation order in the backward (bit-identical runs).
    pub deterministic: bool,
    pub backend: Backend,
    /// The Hopper forward's scheduling switches: research apparatus, see [`crate::unstable`].
    pub sm90_schedule: Sm90Schedule,
}

impl AttentionConfig {
    pub fn new() -> Self {
        Self::default()
    }
    /// Sets the mask. [`mask`](Self::mask), [`causal`](Self::causal) and
    /// [`window`](Self::window) each replace the whole mask: the last one called wins.
    pub fn mask(mut self, mask: AttentionMask) -> Self {
        self.mask = mask;
        self
    }
    /// `true` sets [`AttentionMask::Causal`], `false` [`AttentionMask::Full`]. A causal mask
    /// with a left window is `window(Some(left), Some(0))`.
    pub fn causal(self, causal: bool) -> Self {
        self.mask(if causal {
            AttentionMask::Causal
        } else {
            AttentionMask::Full
        })
    }
    /// Sets [`AttentionMask::Window`] `{ left, right }`.
    pub fn window(self, left: Option<usize>, right: Option<usize>) -> Self {
        self.mask(AttentionMask::Window { left, right })
    }
    pub fn softmax_scale(mut self, scale: f32) -> Self {
        self.softmax_scale = Some(scale);
        self
    }
    pub fn softcap(mut self, cap: f32) -> Self {
        self.softcap = Some(cap);
        self
    }
    pub fn deterministic(mut self, yes: bool) -> Self {
        self.deterministic = yes;
        self
    }
    pub fn backend(mut self, backend: Backend) -> Self {
        self.backend = backend;
        self
    }
    pub fn sm90_schedule(mut self, schedule: Sm90Schedule) -> Self {
        self.sm90_schedule = schedule;
        self
    }

    /// The scale actually used for a given head dimension.
    pub fn scale_for(&self, head_dim: usize) -> f32 {
        self.softmax_scale
            .unwrap_or_else(|| 1.0 / (head_dim as f32).sqrt())
    }

    pub fn validate(&self) -> Result<()> {
        if let Some(s) = self.softmax_scale {
            if !s.is_finite() || s <= 0.0 {
                return Err(Error::InvalidConfig(format!(
                    "softmax_scale must be finite and > 0, got {s}"
                )));
            }
        }
        if let Some(c) = self.softcap {
            if !c.is_finite() || c <= 0.0 {
                return Err(Error::InvalidConfig(format!(
                    "softcap must be finite and > 0, got {c}"
                )));
            }
        }
        Ok(())
    }

    /// The keys each row of this call sees for given sequence lengths.
    pub fn key_rule(&self, seqlen_q: usize, seqlen_k: usize) -> KeyRule {
        self.mask.key_rule(seqlen_q, seqlen_k)
    }
}

/// Which keys each query row may see for given sequence lengths: one place for the mask's
/// index arithmetic (the GPU kernels' counterpart is `KeyRange` in csrc/common/block_range.h).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeyRule {
    pub seqlen_q: usize,
    pub seqlen_k: usize,
    pub left: Option<usize>,
    pub right: Option<usize>,
}

impl KeyRule {
    /// Half-open key range `[lo, hi)` visible to query row `i` (empty when `lo >= hi`). A
    /// window wider than both sequences (`Some(usize::MAX)`, say) is unbounded, as `None` is:
    /// the arithmetic is in i128, where no usize sum overflows.
    pub fn key_range(&self, i: usize) -> (usize, usize) {
        // Bottom-right alignment: row i sits on key diagonal i + s_k - s_q (may be negative).
        let diag = i as i128 + self.seqlen_k as i128 - self.seqlen_q as i128;
        let s_k = self.seqlen_k as i128;
        let lo = match self.left {
            Some(l) => (diag - l as i128).clamp(0, s_k),
            None => 0,
        };
        let hi = match self.right {
            Some(r) => (diag + r as i128 + 1).clamp(0, s_k),
            None => s_k,
        };
        (lo as usize, hi.max(lo) as usize)
    }

    pub fn is_full(&self) -> bool {
        self.left.is_none() && self.right.is_none()
    }

    /// Whether the right bound hides a key from some row: row 0 sees keys up to
    /// `seqlen_k − seqlen_q + right`, so a right window of `seqlen_q − 1` or more hides none.
    pub fn bounds_some_row_on_the_right(&self) -> bool {
        self.right
            .is_some_and(|r| r.saturating_add(1) < self.seqlen_q)
    }

    /// Whether the left bound hides a key from some row: the last row sees keys from
    /// `seqlen_k − 1 − left`, so a left window of `seqlen_k − 1` or more hides none.
    pub fn bounds_some_row_on_the_left(&self) -> bool {
        self.left
            .is_some_and(|l| l.saturating_add(1) < self.seqlen_k)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_right_window_of_seqlen_q_minus_1_hides_no_key() {
        let rule = |sq, right| AttentionMask::Window { left: None, right }.key_rule(sq, 50);
        assert!(rule(8, Some(6)).bounds_some_row_on_the_right());
        assert!(!rule(8, Some(7)).bounds_some_row_on_the_right());
        assert!(!rule(8, Some(usize::MAX)).bounds_some_row_on_the_right());
        assert!(!rule(8, None).bounds_some_row_on_the_right());
        // What the rule says, row by row: row 0 misses the last key exactly when bounded.
        for right in 0..10 {
            let r = rule(8, Some(right));
            assert_eq!(
                r.key_range(0).1 < 50,
                r.bounds_some_row_on_the_right(),
                "{right}"
            );
        }
    }

    #[test]
    fn a_left_window_of_seqlen_k_minus_1_hides_no_key() {
        let rule = |sk, left| AttentionMask::Window { left, right: None }.key_rule(8, sk);
        assert!(rule(50, Some(48)).bounds_some_row_on_the_left());
        assert!(!rule(50, Some(49)).bounds_some_row_on_the_left());
        assert!(!rule(50, Some(usize::MAX)).bounds_some_row_on_the_left());
        assert!(!rule(50, None).bounds_some_row_on_the_left());
        // What the rule says, row by row: the last row misses key 0 exactly when bounded.
        for left in 0..60 {
            let r = rule(50, Some(left));
            assert_eq!(
                r.key_range(7).0 > 0,
                r.bounds_some_row_on_the_left(),
                "{left}"
            );
        }
    }

    #[test]
    fn causal_is_bottom_right_aligned() {
        let m = AttentionConfig::new().causal(true).key_rule(2, 5);
        assert_eq!(m.key_range(0), (0, 4));
        assert_eq!(m.key_range(1), (0, 5));
        // More queries than keys: the first rows see nothing.
        let m = AttentionConfig::new().causal(true).key_rule(5, 2);
        assert_eq!(m.key_range(0), (0, 0));
        assert_eq!(m.key_range(2), (0, 0));
        assert_eq!(m.key_range(3), (0, 1));
        assert_eq!(m.key_range(4), (0, 2));
    }

    #[test]
    fn window_clamps_both_sides() {
        let m = AttentionConfig::new()
            .window(Some(2), Some(1))
            .key_rule(8, 8);
        assert_eq!(m.key_range(0), (0, 2));
        assert_eq!(m.key_range(4), (2, 6));
        assert_eq!(m.key_range(7), (5, 8));
    }

    #[test]
    fn causal_is_the_window_with_nothing_right_of_the_diagonal() {
        let window = AttentionMask::Window {
            left: None,
            right: Some(0),
        };
        assert_eq!(AttentionMask::Causal.bounds(), window.bounds());
        assert!(AttentionMask::Causal.is_causal() && window.is_causal());
        assert!(!AttentionMask::Full.is_causal());
        for (s_q, s_k) in [(1, 7), (7, 7), (9, 4)] {
            assert_eq!(
                AttentionMask::Causal.key_rule(s_q, s_k),
                window.key_rule(s_q, s_k)
            );
        }
    }

    #[test]
    fn the_last_mask_setter_wins() {
        let cfg = AttentionConfig::new().causal(true).window(Some(3), None);
        assert_eq!(
            cfg.mask,
            AttentionMask::Window {
                left: Some(3),
                right: None
            }
        );
        let cfg = cfg.causal(false);
        assert_eq!(cfg.mask, AttentionMask::Full);
        let cfg = cfg.mask(AttentionMask::Causal);
        assert_eq!(cfg, AttentionConfig::new().causal(true));
    }

    #[test]
    fn bad_values_are_errors() {
        assert!(AttentionConfig::new()
            .softmax_scale(-1.0)
            .validate()
            .is_err());
        assert!(AttentionConfig::new().softcap(f32::NAN).validate().is_err());
        assert!(AttentionConfig::new().validate().is_ok());
    }
}
