//! Attention sinks in the reference and the baseline (no GPU needed): the oracles the kernels'
//! sink tests are judged by must themselves be right. The f64 reference's sink gradient and its
//! dQ, dK are checked against finite differences of `Σ dO∘O`, a sink too negative to matter
//! changes nothing, a row that sees no key has the sink as its LSE, and the bf16 baseline stays
//! close to the reference while a result that ignores the sinks fails the rule.

use flashattn::reference::{
    baseline_backward_sinks, baseline_forward, baseline_forward_sinks, baseline_row_sinks, compare,
    reference_backward, reference_backward_sinks, reference_forward, reference_forward_sinks,
    reference_row_sinks,
};
use flashattn::{AttentionConfig, TensorRef};
use half::bf16;

use crate::small_problem::{
    check_element_gradient, check_sink_gradient, configs, wave, Grad, Inputs, B, D, HKV, HQ, SINKS,
    SK, SQ,
};

fn max_abs_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| if x == y { 0.0 } else { (x - y).abs() })
        .fold(0.0, f64::max)
}

fn max_abs(a: &[f64]) -> f64 {
    a.iter().map(|x| x.abs()).fold(0.0, f64::max)
}

fn widen(a: &[f32]) -> Vec<f64> {
    a.iter().map(|&x| x as f64).collect()
}

/// Where O's row `i` of head `h`, batch `b` starts in a packed `(b, s_q, h_q, d)` buffer.
fn q_row(b: usize, i: usize, h: usize) -> usize {
    ((b * SQ + i) * HQ + h) * D
}

#[test]
fn the_sink_gradient_is_the_finite_difference_of_the_loss() {
    let x = Inputs::new(D, D);
    for cfg in configs() {
        check_sink_gradient(&x, &cfg, &SINKS);
        // One element of Q and one of K: dS must be formed with the sink-aware LSE.
        let dk_at = ((SK + 2) * HKV + 1) * D + 6;
        for (grad, idx) in [(Grad::Q, q_row(1, 5, 2) + 3), (Grad::K, dk_at)] {
            check_element_gradient(&x, &cfg, &SINKS, grad, idx);
        }
    }
}

#[test]
fn a_sink_too_negative_to_matter_changes_nothing() {
    // More keys than queries: every row sees a key (an empty row's LSE would be the sink, not
    // +inf).
    let (sq, sk) = (5, 7);
    let q = wave(B * sq * HQ * D, 0.61, 0.3, 1.1);
    let kv = wave(B * sk * HKV * D, 0.29, 1.1, 1.3);
    let v = wave(B * sk * HKV * D, 0.47, 2.0, 1.0);
    let dout = wave(B * sq * HQ * D, 0.83, 0.7, 1.0);
    let q = TensorRef::contiguous(&q, [B, sq, HQ, D]);
    let k = TensorRef::contiguous(&kv, [B, sk, HKV, D]);
    let v = TensorRef::contiguous(&v, [B, sk, HKV, D]);
    let dout = TensorRef::contiguous(&dout, [B, sq, HQ, D]);
    let sinks = [-1e4f32; HQ];
    for cfg in [
        AttentionConfig::new(),
        AttentionConfig::new().causal(true),
        AttentionConfig::new().causal(true).softcap(2.0),
    ] {
        let plain = reference_forward(&cfg, q, k, v);
        let with = reference_forward_sinks(&cfg, q, k, v, &sinks);
        assert!(max_abs_diff(&plain.out, &with.out) < 1e-12, "{cfg:?}");
        assert!(max_abs_diff(&plain.lse, &with.lse) < 1e-12, "{cfg:?}");
        let plain = reference_backward(&cfg, q, k, v, dout);
        let (with, d_sink) = reference_backward_sinks(&cfg, q, k, v, dout, &sinks);
        assert!(max_abs_diff(&plain.dq, &with.dq) < 1e-12, "{cfg:?}");
        assert!(max_abs_diff(&plain.dk, &with.dk) < 1e-12, "{cfg:?}");
        assert!(max_abs_diff(&plain.dv, &with.dv) < 1e-12, "{cfg:?}");
        assert!(d_sink.iter().all(|g| g.abs() < 1e-12), "{d_sink:?}");
        // The baseline's exp(sink − max) is an exact 0 in f32.
        let plain = baseline_forward(&cfg, q, k, v);
        let with = baseline_forward_sinks(&cfg, q, k, v, &sinks);
        assert_eq!(plain.out, with.out, "{cfg:?}");
        assert_eq!(plain.lse, with.lse, "{cfg:?}");
    }
}

