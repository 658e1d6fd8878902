//! Packed (varlen) batches on the device: forward and backward TFLOP/s over three length mixes of
//! about 32k tokens (all 2k; uniform 128..8k; log-normal with median 600 and one 16k sequence),
//! hidden 2048, d64 and d128, causal, bf16; and each mix of equal lengths as a dense call too (the
//! bound the packed one should stay within 3% of). `--long` adds two mixes with 16k sequences,
//! `--parts` the log-normal mix's 16k sequence and its short ones as mixes of their own;
//! `--sorted` orders each mix's sequences longest first; `--mix NAME` times one mix; `--no-sm80`
//! leaves out the forced sm80 rows; `--fp8` adds the FP8 forward's rows (inputs quantized once,
//! outside the timing; O in bf16). An equal-length mix's packed and dense calls alternate, call
//! by call, so that both meet the same clocks; `--dense-first` starts with the dense one;
//! `--rounds N` times everything N times, that order swapped from round to round.
//! CUDA events around each call, queued behind 5 warm-up calls, median of about 200 ms of calls
//! (20 to 100 of them; alternating ways share that time), as the peers are timed (`--warmup`,
//! `--min-reps`, `--max-reps`, `--target-ms` as theirs; `--quick`: 100 ms, which
//! benchmarks/varlen_peers.py has no flag for). Writes the mixes for
//! benchmarks/varlen_peers.py (`--mixes-out PATH`) so that the peers time the very same sequences.
//!
//! `cargo run --release --example bench_varlen -- --out varlen.json --mixes-out mixes.json`

mod common;

use std::sync::Arc;

use cudarc::driver::CudaSlice;
use flashattn::cuda::{
    CudaStream, Device, DeviceBackwardInputs, DeviceForwardInputs, DeviceGradientsMut,
    DeviceSeqlens, DeviceTensor, DeviceTensorMut, Fp8ForwardInputs, Fp8Options,
};
use flashattn::{AttentionConfig, Backend, Plan};
use half::bf16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, LogNormal, Normal};

const TOKENS: usize = 32768;
const HIDDEN: usize = 2048;
/// The cold timing of benchmarks/varlen_peers.py, the peers these rows are compared with.
const PROTOCOL: common::Protocol = common::Protocol {
    warmup: 5,
    min_reps: 20,
    max_reps: 100,
    target_ms: 200.0,
    cool_ms: 20.0,
};

/// The three mixes, each summing to TOKENS (the buffers' rows; other mixes take fewer).
fn mixes() -> Vec<(&'static str, Vec<usize>)> {
    let mut rng = StdRng::seed_from_u64(33);
    let fill = |draw: &mut dyn FnMut() -> usize, first: Vec<usize>| {
        let mut lens = first;
        while lens.iter().sum::<usize>() < TOKENS {
            let left = TOKENS - lens.iter().sum::<usize>();
            lens.push(draw().clamp(1, left));
        }
        lens
    };
    let uniform = fill(&mut || rng.random_range(128..=8192), vec![]);
    let log_normal = LogNormal::new(600f64.ln(), 1.0).unwrap();
    let mut rng2 = StdRng::seed_from_u64(34);
    let heavy = fill(
        &mut || (log_normal.sample(&mut rng2).round() as usize).min(16384),
        vec![16384],
    );
    vec![
        ("all-2k", vec![2048; TOKENS / 2048]),
        ("uniform-128-8k", uniform),
        ("lognormal-600-16k", heavy),
    ]
}

/// Causal forward FLOPs of the packed batch: each sequence's half of 4·s²·h·d.
fn causal_flops(lens: &[usize], heads: usize, d: usize) -> f64 {
    lens.iter()
        .map(|&s| 2.0 * (s * s) as f64 * (heads * d) as f64)
        .sum()
}

struct Buffers {
    q: CudaSlice<bf16>,
    k: CudaSlice<bf16>,
    v: CudaSlice<bf16>,
    dout: CudaSlice<bf16>,
    out: CudaSlice<bf16>,
    lse: CudaSlice<f32>,
    dq: CudaSlice<bf16>,
    dk: CudaSlice<bf16>,
    dv: CudaSlice<bf16>,
}

