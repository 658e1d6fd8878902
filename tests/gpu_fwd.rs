//! Forward correctness of the GPU kernels against the f64 reference under the correctness rule of
//! docs/ARCHITECTURE.md. `#[ignore]`d: run on the device with `--include-ignored` (each test fails
//! without a GPU). Small problems are checked whole; large ones for NaN/poison everywhere and
//! exactly on a sample of rows. Outputs are poisoned (NaN) before every launch.
#![cfg(feature = "cuda")]

mod common;
mod harness;

use std::sync::Arc;

use cudarc::driver::sys::{self, CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaGraph, CudaSlice, DeviceRepr};
use flashattn::cuda::{CudaStream, Device};
use flashattn::reference::{self, compare, Comparison};
use flashattn::registry::TileRole;
use flashattn::unstable::{PingPong, Sm90Schedule, TailSplit};
use flashattn::{AttentionConfig, Backend, Element, Error, Op, TensorRef};
use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::SeedableRng;

use common::{assert_nan_in_head_0, device, download, forward_into, poison, poisoned_outputs};
use harness::Case;

/// The forward of `case` on the device over host inputs, outputs poisoned (NaN) before the
/// launch; returns O and the LSE.
fn forward_on_device<T: Element + DeviceRepr>(
    dev: &Device,
    stream: &Arc<CudaStream>,
    case: &Case,
    cfg: &AttentionConfig,
    [q, k, v]: [&[T]; 3],
) -> (Vec<T>, Vec<f32>) {
    let [q_dev, k_dev, v_dev] = [q, k, v].map(|x| stream.clone_htod(x).unwrap());
    let mut out = poisoned_outputs::<T>(stream, case, q.len());
    forward_into(dev, stream, case, cfg, [&q_dev, &k_dev, &v_dev], &mut out)
        .unwrap_or_else(|e| panic!("{case:?}: {e}"));
    download(stream, &out)
}

/// Runs one case with `cfg` (its backend and schedule); returns the comparisons of O and LSE.
fn run_case<T: Element + DeviceRepr>(
    dev: &Device,
    stream: &Arc<CudaStream>,
    case: &Case,
    cfg: AttentionConfig,
    seed: u64,
) -> (Comparison, Comparison) {
    let (lq, lk) = case.layouts();
    let [q, k, v] = case.random_qkv::<T>(&mut StdRng::seed_from_u64(seed));
    let (o, lse) = forward_on_device(dev, stream, case, &cfg, [&q, &k, &v]);

    let (tq, tk, tv) = (
        TensorRef::new(&q, lq),
        TensorRef::new(&k, lk),
        TensorRef::new(&v, lk),
    );
    let got = reference::pack_f32(TensorRef::new(&o, lq));
    let cfg = case.cfg(Backend::Cpu);
    if case.checked_whole() {
        let want = reference::reference_forward(&cfg, tq, tk, tv);
        let base = reference::baseline_forward(&cfg, tq, tk, tv);
        return (
            compare(&got, &want.out, &base.out),
            compare(&lse, &want.lse, &base.lse),
        );
    }
    // Large: every element written and finite, then a sample of rows exactly.
    let nan_o = got.iter().filter(|x| x.is_nan()).count();
    let nan_lse = lse.iter().filter(|x| x.is_nan()).count();
    assert_eq!(
        nan_o + nan_lse,
        0,
        "{case:?}: {nan_o} O and {nan_lse} LSE entries unwritten or NaN"
    );
    let d = case.head_dim;
    let (mut got_rows, mut want_rows, mut base_rows) = (vec![], vec![], vec![]);
    let (mut got_lse, mut want_lse, mut base_lse) = (vec![], vec![], vec![]);
    let rows = [
        0,
        1,
        case.seqlen_q / 3,
        case.seqlen_q / 2 + 7,
        case.seqlen_q - 2,
        case.seqlen_q - 1,
    ];
    for (n, &i) in rows.iter().enumerate() {
        let (b, h) = (n % case.batch, (n * 5) % case.heads_q);
        let (w, wl) = reference::reference_row(&cfg, tq, tk, tv, b, h, i);
        let (bo, bl) = reference::baseline_row(&cfg, tq, tk, tv, b, h, i);
        let off = ((b * case.seqlen_q + i) * case.heads_q + h) * d;
        got_rows.extend_from_slice(&got[off..off + d]);
        want_rows.extend(w);
        base_rows.extend(bo);
        got_lse.push(lse[(b * case.heads_q + h) * case.seqlen_q + i]);
        want_lse.push(wl);
        base_lse.push(bl);
    }
    (
        compare(&got_rows, &want_rows, &base_rows),
        compare(&got_lse, &want_lse, &base_lse),
    )
}

