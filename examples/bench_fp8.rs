//! The FP8 forward's speed on the headline shapes of docs/ARCHITECTURE.md (16k tokens, hidden 2048,
//! head dim 64/128/256, causal and not), beside the bf16 sm90 forward on the same shapes in the
//! same run, and the quantize step's time on its own (GB/s: bf16 Q, K, V read once, e4m3 and
//! descales written). The FP8 row times the kernel over inputs quantized once (per-block
//! descales, Hadamard on at the power-of-two head dims, off at d96 and d192, where it is not
//! defined), as a caller reusing K and V would run it. CUDA events, timed as
//! benchmarks/peers_fa3_fp8.py times cuDNN's FP8 (5 warm-up calls, median of about 250 ms of
//! calls, 20 to 100; `--quick` 100 ms; its timing flags alike). `--dims`
//! takes other head dims (96 and 192 with their features) and `--hidden` another hidden size
//! (heads = hidden / d), e.g. `--dims 96,192 --hidden 1536`.
//!
//! `--sustained N` also runs, after each headline shape's cold timings, N back-to-back calls of
//! its FP8 forward with no host synchronization among them (`--synced` or not), and reports the
//! mean per call over the last half, with the SM clock, power and temperature that nvidia-smi
//! sampled meanwhile (none where it is missing): one more row per shape (`"sustained": true,
//! "reps": N, "kind": "fwd"`), as benchmarks/peers_fa3_fp8.py writes its cudnn-fp8 sustained
//! rows; the `--long-keys` rows have no sustained run. Each later shape's cold timing then follows
//! the previous shape's sustained run: time cold rows in a run without the flag.
//!
//! Usage: bench_fp8 [--quick] [--only D,S[,causal]] [--seqlens S,S,...]
//!                  [--warmup N] [--min-reps N] [--max-reps N] [--target-ms MS]
//!                  [--dims D,D,...] [--hidden H]
//!                  [--pingpong|--no-pingpong]
//!                  [--no-split-tail|--split-tail]
//!                  [--long-keys] [--synced] [--sustained N] [--out results.json]
//!                  [--commit SHA]

mod common;

use std::sync::Arc;

use flashattn::cuda::{
    CudaSlice, CudaStream, DeviceForwardInputs, DeviceTensor, DeviceTensorMut, Fp8ForwardInputs,
    Fp8Options,
};
use flashattn::unstable::{PingPong, Sm90Schedule, TailSplit};
use flashattn::{AttentionConfig, Backend, DType, Layout, Problem};
use half::bf16;
use rand::rngs::StdRng;
use rand::SeedableRng;
use rand_distr::{Distribution, Normal};

const TOKENS: usize = 16384;
const HIDDEN: usize = 2048;

/// Where the Hadamard transform is defined (power-of-two head dims), on; else off.
fn options_for(d: usize) -> Fp8Options {
    Fp8Options {
        hadamard_seed: d.is_power_of_two().then_some(1),
    }
}

/// The cold timing of benchmarks/peers_fa3_fp8.py, whose cuDNN FP8 rows these are compared with.
const PROTOCOL: common::Protocol = common::Protocol {
    warmup: 5,
    min_reps: 20,
    max_reps: 100,
    target_ms: 250.0,
    cool_ms: 20.0,
};

/// Median milliseconds of `run` under `protocol`, and the calls timed. `synced`: each call waited
/// for before the next is made, timed on the host (what a caller that synchronizes every step
/// sees, host work and stream-ordered allocations included), as many calls as the protocol would
/// queue.
fn time(
    stream: &Arc<CudaStream>,
    protocol: &common::Protocol,
    synced: bool,
    mut run: impl FnMut(),
) -> (f64, usize) {
    if !synced {
        return protocol.median_ms(stream, run);
    }
    let mut synced_ms = |n: usize| {
        let mut ms: Vec<f64> = (0..n)
            .map(|_| {
                let start = std::time::Instant::now();
                run();
                stream.synchronize().unwrap();
                start.elapsed().as_secs_f64() * 1e3
            })
            .collect();
        ms.sort_by(|a, b| a.partial_cmp(b).unwrap());
        ms
    };
    synced_ms(protocol.warmup);
    let probe = synced_ms(3)[1];
    let reps = ((protocol.target_ms / probe.max(1e-3)) as usize)
        .clamp(protocol.min_reps, protocol.max_reps);
    (common::percentile(&synced_ms(reps), 50.0), reps)
}

