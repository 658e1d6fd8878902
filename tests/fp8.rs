//! The FP8 quantize step's host definition (src/fp8.rs): the Hadamard transform's invertibility
//! and what it preserves, the per-block scale choice, saturation, NaN, and what quantization
//! costs attention with outliers (the FlashAttention-3 paper's experiment, at a CPU size).

use flashattn::fp8::{self, fwht, Fp8Tensor, Granularity, RandomSignHadamard, E4M3_MAX};
use flashattn::reference::reference_forward;
use flashattn::{AttentionConfig, Error, Operand, TensorRef};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, StandardNormal};

fn normals(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n).map(|_| StandardNormal.sample(&mut rng)).collect()
}

#[test]
fn fwht_is_its_own_inverse() {
    for d in [64, 128, 256] {
        // Small integers: every butterfly sum is exact, and 1/√d is a power of two at d = 64
        // and 256, so there the round trip is bit-exact.
        let mut rng = StdRng::seed_from_u64(d as u64);
        let ints: Vec<f32> = (0..d).map(|_| rng.random_range(-8i32..=8) as f32).collect();
        let mut x = ints.clone();
        fwht(&mut x).unwrap();
        assert_ne!(x, ints);
        fwht(&mut x).unwrap();
        if d != 128 {
            assert_eq!(x, ints, "d{d}");
        }
        // Any input, any d: back to within a few f32 roundings.
        let orig = normals(d, 7 + d as u64);
        let mut x = orig.clone();
        fwht(&mut x).unwrap();
        fwht(&mut x).unwrap();
        for (a, b) in x.iter().zip(&orig) {
            assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "d{d}: {a} vs {b}");
        }
    }
}

#[test]
fn random_sign_hadamard_inverts_and_keeps_dot_products() {
    for d in [64, 128, 256] {
        let h = RandomSignHadamard::new(d, 42).unwrap();
        assert!(h.signs().iter().any(|&s| s < 0.0) && h.signs().iter().any(|&s| s > 0.0));
        let q = normals(d, 1);
        let k = normals(d, 2);
        let (mut hq, mut hk) = (q.clone(), k.clone());
        h.apply(&mut hq).unwrap();
        h.apply(&mut hk).unwrap();
        let dot = |a: &[f32], b: &[f32]| {
            a.iter()
                .zip(b)
                .map(|(x, y)| *x as f64 * *y as f64)
                .sum::<f64>()
        };
        let (before, after) = (dot(&q, &k), dot(&hq, &hk));
        assert!(
            (before - after).abs() <= 1e-5 * d as f64,
            "d{d}: {before} vs {after}"
        );
        h.invert(&mut hq).unwrap();
        for (a, b) in hq.iter().zip(&q) {
            assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "d{d}: {a} vs {b}");
        }
        // An outlier spreads evenly: a one-hot row becomes ±1/√d everywhere.
        let mut one_hot = vec![0f32; d];
        one_hot[d / 3] = 1.0;
        h.apply(&mut one_hot).unwrap();
        for v in &one_hot {
            assert!((v.abs() - 1.0 / (d as f32).sqrt()).abs() < 1e-6);
        }
    }
    // The same seed gives the same signs; another seed other signs.
    let a = RandomSignHadamard::new(128, 3).unwrap();
    assert_eq!(a.signs(), RandomSignHadamard::new(128, 3).unwrap().signs());
    assert_ne!(a.signs(), RandomSignHadamard::new(128, 4).unwrap().signs());
    assert!(matches!(
        RandomSignHadamard::new(96, 0),
        Err(Error::InvalidConfig(_))
    ));
}

