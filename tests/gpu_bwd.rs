//! Backward correctness of the GPU kernels against the f64 reference under the correctness rule of
//! docs/ARCHITECTURE.md: the GPU forward of the same backend gives O and LSE, the GPU backward dQ,
//! dK, dV (poisoned with NaN before the launch), each compared whole with the reference and the
//! dtype baseline. `#[ignore]`d: run on the device with `--include-ignored` (each test fails
//! without a GPU).
#![cfg(feature = "cuda")]

mod common;
mod harness;

use std::sync::Arc;

use cudarc::driver::DeviceRepr;
use flashattn::cuda::{CudaStream, Device};
use flashattn::reference::{self, compare, Comparison};
use flashattn::{Backend, Element, Layout, TensorRef};
use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::SeedableRng;

use common::{device, OnDevice, Views};
use harness::{random, span, Case, Outputs};

struct Grads {
    dq: Comparison,
    dk: Comparison,
    dv: Comparison,
    /// dQ, dK, dV as f32 bit patterns, for run-to-run comparisons.
    bits: Vec<u32>,
    /// The backend that ran the backward.
    backend: Backend,
}

fn run_case<T: Element + DeviceRepr>(
    dev: &Device,
    stream: &Arc<CudaStream>,
    case: &Case,
    backend: Backend,
    seed: u64,
) -> Grads {
    let mut rng = StdRng::seed_from_u64(seed);
    let views = Views::of(case);
    let (lq, lk, lv, lo) = (views.q, views.k, views.v, views.o);
    let [q, k, v] = case.random_qkv::<T>(&mut rng);
    let dout: Vec<T> = random(span(&lo), &mut rng);
    let cfg = case.cfg(backend);
    let lse_len = case.batch * case.heads_q * case.seqlen_q;

    let mut t = OnDevice::upload(stream, [&q, &k, &v, &dout], lse_len, None);
    t.forward(dev, stream, &cfg, None, views)
        .unwrap_or_else(|e| panic!("{case:?} forward: {e}"));
    let plan = t
        .backward(dev, stream, &cfg, None, views)
        .unwrap_or_else(|e| panic!("{case:?} backward: {e}"));
    if backend != Backend::Auto {
        assert_eq!(plan.backend, backend);
    }
    let Outputs { dq, dk, dv, .. } = t.download(stream);

    let cpu = case.cfg(Backend::Cpu);
    let (tq, tk, tv, tdo) = (
        TensorRef::new(&q, lq),
        TensorRef::new(&k, lk),
        TensorRef::new(&v, lv),
        TensorRef::new(&dout, lo),
    );
    let want = reference::reference_backward(&cpu, tq, tk, tv, tdo);
    let base = reference::baseline_backward(&cpu, tq, tk, tv, tdo);
    let got = |x: &Vec<T>, l: Layout| reference::pack_f32(TensorRef::new(x, l));
    let (dq, dk, dv) = (got(&dq, lq), got(&dk, lk), got(&dv, lv));
    Grads {
        dq: compare(&dq, &want.dq, &base.dq),
        dk: compare(&dk, &want.dk, &base.dk),
        dv: compare(&dv, &want.dv, &base.dv),
        bits: [dq, dk, dv].iter().flatten().map(|x| x.to_bits()).collect(),
        backend: plan.backend,
    }
}

fn run_all<T: Element + DeviceRepr>(cases: &[Case], backend: Backend, label: &str) {
    let (dev, stream) = device();
    let mut failures = vec![];
    for (n, case) in cases.iter().enumerate() {
        let case = &case.dtype(T::DTYPE);
        let g = run_case::<T>(&dev, &stream, case, backend, 2000 + n as u64);
        println!(
            "{label} {}: dQ {}; dK {}; dV {}",
            case.name(),
            g.dq,
            g.dk,
            g.dv
        );
        if !(g.dq.pass && g.dk.pass && g.dv.pass) {
            failures.push(format!("{case:?}"));
        }
    }
    println!("{label}: {} cases, {} failed", cases.len(), failures.len());
    assert!(
        failures.is_empty(),
        "failed cases:\n{}",
        failures.join("\n")
    );
}

