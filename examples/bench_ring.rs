//! Ring attention's time against one call: d128, causal, zig-zag shards, bf16, batch 1, 16
//! heads. `--ranks R` (default 2): the ring over R simulated ranks on one device
//! (`Device::ring_forward_into`, `ring_backward_into`) against the single call over the whole
//! sequence, the ring's cost on one GPU. With `--nccl` (feature `nccl`): one rank a device
//! over every device there is, a thread each (`ring_forward_nccl`, `ring_backward_nccl`),
//! against one device's single call over one rank's rows: the weak scaling of a sequence N
//! times as long over N devices (1.0: N times one device's causal FLOP rate at L rows, whose
//! diagonal share is larger, so above 1.0 can be). `--rows L` (default 16384): rows per rank.
//! Timed as bench_table (`common::Protocol`: CUDA events on each rank's compute stream around
//! each call, 3 warm-up calls, the median of about 200 ms of calls, 20 to 100; its flags). Over
//! NCCL each call includes its agreement (a host synchronization, and the wait for the slowest
//! rank), every rank makes the protocol's fewest calls, and the row is the slowest rank's
//! median. A rank that fails leaves the others waiting: bound the run with a timeout.
//!
//! `cargo run --release --example bench_ring -- --ranks 4 --out ring.json`

mod common;

use std::sync::Arc;

use cudarc::driver::CudaSlice;
use flashattn::cuda::{
    CudaStream, Device, DeviceBackwardInputs, DeviceForwardInputs, DeviceGradientsMut,
    DeviceRingGradients, DeviceRingOutput, DeviceTensor, DeviceTensorMut, RingStreams,
};
use flashattn::ring::Sharding;
use flashattn::AttentionConfig;
use half::bf16;

const HEADS: usize = 16;
const D: usize = 128;
/// Timed as the other benches (`common::Protocol`: its flags).
const PROTOCOL: common::Protocol = common::Protocol {
    warmup: 3,
    min_reps: 20,
    max_reps: 100,
    target_ms: 200.0,
    cool_ms: 20.0,
};

/// One rank's buffers: Q, K, V, O, dO, the gradients (rows × HEADS × D each) and the LSE.
struct Rank {
    x: [CudaSlice<bf16>; 8],
    lse: CudaSlice<f32>,
}

impl Rank {
    fn new(stream: &Arc<CudaStream>, rows: usize, seed: usize) -> Rank {
        let n = rows * HEADS * D;
        let values = |k: usize| -> Vec<bf16> {
            (0..n)
                .map(|i| bf16::from_f32(((i * 7 + seed * 131 + k * 17) as f32 * 0.013).sin()))
                .collect()
        };
        Rank {
            x: std::array::from_fn(|k| stream.clone_htod(&values(k)).unwrap()),
            lse: stream.alloc_zeros::<f32>(HEADS * rows).unwrap(),
        }
    }
}

fn view(x: &CudaSlice<bf16>, shape: [usize; 4]) -> DeviceTensor<'_, bf16> {
    DeviceTensor::contiguous(x, shape)
}

/// The median milliseconds of `call` on `stream` under `protocol`.
fn median_ms(stream: &Arc<CudaStream>, protocol: &common::Protocol, call: impl FnMut()) -> f64 {
    protocol.median_ms(stream, call).0
}

/// Forward and backward milliseconds of one call over `rows` rows (the whole sequence's).
fn single_call_ms(
    dev: &Device,
    cfg: &AttentionConfig,
    rows: usize,
    protocol: &common::Protocol,
) -> (f64, f64) {
    let stream = dev.new_stream().unwrap();
    let mut r = Rank::new(&stream, rows, 0);
    let shape = [1, rows, HEADS, D];
    let [q, k, v, o, g, dq, dk, dv] = &mut r.x;
    let (qt, kt, vt, gt) = (
        view(q, shape),
        view(k, shape),
        view(v, shape),
        view(g, shape),
    );
    let fwd = median_ms(&stream, protocol, || {
        dev.forward_into(
            &stream,
            cfg,
            DeviceForwardInputs::new(&qt, &kt, &vt),
            &mut DeviceTensorMut::contiguous(o, shape),
            &mut r.lse.as_view_mut(),
        )
        .unwrap();
    });
    let ot = view(o, shape);
    let lse = r.lse.as_view();
    let bwd = median_ms(&stream, protocol, || {
        dev.backward_into(
            &stream,
            cfg,
            DeviceBackwardInputs {
                q: &qt,
                k: &kt,
                v: &vt,
                out: &ot,
                dout: &gt,
                lse: &lse,
                sinks: None,
            },
            DeviceGradientsMut {
                dq: &mut DeviceTensorMut::contiguous(dq, shape),
                dk: &mut DeviceTensorMut::contiguous(dk, shape),
                dv: &mut DeviceTensorMut::contiguous(dv, shape),
                dsinks: None,
            },
        )
        .unwrap();
    });
    (fwd, bwd)
}

