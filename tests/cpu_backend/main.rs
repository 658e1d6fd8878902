//! The CPU backend against the f64 reference under FlashAttention's rule (the correctness rule of
//! docs/ARCHITECTURE.md): `max|out − ref| ≤ 2·max|baseline − ref| + 1e-5` for O, LSE, dQ, dK and
//! dV, over random N(0,1) inputs, with every output poisoned (NaN) before the call. Then fully
//! masked rows and bad inputs, each bad input matched to its error variant, and attention sinks
//! (with their gradient).

#[path = "../harness/mod.rs"]
mod harness;

mod bad_inputs;
mod rows;
mod sinks;

use flashattn::reference::{self, compare, pack_f32, Comparison};
use flashattn::{
    Backend, BackwardInputs, DType, Element, ForwardInputs, GradientsMut, TensorMut, TensorRef,
};
use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::SeedableRng;

use harness::{poisoned, random_in, untouched_nan, Case, Storage};

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
    let ((lq, lk), (lv, lo)) = (c.layouts(), c.v_layouts());
    let [qb, kb, vb, dob] = [lq, lk, lv, lo].map(|l| random_in::<T>(&l, &mut rng));
    let (q, k, v) = (
        TensorRef::new(&qb, lq),
        TensorRef::new(&kb, lk),
        TensorRef::new(&vb, lv),
    );
    let dout = TensorRef::new(&dob, lo);
    let cfg = c.cfg(Backend::Auto);

    // Forward into poisoned outputs; one LSE slot past the end must stay untouched.
    let mut ob = poisoned::<T>(&lo);
    let lse_len = c.batch * c.heads_q * c.seqlen_q;
    let mut lse = vec![f32::NAN; lse_len + 1];
    let plan = flashattn::forward_into(
        &cfg,
        ForwardInputs::new(q, k, v),
        TensorMut::new(&mut ob, lo),
        &mut lse,
    )
    .unwrap_or_else(|e| panic!("{}: {e}", c.name()));
    assert_eq!(plan.backend, Backend::Cpu);
    assert!(lse[lse_len].is_nan(), "{}: wrote past the LSE", c.name());
    let (nan, unaddressed) = untouched_nan(&ob, &lo);
    assert_eq!(
        nan,
        unaddressed,
        "{}: out poison left or padding written",
        c.name()
    );
    let out = TensorRef::new(&ob, lo);

    let r = reference::reference_forward(&cfg, q, k, v);
    let bl = reference::baseline_forward(&cfg, q, k, v);
    let mut results = vec![
        ("O", compare(&pack_f32(out), &r.out, &bl.out)),
        ("LSE", compare(&lse[..lse_len], &r.lse, &bl.lse)),
    ];

    // Backward into poisoned gradients laid out like their inputs.
    let [mut dqb, mut dkb, mut dvb] = [lq, lk, lv].map(|l| poisoned::<T>(&l));
    flashattn::backward_into(
        &cfg,
        BackwardInputs {
            q,
            k,
            v,
            out,
            dout,
            lse: &lse[..lse_len],
            sinks: None,
        },
        GradientsMut {
            dq: TensorMut::new(&mut dqb, lq),
            dk: TensorMut::new(&mut dkb, lk),
            dv: TensorMut::new(&mut dvb, lv),
            dsinks: None,
        },
    )
    .unwrap();
    for (what, buf, l) in [("dQ", &dqb, &lq), ("dK", &dkb, &lk), ("dV", &dvb, &lv)] {
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
        compare(&pack_f32(TensorRef::new(&dvb, lv)), &rg.dv, &bg.dv),
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

/// V's head dim apart from Q's and K's (DeepSeek's MLA: 192 and 128; a narrower and a wider V,
/// head dims that are not multiples of the tiles): O, dO and dV of V's head dim, dQ and dK of
/// Q's, with odd seqlens, masks, GQA, softcap and strided storage.
#[test]
fn v_head_dim_apart_from_q() {
    run_all(
        8,
        &[
            case(1, 1, 1, 2, 2, 192, BF16).head_dim_v(128),
            case(1, 17, 17, 2, 2, 192, F32).head_dim_v(128).causal(true),
            case(1, 113, 113, 2, 2, 192, BF16)
                .head_dim_v(128)
                .causal(true),
            case(2, 113, 77, 4, 1, 192, F16).head_dim_v(128),
            case(1, 113, 113, 2, 2, 192, F32)
                .head_dim_v(128)
                .softcap(5.0)
                .deterministic(true),
            case(1, 113, 113, 2, 2, 64, F32)
                .head_dim_v(32)
                .window(Some(20), Some(3)),
            case(1, 17, 113, 8, 2, 64, BF16).head_dim_v(32).causal(true),
            case(1, 113, 17, 2, 2, 40, F16).head_dim_v(72).causal(true),
            case(2, 70, 70, 8, 2, 40, BF16)
                .head_dim_v(72)
                .window(Some(16), Some(16))
                .softcap(10.0),
            case(2, 40, 19, 4, 1, 40, BF16)
                .head_dim_v(72)
                .causal(true)
                .storage(Storage::Padded(3)),
            case(3, 33, 33, 4, 2, 64, F32)
                .head_dim_v(32)
                .storage(Storage::HeadMajor(0)),
            case(1, 17, 17, 1, 1, 3, F32).head_dim_v(5),
        ],
    );
}
