//! GPU TFLOP/s on the headline shapes of docs/ARCHITECTURE.md (total tokens 16384, hidden 2048,
//! seqlen 512…16384, head dim 64/128/256, causal and not, bf16): the Hopper forward with the
//! FlashAttention-3 ablation at d128 s8192 and the Hopper backward where it is built, and the
//! FlashAttention-2-style (sm80) forward and backward (atomic and deterministic) on the same
//! shapes. CUDA events around each call, queued behind the warm-up, median of about 250 ms of
//! calls (30 to 100), as compare_torch.py times the peers (`--warmup`, `--min-reps`,
//! `--max-reps`, `--target-ms` as its flags; `--quick` 100 ms, from 20 calls); the host's enqueue
//! time per forward call is reported beside. Each forward is also
//! checked on sampled rows against the f64 reference (`pass`); the backward's correctness is
//! tests/gpu_bwd.rs's.
//!
//! `--tokens T` gives each shape T tokens (batch = T / seqlen) instead of 16384.
//! `--dims D,...` times other head dims than 64, 128 and 256 (those this build has; the hidden
//! size `--hidden H` must be a multiple of each), a backward only where one is built.
//! `--head-dim-v DV` gives V and O (and dO, dV) head dim DV at each of those (at most each; the
//! FLOPs count P·V over DV: 2·b·s²·h·(d + DV), the backward 2.5× that as for one head dim).
//!
//! `--softcap C` caps every row's scores at C (the results file says so). `--sinks` gives every
//! call attention sinks (one logit per query head), and the backward their gradient: what they
//! cost beside the same rows without (the results file says so).
//!
//! `--sustained N` also runs, after each shape's cold timings, N back-to-back calls of its forward
//! and of its backward (the plain one, where one is built) with no host synchronization among
//! them, and reports the mean per call over the last half, with the SM clock, power and
//! temperature that nvidia-smi sampled meanwhile (none where it is missing): one more row per
//! shape and kind (`"sustained": true, "reps": N, "kind": "fwd"|"bwd"`), as
//! benchmarks/peers_fa3_fp8.py writes its sustained rows. Each later shape's cold timing then
//! follows the previous shape's sustained run: time cold rows in a run without the flag.
//!
//! Usage: bench_table [--quick] [--only D,S[,causal][,sm80]] [--dims D,...] [--head-dim-v DV]
//!                    [--tokens T] [--hidden H] [--softcap C] [--sinks] [--sustained N]
//!                    [--warmup N] [--min-reps N] [--max-reps N] [--target-ms MS]
//!                    [--out results.json] [--commit SHA]

mod common;

use std::sync::Arc;

use flashattn::cuda::{
    CudaSlice, CudaStream, Device, DeviceBackwardInputs, DeviceForwardInputs, DeviceGradientsMut,
    DeviceTensor, DeviceTensorMut,
};
use flashattn::reference::{self, compare};
use flashattn::registry::{self, Family, KernelDtype};
use flashattn::unstable::{PingPong, Sm90Schedule};
use flashattn::{AttentionConfig, Backend, DType, Layout, Problem, TensorRef};
use half::bf16;
use rand::rngs::StdRng;
use rand::SeedableRng;
use rand_distr::{Distribution, Normal};

/// Total tokens per call unless `--tokens T` says otherwise.
const TOKENS: usize = 16384;
/// The cold timing of benchmarks/compare_torch.py, whose peers these rows are compared with.
const PROTOCOL: common::Protocol = common::Protocol {
    warmup: 3,
    min_reps: 30,
    max_reps: 100,
    target_ms: 250.0,
    cool_ms: 20.0,
};

struct Inputs {
    host: [Vec<bf16>; 3],
    dev: [CudaSlice<bf16>; 3],
    out: CudaSlice<bf16>,
    lse: CudaSlice<f32>,
    /// dO and the gradients, for the backward rows.
    dout: CudaSlice<bf16>,
    grads: [CudaSlice<bf16>; 3],
    /// With `--sinks`: the sinks (host and device, enough for the most heads timed) and their
    /// gradient's buffer.
    sinks: Option<(Vec<f32>, CudaSlice<f32>, CudaSlice<f32>)>,
}

