//! The FP8 forward on the GPU: the quantize step against its host definition (bit for bit), the
//! forward against the f64 reference over the quantized inputs under the correctness rule of
//! docs/ARCHITECTURE.md with an FP8 baseline (also on rows whose scores all lie far below 0), and
//! the refusals. `#[ignore]`d: run on the device with `--include-ignored`.
#![cfg(feature = "cuda")]

#[path = "../common/mod.rs"]
mod common;
#[path = "../harness/mod.rs"]
mod harness;

mod baseline;
mod inputs;

use std::sync::Arc;

use cudarc::driver::DeviceRepr;
use flashattn::cuda::{
    fp8_key_block, fp8_query_block, v_key_column, v_row_head_dim, CudaStream, Device, DeviceTensor,
    DeviceTensorMut, Fp8ForwardInputs, Fp8Inputs, Fp8Options,
};
use flashattn::fp8::{Fp8Tensor, Granularity, RandomSignHadamard};
use flashattn::reference::{self, compare, Comparison};
use flashattn::unstable::{PingPong, Sm90Schedule, TailSplit};
use flashattn::{AttentionConfig, Backend, DType, Element, Error, Layout, Operand, TensorRef};
use float8::F8E4M3;
use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::SeedableRng;

use baseline::{compare_with_slack, fp8_baseline};
use common::{assert_nan_in_head_0, device, download, poisoned_outputs};
use harness::{random, Case};

/// Inputs of one case on the host and the device.
struct Inputs<T> {
    q: Vec<T>,
    k: Vec<T>,
    v: Vec<T>,
}

fn inputs<T: Element>(case: &Case, seed: u64) -> Inputs<T> {
    let mut rng = StdRng::seed_from_u64(seed);
    let [nq, nk]: [usize; 2] = [case.q_shape(), case.kv_shape()].map(|s| s.iter().product());
    // A few large entries, so that block scales differ from block to block.
    let spike = |mut x: Vec<T>| {
        for i in (0..x.len()).step_by(997) {
            x[i] = T::from_f32(x[i].to_f32() * 24.0);
        }
        x
    };
    Inputs {
        q: spike(random(nq, &mut rng)),
        k: spike(random(nk, &mut rng)),
        v: spike(random(nk, &mut rng)),
    }
}

/// The FP8 forward's head dims in this build: 64, 128, 256 and, with their features, 96 and 192;
/// with FLASHATTN_TEST_HEAD_DIMS set, those of them it lists (for every test that sweeps them).
fn head_dims() -> Vec<usize> {
    let mut dims = vec![64, 128, 256];
    if cfg!(feature = "hdim96") {
        dims.push(96);
    }
    if cfg!(feature = "hdim192") {
        dims.push(192);
    }
    // FLASHATTN_TEST_HEAD_DIMS=96,192 keeps those alone: the whole reference sweep takes longer
    // than one device command may run.
    if let Ok(only) = std::env::var("FLASHATTN_TEST_HEAD_DIMS") {
        let only: Vec<usize> = only
            .split(',')
            .filter_map(|d| d.trim().parse().ok())
            .collect();
        dims.retain(|d| only.contains(d));
        assert!(
            !dims.is_empty(),
            "FLASHATTN_TEST_HEAD_DIMS={only:?} leaves no head dim"
        );
    }
    dims
}

/// `seed` where the Hadamard transform is defined at head dim `d` (a power of two), else none:
/// d96 and d192 run such cases without it.
fn hadamard_at(d: usize, seed: Option<u64>) -> Option<u64> {
    seed.filter(|_| d.is_power_of_two())
}

