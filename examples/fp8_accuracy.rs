//! The FlashAttention-3 paper's FP8 accuracy test on the GPU: Q, K, V ~ N(0, 1) +
//! N(0, 100)·Bernoulli(0.001) in bf16, b1 s2048 h8, head dim 128 and 256. RMSE and relative L2
//! of O against the f64 reference over those bf16 inputs, for the bf16 kernel and the FP8
//! kernel with one scale per tensor (quantized on the host, handed over with its descales), one
//! per block, and per block after the random-sign Hadamard transform of Q and K (the device's
//! quantize step).
//!
//! With `--floor` it runs on the CPU alone: the f64 reference over the same inputs after each
//! quantizer's round trip (every other step exact), i.e. the error an exact kernel over those e4m3
//! values would have, and which operand's rounding it comes from.
//!
//! Usage: fp8_accuracy [--seqlen S] [--floor] [--out results.json] [--commit SHA]

mod common;

use flashattn::cuda::{
    fp8_key_block, fp8_query_block, CudaSlice, DeviceForwardInputs, DeviceTensor, DeviceTensorMut,
    Fp8ForwardInputs, Fp8Inputs, Fp8Options,
};
use flashattn::fp8::{Fp8Tensor, Granularity, RandomSignHadamard};
use flashattn::reference::reference_forward;
use flashattn::{AttentionConfig, Backend, Layout, Operand, TensorRef};
use half::bf16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, StandardNormal};

fn outlier_inputs(n: usize, rng: &mut StdRng) -> Vec<bf16> {
    (0..n)
        .map(|_| {
            let base: f32 = StandardNormal.sample(rng);
            let outlier: f32 = StandardNormal.sample(rng);
            bf16::from_f32(if rng.random::<f64>() < 0.001 {
                base + 10.0 * outlier
            } else {
                base
            })
        })
        .collect()
}

/// The table printed and the results rows kept; `failed` on a non-finite RMSE.
#[derive(Default)]
struct Report {
    rows: Vec<String>,
    failed: bool,
}

impl Report {
    /// RMSE and relative L2 of `got` against `exact` at head dim `d` and `seqlen`, as a table
    /// line and a results row naming `name` under `key` ("kernel", "reference_over"); the RMSE.
    fn record(
        &mut self,
        (d, seqlen): (usize, usize),
        key: &str,
        name: &str,
        got: impl Iterator<Item = f64>,
        exact: &[f64],
    ) -> f64 {
        let sq: f64 = got.zip(exact).map(|(a, b)| (a - b) * (a - b)).sum();
        let norm = exact.iter().map(|x| x * x).sum::<f64>().sqrt();
        let rmse = (sq / exact.len() as f64).sqrt();
        let rel = sq.sqrt() / norm;
        self.failed |= !rmse.is_finite();
        println!("| {d} | {name} | {rmse:.2e} | {rel:.2e} |");
        self.rows.push(format!(
            "  {{\"d\": {d}, \"seqlen\": {seqlen}, \"batch\": 1, \"heads\": 8, \"{key}\": \"{}\", \"rmse\": {rmse:.4e}, \"rel_l2\": {rel:.4e}}}",
            name.trim()
        ));
        rmse
    }
}

/// `x` after quantizing and dequantizing, contiguous f32.
fn round_trip(x: &[f32], layout: Layout, granularity: Granularity, op: Operand) -> Vec<f32> {
    Fp8Tensor::quantize(TensorRef::new(x, layout), granularity, op)
        .unwrap()
        .dequantize()
}

