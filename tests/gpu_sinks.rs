//! Attention sinks on the GPU kernels against the f64 reference under the correctness rule
//! (docs/ARCHITECTURE.md): O and the LSE of `Device::forward_into` with sinks, dQ, dK, dV and the
//! sinks' gradient of `Device::backward_into`, every output poisoned with NaN before its launch;
//! the FP8 forward's sinks; and the refusals of short vectors and of a gradient without sinks.
//! `#[ignore]`d: run on the device with `--include-ignored`.
#![cfg(feature = "cuda")]

mod common;
mod harness;

use std::sync::Arc;

use cudarc::driver::DeviceRepr;
use flashattn::cuda::{
    CudaStream, Device, DeviceForwardInputs, DeviceTensor, DeviceTensorMut, Fp8ForwardInputs,
    Fp8Options,
};
use flashattn::reference::{self, compare, Comparison};
use flashattn::unstable::TailSplit;
use flashattn::{AttentionConfig, Backend, Element, Error, Layout, Operand, TensorRef};
use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use common::{device, download, poisoned_outputs, OnDevice, Views};
use harness::{random, span, Case, Outputs};

/// One case's comparisons, and the sinks' gradient as bits for run-to-run checks.
struct Outcome {
    o: Comparison,
    lse: Comparison,
    dq: Comparison,
    dk: Comparison,
    dv: Comparison,
    dsinks: Comparison,
    dsink_bits: Vec<u32>,
}

impl Outcome {
    fn pass(&self) -> bool {
        [
            &self.o,
            &self.lse,
            &self.dq,
            &self.dk,
            &self.dv,
            &self.dsinks,
        ]
        .iter()
        .all(|c| c.pass)
    }
}

/// Sinks around the scores' own range (the scaled scores of N(0,1) inputs are about ±3), one
/// far above it, one far below.
fn random_sinks(heads: usize, rng: &mut StdRng) -> Vec<f32> {
    (0..heads)
        .map(|h| match h % 4 {
            2 => 9.0,
            3 => -30.0,
            _ => rng.random_range(-2.0..4.0),
        })
        .collect()
}

fn run_case<T: Element + DeviceRepr>(
    dev: &Device,
    stream: &Arc<CudaStream>,
    case: &Case,
    cfg: &AttentionConfig,
    seed: u64,
) -> Outcome {
    let mut rng = StdRng::seed_from_u64(seed);
    let views = Views::of(case);
    let (lq, lk, lv, lo) = (views.q, views.k, views.v, views.o);
    let [q, k, v] = case.random_qkv::<T>(&mut rng);
    let dout: Vec<T> = random(span(&lo), &mut rng);
    let sinks = random_sinks(case.heads_q, &mut rng);
    let lse_len = case.batch * case.heads_q * case.seqlen_q;

    let mut t = OnDevice::upload(stream, [&q, &k, &v, &dout], lse_len, Some(&sinks));
    t.forward(dev, stream, cfg, None, views)
        .unwrap_or_else(|e| panic!("{case:?} forward: {e}"));
    t.backward(dev, stream, cfg, None, views)
        .unwrap_or_else(|e| panic!("{case:?} backward: {e}"));
    let Outputs {
        out: o,
        lse,
        dq,
        dk,
        dv,
        dsinks,
    } = t.download(stream);
    let dsinks = dsinks.expect("the sinks' gradient");

    let cpu = case.cfg(Backend::Cpu);
    let (tq, tk, tv, tdo) = (
        TensorRef::new(&q, lq),
        TensorRef::new(&k, lk),
        TensorRef::new(&v, lv),
        TensorRef::new(&dout, lo),
    );
    let want = reference::reference_forward_sinks(&cpu, tq, tk, tv, &sinks);
    let base = reference::baseline_forward_sinks(&cpu, tq, tk, tv, &sinks);
    let (want_g, want_ds) = reference::reference_backward_sinks(&cpu, tq, tk, tv, tdo, &sinks);
    let (base_g, base_ds) = reference::baseline_backward_sinks(&cpu, tq, tk, tv, tdo, &sinks);
    let got = |x: &Vec<T>, l: Layout| reference::pack_f32(TensorRef::new(x, l));
    Outcome {
        o: compare(&got(&o, lo), &want.out, &base.out),
        lse: compare(&lse, &want.lse, &base.lse),
        dq: compare(&got(&dq, lq), &want_g.dq, &base_g.dq),
        dk: compare(&got(&dk, lk), &want_g.dk, &base_g.dk),
        dv: compare(&got(&dv, lv), &want_g.dv, &base_g.dv),
        dsinks: compare(&dsinks, &want_ds, &base_ds),
        dsink_bits: dsinks.iter().map(|x| x.to_bits()).collect(),
    }
}

