//! The ring on one device (`Device::ring_forward_into`): 1 to 8 simulated ranks whose shards are
//! device buffers, the K and V shards passed around on a transport stream, each rank's O and LSE
//! against the f64 reference of the whole sequence's single call (its rows of it) under DESIGN's
//! rule, with the baseline of the same single call: contiguous and zig-zag sharding, full,
//! causal and windowed masks (a window narrower than a chunk, and one reaching right), GQA,
//! sinks, chunks of rows no multiple of a key block. Outputs poisoned with NaN before the call.
//! The backward (`Device::ring_backward_into`) likewise: each rank's dQ, dK and dV against its
//! rows of the whole call's f64 gradients, O and LSE from the device's whole forward.

use std::ops::Range;

use flashattn::cuda::{
    DeviceForwardInputs, DeviceRingOutput, DeviceTensor, DeviceTensorMut, RingStreams,
};
use flashattn::reference::{self, compare};
use flashattn::ring::{self, Sharding};
use flashattn::{AttentionConfig, TensorRef};
use half::bf16;
use rand::rngs::StdRng;
use rand::SeedableRng;

use super::common::device;
use super::harness::random;

/// Rank `rows`' rows of `x` `(batch, seqlen, heads, w)`, in the rank's order.
pub(super) fn rank_rows<X: Copy>(
    x: &[X],
    [batch, seqlen, heads, w]: [usize; 4],
    rows: &[Range<usize>],
) -> Vec<X> {
    let mut out = vec![];
    for b in 0..batch {
        for r in rows.iter().flat_map(|r| r.clone()) {
            out.extend_from_slice(&x[(b * seqlen + r) * heads * w..][..heads * w]);
        }
    }
    out
}

/// Rank `rows`' entries of an LSE `(batch, heads, seqlen)`.
pub(super) fn rank_lse<X: Copy>(
    lse: &[X],
    [batch, seqlen, heads]: [usize; 3],
    rows: &[Range<usize>],
) -> Vec<X> {
    let mut out = vec![];
    for bh in 0..batch * heads {
        for r in rows.iter().flat_map(|r| r.clone()) {
            out.push(lse[bh * seqlen + r]);
        }
    }
    out
}

/// The whole sequence's inputs of a ring case, drawn in one order (Q, K, V, then dO) so that
/// every case of a seed sees the same values: Q `(batch, seqlen, hq, d)`, K and V `(batch,
/// seqlen, hk, d)`, dO like Q.
pub(super) struct WholeCall {
    pub q: Vec<bf16>,
    pub k: Vec<bf16>,
    pub v: Vec<bf16>,
    pub dout: Vec<bf16>,
    pub q_shape: [usize; 4],
    pub kv_shape: [usize; 4],
}

impl WholeCall {
    pub(super) fn random(
        (batch, seqlen, hq, hk, d): (usize, usize, usize, usize, usize),
        seed: u64,
    ) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let (q_shape, kv_shape) = ([batch, seqlen, hq, d], [batch, seqlen, hk, d]);
        let q = random(batch * seqlen * hq * d, &mut rng);
        let k = random(batch * seqlen * hk * d, &mut rng);
        let v = random(batch * seqlen * hk * d, &mut rng);
        let dout = random(batch * seqlen * hq * d, &mut rng);
        WholeCall {
            q,
            k,
            v,
            dout,
            q_shape,
            kv_shape,
        }
    }

    /// Q, K, V and dO as tensors.
    pub(super) fn refs(&self) -> [TensorRef<'_, bf16>; 4] {
        [
            TensorRef::contiguous(&self.q, self.q_shape),
            TensorRef::contiguous(&self.k, self.kv_shape),
            TensorRef::contiguous(&self.v, self.kv_shape),
            TensorRef::contiguous(&self.dout, self.q_shape),
        ]
    }
}

