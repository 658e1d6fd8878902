//! Ring attention over simulated ranks (`flashattn::ring`, CPU): 1 to 4 ranks, causal (zig-zag
//! shards), full (contiguous) and sliding windows, GQA and V's own head dim: each rank's O, LSE,
//! dQ, dK and dV are the single call's on its rows (f32, to within f32 rounding of the different
//! summation order; bf16 O and gradients under the reference rule), with attention sinks too (the ranks' shares
//! of their gradient summing to the single call's), and over packed batches; inconsistent shards
//! are typed errors.

mod harness;

use flashattn::reference::{self, baseline_forward, compare, reference_forward};
use flashattn::ring::{self, Sharding};
use flashattn::{AttentionConfig, BackwardInputs, Element, Error, ForwardInputs, TensorRef};
use half::bf16;
use rand::rngs::StdRng;
use rand::SeedableRng;

use harness::random;

const B: usize = 2;
const S: usize = 48;
const HQ: usize = 4;
const HK: usize = 2;
const D: usize = 32;
const DV: usize = 16;

struct Whole<T> {
    q: Vec<T>,
    k: Vec<T>,
    v: Vec<T>,
    dout: Vec<T>,
}

impl<T: Element> Whole<T> {
    fn new(seed: u64) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        Whole {
            q: random(B * S * HQ * D, &mut rng),
            k: random(B * S * HK * D, &mut rng),
            v: random(B * S * HK * DV, &mut rng),
            dout: random(B * S * HQ * DV, &mut rng),
        }
    }
}

fn view<T>(x: &[T], rows: usize, heads: usize, d: usize) -> TensorRef<'_, T> {
    TensorRef::contiguous(x, [B, rows, heads, d])
}

/// Every rank's shard of `x` (B, S, heads, d).
fn shards<T: Element>(
    x: &[T],
    heads: usize,
    d: usize,
    sharding: Sharding,
    ranks: usize,
) -> Vec<Vec<T>> {
    (0..ranks)
        .map(|r| ring::shard(view(x, S, heads, d), sharding, ranks, r).unwrap())
        .collect()
}

/// Every rank's shards of Q, K and V.
fn qkv_shards<T: Element>(w: &Whole<T>, sharding: Sharding, ranks: usize) -> [Vec<Vec<T>>; 3] {
    [
        shards(&w.q, HQ, D, sharding, ranks),
        shards(&w.k, HK, D, sharding, ranks),
        shards(&w.v, HK, DV, sharding, ranks),
    ]
}

/// Each rank's forward inputs over its (contiguous) shards.
fn rank_inputs<T>([qs, ks, vs]: &[Vec<Vec<T>>; 3]) -> Vec<ForwardInputs<'_, T>> {
    let rows = S / qs.len();
    (0..qs.len())
        .map(|r| {
            ForwardInputs::new(
                view(&qs[r], rows, HQ, D),
                view(&ks[r], rows, HK, D),
                view(&vs[r], rows, HK, DV),
            )
        })
        .collect()
}

/// Rank r's rows of an LSE (B, HQ, S), as (B, HQ, S / ranks).
fn lse_shard(lse: &[f32], sharding: Sharding, ranks: usize, rank: usize) -> Vec<f32> {
    let rows = sharding.rows(S, ranks, rank).unwrap();
    (0..B * HQ)
        .flat_map(|bh| {
            rows.iter()
                .flat_map(move |r| r.clone().map(move |i| lse[bh * S + i]))
        })
        .collect()
}

fn close(got: &[f32], want: &[f32], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * (1.0 + w.abs()),
            "{what}[{i}]: {g} vs {w}"
        );
    }
}

