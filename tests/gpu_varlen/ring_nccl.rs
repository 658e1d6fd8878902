//! The ring across devices over NCCL (`Device::ring_forward_nccl`, `ring_backward_nccl`): one
//! rank a device, each driven by its own thread, every rank's O, LSE, dQ, dK and dV against its
//! rows of the whole call's f64 reference under DESIGN's rule (outputs poisoned with NaN). On
//! one device a ring of one rank (the backward's sums still travel: to the rank itself, through
//! NCCL); on two or more, the real ring. Communicators made both ways (`RingComm::for_devices`,
//! and `RingComm::new` in each rank's thread from one `RingId`). Needs libnccl.so on the library
//! path. A rank that fails before its ring call leaves the others waiting: the device scripts
//! bound the run with a timeout.

use std::sync::Mutex;
use std::thread;

use flashattn::cuda::{
    Device, DeviceBackwardInputs, DeviceForwardInputs, DeviceRingGradients, DeviceRingOutput,
    DeviceTensor, DeviceTensorMut, RingComm, RingId, RingStreams,
};
use flashattn::reference::{self, compare};
use flashattn::ring::{self, Sharding};
use flashattn::{AttentionConfig, TensorRef};
use half::bf16;

use super::ring::{rank_gradient_failures, rank_lse, rank_rows, WholeCall};

/// One ring's communicators at a time: NCCL takes no two sets of them driving the same devices
/// at once (the test harness runs tests in parallel).
static ONE_RING: Mutex<()> = Mutex::new(());

/// How a ring's communicators are made: by one thread for every device, or each rank its own
/// from one identity (in its thread).
#[derive(Clone, Copy, Debug)]
enum Init {
    AllDevices,
    EachRank,
}

/// What one rank brings home: O, LSE, dQ, dK and dV of its rows.
struct RankResults {
    o: Vec<bf16>,
    lse: Vec<f32>,
    grads: [Vec<bf16>; 3],
}

/// One rank's forward and backward over NCCL on `dev`: its shards of the inputs, and of the
/// whole call's O and LSE for the backward.
fn run_rank(
    dev: &Device,
    comm: &RingComm,
    cfg: &AttentionConfig,
    sharding: Sharding,
    [q, k, v, o, dout]: [Vec<bf16>; 5],
    lse: Vec<f32>,
    [q_rank, kv_rank]: [[usize; 4]; 2],
) -> Result<RankResults, String> {
    let compute = dev.new_stream().map_err(|e| e.to_string())?;
    let transport = dev.new_stream().map_err(|e| e.to_string())?;
    let streams = RingStreams {
        compute: &compute,
        transport: &transport,
    };
    let up = |x: &[bf16]| compute.clone_htod(x).unwrap();
    let [qd, kd, vd, od, gd] = [&q, &k, &v, &o, &dout].map(|x| up(x));
    let lse_d = compute.clone_htod(&lse).unwrap();
    let [qt, kt, vt, ot, gt] = [
        (&qd, q_rank),
        (&kd, kv_rank),
        (&vd, kv_rank),
        (&od, q_rank),
        (&gd, q_rank),
    ]
    .map(|(x, shape)| DeviceTensor::contiguous(x, shape));

    let mut out = up(&vec![bf16::NAN; q.len()]);
    let mut out_lse = compute.clone_htod(&vec![f32::NAN; lse.len()]).unwrap();
    dev.ring_forward_nccl(
        comm,
        streams,
        cfg,
        sharding,
        DeviceForwardInputs::new(&qt, &kt, &vt),
        &mut DeviceRingOutput {
            out: &mut DeviceTensorMut::contiguous(&mut out, q_rank),
            lse: &mut out_lse.as_view_mut(),
        },
    )
    .map_err(|e| format!("forward: {e}"))?;

    let [mut dq, mut dk, mut dv] = [q.len(), k.len(), v.len()].map(|n| up(&vec![bf16::NAN; n]));
    let lse_v = lse_d.as_view();
    dev.ring_backward_nccl(
        comm,
        streams,
        cfg,
        sharding,
        DeviceBackwardInputs {
            q: &qt,
            k: &kt,
            v: &vt,
            out: &ot,
            dout: &gt,
            lse: &lse_v,
            sinks: None,
        },
        &mut DeviceRingGradients {
            dq: &mut DeviceTensorMut::contiguous(&mut dq, q_rank),
            dk: &mut DeviceTensorMut::contiguous(&mut dk, kv_rank),
            dv: &mut DeviceTensorMut::contiguous(&mut dv, kv_rank),
        },
    )
    .map_err(|e| format!("backward: {e}"))?;
    let down = |x| compute.clone_dtoh(x).unwrap();
    let results = RankResults {
        o: down(&out),
        lse: compute.clone_dtoh(&out_lse).unwrap(),
        grads: [down(&dq), down(&dk), down(&dv)],
    };
    compute.synchronize().map_err(|e| e.to_string())?;
    Ok(results)
}

