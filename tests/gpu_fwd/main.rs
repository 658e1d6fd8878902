//! Forward correctness of the GPU kernels against the f64 reference under the correctness rule of
//! docs/ARCHITECTURE.md. `#[ignore]`d: run on the device with `--include-ignored` (each test fails
//! without a GPU). Small problems are checked whole; large ones for NaN/poison everywhere and
//! exactly on a sample of rows. Outputs are poisoned (NaN) before every launch.
#![cfg(feature = "cuda")]

#[path = "../common/mod.rs"]
mod common;
#[path = "../harness/mod.rs"]
mod harness;

#[cfg(feature = "hdim192")]
mod head_dim_v;
mod schedules;
mod tail_split;

use std::sync::Arc;

use cudarc::driver::DeviceRepr;
use flashattn::cuda::{CudaStream, Device};
use flashattn::reference::{self, compare, Comparison};
use flashattn::{AttentionConfig, Backend, Element, TensorRef};
use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::SeedableRng;

use common::{device, download, forward_into, poisoned_outputs};
use harness::Case;

/// The forward of `case` on the device over host inputs, outputs poisoned (NaN) before the
/// launch; returns O and the LSE.
fn forward_on_device<T: Element + DeviceRepr>(
    dev: &Device,
    stream: &Arc<CudaStream>,
    case: &Case,
    cfg: &AttentionConfig,
    [q, k, v]: [&[T]; 3],
) -> (Vec<T>, Vec<f32>) {
    let [q_dev, k_dev, v_dev] = [q, k, v].map(|x| stream.clone_htod(x).unwrap());
    let mut out = poisoned_outputs::<T>(stream, case, q.len());
    forward_into(dev, stream, case, cfg, [&q_dev, &k_dev, &v_dev], &mut out)
        .unwrap_or_else(|e| panic!("{case:?}: {e}"));
    download(stream, &out)
}

/// Runs one case with `cfg` (its backend and schedule); returns the comparisons of O and LSE.
fn run_case<T: Element + DeviceRepr>(
    dev: &Device,
    stream: &Arc<CudaStream>,
    case: &Case,
    cfg: AttentionConfig,
    seed: u64,
) -> (Comparison, Comparison) {
    let (lq, lk) = case.layouts();
    let [q, k, v] = case.random_qkv::<T>(&mut StdRng::seed_from_u64(seed));
    let (o, lse) = forward_on_device(dev, stream, case, &cfg, [&q, &k, &v]);

    let (tq, tk, tv) = (
        TensorRef::new(&q, lq),
        TensorRef::new(&k, lk),
        TensorRef::new(&v, lk),
    );
    let got = reference::pack_f32(TensorRef::new(&o, lq));
    let cfg = case.cfg(Backend::Cpu);
    if case.checked_whole() {
        let want = reference::reference_forward(&cfg, tq, tk, tv);
        let base = reference::baseline_forward(&cfg, tq, tk, tv);
        return (
            compare(&got, &want.out, &base.out),
            compare(&lse, &want.lse, &base.lse),
        );
    }
    // Large: every element written and finite, then a sample of rows exactly.
    let nan_o = got.iter().filter(|x| x.is_nan()).count();
    let nan_lse = lse.iter().filter(|x| x.is_nan()).count();
    assert_eq!(
        nan_o + nan_lse,
        0,
        "{case:?}: {nan_o} O and {nan_lse} LSE entries unwritten or NaN"
    );
    let d = case.head_dim;
    let (mut got_rows, mut want_rows, mut base_rows) = (vec![], vec![], vec![]);
    let (mut got_lse, mut want_lse, mut base_lse) = (vec![], vec![], vec![]);
    let rows = [
        0,
        1,
        case.seqlen_q / 3,
        case.seqlen_q / 2 + 7,
        case.seqlen_q - 2,
        case.seqlen_q - 1,
    ];
    for (n, &i) in rows.iter().enumerate() {
        let (b, h) = (n % case.batch, (n * 5) % case.heads_q);
        let (w, wl) = reference::reference_row(&cfg, tq, tk, tv, b, h, i);
        let (bo, bl) = reference::baseline_row(&cfg, tq, tk, tv, b, h, i);
        let off = ((b * case.seqlen_q + i) * case.heads_q + h) * d;
        got_rows.extend_from_slice(&got[off..off + d]);
        want_rows.extend(w);
        base_rows.extend(bo);
        got_lse.push(lse[(b * case.heads_q + h) * case.seqlen_q + i]);
        want_lse.push(wl);
        base_lse.push(bl);
    }
    (
        compare(&got_rows, &want_rows, &base_rows),
        compare(&got_lse, &want_lse, &base_lse),
    )
}

