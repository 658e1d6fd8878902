//! Packed (varlen) batches on the CPU backend: each sequence against the f64 reference of its
//! own dense problem under the correctness rule (O, LSE, dQ, dK, dV), V's head dim apart from
//! Q's, equal lengths against the dense batch bit for bit, `seqused_k`, empty sequences, and
//! malformed offsets as typed errors.

mod harness;

use flashattn::varlen::{self, Seqlens};
use flashattn::{
    AttentionConfig, BackwardInputs, Element, Error, ForwardInputs, Layout, Operand, TensorRef,
};
use half::bf16;
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::SeedableRng;

use harness::random;
use harness::varlen::{check_outputs, offsets, Batch};
use harness::Outputs;

/// Runs the batch through the CPU varlen forward and backward with `used` keys per sequence
/// (all without) and checks every sequence.
fn check<T: Element>(batch: &Batch<T>, cfg: &AttentionConfig, used: Option<&[i32]>) {
    let (cu_q, cu_k) = batch.cu();
    let (max_q, max_k) = batch.max();
    let mut seqs = Seqlens::new(&cu_q, &cu_k, max_q, max_k).unwrap();
    if let Some(used) = used {
        seqs = seqs.with_seqused_k(used).unwrap();
    }
    let (q, k, v) = (
        batch.q_view(&batch.q),
        batch.k_view(&batch.k),
        batch.v_view(&batch.v),
    );
    let fwd = varlen::forward(cfg, &seqs, ForwardInputs::new(q, k, v)).unwrap();
    let grads = varlen::backward(
        cfg,
        &seqs,
        BackwardInputs {
            q,
            k,
            v,
            out: batch.o_view(&fwd.out),
            dout: batch.o_view(&batch.dout),
            lse: &fwd.lse,
            sinks: None,
        },
    )
    .unwrap();
    let got = Outputs {
        out: fwd.out,
        lse: fwd.lse,
        dq: grads.dq,
        dk: grads.dk,
        dv: grads.dv,
        dsinks: grads.dsinks,
    };
    check_outputs(batch, cfg, used, &got);
}

#[test]
fn mixed_lengths_match_each_sequence_s_reference() {
    // Empty sequences, single rows, lengths that are no block multiple, more queries than keys.
    let q_lens = [37, 0, 1, 130, 64, 5, 0];
    let k_lens = [37, 12, 3, 130, 70, 0, 9];
    let configs = [
        AttentionConfig::new(),
        AttentionConfig::new().causal(true),
        AttentionConfig::new().window(Some(20), Some(7)),
        AttentionConfig::new().causal(true).softcap(5.0),
    ];
    for (i, cfg) in configs.iter().enumerate() {
        check(
            &Batch::<f32>::new(&q_lens, &k_lens, (4, 2), 32, i as u64),
            cfg,
            None,
        );
        check(
            &Batch::<bf16>::new(&q_lens, &k_lens, (2, 2), 64, 10 + i as u64),
            cfg,
            None,
        );
    }
}

/// V's head dim apart from Q's and K's (192/128, a wider V at 40/72): O, dO and dV of V's head
/// dim per sequence, against each sequence's reference; with `seqused_k`; and O or dO shaped
/// with Q's head dim refused.
#[test]
fn v_head_dim_apart_from_q_per_sequence() {
    let q_lens = [37, 0, 1, 113, 17, 5];
    let k_lens = [37, 12, 3, 113, 40, 0];
    let configs = [
        AttentionConfig::new(),
        AttentionConfig::new().causal(true),
        AttentionConfig::new()
            .window(Some(20), Some(7))
            .softcap(5.0),
    ];
    for (i, cfg) in configs.iter().enumerate() {
        let seed = 20 + i as u64;
        check(
            &Batch::<bf16>::with_head_dim_v(&q_lens, &k_lens, (4, 2), (192, 128), seed),
            cfg,
            None,
        );
        check(
            &Batch::<f32>::with_head_dim_v(&q_lens, &k_lens, (2, 1), (40, 72), seed),
            cfg,
            None,
        );
    }
    let batch = Batch::<f32>::with_head_dim_v(&[20, 33], &[40, 33], (2, 1), (64, 32), 25);
    check(&batch, &AttentionConfig::new().causal(true), Some(&[25, 7]));

    let (cu_q, cu_k) = batch.cu();
    let seqs = Seqlens::new(&cu_q, &cu_k, 33, 40).unwrap();
    let (q, k, v) = (
        batch.q_view(&batch.q),
        batch.k_view(&batch.k),
        batch.v_view(&batch.v),
    );
    let fwd = varlen::forward(&AttentionConfig::new(), &seqs, ForwardInputs::new(q, k, v)).unwrap();
    assert_eq!(fwd.out.len(), 53 * 2 * 32);
    // O and dO with Q's head dim (64), as if V's were Q's.
    let wide = vec![0.5f32; 53 * 2 * 64];
    for (operand, out, dout) in [
        (Operand::Out, batch.q_view(&wide), batch.o_view(&batch.dout)),
        (Operand::DOut, batch.o_view(&fwd.out), batch.q_view(&wide)),
    ] {
        let e = varlen::backward(
            &AttentionConfig::new(),
            &seqs,
            BackwardInputs {
                q,
                k,
                v,
                out,
                dout,
                lse: &fwd.lse,
                sinks: None,
            },
        )
        .unwrap_err();
        assert_eq!(
            e,
            Error::ShapeMismatch {
                operand,
                expected: [1, 53, 2, 32],
                found: [1, 53, 2, 64],
            }
        );
    }
}