/// The first elements of `x` as a tensor of `layout` (as many as it spans).
fn view(x: &CudaSlice<bf16>, layout: flashattn::Layout) -> DeviceTensor<'_, bf16> {
    DeviceTensor::new(x.slice(..layout.shape.iter().product::<usize>()), layout)
}

/// Each way's median milliseconds under `protocol`, the ways' calls alternating.
fn median_ms(
    stream: &Arc<CudaStream>,
    protocol: &common::Protocol,
    ways: usize,
    call: impl FnMut(usize),
) -> Vec<f64> {
    let timed = protocol.times_ms(stream, ways, call);
    timed
        .ms
        .iter()
        .map(|ms| common::percentile(ms, 50.0))
        .collect()
}

/// The tensors' shape: packed `(1, Σ lens)` rows, or dense `(lens.len(), s)` when every length
/// is s.
fn tensor_shape(lens: &[usize], packed: bool, d: usize) -> [usize; 4] {
    if packed {
        [1, lens.iter().sum(), HIDDEN / d, d]
    } else {
        [lens.len(), lens[0], HIDDEN / d, d]
    }
}

/// The lengths' offsets on the device (for queries and keys alike), and the longest.
fn offsets(stream: &Arc<CudaStream>, lens: &[usize]) -> (CudaSlice<i32>, usize) {
    let mut cu = vec![0i32];
    for &l in lens {
        cu.push(cu.last().unwrap() + l as i32);
    }
    (
        stream.clone_htod(&cu).unwrap(),
        lens.iter().copied().max().unwrap(),
    )
}

/// The device, its stream and how calls are timed there.
struct Gpu<'a> {
    dev: &'a Device,
    stream: &'a Arc<CudaStream>,
    protocol: common::Protocol,
}

/// One way of calling the batch: packed with the offsets of `lens`, or dense `(lens.len(), s)`
/// when every length is s.
struct Way {
    packed: bool,
    shape: [usize; 4],
    cu: CudaSlice<i32>,
    max: usize,
}

impl Way {
    fn new(stream: &Arc<CudaStream>, lens: &[usize], packed: bool, d: usize) -> Self {
        let (cu, max) = offsets(stream, lens);
        Way {
            packed,
            shape: tensor_shape(lens, packed, d),
            cu,
            max,
        }
    }

    fn seqs(&self) -> DeviceSeqlens<'_> {
        DeviceSeqlens::new(self.cu.as_view(), self.cu.as_view(), self.max, self.max).unwrap()
    }

    fn layout(&self) -> flashattn::Layout {
        flashattn::Layout::contiguous(self.shape)
    }
}

/// Forward and backward medians of the batch for each of `ways` (packed or not, see [`Way`]),
/// their calls alternating.
fn time(
    Gpu {
        dev,
        stream,
        protocol,
    }: &Gpu,
    bufs: &mut Buffers,
    cfg: &AttentionConfig,
    lens: &[usize],
    ways: &[bool],
    d: usize,
) -> Vec<(Plan, f64, Plan, f64)> {
    let ways: Vec<Way> = ways.iter().map(|&p| Way::new(stream, lens, p, d)).collect();
    let seqs: Vec<_> = ways.iter().map(Way::seqs).collect();
    let mut fwd_plans = vec![None; ways.len()];
    let fwd = median_ms(stream, protocol, ways.len(), |w| {
        let (way, layout) = (&ways[w], ways[w].layout());
        let (q, k, v) = (
            view(&bufs.q, layout),
            view(&bufs.k, layout),
            view(&bufs.v, layout),
        );
        let mut out = DeviceTensorMut::contiguous(&mut bufs.out, way.shape);
        let mut lse = bufs.lse.as_view_mut();
        let inputs = DeviceForwardInputs::new(&q, &k, &v);
        let plan = if way.packed {
            dev.varlen_forward_into(stream, cfg, &seqs[w], inputs, &mut out, &mut lse)
        } else {
            dev.forward_into(stream, cfg, inputs, &mut out, &mut lse)
        };
        fwd_plans[w] = Some(plan.expect("forward"));
    });
    let mut bwd_plans = vec![None; ways.len()];
    let bwd = median_ms(stream, protocol, ways.len(), |w| {
        let (way, layout) = (&ways[w], ways[w].layout());
        let (q, k, v) = (
            view(&bufs.q, layout),
            view(&bufs.k, layout),
            view(&bufs.v, layout),
        );
        let (out, dout) = (view(&bufs.out, layout), view(&bufs.dout, layout));
        let lse = bufs.lse.as_view();
        let inputs = DeviceBackwardInputs {
            q: &q,
            k: &k,
            v: &v,
            out: &out,
            dout: &dout,
            lse: &lse,
            sinks: None,
        };
        let grads = DeviceGradientsMut {
            dq: &mut DeviceTensorMut::contiguous(&mut bufs.dq, way.shape),
            dk: &mut DeviceTensorMut::contiguous(&mut bufs.dk, way.shape),
            dv: &mut DeviceTensorMut::contiguous(&mut bufs.dv, way.shape),
            dsinks: None,
        };
        let plan = if way.packed {
            dev.varlen_backward_into(stream, cfg, &seqs[w], inputs, grads)
        } else {
            dev.backward_into(stream, cfg, inputs, grads)
        };
        bwd_plans[w] = Some(plan.expect("backward"));
    });
    (0..ways.len())
        .map(|w| {
            (
                fwd_plans[w].take().unwrap(),
                fwd[w],
                bwd_plans[w].take().unwrap(),
                bwd[w],
            )
        })
        .collect()
}

