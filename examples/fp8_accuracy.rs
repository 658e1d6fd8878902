//! The FlashAttention-3 paper's FP8 accuracy test on the GPU: Q, K, V ~ N(0, 1) +
//! N(0, 100)·Bernoulli(0.001) in bf16, b1 s2048 h8, head dim 128 and 256. RMSE and relative L2
//! of O against the f64 reference over those bf16 inputs, for the bf16 kernel and the FP8
//! kernel with one scale per tensor (quantized on the host, handed over with its descales), one
//! per block, and per block after the random-sign Hadamard transform of Q and K (the device's
//! quantize step).
//!
//! Usage: fp8_accuracy [--seqlen S] [--out results.json] [--commit SHA]

mod common;

use flashattn::cuda::{
    fp8_key_block, fp8_query_block, CudaSlice, DeviceTensor, DeviceTensorMut, Fp8Inputs, Fp8Options,
};
use flashattn::fp8::{Fp8Tensor, Granularity};
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

fn on_device<T>(x: &CudaSlice<T>, layout: Layout) -> DeviceTensor<'_, T> {
    DeviceTensor::new(x.as_view(), layout)
}

fn main() {
    let args = common::Args::parse();
    let seqlen: usize = args
        .value("--seqlen")
        .and_then(|s| s.parse().ok())
        .unwrap_or(2048);
    let dev = common::device("fp8_accuracy");
    let stream = dev.new_stream().unwrap();
    let cfg = AttentionConfig::new().backend(Backend::Sm90);
    let mut rows = Vec::new();
    let mut failed = false;
    println!("| head dim | kernel | RMSE | relative L2 |\n|---|---|---|---|");
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
        let norm = exact.iter().map(|x| x * x).sum::<f64>().sqrt();
        let (qd, kd, vd) = (
            stream.clone_htod(&q).unwrap(),
            stream.clone_htod(&k).unwrap(),
            stream.clone_htod(&v).unwrap(),
        );
        let t = |x| on_device(x, layout);
        let mut out = stream.clone_htod(&vec![bf16::NAN; n]).unwrap();
        let mut lse = stream.clone_htod(&vec![f32::NAN; 8 * seqlen]).unwrap();
        let mut report = |name: &str, out: &CudaSlice<bf16>| {
            let o: Vec<bf16> = stream.clone_dtoh(out).unwrap();
            stream.synchronize().unwrap();
            let sq: f64 = o
                .iter()
                .zip(&exact)
                .map(|(a, b)| (a.to_f64() - b) * (a.to_f64() - b))
                .sum();
            let rmse = (sq / n as f64).sqrt();
            failed |= !rmse.is_finite();
            println!("| {d} | {name} | {rmse:.2e} | {:.2e} |", sq.sqrt() / norm);
            rows.push(format!(
                "  {{\"d\": {d}, \"seqlen\": {seqlen}, \"batch\": 1, \"heads\": 8, \"kernel\": \"{name}\", \"rmse\": {rmse:.4e}, \"rel_l2\": {:.4e}}}",
                sq.sqrt() / norm
            ));
            rmse
        };

        dev.forward_into(
            &stream,
            &cfg,
            &t(&qd),
            &t(&kd),
            &t(&vd),
            &mut DeviceTensorMut::new(out.as_view_mut(), layout),
            &mut lse.as_view_mut(),
        )
        .expect("bf16 forward");
        report("bf16", &out);

        let mut fp8 = |inputs: &Fp8Inputs, out: &mut CudaSlice<bf16>| {
            stream.memcpy_htod(&vec![bf16::NAN; n], out).unwrap();
            dev.forward_fp8_into(
                &stream,
                &cfg,
                inputs,
                &mut DeviceTensorMut::new(out.as_view_mut(), layout),
                &mut lse.as_view_mut(),
            )
            .expect("fp8 forward");
        };
        // One scale per tensor: the host quantizer, its single descale repeated per block.
        let per_tensor = |x: &[bf16], op, block: usize| {
            let t =
                Fp8Tensor::quantize(TensorRef::new(x, layout), Granularity::PerTensor, op).unwrap();
            let descales = vec![t.scales[0]; 8 * seqlen.div_ceil(block)];
            (
                stream.clone_htod(&t.data).unwrap(),
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
        let tensor_rmse = report("e4m3, one scale per tensor", &out);

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
        report("e4m3, per block", &out);
        fp8(&quantize(Some(1)), &mut out);
        let hadamard_rmse = report("e4m3, per block + Hadamard on Q, K", &out);
        println!(
            "| {d} | per block + Hadamard / per tensor | {:.2}× | (bar ≤ 0.4×) |",
            hadamard_rmse / tensor_rmse
        );
    }
    if let Some(path) = args.value("--out") {
        let commit = args.commit();
        let test = ", \"test\": \"FA3 FP8 accuracy: N(0,1) + N(0,100)*Bernoulli(0.001), bf16 inputs, f64 reference\"";
        common::write_results(&path, dev.info(), &commit, test, &rows);
    }
    if failed {
        std::process::exit(1);
    }
}