/// A ring of one rank a device over `devices` devices against the whole call: the failures.
fn nccl_case(
    cfg: &AttentionConfig,
    sharding: Sharding,
    (devices, init): (usize, Init),
    (batch, seqlen, hq, hk, d): (usize, usize, usize, usize, usize),
    seed: u64,
) -> Vec<String> {
    let whole = WholeCall::random((batch, seqlen, hq, hk, d), seed);
    let (q_shape, kv_shape) = (whole.q_shape, whole.kv_shape);
    let (q, k, v, dout) = (&whole.q, &whole.k, &whole.v, &whole.dout);
    let [qt, kt, vt, dt] = whole.refs();
    let (want, base) = (
        reference::reference_forward(cfg, qt, kt, vt),
        reference::baseline_forward(cfg, qt, kt, vt),
    );
    let (want_grads, base_grads) = (
        reference::reference_backward(cfg, qt, kt, vt, dt),
        reference::baseline_backward(cfg, qt, kt, vt, dt),
    );
    let what = format!(
        "NCCL ({init:?}), {devices} devices {sharding:?}, {:?}, ({batch}, {seqlen}, {hq}/{hk}, {d})",
        cfg.mask
    );
    let devs: Vec<Device> = (0..devices)
        .map(|r| Device::new(r).expect("a CUDA device per rank"))
        .collect();
    // The backward's O and LSE: the whole call's, rounded as the forward gives them.
    let o: Vec<bf16> = want.out.iter().map(|&x| bf16::from_f64(x)).collect();
    let lse: Vec<f32> = want.lse.iter().map(|&x| x as f32).collect();
    let _one_ring = ONE_RING.lock().unwrap_or_else(|e| e.into_inner());
    // Made here, or by each rank's thread from one identity.
    let (mut comms, id) = match init {
        Init::AllDevices => match RingComm::for_devices(&devs) {
            Ok(c) => (c.into_iter().map(Some).collect(), None),
            Err(e) => return vec![format!("{what}: {e}")],
        },
        Init::EachRank => match RingId::new() {
            Ok(id) => ((0..devices).map(|_| None).collect::<Vec<_>>(), Some(id)),
            Err(e) => return vec![format!("{what}: {e}")],
        },
    };
    let rows = seqlen / devices;
    let shard = |x: &[bf16], shape, r| {
        ring::shard(TensorRef::contiguous(x, shape), sharding, devices, r).unwrap()
    };
    let results: Vec<Result<RankResults, String>> = thread::scope(|s| {
        let handles: Vec<_> = devs
            .iter()
            .zip(comms.drain(..))
            .enumerate()
            .map(|(r, (dev, comm))| {
                let rows_of = sharding.rows(seqlen, devices, r).unwrap();
                let inputs = [
                    shard(q, q_shape, r),
                    shard(k, kv_shape, r),
                    shard(v, kv_shape, r),
                    shard(&o, q_shape, r),
                    shard(dout, q_shape, r),
                ];
                let lse = rank_lse(&lse, [batch, seqlen, hq], &rows_of);
                let shapes = [[batch, rows, hq, d], [batch, rows, hk, d]];
                s.spawn(move || {
                    let comm = match (comm, id) {
                        (Some(comm), _) => comm,
                        (None, Some(id)) => RingComm::new(dev, r, devices, &id)
                            .map_err(|e| format!("RingComm::new: {e}"))?,
                        (None, None) => unreachable!("a communicator or an identity"),
                    };
                    run_rank(dev, &comm, cfg, sharding, inputs, lse, shapes)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut failures = vec![];
    for (r, result) in results.into_iter().enumerate() {
        let got = match result {
            Ok(got) => got,
            Err(e) => {
                failures.push(format!("{what}: rank {r}: {e}"));
                continue;
            }
        };
        let rows_of = sharding.rows(seqlen, devices, r).unwrap();
        let lse_shape = [batch, seqlen, hq];
        let checks = [
            (
                "O",
                compare(
                    &reference::to_f32(&got.o),
                    &rank_rows(&want.out, q_shape, &rows_of),
                    &rank_rows(&base.out, q_shape, &rows_of),
                ),
            ),
            (
                "LSE",
                compare(
                    &got.lse,
                    &rank_lse(&want.lse, lse_shape, &rows_of),
                    &rank_lse(&base.lse, lse_shape, &rows_of),
                ),
            ),
        ];
        for (name, cmp) in checks {
            if !cmp.pass {
                failures.push(format!("{what}: rank {r}: {name} {cmp}"));
            }
        }
        let grads = got.grads.map(|g| reference::to_f32(&g));
        failures.extend(rank_gradient_failures(
            &what,
            r,
            grads,
            (&want_grads, &base_grads),
            &whole,
            &rows_of,
        ));
    }
    failures
}

#[test]
#[ignore = "needs a GPU and libnccl.so"]
fn nccl_ring_of_one_device_matches_the_whole_call() {
    let causal = AttentionConfig::new().causal(true);
    let mut failures = nccl_case(
        &causal,
        Sharding::ZigZag,
        (1, Init::EachRank),
        (2, 192, 4, 2, 64),
        300,
    );
    failures.extend(nccl_case(
        &AttentionConfig::new(),
        Sharding::Contiguous,
        (1, Init::AllDevices),
        (1, 256, 8, 1, 128),
        301,
    ));
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Every device of the machine a rank (two at least): run where two GPUs are lent (the device
/// scripts skip `two_devices` on one).
#[test]
#[ignore = "needs two GPUs and libnccl.so"]
fn nccl_two_devices_or_more_ring_matches_the_whole_call() {
    let devices = flashattn::cuda::device_count().expect("a CUDA driver");
    assert!(devices >= 2, "{devices} device(s): this test needs two");
    let causal = AttentionConfig::new().causal(true);
    let window = AttentionConfig::new().window(Some(20), Some(0));
    let mut failures = nccl_case(
        &causal,
        Sharding::ZigZag,
        (devices, Init::AllDevices),
        (2, 96 * devices, 4, 2, 64),
        310,
    );
    failures.extend(nccl_case(
        &AttentionConfig::new(),
        Sharding::Contiguous,
        (devices, Init::EachRank),
        (1, 128 * devices, 8, 1, 128),
        311,
    ));
    failures.extend(nccl_case(
        &window,
        Sharding::ZigZag,
        (devices, Init::AllDevices),
        (2, 128 * devices, 4, 4, 64),
        312,
    ));
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// How one rank's call of a refusal case differs: rank 1 holds twice rank 0's rows, or has
/// sinks where rank 0 has none, or (in the backward) an LSE too short.
#[derive(Clone, Copy, Debug)]
enum Differs {
    Rows,
    Sinks,
    ShortLse,
}

/// Both ranks' errors (or "accepted") of a two-device ring whose rank 1 calls as `differs` says.
fn refusal_case(differs: Differs) -> Vec<String> {
    let devs: Vec<Device> = (0..2).map(|r| Device::new(r).unwrap()).collect();
    let comms = RingComm::for_devices(&devs).unwrap();
    let (batch, hq, d) = (1, 2, 64);
    thread::scope(|s| {
        let handles: Vec<_> = devs
            .iter()
            .zip(comms)
            .enumerate()
            .map(|(r, (dev, comm))| {
                s.spawn(move || {
                    let odd = r == 1;
                    let rows = if odd && matches!(differs, Differs::Rows) {
                        128
                    } else {
                        64
                    };
                    let shape = [batch, rows, hq, d];
                    let compute = dev.new_stream().unwrap();
                    let transport = dev.new_stream().unwrap();
                    let streams = RingStreams {
                        compute: &compute,
                        transport: &transport,
                    };
                    let x: Vec<bf16> = (0..batch * rows * hq * d)
                        .map(|i| bf16::from_f32((i as f32 * 0.37).sin()))
                        .collect();
                    let xd = compute.clone_htod(&x).unwrap();
                    let t = DeviceTensor::contiguous(&xd, shape);
                    let sinks = compute.clone_htod(&vec![0.5f32; hq]).unwrap();
                    let sinks = sinks.as_view();
                    let [mut out, mut dq, mut dk, mut dv] =
                        std::array::from_fn(|_| compute.clone_htod(&x).unwrap());
                    let short = odd && matches!(differs, Differs::ShortLse);
                    let lse_len = batch * hq * rows - usize::from(short);
                    let mut lse = compute.alloc_zeros::<f32>(lse_len).unwrap();
                    let result = if let Differs::ShortLse = differs {
                        let lse = lse.as_view();
                        dev.ring_backward_nccl(
                            &comm,
                            streams,
                            &AttentionConfig::new(),
                            Sharding::Contiguous,
                            DeviceBackwardInputs {
                                q: &t,
                                k: &t,
                                v: &t,
                                out: &t,
                                dout: &t,
                                lse: &lse,
                                sinks: None,
                            },
                            &mut DeviceRingGradients {
                                dq: &mut DeviceTensorMut::contiguous(&mut dq, shape),
                                dk: &mut DeviceTensorMut::contiguous(&mut dk, shape),
                                dv: &mut DeviceTensorMut::contiguous(&mut dv, shape),
                            },
                        )
                    } else {
                        let inputs = DeviceForwardInputs::new(&t, &t, &t);
                        let with_sinks = odd && matches!(differs, Differs::Sinks);
                        dev.ring_forward_nccl(
                            &comm,
                            streams,
                            &AttentionConfig::new(),
                            Sharding::Contiguous,
                            if with_sinks {
                                inputs.with_sinks(&sinks)
                            } else {
                                inputs
                            },
                            &mut DeviceRingOutput {
                                out: &mut DeviceTensorMut::contiguous(&mut out, shape),
                                lse: &mut lse.as_view_mut(),
                            },
                        )
                    };
                    match result {
                        Err(e) => e.to_string(),
                        Ok(_) => "accepted".into(),
                    }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// A ring whose ranks make different calls (other rows, sinks on one rank only), or one that a
/// rank cannot make (its LSE too short), is refused on every rank, not left waiting for a
/// transfer that never comes; the refusing rank gives its own error.
#[test]
#[ignore = "needs two GPUs and libnccl.so"]
fn nccl_two_devices_refuse_ranks_that_disagree() {
    let devices = flashattn::cuda::device_count().expect("a CUDA driver");
    assert!(devices >= 2, "{devices} device(s): this test needs two");
    let _one_ring = ONE_RING.lock().unwrap_or_else(|e| e.into_inner());
    for differs in [Differs::Rows, Differs::Sinks] {
        for (r, e) in refusal_case(differs).iter().enumerate() {
            assert!(
                e.contains("makes another call"),
                "{differs:?}: rank {r}: {e}"
            );
        }
    }
    let errors = refusal_case(Differs::ShortLse);
    assert!(
        errors[0].contains("rank 1 of the ring cannot make this call"),
        "rank 0: {}",
        errors[0]
    );
    assert!(errors[1].contains("lse"), "rank 1: {}", errors[1]);
}
