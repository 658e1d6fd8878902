//! The CPU backend against the f64 reference under FlashAttention's rule (the correctness rule of
//! docs/ARCHITECTURE.md): `max|out − ref| ≤ 2·max|baseline − ref| + 1e-5` for O, LSE, dQ, dK and
//! dV, over random N(0,1) inputs, with every output poisoned (NaN) before the call. Then fully
//! masked rows and bad inputs, each bad input matched to its error variant.

mod harness;

use flashattn::reference::{self, compare, pack_f32, Comparison};
use flashattn::{
    AttentionConfig, Backend, BackwardInputs, DType, Element, Error, GradientsMut, Layout, Operand,
    TensorMut, TensorRef,
};
use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::SeedableRng;

use harness::{poisoned, random, random_in, untouched_nan, Case, Storage};

/// The tables' shorthand: batch, s_q, s_k, heads of Q and of K/V, head dim, dtype.
fn case(b: usize, sq: usize, sk: usize, hq: usize, hkv: usize, d: usize, dtype: DType) -> Case {
    Case::new(sq, sk, d).batch(b).heads(hq, hkv).dtype(dtype)
}

struct Outcome {
    name: String,
    results: Vec<(&'static str, Comparison)>,
}

impl Outcome {
    fn pass(&self) -> bool {
        self.results.iter().all(|(_, c)| c.pass)
    }
    fn line(&self) -> String {
        let worst = self
            .results
            .iter()
            .map(|(_, c)| c.ratio)
            .fold(0.0, f64::max);
        let parts: Vec<String> = self
            .results
            .iter()
            .map(|(w, c)| format!("{w} {:.3}", c.ratio))
            .collect();
        format!(
            "{} {:<60} max ratio {worst:.3} | {}",
            if self.pass() { "ok  " } else { "FAIL" },
            self.name,
            parts.join(" ")
        )
    }
}

/// Forward and backward of one case, compared with the reference under the rule.
fn run<T: Element>(c: &Case, seed: u64) -> Outcome {
    assert_eq!(T::DTYPE, c.dtype);
    let mut rng = StdRng::seed_from_u64(seed);
    let (lq, lk) = c.layouts();
    let [qb, kb, vb, dob] = [lq, lk, lk, lq].map(|l| random_in::<T>(&l, &mut rng));
    let (q, k, v) = (
        TensorRef::new(&qb, lq),
        TensorRef::new(&kb, lk),
        TensorRef::new(&vb, lk),
    );
    let dout = TensorRef::new(&dob, lq);
    let cfg = c.cfg(Backend::Auto);

    // Forward into poisoned outputs; one LSE slot past the end must stay untouched.
    let mut ob = poisoned::<T>(&lq);
    let lse_len = c.batch * c.heads_q * c.seqlen_q;
    let mut lse = vec![f32::NAN; lse_len + 1];
    let plan = flashattn::forward_into(&cfg, q, k, v, TensorMut::new(&mut ob, lq), &mut lse)
        .unwrap_or_else(|e| panic!("{}: {e}", c.name()));
    assert_eq!(plan.backend, Backend::Cpu);
    assert!(lse[lse_len].is_nan(), "{}: wrote past the LSE", c.name());
    let (nan, unaddressed) = untouched_nan(&ob, &lq);
    assert_eq!(
        nan,
        unaddressed,
        "{}: out poison left or padding written",
        c.name()
    );
    let out = TensorRef::new(&ob, lq);

    let r = reference::reference_forward(&cfg, q, k, v);
    let bl = reference::baseline_forward(&cfg, q, k, v);
    let mut results = vec![
        ("O", compare(&pack_f32(out), &r.out, &bl.out)),
        ("LSE", compare(&lse[..lse_len], &r.lse, &bl.lse)),
    ];

    // Backward into poisoned gradients laid out like their inputs.
    let [mut dqb, mut dkb, mut dvb] = [lq, lk, lk].map(|l| poisoned::<T>(&l));
    flashattn::backward_into(
        &cfg,
        BackwardInputs {
            q,
            k,
            v,
            out,
            dout,
            lse: &lse[..lse_len],
        },
        GradientsMut {
            dq: TensorMut::new(&mut dqb, lq),
            dk: TensorMut::new(&mut dkb, lk),
            dv: TensorMut::new(&mut dvb, lk),
        },
    )
    .unwrap();
    for (what, buf, l) in [("dQ", &dqb, &lq), ("dK", &dkb, &lk), ("dV", &dvb, &lk)] {
        let (nan, unaddressed) = untouched_nan(buf, l);
        assert_eq!(nan, unaddressed, "{}: {what} poison left", c.name());
    }
    let rg = reference::reference_backward(&cfg, q, k, v, dout);
    let bg = reference::baseline_backward(&cfg, q, k, v, dout);
    results.push((
        "dQ",
        compare(&pack_f32(TensorRef::new(&dqb, lq)), &rg.dq, &bg.dq),
    ));
    results.push((
        "dK",
        compare(&pack_f32(TensorRef::new(&dkb, lk)), &rg.dk, &bg.dk),
    ));
    results.push((
        "dV",
        compare(&pack_f32(TensorRef::new(&dvb, lk)), &rg.dv, &bg.dv),
    ));
    Outcome {
        name: c.name(),
        results,
    }
}

fn run_any(c: &Case, seed: u64) -> Outcome {
    match c.dtype {
        DType::F32 => run::<f32>(c, seed),
        DType::F16 => run::<f16>(c, seed),
        DType::BF16 => run::<bf16>(c, seed),
        DType::E4M3 => unreachable!("the CPU backend refuses E4M3"),
    }
}

/// Runs every case (fresh seeded inputs each), prints one line per case, fails on any failure.
fn run_all(group: u64, cases: &[Case]) {
    let mut failed = Vec::new();
    for (i, c) in cases.iter().enumerate() {
        let outcome = run_any(c, group * 1000 + i as u64);
        println!("{}", outcome.line());
        for (what, cmp) in &outcome.results {
            if !cmp.pass {
                failed.push(format!("{} {what}: {cmp}", outcome.name));
            }
        }
    }
    assert!(failed.is_empty(), "failed:\n{}", failed.join("\n"));
}

use DType::{BF16, F16, F32};

#[test]
fn seqlens_not_multiples_of_tiles() {
    run_all(
        1,
        &[
            case(1, 1, 1, 1, 1, 32, F32),
            case(1, 1, 1, 2, 2, 64, BF16),
            case(1, 1, 17, 2, 2, 64, F16),
            case(1, 17, 17, 2, 2, 64, F32),
            case(1, 17, 17, 2, 2, 64, F16).causal(true),
            case(1, 17, 17, 2, 2, 64, BF16).causal(true),
            case(1, 113, 113, 2, 2, 128, F32).causal(true),
            case(1, 113, 113, 2, 2, 128, BF16),
            case(1, 1000, 1000, 1, 1, 32, BF16).causal(true),
            case(1, 1000, 1000, 1, 1, 32, F32).window(Some(100), Some(50)),
        ],
    );
}

#[test]
fn seqlen_q_differs_from_seqlen_k() {
    run_all(
        2,
        &[
            case(1, 1000, 17, 2, 1, 32, F16),
            case(1, 17, 1000, 2, 1, 32, BF16).causal(true),
            case(1, 113, 17, 2, 2, 64, F32).causal(true),
            case(1, 17, 113, 2, 2, 64, F32).causal(true),
            case(2, 113, 77, 2, 2, 64, F16),
            case(1, 1, 113, 2, 2, 64, BF16).causal(true),
        ],
    );
}

#[test]
fn gqa_and_mqa() {
    run_all(
        3,
        &[
            case(1, 64, 64, 8, 1, 64, BF16),
            case(1, 33, 65, 8, 1, 32, F32).causal(true),
            case(2, 50, 50, 8, 2, 64, F16).window(Some(9), Some(4)),
            case(1, 17, 40, 8, 2, 128, BF16),
            case(1, 70, 70, 6, 1, 64, F32),
            case(1, 70, 90, 3, 1, 40, BF16).causal(true),
        ],
    );
}

#[test]
fn sliding_windows() {
    run_all(
        4,
        &[
            case(1, 113, 113, 2, 2, 64, F32).window(Some(10), None),
            case(1, 113, 113, 2, 2, 64, BF16).window(None, Some(7)),
            case(1, 113, 113, 2, 2, 64, F16).window(Some(20), Some(3)),
            // Causal with a left window.
            case(1, 113, 113, 2, 1, 64, F32).window(Some(31), Some(0)),
            case(1, 50, 130, 2, 2, 64, BF16).window(Some(8), Some(8)),
            case(1, 130, 50, 2, 2, 64, F32).window(Some(5), Some(5)),
            case(1, 97, 97, 1, 1, 32, F16).window(Some(0), Some(0)),
        ],
    );
}

#[test]
fn softcap() {
    run_all(
        5,
        &[
            case(1, 113, 113, 2, 2, 64, F32).softcap(5.0),
            case(1, 113, 113, 2, 2, 64, BF16).causal(true).softcap(2.0),
            case(1, 70, 70, 8, 2, 64, F16)
                .window(Some(16), Some(16))
                .softcap(10.0),
            case(2, 33, 50, 4, 1, 40, BF16)
                .softcap(1.0)
                .storage(Storage::Padded(3)),
        ],
    );
}

#[test]
fn batches_with_strides() {
    run_all(
        6,
        &[
            case(3, 33, 33, 4, 2, 64, F32).storage(Storage::HeadMajor(0)),
            case(2, 77, 100, 4, 4, 128, BF16)
                .causal(true)
                .storage(Storage::HeadMajor(0)),
            case(2, 65, 65, 2, 2, 64, F16).storage(Storage::Padded(8)),
            case(2, 40, 19, 4, 1, 40, BF16)
                .causal(true)
                .storage(Storage::Padded(3)),
            case(4, 17, 9, 2, 2, 32, F32).storage(Storage::Padded(1)),
        ],
    );
}

#[test]
fn head_dims() {
    run_all(
        7,
        &[
            case(2, 64, 64, 2, 2, 32, F16),
            case(1, 128, 128, 2, 2, 128, F32).causal(true),
            case(1, 65, 65, 2, 2, 256, BF16),
            case(1, 33, 47, 2, 1, 256, F32).causal(true),
            case(1, 113, 113, 2, 2, 40, F32),
            case(1, 80, 80, 2, 2, 40, BF16).window(Some(12), Some(12)),
            case(1, 60, 60, 2, 2, 96, F16).causal(true),
            case(1, 17, 17, 1, 1, 3, F32),
            case(1, 49, 49, 2, 2, 72, BF16),
        ],
    );
}

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