#[test]
fn quantize_saturates_and_keeps_nan() {
    for (x, want) in [
        (1000.0, E4M3_MAX),
        (-1e30, -E4M3_MAX),
        (f32::INFINITY, E4M3_MAX),
        (f32::NEG_INFINITY, -E4M3_MAX),
        (448.0, 448.0),
        (464.0, 448.0), // the tie between 448 and 480 (not representable) saturates too
        (0.0, 0.0),
    ] {
        let q = fp8::quantize(x, 1.0);
        assert!(!q.to_f32().is_nan(), "{x} became NaN");
        assert_eq!(q.to_f32(), want, "{x}");
    }
    assert!(fp8::quantize(f32::NAN, 1.0).to_f32().is_nan());
    assert!(fp8::quantize(f32::NAN, 0.5).to_f32().is_nan());
    // Either sign: the canonical 0x7F, the GPU conversion's NaN.
    assert_eq!(fp8::quantize(-f32::NAN, 1.0).to_bits(), 0x7F);
    assert_eq!(fp8::quantize(f32::NAN, 1.0).to_bits(), 0x7F);
    // Round to nearest with 3 mantissa bits: relative error at most 2^-4 in the normal range.
    for x in normals(10_000, 5) {
        let x = x * 20.0;
        if x.abs() < 2f32.powi(-6) {
            continue;
        }
        let q = fp8::quantize(x, 1.0).to_f32();
        assert!(((q - x) / x).abs() <= 1.0 / 16.0 + 1e-7, "{x} -> {q}");
    }
}

#[test]
fn block_scales_map_each_block_amax_to_448() {
    let shape = [2, 300, 3, 64];
    let mut x = normals(shape.iter().product(), 11);
    // One large entry, one NaN, one inf, and a block of zeros.
    let layout = flashattn::Layout::contiguous(shape);
    x[layout.offset(0, 5, 1, 7)] = 900.0;
    x[layout.offset(1, 200, 2, 3)] = f32::NAN;
    x[layout.offset(1, 10, 0, 0)] = f32::INFINITY;
    for s in 128..256 {
        for d in 0..64 {
            x[layout.offset(1, s, 1, d)] = 0.0;
        }
    }
    let t = Fp8Tensor::quantize(
        TensorRef::contiguous(&x, shape),
        Granularity::PerBlock { rows: 128 },
        Operand::K,
    )
    .unwrap();
    assert_eq!(t.scales().len(), 2 * 3 * 3); // 300 rows: blocks of 128, 128, 44
    for b in 0..2 {
        for h in 0..3 {
            for blk in 0..3 {
                let rows = blk * 128..((blk + 1) * 128).min(300);
                let mut amax = 0f32;
                let mut qmax = 0f32;
                for s in rows.clone() {
                    for d in 0..64 {
                        let v = x[layout.offset(b, s, h, d)];
                        if v.is_finite() {
                            amax = amax.max(v.abs());
                        }
                        let q = t.data()[layout.offset(b, s, h, d)].to_f32();
                        if q.is_finite() {
                            qmax = qmax.max(q.abs());
                        }
                    }
                }
                let scale = t.scale(b, rows.start, h);
                if amax == 0.0 {
                    assert_eq!(scale, 1.0);
                    assert_eq!(qmax, 0.0);
                } else {
                    assert_eq!(scale, amax / E4M3_MAX, "b{b} h{h} block {blk}");
                    assert_eq!(qmax, E4M3_MAX, "b{b} h{h} block {blk}");
                }
            }
        }
    }
    // NaN stays NaN, inf saturates, and neither poisons its block's scale.
    assert!(t.data()[layout.offset(1, 200, 2, 3)].to_f32().is_nan());
    assert_eq!(t.data()[layout.offset(1, 10, 0, 0)].to_f32(), E4M3_MAX);
    assert!(t.scale(1, 10, 0).is_finite() && t.scale(1, 200, 2).is_finite());
    // Dequantized values within e4m3 rounding of the input: half an ulp of 3 mantissa bits in
    // the normal range (|x/scale| ≥ 2^-6), half the subnormal spacing 2^-9 below it.
    let back = t.dequantize();
    for b in 0..2 {
        for s in 0..300 {
            for h in 0..3 {
                let scale = t.scale(b, s, h);
                for d in 0..64 {
                    let i = layout.offset(b, s, h, d);
                    let (v, a) = (x[i], back[i]);
                    if !v.is_finite() {
                        continue;
                    }
                    let bound = if (v / scale).abs() >= 2f32.powi(-6) {
                        v.abs() / 16.0
                    } else {
                        scale * 2f32.powi(-10)
                    };
                    assert!(
                        (a - v).abs() <= bound * (1.0 + 1e-6),
                        "({b},{s},{h},{d}): {v} -> {a}"
                    );
                }
            }
        }
    }
    assert!(matches!(
        Fp8Tensor::quantize(
            TensorRef::contiguous(&x, shape),
            Granularity::PerBlock { rows: 0 },
            Operand::K
        ),
        Err(Error::InvalidConfig(_))
    ));
}