/// Four query heads over two KV heads (sinks per query head), each head with its own kind of
/// sink; more queries than keys under the causal mask, so that rows 0..99 see no key (O = 0,
/// LSE = the sink); windows; softcap, whose cap the sinks do not take.
fn cases(head_dim: usize) -> Vec<Case> {
    let case = |sq, sk| Case::new(sq, sk, head_dim).heads(4, 2);
    vec![
        case(257, 257),
        case(300, 200).causal(true).batch(2),
        case(113, 700),
        case(400, 400).window(Some(64), Some(16)),
        case(257, 257).causal(true).softcap(30.0),
        case(1000, 1000).causal(true).deterministic(true),
    ]
}

fn run_all<T: Element + DeviceRepr>(
    cases: &[Case],
    label: &str,
    cfg_of: impl Fn(&Case) -> AttentionConfig,
) {
    let (dev, stream) = device();
    let mut failures = vec![];
    for (n, case) in cases.iter().enumerate() {
        let case = &case.dtype(T::DTYPE);
        let r = run_case::<T>(&dev, &stream, case, &cfg_of(case), 3000 + n as u64);
        println!(
            "{label} {}: O {}; LSE {}; dQ {}; dK {}; dV {}; d_sink {}",
            case.name(),
            r.o,
            r.lse,
            r.dq,
            r.dk,
            r.dv,
            r.dsinks
        );
        if !r.pass() {
            failures.push(format!("{case:?}"));
        }
    }
    assert!(
        failures.is_empty(),
        "failed cases:\n{}",
        failures.join("\n")
    );
}

/// The Hopper kernels, but with softcap `Auto`: the sm90 softcap backward does not sum the sinks'
/// gradient, so the planner sends that backward to sm80 (the forward stays on sm90).
fn sm90(case: &Case) -> AttentionConfig {
    case.cfg(if case.softcap.is_some() {
        Backend::Auto
    } else {
        Backend::Sm90
    })
}

#[test]
#[ignore = "needs a Hopper GPU"]
fn sm90_sinks() {
    for d in [64, 128, 256] {
        let cases = cases(d);
        run_all::<bf16>(&cases, &format!("sm90 d{d} bf16"), sm90);
        run_all::<f16>(&cases, &format!("sm90 d{d} f16"), sm90);
    }
}

/// The Hopper kernels at the head dims outside the default build (`hdim96`, `hdim192`), and
/// both families at DeepSeek's (192, 128) with `hdim192`.
#[test]
#[ignore = "needs a Hopper GPU"]
#[cfg(any(feature = "hdim96", feature = "hdim192"))]
fn sinks_at_the_optional_head_dims() {
    let mut runs: Vec<(String, Vec<Case>)> = common::optional_head_dims()
        .into_iter()
        .map(|d| (format!("d{d}"), cases(d)))
        .collect();
    if cfg!(feature = "hdim192") {
        let apart = cases(192).into_iter().map(|c| c.head_dim_v(128)).collect();
        runs.push(("d192/128".into(), apart));
    }
    for (dims, cases) in &runs {
        run_all::<bf16>(cases, &format!("sm90 {dims} bf16"), sm90);
        run_all::<f16>(cases, &format!("sm90 {dims} f16"), sm90);
    }
    if cfg!(feature = "hdim192") {
        let apart: Vec<Case> = cases(192).into_iter().map(|c| c.head_dim_v(128)).collect();
        run_all::<bf16>(&apart, "sm80 d192/128 bf16", |c| c.cfg(Backend::Sm80));
    }
}