#[test]
fn seqused_k_attends_to_the_first_keys_only() {
    let batch = Batch::<f32>::new(&[20, 33, 8], &[40, 33, 16], (2, 1), 16, 3);
    check(
        &batch,
        &AttentionConfig::new().causal(true),
        Some(&[25, 33, 0]),
    );
    check(&batch, &AttentionConfig::new(), Some(&[1, 0, 16]));
}

#[test]
fn equal_lengths_match_the_dense_batch_bit_for_bit() {
    let (b, s, hq, hk, d) = (3, 45, 4, 2, 32);
    let batch = Batch::<bf16>::new(&[s; 3], &[s; 3], (hq, hk), d, 9);
    let cfg = AttentionConfig::new().causal(true);
    let (cu, _) = batch.cu();
    let seqs = Seqlens::new(&cu, &cu, s, s).unwrap();
    let (pq, pk, pv) = (
        batch.q_view(&batch.q),
        batch.k_view(&batch.k),
        batch.k_view(&batch.v),
    );
    let packed = varlen::forward(&cfg, &seqs, ForwardInputs::new(pq, pk, pv)).unwrap();
    // The same memory seen as a dense (b, s, h, d) batch.
    let dq = TensorRef::contiguous(&batch.q[..], [b, s, hq, d]);
    let dk = TensorRef::contiguous(&batch.k[..], [b, s, hk, d]);
    let dv = TensorRef::contiguous(&batch.v[..], [b, s, hk, d]);
    let dense = flashattn::forward(&cfg, ForwardInputs::new(dq, dk, dv)).unwrap();
    assert_eq!(packed.out, dense.out);
    for bi in 0..b {
        for h in 0..hq {
            for i in 0..s {
                // varlen (heads, total) against dense (batch, heads, seqlen)
                assert_eq!(
                    packed.lse[h * b * s + bi * s + i].to_bits(),
                    dense.lse[(bi * hq + h) * s + i].to_bits()
                );
            }
        }
    }
    let gp = varlen::backward(
        &cfg,
        &seqs,
        BackwardInputs {
            q: pq,
            k: pk,
            v: pv,
            out: batch.q_view(&packed.out),
            dout: batch.q_view(&batch.dout),
            lse: &packed.lse,
            sinks: None,
        },
    )
    .unwrap();
    let gd = flashattn::backward(
        &cfg,
        BackwardInputs {
            q: dq,
            k: dk,
            v: dv,
            out: TensorRef::contiguous(&dense.out, [b, s, hq, d]),
            dout: TensorRef::contiguous(&batch.dout, [b, s, hq, d]),
            lse: &dense.lse,
            sinks: None,
        },
    )
    .unwrap();
    assert_eq!((gp.dq, gp.dk, gp.dv), (gd.dq, gd.dk, gd.dv));
}

