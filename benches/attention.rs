//! Throughput per shape. `Throughput::Elements(flops)` makes criterion's "elem/s" read as
//! FLOP/s (docs/ARCHITECTURE.md: forward FLOPs = 4·b·s_q·s_k·h·d).
//!
//! Group `cpu`: the CPU backend's forward against a naive three-pass attention (the full score
//! rows S = Q·Kᵀ, a softmax over them, then P·V, all f32), parallelized with rayon over the
//! same (batch, head, query block) tasks, so that the difference is the algorithm.
//!
//! GPU groups (behind `cfg(feature = "cuda")`) go beside `cpu` in `criterion_group!` below.

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use flashattn::{AttentionConfig, Element, ForwardInputs, Problem, TensorMut, TensorRef};
use half::bf16;
use rayon::prelude::*;

/// Query rows per naive task (the CPU backend's block size).
const NAIVE_ROWS: usize = 64;

/// Naive three-pass attention over packed (b, s, h, d) f32 tensors, no mask.
fn naive_forward(q: &[f32], k: &[f32], v: &[f32], out: &mut [f32], shape: [usize; 4]) {
    let [b, s, h, d] = shape;
    let scale = 1.0 / (d as f32).sqrt();
    let at = |i: usize, bb: usize, hh: usize| ((bb * s + i) * h + hh) * d;
    let nqb = s.div_ceil(NAIVE_ROWS);
    let blocks: Vec<Vec<f32>> = (0..b * h * nqb)
        .into_par_iter()
        .map(|t| {
            let (bb, hh, i0) = (t / (h * nqb), t / nqb % h, t % nqb * NAIVE_ROWS);
            let rows = NAIVE_ROWS.min(s - i0);
            // Pass 1: the full score rows.
            let mut p = vec![0f32; rows * s];
            for r in 0..rows {
                let qi = &q[at(i0 + r, bb, hh)..][..d];
                for j in 0..s {
                    let kj = &k[at(j, bb, hh)..][..d];
                    p[r * s + j] = qi.iter().zip(kj).map(|(x, y)| x * y).sum::<f32>() * scale;
                }
            }
            // Pass 2: softmax.
            for row in p.chunks_exact_mut(s) {
                let m = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                row.iter_mut().for_each(|x| *x = (*x - m).exp());
                let l: f32 = row.iter().sum();
                row.iter_mut().for_each(|x| *x /= l);
            }
            // Pass 3: O = P·V.
            let mut o = vec![0f32; rows * d];
            for r in 0..rows {
                let orow = &mut o[r * d..(r + 1) * d];
                for j in 0..s {
                    let pj = p[r * s + j];
                    for (x, y) in orow.iter_mut().zip(&v[at(j, bb, hh)..][..d]) {
                        *x += pj * y;
                    }
                }
            }
            o
        })
        .collect();
    for (t, o) in blocks.iter().enumerate() {
        let (bb, hh, i0) = (t / (h * nqb), t / nqb % h, t % nqb * NAIVE_ROWS);
        for (r, row) in o.chunks_exact(d).enumerate() {
            out[at(i0 + r, bb, hh)..][..d].copy_from_slice(row);
        }
    }
}

/// Inputs and outputs of one forward shape in element type `T`.
struct Fwd<T> {
    shape: [usize; 4],
    q: Vec<T>,
    k: Vec<T>,
    v: Vec<T>,
    out: Vec<T>,
    lse: Vec<f32>,
}

impl<T: Element> Fwd<T> {
    fn new(shape: [usize; 4]) -> Self {
        let n: usize = shape.iter().product();
        let gen = |seed: f32| -> Vec<T> {
            (0..n)
                .map(|i| T::from_f32((i as f32 * seed).sin()))
                .collect()
        };
        Fwd {
            shape,
            q: gen(0.37),
            k: gen(0.71),
            v: gen(0.13),
            out: vec![T::default(); n],
            lse: vec![0.0; shape[0] * shape[2] * shape[1]],
        }
    }

    fn flash(&mut self, cfg: &AttentionConfig) {
        let s = self.shape;
        flashattn::forward_into(
            cfg,
            ForwardInputs::new(
                TensorRef::contiguous(&self.q, s),
                TensorRef::contiguous(&self.k, s),
                TensorRef::contiguous(&self.v, s),
            ),
            TensorMut::contiguous(&mut self.out, s),
            &mut self.lse,
        )
        .expect("valid problem");
    }
}

/// Median seconds of `runs` calls of `f` after two warm-up calls.
fn median_secs(runs: usize, mut f: impl FnMut()) -> f64 {
    f();
    f();
    let mut t: Vec<f64> = (0..runs)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[runs / 2]
}

fn cpu(c: &mut Criterion) {
    let shape = [1, 2048, 8, 128];
    let [b, s, h, d] = shape;
    let problem = Problem {
        batch: b,
        seqlen_q: s,
        seqlen_k: s,
        heads_q: h,
        heads_kv: h,
        head_dim: d,
        head_dim_v: d,
        dtype: flashattn::DType::F32,
        packed: false,
    };
    let flops = problem.forward_flops(false);
    let cfg = AttentionConfig::new();
    let mut f32s = Fwd::<f32>::new(shape);
    let mut bf16s = Fwd::<bf16>::new(shape);
    let mut naive_out = vec![0f32; f32s.out.len()];

    // Our own numbers (criterion's Gelem/s below are the same quantity).
    let name = format!("fwd b{b} h{h} s{s} d{d}");
    let gflops = |secs: f64| flops / secs / 1e9;
    let flash_f32 = median_secs(7, || f32s.flash(&cfg));
    let flash_bf16 = median_secs(7, || bf16s.flash(&cfg));
    let naive = median_secs(3, || {
        naive_forward(&f32s.q, &f32s.k, &f32s.v, &mut naive_out, shape)
    });
    println!(
        "cpu {name} ({} threads): flash f32 {:.1} GFLOP/s, flash bf16 {:.1} GFLOP/s, \
         naive three-pass f32 {:.1} GFLOP/s; flash f32 is {:.1}x naive",
        rayon::current_num_threads(),
        gflops(flash_f32),
        gflops(flash_bf16),
        gflops(naive),
        naive / flash_f32
    );
    let max_diff = naive_out
        .iter()
        .zip(&f32s.out)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(max_diff < 1e-4, "naive and flash disagree by {max_diff}");

    let mut group = c.benchmark_group("cpu");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(4))
        .throughput(Throughput::Elements(flops as u64));
    group.bench_function(BenchmarkId::new("flash_f32", &name), |bch| {
        bch.iter(|| f32s.flash(&cfg))
    });
    group.bench_function(BenchmarkId::new("flash_bf16", &name), |bch| {
        bch.iter(|| bf16s.flash(&cfg))
    });
    group.bench_function(BenchmarkId::new("naive_f32", &name), |bch| {
        bch.iter(|| naive_forward(&f32s.q, &f32s.k, &f32s.v, &mut naive_out, shape))
    });
    group.finish();
}

criterion_group!(benches, cpu);
criterion_main!(benches);