fn quantize_on_device<T: Element + DeviceRepr>(
    dev: &Device,
    stream: &Arc<CudaStream>,
    case: &Case,
    x: &Inputs<T>,
    options: Fp8Options,
) -> Fp8Inputs {
    let lq = Layout::contiguous(case.q_shape());
    let lk = Layout::contiguous(case.kv_shape());
    let q = stream.clone_htod(&x.q).unwrap();
    let k = stream.clone_htod(&x.k).unwrap();
    let v = stream.clone_htod(&x.v).unwrap();
    dev.quantize_fp8(
        stream,
        &DeviceTensor::new(q.as_view(), lq),
        &DeviceTensor::new(k.as_view(), lk),
        &DeviceTensor::new(v.as_view(), lk),
        options,
    )
    .unwrap_or_else(|e| panic!("{case:?}: {e}"))
}

/// The host's quantization of Q, K, V as the GPU step must do it.
fn quantize_on_host<T: Element>(case: &Case, x: &Inputs<T>, options: Fp8Options) -> [Fp8Tensor; 3] {
    let d = case.head_dim;
    let (sq, sk) = (case.q_shape(), case.kv_shape());
    let f32s = |x: &[T]| x.iter().map(|v| v.to_f32()).collect::<Vec<f32>>();
    let (mut q, mut k) = (f32s(&x.q), f32s(&x.k));
    if let Some(seed) = options.hadamard_seed {
        let h = RandomSignHadamard::new(d, seed).unwrap();
        q = h
            .apply_tensor(TensorRef::contiguous(&q, sq), Operand::Q)
            .unwrap();
        k = h
            .apply_tensor(TensorRef::contiguous(&k, sk), Operand::K)
            .unwrap();
    }
    let v = f32s(&x.v);
    let key_rows = fp8_key_block(d).unwrap();
    let quant = |x: &[f32], shape, rows, op| {
        Fp8Tensor::quantize(
            TensorRef::contiguous(x, shape),
            Granularity::PerBlock { rows },
            op,
        )
        .unwrap()
    };
    [
        quant(&q, sq, fp8_query_block(), Operand::Q),
        quant(&k, sk, key_rows, Operand::K),
        quant(&v, sk, key_rows, Operand::V),
    ]
}

fn bits(x: &[F8E4M3]) -> Vec<u8> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// The FP8 forward of one case, quantized on the device, into outputs poisoned (NaN) before the
/// launch; returns O (in the inputs' type) and the LSE.
fn forward_on_device<T: Element + DeviceRepr>(
    dev: &Device,
    stream: &Arc<CudaStream>,
    case: &Case,
    x: &Inputs<T>,
    options: Fp8Options,
    schedule: Sm90Schedule,
) -> (Vec<T>, Vec<f32>) {
    let fp8 = quantize_on_device(dev, stream, case, x, options);
    let lq = Layout::contiguous(case.q_shape());
    let mut out = poisoned_outputs::<T>(stream, case, lq.shape.iter().product());
    let mut cfg = case.cfg(Backend::Sm90);
    cfg.sm90_schedule = schedule;
    dev.forward_fp8_into(
        stream,
        &cfg,
        Fp8ForwardInputs::new(&fp8),
        &mut DeviceTensorMut::new(out.0.as_view_mut(), lq),
        &mut out.1.as_view_mut(),
    )
    .unwrap_or_else(|e| panic!("{case:?}: {e}"));
    download(stream, &out)
}

