//! V's head dim apart from Q's and K's: the Hopper and the sm80 forwards at (192, 128), DeepSeek's
//! MLA shape, against the f64 reference under the rule, O poisoned before the launch. Built with
//! `hdim192`.

use std::sync::Arc;

use cudarc::driver::DeviceRepr;
use flashattn::cuda::{CudaStream, Device, DeviceForwardInputs, DeviceTensor, DeviceTensorMut};
use flashattn::reference::{self, compare, Comparison};
use flashattn::unstable::TailSplit;
use flashattn::{AttentionConfig, Backend, Element, Layout, TensorRef};
use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::SeedableRng;

use crate::common::device;
use crate::harness::random;

/// One problem: batch, query and key rows, query and KV heads.
#[derive(Clone, Copy, Debug)]
struct Sizes {
    batch: usize,
    seqlen_q: usize,
    seqlen_k: usize,
    heads_q: usize,
    heads_kv: usize,
}

const D: usize = 192;
const DV: usize = 128;

/// The forward of `sizes` with `cfg` on the device and in the reference: O's and the LSE's
/// comparisons.
fn run<T: Element + DeviceRepr>(
    dev: &Device,
    stream: &Arc<CudaStream>,
    s: Sizes,
    cfg: &AttentionConfig,
    seed: u64,
) -> (Comparison, Comparison) {
    let lq = Layout::contiguous([s.batch, s.seqlen_q, s.heads_q, D]);
    let lk = Layout::contiguous([s.batch, s.seqlen_k, s.heads_kv, D]);
    let lv = Layout::contiguous([s.batch, s.seqlen_k, s.heads_kv, DV]);
    let lo = Layout::contiguous([s.batch, s.seqlen_q, s.heads_q, DV]);
    let rng = &mut StdRng::seed_from_u64(seed);
    let q: Vec<T> = random(lq.shape.iter().product(), rng);
    let k: Vec<T> = random(lk.shape.iter().product(), rng);
    let v: Vec<T> = random(lv.shape.iter().product(), rng);
    let [qd, kd, vd] = [&q, &k, &v].map(|x| stream.clone_htod(x).unwrap());
    let n_o: usize = lo.shape.iter().product();
    let n_lse = s.batch * s.heads_q * s.seqlen_q;
    let mut o = stream
        .clone_htod(&vec![T::from_f32(f32::NAN); n_o])
        .unwrap();
    let mut lse = stream.clone_htod(&vec![f32::NAN; n_lse]).unwrap();
    let (tq, tk, tv) = (
        DeviceTensor::new(qd.as_view(), lq),
        DeviceTensor::new(kd.as_view(), lk),
        DeviceTensor::new(vd.as_view(), lv),
    );
    dev.forward_into(
        stream,
        cfg,
        DeviceForwardInputs::new(&tq, &tk, &tv),
        &mut DeviceTensorMut::new(o.as_view_mut(), lo),
        &mut lse.as_view_mut(),
    )
    .unwrap_or_else(|e| panic!("{s:?}: {e}"));
    let got_o = reference::to_f32(&stream.clone_dtoh(&o).unwrap());
    let got_lse = stream.clone_dtoh(&lse).unwrap();

    let host = cfg.clone().backend(Backend::Cpu);
    let (hq, hk, hv) = (
        TensorRef::new(&q, lq),
        TensorRef::new(&k, lk),
        TensorRef::new(&v, lv),
    );
    let want = reference::reference_forward(&host, hq, hk, hv);
    let base = reference::baseline_forward(&host, hq, hk, hv);
    (
        compare(&got_o, &want.out, &base.out),
        compare(&got_lse, &want.lse, &base.lse),
    )
}

/// Four query heads over two KV heads.
fn sizes(batch: usize, seqlen_q: usize, seqlen_k: usize) -> Sizes {
    Sizes {
        batch,
        seqlen_q,
        seqlen_k,
        heads_q: 4,
        heads_kv: 2,
    }
}

/// Each case in bf16 and f16 (seeds from `seed`), printed; fails naming the cases that broke
/// the rule for O or the LSE.
fn run_all(cases: &[(&str, Sizes, AttentionConfig)], seed: u64) {
    let (dev, stream) = device();
    let mut failures = vec![];
    for (n, (what, s, cfg)) in cases.iter().enumerate() {
        for (dtype, (o, lse)) in [
            ("bf16", run::<bf16>(&dev, &stream, *s, cfg, seed + n as u64)),
            (
                "f16",
                run::<f16>(&dev, &stream, *s, cfg, seed + 100 + n as u64),
            ),
        ] {
            let backend = cfg.backend;
            println!("{backend:?} d{D}/{DV} {dtype} {what} {s:?}: O {o}; LSE {lse}");
            if !(o.pass && lse.pass) {
                failures.push(format!("{dtype} {what}"));
            }
        }
    }
    assert!(failures.is_empty(), "failed: {failures:?}");
}

#[test]
#[ignore = "needs a Hopper GPU"]
fn sm90_forward_at_192_128() {
    let sm90 = AttentionConfig::new().backend(Backend::Sm90);
    let mut tail = sm90.clone();
    tail.sm90_schedule.split_tail = TailSplit::Always;
    let mut capped = sm90.clone().causal(true);
    capped.softcap = Some(30.0);
    let cases: Vec<(&str, Sizes, AttentionConfig)> = vec![
        ("plain", sizes(1, 257, 257), sm90.clone()),
        (
            "causal, keyless rows",
            sizes(2, 300, 200),
            sm90.clone().causal(true),
        ),
        ("short queries", sizes(1, 17, 700), sm90.clone()),
        (
            "window",
            sizes(1, 400, 400),
            sm90.clone().window(Some(64), Some(16)),
        ),
        ("softcap", sizes(1, 257, 257), capped),
        ("tail split", sizes(2, 1000, 3000), tail),
    ];
    run_all(&cases, 4000);
}

/// The sm80 forward (one key block of 64 per step, walked last to first): partial blocks at
/// both ends, keys past the queries, a single query row, masks and softcap.
#[test]
#[ignore = "needs a GPU"]
fn sm80_forward_at_192_128() {
    let sm80 = AttentionConfig::new().backend(Backend::Sm80);
    let mut capped = sm80.clone().causal(true);
    capped.softcap = Some(30.0);
    let cases: Vec<(&str, Sizes, AttentionConfig)> = vec![
        ("plain", sizes(1, 257, 257), sm80.clone()),
        (
            "causal, keyless rows",
            sizes(2, 300, 200),
            sm80.clone().causal(true),
        ),
        ("short queries", sizes(1, 17, 700), sm80.clone()),
        ("one query", sizes(3, 1, 513), sm80.clone().causal(true)),
        (
            "window",
            sizes(1, 400, 400),
            sm80.clone().window(Some(64), Some(16)),
        ),
        ("softcap", sizes(1, 257, 257), capped),
        ("long keys", sizes(2, 113, 3000), sm80.clone()),
    ];
    run_all(&cases, 4200);
}