/// The FP8 forward's medians over the batch for each of `ways`, as in [`time`]; its inputs
/// quantized once beforehand.
fn time_fp8(
    Gpu {
        dev,
        stream,
        protocol,
    }: &Gpu,
    bufs: &mut Buffers,
    lens: &[usize],
    ways: &[bool],
    d: usize,
) -> Vec<(Plan, f64)> {
    let ways: Vec<Way> = ways.iter().map(|&p| Way::new(stream, lens, p, d)).collect();
    let seqs: Vec<_> = ways.iter().map(Way::seqs).collect();
    let options = Fp8Options::default();
    let inputs: Vec<_> = ways
        .iter()
        .zip(&seqs)
        .map(|(way, seqs)| {
            let layout = way.layout();
            let (q, k, v) = (
                view(&bufs.q, layout),
                view(&bufs.k, layout),
                view(&bufs.v, layout),
            );
            if way.packed {
                dev.varlen_quantize_fp8(stream, seqs, &q, &k, &v, options)
            } else {
                dev.quantize_fp8(stream, &q, &k, &v, options)
            }
            .expect("quantize")
        })
        .collect();
    let cfg = AttentionConfig::new().causal(true);
    let mut plans = vec![None; ways.len()];
    let ms = median_ms(stream, protocol, ways.len(), |w| {
        let mut out = DeviceTensorMut::contiguous(&mut bufs.out, ways[w].shape);
        let mut lse = bufs.lse.as_view_mut();
        let fp8 = Fp8ForwardInputs::new(&inputs[w]);
        let p = if ways[w].packed {
            dev.varlen_forward_fp8_into(stream, &cfg, &seqs[w], fp8, &mut out, &mut lse)
        } else {
            dev.forward_fp8_into(stream, &cfg, fp8, &mut out, &mut lse)
        };
        plans[w] = Some(p.expect("FP8 forward"));
    });
    plans
        .into_iter()
        .zip(ms)
        .map(|(p, ms)| (p.unwrap(), ms))
        .collect()
}

/// One round of rows: its place in the run (`round`, and whether an equal-length mix's dense call
/// goes before its packed one), and where the rows go.
struct Round<'a> {
    gpu: Gpu<'a>,
    bufs: &'a mut Buffers,
    args: &'a common::Args,
    round: usize,
    dense_first: bool,
    rows: &'a mut Vec<String>,
}