/// Rank `r`'s dQ, dK and dV (`got`, f32) against its rows (`rows_of`) of the whole call's f64
/// gradients under the rule: a line for each that fails, naming `what`.
pub(super) fn rank_gradient_failures(
    what: &str,
    r: usize,
    got: [Vec<f32>; 3],
    (want, base): (&reference::ReferenceGrads, &reference::BaselineGrads),
    whole: &WholeCall,
    rows_of: &[Range<usize>],
) -> Vec<String> {
    let mut failures = vec![];
    for ((name, got), (reference, baseline, shape)) in
        ["dQ", "dK", "dV"].into_iter().zip(got).zip([
            (&want.dq, &base.dq, whole.q_shape),
            (&want.dk, &base.dk, whole.kv_shape),
            (&want.dv, &base.dv, whole.kv_shape),
        ])
    {
        let cmp = reference::compare_gradient::<bf16>(
            &got,
            &rank_rows(reference, shape, rows_of),
            &rank_rows(baseline, shape, rows_of),
        );
        if !cmp.pass {
            failures.push(format!("{what}: rank {r}: {name} {cmp}"));
        }
    }
    failures
}

/// One ring against the whole call: the failures, each naming the case.
fn ring_case(
    cfg: &AttentionConfig,
    sharding: Sharding,
    ranks: usize,
    (batch, seqlen, hq, hk, d): (usize, usize, usize, usize, usize),
    with_sinks: bool,
    seed: u64,
) -> Vec<String> {
    let whole = WholeCall::random((batch, seqlen, hq, hk, d), seed);
    let sinks: Vec<f32> = (0..hq).map(|h| 0.5 * h as f32 - 1.0).collect();
    let [qt, kt, vt, _] = whole.refs();
    let (want, base) = if with_sinks {
        (
            reference::reference_forward_sinks(cfg, qt, kt, vt, &sinks),
            reference::baseline_forward_sinks(cfg, qt, kt, vt, &sinks),
        )
    } else {
        (
            reference::reference_forward(cfg, qt, kt, vt),
            reference::baseline_forward(cfg, qt, kt, vt),
        )
    };

    let (dev, compute) = device();
    let transport = dev.new_stream().unwrap();
    let rows = seqlen / ranks;
    let shard = |x: TensorRef<bf16>, r| ring::shard(x, sharding, ranks, r).unwrap();
    let up = |x: &[bf16]| compute.clone_htod(x).unwrap();
    let shards: Vec<_> = (0..ranks)
        .map(|r| (up(&shard(qt, r)), up(&shard(kt, r)), up(&shard(vt, r))))
        .collect();
    let sinks_d = compute.clone_htod(&sinks).unwrap();
    let sinks_v = sinks_d.as_view();
    let views: Vec<_> = shards
        .iter()
        .map(|(q, k, v)| {
            (
                DeviceTensor::contiguous(q, [batch, rows, hq, d]),
                DeviceTensor::contiguous(k, [batch, rows, hk, d]),
                DeviceTensor::contiguous(v, [batch, rows, hk, d]),
            )
        })
        .collect();
    let rank_inputs: Vec<_> = views
        .iter()
        .map(|(q, k, v)| DeviceForwardInputs {
            q,
            k,
            v,
            sinks: with_sinks.then_some(&sinks_v),
        })
        .collect();
    let mut outs: Vec<_> = (0..ranks)
        .map(|_| {
            (
                up(&vec![bf16::NAN; batch * rows * hq * d]),
                compute
                    .clone_htod(&vec![f32::NAN; batch * hq * rows])
                    .unwrap(),
            )
        })
        .collect();
    let what = format!(
        "{ranks} ranks {sharding:?}, {:?}, ({batch}, {seqlen}, {hq}/{hk}, {d}), sinks {with_sinks}",
        cfg.mask
    );
    {
        let mut o_views: Vec<_> = outs
            .iter_mut()
            .map(|(o, l)| {
                (
                    DeviceTensorMut::contiguous(o, [batch, rows, hq, d]),
                    l.as_view_mut(),
                )
            })
            .collect();
        let mut outputs: Vec<_> = o_views
            .iter_mut()
            .map(|(out, lse)| DeviceRingOutput { out, lse })
            .collect();
        if let Err(e) = dev.ring_forward_into(
            RingStreams {
                compute: &compute,
                transport: &transport,
            },
            cfg,
            sharding,
            &rank_inputs,
            &mut outputs,
        ) {
            return vec![format!("{what}: {e}")];
        }
    }
    let mut failures = vec![];
    for (r, (o, l)) in outs.iter().enumerate() {
        let (o, l) = (
            compute.clone_dtoh(o).unwrap(),
            compute.clone_dtoh(l).unwrap(),
        );
        compute.synchronize().unwrap();
        let rows_of = sharding.rows(seqlen, ranks, r).unwrap();
        let o_shape = [batch, seqlen, hq, d];
        let lse_shape = [batch, seqlen, hq];
        for (name, cmp) in [
            (
                "O",
                compare(
                    &reference::to_f32(&o),
                    &rank_rows(&want.out, o_shape, &rows_of),
                    &rank_rows(&base.out, o_shape, &rows_of),
                ),
            ),
            (
                "LSE",
                compare(
                    &l,
                    &rank_lse(&want.lse, lse_shape, &rows_of),
                    &rank_lse(&base.lse, lse_shape, &rows_of),
                ),
            ),
        ] {
            if !cmp.pass {
                failures.push(format!("{what}: rank {r}: {name} {cmp}"));
            }
        }
    }
    failures
}

