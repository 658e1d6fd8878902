//! Fully masked and NaN-poisoned rows, the entry points agreeing, sampled rows of a large shape.

use flashattn::reference::{self, compare};
use flashattn::{
    AttentionConfig, Backend, BackwardInputs, ForwardInputs, GradientsMut, TensorMut, TensorRef,
};
use half::bf16;
use rand::rngs::StdRng;
use rand::SeedableRng;

use crate::case;
use crate::harness::{random, Case};
use flashattn::DType::BF16;

/// Fully masked rows: O = 0 exactly, LSE = +inf, no NaN; a dO nonzero only on those rows gives
/// exactly zero gradients.
fn check_fully_masked(cfg: &AttentionConfig, sq: usize, sk: usize, masked: usize) {
    let (h, d) = (2, 32);
    let mut rng = StdRng::seed_from_u64(77);
    let qv = random::<f32>(sq * h * d, &mut rng);
    let kv = random::<f32>(sk * h * d, &mut rng);
    let vv = random::<f32>(sk * h * d, &mut rng);
    let (q, k, v) = (
        TensorRef::contiguous(&qv, [1, sq, h, d]),
        TensorRef::contiguous(&kv, [1, sk, h, d]),
        TensorRef::contiguous(&vv, [1, sk, h, d]),
    );
    let keys = cfg.key_rule(sq, sk);
    let is_masked = |i: usize| {
        let (lo, hi) = keys.key_range(i);
        lo >= hi
    };
    assert_eq!((0..sq).filter(|&i| is_masked(i)).count(), masked);

    let fwd = flashattn::forward(cfg, ForwardInputs::new(q, k, v)).unwrap();
    assert!(fwd.out.iter().all(|x| !x.is_nan()));
    for hh in 0..h {
        for i in 0..sq {
            let lse = fwd.lse[hh * sq + i];
            let row = &fwd.out[(i * h + hh) * d..][..d];
            if is_masked(i) {
                assert_eq!(lse, f32::INFINITY, "row {i}");
                assert!(row.iter().all(|&x| x == 0.0), "row {i}");
            } else {
                assert!(lse.is_finite(), "row {i}");
                assert!(row.iter().any(|&x| x != 0.0), "row {i}");
            }
        }
    }
    // Against the reference with a random dO.
    let r = reference::reference_forward(cfg, q, k, v);
    let bl = reference::baseline_forward(cfg, q, k, v);
    let c = compare(&fwd.out, &r.out, &bl.out);
    assert!(c.pass, "O {c}");
    assert!(compare(&fwd.lse, &r.lse, &bl.lse).pass);
    let out = TensorRef::contiguous(&fwd.out, [1, sq, h, d]);
    let dov = random::<f32>(sq * h * d, &mut rng);
    let dout = TensorRef::contiguous(&dov, [1, sq, h, d]);
    let g = flashattn::backward(
        cfg,
        BackwardInputs {
            q,
            k,
            v,
            out,
            dout,
            lse: &fwd.lse,
            sinks: None,
        },
    )
    .unwrap();
    let rg = reference::reference_backward(cfg, q, k, v, dout);
    let bg = reference::baseline_backward(cfg, q, k, v, dout);
    for (what, got, want, base) in [
        ("dQ", &g.dq, &rg.dq, &bg.dq),
        ("dK", &g.dk, &rg.dk, &bg.dk),
        ("dV", &g.dv, &rg.dv, &bg.dv),
    ] {
        let c = compare(got, want, base);
        assert!(c.pass, "{what} {c}");
    }
    for i in (0..sq).filter(|&i| is_masked(i)) {
        assert!(g.dq[i * h * d..(i + 1) * h * d].iter().all(|&x| x == 0.0));
    }
    // dO only on the masked rows: nothing flows back.
    let mut dov = dov;
    for i in (0..sq).filter(|&i| !is_masked(i)) {
        dov[i * h * d..(i + 1) * h * d].fill(0.0);
    }
    assert!(dov.iter().any(|&x| x != 0.0));
    let dout = TensorRef::contiguous(&dov, [1, sq, h, d]);
    let g = flashattn::backward(
        cfg,
        BackwardInputs {
            q,
            k,
            v,
            out,
            dout,
            lse: &fwd.lse,
            sinks: None,
        },
    )
    .unwrap();
    for (what, grad) in [("dQ", &g.dq), ("dK", &g.dk), ("dV", &g.dv)] {
        assert!(grad.iter().all(|&x| x == 0.0), "{what} not zero");
    }
}

