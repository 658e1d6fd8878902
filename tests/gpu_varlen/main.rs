//! Packed (varlen) batches on the GPU: every sequence's O, LSE, dQ, dK and dV against the f64
//! reference of its own dense problem under the correctness rule (outputs poisoned with NaN
//! before the launches), equal lengths against the dense kernels bit for bit, `seqused_k`, and
//! malformed device offsets that must stay inside the buffers. `#[ignore]`d: run on the device
//! with `--include-ignored` (each test fails without a GPU).
#![cfg(feature = "cuda")]

mod combine;
#[path = "../common/mod.rs"]
mod common;
mod dense;
mod fp8;
#[path = "../harness/mod.rs"]
mod harness;
mod kvcache;
mod kvcache_fp8;
mod kvcache_step;
mod ring;
#[cfg(feature = "nccl")]
mod ring_nccl;

use std::sync::Arc;

use cudarc::driver::DeviceRepr;
use flashattn::cuda::{CudaStream, Device, DeviceSeqlens};
use flashattn::{AttentionConfig, Backend, Element, Layout, Plan};
use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use common::{device, OnDevice, Views};
use harness::varlen::{check_outputs, Batch};
use harness::Outputs;

/// The batch's tensors on the device, the outputs poisoned with NaN.
fn upload<T: Element + DeviceRepr>(stream: &Arc<CudaStream>, batch: &Batch<T>) -> OnDevice<T> {
    let total_q: usize = batch.q_lens.iter().sum();
    let tensors = [&batch.q, &batch.k, &batch.v, &batch.dout].map(|x| &x[..]);
    OnDevice::upload(stream, tensors, batch.heads_q * total_q, None)
}

/// Runs the varlen forward, then the backward from its O and LSE, with `cfg`, offsets `cu`
/// (as given, well formed or not) and bounds `max`; returns the plans.
#[allow(clippy::too_many_arguments)]
fn run<T: Element + DeviceRepr>(
    dev: &Device,
    stream: &Arc<CudaStream>,
    batch: &Batch<T>,
    cfg: &AttentionConfig,
    (cu_q, cu_k): (&[i32], &[i32]),
    used: Option<&[i32]>,
    max: (usize, usize),
    t: &mut OnDevice<T>,
) -> flashattn::Result<(Plan, Plan)> {
    let cu_q = stream.clone_htod(cu_q).unwrap();
    let cu_k = stream.clone_htod(cu_k).unwrap();
    let used = used.map(|u| stream.clone_htod(u).unwrap());
    let mut seqs = DeviceSeqlens::new(cu_q.as_view(), cu_k.as_view(), max.0, max.1)?;
    if let Some(used) = &used {
        seqs = seqs.with_seqused_k(used.as_view())?;
    }
    let total_q: usize = batch.q_lens.iter().sum();
    let total_k: usize = batch.k_lens.iter().sum();
    let (hq, hk, d, dv) = (batch.heads_q, batch.heads_kv, batch.d, batch.dv);
    let views = Views {
        q: Layout::contiguous([1, total_q, hq, d]),
        k: Layout::contiguous([1, total_k, hk, d]),
        v: Layout::contiguous([1, total_k, hk, dv]),
        o: Layout::contiguous([1, total_q, hq, dv]),
    };
    let fwd = t.forward(dev, stream, cfg, Some(&seqs), views)?;
    let bwd = t.backward(dev, stream, cfg, Some(&seqs), views)?;
    stream.synchronize().unwrap();
    Ok((fwd, bwd))
}