#[test]
fn every_rank_gets_the_single_call_s_rows_in_f32() {
    for (cfg, sharding) in [
        (AttentionConfig::new().causal(true), Sharding::ZigZag),
        (AttentionConfig::new(), Sharding::Contiguous),
        (
            AttentionConfig::new().causal(true).softcap(3.0),
            Sharding::ZigZag,
        ),
        (
            AttentionConfig::new().window(None, Some(0)),
            Sharding::ZigZag,
        ),
        (AttentionConfig::new().causal(true), Sharding::Contiguous),
        (AttentionConfig::new(), Sharding::ZigZag),
        // Sliding windows: bands that reach into the next chunks, that miss a pair's diagonal on
        // either side, and that are wider than the sequence.
        (
            AttentionConfig::new().window(Some(5), Some(0)),
            Sharding::ZigZag,
        ),
        (
            AttentionConfig::new().window(Some(13), Some(3)),
            Sharding::ZigZag,
        ),
        (
            AttentionConfig::new().window(None, Some(9)),
            Sharding::Contiguous,
        ),
        (
            AttentionConfig::new().window(Some(7), None),
            Sharding::ZigZag,
        ),
        (
            AttentionConfig::new().window(Some(2), Some(17)),
            Sharding::Contiguous,
        ),
        (
            AttentionConfig::new().window(Some(100), Some(100)),
            Sharding::ZigZag,
        ),
        // Widths of whole chunks (of 12 rows at 2 ranks): bands that end on a pair's diagonal.
        (
            AttentionConfig::new().window(Some(12), Some(12)),
            Sharding::ZigZag,
        ),
    ] {
        for ranks in 1..=4 {
            ring_matches_the_single_call(&cfg, sharding, ranks, ranks as u64, None);
        }
    }
}

/// With attention sinks: each rank's O and LSE are the single call's with them, its dQ, dK and dV
/// too, and the ranks' shares of the sinks' gradient sum to the single call's (f32).
#[test]
fn sinks_join_the_ring_once_and_their_gradient_sums_over_the_ranks() {
    let sinks: Vec<f32> = (0..HQ).map(|h| 0.8 * h as f32 - 1.5).collect();
    for (cfg, sharding) in [
        (AttentionConfig::new().causal(true), Sharding::ZigZag),
        (AttentionConfig::new(), Sharding::Contiguous),
        (
            AttentionConfig::new().window(Some(5), Some(0)),
            Sharding::ZigZag,
        ),
    ] {
        for ranks in 1..=4 {
            ring_matches_the_single_call(&cfg, sharding, ranks, 40 + ranks as u64, Some(&sinks));
        }
    }
}