/// Runs the FP8 forward of one case (quantized on the device) and compares O and the LSE with
/// the f64 reference over the dequantized inputs.
fn run_forward_case<T: Element + DeviceRepr>(
    dev: &Device,
    stream: &Arc<CudaStream>,
    case: &Case,
    options: Fp8Options,
    schedule: Sm90Schedule,
    seed: u64,
    shift: f32,
) -> (Comparison, Comparison) {
    let mut x = inputs::<T>(case, seed);
    // Q and K moved along head-dim column 0 in opposite senses: every score drops by about
    // shift²·scale, which the softmax must not notice.
    if shift != 0.0 {
        let d = case.head_dim;
        for q in x.q.chunks_mut(d) {
            q[0] = T::from_f32(q[0].to_f32() + shift);
        }
        for k in x.k.chunks_mut(d) {
            k[0] = T::from_f32(k[0].to_f32() - shift);
        }
    }
    let (o, lse) = forward_on_device::<T>(dev, stream, case, &x, options, schedule);

    let [hq, hk, hv] = quantize_on_host(case, &x, options);
    let (dq, dk, dv) = (hq.dequantize(), hk.dequantize(), hv.dequantize());
    let (sq, sk) = (case.q_shape(), case.kv_shape());
    let cpu = case.cfg(Backend::Cpu);
    let want = reference::reference_forward(
        &cpu,
        TensorRef::contiguous(&dq, sq),
        TensorRef::contiguous(&dk, sk),
        TensorRef::contiguous(&dv, sk),
    );
    let base = fp8_baseline::<T>(&cpu, case, [&dq, &dk, &dv]);
    let got = reference::to_f32(&o);
    (
        compare_with_slack("O", &got, &want.out, &base.out, &base.slack.out),
        compare_with_slack("LSE", &lse, &want.lse, &base.lse, &base.slack.score),
    )
}

fn forward_cases() -> Vec<Case> {
    let mut cases = Vec::new();
    for d in head_dims() {
        for causal in [false, true] {
            for (sq, sk) in [
                (1, 1),
                (17, 17),
                (113, 300),
                (1000, 1000),
                (640, 129),
                (256, 1000),
            ] {
                cases.push(Case::new(sq, sk, d).causal(causal));
            }
        }
        // The tail split (csrc/sm90/fwd_tail.h) on 132 SMs: 144 tiles, one whole wave and 12
        // tiles in pieces (GQA, odd lengths); two tiles (two heads) in one-block pieces (split
        // by the cost model too).
        cases.push(Case::new(1000, 3000, d).batch(2).heads(9, 3));
        cases.push(Case::new(100, 8192, d));
        // One query block per head: split when causal too.
        cases.push(Case::new(100, 8192, d).causal(true));
        // Sliding windows: banded, wide enough that middle tiles have unmasked key blocks
        // between masked ones, rows left with no key (O = 0, LSE = +inf), and one query block
        // under a window (split).
        for ((left, right), sq, sk) in [
            ((Some(100), Some(0)), 700, 700),
            ((Some(64), Some(32)), 500, 600),
            ((Some(700), Some(300)), 2000, 2000),
            ((Some(0), Some(0)), 300, 100),
            ((Some(3000), Some(0)), 100, 8192),
        ] {
            cases.push(Case::new(sq, sk, d).window(left, right));
        }
        // GQA, batch > 1.
        cases.push(Case::new(384, 517, d).causal(true).batch(2).heads(4, 1));
    }
    cases
}

