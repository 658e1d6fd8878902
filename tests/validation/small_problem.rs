//! The small problem the oracle tests share (sinks, V's own head dim): GQA (4 query heads over
//! 2 KV heads) with more queries than keys, so that a causal mask leaves the first rows without
//! a key; deterministic inputs; and the f64 reference's gradients checked against central
//! differences of the loss `Σ dO∘O`.

use flashattn::reference::{reference_backward_sinks, reference_forward_sinks};
use flashattn::{AttentionConfig, TensorRef};

pub const B: usize = 2;
pub const SQ: usize = 7;
pub const SK: usize = 5;
pub const HQ: usize = 4;
pub const HKV: usize = 2;
/// Q's and K's head dim (V's is each test's).
pub const D: usize = 8;

/// Logits exactly representable in f32, and so after a step of [`STEP`] either way.
pub const SINKS: [f32; HQ] = [0.5, -0.25, 1.0, -1.5];

/// The finite-difference step: 2⁻¹⁷ (about 1e-5), exact in f32 beside every value it is added
/// to here, so that the step taken is the step divided by.
pub const STEP: f32 = 1.0 / 131_072.0;

/// `n` values `amp·sin(f·i + phase)`: deterministic inputs that differ per operand.
pub fn wave(n: usize, f: f32, phase: f32, amp: f32) -> Vec<f32> {
    (0..n).map(|i| amp * (f * i as f32 + phase).sin()).collect()
}

/// The configurations of the gradient checks: each leaves the first row of every head without
/// a visible key.
pub fn configs() -> [AttentionConfig; 3] {
    [
        AttentionConfig::new().causal(true),
        AttentionConfig::new().causal(true).softcap(2.0),
        AttentionConfig::new().window(Some(2), Some(1)),
    ]
}

/// The problem's Q, K (head dim `d`), V and dO (head dim `dv`).
pub struct Inputs {
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub dout: Vec<f32>,
    d: usize,
    dv: usize,
}

/// The operand whose gradient a check takes.
#[derive(Clone, Copy, Debug)]
pub enum Grad {
    Q,
    K,
    V,
}

impl Inputs {
    pub fn new(d: usize, dv: usize) -> Self {
        Inputs {
            q: wave(B * SQ * HQ * d, 0.61, 0.3, 1.1),
            k: wave(B * SK * HKV * d, 0.29, 1.1, 1.3),
            v: wave(B * SK * HKV * dv, 0.47, 2.0, 1.0),
            dout: wave(B * SQ * HQ * dv, 0.83, 0.7, 1.0),
            d,
            dv,
        }
    }

    pub fn tensors(&self) -> [TensorRef<'_, f32>; 4] {
        let (d, dv) = (self.d, self.dv);
        [
            TensorRef::contiguous(&self.q, [B, SQ, HQ, d]),
            TensorRef::contiguous(&self.k, [B, SK, HKV, d]),
            TensorRef::contiguous(&self.v, [B, SK, HKV, dv]),
            TensorRef::contiguous(&self.dout, [B, SQ, HQ, dv]),
        ]
    }

    /// `Σ dO∘O` in f64, the loss whose gradients the backward computes.
    pub fn loss(&self, cfg: &AttentionConfig, sinks: &[f32]) -> f64 {
        let [q, k, v, _] = self.tensors();
        let out = reference_forward_sinks(cfg, q, k, v, sinks).out;
        assert_eq!(out.len(), self.dout.len());
        out.iter().zip(&self.dout).map(|(o, g)| o * *g as f64).sum()
    }

    /// The inputs with element `idx` of `grad`'s operand set to `value`.
    fn with(&self, grad: Grad, idx: usize, value: f32) -> Self {
        let mut y = Inputs::new(self.d, self.dv);
        match grad {
            Grad::Q => y.q[idx] = value,
            Grad::K => y.k[idx] = value,
            Grad::V => y.v[idx] = value,
        }
        y
    }
}

/// The reference's sink gradient of every head against central differences of the loss.
pub fn check_sink_gradient(x: &Inputs, cfg: &AttentionConfig, sinks: &[f32; HQ]) {
    let [q, k, v, dout] = x.tensors();
    let (_, d_sink) = reference_backward_sinks(cfg, q, k, v, dout, sinks);
    assert_eq!(d_sink.len(), HQ);
    for h in 0..HQ {
        let (mut up, mut down) = (*sinks, *sinks);
        up[h] += STEP;
        down[h] -= STEP;
        let fd = (x.loss(cfg, &up) - x.loss(cfg, &down)) / (2.0 * STEP as f64);
        let rel = (fd - d_sink[h]).abs() / d_sink[h].abs();
        assert!(
            rel < 1e-6,
            "{cfg:?} head {h}: d_sink {} vs finite difference {fd} (rel {rel:.2e})",
            d_sink[h]
        );
    }
}

/// The reference's gradient of element `idx` of `grad`'s operand, set to 0.375 (exact in f32
/// at ± [`STEP`]), against central differences of the loss; an element whose gradient vanishes
/// would pass trivially, so it must not.
pub fn check_element_gradient(
    x: &Inputs,
    cfg: &AttentionConfig,
    sinks: &[f32; HQ],
    grad: Grad,
    idx: usize,
) {
    let y = x.with(grad, idx, 0.375);
    let [q, k, v, dout] = y.tensors();
    let (g, _) = reference_backward_sinks(cfg, q, k, v, dout, sinks);
    let analytic = match grad {
        Grad::Q => g.dq[idx],
        Grad::K => g.dk[idx],
        Grad::V => g.dv[idx],
    };
    let fd = (x.with(grad, idx, 0.375 + STEP).loss(cfg, sinks)
        - x.with(grad, idx, 0.375 - STEP).loss(cfg, sinks))
        / (2.0 * STEP as f64);
    let rel = (fd - analytic).abs() / analytic.abs();
    assert!(
        rel < 1e-6,
        "{cfg:?} d{grad:?}[{idx}]: {analytic} vs finite difference {fd} (rel {rel:.2e})"
    );
    assert!(analytic.abs() > 1e-4, "{cfg:?} d{grad:?}: {analytic}");
}