/// The ring of `ranks` over random f32 Q, K, V and dO (`seed`) against the single call, with
/// `sinks` or without: every rank's O and LSE (within 2e-6), dQ, dK and dV (within 2e-5), and with
/// sinks the ranks' shares of their gradient summed against the single call's (a gradient that
/// is not about zero).
fn ring_matches_the_single_call(
    cfg: &AttentionConfig,
    sharding: Sharding,
    ranks: usize,
    seed: u64,
    sinks: Option<&[f32]>,
) {
    let w = Whole::<f32>::new(seed);
    let (q, k, v, dout) = (
        view(&w.q, S, HQ, D),
        view(&w.k, S, HK, D),
        view(&w.v, S, HK, DV),
        view(&w.dout, S, HQ, DV),
    );
    let fwd = flashattn::forward(
        cfg,
        ForwardInputs {
            sinks,
            ..ForwardInputs::new(q, k, v)
        },
    )
    .unwrap();
    let grads = flashattn::backward(
        cfg,
        BackwardInputs {
            q,
            k,
            v,
            out: view(&fwd.out, S, HQ, DV),
            dout,
            lse: &fwd.lse,
            sinks,
        },
    )
    .unwrap();
    let rows = S / ranks;
    let qkv = qkv_shards(&w, sharding, ranks);
    let [qs, ks, vs] = &qkv;
    let ds = shards(&w.dout, HQ, DV, sharding, ranks);
    let inputs: Vec<_> = rank_inputs(&qkv)
        .into_iter()
        .map(|i| ForwardInputs { sinks, ..i })
        .collect();
    let outs = ring::forward(cfg, sharding, &inputs).unwrap();
    let want_o = shards(&fwd.out, HQ, DV, sharding, ranks);
    let with = if sinks.is_some() { " with sinks" } else { "" };
    for (r, out) in outs.iter().enumerate() {
        let what = format!("{cfg:?} ranks {ranks} rank {r}{with}");
        close(&out.out, &want_o[r], 2e-6, &format!("{what} O"));
        let want_lse = lse_shard(&fwd.lse, sharding, ranks, r);
        close(&out.lse, &want_lse, 2e-6, &format!("{what} LSE"));
    }
    let binputs: Vec<_> = (0..ranks)
        .map(|r| BackwardInputs {
            q: view(&qs[r], rows, HQ, D),
            k: view(&ks[r], rows, HK, D),
            v: view(&vs[r], rows, HK, DV),
            out: view(&outs[r].out, rows, HQ, DV),
            dout: view(&ds[r], rows, HQ, DV),
            lse: &outs[r].lse,
            sinks,
        })
        .collect();
    let got = ring::backward(cfg, sharding, &binputs).unwrap();
    let (want_dq, want_dk, want_dv) = (
        shards(&grads.dq, HQ, D, sharding, ranks),
        shards(&grads.dk, HK, D, sharding, ranks),
        shards(&grads.dv, HK, DV, sharding, ranks),
    );
    let mut dsinks = vec![0f32; HQ];
    for (r, g) in got.iter().enumerate() {
        let what = format!("{cfg:?} ranks {ranks} rank {r}{with}");
        close(&g.dq, &want_dq[r], 2e-5, &format!("{what} dQ"));
        close(&g.dk, &want_dk[r], 2e-5, &format!("{what} dK"));
        close(&g.dv, &want_dv[r], 2e-5, &format!("{what} dV"));
        if let Some(part) = &g.dsinks {
            for (s, x) in dsinks.iter_mut().zip(part) {
                *s += x;
            }
        }
        assert_eq!(
            g.dsinks.is_some(),
            sinks.is_some(),
            "{what}: the sinks' gradient"
        );
    }
    if let Some(want) = &grads.dsinks {
        close(
            &dsinks,
            want,
            2e-5,
            &format!("{cfg:?} ranks {ranks} dsinks"),
        );
        assert!(want.iter().any(|x| x.abs() > 1e-3), "a gradient to compare");
    }
}

/// `x`'s first `rows` rows as one packed batch entry `(1, rows, heads, d)`.
fn packed(x: &[f32], rows: usize, heads: usize, d: usize) -> TensorRef<'_, f32> {
    TensorRef::contiguous(&x[..rows * heads * d], [1, rows, heads, d])
}