/// Attention sinks over a packed host batch: every sequence as its own dense call with the same
/// sinks, bit for bit (O, LSE, dQ, dK, dV), the sinks' gradient the sequences' summed in order;
/// a sequence with no key gets LSE = its head's sink; a short sinks vector is refused.
#[test]
fn sinks_over_a_packed_host_batch_match_each_sequence_alone() {
    let (q_lens, k_lens) = ([5, 3, 4], [5, 3, 0]);
    let batch = Batch::<f32>::new(&q_lens, &k_lens, (2, 2), 8, 3);
    let (cu_q, cu_k) = batch.cu();
    let seqs = Seqlens::new(&cu_q, &cu_k, 5, 5).unwrap();
    let cfg = AttentionConfig::new().causal(true);
    let sinks = [0.5f32, -1.25];
    let (q, k, v) = (
        batch.q_view(&batch.q),
        batch.k_view(&batch.k),
        batch.k_view(&batch.v),
    );
    let fwd = varlen::forward(&cfg, &seqs, ForwardInputs::new(q, k, v).with_sinks(&sinks)).unwrap();
    let grads = varlen::backward(
        &cfg,
        &seqs,
        BackwardInputs {
            q,
            k,
            v,
            out: batch.q_view(&fwd.out),
            dout: batch.q_view(&batch.dout),
            lse: &fwd.lse,
            sinks: Some(&sinks),
        },
    )
    .unwrap();
    let (h, d, total_q) = (2, 8, cu_q[3] as usize);
    let rows = |x: &[f32], start: i32, len: usize| -> Vec<f32> {
        x[start as usize * h * d..][..len * h * d].to_vec()
    };
    let mut dsinks = [0f32; 2];
    for b in 0..3 {
        let (nq, nk) = (q_lens[b], k_lens[b]);
        let (sq, sk) = (rows(&batch.q, cu_q[b], nq), rows(&batch.k, cu_k[b], nk));
        let (sv, sdo) = (rows(&batch.v, cu_k[b], nk), rows(&batch.dout, cu_q[b], nq));
        let lse_of = |lse: &[f32], head: usize| -> Vec<f32> {
            lse[head * total_q + cu_q[b] as usize..][..nq].to_vec()
        };
        if nk == 0 {
            for (head, &sink) in sinks.iter().enumerate() {
                assert!(lse_of(&fwd.lse, head).iter().all(|&l| l == sink));
            }
            assert!(rows(&fwd.out, cu_q[b], nq).iter().all(|&x| x == 0.0));
            continue;
        }
        fn t(x: &[f32], n: usize) -> TensorRef<'_, f32> {
            TensorRef::contiguous(x, [1, n, 2, 8])
        }
        let one = flashattn::forward(
            &cfg,
            ForwardInputs::new(t(&sq, nq), t(&sk, nk), t(&sv, nk)).with_sinks(&sinks),
        )
        .unwrap();
        assert_eq!(rows(&fwd.out, cu_q[b], nq), one.out, "sequence {b}: O");
        for head in 0..h {
            assert_eq!(
                lse_of(&fwd.lse, head),
                one.lse[head * nq..][..nq],
                "sequence {b}: LSE"
            );
        }
        let g = flashattn::backward(
            &cfg,
            BackwardInputs {
                q: t(&sq, nq),
                k: t(&sk, nk),
                v: t(&sv, nk),
                out: t(&one.out, nq),
                dout: t(&sdo, nq),
                lse: &one.lse,
                sinks: Some(&sinks),
            },
        )
        .unwrap();
        assert_eq!(rows(&grads.dq, cu_q[b], nq), g.dq, "sequence {b}: dQ");
        assert_eq!(rows(&grads.dk, cu_k[b], nk), g.dk, "sequence {b}: dK");
        assert_eq!(rows(&grads.dv, cu_k[b], nk), g.dv, "sequence {b}: dV");
        let gs = g.dsinks.unwrap();
        dsinks.iter_mut().zip(&gs).for_each(|(t, x)| *t += x);
    }
    assert_eq!(grads.dsinks.unwrap(), dsinks);
    let e =
        varlen::forward(&cfg, &seqs, ForwardInputs::new(q, k, v).with_sinks(&[0.5])).unwrap_err();
    assert!(
        matches!(
            e,
            Error::BufferTooSmall {
                operand: Operand::Sinks,
                ..
            }
        ),
        "{e:?}"
    );
}

