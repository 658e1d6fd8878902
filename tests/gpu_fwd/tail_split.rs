//! The sm90 tail split (split-KV), forced and planned: results, NaN, launches, CUDA graph replays.

use std::sync::Arc;

use cudarc::driver::sys::{self, CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaGraph, CudaSlice};
use flashattn::cuda::{CudaStream, Device};
use flashattn::unstable::TailSplit;
use flashattn::{AttentionConfig, Backend};
use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::SeedableRng;

use crate::common::{
    assert_nan_in_head_0, device, download, forward_into, poison, poisoned_outputs,
};
use crate::harness::Case;
use crate::{forward_on_device, run_all_with};

/// The tail split (csrc/sm90/fwd_tail.h) forced: tiles cut by key blocks into pieces merged by
/// their LSE, with and without whole waves before them; non-causal, and masked with one query
/// block per head (decoding), where a piece may hold no key of a row.
#[test]
#[ignore = "needs a Hopper GPU"]
fn sm90_fwd_tail_split() {
    let mut cases = vec![];
    for head_dim in [64, 128, 256]
        .into_iter()
        .chain(crate::common::optional_head_dims())
    {
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