/// `--floor`: RMSE and relative L2 against `exact` of the f64 reference over Q, K, V after the
/// quantizers' round trips. The transform is the device step's (seed 1); Q·Kᵀ is unchanged by
/// it, and where V is transformed too the output is transformed back.
fn error_floors(
    d: usize,
    seqlen: usize,
    (q, k, v): (&[bf16], &[bf16], &[bf16]),
    exact: &[f64],
    report: &mut Report,
) {
    let layout = Layout::contiguous([1, seqlen, 8, d]);
    let f32s = |x: &[bf16]| x.iter().map(|x| x.to_f32()).collect::<Vec<f32>>();
    let (q, k, v) = (f32s(q), f32s(k), f32s(v));
    let per_tensor = |x: &[f32], op| round_trip(x, layout, Granularity::PerTensor, op);
    let key_rows = Granularity::PerBlock {
        rows: fp8_key_block(d).expect("an FP8 kernel at this head dim"),
    };
    let query_rows = Granularity::PerBlock {
        rows: fp8_query_block(),
    };
    let hadamard = RandomSignHadamard::new(d, 1).unwrap();
    let rotate = |x: &[f32], op| {
        hadamard
            .apply_tensor(TensorRef::new(x, layout), op)
            .unwrap()
    };
    let (qh, kh, vh) = (
        rotate(&q, Operand::Q),
        rotate(&k, Operand::K),
        rotate(&v, Operand::V),
    );
    let (qb, kb) = (
        round_trip(&qh, layout, query_rows, Operand::Q),
        round_trip(&kh, layout, key_rows, Operand::K),
    );
    let vb = round_trip(&v, layout, key_rows, Operand::V);
    let mut floor = |name: &str, q: &[f32], k: &[f32], v: &[f32], rotated_v: bool| {
        let t = |x| TensorRef::new(x, layout);
        let mut out = reference_forward(&AttentionConfig::new(), t(q), t(k), t(v)).out;
        if rotated_v {
            for row in out.chunks_mut(d) {
                let mut r: Vec<f32> = row.iter().map(|&x| x as f32).collect();
                hadamard.invert(&mut r).unwrap();
                row.iter_mut().zip(&r).for_each(|(o, &x)| *o = x as f64);
            }
        }
        report.record((d, seqlen), "reference_over", name, out.into_iter(), exact);
    };
    floor(
        "per tensor",
        &per_tensor(&q, Operand::Q),
        &per_tensor(&k, Operand::K),
        &per_tensor(&v, Operand::V),
        false,
    );
    floor("per block + Hadamard on Q, K", &qb, &kb, &vb, false);
    floor("  only Q, K rounded", &qb, &kb, &v, false);
    floor("  only V rounded", &qh, &kh, &vb, false);
    let vhb = round_trip(&vh, layout, key_rows, Operand::V);
    floor("per block + Hadamard on Q, K and V", &qb, &kb, &vhb, true);
}

fn on_device<T>(x: &CudaSlice<T>, layout: Layout) -> DeviceTensor<'_, T> {
    DeviceTensor::new(x.as_view(), layout)
}