/// Forward and backward milliseconds of the ring over `ranks` simulated ranks of `rows` rows.
fn local_ring_ms(
    dev: &Device,
    cfg: &AttentionConfig,
    ranks: usize,
    rows: usize,
    protocol: &common::Protocol,
) -> (f64, f64) {
    let compute = dev.new_stream().unwrap();
    let transport = dev.new_stream().unwrap();
    let streams = RingStreams {
        compute: &compute,
        transport: &transport,
    };
    let shape = [1, rows, HEADS, D];
    let mut held: Vec<Rank> = (0..ranks).map(|r| Rank::new(&compute, rows, r)).collect();
    let fwd = {
        let (inputs, mut outputs): (Vec<_>, Vec<_>) = held
            .iter_mut()
            .map(|r| {
                let [q, k, v, o, ..] = &mut r.x;
                let t = |x| view(x, shape);
                (
                    [t(q), t(k), t(v)],
                    (DeviceTensorMut::contiguous(o, shape), r.lse.as_view_mut()),
                )
            })
            .unzip();
        let inputs: Vec<_> = inputs
            .iter()
            .map(|[q, k, v]| DeviceForwardInputs::new(q, k, v))
            .collect();
        let mut outs: Vec<_> = outputs
            .iter_mut()
            .map(|(out, lse)| DeviceRingOutput { out, lse })
            .collect();
        median_ms(&compute, protocol, || {
            dev.ring_forward_into(streams, cfg, Sharding::ZigZag, &inputs, &mut outs)
                .unwrap();
        })
    };
    let (inputs, mut grads): (Vec<_>, Vec<_>) = held
        .iter_mut()
        .map(|r| {
            let [q, k, v, o, g, dq, dk, dv] = &mut r.x;
            let t = |x| view(x, shape);
            let m = |x| DeviceTensorMut::contiguous(x, shape);
            (
                ([t(q), t(k), t(v), t(o), t(g)], r.lse.as_view()),
                [m(dq), m(dk), m(dv)],
            )
        })
        .unzip();
    let inputs: Vec<_> = inputs
        .iter()
        .map(|([q, k, v, out, dout], lse)| DeviceBackwardInputs {
            q,
            k,
            v,
            out,
            dout,
            lse,
            sinks: None,
        })
        .collect();
    let mut g: Vec<_> = grads
        .iter_mut()
        .map(|[dq, dk, dv]| DeviceRingGradients { dq, dk, dv })
        .collect();
    let bwd = median_ms(&compute, protocol, || {
        dev.ring_backward_into(streams, cfg, Sharding::ZigZag, &inputs, &mut g)
            .unwrap();
    });
    (fwd, bwd)
}