impl Round<'_> {
    /// Packed (true) and, for equal lengths, dense (false), in this round's order: the ways
    /// whose calls alternate.
    fn calls(&self, lens: &[usize]) -> Vec<bool> {
        match (lens.iter().all(|&l| l == lens[0]), self.dense_first) {
            (false, _) => vec![true],
            (true, false) => vec![true, false],
            (true, true) => vec![false, true],
        }
    }

    /// The 16-bit forward and backward of one mix at head dim `d`: Auto packed and dense
    /// (alternating), and (without `--no-sm80`, whose long runs change the clocks the next row
    /// starts at) the sm80 kernels packed after them.
    fn bf16_rows(&mut self, name: &str, lens: &[usize], d: usize) {
        let auto = AttentionConfig::new().causal(true);
        let ways = self.calls(lens);
        let timed = time(&self.gpu, self.bufs, &auto, lens, &ways, d);
        for (&packed, t) in ways.iter().zip(timed) {
            self.bf16_row(name, lens, d, packed, Backend::Auto, t);
        }
        if !self.args.flag("--no-sm80") {
            let cfg = auto.backend(Backend::Sm80);
            let t = time(&self.gpu, self.bufs, &cfg, lens, &[true], d).remove(0);
            self.bf16_row(name, lens, d, true, Backend::Sm80, t);
        }
    }

    fn bf16_row(
        &mut self,
        name: &str,
        lens: &[usize],
        d: usize,
        packed: bool,
        backend: Backend,
        (fp, fwd, bp, bwd): (Plan, f64, Plan, f64),
    ) {
        let (heads, round, ways) = (HIDDEN / d, self.round, self.calls(lens).len());
        let flops = causal_flops(lens, heads, d);
        let tf = |ms: f64, f: f64| f / (ms * 1e-3) / 1e12;
        let name_of = |p: &Plan| format!("flashattn-{}", p.backend.name());
        println!(
            "d{d} {name:<18} {:>6} {} fwd {:.3} ms {:.0} TFLOP/s ({}), bwd {:.3} ms {:.0} TFLOP/s ({})",
            if packed { "varlen" } else { "dense" },
            lens.len(),
            fwd,
            tf(fwd, flops),
            fp.explain(),
            bwd,
            tf(bwd, 2.5 * flops),
            bp.explain()
        );
        self.rows.push(format!(
            "{{\"impl\": \"{}\", \"bwd_impl\": \"{}\", \"varlen\": {packed}, \"round\": {round}, \"mix\": \"{name}\", \
             \"dtype\": \"bf16\", \"d\": {d}, \"heads\": {heads}, \"heads_kv\": {heads}, \
             \"batch\": {}, \"total_tokens\": {}, \"max_seqlen\": {}, \"causal\": true, \
             \"forced\": \"{}\", \"interleaved_ways\": {}, \"fwd_ms\": {fwd:.4}, \"fwd_tflops\": {:.1}, \
             \"bwd_ms\": {bwd:.4}, \"bwd_tflops\": {:.1}}}",
            name_of(&fp),
            name_of(&bp),
            lens.len(),
            lens.iter().sum::<usize>(),
            lens.iter().max().unwrap(),
            backend.name(),
            if backend == Backend::Auto { ways } else { 1 },
            tf(fwd, flops),
            tf(bwd, 2.5 * flops),
        ));
    }

    /// The FP8 forward of one mix at head dim `d`, packed and (equal lengths) dense, alternating.
    fn fp8_rows(&mut self, name: &str, lens: &[usize], d: usize) {
        let (heads, round) = (HIDDEN / d, self.round);
        let flops = causal_flops(lens, heads, d);
        let ways = self.calls(lens);
        let timed = time_fp8(&self.gpu, self.bufs, lens, &ways, d);
        for (&packed, (plan, fwd)) in ways.iter().zip(timed) {
            let tflops = flops / (fwd * 1e-3) / 1e12;
            println!(
                "d{d} {name:<18} {:>6} {} fp8 fwd {fwd:.3} ms {tflops:.0} TFLOP/s ({})",
                if packed { "varlen" } else { "dense" },
                lens.len(),
                plan.explain()
            );
            self.rows.push(format!(
                "{{\"impl\": \"flashattn-{}\", \"varlen\": {packed}, \"round\": {round}, \"mix\": \"{name}\", \
                 \"dtype\": \"e4m3\", \"out_dtype\": \"bf16\", \"d\": {d}, \"heads\": {heads}, \
                 \"heads_kv\": {heads}, \"batch\": {}, \"total_tokens\": {}, \
                 \"max_seqlen\": {}, \"causal\": true, \"interleaved_ways\": {}, \"fwd_ms\": {fwd:.4}, \
                 \"fwd_tflops\": {tflops:.1}}}",
                plan.backend.name(),
                lens.len(),
                lens.iter().sum::<usize>(),
                lens.iter().max().unwrap(),
                ways.len(),
            ));
        }
    }
}