/// Packed batches (self-attention over sequences of 16, 0, 40 and 8 rows, sinks included): each
/// rank's O, LSE (a packed call's layout), dQ, dK and dV are the single packed call's on its
/// rows, and the ranks' shares of the sinks' gradient sum to the single call's (f32).
#[test]
fn a_packed_ring_gives_the_single_packed_call_s_rows() {
    use flashattn::varlen::{self, Seqlens};
    let cu = [0i32, 16, 16, 56, 64];
    let total = 64;
    let sinks: Vec<f32> = (0..HQ).map(|h| 0.5 * h as f32 - 1.0).collect();
    let mut rng = StdRng::seed_from_u64(77);
    let q: Vec<f32> = random(total * HQ * D, &mut rng);
    let k: Vec<f32> = random(total * HK * D, &mut rng);
    let v: Vec<f32> = random(total * HK * DV, &mut rng);
    let dout: Vec<f32> = random(total * HQ * DV, &mut rng);
    let seqs = Seqlens::new(&cu, &cu, 40, 40).unwrap();
    for (cfg, sharding) in [
        (AttentionConfig::new().causal(true), Sharding::ZigZag),
        (AttentionConfig::new(), Sharding::Contiguous),
        (
            AttentionConfig::new().window(Some(3), Some(1)),
            Sharding::ZigZag,
        ),
    ] {
        let whole = ForwardInputs::new(
            packed(&q, total, HQ, D),
            packed(&k, total, HK, D),
            packed(&v, total, HK, DV),
        )
        .with_sinks(&sinks);
        let fwd = varlen::forward(&cfg, &seqs, whole).unwrap();
        let grads = varlen::backward(
            &cfg,
            &seqs,
            BackwardInputs {
                q: whole.q,
                k: whole.k,
                v: whole.v,
                out: packed(&fwd.out, total, HQ, DV),
                dout: packed(&dout, total, HQ, DV),
                lse: &fwd.lse,
                sinks: Some(&sinks),
            },
        )
        .unwrap();
        for ranks in [1, 2, 4] {
            let rows = total / ranks;
            let shard = |x: &[f32], heads: usize, d: usize, r: usize| {
                ring::shard_packed(packed(x, total, heads, d), &cu, sharding, ranks, r).unwrap()
            };
            let shards = |x: &[f32], heads: usize, d: usize| -> Vec<Vec<f32>> {
                (0..ranks).map(|r| shard(x, heads, d, r)).collect()
            };
            let (qs, ks, vs, ds) = (
                shards(&q, HQ, D),
                shards(&k, HK, D),
                shards(&v, HK, DV),
                shards(&dout, HQ, DV),
            );
            let inputs: Vec<_> = (0..ranks)
                .map(|r| {
                    ForwardInputs::new(
                        packed(&qs[r], rows, HQ, D),
                        packed(&ks[r], rows, HK, D),
                        packed(&vs[r], rows, HK, DV),
                    )
                    .with_sinks(&sinks)
                })
                .collect();
            let outs = ring::varlen_forward(&cfg, sharding, &cu, &inputs).unwrap();
            // The single call's LSE (heads, total) as each rank's (heads, rows): its shard of a
            // (1, total, heads, 1) view of the transposed values.
            let lse_rows: Vec<f32> = (0..total)
                .flat_map(|i| (0..HQ).map(move |h| (h, i)))
                .map(|(h, i)| fwd.lse[h * total + i])
                .collect();
            for (r, got) in outs.iter().enumerate() {
                let what = format!("{cfg:?} ranks {ranks} rank {r} packed");
                close(
                    &got.out,
                    &shard(&fwd.out, HQ, DV, r),
                    2e-6,
                    &format!("{what} O"),
                );
                let want = shard(&lse_rows, HQ, 1, r);
                let want: Vec<f32> = (0..HQ)
                    .flat_map(|h| (0..rows).map(move |i| (h, i)))
                    .map(|(h, i)| want[i * HQ + h])
                    .collect();
                close(&got.lse, &want, 2e-6, &format!("{what} LSE"));
            }
            let binputs: Vec<_> = (0..ranks)
                .map(|r| BackwardInputs {
                    q: packed(&qs[r], rows, HQ, D),
                    k: packed(&ks[r], rows, HK, D),
                    v: packed(&vs[r], rows, HK, DV),
                    out: packed(&outs[r].out, rows, HQ, DV),
                    dout: packed(&ds[r], rows, HQ, DV),
                    lse: &outs[r].lse,
                    sinks: Some(&sinks),
                })
                .collect();
            let got = ring::varlen_backward(&cfg, sharding, &cu, &binputs).unwrap();
            let mut dsinks = vec![0f32; HQ];
            for (r, got) in got.iter().enumerate() {
                let what = format!("{cfg:?} ranks {ranks} rank {r} packed");
                close(
                    &got.dq,
                    &shard(&grads.dq, HQ, D, r),
                    2e-5,
                    &format!("{what} dQ"),
                );
                close(
                    &got.dk,
                    &shard(&grads.dk, HK, D, r),
                    2e-5,
                    &format!("{what} dK"),
                );
                close(
                    &got.dv,
                    &shard(&grads.dv, HK, DV, r),
                    2e-5,
                    &format!("{what} dV"),
                );
                for (s, x) in dsinks.iter_mut().zip(got.dsinks.as_ref().unwrap()) {
                    *s += x;
                }
            }
            let want = grads.dsinks.as_ref().unwrap();
            close(
                &dsinks,
                want,
                2e-5,
                &format!("{cfg:?} ranks {ranks} packed dsinks"),
            );
            assert!(want.iter().any(|x| x.abs() > 1e-3), "a gradient to compare");
        }
    }
    // A sequence of no whole number of chunks, and a shard of the wrong length.
    let bad = [0i32, 16, 18];
    let e = ring::shard_packed(packed(&q, 18, HQ, D), &bad, Sharding::ZigZag, 2, 0).unwrap_err();
    assert!(matches!(e, Error::InvalidConfig(_)), "{e:?}");
    let short = ForwardInputs::new(
        packed(&q, 30, HQ, D),
        packed(&k, 30, HK, D),
        packed(&v, 30, HK, DV),
    );
    let e = ring::varlen_forward(
        &AttentionConfig::new(),
        Sharding::Contiguous,
        &cu,
        &[short, short],
    )
    .unwrap_err();
    assert!(matches!(e, Error::ShapeMismatch { .. }), "{e:?}");
    // No ranks, and a shard whose rows reach past its buffer (rows 2 apart, one element each):
    // typed errors, not a division by zero or a slice past the end.
    let e = ring::shard_packed(packed(&q, 4, 1, 1), &[0, 0, 4], Sharding::Contiguous, 0, 0)
        .unwrap_err();
    assert!(matches!(e, Error::InvalidConfig(_)), "{e:?}");
    let spaced = TensorRef::new(
        &q[..3],
        flashattn::Layout::with_strides([1, 4, 1, 1], [8, 2, 1, 1]),
    );
    let e = ring::varlen_forward(
        &AttentionConfig::new(),
        Sharding::Contiguous,
        &[0, 2, 4],
        &[ForwardInputs::new(spaced, spaced, spaced)],
    )
    .unwrap_err();
    assert!(matches!(e, Error::BufferTooSmall { .. }), "{e:?}");
}