/// The tail split's pieces and merge, with the sinks added after them.
#[test]
#[ignore = "needs a Hopper GPU"]
fn sm90_sinks_tail_split() {
    let always = |case: &Case| {
        let mut cfg = case.cfg(Backend::Sm90);
        cfg.sm90_schedule.split_tail = TailSplit::Always;
        cfg
    };
    // 100 keys make one key block at d64/d128 (no split) but two of d256's 80: there the rows
    // that see no key reach the merge.
    for d in [64, 128, 256] {
        let cases = [
            Case::new(1000, 3000, d).batch(2).heads(4, 2),
            Case::new(120, 100, d).causal(true).heads(4, 2),
        ];
        run_all::<bf16>(&cases, &format!("sm90 tail split d{d}"), always);
    }
}

#[test]
#[ignore = "needs a GPU"]
fn sm80_sinks() {
    for d in [64, 128] {
        let cases = cases(d);
        run_all::<bf16>(&cases, &format!("sm80 d{d} bf16"), |c| c.cfg(Backend::Sm80));
        run_all::<f16>(&cases, &format!("sm80 d{d} f16"), |c| c.cfg(Backend::Sm80));
    }
}

/// The sinks' gradient sums in a fixed order: two runs give the same bits, in either mode.
#[test]
#[ignore = "needs a GPU"]
fn sink_gradient_repeats_bit_for_bit() {
    let (dev, stream) = device();
    for backend in [Backend::Sm90, Backend::Sm80] {
        for deterministic in [false, true] {
            let case = Case::new(2000, 2000, 128)
                .heads(4, 2)
                .batch(3)
                .causal(true)
                .deterministic(deterministic);
            let cfg = case.cfg(backend);
            let what = format!("{backend:?}, deterministic {deterministic}");
            let first = run_case::<bf16>(&dev, &stream, &case, &cfg, 77);
            let second = run_case::<bf16>(&dev, &stream, &case, &cfg, 77);
            assert!(first.pass(), "{what}: {}", first.dsinks);
            assert_eq!(first.dsink_bits, second.dsink_bits, "{what}");
        }
    }
}

/// A sinks vector shorter than heads_q, or a dsinks one, is refused before any launch, and so is
/// dsinks without sinks: nothing written.
#[test]
#[ignore = "needs a GPU"]
fn short_sinks_and_dsinks_without_sinks_are_refused() {
    let (dev, stream) = device();
    let case = Case::new(64, 64, 64).heads(4, 2);
    let layouts = case.layouts();
    let cfg = case.cfg(Backend::Auto);
    let mut rng = StdRng::seed_from_u64(1);
    let [q, k, v] = case.random_qkv::<bf16>(&mut rng);
    let dout: Vec<bf16> = random(span(&layouts.0), &mut rng);
    let lse_len = case.heads_q * case.seqlen_q;
    let upload =
        |sinks: &[f32]| OnDevice::upload(&stream, [&q, &k, &v, &dout], lse_len, Some(sinks));
    let untouched = |t: &OnDevice<bf16>| {
        let got = t.download(&stream);
        let nan = |x: &[bf16]| x.iter().all(|x| x.is_nan());
        nan(&got.out) && nan(&got.dq) && nan(&got.dk) && nan(&got.dv)
    };
    let too_small = |e: Error, operand: Operand, len: usize| {
        assert!(
            matches!(e, Error::BufferTooSmall { operand: o, needed: 4, len: l } if o == operand && l == len),
            "{e:?}"
        );
    };

    let mut short = upload(&[0.5; 3]);
    let e = short
        .forward(&dev, &stream, &cfg, None, layouts)
        .unwrap_err();
    too_small(e, Operand::Sinks, 3);
    let e = short
        .backward(&dev, &stream, &cfg, None, layouts)
        .unwrap_err();
    too_small(e, Operand::Sinks, 3);
    assert!(untouched(&short));

    let mut t = upload(&[0.5; 4]);
    t.forward(&dev, &stream, &cfg, None, layouts).unwrap();
    t.dsinks = Some(stream.clone_htod(&[f32::NAN; 3]).unwrap());
    let e = t.backward(&dev, &stream, &cfg, None, layouts).unwrap_err();
    too_small(e, Operand::DSinks, 3);
    t.dsinks = Some(stream.clone_htod(&[f32::NAN; 4]).unwrap());
    t.sinks = None;
    let e = t.backward(&dev, &stream, &cfg, None, layouts).unwrap_err();
    assert!(matches!(e, Error::InvalidConfig(_)), "{e:?}");
    let got = t.download(&stream);
    assert!(got
        .dq
        .iter()
        .chain(&got.dk)
        .chain(&got.dv)
        .all(|x| x.is_nan()));
    assert!(got.dsinks.unwrap().iter().all(|x| x.is_nan()));
}