fn main() {
    let args = common::Args::parse();
    let quick = args.flag("--quick");
    // --synced: each call waited for before the next, timed on the host.
    let synced = args.flag("--synced");
    // --pingpong / --no-pingpong: both forwards with ping-pong on / off (by default on in the
    // bf16 forward only).
    let schedule = Sm90Schedule {
        pingpong: match args.switch("--pingpong", "--no-pingpong") {
            Some(true) => PingPong::On,
            Some(false) => PingPong::Off,
            None => PingPong::Auto,
        },
        // --split-tail / --no-split-tail: the last partial wave split wherever it can be / run
        // whole (csrc/sm90/fwd_tail.h); by default where the cost model predicts a gain.
        split_tail: match args.switch("--split-tail", "--no-split-tail") {
            Some(true) => TailSplit::Always,
            Some(false) => TailSplit::Off,
            None => TailSplit::Auto,
        },
        ..Sm90Schedule::default()
    };
    // --only D,S[,causal]: that one shape (for profilers).
    let only = args
        .only(TOKENS, &["causal"])
        .map(|(d, s, words)| (d, s, !words.is_empty()));
    // --seqlens S,S,...: these sequence lengths in this order within each head dim and mask (the
    // outer loops), repeats allowed: whether a shape's time depends on what ran before it.
    let listed: Option<Vec<usize>> = args.value("--seqlens").map(|v| {
        v.split(',')
            .map(|x| match x.parse::<usize>() {
                Ok(s) if s > 0 && TOKENS % s == 0 => s,
                _ => {
                    eprintln!("--seqlens takes S,S,... with each S dividing {TOKENS}");
                    std::process::exit(2)
                }
            })
            .collect()
    });
    if only.is_some() && listed.is_some() {
        eprintln!("--only and --seqlens exclude each other");
        std::process::exit(2)
    }
    let only_seqlen = only.map(|(_, s, _)| vec![s]);
    let seqlens: &[usize] = if let Some(s) = only_seqlen.as_ref().or(listed.as_ref()) {
        s
    } else if quick {
        &[2048, 8192]
    } else {
        &[512, 1024, 2048, 4096, 8192, 16384]
    };
    let protocol = common::Protocol::from_args(&args, PROTOCOL);
    // --hidden H and --dims D,D,...: the hidden size (heads = H / D) and the head dims timed, in
    // this order; each D must divide H.
    let hidden = match args.value("--hidden").map(|v| v.parse::<usize>()) {
        Some(Ok(h)) if h > 0 => h,
        Some(_) => {
            eprintln!("--hidden takes a positive size");
            std::process::exit(2)
        }
        None => HIDDEN,
    };
    let dims: Vec<usize> = match args.value("--dims") {
        Some(v) => v
            .split(',')
            .map(|x| match x.parse::<usize>() {
                Ok(d) if d > 0 => d,
                _ => {
                    eprintln!("--dims takes D,D,... (head dims)");
                    std::process::exit(2)
                }
            })
            .collect(),
        None => vec![64, 128, 256],
    };
    if let Some(d) = dims.iter().find(|&&d| hidden % d != 0) {
        eprintln!("the hidden size {hidden} is not a multiple of head dim {d} (--hidden)");
        std::process::exit(2)
    }
    let sustained = args.sustained();
    let dev = common::device("bench_fp8");
    // Sampling from the start, so that each run's window finds samples already flowing.
    let sampler = sustained.and_then(|_| {
        let s = common::GpuSampler::start(0);
        if s.is_none() {
            eprintln!("note: nvidia-smi did not start; the sustained rows carry no clocks");
        }
        s
    });
    let stream = dev.new_stream().unwrap();
    let n = TOKENS * hidden;
    let mut rng = StdRng::seed_from_u64(11);
    let normal = Normal::new(0f32, 1.0).unwrap();
    let mut gen = || {
        let h: Vec<bf16> = (0..n)
            .map(|_| bf16::from_f32(normal.sample(&mut rng)))
            .collect();
        stream.clone_htod(&h).unwrap()
    };
    let (q, k, v) = (gen(), gen(), gen());
    let poison = vec![bf16::NAN; n];
    let mut out = stream.clone_htod(&poison).unwrap();
    let mut lse = stream
        .clone_htod(&vec![
            f32::NAN;
            TOKENS * hidden / dims.iter().min().unwrap()
        ])
        .unwrap();

    let mut rows = Vec::new();
    for &d in &dims {
        let options = options_for(d);
        for causal in [false, true] {
            for &s in seqlens {
                if only.is_some_and(|o| o != (d, s, causal)) {
                    continue;
                }
                let shape = [TOKENS / s, s, hidden / d, d];
                let layout = Layout::contiguous(shape);
                let t = |x| DeviceTensor::new(x, layout);
                let cfg = AttentionConfig::new()
                    .causal(causal)
                    .backend(Backend::Sm90)
                    .sm90_schedule(schedule);
                // The inputs of the last timed call are the ones the forward runs on.
                let mut fp8 = None;
                let (quant_ms, _) = time(&stream, &protocol, synced, || {
                    fp8 = Some(
                        dev.quantize_fp8(
                            &stream,
                            &t(q.as_view()),
                            &t(k.as_view()),
                            &t(v.as_view()),
                            options,
                        )
                        .expect("quantize"),
                    );
                });
                let fp8 = fp8.expect("quantized inputs");
                // One FP8 forward (the cold and the sustained timings').
                let fp8_forward = |out: &mut CudaSlice<bf16>, lse: &mut CudaSlice<f32>| {
                    dev.forward_fp8_into(
                        &stream,
                        &cfg,
                        Fp8ForwardInputs::new(&fp8),
                        &mut DeviceTensorMut::new(out.as_view_mut(), layout),
                        &mut lse.as_view_mut(),
                    )
                    .expect("fp8 forward");
                };
                stream.memcpy_htod(&poison, &mut out).unwrap(); // every output must be rewritten
                let (fp8_ms, fwd_reps) = time(&stream, &protocol, synced, || {
                    fp8_forward(&mut out, &mut lse)
                });
                let host_out = stream.clone_dtoh(&out).unwrap();
                stream.synchronize().unwrap();
                let unwritten = host_out.iter().filter(|x| !x.is_finite()).count();
                let (bf16_ms, _) = time(&stream, &protocol, synced, || {
                    dev.forward_into(
                        &stream,
                        &cfg,
                        DeviceForwardInputs::new(&t(q.as_view()), &t(k.as_view()), &t(v.as_view())),
                        &mut DeviceTensorMut::new(out.as_view_mut(), layout),
                        &mut lse.as_view_mut(),
                    )
                    .expect("bf16 forward");
                });
                let problem = Problem {
                    batch: shape[0],
                    seqlen_q: s,
                    seqlen_k: s,
                    heads_q: shape[2],
                    heads_kv: shape[2],
                    head_dim: d,
                    head_dim_v: d,
                    dtype: DType::E4M3,
                    packed: false,
                };
                let tflops = |ms: f64| problem.forward_flops(causal) / (ms * 1e-3) / 1e12;
                // Read bf16 Q, K, V once, write them in e4m3 (descales are negligible).
                let quant_gbs = (3 * n * 2 + 3 * n) as f64 / (quant_ms * 1e-3) / 1e9;
                println!(
                    "fp8 fwd{} d{d:<3} s{s:<5} causal={causal:<5} {fp8_ms:8.3} ms {:7.1} TFLOP/s | bf16 {bf16_ms:8.3} ms {:7.1} TFLOP/s | quantize {quant_ms:.3} ms {quant_gbs:6.0} GB/s | non-finite outputs {unwritten}",
                    if synced { " (synced)" } else { "" },
                    tflops(fp8_ms),
                    tflops(bf16_ms)
                );
                rows.push(format!(
                    "  {{\"impl\": \"flashattn-sm90-fp8\", \"backend\": \"sm90\", \"dtype\": \"e4m3\", \"d\": {d}, \"seqlen_q\": {s}, \"seqlen_k\": {s}, \"batch\": {}, \"heads\": {}, \"heads_kv\": {}, \"causal\": {causal}, \"pingpong_fp8\": {}, \"pingpong_bf16\": {}, \"split_tail\": \"{:?}\", \"synced\": {synced}, {}, \"hadamard\": {}, \"fwd_tflops\": {:.1}, \"fwd_ms\": {fp8_ms:.4}, \"fwd_reps\": {fwd_reps}, \"bf16_fwd_tflops\": {:.1}, \"bf16_fwd_ms\": {bf16_ms:.4}, \"quantize_ms\": {quant_ms:.4}, \"quantize_gbs\": {quant_gbs:.0}, \"non_finite_outputs\": {unwritten}}}",
                    shape[0],
                    shape[2],
                    shape[2],
                    schedule.pingpong.takes_turns(DType::E4M3),
                    schedule.pingpong.takes_turns(DType::BF16),
                    schedule.split_tail,
                    protocol.json_fields(),
                    options.hadamard_seed.is_some(),
                    tflops(fp8_ms),
                    tflops(bf16_ms)
                ));
                // After the shape's cold timings, so that the heat of hundreds of calls changes
                // none of this shape's (the next shape's follow it).
                if let Some(reps) = sustained {
                    let run = common::sustained_run(
                        &stream,
                        common::SUSTAINED_WARMUP,
                        reps,
                        sampler.as_ref(),
                        || fp8_forward(&mut out, &mut lse),
                    );
                    let flops = problem.forward_flops(causal);
                    println!(
                        "fp8 fwd sustained x{n} d{d:<3} s{s:<5} causal={causal:<5} {}",
                        run.text(flops)
                    );
                    rows.push(format!(
                        "  {{\"impl\": \"flashattn-sm90-fp8\", \"backend\": \"sm90\", \"dtype\": \"e4m3\", \"d\": {d}, \"seqlen_q\": {s}, \"seqlen_k\": {s}, \"batch\": {}, \"heads\": {}, \"heads_kv\": {}, \"causal\": {causal}, \"pingpong_fp8\": {}, \"split_tail\": \"{:?}\", \"hadamard\": {}, {}}}",
                        shape[0],
                        shape[2],
                        shape[2],
                        schedule.pingpong.takes_turns(DType::E4M3),
                        schedule.split_tail,
                        options.hadamard_seed.is_some(),
                        run.json_fields("fwd", flops)
                    ));
                }
                if unwritten != 0 {
                    eprintln!(
                        "FAIL: {unwritten} non-finite FP8 outputs at d{d} s{s} causal={causal}"
                    );
                }
            }
        }
    }
    // --long-keys: fewer query tiles than SMs over many keys (batch 1, 16k keys, the hidden size:
    // 512 queries, 128 causal ones (a chunk of a decode) and one (a decoded token)), where the
    // tail split deals each tile's key blocks out to the idle SMs (csrc/sm90/fwd_tail.h): FP8
    // and bf16, each with and without it, in one run. FLOPs: 4·d per visible (query, key) pair.
    let long_keys: &[(usize, bool)] = if args.flag("--long-keys") {
        &[(512, false), (128, true), (1, true)]
    } else {
        &[]
    };
    for &(sq, causal) in long_keys {
        let sk = 16384;
        for &d in &dims {
            let h = hidden / d;
            let options = options_for(d);
            let (lq, lk) = (
                Layout::contiguous([1, sq, h, d]),
                Layout::contiguous([1, sk, h, d]),
            );
            let (nq, nl) = (sq * h * d, sq * h);
            let fp8 = dev
                .quantize_fp8(
                    &stream,
                    &DeviceTensor::new(q.slice(0..nq), lq),
                    &DeviceTensor::new(k.as_view(), lk),
                    &DeviceTensor::new(v.as_view(), lk),
                    options,
                )
                .expect("quantize");
            // Each forward with the split as the model takes it and without; outputs poisoned
            // before each, every one must be rewritten.
            let (mut fp8_ms, mut bf16_ms) = ([0f64; 2], [0f64; 2]);
            let mut unwritten = 0;
            for (i, split) in [TailSplit::Auto, TailSplit::Off].into_iter().enumerate() {
                let cfg = AttentionConfig::new()
                    .causal(causal)
                    .backend(Backend::Sm90)
                    .sm90_schedule(Sm90Schedule {
                        split_tail: split,
                        ..schedule
                    });
                let mut non_finite = |out: &cudarc::driver::CudaSlice<bf16>| {
                    let host = stream.clone_dtoh(&out.slice(0..nq)).unwrap();
                    unwritten += host.iter().filter(|x| !x.is_finite()).count();
                };
                stream.memcpy_htod(&poison, &mut out).unwrap();
                fp8_ms[i] = time(&stream, &protocol, synced, || {
                    dev.forward_fp8_into(
                        &stream,
                        &cfg,
                        Fp8ForwardInputs::new(&fp8),
                        &mut DeviceTensorMut::new(out.slice_mut(0..nq), lq),
                        &mut lse.slice_mut(0..nl),
                    )
                    .expect("fp8 forward");
                })
                .0;
                non_finite(&out);
                stream.memcpy_htod(&poison, &mut out).unwrap();
                bf16_ms[i] = time(&stream, &protocol, synced, || {
                    dev.forward_into(
                        &stream,
                        &cfg,
                        DeviceForwardInputs::new(
                            &DeviceTensor::new(q.slice(0..nq), lq),
                            &DeviceTensor::new(k.as_view(), lk),
                            &DeviceTensor::new(v.as_view(), lk),
                        ),
                        &mut DeviceTensorMut::new(out.slice_mut(0..nq), lq),
                        &mut lse.slice_mut(0..nl),
                    )
                    .expect("bf16 forward");
                })
                .0;
                non_finite(&out);
            }
            let mask = AttentionConfig::new().causal(causal).key_rule(sq, sk);
            let pairs: usize = (0..sq)
                .map(|i| {
                    let (lo, hi) = mask.key_range(i);
                    hi - lo
                })
                .sum();
            let flops = 4.0 * (h * d * pairs) as f64;
            let tflops = |ms: f64| flops / (ms * 1e-3) / 1e12;
            // Each timing as printed and under its JSON key prefix.
            let timings = [
                ("split auto", "", fp8_ms[0]),
                ("off", "no_split_tail_", fp8_ms[1]),
                ("bf16 auto", "bf16_", bf16_ms[0]),
                ("off", "bf16_no_split_tail_", bf16_ms[1]),
            ];
            let text: Vec<String> = timings
                .iter()
                .map(|(label, _, ms)| format!("{label} {ms:8.3} ms {:7.1} TFLOP/s", tflops(*ms)))
                .collect();
            let fields: Vec<String> = timings
                .iter()
                .map(|(_, key, ms)| {
                    format!(
                        "\"{key}fwd_tflops\": {:.1}, \"{key}fwd_ms\": {ms:.4}",
                        tflops(*ms)
                    )
                })
                .collect();
            println!(
                "fp8 fwd long keys{} d{d:<3} q{sq} k{sk} causal={causal:<5} {} | non-finite outputs {unwritten}",
                if synced { " (synced)" } else { "" },
                text.join(" | ")
            );
            rows.push(format!(
                "  {{\"impl\": \"flashattn-sm90-fp8\", \"backend\": \"sm90\", \"dtype\": \"e4m3\", \"d\": {d}, \"seqlen_q\": {sq}, \"seqlen_k\": {sk}, \"batch\": 1, \"heads\": {h}, \"heads_kv\": {h}, \"causal\": {causal}, \"pingpong_fp8\": {}, \"pingpong_bf16\": {}, \"synced\": {synced}, {}, \"hadamard\": {}, {}, \"non_finite_outputs\": {unwritten}}}",
                schedule.pingpong.takes_turns(DType::E4M3),
                schedule.pingpong.takes_turns(DType::BF16),
                protocol.json_fields(),
                options.hadamard_seed.is_some(),
                fields.join(", ")
            ));
            if unwritten != 0 {
                eprintln!("FAIL: {unwritten} non-finite outputs at long keys d{d} causal={causal}");
            }
        }
    }
    if let Some(path) = args.value("--out") {
        let commit = args.commit();
        common::write_results(&path, &common::describe(dev.info()), &commit, "", &rows);
    }
}