#[test]
fn a_row_that_sees_no_key_has_the_sink_as_its_lse() {
    let x = Inputs::new(D, D);
    let [q, k, v, dout] = x.tensors();
    let cfg = AttentionConfig::new().causal(true);
    let r = reference_forward_sinks(&cfg, q, k, v, &SINKS);
    let bl = baseline_forward_sinks(&cfg, q, k, v, &SINKS);
    let (g, _) = reference_backward_sinks(&cfg, q, k, v, dout, &SINKS);
    let (bg, _) = baseline_backward_sinks(&cfg, q, k, v, dout, &SINKS);
    // Causal with s_q − s_k = 2: rows 0 and 1 see nothing, row 2 sees key 0.
    for b in 0..B {
        for (h, &sink) in SINKS.iter().enumerate() {
            for i in 0..SQ {
                let empty = i < SQ - SK;
                let lse = (b * HQ + h) * SQ + i;
                let row = q_row(b, i, h)..q_row(b, i, h) + D;
                if empty {
                    assert_eq!(r.lse[lse], sink as f64);
                    assert_eq!(bl.lse[lse], sink);
                    assert!(r.out[row.clone()].iter().all(|&o| o == 0.0));
                    assert!(bl.out[row.clone()].iter().all(|&o| o == 0.0));
                    assert!(g.dq[row.clone()].iter().all(|&o| o == 0.0));
                    assert!(bg.dq[row.clone()].iter().all(|&o| o == 0.0));
                } else {
                    assert!(r.lse[lse].is_finite() && r.lse[lse] > sink as f64);
                }
                // The single rows agree with the whole computations.
                let (o, l) = reference_row_sinks(&cfg, q, k, v, &SINKS, b, h, i);
                assert_eq!((&o[..], l), (&r.out[row.clone()], r.lse[lse]));
                let (o, l) = baseline_row_sinks(&cfg, q, k, v, &SINKS, b, h, i);
                assert_eq!((&o[..], l), (&bl.out[row], bl.lse[lse]));
            }
        }
    }
}

#[test]
fn the_sink_is_one_more_column_without_a_value() {
    // Q = 0: every score is 0, so with n visible keys LSE = ln(e^sink + n) and
    // O = Σ_j V_j / (e^sink + n).
    let q = vec![0f32; B * SQ * HQ * D];
    let x = Inputs::new(D, D);
    let q = TensorRef::contiguous(&q, [B, SQ, HQ, D]);
    let [_, k, v, _] = x.tensors();
    let r = reference_forward_sinks(&AttentionConfig::new(), q, k, v, &SINKS);
    for b in 0..B {
        for (h, &sink) in SINKS.iter().enumerate() {
            let denom = (sink as f64).exp() + SK as f64;
            for i in 0..SQ {
                let lse = r.lse[(b * HQ + h) * SQ + i];
                assert!((lse - denom.ln()).abs() < 1e-14, "{lse} vs {}", denom.ln());
                for c in 0..D {
                    let want: f64 = (0..SK)
                        .map(|j| x.v[((b * SK + j) * HKV + h / (HQ / HKV)) * D + c] as f64)
                        .sum::<f64>()
                        / denom;
                    let got = r.out[q_row(b, i, h) + c];
                    assert!((got - want).abs() < 1e-14, "{got} vs {want}");
                }
            }
        }
    }
}

#[test]
fn the_bf16_baseline_with_sinks_is_close_to_the_reference() {
    // A larger GQA problem whose causal mask leaves the first 7 rows without a key.
    let (b, sq, sk, hq, hkv, d) = (2, 40, 33, 4, 2, 32);
    let bf = |x: Vec<f32>| -> Vec<bf16> { x.into_iter().map(bf16::from_f32).collect() };
    let q = bf(wave(b * sq * hq * d, 0.61, 0.3, 1.1));
    let k = bf(wave(b * sk * hkv * d, 0.29, 1.1, 1.3));
    let v = bf(wave(b * sk * hkv * d, 0.47, 2.0, 1.0));
    let dout = bf(wave(b * sq * hq * d, 0.83, 0.7, 1.0));
    let q = TensorRef::contiguous(&q, [b, sq, hq, d]);
    let k = TensorRef::contiguous(&k, [b, sk, hkv, d]);
    let v = TensorRef::contiguous(&v, [b, sk, hkv, d]);
    let dout = TensorRef::contiguous(&dout, [b, sq, hq, d]);
    let sinks = [0.5f32, -0.25, 1.0, 2.5];
    for cfg in [
        AttentionConfig::new().causal(true),
        AttentionConfig::new().causal(true).softcap(2.0),
    ] {
        let r = reference_forward_sinks(&cfg, q, k, v, &sinks);
        let bl = baseline_forward_sinks(&cfg, q, k, v, &sinks);
        let (rg, rs) = reference_backward_sinks(&cfg, q, k, v, dout, &sinks);
        let (bg, bs) = baseline_backward_sinks(&cfg, q, k, v, dout, &sinks);
        // dQ, dK, dV sum dS rounded to bf16 over rows and keys, where they partly cancel: they
        // get the looser bound that bf16 needs without sinks as well.
        for (what, base, want, rel) in [
            ("O", &bl.out, &r.out, 1e-2),
            ("LSE", &bl.lse, &r.lse, 1e-2),
            ("d_sink", &bs, &rs, 1e-2),
            ("dQ", &bg.dq, &rg.dq, 3e-2),
            ("dK", &bg.dk, &rg.dk, 3e-2),
            ("dV", &bg.dv, &rg.dv, 3e-2),
        ] {
            let err = max_abs_diff(&widen(base), want);
            let bound = rel * max_abs(want);
            assert!(err <= bound, "{cfg:?} {what}: {err:.3e} > {bound:.3e}");
            // bf16 leaves a visible error where there is rounding (not in the empty rows' LSE).
            if what != "LSE" {
                assert!(err > 0.0, "{cfg:?} {what}");
            }
        }
        // A result that ignores the sinks fails the rule against the sink reference: the
        // baseline's allowance is tight enough to see them.
        let ignoring = baseline_forward(&cfg, q, k, v);
        let c = compare(&ignoring.out, &r.out, &bl.out);
        assert!(!c.pass, "{cfg:?}: O without sinks {c}");
        // While the baseline itself passes, as every correct result should.
        assert!(compare(&bl.out, &r.out, &bl.out).pass);
        assert!(compare(&bl.lse, &r.lse, &bl.lse).pass);
    }
}