/// Every sequence of `batch` through the GPU (backend `backend`, `used` keys per sequence)
/// against its reference; no NaN poison left anywhere (every row belongs to a sequence).
fn check<T: Element + DeviceRepr>(
    batch: &Batch<T>,
    cfg: &AttentionConfig,
    used: Option<&[i32]>,
    backend: Backend,
) -> (Plan, Plan) {
    let (dev, stream) = device();
    let cfg = cfg.clone().backend(backend);
    let mut t = upload(&stream, batch);
    let (cu_q, cu_k) = batch.cu();
    let plans = run(
        &dev,
        &stream,
        batch,
        &cfg,
        (&cu_q, &cu_k),
        used,
        batch.max(),
        &mut t,
    )
    .unwrap_or_else(|e| panic!("{cfg:?}: {e}"));
    let got = t.download(&stream);
    for (name, x) in [
        ("O", &got.out),
        ("dQ", &got.dq),
        ("dK", &got.dk),
        ("dV", &got.dv),
    ] {
        assert!(
            x.iter().all(|v| !v.to_f32().is_nan()),
            "{name} has unwritten elements ({cfg:?})"
        );
    }
    assert!(got.lse.iter().all(|v| !v.is_nan()), "LSE unwritten");
    check_outputs(batch, &cfg, used, &got);
    // Where Auto runs the forward on the Hopper kernels it runs the backward there too, softcap's
    // deterministic mode aside (built for the sm80 family only).
    if backend == Backend::Auto && plans.0.backend == Backend::Sm90 {
        let want = if cfg.softcap.is_some() && cfg.deterministic {
            Backend::Sm80
        } else {
            Backend::Sm90
        };
        assert_eq!(plans.1.backend, want, "{}", plans.1.explain());
    }
    plans
}

const MIXED_Q: [usize; 7] = [37, 0, 1, 130, 64, 5, 0];
const MIXED_K: [usize; 7] = [37, 12, 3, 130, 70, 0, 9];

fn configs() -> [AttentionConfig; 6] {
    [
        AttentionConfig::new(),
        AttentionConfig::new().causal(true),
        AttentionConfig::new().window(Some(20), Some(7)),
        AttentionConfig::new().causal(true).softcap(5.0),
        AttentionConfig::new().causal(true).deterministic(true),
        AttentionConfig::new()
            .window(Some(20), Some(7))
            .deterministic(true),
    ]
}

#[test]
#[ignore = "needs a GPU"]
fn mixed_lengths_match_each_sequence_s_reference() {
    // Every case runs; the failures are listed at the end.
    let mut failed = vec![];
    for backend in [Backend::Sm80, Backend::Auto] {
        for d in [64, 128, 256] {
            for (i, cfg) in configs().iter().enumerate() {
                let seed = (d + i) as u64;
                let bf = &Batch::<bf16>::new(&MIXED_Q, &MIXED_K, (4, 2), d, seed);
                match std::panic::catch_unwind(|| check(bf, cfg, None, backend)) {
                    Ok((fwd, bwd)) => {
                        println!("d{d} {cfg:?}: {} / {}", fwd.explain(), bwd.explain())
                    }
                    Err(_) => failed.push(format!("bf16 d{d} {backend:?} {cfg:?}")),
                }
                let hf = &Batch::<f16>::new(&MIXED_Q, &MIXED_K, (2, 2), d, seed + 100);
                if std::panic::catch_unwind(|| check(hf, cfg, None, backend)).is_err() {
                    failed.push(format!("f16 d{d} {backend:?} {cfg:?}"));
                }
            }
        }
    }
    assert!(failed.is_empty(), "failed: {failed:#?}");
}