fn main() {
    let args = common::Args::parse();
    let dev = common::device("bench_varlen");
    let stream = dev.new_stream().unwrap();
    let info = dev.info().clone();
    let mut mixes = mixes();
    // --long: where long sequences lose in a packed call — two of 16k (against the dense
    // (2, 16384) call), and one of 16k beside eight of 2k.
    if args.flag("--long") {
        mixes.push(("two-16k", vec![16384; 2]));
        let mut beside = vec![16384];
        beside.extend([2048; 8]);
        mixes.push(("16k-and-2k", beside));
    }
    // --parts: the log-normal mix's two parts alone — its 16k sequence, and the short ones
    // without it — to see which of them holds its rate down.
    if args.flag("--parts") {
        let heavy = mixes[2].1.clone();
        mixes.push(("lognormal-short", heavy[1..].to_vec()));
        mixes.push(("lognormal-16k", heavy[..1].to_vec()));
    }
    // --sorted: each mix's sequences longest first, the order a longest-first schedule would
    // take them in (against the drawn order, to see what the order costs).
    if args.flag("--sorted") {
        for (_, lens) in &mut mixes {
            lens.sort_unstable_by(|a, b| b.cmp(a));
        }
    }
    if let Some(path) = args.value("--mixes-out") {
        let list: Vec<String> = mixes
            .iter()
            .map(|(name, lens)| format!("{{\"name\": \"{name}\", \"lengths\": {lens:?}}}"))
            .collect();
        let json = format!(
            "{{\"mixes\": [{}], \"head_dims\": [64, 128], \"hidden\": {HIDDEN}, \"causal\": true}}\n",
            list.join(", ")
        );
        std::fs::write(&path, json).expect("write the mixes");
    }

    let n = TOKENS * HIDDEN;
    let mut rng = StdRng::seed_from_u64(7);
    let normal = Normal::new(0f32, 1.0).unwrap();
    let mut random = || -> CudaSlice<bf16> {
        let host: Vec<bf16> = (0..n)
            .map(|_| bf16::from_f32(normal.sample(&mut rng)))
            .collect();
        stream.clone_htod(&host).unwrap()
    };
    let nan = |len: usize| stream.clone_htod(&vec![bf16::NAN; len]).unwrap();
    let mut bufs = Buffers {
        q: random(),
        k: random(),
        v: random(),
        dout: random(),
        out: nan(n),
        lse: stream
            .clone_htod(&vec![f32::NAN; TOKENS * HIDDEN / 64])
            .unwrap(),
        dq: nan(n),
        dk: nan(n),
        dv: nan(n),
    };

    let protocol = common::Protocol::from_args(&args, PROTOCOL);
    let mut rows = vec![];
    let rounds: usize = args
        .value("--rounds")
        .map_or(1, |r| r.parse().expect("--rounds N"));
    // --mix NAME: that mix alone.
    let timed: Vec<_> = mixes
        .iter()
        .filter(|(name, _)| args.value("--mix").is_none_or(|m| m == *name))
        .collect();
    for round in 0..rounds {
        let dense_first = args.flag("--dense-first") != (round % 2 == 1);
        let mut bench = Round {
            gpu: Gpu {
                dev: &dev,
                stream: &stream,
                protocol,
            },
            bufs: &mut bufs,
            args: &args,
            round,
            dense_first,
            rows: &mut rows,
        };
        for d in [64, 128] {
            for (name, lens) in &timed {
                bench.bf16_rows(name, lens, d);
            }
        }
        // --fp8: the FP8 forward over the same mixes, packed and (equal lengths) dense.
        for d in [64, 128].into_iter().filter(|_| args.flag("--fp8")) {
            for (name, lens) in &timed {
                bench.fp8_rows(name, lens, d);
            }
        }
    }
    if let Some(path) = args.value("--out") {
        let extra = format!(", \"timing\": {{{}}}", protocol.json_fields());
        common::write_results(
            &path,
            &common::describe(&info),
            &args.commit(),
            &extra,
            &rows,
        );
    }
}