fn run_all<T: Element + DeviceRepr>(cases: &[Case], backend: Backend, label: &str) {
    run_all_with::<T>(cases, label, |case| case.cfg(backend));
}

/// `run_all` with each case's config from `cfg` (a schedule other than the default).
fn run_all_with<T: Element + DeviceRepr>(
    cases: &[Case],
    label: &str,
    cfg: impl Fn(&Case) -> AttentionConfig,
) {
    let (dev, stream) = device();
    let mut failures = vec![];
    for (n, case) in cases.iter().enumerate() {
        let case = &case.dtype(T::DTYPE);
        let cfg = cfg(case);
        let backend = cfg.backend;
        let (o, lse) = run_case::<T>(&dev, &stream, case, cfg, 1000 + n as u64);
        println!("{label} {backend:?} {}: O {o}; LSE {lse}", case.name());
        if !o.pass || !lse.pass {
            failures.push(format!("{case:?}"));
        }
    }
    println!("{label}: {} cases, {} failed", cases.len(), failures.len());
    assert!(
        failures.is_empty(),
        "failed cases:\n{}",
        failures.join("\n")
    );
}

/// The sweep of the issue: seqlens that are not tile multiples, s_q ≠ s_k both ways, causal and
/// not, at one head dim.
fn sweep(head_dim: usize) -> Vec<Case> {
    let pairs = [
        (1, 1),
        (17, 17),
        (113, 113),
        (128, 128),
        (1000, 1000),
        (113, 1000),
        (1000, 113),
        (1, 4097),
        (4097, 4097),
        (8192, 8192),
    ];
    let mut cases = vec![];
    for causal in [false, true] {
        for &(sq, sk) in &pairs {
            cases.push(Case::new(sq, sk, head_dim).causal(causal));
        }
    }
    // GQA, batch > 1, strided layouts, windows, softcap.
    for causal in [false, true] {
        let case = |sq, sk| Case::new(sq, sk, head_dim).causal(causal);
        cases.push(case(300, 300).batch(2).heads(8, 2));
        cases.push(case(257, 515).batch(2).heads(8, 1));
        cases.push(case(200, 333).batch(3).strided());
        cases.push(case(333, 333).heads(4, 4).softcap(30.0));
    }
    let case = |sq, sk| Case::new(sq, sk, head_dim);
    cases.push(case(700, 700).window(Some(100), Some(0)));
    cases.push(case(500, 600).window(Some(64), Some(32)));
    cases.push(case(400, 300).window(None, Some(17)));
    cases.push(case(300, 400).window(Some(50), None));
    // Wide enough that middle tiles have masked key blocks above and below unmasked ones
    // (the kernels' loop copy for unmasked blocks runs between the two).
    cases.push(case(4000, 4000).window(Some(1500), Some(700)));
    // More tiles than SMs, so each persistent CTA walks several; with GQA and both masks.
    for causal in [false, true] {
        cases.push(case(200, 260).causal(causal).batch(8).heads(16, 4));
    }
    // Causal tiles go heaviest first across heads, the heads in groups whose K and V fit 4/5 of
    // the L2: on an H200 (60 MiB) 16 heads of 16k keys make groups of 12 + 4 at d64, 6 + 6 + 4 at
    // d128, 3 × 5 + 1 at d256. (At 32k keys the f32 row sums of fp16 inputs drift past the rule's LSE
    // bound, on sm90 too.)
    cases.push(case(200, 16384).causal(true).batch(2).heads(8, 2));
    // Many tiles, a third of which see no key (O = 0 from registers), interleaved with others.
    cases.push(
        case(300, 100)
            .batch(6)
            .heads(24, 24)
            .window(Some(0), Some(0)),
    );
    // Windows that leave some rows with no key at all: O = 0, LSE = +inf.
    cases.push(case(300, 100).window(Some(0), Some(0)));
    cases
}