/// Odd seqlens, s_q ≠ s_k both ways, causal and not, GQA/MQA, batch > 1, strided, windows,
/// softcap, at one head dim (sizes the f64 reference backward covers whole).
fn sweep(head_dim: usize) -> Vec<Case> {
    let pairs = [
        (1, 1),
        (17, 17),
        (113, 113),
        (128, 128),
        (300, 300),
        (113, 700),
        (700, 113),
        (1, 513),
        (1000, 1000),
    ];
    let mut cases = vec![];
    for causal in [false, true] {
        let case = |sq, sk| Case::new(sq, sk, head_dim).causal(causal);
        for &(sq, sk) in &pairs {
            cases.push(case(sq, sk));
        }
        cases.push(case(200, 200).batch(2).heads(8, 2));
        cases.push(case(157, 301).batch(2).heads(4, 1));
        cases.push(case(130, 250).batch(3).strided());
    }
    let case = |sq, sk| Case::new(sq, sk, head_dim);
    // Causal key blocks go heaviest first across heads, the heads in groups whose Q, dO and dQ
    // fit half the L2: queries long enough for several groups at every head dim on an H200
    // (60 MiB), the last one partial at d64/d128 (rows before the last 200 see no key).
    cases.push(case(8192, 200).causal(true).batch(2).heads(4, 2));
    cases.push(case(400, 400).window(Some(64), Some(16)));
    cases.push(case(300, 500).window(Some(100), None));
    cases.push(case(257, 257).causal(true).softcap(30.0));
    // A cap the scores reach (scaled scores of about ±3 against 3): the cap's derivative
    // 1 − tanh² moves dS by a large part, which a cap of 30 (1 − tanh² ≥ 0.98) would not show.
    cases.push(case(200, 300).causal(true).softcap(3.0));
    cases
}

#[test]
#[ignore = "needs a GPU"]
fn sm80_bwd_d64_bf16() {
    run_all::<bf16>(&sweep(64), Backend::Sm80, "sm80 bwd d64 bf16");
}
#[test]
#[ignore = "needs a GPU"]
fn sm80_bwd_d128_bf16() {
    run_all::<bf16>(&sweep(128), Backend::Sm80, "sm80 bwd d128 bf16");
}
#[test]
#[ignore = "needs a GPU"]
fn sm80_bwd_d256_bf16() {
    run_all::<bf16>(&sweep(256), Backend::Sm80, "sm80 bwd d256 bf16");
}
#[test]
#[ignore = "needs a GPU"]
fn sm80_bwd_d64_f16() {
    run_all::<f16>(&sweep(64), Backend::Sm80, "sm80 bwd d64 f16");
}
#[test]
#[ignore = "needs a GPU"]
fn sm80_bwd_d128_f16() {
    run_all::<f16>(&sweep(128), Backend::Sm80, "sm80 bwd d128 f16");
}
#[test]
#[ignore = "needs a GPU"]
fn sm80_bwd_d256_f16() {
    run_all::<f16>(&sweep(256), Backend::Sm80, "sm80 bwd d256 f16");
}

#[test]
#[ignore = "needs a GPU"]
fn sm90_bwd_d64_bf16() {
    run_all::<bf16>(&sweep(64), Backend::Sm90, "sm90 bwd d64 bf16");
}
#[test]
#[ignore = "needs a GPU"]
fn sm90_bwd_d128_bf16() {
    run_all::<bf16>(&sweep(128), Backend::Sm90, "sm90 bwd d128 bf16");
}
#[test]
#[ignore = "needs a GPU"]
fn sm90_bwd_d256_bf16() {
    run_all::<bf16>(&sweep(256), Backend::Sm90, "sm90 bwd d256 bf16");
}
#[test]
#[ignore = "needs a GPU"]
fn sm90_bwd_d64_f16() {
    run_all::<f16>(&sweep(64), Backend::Sm90, "sm90 bwd d64 f16");
}
#[test]
#[ignore = "needs a GPU"]
fn sm90_bwd_d128_f16() {
    run_all::<f16>(&sweep(128), Backend::Sm90, "sm90 bwd d128 f16");
}
#[test]
#[ignore = "needs a GPU"]
fn sm90_bwd_d256_f16() {
    run_all::<f16>(&sweep(256), Backend::Sm90, "sm90 bwd d256 f16");
}