fn run_all<T: Element + DeviceRepr>(cases: &[Case], backend: Backend, label: &str) {
    run_all_with::<T>(cases, label, |case| case.cfg(backend));
}

/// `run_all` with each case's config from `cfg` (a schedule other than the default).
fn run_all_with<T: Element + DeviceRepr>(
    cases: &[Case],
    label: &str,
    cfg: impl Fn(&Case) -> AttentionConfig,
) {
    let (dev, stream) = device();
    let mut failures = vec![];
    for (n, case) in cases.iter().enumerate() {
        let case = &case.dtype(T::DTYPE);
        let cfg = cfg(case);
        let backend = cfg.backend;
        let (o, lse) = run_case::<T>(&dev, &stream, case, cfg, 1000 + n as u64);
        println!("{label} {backend:?} {}: O {o}; LSE {lse}", case.name());
        if !o.pass || !lse.pass {
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

/// The sweep of the issue: seqlens that are not tile multiples, s_q ≠ s_k both ways, causal and
/// not, at one head dim.
fn sweep(head_dim: usize) -> Vec<Case> {
    let pairs = [
        (1, 1),
        (17, 17),
        (113, 113),
        (128, 128),
        (1000, 1000),
        (113, 1000),
        (1000, 113),
        (1, 4097),
        (4097, 4097),
        (8192, 8192),
    ];
    let mut cases = vec![];
    for causal in [false, true] {
        for &(sq, sk) in &pairs {
            cases.push(Case::new(sq, sk, head_dim).causal(causal));
        }
    }
    // GQA, batch > 1, strided layouts, windows, softcap.
    for causal in [false, true] {
        let case = |sq, sk| Case::new(sq, sk, head_dim).causal(causal);
        cases.push(case(300, 300).batch(2).heads(8, 2));
        cases.push(case(257, 515).batch(2).heads(8, 1));
        cases.push(case(200, 333).batch(3).strided());
        cases.push(case(333, 333).heads(4, 4).softcap(30.0));
    }
    let case = |sq, sk| Case::new(sq, sk, head_dim);
    cases.push(case(700, 700).window(Some(100), Some(0)));
    cases.push(case(500, 600).window(Some(64), Some(32)));
    cases.push(case(400, 300).window(None, Some(17)));
    cases.push(case(300, 400).window(Some(50), None));
    // Wide enough that middle tiles have masked key blocks above and below unmasked ones
    // (the kernels' loop copy for unmasked blocks runs between the two).
    cases.push(case(4000, 4000).window(Some(1500), Some(700)));
    // More tiles than SMs, so each persistent CTA walks several; with GQA and both masks.
    for causal in [false, true] {
        cases.push(case(200, 260).causal(causal).batch(8).heads(16, 4));
    }
    // Causal tiles go heaviest first across heads, the heads in groups whose K and V fit 4/5 of
    // the L2: on an H200 (60 MiB) 16 heads of 16k keys make groups of 12 + 4 at d64, 6 + 6 + 4 at
    // d128, 3 × 5 + 1 at d256. (At 32k keys the f32 row sums of fp16 inputs drift past the rule's LSE
    // bound, on sm90 too.)
    cases.push(case(200, 16384).causal(true).batch(2).heads(8, 2));
    // Many tiles, a third of which see no key (O = 0 from registers), interleaved with others.
    cases.push(
        case(300, 100)
            .batch(6)
            .heads(24, 24)
            .window(Some(0), Some(0)),
    );
    // Windows that leave some rows with no key at all: O = 0, LSE = +inf.
    cases.push(case(300, 100).window(Some(0), Some(0)));
    cases
}

// The FlashAttention-2-style kernels, forced on whatever GPU runs the tests (sm_80 and later).
#[test]
#[ignore = "needs a GPU"]
fn sm80_fwd_d64_bf16() {
    run_all::<bf16>(&sweep(64), Backend::Sm80, "sm80 d64 bf16");
}
#[test]
#[ignore = "needs a GPU"]
fn sm80_fwd_d128_bf16() {
    run_all::<bf16>(&sweep(128), Backend::Sm80, "sm80 d128 bf16");
}
#[test]
#[ignore = "needs a GPU"]
fn sm80_fwd_d256_bf16() {
    run_all::<bf16>(&sweep(256), Backend::Sm80, "sm80 d256 bf16");
}
#[test]
#[ignore = "needs a GPU"]
fn sm80_fwd_d64_f16() {
    run_all::<f16>(&sweep(64), Backend::Sm80, "sm80 d64 f16");
}
#[test]
#[ignore = "needs a GPU"]
fn sm80_fwd_d128_f16() {
    run_all::<f16>(&sweep(128), Backend::Sm80, "sm80 d128 f16");
}
#[test]
#[ignore = "needs a GPU"]
fn sm80_fwd_d256_f16() {
    run_all::<f16>(&sweep(256), Backend::Sm80, "sm80 d256 f16");
}
#[test]
#[ignore = "needs a GPU"]
fn sm80_fwd_sanitizer_set() {
    let mut cases = vec![
        Case::new(17, 113, 64),
        Case::new(130, 70, 128).causal(true),
        Case::new(65, 200, 256).heads(4, 2),
    ];
    for d in common::optional_head_dims() {
        cases.push(Case::new(77, 150, d).causal(true).heads(4, 2));
    }
    run_all::<bf16>(&cases, Backend::Sm80, "sm80 sanitizer set");
}

#[test]
#[ignore = "needs a Hopper GPU"]
fn sm90_fwd_d64_bf16() {
    run_all::<bf16>(&sweep(64), Backend::Sm90, "sm90 d64 bf16");
}
#[test]
#[ignore = "needs a Hopper GPU"]
fn sm90_fwd_d128_bf16() {
    run_all::<bf16>(&sweep(128), Backend::Sm90, "sm90 d128 bf16");
}
#[test]
#[ignore = "needs a Hopper GPU"]
fn sm90_fwd_d256_bf16() {
    run_all::<bf16>(&sweep(256), Backend::Sm90, "sm90 d256 bf16");
}
#[test]
#[ignore = "needs a Hopper GPU"]
fn sm90_fwd_d64_f16() {
    run_all::<f16>(&sweep(64), Backend::Sm90, "sm90 d64 f16");
}
#[test]
#[ignore = "needs a Hopper GPU"]
fn sm90_fwd_d128_f16() {
    run_all::<f16>(&sweep(128), Backend::Sm90, "sm90 d128 f16");
}
#[test]
#[ignore = "needs a Hopper GPU"]
fn sm90_fwd_d256_f16() {
    run_all::<f16>(&sweep(256), Backend::Sm90, "sm90 d256 f16");
}

/// The head dims outside the default build (`hdim96`, `hdim192`), where this build has them, on
/// both forward families.
#[test]
#[ignore = "needs a Hopper GPU"]
#[cfg(any(feature = "hdim96", feature = "hdim192"))]
fn fwd_optional_head_dims() {
    for d in common::optional_head_dims() {
        for backend in [Backend::Sm90, Backend::Sm80] {
            let name = backend.name();
            run_all::<bf16>(&sweep(d), backend, &format!("{name} d{d} bf16"));
            run_all::<f16>(&sweep(d), backend, &format!("{name} d{d} f16"));
        }
    }
}

/// A few small cases for compute-sanitizer (memcheck, racecheck), which slows kernels a lot.
#[test]
#[ignore = "needs a Hopper GPU"]
fn sanitizer_sm90_fwd_small() {
    let mut cases = vec![];
    for d in [64, 128, 256]
        .into_iter()
        .chain(common::optional_head_dims())
    {
        cases.push(Case::new(17, 200, d).causal(true));
        cases.push(Case::new(130, 77, d).batch(2).heads(4, 1));
    }
    run_all::<bf16>(&cases, Backend::Sm90, "sanitizer");
}