#[test]
fn a_bf16_ring_holds_the_reference_rule() {
    let cfg = AttentionConfig::new().causal(true);
    let (ranks, sharding) = (3, Sharding::ZigZag);
    let w = Whole::<bf16>::new(7);
    let (q, k, v) = (
        view(&w.q, S, HQ, D),
        view(&w.k, S, HK, D),
        view(&w.v, S, HK, DV),
    );
    let want = reference_forward(&cfg, q, k, v);
    let base = baseline_forward(&cfg, q, k, v);
    let qkv = qkv_shards(&w, sharding, ranks);
    let outs = ring::forward(&cfg, sharding, &rank_inputs(&qkv)).unwrap();
    // The whole O from the ranks' rows, in f64 like the reference.
    let mut o = vec![0f32; B * S * HQ * DV];
    for (r, out) in outs.iter().enumerate() {
        let ranges = sharding.rows(S, ranks, r).unwrap();
        let mut at = 0;
        for b in 0..B {
            for i in ranges.iter().flat_map(|x| x.clone()) {
                let dst = (b * S + i) * HQ * DV;
                o[dst..dst + HQ * DV]
                    .copy_from_slice(&reference::to_f32(&out.out[at..at + HQ * DV]));
                at += HQ * DV;
            }
        }
    }
    let c = compare(&o, &want.out, &base.out);
    assert!(c.pass, "O: {c}");
}

