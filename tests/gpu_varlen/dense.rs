//! Packed against dense: equal lengths against the dense kernels, and each sequence of a mixed
//! batch against a dense call on its rows alone, bit for bit.

use super::*;

/// The dense forward (with `cfgs.0`), then the backward from its O and LSE (with `cfgs.1`), over
/// `batch`'s buffers seen as Q `shapes.0` and K, V `shapes.1`; the outputs downloaded.
fn dense_call<T: Element + DeviceRepr>(
    dev: &Device,
    stream: &Arc<CudaStream>,
    batch: &Batch<T>,
    cfgs: (&AttentionConfig, &AttentionConfig),
    (q_shape, k_shape): ([usize; 4], [usize; 4]),
) -> Outputs<T> {
    let mut t = upload(stream, batch);
    let layouts = (Layout::contiguous(q_shape), Layout::contiguous(k_shape));
    t.forward(dev, stream, cfgs.0, None, layouts).unwrap();
    t.backward(dev, stream, cfgs.1, None, layouts).unwrap();
    t.download(stream)
}

/// Equal lengths: the packed call and the dense `(batch, seqlen)` call over the same memory run
/// the same kernels on the same rows, so every output is the same bits (in deterministic mode:
/// the atomic mode's f32 sums may add in another order on each run).
#[test]
#[ignore = "needs a GPU"]
fn equal_lengths_match_the_dense_kernels_bit_for_bit() {
    let (b, s, hq, hk, d) = (4, 300, 4, 2, 128);
    let batch = Batch::<bf16>::new(&[s; 4], &[s; 4], (hq, hk), d, 9);
    let (dev, stream) = device();
    for backend in [Backend::Sm80, Backend::Auto] {
        let cfg = AttentionConfig::new()
            .causal(true)
            .deterministic(true)
            .backend(backend);
        let (cu, _) = batch.cu();
        let mut packed = upload(&stream, &batch);
        let (_, bwd_plan) = run(
            &dev,
            &stream,
            &batch,
            &cfg,
            (&cu, &cu),
            None,
            (s, s),
            &mut packed,
        )
        .unwrap();
        let packed = packed.download(&stream);
        // The dense backward on the backend the packed one ran on.
        let bwd_cfg = cfg.clone().backend(bwd_plan.backend);

        let dense = dense_call(
            &dev,
            &stream,
            &batch,
            (&cfg, &bwd_cfg),
            ([b, s, hq, d], [b, s, hk, d]),
        );
        let bits = |x: &[bf16]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&packed.out), bits(&dense.out), "{backend:?} O");
        for bi in 0..b {
            for h in 0..hq {
                for i in 0..s {
                    // packed (heads, total) against dense (batch, heads, seqlen)
                    assert_eq!(
                        packed.lse[h * b * s + bi * s + i].to_bits(),
                        dense.lse[(bi * hq + h) * s + i].to_bits(),
                        "{backend:?} LSE"
                    );
                }
            }
        }
        for (name, p, q) in [
            ("dQ", &packed.dq, &dense.dq),
            ("dK", &packed.dk, &dense.dk),
            ("dV", &packed.dv, &dense.dv),
        ] {
            assert_eq!(bits(p), bits(q), "{backend:?} {name}");
        }
    }
}

/// Every sequence of a mixed batch, run alone as a dense call on copies of its rows, gives the
/// same bits as the packed call (O, LSE, dQ, dK, dV): packing changes which rows a work unit
/// reads, not what it computes. (f16, d64, on the sm80 kernels: the one case family where the
/// reference rule fails marginally on a 1 x 3 sequence.)
#[test]
#[ignore = "needs a GPU"]
fn each_sequence_matches_a_dense_call_on_its_rows_bit_for_bit() {
    let (dev, stream) = device();
    let (hq, hk, d) = (2, 2, 64);
    let batch = Batch::<f16>::new(&MIXED_Q, &MIXED_K, (hq, hk), d, 164);
    let cfg = AttentionConfig::new().backend(Backend::Sm80);
    let (cu_q, cu_k) = batch.cu();
    let mut t = upload(&stream, &batch);
    run(
        &dev,
        &stream,
        &batch,
        &cfg,
        (&cu_q, &cu_k),
        None,
        batch.max(),
        &mut t,
    )
    .unwrap();
    let packed = t.download(&stream);
    let total_q: usize = MIXED_Q.iter().sum();
    let bits = |x: &[f16]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    for b in 0..MIXED_Q.len() {
        let (q0, k0) = (cu_q[b] as usize, cu_k[b] as usize);
        let (sq, sk) = (MIXED_Q[b], MIXED_K[b]);
        if sq == 0 || sk == 0 {
            continue;
        }
        let part =
            |x: &[f16], r0: usize, n: usize, h: usize| x[r0 * h * d..(r0 + n) * h * d].to_vec();
        let one = Batch {
            q_lens: vec![sq],
            k_lens: vec![sk],
            heads_q: hq,
            heads_kv: hk,
            d,
            dv: d,
            q: part(&batch.q, q0, sq, hq),
            k: part(&batch.k, k0, sk, hk),
            v: part(&batch.v, k0, sk, hk),
            dout: part(&batch.dout, q0, sq, hq),
        };
        let dense = dense_call(
            &dev,
            &stream,
            &one,
            (&cfg, &cfg),
            ([1, sq, hq, d], [1, sk, hk, d]),
        );
        assert_eq!(
            bits(&part(&packed.out, q0, sq, hq)),
            bits(&dense.out),
            "sequence {b} O"
        );
        for h in 0..hq {
            let got = &packed.lse[h * total_q + q0..h * total_q + q0 + sq];
            let want = &dense.lse[h * sq..(h + 1) * sq];
            let same = got
                .iter()
                .zip(want)
                .all(|(a, w)| a.to_bits() == w.to_bits());
            assert!(same, "sequence {b} LSE head {h}");
        }
        assert_eq!(
            bits(&part(&packed.dq, q0, sq, hq)),
            bits(&dense.dq),
            "sequence {b} dQ"
        );
        assert_eq!(
            bits(&part(&packed.dk, k0, sk, hk)),
            bits(&dense.dk),
            "sequence {b} dK"
        );
        assert_eq!(
            bits(&part(&packed.dv, k0, sk, hk)),
            bits(&dense.dv),
            "sequence {b} dV"
        );
        println!("sequence {b} ({sq}x{sk}): packed = dense, bit for bit");
    }
}