// The FlashAttention-2-style kernels, forced on whatever GPU runs the tests (sm_80 and later).
#[test]
#[ignore = "needs a GPU"]
fn sm80_fwd_d64_bf16() {
    run_all::<bf16>(&sweep(64), Backend::Sm80, "sm80 d64 bf16");
}
#[test]
#[ignore = "needs a GPU"]
fn sm80_fwd_d128_bf16() {
    run_all::<bf16>(&sweep(128), Backend::Sm80, "sm80 d128 bf16");
}
#[test]
#[ignore = "needs a GPU"]
fn sm80_fwd_d256_bf16() {
    run_all::<bf16>(&sweep(256), Backend::Sm80, "sm80 d256 bf16");
}
#[test]
#[ignore = "needs a GPU"]
fn sm80_fwd_d64_f16() {
    run_all::<f16>(&sweep(64), Backend::Sm80, "sm80 d64 f16");
}
#[test]
#[ignore = "needs a GPU"]
fn sm80_fwd_d128_f16() {
    run_all::<f16>(&sweep(128), Backend::Sm80, "sm80 d128 f16");
}
#[test]
#[ignore = "needs a GPU"]
fn sm80_fwd_d256_f16() {
    run_all::<f16>(&sweep(256), Backend::Sm80, "sm80 d256 f16");
}
#[test]
#[ignore = "needs a GPU"]
fn sm80_fwd_sanitizer_set() {
    let cases = [
        Case::new(17, 113, 64),
        Case::new(130, 70, 128).causal(true),
        Case::new(65, 200, 256).heads(4, 2),
    ];
    run_all::<bf16>(&cases, Backend::Sm80, "sm80 sanitizer set");
}

#[test]
#[ignore = "needs a Hopper GPU"]
fn sm90_fwd_d64_bf16() {
    run_all::<bf16>(&sweep(64), Backend::Sm90, "sm90 d64 bf16");
}
#[test]
#[ignore = "needs a Hopper GPU"]
fn sm90_fwd_d128_bf16() {
    run_all::<bf16>(&sweep(128), Backend::Sm90, "sm90 d128 bf16");
}
#[test]
#[ignore = "needs a Hopper GPU"]
fn sm90_fwd_d256_bf16() {
    run_all::<bf16>(&sweep(256), Backend::Sm90, "sm90 d256 bf16");
}
#[test]
#[ignore = "needs a Hopper GPU"]
fn sm90_fwd_d64_f16() {
    run_all::<f16>(&sweep(64), Backend::Sm90, "sm90 d64 f16");
}
#[test]
#[ignore = "needs a Hopper GPU"]
fn sm90_fwd_d128_f16() {
    run_all::<f16>(&sweep(128), Backend::Sm90, "sm90 d128 f16");
}
#[test]
#[ignore = "needs a Hopper GPU"]
fn sm90_fwd_d256_f16() {
    run_all::<f16>(&sweep(256), Backend::Sm90, "sm90 d256 f16");
}