/// V's head dim apart from Q's: DeepSeek's (192, 128) over the mixed lengths, every config, both
/// dtypes, and `seqused_k`, on both families (`hdim192`).
#[test]
#[ignore = "needs a Hopper GPU"]
#[cfg(feature = "hdim192")]
fn mixed_lengths_at_192_128() {
    let mut failed = vec![];
    for backend in [Backend::Sm90, Backend::Sm80] {
        let (q_lens, k_lens, used) = ([20, 33, 150], [40, 33, 300], [25, 0, 170]);
        let batch = Batch::<f16>::with_head_dim_v(&q_lens, &k_lens, (2, 1), (192, 128), 7);
        let causal = AttentionConfig::new().causal(true);
        if std::panic::catch_unwind(|| check(&batch, &causal, Some(&used), backend)).is_err() {
            failed.push(format!("seqused_k {backend:?}"));
        }
        for (i, cfg) in configs().iter().enumerate() {
            let seed = 1920 + i as u64;
            let dims = (192, 128);
            let bf = &Batch::<bf16>::with_head_dim_v(&MIXED_Q, &MIXED_K, (4, 2), dims, seed);
            if std::panic::catch_unwind(|| check(bf, cfg, None, backend)).is_err() {
                failed.push(format!("bf16 {backend:?} {cfg:?}"));
            }
            let hf = &Batch::<f16>::with_head_dim_v(&MIXED_Q, &MIXED_K, (2, 2), dims, seed + 100);
            if std::panic::catch_unwind(|| check(hf, cfg, None, backend)).is_err() {
                failed.push(format!("f16 {backend:?} {cfg:?}"));
            }
        }
    }
    assert!(failed.is_empty(), "failed: {failed:#?}");
}

/// 64 sequences of 0 to 400 rows and two long ones (not block multiples), GQA 8:2, d128.
#[test]
#[ignore = "needs a GPU"]
fn many_sequences_and_long_ones() {
    let mut rng = StdRng::seed_from_u64(64);
    let mut lens: Vec<usize> = (0..62).map(|_| rng.random_range(0..=400)).collect();
    lens.insert(10, 2047);
    lens.push(1500);
    check_on_both_families(
        &Batch::<bf16>::new(&lens, &lens, (8, 2), 128, 7),
        &[
            AttentionConfig::new().causal(true),
            AttentionConfig::new().window(Some(300), Some(0)),
        ],
    );
}

/// An 8k-row sequence beside a one-row, an empty and a 333-row one (not block multiples), d64,
/// GQA 2:1, causal and windowed: every output of each against its whole reference.
#[test]
#[ignore = "needs a GPU"]
fn an_8k_sequence_beside_short_ones() {
    let lens = [8000, 1, 0, 333];
    check_on_both_families(
        &Batch::<bf16>::new(&lens, &lens, (2, 1), 64, 8),
        &[
            AttentionConfig::new().causal(true),
            AttentionConfig::new().window(Some(700), Some(50)),
        ],
    );
}

/// `batch` under each of `cfgs` on the Ampere kernels (forced) and as `Auto` runs it.
fn check_on_both_families(batch: &Batch<bf16>, cfgs: &[AttentionConfig]) {
    for backend in [Backend::Sm80, Backend::Auto] {
        for cfg in cfgs {
            check(batch, cfg, None, backend);
        }
    }
}

/// Lengths that fill Q's rows at nearly a block's multiple each, one of them empty and one short
/// of a block multiple (1452 rows: at most 1452 / 128 + 5 = 16 slots against 5 · 3 = 15 padded
/// tiles per head): the Hopper forward walks them padded, without its schedule, and every
/// sequence still matches its reference (full, causal, and a right bound that pairs tiles).
#[test]
#[ignore = "needs a Hopper GPU"]
fn nearly_equal_lengths_walk_padded() {
    let (q_lens, k_lens) = ([384, 0, 384, 300, 384], [384, 50, 384, 300, 400]);
    for cfg in [
        AttentionConfig::new(),
        AttentionConfig::new().causal(true),
        AttentionConfig::new().window(None, Some(20)),
    ] {
        check(
            &Batch::<bf16>::new(&q_lens, &k_lens, (4, 2), 128, 31),
            &cfg,
            None,
            Backend::Sm90,
        );
    }
}