/// A NaN key poisons O and the LSE of exactly the rows that see it, as in the reference.
#[test]
fn a_nan_key_poisons_the_rows_that_see_it() {
    let (sq, sk, h, d) = (40, 70, 2, 32);
    let mut rng = StdRng::seed_from_u64(5);
    let qv = random::<f32>(sq * h * d, &mut rng);
    let mut kv = random::<f32>(sk * h * d, &mut rng);
    let vv = random::<f32>(sk * h * d, &mut rng);
    kv[(50 * h) * d + 3] = f32::NAN; // key 50 of head 0
    let cfg = AttentionConfig::new().causal(true); // row i sees keys up to i + 30
    let fwd = flashattn::forward(
        &cfg,
        ForwardInputs::new(
            TensorRef::contiguous(&qv, [1, sq, h, d]),
            TensorRef::contiguous(&kv, [1, sk, h, d]),
            TensorRef::contiguous(&vv, [1, sk, h, d]),
        ),
    )
    .unwrap();
    for hh in 0..h {
        for i in 0..sq {
            let sees_nan = hh == 0 && i + 30 >= 50;
            let lse = fwd.lse[hh * sq + i];
            let row = &fwd.out[(i * h + hh) * d..][..d];
            assert_eq!(lse.is_nan(), sees_nan, "head {hh} row {i}: LSE {lse}");
            assert!(
                row.iter().all(|x| x.is_nan() == sees_nan),
                "head {hh} row {i}: O {row:?}"
            );
        }
    }
}

#[test]
fn fully_masked_rows_from_a_window() {
    // Window (0, 0) with s_q > s_k: rows whose diagonal i + s_k − s_q is negative see nothing.
    check_fully_masked(&AttentionConfig::new().window(Some(0), Some(0)), 10, 4, 6);
}

#[test]
fn fully_masked_rows_causal_more_queries_than_keys() {
    check_fully_masked(&AttentionConfig::new().causal(true), 20, 5, 15);
}

#[test]
fn public_backward_matches_backend_and_is_deterministic() {
    allocating_calls_match_the_others(case(2, 45, 70, 4, 2, 64, BF16).causal(true));
}

/// The allocating calls with V's head dim apart from Q's: O and dV shaped by it.
#[test]
fn allocating_calls_with_v_head_dim_apart() {
    allocating_calls_match_the_others(
        case(2, 45, 70, 4, 2, 192, BF16)
            .head_dim_v(128)
            .causal(true),
    );
    allocating_calls_match_the_others(case(1, 17, 33, 4, 1, 40, BF16).head_dim_v(72));
}