#[test]
fn malformed_offsets_are_typed_errors() {
    let bad = |r: flashattn::Result<Seqlens>| matches!(r, Err(Error::InvalidSeqlens(_)));
    assert!(bad(Seqlens::new(&[], &[], 4, 4)));
    assert!(bad(Seqlens::new(&[1, 4], &[0, 4], 4, 4)), "not from 0");
    assert!(
        bad(Seqlens::new(&[0, 4, 2], &[0, 4, 8], 4, 4)),
        "decreasing"
    );
    assert!(
        bad(Seqlens::new(&[0, 5], &[0, 4], 4, 4)),
        "past max_seqlen_q"
    );
    assert!(
        bad(Seqlens::new(&[0, 4], &[0, 4, 8], 4, 4)),
        "counts differ"
    );
    assert!(bad(Seqlens::new(
        &[0, i32::MAX, i32::MIN],
        &[0, 1, 2],
        usize::MAX,
        4
    )));
    let ok = Seqlens::new(&[0, 2, 4], &[0, 3, 6], 2, 3).unwrap();
    assert!(matches!(
        ok.with_seqused_k(&[3]),
        Err(Error::InvalidSeqlens(_))
    ));
    assert!(matches!(
        ok.with_seqused_k(&[4, 0]),
        Err(Error::InvalidSeqlens(_))
    ));
    assert!(matches!(
        ok.with_seqused_k(&[-1, 0]),
        Err(Error::InvalidSeqlens(_))
    ));
    // Tensors that disagree with the offsets: the last offset is not their row count.
    let x = vec![0.5f32; 5 * 2 * 8];
    let t = TensorRef::contiguous(&x, [1, 5, 2, 8]);
    let e = varlen::forward(&AttentionConfig::new(), &ok, ForwardInputs::new(t, t, t)).unwrap_err();
    assert!(matches!(e, Error::ShapeMismatch { .. }), "{e:?}");
    // A batch axis other than 1.
    let t2 = TensorRef::contiguous(&x[..4 * 2 * 8], [2, 2, 2, 8]);
    let e =
        varlen::forward(&AttentionConfig::new(), &ok, ForwardInputs::new(t2, t2, t2)).unwrap_err();
    assert!(matches!(e, Error::ShapeMismatch { .. }), "{e:?}");
}

/// Q, K and V as strided views into one (total, 3, heads, d) buffer, as a fused QKV
/// projection leaves them: read in place, the same answer as packed copies.
#[test]
fn views_into_a_fused_qkv_buffer_match_packed_copies() {
    let (lens, h, d) = ([7usize, 0, 19, 4], 2, 16);
    let total: usize = lens.iter().sum();
    let mut rng = StdRng::seed_from_u64(21);
    let qkv: Vec<f32> = random(total * 3 * h * d, &mut rng);
    let strides = [total * 3 * h * d, 3 * h * d, d, 1];
    let view = |i: usize| {
        TensorRef::new(
            &qkv[i * h * d..],
            Layout::with_strides([1, total, h, d], strides),
        )
    };
    let packed = |i: usize| -> Vec<f32> {
        (0..total)
            .flat_map(|t| qkv[(t * 3 + i) * h * d..(t * 3 + i + 1) * h * d].to_vec())
            .collect()
    };
    let cu = offsets(&lens);
    let seqs = Seqlens::new(&cu, &cu, 19, 19).unwrap();
    let cfg = AttentionConfig::new().causal(true);
    let strided =
        varlen::forward(&cfg, &seqs, ForwardInputs::new(view(0), view(1), view(2))).unwrap();
    let (pq, pk, pv) = (packed(0), packed(1), packed(2));
    let shape = [1, total, h, d];
    let copied = varlen::forward(
        &cfg,
        &seqs,
        ForwardInputs::new(
            TensorRef::contiguous(&pq, shape),
            TensorRef::contiguous(&pk, shape),
            TensorRef::contiguous(&pv, shape),
        ),
    )
    .unwrap();
    assert_eq!(strided.out, copied.out);
    assert_eq!(strided.lse, copied.lse);
}

