//! What the FP8 quantize step alone costs attention: the FlashAttention-3 paper's inputs
//! (Q, K, V ~ N(0, 1) + N(0, 100)·Bernoulli(0.001), b1 s2048 h8), O computed exactly (f64) from
//! the dequantized e4m3 inputs, RMSE and relative L2 against the exact O, for one scale per
//! tensor, one per 128-row block, and per block after the random-sign Hadamard transform of Q
//! and K. The FP8 kernel adds P in e4m3 and f32 accumulation on top; its rows come from the GPU.
//!
//! Usage: fp8_accuracy [SEQLEN] (default 2048; the f64 reference takes a while on two cores)

use flashattn::fp8::{Fp8Tensor, Granularity, RandomSignHadamard};
use flashattn::reference::reference_forward;
use flashattn::{AttentionConfig, Operand, TensorRef};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, StandardNormal};

fn outlier_inputs(n: usize, rng: &mut StdRng) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let base: f32 = StandardNormal.sample(rng);
            let outlier: f32 = StandardNormal.sample(rng);
            if rng.random::<f64>() < 0.001 {
                base + 10.0 * outlier
            } else {
                base
            }
        })
        .collect()
}

fn tensor(x: &[f32], shape: [usize; 4]) -> TensorRef<'_, f32> {
    TensorRef::contiguous(x, shape)
}

fn main() {
    let seqlen: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(2048);
    let cfg = AttentionConfig::new();
    println!("| head dim | quantization | RMSE | relative L2 |\n|---|---|---|---|");
    for d in [128, 256] {
        let shape = [1, seqlen, 8, d];
        let n = shape.iter().product();
        let mut rng = StdRng::seed_from_u64(d as u64);
        let (q, k, v) = (
            outlier_inputs(n, &mut rng),
            outlier_inputs(n, &mut rng),
            outlier_inputs(n, &mut rng),
        );
        let attention = |q: &[f32], k: &[f32], v: &[f32]| {
            reference_forward(&cfg, tensor(q, shape), tensor(k, shape), tensor(v, shape)).out
        };
        let exact = attention(&q, &k, &v);
        let norm = exact.iter().map(|x| x * x).sum::<f64>().sqrt();
        let report = |name: &str, q: &[f32], k: &[f32], granularity| {
            let deq = |x: &[f32], op| {
                Fp8Tensor::quantize(tensor(x, shape), granularity, op)
                    .expect("valid tensor")
                    .dequantize()
            };
            let (dq, dk, dv) = (deq(q, Operand::Q), deq(k, Operand::K), deq(&v, Operand::V));
            let out = attention(&dq, &dk, &dv);
            let sq: f64 = out.iter().zip(&exact).map(|(a, b)| (a - b) * (a - b)).sum();
            println!(
                "| {d} | {name} | {:.2e} | {:.2e} |",
                (sq / n as f64).sqrt(),
                sq.sqrt() / norm
            );
        };
        report("e4m3, one scale per tensor", &q, &k, Granularity::PerTensor);
        let block = Granularity::PerBlock { rows: 128 };
        report("e4m3, one scale per 128-row block", &q, &k, block);
        let h = RandomSignHadamard::new(d, 1).expect("power of two");
        let hq = h
            .apply_tensor(tensor(&q, shape), Operand::Q)
            .expect("valid tensor");
        let hk = h
            .apply_tensor(tensor(&k, shape), Operand::K)
            .expect("valid tensor");
        report("e4m3, per block + Hadamard on Q, K", &hq, &hk, block);
    }
}