struct Row {
    d: usize,
    dv: usize,
    seqlen: usize,
    causal: bool,
    backend: Backend,
    schedule: Sm90Schedule,
    ms: f64,
    ms_p10: f64,
    ms_p90: f64,
    host_us: f64,
    /// The calls each median was taken over (the plain backward's for `bwd_reps`).
    fwd_reps: usize,
    bwd_reps: Option<usize>,
    tflops: f64,
    bwd_ms: Option<f64>,
    bwd_tflops: Option<f64>,
    /// The deterministic backward (fixed accumulation order).
    bwd_det_ms: Option<f64>,
    bwd_det_tflops: Option<f64>,
    err_ratio: f64,
    pass: bool,
    /// One forward's FLOPs, for the sustained rows' TFLOP/s.
    flops: f64,
    /// With `--sustained`: the forward's and the plain backward's sustained runs.
    sustained_fwd: Option<common::Sustained>,
    sustained_bwd: Option<common::Sustained>,
}

/// One forward call on `shape` into `inp`'s O and LSE (the cold and the sustained timings').
fn forward_call<'a>(
    dev: &'a Device,
    stream: &'a Arc<CudaStream>,
    cfg: &'a AttentionConfig,
    shape: [usize; 5],
) -> impl Fn(&mut Inputs) + 'a {
    let (layout, layout_v) = layouts(shape);
    move |inp: &mut Inputs| {
        let Inputs {
            dev: [q, k, v],
            out,
            lse,
            sinks,
            ..
        } = inp;
        let (tq, tk, tv) = (
            DeviceTensor::new(
                q.slice(..layout.span(flashattn::Operand::Q).unwrap()),
                layout,
            ),
            DeviceTensor::new(k.slice(..), layout),
            DeviceTensor::new(v.slice(..), layout_v),
        );
        let sinks = sinks.as_ref().map(|(_, s, _)| s.as_view());
        let mut inputs = DeviceForwardInputs::new(&tq, &tk, &tv);
        if let Some(s) = &sinks {
            inputs = inputs.with_sinks(s);
        }
        dev.forward_into(
            stream,
            cfg,
            inputs,
            &mut DeviceTensorMut::new(out.as_view_mut(), layout_v),
            &mut lse.as_view_mut(),
        )
        .expect("forward");
    }
}

/// The forward timed under `protocol`.
fn time_forward(
    dev: &Device,
    stream: &Arc<CudaStream>,
    inp: &mut Inputs,
    cfg: &AttentionConfig,
    shape: [usize; 5],
    protocol: &common::Protocol,
) -> common::Timed {
    let run = forward_call(dev, stream, cfg, shape);
    protocol.times_ms(stream, 1, |_| run(inp))
}

/// One backward call on `shape` into `inp`'s gradients, from the O and LSE a forward left there.
fn backward_call<'a>(
    dev: &'a Device,
    stream: &'a Arc<CudaStream>,
    cfg: &'a AttentionConfig,
    shape: [usize; 5],
) -> impl Fn(&mut Inputs) + 'a {
    let (layout, layout_v) = layouts(shape);
    let n = layout.span(flashattn::Operand::Q).unwrap();
    let n_v = layout_v.span(flashattn::Operand::V).unwrap();
    move |inp: &mut Inputs| {
        let [q, k, v] = &inp.dev;
        fn t(x: &CudaSlice<bf16>, n: usize, layout: Layout) -> DeviceTensor<'_, bf16> {
            DeviceTensor::new(x.slice(..n), layout)
        }
        let [dq, dk, dv] = &mut inp.grads;
        let (sinks, mut dsinks) = match &mut inp.sinks {
            Some((_, s, ds)) => (Some(s.as_view()), Some(ds.as_view_mut())),
            None => (None, None),
        };
        dev.backward_into(
            stream,
            cfg,
            DeviceBackwardInputs {
                q: &t(q, n, layout),
                k: &t(k, n, layout),
                v: &t(v, n_v, layout_v),
                out: &t(&inp.out, n_v, layout_v),
                dout: &t(&inp.dout, n_v, layout_v),
                lse: &inp.lse.slice(..),
                sinks: sinks.as_ref(),
            },
            DeviceGradientsMut {
                dq: &mut DeviceTensorMut::new(dq.slice_mut(..n), layout),
                dk: &mut DeviceTensorMut::new(dk.slice_mut(..n), layout),
                dv: &mut DeviceTensorMut::new(dv.slice_mut(..n_v), layout_v),
                dsinks: dsinks.as_mut(),
            },
        )
        .expect("backward");
    }
}