/// Forward and backward milliseconds of the ring over NCCL, one rank a device: each rank's
/// median, the slowest.
#[cfg(feature = "nccl")]
fn nccl_ring_ms(
    devs: &[Device],
    cfg: &AttentionConfig,
    rows: usize,
    protocol: &common::Protocol,
) -> (f64, f64) {
    // Every rank makes as many calls (a rank that made fewer would leave the others waiting):
    // the protocol's count with no time target, its fewest runs.
    let protocol = &common::Protocol {
        target_ms: 0.0,
        ..*protocol
    };
    use flashattn::cuda::RingComm;
    let comms = RingComm::for_devices(devs).unwrap();
    let shape = [1, rows, HEADS, D];
    let times: Vec<(f64, f64)> = std::thread::scope(|s| {
        let handles: Vec<_> = devs
            .iter()
            .zip(comms)
            .enumerate()
            .map(|(i, (dev, comm))| {
                s.spawn(move || {
                    let compute = dev.new_stream().unwrap();
                    let transport = dev.new_stream().unwrap();
                    let streams = RingStreams {
                        compute: &compute,
                        transport: &transport,
                    };
                    let mut r = Rank::new(&compute, rows, i);
                    let [q, k, v, o, g, dq, dk, dv] = &mut r.x;
                    let t = |x| view(x, shape);
                    let (qt, kt, vt, gt) = (t(q), t(k), t(v), t(g));
                    let fwd = median_ms(&compute, protocol, || {
                        dev.ring_forward_nccl(
                            &comm,
                            streams,
                            cfg,
                            Sharding::ZigZag,
                            DeviceForwardInputs::new(&qt, &kt, &vt),
                            &mut DeviceRingOutput {
                                out: &mut DeviceTensorMut::contiguous(o, shape),
                                lse: &mut r.lse.as_view_mut(),
                            },
                        )
                        .unwrap();
                    });
                    let ot = t(o);
                    let lse = r.lse.as_view();
                    let bwd = median_ms(&compute, protocol, || {
                        dev.ring_backward_nccl(
                            &comm,
                            streams,
                            cfg,
                            Sharding::ZigZag,
                            DeviceBackwardInputs {
                                q: &qt,
                                k: &kt,
                                v: &vt,
                                out: &ot,
                                dout: &gt,
                                lse: &lse,
                                sinks: None,
                            },
                            &mut DeviceRingGradients {
                                dq: &mut DeviceTensorMut::contiguous(dq, shape),
                                dk: &mut DeviceTensorMut::contiguous(dk, shape),
                                dv: &mut DeviceTensorMut::contiguous(dv, shape),
                            },
                        )
                        .unwrap();
                    });
                    (fwd, bwd)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    times
        .into_iter()
        .fold((0.0, 0.0), |(f, b), (tf, tb)| (f.max(tf), b.max(tb)))
}

fn main() {
    let args = common::Args::parse();
    let dev = common::device("bench_ring");
    let num = |name: &str, default: usize| {
        args.value(name)
            .map(|v| v.parse::<usize>().expect("a number"))
            .unwrap_or(default)
    };
    let rows = num("--rows", 16384);
    let protocol = &common::Protocol::from_args(&args, PROTOCOL);
    let cfg = AttentionConfig::new().causal(true);
    // Causal forward FLOPs over `n` rows; the backward 2.5 times them.
    let flops = |n: usize| 2.0 * (n * n) as f64 * (HEADS * D) as f64;
    let tflops = |n: usize, ms: f64, factor: f64| factor * flops(n) / (ms * 1e9);
    let mut rows_json = vec![];
    if args.flag("--nccl") {
        #[cfg(feature = "nccl")]
        {
            let count = flashattn::cuda::device_count().unwrap();
            let devs: Vec<Device> = (0..count).map(|i| Device::new(i).unwrap()).collect();
            let (one_fwd, one_bwd) = single_call_ms(&dev, &cfg, rows, protocol);
            let (fwd, bwd) = nccl_ring_ms(&devs, &cfg, rows, protocol);
            let total = rows * count;
            let scaling = |ring_ms: f64, one_ms: f64| {
                (flops(total) / ring_ms) / (count as f64 * flops(rows) / one_ms)
            };
            println!(
                "NCCL ring of {count} devices, {rows} rows each: fwd {fwd:.3} ms ({:.0} TFLOP/s, \
                 scaling {:.3}), bwd {bwd:.3} ms ({:.0} TFLOP/s, scaling {:.3}); one device over \
                 {rows} rows: fwd {one_fwd:.3} ms, bwd {one_bwd:.3} ms",
                tflops(total, fwd, 1.0),
                scaling(fwd, one_fwd),
                tflops(total, bwd, 2.5),
                scaling(bwd, one_bwd)
            );
            rows_json.push(format!(
                "{{\"kind\": \"ring\", \"impl\": \"ours\", \"transport\": \"nccl\", \"ranks\": \
                 {count}, \"rows_per_rank\": {rows}, \"heads\": {HEADS}, \"d\": {D}, \"causal\": \
                 true, \"fwd_ms\": {fwd:.4}, \"bwd_ms\": {bwd:.4}, \"one_device_fwd_ms\": \
                 {one_fwd:.4}, \"one_device_bwd_ms\": {one_bwd:.4}, \"fwd_scaling\": {:.4}, \
                 \"bwd_scaling\": {:.4}}}",
                scaling(fwd, one_fwd),
                scaling(bwd, one_bwd)
            ));
        }
        #[cfg(not(feature = "nccl"))]
        {
            eprintln!("--nccl needs the `nccl` feature");
            std::process::exit(2)
        }
    } else {
        let ranks = num("--ranks", 2);
        let total = rows * ranks;
        let (one_fwd, one_bwd) = single_call_ms(&dev, &cfg, total, protocol);
        let (fwd, bwd) = local_ring_ms(&dev, &cfg, ranks, rows, protocol);
        println!(
            "ring of {ranks} simulated ranks, {rows} rows each, one device: fwd {fwd:.3} ms \
             ({:.0} TFLOP/s, {:.3} of the single call's {one_fwd:.3} ms), bwd {bwd:.3} ms ({:.0} \
             TFLOP/s, {:.3} of {one_bwd:.3} ms)",
            tflops(total, fwd, 1.0),
            one_fwd / fwd,
            tflops(total, bwd, 2.5),
            one_bwd / bwd
        );
        rows_json.push(format!(
            "{{\"kind\": \"ring\", \"impl\": \"ours\", \"transport\": \"local\", \"ranks\": \
             {ranks}, \"rows_per_rank\": {rows}, \"heads\": {HEADS}, \"d\": {D}, \"causal\": true, \
             \"fwd_ms\": {fwd:.4}, \"bwd_ms\": {bwd:.4}, \"single_call_fwd_ms\": {one_fwd:.4}, \
             \"single_call_bwd_ms\": {one_bwd:.4}}}"
        ));
    }
    if let Some(path) = args.value("--out") {
        let device = common::describe(dev.info());
        let timing = format!(", \"timing\": {{{}}}", protocol.json_fields());
        common::write_results(&path, &device, &args.commit(), &timing, &rows_json);
    }
}