/// More sequences than the Hopper forward's schedule sorts at once (1024): 1500 of 16 to 40 rows,
/// every tenth empty, with a few longer ones in the second chunk, GQA 2:1, d64; full, and a right
/// bound that pairs tiles. (No row sees fewer than 16 keys: on rows of 1 to 4 keys the
/// backward's dQ and dK miss the rule's bound now and then, as the peers' do; see
/// `mixed_lengths_match_each_sequence_s_reference`.)
#[test]
#[ignore = "needs a GPU"]
fn more_sequences_than_one_schedule_chunk() {
    let mut rng = StdRng::seed_from_u64(1500);
    let mut lens: Vec<usize> = (0..1500)
        .map(|i| {
            if i % 10 == 3 {
                0
            } else {
                rng.random_range(16..=40)
            }
        })
        .collect();
    for (at, len) in [(1100, 300), (1300, 129), (1499, 257)] {
        lens[at] = len;
    }
    for cfg in [
        AttentionConfig::new(),
        AttentionConfig::new().window(None, Some(20)),
    ] {
        check(
            &Batch::<bf16>::new(&lens, &lens, (2, 1), 64, 15),
            &cfg,
            None,
            Backend::Auto,
        );
    }
}

#[test]
#[ignore = "needs a GPU"]
fn seqused_k_attends_to_the_first_keys_only() {
    for backend in [Backend::Sm80, Backend::Auto] {
        let batch = Batch::<bf16>::new(&[20, 33, 8, 150], &[40, 33, 16, 300], (2, 1), 64, 3);
        let used = [25, 33, 0, 170];
        check(
            &batch,
            &AttentionConfig::new().causal(true),
            Some(&used),
            backend,
        );
        check(
            &batch,
            &AttentionConfig::new(),
            Some(&[1, 0, 16, 300]),
            backend,
        );
    }
}

/// Offsets that describe no packing (decreasing, negative, past the rows, past the maxima) and
/// used-key counts past the keys: the kernels clamp them, so the calls complete, write nothing
/// past the tensors (sentinel rows after each output stay as they were), and run clean under
/// compute-sanitizer; in deterministic mode too, whose dQ hand-over between CTAs must not wait
/// for a key block that malformed offsets left to no CTA.
#[test]
#[ignore = "needs a GPU"]
fn sanitizer_malformed_offsets_stay_in_bounds() {
    let (dev, stream) = device();
    // (cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q and _k)
    type Offsets<'a> = (&'a [i32], &'a [i32], Option<&'a [i32]>, usize);
    let bad: [Offsets; 6] = [
        (&[0, 200, 100], &[0, 100, 256], None, 128),
        (&[-50, 300, i32::MAX], &[i32::MIN, -1, 10_000], None, 128),
        (&[0, 256, 256], &[0, 0, 256], Some(&[1000, -3]), 128),
        (
            &[0, 128, 256],
            &[0, 128, 256],
            Some(&[i32::MAX, i32::MIN]),
            128,
        ),
        (&[256, 0, 0], &[256, 256, 0], None, 128),
        // The third sequence's two key blocks start before the second's: the first of them
        // maps to no CTA of its own.
        (&[0, 64, 64, 128], &[0, 256, 0, 256], None, 256),
    ];
    let configs = [
        AttentionConfig::new().causal(true),
        AttentionConfig::new().deterministic(true),
        AttentionConfig::new().causal(true).deterministic(true),
    ];
    // d256: the Hopper backward's split-head-dim kernel, whose hand-over is the consumers'.
    let mut cases = vec![];
    for d in [64, 256] {
        for backend in [Backend::Sm80, Backend::Auto] {
            for cfg in &configs {
                cases.push((d, backend, cfg.clone().backend(backend)));
            }
        }
    }
    for (d, backend, cfg) in cases {
        // The call's tensors hold 256 query and 256 key rows; `padded`'s buffers, 64 more.
        let batch = Batch::<bf16>::new(&[128, 128], &[128, 128], (2, 2), d, 5);
        let padded = Batch::<bf16>::new(&[192, 128], &[192, 128], (2, 2), d, 5);
        for (cu_q, cu_k, used, max) in bad {
            // Buffers of 320 rows, of which the call's tensors are the first 256.
            let mut t = upload(&stream, &padded);
            let before = t.download(&stream);
            run(
                &dev,
                &stream,
                &batch,
                &cfg,
                (cu_q, cu_k),
                used,
                (max, max),
                &mut t,
            )
            .unwrap_or_else(|e| panic!("{cu_q:?} {cu_k:?}: {e}"));
            let after = t.download(&stream);
            let tail = 256 * 2 * d..;
            for (name, x, y) in [
                ("O", &after.out, &before.out),
                ("dQ", &after.dq, &before.dq),
                ("dK", &after.dk, &before.dk),
                ("dV", &after.dv, &before.dv),
            ] {
                let same = x[tail.clone()]
                    .iter()
                    .zip(&y[tail.clone()])
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same,
                    "{backend:?} {cu_q:?} {cu_k:?}: {name} written past the tensor"
                );
            }
            let lse_same = after.lse[2 * 256..]
                .iter()
                .zip(&before.lse[2 * 256..])
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(
                lse_same,
                "{backend:?} {cu_q:?} {cu_k:?}: LSE written past the tensor"
            );
        }
    }
}