/// The backward's median milliseconds under `protocol` and the calls timed, after one forward
/// that leaves O and LSE in `inp`.
fn time_backward(
    dev: &Device,
    stream: &Arc<CudaStream>,
    inp: &mut Inputs,
    cfg: &AttentionConfig,
    shape: [usize; 5],
    protocol: &common::Protocol,
) -> (f64, usize) {
    let run = backward_call(dev, stream, cfg, shape);
    protocol.median_ms(stream, || run(inp))
}

/// Error ratio on sampled rows of the last output (the correctness rule of docs/ARCHITECTURE.md).
fn check(stream: &Arc<CudaStream>, inp: &Inputs, cfg: &AttentionConfig, shape: [usize; 5]) -> f64 {
    let (layout, layout_v) = layouts(shape);
    let n = layout.span(flashattn::Operand::Q).unwrap();
    let n_v = layout_v.span(flashattn::Operand::V).unwrap();
    let out: Vec<bf16> = stream.clone_dtoh(&inp.out.slice(..n_v)).unwrap();
    stream.synchronize().unwrap();
    if out.iter().any(|x| x.is_nan()) {
        return f64::INFINITY;
    }
    let t = |i: usize| match i {
        2 => TensorRef::new(&inp.host[i][..n_v], layout_v),
        _ => TensorRef::new(&inp.host[i][..n], layout),
    };
    let cpu = cfg.clone().backend(Backend::Cpu);
    let [b, s, h, _, dv] = shape;
    let (mut got, mut want, mut base) = (vec![], vec![], vec![]);
    for (bi, hi, i) in [(0, 0, 0), (b - 1, h - 1, s - 1), (b / 2, h / 2, s / 2 + 3)] {
        let (w, bo) = match &inp.sinks {
            Some((host, _, _)) => (
                reference::reference_row_sinks(&cpu, t(0), t(1), t(2), &host[..h], bi, hi, i).0,
                reference::baseline_row_sinks(&cpu, t(0), t(1), t(2), &host[..h], bi, hi, i).0,
            ),
            None => (
                reference::reference_row(&cpu, t(0), t(1), t(2), bi, hi, i).0,
                reference::baseline_row(&cpu, t(0), t(1), t(2), bi, hi, i).0,
            ),
        };
        let off = layout_v.offset(bi, i, hi, 0);
        got.extend(out[off..off + dv].iter().map(|x| x.to_f32()));
        want.extend(w);
        base.extend(bo);
    }
    compare(&got, &want, &base).ratio
}

/// Head dims as the table prints them: "128", or "192/128" where V's differs.
fn dims_name(d: usize, dv: usize) -> String {
    if d == dv {
        d.to_string()
    } else {
        format!("{d}/{dv}")
    }
}

/// Q's and K's layout of a shape (batch, seqlen, heads, d, d_v), and V's and O's.
fn layouts([b, s, h, d, dv]: [usize; 5]) -> (Layout, Layout) {
    (
        Layout::contiguous([b, s, h, d]),
        Layout::contiguous([b, s, h, dv]),
    )
}

/// Whether this build holds `family`'s bf16 kernel at head dims `d` and `dv`.
fn built(family: Family, d: usize, dv: usize) -> bool {
    registry::find(family, d, dv, KernelDtype::Bf16).is_some_and(|k| k.built())
}