#[test]
#[ignore = "needs a GPU"]
fn sm90_bwd_sanitizer_set() {
    let cases = [
        // Two query blocks per stage cycle, a partial key block, causal masks.
        Case::new(200, 130, 64).causal(true),
        Case::new(65, 300, 128).heads(4, 2),
        // A key block no query row sees (window): the CTA loads nothing, writes zeros.
        Case::new(100, 400, 128).window(Some(100), None),
        // Softcap: the cap's derivative from P, masked scores (P = 0) left at dS = 0.
        Case::new(130, 200, 64).causal(true).softcap(30.0),
        // Deterministic: semaphores hand each dQ slab from key block to key block, GQA per head.
        Case::new(200, 300, 64)
            .causal(true)
            .heads(4, 2)
            .deterministic(true),
        // d256 (head dim split between the warpgroups): Pᵀ/dSᵀ stages, GQA, causal; and its
        // deterministic variant.
        Case::new(150, 130, 256).causal(true).heads(4, 2),
        Case::new(150, 200, 256)
            .causal(true)
            .heads(4, 2)
            .deterministic(true),
    ];
    run_all::<bf16>(&cases, Backend::Sm90, "sm90 bwd sanitizer set");
}

/// Auto takes the sm90 backward where it is built (softcap too, but not softcap's deterministic
/// mode).
#[test]
#[ignore = "needs a GPU"]
fn sm90_bwd_dispatch() {
    let (dev, stream) = device();
    for (case, want) in [
        (Case::new(100, 100, 128).causal(true), Backend::Sm90),
        (Case::new(100, 100, 256).causal(true), Backend::Sm90),
        (Case::new(100, 100, 256).deterministic(true), Backend::Sm90),
        (Case::new(100, 100, 64).softcap(30.0), Backend::Sm90),
        (
            Case::new(100, 100, 64).softcap(30.0).deterministic(true),
            Backend::Sm80,
        ),
        (Case::new(100, 100, 64).deterministic(true), Backend::Sm90),
    ] {
        let g = run_case::<bf16>(&dev, &stream, &case, Backend::Auto, 5000);
        assert_eq!(g.backend, want, "{case:?}");
        assert!(g.dq.pass && g.dk.pass && g.dv.pass, "{case:?}");
    }
}

/// The head dims outside the default build (`hdim96`, `hdim192`), where this build has them: the
/// sm80 backward, its deterministic mode, and the backend Auto takes (sm90 on a Hopper GPU).
#[test]
#[ignore = "needs a GPU"]
#[cfg(any(feature = "hdim96", feature = "hdim192"))]
fn sm80_bwd_optional_head_dims() {
    let dims = common::optional_head_dims();
    for &d in &dims {
        run_all::<bf16>(&sweep(d), Backend::Sm80, &format!("sm80 bwd d{d} bf16"));
        run_all::<f16>(&sweep(d), Backend::Sm80, &format!("sm80 bwd d{d} f16"));
    }
    check_deterministic(&dims, Backend::Sm80, vec![]);
    let (dev, stream) = device();
    for &d in &dims {
        let case = Case::new(100, 150, d).causal(true).heads(4, 2);
        let g = run_case::<bf16>(&dev, &stream, &case, Backend::Auto, 5100);
        let hopper = dev.info().compute_capability() == (9, 0);
        let want = if hopper { Backend::Sm90 } else { Backend::Sm80 };
        assert_eq!(g.backend, want, "{case:?}");
        assert!(g.dq.pass && g.dk.pass && g.dv.pass, "{case:?}");
    }
}