#[test]
#[ignore = "needs an sm_90 GPU"]
fn forward_matches_the_reference_over_quantized_inputs() {
    let (dev, stream) = device();
    let mut failures = Vec::new();
    let mut n = 0;
    for (i, case) in forward_cases().iter().enumerate() {
        // O in bf16 from bf16 inputs, in fp16 from fp16 ones, case by case in turn.
        let case = &case.dtype(if i % 2 == 0 { DType::BF16 } else { DType::F16 });
        for seed in [None, Some(3)] {
            let hadamard_seed = hadamard_at(case.head_dim, seed);
            let options = Fp8Options { hadamard_seed };
            // Without Hadamard, the tail split wherever it can be (csrc/sm90/fwd_tail.h): the
            // cases with more than one key block and no mask, or one query block, run in
            // pieces. With it (at d96 and d192 in its place), the warpgroups take turns (off by
            // default in the FP8 forward).
            let split = if seed.is_none() {
                Sm90Schedule {
                    split_tail: TailSplit::Always,
                    ..Default::default()
                }
            } else {
                Sm90Schedule {
                    pingpong: PingPong::On,
                    ..Default::default()
                }
            };
            let (o, lse) = if case.dtype == DType::BF16 {
                run_forward_case::<bf16>(&dev, &stream, case, options, split, i as u64, 0.0)
            } else {
                run_forward_case::<f16>(&dev, &stream, case, options, split, i as u64, 0.0)
            };
            println!("fp8 {case:?} hadamard={hadamard_seed:?}: O {o}; LSE {lse}");
            if !(o.pass && lse.pass) {
                failures.push(format!("{case:?} {options:?}: O {o}; LSE {lse}"));
            }
            n += 1;
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {n} failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// The tail split's pieces at d128, whose tile (and so each piece) runs the loop without
/// intra-warpgroup overlap: one query block per head over 8k keys, causal or not, and a partial
/// last wave of GQA tiles, against the reference (a subset of the sweep above, quick to run).
#[test]
#[ignore = "needs an sm_90 GPU"]
fn forward_pieces_at_d128_match_the_reference() {
    let (dev, stream) = device();
    let split = Sm90Schedule {
        split_tail: TailSplit::Always,
        ..Default::default()
    };
    let options = Fp8Options {
        hadamard_seed: None,
    };
    let cases = [
        Case::new(100, 8192, 128),
        Case::new(100, 8192, 128).causal(true),
        Case::new(1000, 3000, 128).batch(2).heads(9, 3),
    ];
    let mut failures = Vec::new();
    for (i, case) in cases.iter().enumerate() {
        let (o, lse) =
            run_forward_case::<bf16>(&dev, &stream, case, options, split, 100 + i as u64, 0.0);
        println!("fp8 pieces {case:?}: O {o}; LSE {lse}");
        if !(o.pass && lse.pass) {
            failures.push(format!("{case:?}: O {o}; LSE {lse}"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A NaN key poisons O and the LSE of every row that sees it, split or not, as in the 16-bit
/// forwards and the reference (without Hadamard the NaN stays in one element of K).
#[test]
#[ignore = "needs an sm_90 GPU"]
fn forward_passes_nan_on() {
    let (dev, stream) = device();
    let case = Case::new(100, 4097, 128); // two heads, one query block each
    let mut x = inputs::<bf16>(&case, 7);
    x.k[(2000 * case.heads_kv) * case.head_dim + 5] = bf16::NAN; // key 2000 of head 0
    let options = Fp8Options {
        hadamard_seed: None,
    };
    for split_tail in [TailSplit::Always, TailSplit::Off] {
        let schedule = Sm90Schedule {
            split_tail,
            ..Default::default()
        };
        let (o, lse) = forward_on_device::<bf16>(&dev, &stream, &case, &x, options, schedule);
        assert_nan_in_head_0(&case, &o, &lse, &format!("{split_tail:?}"));
    }
}

/// Rows whose every score lies far below 0 (q·k ≈ −400, a logit of −25 at d256): P is taken
/// relative to the row's maximum, so O stays the weighted mean of V (a maximum clamped at 0
/// would round every P of these rows to 0 in e4m3 and give O = 0).
#[test]
#[ignore = "needs an sm_90 GPU"]
fn forward_holds_for_rows_of_only_negative_scores() {
    let (dev, stream) = device();
    let mut failures = Vec::new();
    for d in head_dims() {
        for causal in [false, true] {
            let case = Case::new(300, 517, d).causal(causal);
            for hadamard_seed in [None, Some(3)] {
                if hadamard_at(d, hadamard_seed) != hadamard_seed {
                    continue; // d96, d192: without Hadamard only
                }
                let options = Fp8Options { hadamard_seed };
                let (o, lse) = run_forward_case::<bf16>(
                    &dev,
                    &stream,
                    &case,
                    options,
                    Sm90Schedule::default(),
                    5,
                    20.0,
                );
                println!("fp8 shifted {case:?} hadamard={hadamard_seed:?}: O {o}; LSE {lse}");
                if !(o.pass && lse.pass) {
                    failures.push(format!("{case:?} {options:?}: O {o}; LSE {lse}"));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