/// The tail split (csrc/sm90/fwd_tail.h) forced: tiles cut by key blocks into pieces merged by
/// their LSE, with and without whole waves before them; non-causal, and masked with one query
/// block per head (decoding), where a piece may hold no key of a row.
#[test]
#[ignore = "needs a Hopper GPU"]
fn sm90_fwd_tail_split() {
    let mut cases = vec![];
    for head_dim in [64, 128, 256] {
        let case = |sq, sk| Case::new(sq, sk, head_dim);
        cases.extend([
            case(1000, 1500),
            case(113, 2000),
            case(1, 4097),
            case(100, 8192),
            case(200, 1333).batch(3).strided(),
            case(333, 1100).softcap(30.0),
            // 144 tiles on 132 SMs: one whole wave and 12 tiles in pieces, with GQA.
            case(1000, 3000).batch(2).heads(9, 3),
            case(1, 4097).causal(true),
            case(100, 5000).causal(true).batch(2).heads(8, 2),
            // Non-causal with up to 1024 keys: the narrow key blocks (src/backend/gpu.rs).
            case(300, 1000),
            // More queries than keys, causal: rows 0..19 see no key, so every piece of theirs is
            // empty and the merge gives O = 0, LSE = +inf (two key blocks only at d256).
            case(120, 100).causal(true),
            // Rows 0 and 63 see keys 2436..2936 and 2499..2999: the last block is a piece no
            // early row sees.
            case(64, 3000).window(Some(500), Some(0)),
        ]);
    }
    let always = |case: &Case| {
        let mut cfg = case.cfg(Backend::Sm90);
        cfg.sm90_schedule.split_tail = TailSplit::Always;
        cfg
    };
    run_all_with::<bf16>(&cases, "sm90 tail split bf16", always);
    run_all_with::<f16>(&cases, "sm90 tail split f16", always);
}

/// A NaN key poisons O and the LSE of every row that sees it, as in the reference, split or
/// not and on both kernel families: the merge passes a piece's NaN on.
#[test]
#[ignore = "needs a Hopper GPU"]
fn sm90_fwd_tail_split_passes_nan_on() {
    let (dev, stream) = device();
    let case = Case::new(100, 4097, 128); // two heads, one query block each
    let [q, mut k, v] = case.random_qkv::<bf16>(&mut StdRng::seed_from_u64(7));
    k[(2000 * case.heads_kv) * case.head_dim + 5] = bf16::NAN; // key 2000 of head 0
    for (backend, split) in [
        (Backend::Sm90, TailSplit::Always),
        (Backend::Sm90, TailSplit::Off),
        (Backend::Sm80, TailSplit::Off),
    ] {
        let mut cfg = case.cfg(backend);
        cfg.sm90_schedule.split_tail = split;
        let (o, lse) = forward_on_device(&dev, &stream, &case, &cfg, [&q, &k, &v]);
        assert_nan_in_head_0(&case, &o, &lse, &format!("{backend:?} {split:?}"));
    }
}

/// One forward call captured into a CUDA graph, not run. The stream's context must have cudarc's
/// event tracking off (a captured wait on an event recorded before the capture is an isolation
/// error, CUDA_ERROR_STREAM_CAPTURE_ISOLATION), as for any caller that captures with cudarc.
fn capture_forward(
    dev: &Device,
    stream: &Arc<CudaStream>,
    case: &Case,
    cfg: &AttentionConfig,
    qkv: [&CudaSlice<bf16>; 3],
    out: &mut (CudaSlice<bf16>, CudaSlice<f32>),
) -> CudaGraph {
    stream.synchronize().unwrap();
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
        .unwrap();
    let called = forward_into(dev, stream, case, cfg, qkv, out);
    let graph = stream.end_capture(CUgraphInstantiate_flags(0)).unwrap();
    called.unwrap_or_else(|e| panic!("{case:?}: {e}"));
    graph.expect("a captured graph")
}

/// The kernel launches in a captured graph.
fn kernels_in(graph: &CudaGraph) -> usize {
    let g = graph.cu_graph();
    let mut n = 0usize;
    unsafe { sys::cuGraphGetNodes(g, std::ptr::null_mut(), &mut n) }
        .result()
        .unwrap();
    let mut nodes = vec![std::ptr::null_mut(); n];
    unsafe { sys::cuGraphGetNodes(g, nodes.as_mut_ptr(), &mut n) }
        .result()
        .unwrap();
    nodes
        .iter()
        .filter(|&&node| {
            let mut kind = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
            unsafe { sys::cuGraphNodeGetType(node, &mut kind) }
                .result()
                .unwrap();
            kind == sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL
        })
        .count()
}