/// The sm90 backward at the optional head dims: d96 (`hdim96`; the kernel that splits the keys,
/// with three 32-column dQ slabs) and d192 (`hdim192`; the head-dim-split kernel with 96
/// columns per warpgroup), their sweeps in both dtypes and deterministic mode.
#[test]
#[ignore = "needs a Hopper GPU"]
#[cfg(any(feature = "hdim96", feature = "hdim192"))]
fn sm90_bwd_optional_head_dims() {
    let dims = common::optional_head_dims();
    for &d in &dims {
        run_all::<bf16>(&sweep(d), Backend::Sm90, &format!("sm90 bwd d{d} bf16"));
        run_all::<f16>(&sweep(d), Backend::Sm90, &format!("sm90 bwd d{d} f16"));
    }
    let extra = dims
        .iter()
        .flat_map(|&d| {
            let case = |sq, sk| Case::new(sq, sk, d).deterministic(true);
            [
                case(900, 1000).window(Some(200), Some(0)),
                case(3000, 3000).causal(true).heads(2, 2),
            ]
        })
        .collect();
    check_deterministic(&dims, Backend::Sm90, extra);
}

#[test]
#[ignore = "needs a Hopper GPU"]
#[cfg(any(feature = "hdim96", feature = "hdim192"))]
fn sanitizer_sm90_bwd_optional_head_dims() {
    for d in common::optional_head_dims() {
        let cases = [
            Case::new(150, 130, d).causal(true).heads(4, 2),
            Case::new(150, 200, d)
                .causal(true)
                .heads(4, 2)
                .deterministic(true),
            Case::new(100, 400, d).window(Some(100), None),
        ];
        run_all::<bf16>(
            &cases,
            Backend::Sm90,
            &format!("sm90 bwd d{d} sanitizer set"),
        );
    }
}

/// V's head dim apart from Q's: both families' backward at (192, 128), DeepSeek's MLA shape
/// (`hdim192`; on sm90 the head-dim-split kernel with dV's 64 columns per warpgroup beside dK's
/// 96, on sm80 dP = dO·Vᵀ and dV over V's head dim): d192's sweep (odd seqlens, causal, GQA/MQA,
/// strides, windows, softcap) in both dtypes, deterministic mode bit for bit, and the backend
/// Auto takes.
#[test]
#[ignore = "needs a Hopper GPU"]
#[cfg(feature = "hdim192")]
fn bwd_at_192_128() {
    let apart =
        |cases: Vec<Case>| -> Vec<Case> { cases.into_iter().map(|c| c.head_dim_v(128)).collect() };
    for backend in [Backend::Sm90, Backend::Sm80] {
        let label = format!("{backend:?} bwd d192/128");
        run_all::<bf16>(&apart(sweep(192)), backend, &format!("{label} bf16"));
        run_all::<f16>(&apart(sweep(192)), backend, &format!("{label} f16"));
        let case = |sq, sk| Case::new(sq, sk, 192).deterministic(true);
        let deterministic = apart(vec![
            case(1000, 1000),
            case(300, 500).causal(true).heads(4, 2),
            case(300, 513).batch(2).heads(8, 2),
            case(900, 1000).window(Some(200), Some(0)),
            case(400, 400).window(Some(64), Some(16)).heads(4, 1),
        ]);
        check_deterministic(&[], backend, deterministic);
    }
    let (dev, stream) = device();
    let case = Case::new(100, 150, 192)
        .head_dim_v(128)
        .causal(true)
        .heads(4, 2);
    let g = run_case::<bf16>(&dev, &stream, &case, Backend::Auto, 5300);
    assert_eq!(g.backend, Backend::Sm90, "{case:?}");
    assert!(g.dq.pass && g.dk.pass && g.dv.pass, "{case:?}");
}

