//! The FP8 baseline (the forward as a framework computes it from the quantized inputs) and the
//! rule for O and the LSE against it.

use super::*;

/// The FP8 forward as a framework would compute it from the quantized inputs: S in f32, P =
/// exp(s − max) scaled by 2^8 and rounded to e4m3 (as the kernel rounds it), O = Σ P·V / Σ P
/// in f32 rounded to `O`, LSE in f32. Rows with no key: O = 0, LSE = +inf.
///
/// Beside it, what the FP8 tensor cores' accumulation may add: their dot products keep fewer bits
/// than f32 (about 14: DeepSeek-V3 report §3.3), so a score may err by 2^-8 of its row's largest
/// Σ_d |q_d·k_d|·scale (`slack.score`, per row). The LSE moves by at most that much; O, to first
/// order, by that much times Σ_j p_j·|v_j − o| (`slack.out`, per element: a score error δ_j moves
/// o by Σ_j p_j·δ_j·(v_j − o)).
pub(super) struct Fp8Baseline {
    pub out: Vec<f32>,
    pub lse: Vec<f32>,
    pub slack: Slack,
}

/// The accumulation's allowance beside the baseline's (see `Fp8Baseline`).
pub(super) struct Slack {
    /// Per query row (batch, head, row): 2^-8 of the largest Σ_d |q_d·k_d|·scale over its keys.
    pub score: Vec<f32>,
    /// Per element of O: `score` of its row times Σ_j p_j·|v_jc − o_c|.
    pub out: Vec<f32>,
}

pub(super) fn fp8_baseline<O: Element>(
    cfg: &AttentionConfig,
    case: &Case,
    [q, k, v]: [&[f32]; 3],
) -> Fp8Baseline {
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
    let mut score_slack = vec![0f32; case.batch * hq * sq];
    let mut out_slack = vec![0f32; case.batch * sq * hq * d];
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
                let delta = keys
                    .iter()
                    .map(|&j| {
                        let kj = &k[((b * sk + j) * hkv + hk) * d..][..d];
                        qi.iter().zip(kj).map(|(a, b)| (a * b).abs()).sum::<f32>() * scale
                    })
                    .fold(0.0, f32::max)
                    / 256.0;
                score_slack[(b * hq + h) * sq + i] = delta;
                let m = s.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                let p: Vec<f32> = s.iter().map(|x| (x - m).exp() * 256.0).collect();
                let l: f32 = p.iter().sum();
                let o = &mut out[((b * sq + i) * hq + h) * d..][..d];
                for (&j, &pj) in keys.iter().zip(&p) {
                    let p8 = F8E4M3::from_f32(pj).to_f32();
                    let vj = &v[((b * sk + j) * hkv + hk) * d..][..d];
                    o.iter_mut().zip(vj).for_each(|(a, x)| *a += p8 * x);
                }
                if l > 0.0 {
                    let slack = &mut out_slack[((b * sq + i) * hq + h) * d..][..d];
                    for (c, s) in slack.iter_mut().enumerate() {
                        let oc = o[c] / l;
                        let spread: f32 = keys
                            .iter()
                            .zip(&p)
                            .map(|(&j, &pj)| pj * (v[((b * sk + j) * hkv + hk) * d + c] - oc).abs())
                            .sum();
                        *s = delta * spread / l;
                    }
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
    Fp8Baseline {
        out,
        lse,
        slack: Slack {
            score: score_slack,
            out: out_slack,
        },
    }
}

/// docs/ARCHITECTURE.md's correctness rule against the FP8 baseline, widened element by element
/// by the accumulation's `slack` (`Fp8Baseline`: `slack.out` for O, `slack.score` for the LSE; a
/// wrong descale or block errs by whole percents of Σ|q·k|·scale). cuBLASLt's own FP8 GEMM errs by
/// a like fraction of Σ|q·k| on these inputs (benchmarks/fp8_accumulation_probe.py measures both;
/// the numbers are in benchmarks/README.md). Where the worst element against its allowance needs
/// the slack, it is printed with it.
pub(super) fn compare_with_slack(
    what: &str,
    got: &[f32],
    reference: &[f64],
    baseline: &[f32],
    slack: &[f32],
) -> Comparison {
    assert_eq!(got.len(), slack.len(), "{what}: slack per element");
    let base = compare(got, reference, baseline);
    let mut worst = Comparison { ratio: 0.0, ..base };
    let mut worst_at = 0;
    for (i, ((&g, &r), &s)) in got.iter().zip(reference).zip(slack).enumerate() {
        let err = if g as f64 == r {
            0.0
        } else {
            (g as f64 - r).abs()
        };
        let allowed = base.allowed + s as f64;
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
    if worst.max_err > base.allowed {
        let i = worst_at;
        println!(
            "{what} worst at index {i}: got {}, reference {}, FP8 baseline {}, error {:.3e} \
             against the baseline's allowance {:.3e} and the accumulation's slack {:.3e}",
            got[i], reference[i], baseline[i], worst.max_err, base.allowed, slack[i]
        );
    }
    worst
}