/// The FP8 forward's sinks: the pass after its kernel turns O and the LSE of the same call
/// without sinks into O' = O·e^(LSE − LSE') and LSE' = log(e^LSE + e^sink) (O' rounded to bf16
/// once more), so that a row that sees no key gets O = 0 and the sink as its LSE exactly; the
/// one-call `forward_fp8` passes its sinks on, bit for bit.
#[test]
#[ignore = "needs a Hopper GPU"]
fn fp8_forward_adds_the_sinks() {
    let (dev, stream) = device();
    // More queries than keys under the causal mask: rows 0..99 see no key.
    let case = Case::new(300, 200, 128).heads(4, 2).causal(true);
    let (lq, lk) = (
        Layout::contiguous(case.q_shape()),
        Layout::contiguous(case.kv_shape()),
    );
    let mut rng = StdRng::seed_from_u64(5);
    let [q, k, v] = [lq, lk, lk].map(|l| random::<bf16>(span(&l), &mut rng));
    let sinks = random_sinks(case.heads_q, &mut rng);
    let up = |x: &Vec<bf16>| stream.clone_htod(x).unwrap();
    let (q_dev, k_dev, v_dev) = (up(&q), up(&k), up(&v));
    let (q_t, k_t, v_t) = (
        DeviceTensor::new(q_dev.as_view(), lq),
        DeviceTensor::new(k_dev.as_view(), lk),
        DeviceTensor::new(v_dev.as_view(), lk),
    );
    let options = Fp8Options::default();
    let fp8 = dev
        .quantize_fp8(&stream, &q_t, &k_t, &v_t, options)
        .unwrap();
    let sinks_dev = stream.clone_htod(&sinks).unwrap();
    let sinks_view = sinks_dev.as_view();
    let cfg = case.cfg(Backend::Sm90);
    let run = |inputs: Fp8ForwardInputs| {
        let mut out = poisoned_outputs::<bf16>(&stream, &case, span(&lq));
        dev.forward_fp8_into(
            &stream,
            &cfg,
            inputs,
            &mut DeviceTensorMut::new(out.0.as_view_mut(), lq),
            &mut out.1.as_view_mut(),
        )
        .unwrap();
        download(&stream, &out)
    };
    let (o, lse) = run(Fp8ForwardInputs::new(&fp8));
    let (o_s, lse_s) = run(Fp8ForwardInputs::new(&fp8).with_sinks(&sinks_view));

    let (sq, h, d) = (case.seqlen_q, case.heads_q, case.head_dim);
    let mut without_key = 0;
    for (head, &sink) in sinks.iter().enumerate() {
        for i in 0..sq {
            let (l, l_s) = (lse[head * sq + i], lse_s[head * sq + i]);
            let row = |x: &[bf16]| x[(i * h + head) * d..][..d].to_vec();
            let (row, row_s) = (row(&o), row(&o_s));
            if l == f32::INFINITY {
                without_key += 1;
                assert_eq!(l_s, sink, "head {head} row {i}");
                assert!(
                    row_s.iter().all(|x| x.to_f32() == 0.0),
                    "head {head} row {i}"
                );
                continue;
            }
            let (l, s) = (l as f64, sink as f64);
            let want = l.max(s) + (-(l - s).abs()).exp().ln_1p();
            let err = (l_s as f64 - want).abs();
            assert!(
                err <= 1e-5 * (1.0 + want.abs()),
                "head {head} row {i}: LSE {l_s}, want {want}"
            );
            let scale = (l - l_s as f64).exp();
            for (x, y) in row.iter().zip(&row_s) {
                let want = x.to_f32() as f64 * scale;
                // O' is rounded to bf16 from an f32 product: within one unit in its last place.
                let err = (y.to_f32() as f64 - want).abs();
                assert!(
                    err <= want.abs() / 128.0,
                    "head {head} row {i}: O {y}, want {want}"
                );
            }
        }
    }
    assert_eq!(without_key, h * (case.seqlen_q - case.seqlen_k));

    let mut out = poisoned_outputs::<bf16>(&stream, &case, span(&lq));
    dev.forward_fp8(
        &stream,
        &cfg,
        DeviceForwardInputs::new(&q_t, &k_t, &v_t).with_sinks(&sinks_view),
        &mut DeviceTensorMut::new(out.0.as_view_mut(), lq),
        &mut out.1.as_view_mut(),
        options,
    )
    .unwrap();
    let (o_one, lse_one) = download(&stream, &out);
    assert_eq!(o_one, o_s);
    assert_eq!(lse_one, lse_s);
}