/// Q, K, V ~ N(0, 1) + N(0, 100)·Bernoulli(0.001) (the FlashAttention-3 paper's outlier
/// inputs); RMSE of O computed exactly from the quantized (dequantized) inputs against the exact
/// O. This isolates the quantize step (the kernel adds P in e4m3 and f32 accumulation; its own
/// accuracy test is a GPU test): e4m3 is a float format, so block scales help only where values
/// would fall below its normal range (here they must do no harm), while the Hadamard transform
/// spreads each outlier's rounding error over the head dim and must cut the error by a fifth.
#[test]
fn hadamard_cuts_the_fp8_error_with_outliers_and_block_scales_do_no_harm() {
    let shape = [1, 512, 2, 128];
    let n = shape.iter().product();
    let mut rng = StdRng::seed_from_u64(2024);
    let mut gen = || -> Vec<f32> {
        (0..n)
            .map(|_| {
                let base: f32 = StandardNormal.sample(&mut rng);
                let outlier: f32 = StandardNormal.sample(&mut rng);
                if rng.random::<f64>() < 0.001 {
                    base + 10.0 * outlier
                } else {
                    base
                }
            })
            .collect()
    };
    let (q, k, v) = (gen(), gen(), gen());
    let cfg = AttentionConfig::new();
    let exact = reference_forward(
        &cfg,
        TensorRef::contiguous(&q, shape),
        TensorRef::contiguous(&k, shape),
        TensorRef::contiguous(&v, shape),
    )
    .out;
    let rmse_of = |q: &[f32], k: &[f32], v: &[f32], granularity: Granularity| {
        let deq = |x: &[f32], op| {
            Fp8Tensor::quantize(TensorRef::contiguous(x, shape), granularity, op)
                .unwrap()
                .dequantize()
        };
        let out = reference_forward(
            &cfg,
            TensorRef::contiguous(&deq(q, Operand::Q), shape),
            TensorRef::contiguous(&deq(k, Operand::K), shape),
            TensorRef::contiguous(&deq(v, Operand::V), shape),
        )
        .out;
        (out.iter()
            .zip(&exact)
            .map(|(a, b)| (a - b) * (a - b))
            .sum::<f64>()
            / n as f64)
            .sqrt()
    };
    let per_tensor = rmse_of(&q, &k, &v, Granularity::PerTensor);
    let per_block = rmse_of(&q, &k, &v, Granularity::PerBlock { rows: 128 });
    let h = RandomSignHadamard::new(128, 9).unwrap();
    let hq = h
        .apply_tensor(TensorRef::contiguous(&q, shape), Operand::Q)
        .unwrap();
    let hk = h
        .apply_tensor(TensorRef::contiguous(&k, shape), Operand::K)
        .unwrap();
    let hadamard = rmse_of(&hq, &hk, &v, Granularity::PerBlock { rows: 128 });
    eprintln!("RMSE per-tensor {per_tensor:.3e}, per-block {per_block:.3e}, per-block + Hadamard {hadamard:.3e}");
    assert!(per_block <= per_tensor, "{per_block} vs {per_tensor}");
    assert!(hadamard <= 0.8 * per_block, "{hadamard} vs {per_block}");
}