/// Well-formed offsets that leave rows to no sequence (the first offset past 0, a gap, an empty
/// sequence), GQA, deterministic mode: two runs give the same bits (the dQ hand-over stays on;
/// were the offsets check to turn it off, the sums would add in any order), and the rows that no
/// sequence owns keep their poison.
#[test]
#[ignore = "needs a GPU"]
fn deterministic_calls_with_gaps_repeat_bit_for_bit() {
    let (dev, stream) = device();
    // 512 query and key rows; the offsets below give sequences of 183, 0 and 260 query rows.
    let batch = Batch::<bf16>::new(&[300, 212], &[300, 212], (4, 2), 128, 11);
    let (cu_q, cu_k) = ([7, 190, 190, 450], [0, 200, 260, 512]);
    for backend in [Backend::Sm80, Backend::Auto] {
        for cfg in [
            AttentionConfig::new().causal(true).deterministic(true),
            AttentionConfig::new().deterministic(true),
        ] {
            let cfg = cfg.backend(backend);
            let mut runs = vec![];
            for _ in 0..2 {
                let mut t = upload(&stream, &batch);
                run(
                    &dev,
                    &stream,
                    &batch,
                    &cfg,
                    (&cu_q, &cu_k),
                    None,
                    (260, 260),
                    &mut t,
                )
                .unwrap_or_else(|e| panic!("{cfg:?}: {e}"));
                runs.push(t.download(&stream));
            }
            let bits = |x: &[bf16]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            for (name, a, b) in [
                ("O", &runs[0].out, &runs[1].out),
                ("dQ", &runs[0].dq, &runs[1].dq),
                ("dK", &runs[0].dk, &runs[1].dk),
                ("dV", &runs[0].dv, &runs[1].dv),
            ] {
                assert_eq!(bits(a), bits(b), "{cfg:?}: {name} differs between runs");
            }
            // Query rows 0..7 and 450..512 (4 heads of 128 columns each) belong to no sequence.
            let row = 4 * 128;
            for (name, x) in [("O", &runs[0].out), ("dQ", &runs[0].dq)] {
                let mut unowned = x[..7 * row].iter().chain(&x[450 * row..]);
                assert!(
                    unowned.all(|v| v.to_f32().is_nan()),
                    "{cfg:?}: {name} written on rows no sequence owns"
                );
            }
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn sanitizer_mixed_lengths_small() {
    for backend in [Backend::Sm80, Backend::Auto] {
        for cfg in [AttentionConfig::new().causal(true), AttentionConfig::new()] {
            check(
                &Batch::<bf16>::new(&MIXED_Q, &MIXED_K, (2, 1), 128, 1),
                &cfg,
                Some(&[37, 5, 3, 100, 70, 0, 9]),
                backend,
            );
        }
    }
}