/// A bf16 ring's gradients (each pair's rounded to bf16, then summed in f32 and rounded once)
/// and O (each part rounded to bf16 before the merge) under DESIGN's rule against the f64
/// reference of the whole call, with up to 8 key chunks a query chunk meets: what the device
/// ring (the same arithmetic) is held to.
#[test]
fn a_bf16_ring_backward_holds_the_gradient_rule() {
    use flashattn::reference::{baseline_backward, compare_gradient, reference_backward};
    let cases = [
        (AttentionConfig::new().causal(true), Sharding::ZigZag, 4),
        (AttentionConfig::new(), Sharding::Contiguous, 3),
        (
            AttentionConfig::new().window(Some(10), Some(0)),
            Sharding::ZigZag,
            4,
        ),
    ];
    for (i, (cfg, sharding, ranks)) in cases.into_iter().enumerate() {
        let w = Whole::<bf16>::new(20 + i as u64);
        let (q, k, v, dout) = (
            view(&w.q, S, HQ, D),
            view(&w.k, S, HK, D),
            view(&w.v, S, HK, DV),
            view(&w.dout, S, HQ, DV),
        );
        let (want, base) = (
            reference_backward(&cfg, q, k, v, dout),
            baseline_backward(&cfg, q, k, v, dout),
        );
        let (want_o, base_o) = (
            reference_forward(&cfg, q, k, v),
            baseline_forward(&cfg, q, k, v),
        );
        let rows = S / ranks;
        let qkv = qkv_shards(&w, sharding, ranks);
        let [qs, ks, vs] = &qkv;
        let ds = shards(&w.dout, HQ, DV, sharding, ranks);
        let outs = ring::forward(&cfg, sharding, &rank_inputs(&qkv)).unwrap();
        let binputs: Vec<_> = (0..ranks)
            .map(|r| BackwardInputs {
                q: view(&qs[r], rows, HQ, D),
                k: view(&ks[r], rows, HK, D),
                v: view(&vs[r], rows, HK, DV),
                out: view(&outs[r].out, rows, HQ, DV),
                dout: view(&ds[r], rows, HQ, DV),
                lse: &outs[r].lse,
                sinks: None,
            })
            .collect();
        let got = ring::backward(&cfg, sharding, &binputs).unwrap();
        // Rank r's rows of a whole (B, S, heads, d) tensor, as its shard orders them.
        let rank_rows = |x: &[f64], heads: usize, d: usize, r: usize| -> Vec<f64> {
            let ranges = sharding.rows(S, ranks, r).unwrap();
            (0..B)
                .flat_map(|b| {
                    ranges.iter().flat_map(move |range| {
                        range
                            .clone()
                            .flat_map(move |i| x[(b * S + i) * heads * d..][..heads * d].to_vec())
                    })
                })
                .collect()
        };
        let rank_rows32 = |x: &[f32], heads, d, r| -> Vec<f32> {
            let wide: Vec<f64> = x.iter().map(|&v| v as f64).collect();
            rank_rows(&wide, heads, d, r)
                .into_iter()
                .map(|v| v as f32)
                .collect()
        };
        for r in 0..ranks {
            let what = format!("{cfg:?} {sharding:?} ranks {ranks} rank {r}");
            let c = compare(
                &reference::to_f32(&outs[r].out),
                &rank_rows(&want_o.out, HQ, DV, r),
                &rank_rows32(&base_o.out, HQ, DV, r),
            );
            assert!(c.pass, "{what} O: {c}");
            for (name, g, want, base, heads, d) in [
                ("dQ", &got[r].dq, &want.dq, &base.dq, HQ, D),
                ("dK", &got[r].dk, &want.dk, &base.dk, HK, D),
                ("dV", &got[r].dv, &want.dv, &base.dv, HK, DV),
            ] {
                let c = compare_gradient::<bf16>(
                    &reference::to_f32(g),
                    &rank_rows(want, heads, d, r),
                    &rank_rows32(base, heads, d, r),
                );
                assert!(c.pass, "{what} {name}: {c}");
            }
        }
    }
}

