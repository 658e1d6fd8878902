//! The FP8 baseline (the forward as a framework computes it from the quantized inputs) and the
//! LSE's rule against it.

use super::*;

/// The FP8 forward as a framework would compute it from the quantized inputs: S in f32, P =
/// exp(s − max) scaled by 2^8 and rounded to e4m3 (as the kernel rounds it), O = Σ P·V / Σ P
/// in f32 rounded to `O`, LSE in f32. Rows with no key: O = 0, LSE = +inf. Also, per query row,
/// the largest Σ_d |q_d·k_d|·scale over its keys: what bounds the error of an FP8 tensor-core
/// dot product, whose accumulator keeps fewer bits than f32 (about 14: DeepSeek-V3 report §3.3).
pub(super) fn fp8_baseline<O: Element>(
    cfg: &AttentionConfig,
    case: &Case,
    [q, k, v]: [&[f32]; 3],
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (hq, hkv, d, sq, sk) = (
        case.heads_q,
        case.heads_kv,
        case.head_dim,
        case.seqlen_q,
        case.seqlen_k,
    );
    let scale = cfg.scale_for(d);
    let mask = cfg.key_rule(sq, sk);
    let mut out = vec![0f32; case.batch * sq * hq * d];
    let mut lse = vec![0f32; case.batch * hq * sq];
    let mut magnitude = vec![0f32; case.batch * hq * sq];
    for b in 0..case.batch {
        for h in 0..hq {
            let hk = h / (hq / hkv);
            for i in 0..sq {
                let qi = &q[((b * sq + i) * hq + h) * d..][..d];
                let (lo, hi) = mask.key_range(i);
                let keys: Vec<usize> = (lo..hi.max(lo)).collect();
                let s: Vec<f32> = keys
                    .iter()
                    .map(|&j| {
                        let kj = &k[((b * sk + j) * hkv + hk) * d..][..d];
                        qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f32>() * scale
                    })
                    .collect();
                magnitude[(b * hq + h) * sq + i] = keys
                    .iter()
                    .map(|&j| {
                        let kj = &k[((b * sk + j) * hkv + hk) * d..][..d];
                        qi.iter().zip(kj).map(|(a, b)| (a * b).abs()).sum::<f32>() * scale
                    })
                    .fold(0.0, f32::max);
                let m = s.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                let p: Vec<f32> = s.iter().map(|x| (x - m).exp() * 256.0).collect();
                let l: f32 = p.iter().sum();
                let o = &mut out[((b * sq + i) * hq + h) * d..][..d];
                for (&j, &pj) in keys.iter().zip(&p) {
                    let p8 = F8E4M3::from_f32(pj).to_f32();
                    let vj = &v[((b * sk + j) * hkv + hk) * d..][..d];
                    o.iter_mut().zip(vj).for_each(|(a, x)| *a += p8 * x);
                }
                o.iter_mut().for_each(|a| {
                    *a = if l > 0.0 {
                        O::from_f32(*a / l).to_f32()
                    } else {
                        0.0
                    }
                });
                lse[(b * hq + h) * sq + i] = if l > 0.0 {
                    m + (l / 256.0).ln()
                } else {
                    f32::INFINITY
                };
            }
        }
    }
    (out, lse, magnitude)
}

/// The LSE's rule: docs/ARCHITECTURE.md's correctness rule, against the FP8 baseline, widened per
/// row by 2^-8 of the row's largest Σ|q·k|·scale for the tensor cores' FP8 accumulation (see
/// `fp8_baseline`; a wrong descale or block errs by whole percents of it). cuBLASLt's own FP8
/// GEMM errs by a like fraction of Σ|q·k| on these inputs (benchmarks/fp8_accumulation_probe.py
/// measures both; the numbers are in benchmarks/README.md).
pub(super) fn compare_lse(
    got: &[f32],
    reference: &[f64],
    baseline: &[f32],
    magnitude: &[f32],
) -> Comparison {
    let base = compare(got, reference, baseline);
    let mut worst = Comparison { ratio: 0.0, ..base };
    let mut worst_at = 0;
    for (i, ((&g, &r), &m)) in got.iter().zip(reference).zip(magnitude).enumerate() {
        let err = if g as f64 == r {
            0.0
        } else {
            (g as f64 - r).abs()
        };
        let allowed = base.allowed + m as f64 / 256.0;
        let ratio = if err.is_nan() {
            f64::INFINITY
        } else {
            err / allowed
        };
        if ratio > worst.ratio {
            worst_at = i;
            worst = Comparison {
                max_err: err,
                allowed,
                ratio,
                ..base
            };
        }
    }
    worst.pass = base.nan_count == 0 && worst.ratio <= 1.0;
    if !worst.pass {
        let i = worst_at;
        println!(
            "LSE worst at (batch·head, row) index {i}: got {}, reference {}, FP8 baseline {}, \
             max Σ|q·k|·scale {}",
            got[i], reference[i], baseline[i], magnitude[i]
        );
    }
    worst
}