/// A packed batch with sinks (sequences of 1–300 rows, one whose first rows see no key under
/// the causal mask, one without queries): every sequence's O, LSE, dQ, dK, dV against its own
/// dense reference with sinks (the one without queries: dK and dV zero), and the sinks'
/// gradient against the sum of theirs.
#[test]
#[ignore = "needs a GPU"]
fn packed_batches_with_sinks() {
    use flashattn::cuda::DeviceSeqlens;
    use harness::varlen::{rows, Batch};
    let (dev, stream) = device();
    let (q_lens, k_lens) = ([37, 300, 1, 0, 130], [37, 200, 5, 9, 250]);
    for backend in [Backend::Sm90, Backend::Sm80] {
        for d in [64, 128] {
            let batch = Batch::<bf16>::new(&q_lens, &k_lens, (4, 2), d, 11 + d as u64);
            let (h, hk) = (batch.heads_q, batch.heads_kv);
            let (tq, tk): (usize, usize) = (q_lens.iter().sum(), k_lens.iter().sum());
            let sinks = random_sinks(h, &mut StdRng::seed_from_u64(d as u64));
            let cfg = AttentionConfig::new().causal(true).backend(backend);
            let (cu_q, cu_k) = batch.cu();
            let (max_q, max_k) = batch.max();
            let (cu_q_dev, cu_k_dev) = (
                stream.clone_htod(&cu_q).unwrap(),
                stream.clone_htod(&cu_k).unwrap(),
            );
            let seqs =
                DeviceSeqlens::new(cu_q_dev.as_view(), cu_k_dev.as_view(), max_q, max_k).unwrap();
            let layouts = (
                Layout::contiguous([1, tq, h, d]),
                Layout::contiguous([1, tk, hk, d]),
            );
            let tensors = [&batch.q, &batch.k, &batch.v, &batch.dout].map(|x| &x[..]);
            let mut t = OnDevice::upload(&stream, tensors, tq * h, Some(&sinks));
            t.forward(&dev, &stream, &cfg, Some(&seqs), layouts)
                .unwrap();
            t.backward(&dev, &stream, &cfg, Some(&seqs), layouts)
                .unwrap();
            let Outputs {
                out: o,
                lse,
                dq,
                dk,
                dv,
                dsinks,
            } = t.download(&stream);
            let dsinks = dsinks.expect("the sinks' gradient");

            let cpu = AttentionConfig::new().causal(true).backend(Backend::Cpu);
            let (mut want_ds, mut base_ds) = (vec![0f64; h], vec![0f32; h]);
            let (mut q0, mut k0) = (0, 0);
            let mut failures = vec![];
            for (b, (&nq, &nk)) in q_lens.iter().zip(&k_lens).enumerate() {
                let (qr, kr) = (q0..q0 + nq, k0..k0 + nk);
                (q0, k0) = (qr.end, kr.end);
                if nq == 0 {
                    // No query sees its keys: their gradients are zero (the poison written over).
                    let zero = |g: &[bf16]| {
                        g[kr.start * hk * d..kr.end * hk * d]
                            .iter()
                            .all(|x| x.to_f32() == 0.0)
                    };
                    if !(zero(&dk) && zero(&dv)) {
                        failures.push(format!(
                            "{backend:?} d{d} sequence {b}: dK/dV of keys no query sees not zero"
                        ));
                    }
                    continue;
                }
                let seq = |x: &[bf16], r: std::ops::Range<usize>, heads| rows(x, r, heads, d);
                let (sq, sk, sv, sdo) = (
                    seq(&batch.q, qr.clone(), h),
                    seq(&batch.k, kr.clone(), hk),
                    seq(&batch.v, kr.clone(), hk),
                    seq(&batch.dout, qr.clone(), h),
                );
                let (dl_q, dl_k) = (
                    Layout::contiguous([1, nq, h, d]),
                    Layout::contiguous([1, nk, hk, d]),
                );
                let (tq_, tk_, tv_, tdo) = (
                    TensorRef::new(&sq, dl_q),
                    TensorRef::new(&sk, dl_k),
                    TensorRef::new(&sv, dl_k),
                    TensorRef::new(&sdo, dl_q),
                );
                let want = reference::reference_forward_sinks(&cpu, tq_, tk_, tv_, &sinks);
                let base = reference::baseline_forward_sinks(&cpu, tq_, tk_, tv_, &sinks);
                let (wg, wds) =
                    reference::reference_backward_sinks(&cpu, tq_, tk_, tv_, tdo, &sinks);
                let (bg, bds) =
                    reference::baseline_backward_sinks(&cpu, tq_, tk_, tv_, tdo, &sinks);
                for i in 0..h {
                    want_ds[i] += wds[i];
                    base_ds[i] += bds[i];
                }
                let f = |x: &[bf16]| x.iter().map(|v| v.to_f32()).collect::<Vec<f32>>();
                let got_lse: Vec<f32> = (0..h)
                    .flat_map(|hh| lse[hh * tq + qr.start..hh * tq + qr.end].to_vec())
                    .collect();
                let checks = [
                    (
                        "O",
                        compare(&f(&seq(&o, qr.clone(), h)), &want.out, &base.out),
                    ),
                    ("LSE", compare(&got_lse, &want.lse, &base.lse)),
                    ("dQ", compare(&f(&seq(&dq, qr.clone(), h)), &wg.dq, &bg.dq)),
                    ("dK", compare(&f(&seq(&dk, kr.clone(), hk)), &wg.dk, &bg.dk)),
                    ("dV", compare(&f(&seq(&dv, kr.clone(), hk)), &wg.dv, &bg.dv)),
                ];
                for (what, c) in checks {
                    println!("{backend:?} d{d} sequence {b} {what}: {c}");
                    if !c.pass {
                        failures.push(format!("{backend:?} d{d} sequence {b} {what}"));
                    }
                }
            }
            let c = compare(&dsinks, &want_ds, &base_ds);
            println!("{backend:?} d{d} d_sink: {c}");
            if !c.pass {
                failures.push(format!("{backend:?} d{d} d_sink"));
            }
            assert!(failures.is_empty(), "failed: {failures:#?}");
        }
    }
}