fn main() {
    let args = common::Args::parse();
    let quick = args.flag("--quick");
    let dev = common::device("bench_table");
    let stream = dev.new_stream().unwrap();
    let info = dev.info().clone();
    let sustained = args.sustained();
    let protocol = common::Protocol::from_args(&args, PROTOCOL);
    // Sampling from the start, so that each run's window finds samples already flowing.
    let sampler = sustained.and_then(|_| {
        let s = common::GpuSampler::start(0);
        if s.is_none() {
            eprintln!("note: nvidia-smi did not start; the sustained rows carry no clocks");
        }
        s
    });

    let tokens: usize = args
        .value("--tokens")
        .map_or(TOKENS, |t| t.parse().expect("--tokens T"));
    assert!(
        tokens % TOKENS == 0 || args.value("--only").is_some(),
        "--tokens T is a multiple of {TOKENS}, which every seqlen timed divides"
    );
    let hidden: usize = args
        .value("--hidden")
        .map_or(2048, |h| h.parse().expect("--hidden H"));
    let softcap: Option<f32> = args
        .value("--softcap")
        .map(|c| c.parse().expect("--softcap C"));
    let with_sinks = args.flag("--sinks");
    if with_sinks {
        println!("every call with attention sinks, every backward with their gradient");
    }
    let dims: Vec<usize> = args.value("--dims").map_or(vec![64, 128, 256], |v| {
        v.split(',')
            .map(|d| d.parse().expect("--dims D,..."))
            .collect()
    });
    assert!(
        dims.iter().chain(&[64, 128, 256]).all(|d| hidden % d == 0),
        "--hidden {hidden} is not a multiple of each head dim timed"
    );
    let head_dim_v: Option<usize> = args
        .value("--head-dim-v")
        .map(|v| v.parse().expect("--head-dim-v DV"));
    // V, O, dO and dV live in buffers of Q's size.
    assert!(
        head_dim_v.is_none_or(|dv| dims.iter().all(|&d| dv <= d)),
        "--head-dim-v is at most each head dim timed"
    );
    let dv_of = |d: usize| head_dim_v.unwrap_or(d);
    let n = tokens * hidden;
    let mut rng = StdRng::seed_from_u64(7);
    let normal = Normal::new(0f32, 1.0).unwrap();
    let mut gen = || -> Vec<bf16> {
        (0..n)
            .map(|_| bf16::from_f32(normal.sample(&mut rng)))
            .collect()
    };
    let host = [gen(), gen(), gen()];
    let upload = |h: &Vec<bf16>| stream.clone_htod(h).unwrap();
    let dev_bufs = [upload(&host[0]), upload(&host[1]), upload(&host[2])];
    // Heads at the smallest head dim timed (the fixed rows below include d64).
    let most_heads = hidden / dims.iter().fold(64, |m, &d| m.min(d));
    let mut inp = Inputs {
        dev: dev_bufs,
        out: stream.clone_htod(&vec![bf16::NAN; n]).unwrap(),
        lse: stream
            .clone_htod(&vec![f32::NAN; tokens * most_heads])
            .unwrap(),
        dout: upload(&gen()),
        grads: [
            stream.clone_htod(&vec![bf16::NAN; n]).unwrap(),
            stream.clone_htod(&vec![bf16::NAN; n]).unwrap(),
            stream.clone_htod(&vec![bf16::NAN; n]).unwrap(),
        ],
        // Around the scaled scores' own range (about ±3 for N(0, 1) inputs).
        sinks: with_sinks.then(|| {
            let host: Vec<f32> = (0..most_heads).map(|h| (h % 7) as f32 - 3.0).collect();
            let dev = stream.clone_htod(&host).unwrap();
            (
                host,
                dev,
                stream.clone_htod(&vec![f32::NAN; most_heads]).unwrap(),
            )
        }),
        host,
    };

    let seqlens: &[usize] = if quick {
        &[2048, 8192]
    } else {
        &[512, 1024, 2048, 4096, 8192, 16384]
    };
    let full = Sm90Schedule::default();
    let mut plan = vec![];
    for &d in dims
        .iter()
        .filter(|&&d| built(Family::Sm90Fwd, d, dv_of(d)))
    {
        for &causal in &[false, true] {
            for &s in seqlens {
                plan.push((Backend::Sm90, d, s, causal, full));
            }
        }
    }
    // The FlashAttention-2-style kernels on the same shapes (forced: Hopper would take sm90).
    for &d in dims
        .iter()
        .filter(|&&d| built(Family::Sm80Fwd, d, dv_of(d)))
    {
        for &causal in &[false, true] {
            for &s in seqlens {
                plan.push((Backend::Sm80, d, s, causal, full));
            }
        }
    }
    // The ablation of the FA3 paper at d128 s8192 non-causal (without intra-warpgroup overlap
    // when built with the `ablation` feature), and ping-pong off elsewhere (one head dim).
    let ablation_rows = if head_dim_v.is_some() {
        vec![]
    } else {
        vec![
            (PingPong::Off, true),
            (PingPong::On, false),
            (PingPong::Off, false),
        ]
    };
    for (pingpong, intra_wg_overlap) in ablation_rows {
        if !intra_wg_overlap && !cfg!(feature = "ablation") {
            continue;
        }
        plan.push((
            Backend::Sm90,
            128,
            8192,
            false,
            Sm90Schedule {
                pingpong,
                intra_wg_overlap,
                ..full
            },
        ));
    }
    let no_pingpong = Sm90Schedule {
        pingpong: PingPong::Off,
        ..full
    };
    if head_dim_v.is_none() {
        for (d, causal) in [
            (64, false),
            (64, true),
            (128, true),
            (256, false),
            (256, true),
        ] {
            plan.push((Backend::Sm90, d, 8192, causal, no_pingpong));
        }
    }
    // --sm80 / --sm90: one family's rows alone, the sm90 ones without the ablation (for timing
    // several builds in one device call).
    if args.flag("--sm80") {
        plan.retain(|row| row.0 == Backend::Sm80);
    }
    if args.flag("--sm90") {
        plan.retain(|row| row.0 == Backend::Sm90 && row.4 == full);
    }
    // --only D,S[,causal][,sm80]: one shape with the default schedule (for profilers).
    if let Some((d, s, words)) = args.only(tokens, &["causal", "sm80"]) {
        assert!(dv_of(d) <= d, "--head-dim-v is at most the head dim timed");
        let backend = if words.iter().any(|w| w == "sm80") {
            Backend::Sm80
        } else {
            Backend::Sm90
        };
        plan = vec![(backend, d, s, words.iter().any(|w| w == "causal"), full)];
    }

    let mut rows = vec![];
    for (backend, d, s, causal, schedule) in plan {
        let dv = dv_of(d);
        let shape = [tokens / s, s, hidden / d, d, dv];
        let mut cfg = AttentionConfig::new()
            .causal(causal)
            .backend(backend)
            .sm90_schedule(schedule);
        if let Some(c) = softcap {
            cfg = cfg.softcap(c);
        }
        let timed = time_forward(&dev, &stream, &mut inp, &cfg, shape, &protocol);
        let (host_us, fwd_reps) = (timed.host_us, timed.reps);
        let times = &timed.ms[0];
        let pct = |p: f64| common::percentile(times, p);
        let ms = pct(50.0);
        let problem = Problem {
            batch: shape[0],
            seqlen_q: s,
            seqlen_k: s,
            heads_q: shape[2],
            heads_kv: shape[2],
            head_dim: d,
            head_dim_v: dv,
            dtype: flashattn::DType::BF16,
            packed: false,
        };
        let tflops = problem.forward_flops(causal) / (ms * 1e-3) / 1e12;
        let err_ratio = check(&stream, &inp, &cfg, shape);
        // The backward of the kernels that have one (its correctness: tests/gpu_bwd.rs).
        let mut median_backward =
            |cfg: &AttentionConfig| time_backward(&dev, &stream, &mut inp, cfg, shape, &protocol);
        // sm90: the default schedule's rows.
        let sm80 = backend == Backend::Sm80 && built(Family::Sm80Bwd, d, dv);
        // (The sm90 backward has no deterministic mode with softcap, nor the sinks' gradient.)
        let sm90_bwd = backend == Backend::Sm90
            && schedule == full
            && built(Family::Sm90Bwd, d, dv)
            && !(softcap.is_some() && with_sinks);
        let bwd = (sm80 || sm90_bwd).then(|| median_backward(&cfg));
        let (bwd_ms, bwd_reps) = (bwd.map(|b| b.0), bwd.map(|b| b.1));
        let bwd_det_ms = (sm80 || (sm90_bwd && softcap.is_none()))
            .then(|| median_backward(&cfg.clone().deterministic(true)).0);
        let bwd_tflops = |ms: f64| 2.5 * problem.forward_flops(causal) / (ms * 1e-3) / 1e12;
        // After the cold timings, so that the heat of hundreds of calls changes none of them.
        let (sustained_fwd, sustained_bwd) = match sustained {
            Some(reps) => {
                let fwd = forward_call(&dev, &stream, &cfg, shape);
                let f = common::sustained_run(
                    &stream,
                    common::SUSTAINED_WARMUP,
                    reps,
                    sampler.as_ref(),
                    || fwd(&mut inp),
                );
                // The plain (non-deterministic) backward alone, where one was timed cold.
                let b = bwd_ms.is_some().then(|| {
                    let bwd = backward_call(&dev, &stream, &cfg, shape);
                    common::sustained_run(
                        &stream,
                        common::SUSTAINED_WARMUP,
                        reps,
                        sampler.as_ref(),
                        || bwd(&mut inp),
                    )
                });
                (Some(f), b)
            }
            None => (None, None),
        };
        let row = Row {
            d,
            dv,
            seqlen: s,
            causal,
            backend,
            schedule,
            ms,
            ms_p10: pct(10.0),
            ms_p90: pct(90.0),
            host_us,
            fwd_reps,
            bwd_reps,
            tflops,
            bwd_ms,
            bwd_tflops: bwd_ms.map(bwd_tflops),
            bwd_det_ms,
            bwd_det_tflops: bwd_det_ms.map(bwd_tflops),
            err_ratio,
            pass: err_ratio <= 1.0,
            flops: problem.forward_flops(causal),
            sustained_fwd,
            sustained_bwd,
        };
        println!(
            "{} fwd d{:<7} s{:<5} causal={:<5} pingpong={:<5} overlap={:<5} persistent_causal={:<5} {:8.3} ms (p10 {:.3}, p90 {:.3})  {:6.1} TFLOP/s  host {:.1} us/call  err ratio {:.3} {}",
            backend.name(), dims_name(d, dv), s, causal, schedule.pingpong.takes_turns(DType::BF16), schedule.intra_wg_overlap, schedule.persistent_causal, ms, row.ms_p10, row.ms_p90,
            tflops, host_us, err_ratio, if row.pass { "pass" } else { "FAIL" }
        );
        if let (Some(ms), Some(tf)) = (row.bwd_ms, row.bwd_tflops) {
            let det = match (row.bwd_det_ms, row.bwd_det_tflops) {
                (Some(det), Some(det_tf)) => {
                    format!("  deterministic {det:8.3} ms  {det_tf:6.1} TFLOP/s")
                }
                _ => String::new(),
            };
            println!(
                "{} bwd d{:<7} s{s:<5} causal={causal:<5} {ms:8.3} ms  {tf:6.1} TFLOP/s{det}",
                backend.name(),
                dims_name(d, dv)
            );
        }
        for (kind, run, flops) in [
            ("fwd", &row.sustained_fwd, row.flops),
            ("bwd", &row.sustained_bwd, 2.5 * row.flops),
        ] {
            if let Some(run) = run {
                println!(
                    "{} {kind} sustained x{} d{:<7} s{s:<5} causal={causal:<5} {}",
                    backend.name(),
                    run.reps,
                    dims_name(d, dv),
                    run.text(flops)
                );
            }
        }
        rows.push(row);
    }

    if let Some(path) = args.value("--out") {
        let commit = args.commit();
        let mut json_rows = Vec::new();
        for r in &rows {
            let sch = r.schedule;
            let variant = if sch.narrow_key_blocks {
                ", \"variant\": \"narrow-key-blocks\""
            } else {
                match (
                    sch.pingpong.takes_turns(DType::BF16),
                    sch.intra_wg_overlap,
                    sch.persistent_causal,
                ) {
                    (true, true, true) => "",
                    (true, true, false) => ", \"variant\": \"one-cta-per-tile\"",
                    (false, true, _) => ", \"variant\": \"no-pingpong\"",
                    (true, false, _) => ", \"variant\": \"no-intra-wg-overlap\"",
                    (false, false, _) => ", \"variant\": \"no-pingpong-no-overlap\"",
                }
            };
            json_rows.push(format!(
                "  {{\"impl\": \"flashattn-{}\", \"backend\": \"{}\", \"dtype\": \"bf16\", \"d\": {}{}, \"seqlen_q\": {}, \"seqlen_k\": {}, \"batch\": {}, \"heads\": {}, \"heads_kv\": {}, \"causal\": {}, \"pass\": {}, \"max_err_ratio\": {:.4}, \"fwd_tflops\": {:.1}, \"fwd_ms\": {:.4}, \"fwd_ms_p10\": {:.4}, \"fwd_ms_p90\": {:.4}, \"host_us_per_call\": {:.1}, \"fwd_reps\": {}{}{}}}",
                r.backend.name(), r.backend.name(), r.d,
                if r.dv == r.d { String::new() } else { format!(", \"d_v\": {}", r.dv) },
                r.seqlen, r.seqlen, tokens / r.seqlen, hidden / r.d, hidden / r.d, r.causal,
                r.pass, r.err_ratio, r.tflops, r.ms, r.ms_p10, r.ms_p90, r.host_us, r.fwd_reps, variant,
                match (r.bwd_tflops, r.bwd_ms, r.bwd_reps) {
                    (Some(tf), Some(ms), Some(n)) => format!(", \"bwd_tflops\": {tf:.1}, \"bwd_ms\": {ms:.4}, \"bwd_reps\": {n}"),
                    _ => String::new(),
                } + &match (r.bwd_det_tflops, r.bwd_det_ms) {
                    (Some(tf), Some(ms)) => format!(", \"bwd_det_tflops\": {tf:.1}, \"bwd_det_ms\": {ms:.4}"),
                    _ => String::new(),
                },
            ));
            // The sustained rows: the cold row's shape fields and variant, then their own.
            for (kind, run, flops) in [
                ("fwd", &r.sustained_fwd, r.flops),
                ("bwd", &r.sustained_bwd, 2.5 * r.flops),
            ] {
                if let Some(run) = run {
                    json_rows.push(format!(
                        "  {{\"impl\": \"flashattn-{}\", \"backend\": \"{}\", \"dtype\": \"bf16\", \"d\": {}{}, \"seqlen_q\": {}, \"seqlen_k\": {}, \"batch\": {}, \"heads\": {}, \"heads_kv\": {}, \"causal\": {}{}, {}}}",
                        r.backend.name(), r.backend.name(), r.d,
                        if r.dv == r.d { String::new() } else { format!(", \"d_v\": {}", r.dv) },
                        r.seqlen, r.seqlen, tokens / r.seqlen, hidden / r.d, hidden / r.d, r.causal,
                        variant, run.json_fields(kind, flops),
                    ));
                }
            }
        }
        let extra = format!(", \"timing\": {{{}}}", protocol.json_fields())
            + &softcap.map_or(String::new(), |c| format!(", \"softcap\": {c}"))
            + if with_sinks { ", \"sinks\": true" } else { "" };
        common::write_results(&path, &common::describe(&info), &commit, &extra, &json_rows);
    }
    // exit() runs no destructor: end nvidia-smi first.
    drop(sampler);
    if rows.iter().any(|r| !r.pass) {
        std::process::exit(1);
    }
}