/// Which calls the tail split takes, seen as the kernels each launches (captured, not run): one
/// unsplit; with it, the whole waves (when there are any), the pieces and the merge.
#[test]
#[ignore = "needs a Hopper GPU"]
fn sm90_fwd_tail_split_plans() {
    let (dev, stream) = device();
    // Safety: every slice of this test lives on this one stream.
    unsafe { stream.context().disable_event_tracking() };
    let sms = dev.info().sm_count as usize;
    let gqa = Case::new(1000, 3000, 128).batch(2).heads(9, 3);
    let headline = Case::new(8192, 8192, 128).batch(2).heads(16, 16);
    let windowed = Case::new(1000, 3000, 128).window(Some(500), Some(0));
    let gqa_tiles = 2 * 9 * 8;
    let split = |tiles: usize| if tiles > sms { 3 } else { 2 };
    for (case, mode, want) in [
        (Case::new(1, 4097, 128), TailSplit::Always, split(2)),
        (Case::new(1, 4097, 128), TailSplit::Auto, split(2)),
        (Case::new(1, 4097, 128), TailSplit::Off, 1),
        (
            Case::new(100, 8192, 128).causal(true),
            TailSplit::Auto,
            split(2),
        ),
        (gqa, TailSplit::Always, split(gqa_tiles)),
        (gqa, TailSplit::Off, 1),
        // The cost model declines the 16k-token shape (measured ±0 at d128 s8k).
        (headline, TailSplit::Auto, 1),
        // Several query blocks under a window: their tiles differ, never split.
        (windowed, TailSplit::Always, 1),
    ] {
        let mut cfg = case.cfg(Backend::Sm90);
        cfg.sm90_schedule.split_tail = mode;
        let q = stream
            .alloc_zeros::<bf16>(case.batch * case.seqlen_q * case.heads_q * case.head_dim)
            .unwrap();
        let kv = case.batch * case.seqlen_k * case.heads_kv * case.head_dim;
        let (k, v) = (
            stream.alloc_zeros::<bf16>(kv).unwrap(),
            stream.alloc_zeros::<bf16>(kv).unwrap(),
        );
        let mut out = poisoned_outputs::<bf16>(&stream, &case, q.len()); // captured, not run
        let graph = capture_forward(&dev, &stream, &case, &cfg, [&q, &k, &v], &mut out);
        assert_eq!(kernels_in(&graph), want, "{case:?} {mode:?}");
    }
}

/// A split call captured into a CUDA graph (its workspace becomes the graph's allocation) and
/// replayed gives the eager call's O and LSE bit for bit, on every replay. As a caller captures
/// with cudarc: its per-slice event tracking off, since a captured wait on an event recorded
/// before the capture is an isolation error (CUDA_ERROR_STREAM_CAPTURE_ISOLATION).
#[test]
#[ignore = "needs a Hopper GPU"]
fn sm90_fwd_tail_split_in_a_cuda_graph() {
    let (dev, stream) = device();
    // Safety: every slice of this test lives on this one stream.
    unsafe { stream.context().disable_event_tracking() };
    let case = Case::new(1, 4097, 128); // two tiles over 26 key blocks: split
    let mut cfg = case.cfg(Backend::Sm90);
    cfg.sm90_schedule.split_tail = TailSplit::Always;
    let [q, k, v] = case.random_qkv::<bf16>(&mut StdRng::seed_from_u64(5));
    let (want_o, want_lse) = forward_on_device(&dev, &stream, &case, &cfg, [&q, &k, &v]);
    assert!(want_o.iter().all(|x| x.is_finite()) && want_lse.iter().all(|x| x.is_finite()));

    // Q, K and V stay alive on the device for the replays.
    let [q_dev, k_dev, v_dev] = [&q, &k, &v].map(|x| stream.clone_htod(x).unwrap());
    let mut out = poisoned_outputs::<bf16>(&stream, &case, q.len());
    let graph = capture_forward(
        &dev,
        &stream,
        &case,
        &cfg,
        [&q_dev, &k_dev, &v_dev],
        &mut out,
    );
    for replay in 0..3 {
        poison(&stream, &mut out); // the buffers the graph writes
        graph.launch().unwrap();
        let (o, lse) = download(&stream, &out);
        assert!(
            o.iter()
                .map(|x| x.to_bits())
                .eq(want_o.iter().map(|x| x.to_bits())),
            "replay {replay}: O differs from the eager call"
        );
        assert!(
            lse.iter()
                .map(|x| x.to_bits())
                .eq(want_lse.iter().map(|x| x.to_bits())),
            "replay {replay}: LSE differs from the eager call"
        );
    }
}