/// `forward()` and `backward()` (which allocate) against the reference under the rule and
/// against `forward_into()` and `backward_into()` bit for bit, twice (the backward repeats
/// itself).
fn allocating_calls_match_the_others(c: Case) {
    let mut rng = StdRng::seed_from_u64(5);
    let [qv, kv, vv] = c.random_qkv::<bf16>(&mut rng);
    let dov = random::<bf16>(c.o_shape().iter().product(), &mut rng);
    let q = TensorRef::contiguous(&qv, c.q_shape());
    let k = TensorRef::contiguous(&kv, c.kv_shape());
    let v = TensorRef::contiguous(&vv, c.v_shape());
    let dout = TensorRef::contiguous(&dov, c.o_shape());
    let cfg = c.cfg(Backend::Auto);
    let fwd = flashattn::forward(&cfg, ForwardInputs::new(q, k, v)).unwrap();
    assert_eq!(fwd.out.len(), c.o_shape().iter().product::<usize>());
    // forward() and forward_into() agree bit for bit.
    let mut o2 = vec![bf16::from_f32(f32::NAN); fwd.out.len()];
    let mut lse2 = vec![f32::NAN; fwd.lse.len()];
    flashattn::forward_into(
        &cfg,
        ForwardInputs::new(q, k, v),
        TensorMut::contiguous(&mut o2, c.o_shape()),
        &mut lse2,
    )
    .unwrap();
    assert_eq!(o2, fwd.out);
    assert_eq!(lse2, fwd.lse);
    let out = TensorRef::contiguous(&fwd.out, c.o_shape());
    let g1 = flashattn::backward(
        &cfg,
        BackwardInputs {
            q,
            k,
            v,
            out,
            dout,
            lse: &fwd.lse,
            sinks: None,
        },
    )
    .unwrap();
    let g2 = flashattn::backward(
        &cfg,
        BackwardInputs {
            q,
            k,
            v,
            out,
            dout,
            lse: &fwd.lse,
            sinks: None,
        },
    )
    .unwrap();
    assert_eq!((&g1.dq, &g1.dk, &g1.dv), (&g2.dq, &g2.dk, &g2.dv));
    assert_eq!(g1.dv.len(), c.v_shape().iter().product::<usize>());
    let (r, bl) = (
        reference::reference_forward(&cfg, q, k, v),
        reference::baseline_forward(&cfg, q, k, v),
    );
    let (rg, bg) = (
        reference::reference_backward(&cfg, q, k, v, dout),
        reference::baseline_backward(&cfg, q, k, v, dout),
    );
    let f32s = reference::to_f32;
    for (what, got, want, base) in [
        ("O", f32s(&fwd.out), &r.out, &bl.out),
        ("dQ", f32s(&g1.dq), &rg.dq, &bg.dq),
        ("dK", f32s(&g1.dk), &rg.dk, &bg.dk),
        ("dV", f32s(&g1.dv), &rg.dv, &bg.dv),
    ] {
        let cmp = compare(&got, want, base);
        assert!(cmp.pass, "{} {what}: {cmp}", c.name());
    }
    let cmp = compare(&fwd.lse, &r.lse, &bl.lse);
    assert!(cmp.pass, "{} LSE: {cmp}", c.name());
    let mut dq = vec![bf16::from_f32(f32::NAN); g1.dq.len()];
    let mut dk = vec![bf16::from_f32(f32::NAN); g1.dk.len()];
    let mut dv = vec![bf16::from_f32(f32::NAN); g1.dv.len()];
    flashattn::backward_into(
        &cfg,
        BackwardInputs {
            q,
            k,
            v,
            out,
            dout,
            lse: &fwd.lse,
            sinks: None,
        },
        GradientsMut {
            dq: TensorMut::contiguous(&mut dq, c.q_shape()),
            dk: TensorMut::contiguous(&mut dk, c.kv_shape()),
            dv: TensorMut::contiguous(&mut dv, c.v_shape()),
            dsinks: None,
        },
    )
    .unwrap();
    assert!(g1.dq.iter().any(|x| x.to_f32() != 0.0));
    assert_eq!((dq, dk, dv), (g1.dq, g1.dk, g1.dv));
}

#[test]
fn sampled_rows_of_a_larger_shape() {
    // the correctness rule of docs/ARCHITECTURE.md for shapes too large to check whole: no NaN or
    // poison anywhere, and sampled rows against the f64 reference row (f32 inputs, so a tight
    // absolute bound).
    let (b, s, h, d) = (1, 1536, 4, 64);
    let mut rng = StdRng::seed_from_u64(9);
    let qv = random::<f32>(b * s * h * d, &mut rng);
    let kv = random::<f32>(b * s * 2 * d, &mut rng);
    let vv = random::<f32>(b * s * 2 * d, &mut rng);
    let q = TensorRef::contiguous(&qv, [b, s, h, d]);
    let k = TensorRef::contiguous(&kv, [b, s, 2, d]);
    let v = TensorRef::contiguous(&vv, [b, s, 2, d]);
    let cfg = AttentionConfig::new().causal(true);
    let mut out = vec![f32::NAN; qv.len()];
    let mut lse = vec![f32::NAN; b * h * s];
    flashattn::forward_into(
        &cfg,
        ForwardInputs::new(q, k, v),
        TensorMut::contiguous(&mut out, [b, s, h, d]),
        &mut lse,
    )
    .unwrap();
    assert!(out.iter().chain(&lse).all(|x| x.is_finite()));
    for _ in 0..12 {
        let (hh, i) = (
            rand::Rng::random_range(&mut rng, 0..h),
            rand::Rng::random_range(&mut rng, 0..s),
        );
        let (want, want_lse) = reference::reference_row(&cfg, q, k, v, 0, hh, i);
        let got = &out[(i * h + hh) * d..][..d];
        let err = got
            .iter()
            .zip(&want)
            .map(|(&g, &w)| (g as f64 - w).abs())
            .fold(0.0, f64::max);
        assert!(err < 1e-5, "row {i} head {hh}: err {err}");
        assert!(
            (lse[hh * s + i] as f64 - want_lse).abs() < 1e-4,
            "lse row {i}"
        );
    }
}