/// Valid offsets, or valid offsets with one value changed (most then malformed).
fn offsets_maybe_corrupted() -> impl Strategy<Value = (Vec<i32>, Vec<i32>, usize, usize)> {
    (
        prop::collection::vec((0usize..10, 0usize..10), 1..5),
        any::<bool>(),
        any::<prop::sample::Index>(),
        -3i32..3,
    )
        .prop_map(|(lens, corrupt, at, delta)| {
            let q: Vec<usize> = lens.iter().map(|l| l.0).collect();
            let k: Vec<usize> = lens.iter().map(|l| l.1).collect();
            let (max_q, max_k) = (*q.iter().max().unwrap(), *k.iter().max().unwrap());
            let (mut cu_q, cu_k) = (offsets(&q), offsets(&k));
            if corrupt {
                let i = at.index(cu_q.len());
                cu_q[i] += delta;
            }
            (cu_q, cu_k, max_q, max_k)
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]
    /// Any offsets: refused (`InvalidSeqlens`) exactly when malformed (not from 0, decreasing, or
    /// a sequence longer than its bound); otherwise each sequence's O and LSE those of the dense
    /// call over its rows, bit for bit (+inf LSE and O 0 on rows that see no key), or a typed
    /// error where there are no rows at all; never a panic.
    #[test]
    fn any_offsets_give_an_error_or_a_full_answer(
        (cu_q, cu_k, max_q, max_k) in offsets_maybe_corrupted(),
        causal in any::<bool>(),
    ) {
        let well_formed = |cu: &[i32], max: usize| {
            cu.first() == Some(&0)
                && cu.windows(2).all(|w| w[0] <= w[1] && (w[1] - w[0]) as usize <= max)
        };
        let seqs = match Seqlens::new(&cu_q, &cu_k, max_q, max_k) {
            Ok(seqs) => seqs,
            Err(e) => {
                prop_assert!(matches!(e, Error::InvalidSeqlens(_)), "{e:?}");
                prop_assert!(!(well_formed(&cu_q, max_q) && well_formed(&cu_k, max_k)), "{e:?}");
                return Ok(());
            }
        };
        prop_assert!(well_formed(&cu_q, max_q) && well_formed(&cu_k, max_k), "{cu_q:?} accepted");
        let (tq, tk) = (seqs.total_q().max(1), seqs.total_k().max(1));
        let (h, d) = (2, 8);
        let xq: Vec<f32> = (0..tq * h * d).map(|i| (i as f32 * 0.37).sin()).collect();
        let xk: Vec<f32> = (0..tk * h * d).map(|i| (i as f32 * 0.21).cos()).collect();
        let q = TensorRef::contiguous(&xq, [1, tq, h, d]);
        let k = TensorRef::contiguous(&xk, [1, tk, h, d]);
        let cfg = AttentionConfig::new().causal(causal);
        let f = match varlen::forward(&cfg, &seqs, ForwardInputs::new(q, k, k)) {
            Ok(f) => f,
            Err(e) => {
                prop_assert!(matches!(e, Error::ShapeMismatch { .. } | Error::EmptyDimension { .. }), "{e:?}");
                prop_assert!(seqs.total_q() == 0 || seqs.total_k() == 0, "{e:?}");
                return Ok(());
            }
        };
        let total = seqs.total_q();
        for b in 0..seqs.batch() {
            let (rows, keys) = (seqs.queries(b), seqs.keys(b));
            if rows.is_empty() {
                continue;
            }
            let o = &f.out[rows.start * h * d..rows.end * h * d];
            let lse = |head: usize| &f.lse[head * total + rows.start..head * total + rows.end];
            if keys.is_empty() {
                prop_assert!(o.iter().all(|&x| x == 0.0), "sequence {b}: O without keys");
                for head in 0..h {
                    prop_assert!(lse(head).iter().all(|&l| l == f32::INFINITY));
                }
                continue;
            }
            let qb = TensorRef::contiguous(&xq[rows.start * h * d..rows.end * h * d], [1, rows.len(), h, d]);
            let kb = TensorRef::contiguous(&xk[keys.start * h * d..keys.end * h * d], [1, keys.len(), h, d]);
            let want = flashattn::forward(&cfg, ForwardInputs::new(qb, kb, kb)).unwrap();
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            prop_assert_eq!(bits(o), bits(&want.out), "sequence {} O", b);
            for head in 0..h {
                let dense = &want.lse[head * rows.len()..(head + 1) * rows.len()];
                prop_assert_eq!(bits(lse(head)), bits(dense), "sequence {} head {} LSE", b, head);
            }
        }
    }
}