#[test]
#[ignore = "needs a Hopper GPU"]
fn sm90_fwd_ablation_schedules_agree() {
    // Every schedule computes the same function.
    for (pingpong, intra_wg_overlap) in [
        (PingPong::Off, true),
        (PingPong::On, false),
        (PingPong::Off, false),
    ] {
        let (dev, stream) = device();
        let case = Case::new(777, 1029, 128).causal(true).batch(2).heads(4, 2);
        let mut cfg = case.cfg(Backend::Sm90);
        cfg.sm90_schedule = Sm90Schedule {
            pingpong,
            intra_wg_overlap,
            ..Default::default()
        };
        if !intra_wg_overlap && !cfg!(feature = "ablation") {
            // Not compiled: refused before anything runs, naming the feature.
            match dev.plan(Op::Forward, &case.problem(), &cfg) {
                Err(Error::Unsupported { what, .. }) if what.contains("`ablation`") => continue,
                other => panic!("the ablation is not built, yet planned as {other:?}"),
            }
        }
        let (o, lse) = run_case::<bf16>(&dev, &stream, &case, cfg, 77);
        println!("schedule pingpong={pingpong:?} overlap={intra_wg_overlap}: O {o}; LSE {lse}");
        assert!(o.pass && lse.pass);
    }
}

#[test]
#[ignore = "needs a Hopper GPU"]
fn sm90_fwd_one_cta_per_tile_schedule() {
    // Masked problems on the one-CTA-per-tile grid (the default is the persistent schedule).
    let (dev, stream) = device();
    let cases = [
        Case::new(700, 700, 128).causal(true).batch(8).heads(16, 4),
        Case::new(300, 500, 64).causal(true).batch(4).heads(32, 8),
        Case::new(300, 100, 256)
            .batch(6)
            .heads(24, 24)
            .window(Some(0), Some(0)),
        Case::new(400, 400, 128)
            .batch(3)
            .heads(40, 40)
            .window(Some(90), Some(10)),
    ];
    for (n, case) in cases.iter().enumerate() {
        let mut cfg = case.cfg(Backend::Sm90);
        cfg.sm90_schedule.persistent_causal = false;
        let (o, lse) = run_case::<bf16>(&dev, &stream, case, cfg, 500 + n as u64);
        println!("one CTA per tile {case:?}: O {o}; LSE {lse}");
        assert!(o.pass && lse.pass);
    }
}

#[test]
#[ignore = "needs a Hopper GPU"]
fn sm90_fwd_narrow_key_blocks() {
    // Non-causal calls on the causal tile (128-key blocks at d64/d128), with more keys than the
    // planner takes it for by itself.
    let (dev, stream) = device();
    let mut cases = vec![];
    for d in [64, 128] {
        cases.push(Case::new(1500, 1500, d));
        cases.push(Case::new(113, 1500, d));
        cases.push(Case::new(300, 257, d).batch(4).heads(16, 2));
    }
    for (n, case) in cases.iter().enumerate() {
        let mut cfg = case.cfg(Backend::Sm90);
        cfg.sm90_schedule.narrow_key_blocks = true;
        let plan = dev.plan(Op::Forward, &case.problem(), &cfg).unwrap();
        assert_eq!(
            plan.tile().map(|t| t.role),
            Some(TileRole::Masked),
            "{}",
            plan.explain()
        );
        let (o, lse) = run_case::<bf16>(&dev, &stream, case, cfg, 900 + n as u64);
        println!("narrow key blocks {case:?}: O {o}; LSE {lse}");
        assert!(o.pass && lse.pass);
    }
}

/// A few small cases for compute-sanitizer (memcheck, racecheck), which slows kernels a lot.
#[test]
#[ignore = "needs a Hopper GPU"]
fn sanitizer_sm90_fwd_small() {
    let mut cases = vec![];
    for d in [64, 128, 256] {
        cases.push(Case::new(17, 200, d).causal(true));
        cases.push(Case::new(130, 77, d).batch(2).heads(4, 1));
    }
    run_all::<bf16>(&cases, Backend::Sm90, "sanitizer");
}