#[test]
fn inconsistent_rings_are_typed_errors() {
    let x: Vec<f32> = (0..B * 12 * HQ * D)
        .map(|i| (i as f32 * 0.1).sin())
        .collect();
    let t = TensorRef::contiguous(&x, [B, 12, HQ, D]);
    // Sinks on one rank and not on the other.
    let sinks = [0.0f32; HQ];
    let u = TensorRef::contiguous(&x[..B * 6 * HQ * D], [B, 6, HQ, D]);
    let e = ring::forward(
        &AttentionConfig::new(),
        Sharding::Contiguous,
        &[
            ForwardInputs::new(u, u, u).with_sinks(&sinks),
            ForwardInputs::new(u, u, u),
        ],
    )
    .unwrap_err();
    assert!(matches!(e, Error::InvalidConfig(_)), "{e:?}");
    let u = TensorRef::contiguous(&x[..B * 6 * HQ * D], [B, 6, HQ, D]);
    let e = ring::forward(
        &AttentionConfig::new(),
        Sharding::Contiguous,
        &[ForwardInputs::new(t, t, t), ForwardInputs::new(u, u, u)],
    )
    .unwrap_err();
    assert!(matches!(e, Error::ShapeMismatch { .. }), "{e:?}");
    let e = ring::forward::<f32>(&AttentionConfig::new(), Sharding::Contiguous, &[]).unwrap_err();
    assert!(matches!(e, Error::InvalidConfig(_)), "{e:?}");
    // K with other rows than Q, and a backward whose LSE is short: refused before any slicing.
    let e = ring::forward(
        &AttentionConfig::new(),
        Sharding::Contiguous,
        &[ForwardInputs::new(t, u, u)],
    )
    .unwrap_err();
    assert!(matches!(e, Error::ShapeMismatch { .. }), "{e:?}");
    let o: Vec<f32> = x[..B * 12 * HQ * D].to_vec();
    let ot = TensorRef::contiguous(&o, [B, 12, HQ, D]);
    let short = vec![0f32; B * HQ * 12 - 1];
    let e = ring::backward(
        &AttentionConfig::new(),
        Sharding::Contiguous,
        &[BackwardInputs {
            q: t,
            k: t,
            v: t,
            out: ot,
            dout: ot,
            lse: &short,
            sinks: None,
        }],
    )
    .unwrap_err();
    assert!(matches!(e, Error::BufferTooSmall { .. }), "{e:?}");
    // 12 rows do not make 2 · 5 equal chunks.
    let e = ring::shard(t, Sharding::ZigZag, 5, 0).unwrap_err();
    assert!(matches!(e, Error::InvalidConfig(_)), "{e:?}");
}

/// Shards seen through strides (rows padded in their buffer) give the contiguous shards' bits.
#[test]
fn strided_shards_give_the_same_bits() {
    let (ranks, sharding, cfg) = (2, Sharding::ZigZag, AttentionConfig::new().causal(true));
    let w = Whole::<f32>::new(11);
    let rows = S / ranks;
    let qkv = qkv_shards(&w, sharding, ranks);
    let [qs, ks, vs] = &qkv;
    // Each row of a shard followed by `pad` unused (NaN) elements.
    let padded = |x: &[f32], heads: usize, d: usize, pad: usize| -> Vec<f32> {
        x.chunks(heads * d)
            .flat_map(|r| r.iter().copied().chain(std::iter::repeat_n(f32::NAN, pad)))
            .collect()
    };
    fn strided(x: &[f32], rows: usize, heads: usize, d: usize, pad: usize) -> TensorRef<'_, f32> {
        let row = heads * d + pad;
        TensorRef::new(
            x,
            flashattn::Layout::with_strides([B, rows, heads, d], [rows * row, row, d, 1]),
        )
    }
    let want = ring::forward(&cfg, sharding, &rank_inputs(&qkv)).unwrap();
    let pq: Vec<_> = qs.iter().map(|x| padded(x, HQ, D, 5)).collect();
    let pk: Vec<_> = ks.iter().map(|x| padded(x, HK, D, 3)).collect();
    let pv: Vec<_> = vs.iter().map(|x| padded(x, HK, DV, 7)).collect();
    let inputs: Vec<_> = (0..ranks)
        .map(|r| {
            ForwardInputs::new(
                strided(&pq[r], rows, HQ, D, 5),
                strided(&pk[r], rows, HK, D, 3),
                strided(&pv[r], rows, HK, DV, 7),
            )
        })
        .collect();
    let got = ring::forward(&cfg, sharding, &inputs).unwrap();
    for r in 0..ranks {
        assert_eq!(got[r].out, want[r].out, "rank {r} O");
        assert_eq!(got[r].lse, want[r].lse, "rank {r} LSE");
    }
}