fn main() {
    let args = common::Args::parse();
    let seqlen: usize = args
        .value("--seqlen")
        .and_then(|s| s.parse().ok())
        .unwrap_or(2048);
    let floor = args.flag("--floor");
    let dev = (!floor).then(|| common::device("fp8_accuracy"));
    let mut report = Report::default();
    let what = if floor {
        "f64 reference over"
    } else {
        "kernel"
    };
    println!("| head dim | {what} | RMSE | relative L2 |\n|---|---|---|---|");
    for d in [128, 256] {
        let shape = [1, seqlen, 8, d];
        let layout = Layout::contiguous(shape);
        let n: usize = shape.iter().product();
        let mut rng = StdRng::seed_from_u64(d as u64);
        let (q, k, v) = (
            outlier_inputs(n, &mut rng),
            outlier_inputs(n, &mut rng),
            outlier_inputs(n, &mut rng),
        );
        let exact = reference_forward(
            &AttentionConfig::new(),
            TensorRef::new(&q, layout),
            TensorRef::new(&k, layout),
            TensorRef::new(&v, layout),
        )
        .out;
        let Some(dev) = &dev else {
            error_floors(d, seqlen, (&q, &k, &v), &exact, &mut report);
            continue;
        };
        let stream = dev.new_stream().unwrap();
        let cfg = AttentionConfig::new().backend(Backend::Sm90);
        let (qd, kd, vd) = (
            stream.clone_htod(&q).unwrap(),
            stream.clone_htod(&k).unwrap(),
            stream.clone_htod(&v).unwrap(),
        );
        let t = |x| on_device(x, layout);
        let mut out = stream.clone_htod(&vec![bf16::NAN; n]).unwrap();
        let mut lse = stream.clone_htod(&vec![f32::NAN; 8 * seqlen]).unwrap();
        let mut kernel = |name: &str, out: &CudaSlice<bf16>| {
            let o: Vec<bf16> = stream.clone_dtoh(out).unwrap();
            stream.synchronize().unwrap();
            let got = o.iter().map(|x| x.to_f64());
            report.record((d, seqlen), "kernel", name, got, &exact)
        };

        dev.forward_into(
            &stream,
            &cfg,
            DeviceForwardInputs::new(&t(&qd), &t(&kd), &t(&vd)),
            &mut DeviceTensorMut::new(out.as_view_mut(), layout),
            &mut lse.as_view_mut(),
        )
        .expect("bf16 forward");
        kernel("bf16", &out);

        let mut fp8 = |inputs: &Fp8Inputs, out: &mut CudaSlice<bf16>| {
            stream.memcpy_htod(&vec![bf16::NAN; n], out).unwrap();
            dev.forward_fp8_into(
                &stream,
                &cfg,
                Fp8ForwardInputs::new(inputs),
                &mut DeviceTensorMut::new(out.as_view_mut(), layout),
                &mut lse.as_view_mut(),
            )
            .expect("fp8 forward");
        };
        // One scale per tensor: the host quantizer, its single descale repeated per block.
        let per_tensor = |x: &[bf16], op, block: usize| {
            let t =
                Fp8Tensor::quantize(TensorRef::new(x, layout), Granularity::PerTensor, op).unwrap();
            let descales = vec![t.scales()[0]; 8 * seqlen.div_ceil(block)];
            (
                stream.clone_htod(t.data()).unwrap(),
                stream.clone_htod(&descales).unwrap(),
            )
        };
        let key_block = fp8_key_block(d).expect("an FP8 kernel at this head dim");
        let (q8, qs) = per_tensor(&q, Operand::Q, fp8_query_block());
        let (k8, ks) = per_tensor(&k, Operand::K, key_block);
        let (v8, vs) = per_tensor(&v, Operand::V, key_block);
        let t8 = |x| on_device(x, layout);
        let inputs = dev
            .fp8_inputs_from_e4m3(
                &stream,
                &t8(&q8),
                &t8(&k8),
                &t8(&v8),
                &qs.as_view(),
                &ks.as_view(),
                &vs.as_view(),
            )
            .expect("per-tensor inputs");
        fp8(&inputs, &mut out);
        let tensor_rmse = kernel("e4m3, one scale per tensor", &out);

        let quantize = |seed| {
            dev.quantize_fp8(
                &stream,
                &t(&qd),
                &t(&kd),
                &t(&vd),
                Fp8Options {
                    hadamard_seed: seed,
                },
            )
            .expect("quantize")
        };
        fp8(&quantize(None), &mut out);
        kernel("e4m3, per block", &out);
        fp8(&quantize(Some(1)), &mut out);
        let hadamard_rmse = kernel("e4m3, per block + Hadamard on Q, K", &out);
        println!(
            "| {d} | per block + Hadamard / per tensor | {:.2}× | (bar ≤ 0.4×) |",
            hadamard_rmse / tensor_rmse
        );
    }
    if let Some(path) = args.value("--out") {
        let commit = args.commit();
        let test = ", \"test\": \"FA3 FP8 accuracy: N(0,1) + N(0,100)*Bernoulli(0.001), bf16 inputs, f64 reference\"";
        let device = match &dev {
            Some(dev) => common::describe(dev.info()),
            None => "CPU: the f64 reference over the quantizers' round trips".to_string(),
        };
        common::write_results(&path, &device, &commit, test, &report.rows);
    }
    if report.failed {
        std::process::exit(1);
    }
}