#[test]
#[ignore = "needs a GPU"]
fn device_ring_matches_the_whole_call() {
    let causal = AttentionConfig::new().causal(true);
    let mut failures = vec![];
    let mut seed = 0;
    let mut run = |cfg: &AttentionConfig, sharding, ranks, shape, sinks| {
        seed += 1;
        failures.extend(ring_case(cfg, sharding, ranks, shape, sinks, seed));
    };
    for ranks in [1, 2, 3, 4, 8] {
        // Chunks of 24 rows zig-zag (48 contiguous): no multiple of a key block.
        let shape = (2, 48 * ranks, 4, 2, 64);
        run(&causal, Sharding::ZigZag, ranks, shape, false);
        run(
            &AttentionConfig::new(),
            Sharding::Contiguous,
            ranks,
            shape,
            false,
        );
    }
    // A window narrower than a chunk and one that reaches right (pairs over fewer rows or keys
    // than their chunks, two batch entries); sinks; d128, MQA.
    let window = AttentionConfig::new().window(Some(20), Some(0));
    let wide = AttentionConfig::new().window(Some(70), Some(30));
    let full = AttentionConfig::new();
    run(&window, Sharding::ZigZag, 4, (2, 256, 4, 4, 64), false);
    run(&wide, Sharding::Contiguous, 3, (2, 192, 4, 2, 64), false);
    run(&causal, Sharding::ZigZag, 2, (2, 256, 8, 1, 128), true);
    run(&full, Sharding::Contiguous, 4, (1, 256, 4, 2, 128), true);
    // Shards large enough that the transport's copies take about as long as a step's calls.
    run(&causal, Sharding::ZigZag, 4, (1, 4096, 4, 2, 64), false);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Rings the device refuses before anything runs: K of another head dim than Q's, K not
/// contiguous, outputs for another number of ranks, more parts a query chunk than the merge
/// takes (33 ranks zig-zag).
#[test]
#[ignore = "needs a GPU"]
fn device_ring_refusals_are_typed_errors() {
    let (dev, compute) = device();
    let transport = dev.new_stream().unwrap();
    let streams = RingStreams {
        compute: &compute,
        transport: &transport,
    };
    let mut rng = StdRng::seed_from_u64(1);
    let x: Vec<bf16> = random(64 * 4 * 128, &mut rng);
    let buf = compute.clone_htod(&x).unwrap();
    let (q, k, k96) = (
        DeviceTensor::contiguous(&buf, [1, 64, 4, 64]),
        DeviceTensor::contiguous(&buf, [1, 64, 2, 64]),
        DeviceTensor::contiguous(&buf, [1, 64, 2, 96]),
    );
    // K's rows 256 elements apart: not contiguous.
    let strided = DeviceTensor::new(
        buf.slice(..),
        flashattn::Layout::with_strides([1, 64, 2, 64], [64 * 256, 256, 64, 1]),
    );
    let mut o = compute.clone_htod(&vec![bf16::NAN; 64 * 4 * 64]).unwrap();
    let mut l = compute.clone_htod(&vec![f32::NAN; 4 * 64]).unwrap();
    let causal = AttentionConfig::new().causal(true);
    let rank = |k| DeviceForwardInputs {
        q: &q,
        k,
        v: k,
        sinks: None,
    };
    let cases: Vec<(&str, Vec<DeviceForwardInputs<bf16>>)> = vec![
        ("K of head dim 96 under Q's 64", vec![rank(&k96)]),
        ("K not contiguous", vec![rank(&strided)]),
        ("two ranks, one output", vec![rank(&k), rank(&k)]),
        ("33 ranks zig-zag", (0..33).map(|_| rank(&k)).collect()),
    ];
    for (what, ranks) in cases {
        let mut out = DeviceTensorMut::contiguous(&mut o, [1, 64, 4, 64]);
        let mut lse = l.as_view_mut();
        let mut outputs = [DeviceRingOutput {
            out: &mut out,
            lse: &mut lse,
        }];
        let r = dev.ring_forward_into(streams, &causal, Sharding::ZigZag, &ranks, &mut outputs);
        let typed = match (&r, what) {
            (Err(flashattn::Error::ShapeMismatch { .. }), "K of head dim 96 under Q's 64") => true,
            (Err(flashattn::Error::Unsupported { .. }), "K not contiguous") => true,
            (Err(flashattn::Error::InvalidConfig(why)), "two ranks, one output") => {
                why.contains("outputs")
            }
            (Err(flashattn::Error::InvalidConfig(why)), "33 ranks zig-zag") => {
                why.contains("parts")
            }
            _ => false,
        };
        assert!(typed, "{what}: {r:?}");
    }
}

/// One ring backward against the whole call's gradients: O and LSE from the device's whole
/// forward, sharded; each rank's dQ, dK and dV against its rows of the f64 reference's under
/// DESIGN's gradient rule. The failures, each naming the case.
fn ring_backward_case(
    cfg: &AttentionConfig,
    sharding: Sharding,
    ranks: usize,
    (batch, seqlen, hq, hk, d): (usize, usize, usize, usize, usize),
    seed: u64,
) -> Vec<String> {
    use flashattn::cuda::{DeviceBackwardInputs, DeviceForwardInputs, DeviceRingGradients};
    let whole = WholeCall::random((batch, seqlen, hq, hk, d), seed);
    let (q_shape, kv_shape) = (whole.q_shape, whole.kv_shape);
    let (q, k, v, dout) = (&whole.q[..], &whole.k[..], &whole.v[..], &whole.dout[..]);
    let [qt, kt, vt, dt] = whole.refs();
    let want = reference::reference_backward(cfg, qt, kt, vt, dt);
    let base = reference::baseline_backward(cfg, qt, kt, vt, dt);
    let what = format!(
        "backward, {ranks} ranks {sharding:?}, {:?}, ({batch}, {seqlen}, {hq}/{hk}, {d})",
        cfg.mask
    );

    // The whole call's O and LSE, as the ring's forward would give them.
    let (dev, compute) = device();
    let transport = dev.new_stream().unwrap();
    let up = |x: &[bf16]| compute.clone_htod(x).unwrap();
    let (qd, kd, vd) = (up(q), up(k), up(v));
    let mut od = up(&vec![bf16::NAN; q.len()]);
    let mut lse_d = compute
        .clone_htod(&vec![f32::NAN; batch * hq * seqlen])
        .unwrap();
    if let Err(e) = dev.forward_into(
        &compute,
        cfg,
        DeviceForwardInputs::new(
            &DeviceTensor::contiguous(&qd, q_shape),
            &DeviceTensor::contiguous(&kd, kv_shape),
            &DeviceTensor::contiguous(&vd, kv_shape),
        ),
        &mut DeviceTensorMut::contiguous(&mut od, q_shape),
        &mut lse_d.as_view_mut(),
    ) {
        return vec![format!("{what}: the whole forward: {e}")];
    }
    let (o, lse) = (
        compute.clone_dtoh(&od).unwrap(),
        compute.clone_dtoh(&lse_d).unwrap(),
    );
    compute.synchronize().unwrap();

    let rows = seqlen / ranks;
    let shard = |x: &[bf16], shape, r| {
        up(&ring::shard(TensorRef::contiguous(x, shape), sharding, ranks, r).unwrap())
    };
    let inputs: Vec<_> = (0..ranks)
        .map(|r| {
            let rows_of = sharding.rows(seqlen, ranks, r).unwrap();
            (
                [
                    shard(q, q_shape, r),
                    shard(k, kv_shape, r),
                    shard(v, kv_shape, r),
                    shard(&o, q_shape, r),
                    shard(dout, q_shape, r),
                ],
                compute
                    .clone_htod(&rank_lse(&lse, [batch, seqlen, hq], &rows_of))
                    .unwrap(),
            )
        })
        .collect();
    let (q_rank, kv_rank) = ([batch, rows, hq, d], [batch, rows, hk, d]);
    let views: Vec<_> = inputs
        .iter()
        .map(|([q, k, v, o, g], l)| {
            (
                [
                    DeviceTensor::contiguous(q, q_rank),
                    DeviceTensor::contiguous(k, kv_rank),
                    DeviceTensor::contiguous(v, kv_rank),
                    DeviceTensor::contiguous(o, q_rank),
                    DeviceTensor::contiguous(g, q_rank),
                ],
                l.as_view(),
            )
        })
        .collect();
    let rank_inputs: Vec<_> = views
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
    let mut grads: Vec<_> = (0..ranks)
        .map(|_| {
            (
                up(&vec![bf16::NAN; batch * rows * hq * d]),
                up(&vec![bf16::NAN; batch * rows * hk * d]),
                up(&vec![bf16::NAN; batch * rows * hk * d]),
            )
        })
        .collect();
    {
        let mut g_views: Vec<_> = grads
            .iter_mut()
            .map(|(dq, dk, dv)| {
                (
                    DeviceTensorMut::contiguous(dq, q_rank),
                    DeviceTensorMut::contiguous(dk, kv_rank),
                    DeviceTensorMut::contiguous(dv, kv_rank),
                )
            })
            .collect();
        let mut outputs: Vec<_> = g_views
            .iter_mut()
            .map(|(dq, dk, dv)| DeviceRingGradients { dq, dk, dv })
            .collect();
        if let Err(e) = dev.ring_backward_into(
            RingStreams {
                compute: &compute,
                transport: &transport,
            },
            cfg,
            sharding,
            &rank_inputs,
            &mut outputs,
        ) {
            return vec![format!("{what}: {e}")];
        }
    }
    let mut failures = vec![];
    for (r, (dq, dk, dv)) in grads.iter().enumerate() {
        let rows_of = sharding.rows(seqlen, ranks, r).unwrap();
        let got = [dq, dk, dv].map(|g| reference::to_f32(&compute.clone_dtoh(g).unwrap()));
        compute.synchronize().unwrap();
        failures.extend(rank_gradient_failures(
            &what,
            r,
            got,
            (&want, &base),
            &whole,
            &rows_of,
        ));
    }
    failures
}

#[test]
#[ignore = "needs a GPU"]
fn device_ring_backward_matches_the_whole_call() {
    let causal = AttentionConfig::new().causal(true);
    let full = AttentionConfig::new();
    let window = AttentionConfig::new().window(Some(20), Some(0));
    let wide = AttentionConfig::new().window(Some(70), Some(30));
    let cases = [
        (&causal, Sharding::ZigZag, 1, (1, 96, 4, 2, 64)),
        (&causal, Sharding::ZigZag, 2, (2, 192, 4, 2, 64)),
        (&causal, Sharding::ZigZag, 4, (1, 384, 4, 4, 64)),
        (&full, Sharding::Contiguous, 3, (2, 144, 4, 2, 64)),
        (&window, Sharding::ZigZag, 4, (2, 256, 4, 2, 64)),
        (&wide, Sharding::Contiguous, 3, (2, 192, 4, 2, 64)),
        (&causal, Sharding::ZigZag, 2, (1, 256, 8, 1, 128)),
    ];
    let failures: Vec<String> = cases
        .into_iter()
        .enumerate()
        .flat_map(|(i, (cfg, sharding, ranks, shape))| {
            ring_backward_case(cfg, sharding, ranks, shape, 100 + i as u64)
        })
        .collect();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Packed batches over a device ring (`Device::ring_varlen_forward_into` and
/// `ring_varlen_backward_into`): sequences of different lengths (one empty), each a whole number
/// of chunks, each running as its own ring; every rank's O, LSE `(heads, rows)`, dQ, dK and dV
/// against its rows of each sequence's f64 reference.
#[test]
#[ignore = "needs a GPU"]
fn device_varlen_ring_matches_each_sequences_call() {
    use flashattn::cuda::{DeviceBackwardInputs, DeviceRingGradients};
    let (ranks, hq, hk, d) = (2, 4, 2, 64);
    let sharding = Sharding::ZigZag;
    let cfg = AttentionConfig::new().causal(true);
    // Chunks of 24, 16 and 40 rows (four a sequence): 96, 0, 64 and 160 rows.
    let cu: Vec<i32> = vec![0, 96, 96, 160, 320];
    let total = 320;
    let mut rng = StdRng::seed_from_u64(7);
    let q: Vec<bf16> = random(total * hq * d, &mut rng);
    let k: Vec<bf16> = random(total * hk * d, &mut rng);
    let v: Vec<bf16> = random(total * hk * d, &mut rng);
    let dout: Vec<bf16> = random(total * hq * d, &mut rng);
    let (q_shape, kv_shape) = ([1, total, hq, d], [1, total, hk, d]);
    let (dev, compute) = device();
    let transport = dev.new_stream().unwrap();
    let streams = RingStreams {
        compute: &compute,
        transport: &transport,
    };
    let up = |x: &[bf16]| compute.clone_htod(x).unwrap();
    let shard = |x: &[bf16], shape, r| {
        ring::shard_packed(TensorRef::contiguous(x, shape), &cu, sharding, ranks, r).unwrap()
    };
    let rows = total / ranks;
    let (q_rank, kv_rank) = ([1, rows, hq, d], [1, rows, hk, d]);
    let ins: Vec<_> = (0..ranks)
        .map(|r| {
            [
                up(&shard(&q, q_shape, r)),
                up(&shard(&k, kv_shape, r)),
                up(&shard(&v, kv_shape, r)),
                up(&shard(&dout, q_shape, r)),
            ]
        })
        .collect();
    let views: Vec<_> = ins
        .iter()
        .map(|[q, k, v, g]| {
            [
                DeviceTensor::contiguous(q, q_rank),
                DeviceTensor::contiguous(k, kv_rank),
                DeviceTensor::contiguous(v, kv_rank),
                DeviceTensor::contiguous(g, q_rank),
            ]
        })
        .collect();
    // The forward.
    let mut outs: Vec<_> = (0..ranks)
        .map(|_| {
            (
                up(&vec![bf16::NAN; rows * hq * d]),
                compute.clone_htod(&vec![f32::NAN; hq * rows]).unwrap(),
            )
        })
        .collect();
    {
        let rank_inputs: Vec<_> = views
            .iter()
            .map(|[q, k, v, _]| DeviceForwardInputs {
                q,
                k,
                v,
                sinks: None,
            })
            .collect();
        let mut o_views: Vec<_> = outs
            .iter_mut()
            .map(|(o, l)| (DeviceTensorMut::contiguous(o, q_rank), l.as_view_mut()))
            .collect();
        let mut outputs: Vec<_> = o_views
            .iter_mut()
            .map(|(out, lse)| DeviceRingOutput { out, lse })
            .collect();
        dev.ring_varlen_forward_into(streams, &cfg, sharding, &cu, &rank_inputs, &mut outputs)
            .unwrap();
    }
    // The backward over the forward's O and LSE.
    let mut grads: Vec<_> = (0..ranks)
        .map(|_| {
            (
                up(&vec![bf16::NAN; rows * hq * d]),
                up(&vec![bf16::NAN; rows * hk * d]),
                up(&vec![bf16::NAN; rows * hk * d]),
            )
        })
        .collect();
    {
        let o_views: Vec<_> = outs
            .iter()
            .map(|(o, l)| (DeviceTensor::contiguous(o, q_rank), l.as_view()))
            .collect();
        let rank_inputs: Vec<_> = views
            .iter()
            .zip(&o_views)
            .map(|([q, k, v, dout], (out, lse))| DeviceBackwardInputs {
                q,
                k,
                v,
                out,
                dout,
                lse,
                sinks: None,
            })
            .collect();
        let mut g_views: Vec<_> = grads
            .iter_mut()
            .map(|(dq, dk, dv)| {
                (
                    DeviceTensorMut::contiguous(dq, q_rank),
                    DeviceTensorMut::contiguous(dk, kv_rank),
                    DeviceTensorMut::contiguous(dv, kv_rank),
                )
            })
            .collect();
        let mut outputs: Vec<_> = g_views
            .iter_mut()
            .map(|(dq, dk, dv)| DeviceRingGradients { dq, dk, dv })
            .collect();
        dev.ring_varlen_backward_into(streams, &cfg, sharding, &cu, &rank_inputs, &mut outputs)
            .unwrap();
    }

    // Each sequence's reference, its rows of each rank gathered in the rank's order.
    let mut want: Vec<[Vec<f64>; 5]> = vec![Default::default(); ranks];
    let mut base: Vec<[Vec<f32>; 5]> = vec![Default::default(); ranks];
    let mut lse_want: Vec<Vec<Vec<f64>>> = vec![vec![vec![]; hq]; ranks];
    let mut lse_base: Vec<Vec<Vec<f32>>> = vec![vec![vec![]; hq]; ranks];
    for w in cu.windows(2) {
        let (first, len) = (w[0] as usize, (w[1] - w[0]) as usize);
        if len == 0 {
            continue;
        }
        let seq = |x: &[bf16], h: usize| x[first * h * d..][..len * h * d].to_vec();
        let (qs, ks, vs, gs) = (seq(&q, hq), seq(&k, hk), seq(&v, hk), seq(&dout, hq));
        let (qt, kt, vt, gt) = (
            TensorRef::contiguous(&qs, [1, len, hq, d]),
            TensorRef::contiguous(&ks, [1, len, hk, d]),
            TensorRef::contiguous(&vs, [1, len, hk, d]),
            TensorRef::contiguous(&gs, [1, len, hq, d]),
        );
        let (f, fb) = (
            reference::reference_forward(&cfg, qt, kt, vt),
            reference::baseline_forward(&cfg, qt, kt, vt),
        );
        let (g, gb) = (
            reference::reference_backward(&cfg, qt, kt, vt, gt),
            reference::baseline_backward(&cfg, qt, kt, vt, gt),
        );
        for r in 0..ranks {
            let rows_of = sharding.rows(len, ranks, r).unwrap();
            let qs_shape = [1, len, hq, d];
            let kv_s = [1, len, hk, d];
            for (i, (x, shape)) in [
                (&f.out, qs_shape),
                (&g.dq, qs_shape),
                (&g.dk, kv_s),
                (&g.dv, kv_s),
            ]
            .into_iter()
            .enumerate()
            {
                want[r][i].extend(rank_rows(x, shape, &rows_of));
            }
            for (i, (x, shape)) in [
                (&fb.out, qs_shape),
                (&gb.dq, qs_shape),
                (&gb.dk, kv_s),
                (&gb.dv, kv_s),
            ]
            .into_iter()
            .enumerate()
            {
                base[r][i].extend(rank_rows(x, shape, &rows_of));
            }
            for h in 0..hq {
                let one = |l: &[f64]| rank_lse(&l[h * len..][..len], [1, len, 1], &rows_of);
                lse_want[r][h].extend(one(&f.lse));
                lse_base[r][h].extend(rank_lse(&fb.lse[h * len..][..len], [1, len, 1], &rows_of));
            }
        }
    }
    let mut failures = vec![];
    for r in 0..ranks {
        let (o, l) = (&outs[r].0, &outs[r].1);
        let (dq, dk, dv) = &grads[r];
        let host = |x: &cudarc::driver::CudaSlice<bf16>| {
            reference::to_f32(&compute.clone_dtoh(x).unwrap())
        };
        let lse = compute.clone_dtoh(l).unwrap();
        compute.synchronize().unwrap();
        let c = compare(&host(o), &want[r][0], &base[r][0]);
        if !c.pass {
            failures.push(format!("rank {r}: O {c}"));
        }
        let c = compare(&lse, &lse_want[r].concat(), &lse_base[r].concat());
        if !c.pass {
            failures.push(format!("rank {r}: LSE {c}"));
        }
        for (i, (name, g)) in [("dQ", dq), ("dK", dk), ("dV", dv)].into_iter().enumerate() {
            let c = reference::compare_gradient::<bf16>(&host(g), &want[r][i + 1], &base[r][i + 1]);
            if !c.pass {
                failures.push(format!("rank {r}: {name} {c}"));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