    let fwd = flashattn::forward(cfg, q, k, v).unwrap();
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
        TensorRef::contiguous(&qv, [1, sq, h, d]),
        TensorRef::contiguous(&kv, [1, sk, h, d]),
        TensorRef::contiguous(&vv, [1, sk, h, d]),
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
    let c = case(2, 45, 70, 4, 2, 64, BF16).causal(true);
    let mut rng = StdRng::seed_from_u64(5);
    let [qv, kv, vv] = c.random_qkv::<bf16>(&mut rng);
    let dov = random::<bf16>(qv.len(), &mut rng);
    let q = TensorRef::contiguous(&qv, c.q_shape());
    let k = TensorRef::contiguous(&kv, c.kv_shape());
    let v = TensorRef::contiguous(&vv, c.kv_shape());
    let dout = TensorRef::contiguous(&dov, c.q_shape());
    let cfg = c.cfg(Backend::Auto);
    let fwd = flashattn::forward(&cfg, q, k, v).unwrap();
    // forward() and forward_into() agree bit for bit.
    let mut o2 = vec![bf16::from_f32(f32::NAN); fwd.out.len()];
    let mut lse2 = vec![f32::NAN; fwd.lse.len()];
    flashattn::forward_into(
        &cfg,
        q,
        k,
        v,
        TensorMut::contiguous(&mut o2, c.q_shape()),
        &mut lse2,
    )
    .unwrap();
    assert_eq!(o2, fwd.out);
    assert_eq!(lse2, fwd.lse);
    let out = TensorRef::contiguous(&fwd.out, c.q_shape());
    let g1 = flashattn::backward(
        &cfg,
        BackwardInputs {
            q,
            k,
            v,
            out,
            dout,
            lse: &fwd.lse,
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
        },
    )
    .unwrap();
    assert_eq!((&g1.dq, &g1.dk, &g1.dv), (&g2.dq, &g2.dk, &g2.dv));
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
        },
        GradientsMut {
            dq: TensorMut::contiguous(&mut dq, c.q_shape()),
            dk: TensorMut::contiguous(&mut dk, c.kv_shape()),
            dv: TensorMut::contiguous(&mut dv, c.kv_shape()),
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
        q,
        k,
        v,
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

// ---------------------------------------------------------------------------------------------
// Bad inputs: each a typed error.

fn ones(n: usize) -> Vec<f32> {
    vec![1.0; n]
}

fn fwd_err(
    cfg: &AttentionConfig,
    q: TensorRef<f32>,
    k: TensorRef<f32>,
    v: TensorRef<f32>,
) -> Error {
    flashattn::forward(cfg, q, k, v).expect_err("bad input must be refused")
}

#[test]
fn mismatched_batch_is_a_shape_error() {
    let (a, b) = (ones(2 * 4 * 2 * 8), ones(4 * 2 * 8));
    let q = TensorRef::contiguous(&a, [2, 4, 2, 8]);
    let k = TensorRef::contiguous(&b, [1, 4, 2, 8]);
    let e = fwd_err(&AttentionConfig::new(), q, k, k);
    assert!(
        matches!(
            e,
            Error::ShapeMismatch {
                operand: Operand::K,
                expected: [2, 4, 2, 8],
                found: [1, 4, 2, 8]
            }
        ),
        "{e:?}"
    );
}

#[test]
fn v_shape_differing_from_k_is_a_shape_error() {
    let (a, b) = (ones(4 * 2 * 8), ones(5 * 2 * 8));
    let q = TensorRef::contiguous(&a, [1, 4, 2, 8]);
    let v = TensorRef::contiguous(&b, [1, 5, 2, 8]);
    let e = fwd_err(&AttentionConfig::new(), q, q, v);
    assert!(
        matches!(
            e,
            Error::ShapeMismatch {
                operand: Operand::V,
                ..
            }
        ),
        "{e:?}"
    );
}

#[test]
fn head_dim_mismatch_is_a_shape_error() {
    let (a, b) = (ones(4 * 2 * 8), ones(4 * 2 * 16));
    let q = TensorRef::contiguous(&a, [1, 4, 2, 8]);
    let k = TensorRef::contiguous(&b, [1, 4, 2, 16]);
    let e = fwd_err(&AttentionConfig::new(), q, k, k);
    assert!(
        matches!(
            e,
            Error::ShapeMismatch {
                operand: Operand::K,
                expected: [1, 4, 2, 8],
                ..
            }
        ),
        "{e:?}"
    );
}

#[test]
fn non_unit_head_dim_stride_is_refused() {
    let a = ones(2 * 4 * 2 * 8);
    let q = TensorRef::new(&a, Layout::with_strides([1, 4, 2, 8], [128, 32, 16, 2]));
    let k = TensorRef::contiguous(&a[..64], [1, 4, 2, 8]);
    let e = fwd_err(&AttentionConfig::new(), q, k, k);
    assert!(
        matches!(
            e,
            Error::NonUnitHeadDimStride {
                operand: Operand::Q,
                stride: 2
            }
        ),
        "{e:?}"
    );
}

#[test]
fn heads_not_a_multiple_are_refused() {
    let (a, b) = (ones(4 * 3 * 8), ones(4 * 2 * 8));
    let q = TensorRef::contiguous(&a, [1, 4, 3, 8]);
    let k = TensorRef::contiguous(&b, [1, 4, 2, 8]);
    let e = fwd_err(&AttentionConfig::new(), q, k, k);
    assert_eq!(
        e,
        Error::HeadsNotMultiple {
            heads_q: 3,
            heads_kv: 2
        }
    );
}

#[test]
fn zero_size_dimensions_are_refused() {
    let a = ones(64);
    let k = TensorRef::contiguous(&a, [1, 4, 2, 8]);
    for dim in 0..4 {
        let mut shape = [1, 4, 2, 8];
        shape[dim] = 0;
        let q = TensorRef::contiguous(&a, shape);
        let e = fwd_err(&AttentionConfig::new(), q, k, k);
        assert_eq!(
            e,
            Error::EmptyDimension {
                operand: Operand::Q,
                dim
            }
        );
    }
    let q = TensorRef::contiguous(&a, [1, 4, 2, 8]);
    let k0 = TensorRef::contiguous(&a, [1, 0, 2, 8]);
    let e = fwd_err(&AttentionConfig::new(), q, k0, k0);
    assert_eq!(
        e,
        Error::EmptyDimension {
            operand: Operand::K,
            dim: 1
        }
    );
}

#[test]
fn buffer_too_small_is_refused() {
    let a = ones(4 * 2 * 8 - 1);
    let b = ones(4 * 2 * 8);
    let q = TensorRef::contiguous(&b, [1, 4, 2, 8]);
    let v = TensorRef::contiguous(&a, [1, 4, 2, 8]);
    let e = fwd_err(&AttentionConfig::new(), q, q, v);
    assert_eq!(
        e,
        Error::BufferTooSmall {
            operand: Operand::V,
            needed: 64,
            len: 63
        }
    );
}

#[test]
fn wrong_out_shape_and_short_lse_are_refused() {
    let a = ones(4 * 2 * 8);
    let q = TensorRef::contiguous(&a, [1, 4, 2, 8]);
    let cfg = AttentionConfig::new();
    let mut o = vec![0f32; 64];
    let mut lse = vec![0f32; 8];
    let e = flashattn::forward_into(
        &cfg,
        q,
        q,
        q,
        TensorMut::contiguous(&mut o, [1, 2, 4, 8]),
        &mut lse,
    )
    .unwrap_err();
    assert!(
        matches!(
            e,
            Error::ShapeMismatch {
                operand: Operand::Out,
                expected: [1, 4, 2, 8],
                found: [1, 2, 4, 8]
            }
        ),
        "{e:?}"
    );
    let e = flashattn::forward_into(
        &cfg,
        q,
        q,
        q,
        TensorMut::contiguous(&mut o, [1, 4, 2, 8]),
        &mut lse[..7],
    )
    .unwrap_err();
    assert_eq!(
        e,
        Error::BufferTooSmall {
            operand: Operand::Lse,
            needed: 8,
            len: 7
        }
    );
    // The backward checks its LSE and dO too.
    let e = flashattn::backward(
        &cfg,
        BackwardInputs {
            q,
            k: q,
            v: q,
            out: q,
            dout: q,
            lse: &lse[..7],
        },
    )
    .unwrap_err();
    assert!(
        matches!(
            e,
            Error::BufferTooSmall {
                operand: Operand::Lse,
                ..
            }
        ),
        "{e:?}"
    );
    let wrong = TensorRef::contiguous(&a, [1, 2, 4, 8]);
    let e = flashattn::backward(
        &cfg,
        BackwardInputs {
            q,
            k: q,
            v: q,
            out: q,
            dout: wrong,
            lse: &lse,
        },
    )
    .unwrap_err();
    assert!(
        matches!(
            e,
            Error::ShapeMismatch {
                operand: Operand::DOut,
                ..
            }
        ),
        "{e:?}"
    );
}

#[test]
fn e4m3_is_unsupported_on_cpu() {
    let a = vec![float8::F8E4M3::from_f32(1.0); 64];
    let q = TensorRef::contiguous(&a, [1, 4, 2, 8]);
    // Forced onto the CPU: the backend's own error.
    let cfg = AttentionConfig::new().backend(Backend::Cpu);
    let e = flashattn::forward(&cfg, q, q, q).unwrap_err();
    assert_eq!(
        e,
        Error::UnsupportedDtype {
            dtype: DType::E4M3,
            backend: Backend::Cpu
        }
    );
    // Auto: no backend accepts the call, and the error says why the CPU refused.
    let e = flashattn::forward(&AttentionConfig::new(), q, q, q).unwrap_err();
    assert!(
        matches!(&e, Error::Unsupported { what, backend: Backend::Auto } if what.contains("E4M3")),
        "{e:?}"
    );
}

#[test]
fn negative_scale_is_an_invalid_config() {
    let a = ones(64);
    let q = TensorRef::contiguous(&a, [1, 4, 2, 8]);
    let e = fwd_err(&AttentionConfig::new().softmax_scale(-0.5), q, q, q);
    assert!(matches!(e, Error::InvalidConfig(_)), "{e:?}");
}

#[test]
fn gpu_backend_on_host_data_is_unavailable() {
    let a = vec![bf16::from_f32(1.0); 4 * 2 * 64];
    let q = TensorRef::contiguous(&a, [1, 4, 2, 64]);
    for backend in [Backend::Sm90, Backend::Sm80] {
        let e = flashattn::forward(&AttentionConfig::new().backend(backend), q, q, q).unwrap_err();
        assert!(
            matches!(e, Error::BackendUnavailable { backend: b, .. } if b == backend),
            "{e:?}"
        );
    }
    // Forcing the CPU works and says so.
    let fwd = flashattn::forward(&AttentionConfig::new().backend(Backend::Cpu), q, q, q).unwrap();
    assert_eq!(fwd.plan.backend, Backend::Cpu);
}