#[test]
#[ignore = "needs a GPU"]
fn sm80_bwd_sanitizer_set() {
    let mut cases = vec![
        Case::new(70, 130, 64).causal(true),
        Case::new(65, 90, 128).heads(4, 2),
        // Deterministic: 3 dQ slices over 5 key blocks of 64 (CTAs walk two), GQA per head.
        Case::new(100, 300, 256).heads(4, 2).deterministic(true),
    ];
    for d in common::optional_head_dims() {
        cases.push(Case::new(77, 150, d).causal(true).heads(4, 2));
        cases.push(Case::new(90, 200, d).heads(4, 2).deterministic(true));
    }
    if cfg!(feature = "hdim192") {
        // V's head dim apart from Q's: dO's and V's tiles, dV's stores and GQA sums.
        cases.push(
            Case::new(77, 150, 192)
                .head_dim_v(128)
                .causal(true)
                .heads(4, 2),
        );
        cases.push(
            Case::new(90, 200, 192)
                .head_dim_v(128)
                .heads(4, 2)
                .deterministic(true),
        );
        cases.push(Case::new(70, 130, 192).head_dim_v(128));
    }
    run_all::<bf16>(&cases, Backend::Sm80, "sm80 bwd sanitizer set");
}

/// Deterministic mode, correct under the correctness rule and bit-identical over two runs: cases for `dims` on
/// `backend`.
fn check_deterministic(dims: &[usize], backend: Backend, extra: Vec<Case>) {
    let (dev, stream) = device();
    let mut cases = vec![];
    for &d in dims {
        let case = |sq, sk| Case::new(sq, sk, d).deterministic(true);
        cases.push(case(1000, 1000));
        cases.push(case(700, 1100).causal(true));
        cases.push(case(300, 513).batch(2).heads(8, 2));
    }
    cases.extend(extra);
    let mut failures = vec![];
    for (n, case) in cases.iter().enumerate() {
        let first = run_case::<bf16>(&dev, &stream, case, backend, 4000 + n as u64);
        let second = run_case::<bf16>(&dev, &stream, case, backend, 4000 + n as u64);
        let identical = first.bits == second.bits;
        println!(
            "{backend:?} bwd {}: dQ {}; dK {}; dV {}; bit-identical over two runs: {identical}",
            case.name(),
            first.dq,
            first.dk,
            first.dv
        );
        if !(first.dq.pass && first.dk.pass && first.dv.pass && identical) {
            failures.push(format!("{case:?}"));
        }
    }
    assert!(
        failures.is_empty(),
        "failed cases:\n{}",
        failures.join("\n")
    );
}

/// sm80: dQ in per-CTA slices, GQA dK/dV per query head, fixed summation order; at shapes where
/// the dQ slices outnumber one (few heads), and where each CTA walks several key blocks (64
/// batch · head pairs leave two slices a pair on 132 SMs, over 8 key blocks), with GQA and a
/// window.
#[test]
#[ignore = "needs a GPU"]
fn sm80_bwd_deterministic() {
    let many_heads = [64, 128]
        .into_iter()
        .flat_map(|d| {
            let case = || {
                Case::new(400, 1000, d)
                    .batch(4)
                    .heads(16, 4)
                    .deterministic(true)
            };
            [case(), case().window(Some(300), Some(0))]
        })
        .collect();
    check_deterministic(&[64, 128, 256], Backend::Sm80, many_heads);
}

/// sm90: each query block's dQ slab is added key block after key block (semaphores), GQA dK/dV
/// per query head; plus sliding windows (the key blocks that see a query block start later) and
/// many key blocks per head.
#[test]
#[ignore = "needs a GPU"]
fn sm90_bwd_deterministic() {
    let mut extra = vec![];
    for d in [64, 128, 256] {
        let case = |sq, sk| Case::new(sq, sk, d).deterministic(true);
        extra.push(case(900, 1000).window(Some(200), Some(0)));
        extra.push(case(3000, 3000).causal(true).heads(2, 2));
    }
    check_deterministic(&[64, 128, 256], Backend::Sm90, extra);
}
