//! The validation layer against hostile input (no GPU needed): strides cast from negative ones,
//! broadcast (zero-stride) views, overlapping outputs, windows meaning "unbounded", sizes past
//! what the GPU kernels index, problems built by hand. Each must be a typed error or the
//! documented result, never a panic, an abort or a write outside a buffer; a property test
//! checks that every accepted call stays inside its buffers.

use flashattn::dispatch::{self, BuiltKernels, DeviceInfo, Memory, Op};
use flashattn::fp8::{fwht, Fp8Tensor, Granularity, RandomSignHadamard};
use flashattn::registry::{Family, KernelDtype};
use flashattn::tensor::{check_backward, check_forward, MAX_GPU_SEQLEN};
use flashattn::{
    AttentionConfig, Backend, BackwardInputs, DType, Error, GradientsMut, Layout, Operand, Problem,
    TensorMut, TensorRef,
};
use proptest::prelude::*;
use proptest::test_runner::{TestCaseError, TestRunner};

fn ramp(n: usize) -> Vec<f32> {
    (0..n).map(|i| ((i as f32) * 0.37).sin()).collect()
}

fn fake_h200() -> Memory {
    Memory::Device(DeviceInfo {
        ordinal: 0,
        name: "fake H200".into(),
        major: 9,
        minor: 0,
        sm_count: 132,
        max_smem_per_block_optin: 232_448,
        l2_bytes: 60 << 20,
    })
}

fn all_gpu_kernels() -> BuiltKernels {
    BuiltKernels::All
}

fn problem(batch: usize, seqlen_q: usize, seqlen_k: usize, heads: usize, d: usize) -> Problem {
    Problem {
        batch,
        seqlen_q,
        seqlen_k,
        heads_q: heads,
        heads_kv: heads,
        head_dim: d,
        dtype: DType::BF16,
        packed: false,
    }
}

/// The plan names the tile that runs: the sm90 forward's Masked row (narrow key blocks) for
/// causal calls, windows with a right side that bounds some row, and short keys; its Base row
/// otherwise, in its ablation, and where it has no Masked row; one Base row for every other
/// family.
#[test]
fn the_plan_names_the_tile_the_planner_chose() {
    use flashattn::registry::TileRole::{Base, Masked};
    let causal = || AttentionConfig::new().causal(true);
    let mut ablation = causal();
    ablation.sm90_schedule.intra_wg_overlap = false;
    let (fwd, bwd) = (Op::Forward, Op::Backward);
    let long = |d| problem(2, 4096, 4096, 8, d);
    let cases = [
        (long(128), AttentionConfig::new(), fwd, Base, (128, 160)),
        (long(128), causal(), fwd, Masked, (128, 128)),
        (
            long(64),
            AttentionConfig::new().window(Some(256), Some(64)),
            fwd,
            Masked,
            (128, 128),
        ),
        // A right window of seqlen_q − 1 or more bounds no row.
        (
            long(128),
            AttentionConfig::new().window(None, Some(4095)),
            fwd,
            Base,
            (128, 160),
        ),
        (
            problem(2, 1, 4096, 8, 128),
            causal(),
            fwd,
            Masked,
            (128, 128),
        ),
        (
            problem(2, 1024, 1024, 8, 64),
            AttentionConfig::new(),
            fwd,
            Masked,
            (128, 128),
        ),
        (long(256), causal(), fwd, Base, (128, 80)),
        (long(128), ablation, fwd, Base, (128, 160)),
        (long(128), causal(), bwd, Base, (64, 128)),
    ];
    for (p, cfg, op, role, shape) in cases {
        let plan = dispatch::plan(
            op,
            &p,
            &cfg.backend(Backend::Sm90),
            &fake_h200(),
            all_gpu_kernels(),
        )
        .unwrap();
        let row = plan.tile().expect("a GPU plan has a tile");
        assert_eq!(
            (row.role, row.tile.shape()),
            (role, shape),
            "{}",
            plan.explain()
        );
        let role_name = if role == Masked { "masked" } else { "base" };
        let named = format!("tile {}x{} ({role_name})", shape.0, shape.1);
        assert!(plan.explain().contains(&named), "{}", plan.explain());
    }
    let cpu = flashattn::forward(&AttentionConfig::new(), t4(), t4(), t4()).unwrap();
    assert!(cpu.plan.tile().is_none());
}

fn t4() -> TensorRef<'static, f32> {
    static X: [f32; 64] = [0.5; 64];
    TensorRef::contiguous(&X, [1, 4, 2, 8])
}

// Finding 1: spans, negative strides cast to usize, outputs that reach an element twice.

#[test]
fn a_span_past_usize_max_is_an_overflow_not_zero() {
    // The last offset is exactly usize::MAX: "+ 1" used to wrap to a span of 0.
    let wraps = Layout::with_strides([2, 1, 1, 8], [usize::MAX - 7, 0, 0, 1]);
    assert!(matches!(
        wraps.span(Operand::Q),
        Err(Error::IndexOverflow { .. })
    ));
    assert!(TensorRef::<f32>::new(&[], wraps).check(Operand::Q).is_err());
    // A zero dimension has no last offset.
    assert_eq!(
        Layout::contiguous([1, 0, 2, 8]).span(Operand::K),
        Err(Error::EmptyDimension {
            operand: Operand::K,
            dim: 1
        })
    );
    // Contiguous strides that do not fit saturate and are refused, rather than wrapping.
    let huge = Layout::contiguous([1, 1 << 40, 1 << 20, 1 << 10]);
    assert!(matches!(
        huge.validate(Operand::Q),
        Err(Error::IndexOverflow { .. })
    ));
}

#[test]
fn a_batch_flipped_by_a_negative_stride_is_refused() {
    // x[::-1] on batch from a framework that casts its strides with `as usize`.
    let x = ramp(2 * 4 * 2 * 8);
    let flipped = Layout::with_strides([2, 4, 2, 8], [(-64i64) as usize, 16, 8, 1]);
    let t = TensorRef::new(&x[64..], flipped);
    let e = flashattn::forward(&AttentionConfig::new(), t, t, t).unwrap_err();
    assert!(matches!(e, Error::IndexOverflow { .. }), "{e:?}");
}

#[test]
fn the_output_wrap_of_the_review_is_refused_before_any_write() {
    // O [2,1,1,64] with batch stride usize::MAX - 63 over 64 elements in the middle of a
    // buffer: batch 1's row would land before the view.
    let q = ramp(128);
    let qt = TensorRef::contiguous(&q, [2, 1, 1, 64]);
    let mut big = vec![0.0f32; 1024];
    let bad = Layout::with_strides([2, 1, 1, 64], [usize::MAX - 63, 0, 0, 1]);
    let mut lse = vec![0.0f32; 2];
    let e = flashattn::forward_into(
        &AttentionConfig::new(),
        qt,
        qt,
        qt,
        TensorMut::new(&mut big[512..576], bad),
        &mut lse,
    )
    .unwrap_err();
    assert!(matches!(e, Error::IndexOverflow { .. }), "{e:?}");
    assert!(big.iter().all(|&x| x == 0.0), "a refused call wrote");
}

#[test]
fn outputs_that_reach_an_element_twice_are_refused() {
    let x = ramp(2 * 8 * 2 * 16);
    let t = TensorRef::contiguous(&x, [2, 8, 2, 16]);
    let mut out = vec![0.0f32; 2 * 8 * 2 * 16];
    let mut lse = vec![0.0f32; 2 * 2 * 8];
    // Zero row stride: every row of O would be written to the same place.
    for strides in [
        [256, 0, 16, 1],  // rows on top of each other
        [0, 32, 16, 1],   // batches on top of each other
        [256, 16, 8, 1],  // heads half over each other
        [256, 32, 16, 2], // not a unit head-dim stride (its own error)
    ] {
        let layout = Layout::with_strides([2, 8, 2, 16], strides);
        let e = flashattn::forward_into(
            &AttentionConfig::new(),
            t,
            t,
            t,
            TensorMut::new(&mut out, layout),
            &mut lse,
        )
        .unwrap_err();
        match strides[3] {
            1 => assert_eq!(
                e,
                Error::OverlappingOutput {
                    operand: Operand::Out,
                    strides
                }
            ),
            _ => assert!(matches!(e, Error::NonUnitHeadDimStride { .. }), "{e:?}"),
        }
    }
    // The same for a gradient, after the forward.
    let fwd = flashattn::forward(&AttentionConfig::new(), t, t, t).unwrap();
    let o = TensorRef::contiguous(&fwd.out, [2, 8, 2, 16]);
    let (mut dq, mut dk, mut dv) = (vec![0.0f32; 512], vec![0.0f32; 512], vec![0.0f32; 512]);
    let contiguous = Layout::contiguous([2, 8, 2, 16]);
    let aliased = Layout::with_strides([2, 8, 2, 16], [256, 32, 0, 1]);
    let e = flashattn::backward_into(
        &AttentionConfig::new(),
        BackwardInputs {
            q: t,
            k: t,
            v: t,
            out: o,
            dout: o,
            lse: &fwd.lse,
        },
        GradientsMut {
            dq: TensorMut::new(&mut dq, contiguous),
            dk: TensorMut::new(&mut dk, aliased),
            dv: TensorMut::new(&mut dv, contiguous),
        },
    )
    .unwrap_err();
    assert!(
        matches!(
            e,
            Error::OverlappingOutput {
                operand: Operand::DK,
                ..
            }
        ),
        "{e:?}"
    );
}

#[test]
fn broadcast_inputs_mean_what_they_say() {
    // K and V with a zero head stride are one KV head seen by every head: the same as the
    // materialized copy.
    let (b, s, h, d) = (1, 9, 3, 16);
    let q = ramp(b * s * h * d);
    let kv: Vec<f32> = ramp(b * s * d).iter().map(|x| x * 1.7).collect();
    let broadcast = Layout::with_strides([b, s, h, d], [s * d, d, 0, 1]);
    let copied: Vec<f32> = (0..b * s * h * d)
        .map(|i| kv[(i / (h * d)) * d + i % d])
        .collect();
    let cfg = AttentionConfig::new().causal(true);
    let qt = TensorRef::contiguous(&q, [b, s, h, d]);
    let a = flashattn::forward(
        &cfg,
        qt,
        TensorRef::new(&kv, broadcast),
        TensorRef::new(&kv, broadcast),
    )
    .unwrap();
    let c = TensorRef::contiguous(&copied, [b, s, h, d]);
    let e = flashattn::forward(&cfg, qt, c, c).unwrap();
    assert_eq!(a.out, e.out);
    assert_eq!(a.lse, e.lse);
}

// Finding 2: sizes the GPU kernels cannot index are refused before a launch.

#[test]
fn gpu_sizes_are_refused_in_the_planner() {
    let cfg = AttentionConfig::new();
    let plan = |p: &Problem, op| dispatch::plan(op, p, &cfg, &fake_h200(), all_gpu_kernels());
    // The longest sequence is accepted, one more row is not, for queries and for keys.
    for op in [Op::Forward, Op::Backward] {
        assert_eq!(
            plan(&problem(1, MAX_GPU_SEQLEN, 3, 1, 64), op)
                .unwrap()
                .backend,
            Backend::Sm90
        );
        assert_eq!(
            plan(&problem(1, 3, MAX_GPU_SEQLEN, 1, 64), op)
                .unwrap()
                .backend,
            Backend::Sm90
        );
        for p in [
            problem(1, MAX_GPU_SEQLEN + 1, 3, 1, 64),
            problem(1, 3, MAX_GPU_SEQLEN + 1, 1, 64),
            problem(1, 1 << 31, 1024, 1, 128),
        ] {
            let e = plan(&p, op).unwrap_err();
            assert!(matches!(e, Error::IndexOverflow { .. }), "{p:?}: {e:?}");
        }
    }
    // Work items (64-row block, batch · head) within i32: 2^31 heads of one row are too many.
    let e = plan(&problem(1 << 16, 1, 1, 1 << 15, 64), Op::Forward).unwrap_err();
    assert!(matches!(e, Error::IndexOverflow { .. }), "{e:?}");
    assert!(plan(&problem(1 << 16, 1, 1, (1 << 15) - 1, 64), Op::Forward).is_ok());
    // More than 2^42 elements in one operand.
    assert!(plan(&problem(1 << 9, 1 << 20, 1, 32, 256), Op::Forward).is_ok());
    let e = plan(&problem(1 << 10, 1 << 20, 1, 32, 256), Op::Forward).unwrap_err();
    assert!(matches!(e, Error::IndexOverflow { .. }), "{e:?}");
    // The FlashAttention-2 kernels' grid takes at most 65535 heads: forced Sm80 refuses what
    // Auto gives to Sm90.
    let many_heads = problem(1, 128, 128, 70_000, 64);
    assert_eq!(
        plan(&many_heads, Op::Forward).unwrap().backend,
        Backend::Sm90
    );
    let forced = dispatch::plan(
        Op::Forward,
        &many_heads,
        &cfg.clone().backend(Backend::Sm80),
        &fake_h200(),
        all_gpu_kernels(),
    )
    .unwrap_err();
    assert!(matches!(forced, Error::IndexOverflow { .. }), "{forced:?}");
}

#[test]
fn kernels_left_out_of_the_build_are_refused_by_name() {
    // Every kernel of the registry: planned when this build holds it, otherwise refused with the
    // Cargo features it needs (CI also runs this suite in a build of the d128 Hopper forwards).
    let cfg = AttentionConfig::new();
    for k in flashattn::registry::KERNELS {
        let (op, backend) = match k.family {
            Family::Sm90Fwd | Family::Sm90Fp8Fwd => (Op::Forward, Backend::Sm90),
            Family::Sm90Bwd => (Op::Backward, Backend::Sm90),
            Family::Sm80Fwd => (Op::Forward, Backend::Sm80),
            Family::Sm80Bwd => (Op::Backward, Backend::Sm80),
        };
        let dtype = match k.dtype {
            KernelDtype::Bf16 => DType::BF16,
            KernelDtype::Fp16 => DType::F16,
            KernelDtype::E4m3 => DType::E4M3,
        };
        let p = Problem {
            dtype,
            ..problem(2, 300, 300, 4, k.head_dim)
        };
        let r = dispatch::plan(
            op,
            &p,
            &cfg.clone().backend(backend),
            &fake_h200(),
            BuiltKernels::current(),
        );
        if k.built() {
            assert_eq!(r.unwrap().kernel(), Some(k), "{}", k.name());
        } else {
            let e = r.unwrap_err();
            let text = e.to_string();
            assert!(
                k.features().iter().all(|f| text.contains(f)) && text.contains(&k.name()),
                "{}: {text}",
                k.name()
            );
        }
    }
}

#[test]
fn problems_built_by_hand_are_validated() {
    let cfg = AttentionConfig::new();
    let mut p = problem(1, 8, 8, 4, 64);
    p.heads_kv = 0;
    assert_eq!(p.group_size(), 0);
    for memory in [Memory::Host, fake_h200()] {
        let e = dispatch::plan(Op::Forward, &p, &cfg, &memory, all_gpu_kernels()).unwrap_err();
        assert!(matches!(e, Error::EmptyDimension { .. }), "{e:?}");
    }
    // Sizes whose product passes usize::MAX (the review's zero-stride K/V of 2^31 heads).
    let p = Problem {
        heads_q: i32::MAX as usize,
        heads_kv: i32::MAX as usize,
        ..problem(1, 1, i32::MAX as usize, 1, 256)
    };
    let e = dispatch::plan(Op::Forward, &p, &cfg, &fake_h200(), all_gpu_kernels()).unwrap_err();
    assert!(matches!(e, Error::IndexOverflow { .. }), "{e:?}");
    let huge = Problem {
        batch: 1 << 22,
        heads_q: 1 << 21,
        heads_kv: 1 << 21,
        ..problem(1, 1 << 21, 1 << 21, 1, 8)
    };
    assert!(matches!(huge.lse_len(), Err(Error::IndexOverflow { .. })));
}

// Finding 4: one saturating definition of windows.

#[test]
fn windows_wider_than_any_sequence_are_unbounded() {
    for (s_q, s_k) in [(33, 33), (5, 3), (3, 5), (1, 1)] {
        let full = AttentionConfig::new().key_rule(s_q, s_k);
        for (left, right) in [
            (Some(usize::MAX), None),
            (None, Some(usize::MAX)),
            (Some(usize::MAX), Some(usize::MAX)),
            (Some(1 << 63), Some(1 << 63)),
        ] {
            let m = AttentionConfig::new()
                .window(left, right)
                .key_rule(s_q, s_k);
            for i in 0..s_q {
                assert_eq!(
                    m.key_range(i),
                    full.key_range(i),
                    "{left:?} {right:?} row {i}"
                );
            }
        }
        // Causal with an unbounded-by-saturation left window is plain causal.
        let causal = AttentionConfig::new().causal(true).key_rule(s_q, s_k);
        let wide = AttentionConfig::new()
            .window(Some(usize::MAX), Some(0))
            .key_rule(s_q, s_k);
        for i in 0..s_q {
            assert_eq!(wide.key_range(i), causal.key_range(i));
        }
    }
    // And the CPU backend and the reference compute the unbounded result bit for bit.
    let x = ramp(33 * 2 * 16);
    let t = TensorRef::contiguous(&x, [1, 33, 2, 16]);
    let plain = flashattn::forward(&AttentionConfig::new(), t, t, t).unwrap();
    let wide = AttentionConfig::new().window(Some(usize::MAX), Some(usize::MAX));
    let w = flashattn::forward(&wide, t, t, t).unwrap();
    assert_eq!(w.out, plain.out);
    let r_plain = flashattn::reference::reference_forward(&AttentionConfig::new(), t, t, t);
    let r_wide = flashattn::reference::reference_forward(&wide, t, t, t);
    assert_eq!(r_wide.out, r_plain.out);
}

// Finding 5: inputs that pass validation must not panic or abort further in.

#[test]
fn a_broadcast_input_larger_than_memory_is_an_error_not_an_abort() {
    // 8 elements standing for 2^39 elements of Q, or one for usize::MAX keys: past what the
    // host code converts to f32, refused before anything is allocated.
    let q = ramp(8);
    let kv = ramp(8);
    let big_q = TensorRef::new(&q, Layout::with_strides([1, 1 << 36, 1, 8], [0, 0, 0, 1]));
    let k = TensorRef::contiguous(&kv, [1, 1, 1, 8]);
    let e = flashattn::forward(&AttentionConfig::new(), big_q, k, k).unwrap_err();
    assert!(
        matches!(
            e,
            Error::IndexOverflow {
                operand: Operand::Q,
                ..
            }
        ),
        "{e:?}"
    );
    let one = TensorRef::contiguous(&q[..1], [1, 1, 1, 1]);
    let endless = TensorRef::new(
        &kv[..1],
        Layout::with_strides([1, usize::MAX, 1, 1], [0, 0, 0, 1]),
    );
    let e = flashattn::forward(&AttentionConfig::new(), one, endless, endless).unwrap_err();
    assert!(
        matches!(
            e,
            Error::IndexOverflow {
                operand: Operand::K,
                ..
            }
        ),
        "{e:?}"
    );
    let e =
        Fp8Tensor::quantize(big_q, Granularity::PerBlock { rows: 128 }, Operand::Q).unwrap_err();
    assert!(matches!(e, Error::IndexOverflow { .. }), "{e:?}");
    assert!(RandomSignHadamard::new(1 << 40, 1).is_err());
    // Logical sizes past usize::MAX through forward_into with an 8-element LSE.
    let huge = Layout::with_strides([1 << 22, 1 << 21, 1 << 21, 8], [0, 0, 0, 1]);
    let t = TensorRef::new(&q, huge);
    let mut out = vec![0.0f32; 8];
    let mut lse = vec![0.0f32; 8];
    let e = flashattn::forward_into(
        &AttentionConfig::new(),
        t,
        t,
        t,
        TensorMut::new(&mut out, Layout::contiguous([1, 1, 1, 8])),
        &mut lse,
    )
    .unwrap_err();
    assert!(matches!(e, Error::IndexOverflow { .. }), "{e:?}");
}

#[test]
fn fp8_helpers_refuse_what_they_cannot_transform() {
    assert!(matches!(fwht(&mut [0.0; 3]), Err(Error::InvalidConfig(_))));
    assert!(RandomSignHadamard::new(96, 1).is_err());
    let h = RandomSignHadamard::new(64, 1).unwrap();
    assert!(h.apply(&mut [0.0; 32]).is_err());
    assert!(h.invert(&mut [0.0; 128]).is_err());
    let x = ramp(64);
    let t = TensorRef::contiguous(&x, [1, 1, 1, 64]);
    assert!(Fp8Tensor::quantize(t, Granularity::PerBlock { rows: 0 }, Operand::Q).is_err());
    // Built only by quantize: its scales always cover its data.
    let q = Fp8Tensor::quantize(t, Granularity::PerBlock { rows: 128 }, Operand::Q).unwrap();
    assert_eq!((q.data().len(), q.scales().len()), (64, 1));
}

// The property: every call the validation layer accepts stays inside its buffers, and nothing
// panics, whatever the shapes, strides (zero, huge, near usize::MAX) and buffer lengths.

/// The largest offset a layout reaches, in u128, saturating (each term fits; their sum may not).
fn reach(l: &Layout) -> u128 {
    l.shape
        .iter()
        .zip(&l.strides)
        .map(|(&n, &s)| (n as u128).saturating_sub(1) * s as u128)
        .fold(0u128, u128::saturating_add)
}

/// Whether the layout's offsets are distinct, by enumeration (small layouts only).
fn distinct_offsets(l: &Layout) -> Option<bool> {
    let count: usize = l.shape.iter().product();
    if count > 4096 {
        return None;
    }
    let mut seen = std::collections::HashSet::new();
    for b in 0..l.shape[0] {
        for s in 0..l.shape[1] {
            for h in 0..l.shape[2] {
                for d in 0..l.shape[3] {
                    if !seen.insert(reach(&Layout::with_strides(
                        [b + 1, s + 1, h + 1, d + 1],
                        l.strides,
                    ))) {
                        return Some(false);
                    }
                }
            }
        }
    }
    Some(true)
}

fn dim() -> impl Strategy<Value = usize> {
    prop_oneof![
        12 => 1usize..=5,
        1 => Just(0usize),
        1 => Just(1usize << 31),
        1 => any::<usize>(),
    ]
}

fn stride() -> impl Strategy<Value = usize> {
    prop_oneof![
        4 => 0usize..=64,
        1 => Just(0usize),
        1 => (1usize..=64).prop_map(|n| usize::MAX - n + 1),
        1 => (0u32..64).prop_map(|p| 1usize << p),
        1 => any::<usize>(),
    ]
}

/// Strides for `shape`: packed with some padding per dimension (saturating, as a framework's
/// would overflow), broadcast (a zero among them), or anything at all.
fn strides_for(shape: [usize; 4]) -> impl Strategy<Value = [usize; 4]> {
    let packed = (0usize..3, 0usize..3, 0usize..3).prop_map(move |(ph, ps, pb)| {
        let h = shape[3].saturating_add(ph);
        let s = shape[2].saturating_mul(h).saturating_add(ps);
        let b = shape[1].saturating_mul(s).saturating_add(pb);
        [b, s, h, 1]
    });
    let broadcast = (packed.clone(), 0usize..3).prop_map(|(mut st, i)| {
        st[i] = 0;
        st
    });
    prop_oneof![
        4 => packed,
        1 => broadcast,
        1 => (stride(), stride(), stride(), prop_oneof![8 => Just(1usize), 1 => stride()])
            .prop_map(|(b, s, h, d)| [b, s, h, d]),
    ]
}

/// An operand of `shape`: its layout and a buffer length around its span (or anything).
fn operand(shape: [usize; 4]) -> impl Strategy<Value = (Layout, usize)> {
    strides_for(shape).prop_flat_map(move |strides| {
        let layout = Layout::with_strides(shape, strides);
        let span = reach(&layout).saturating_add(1).min(usize::MAX as u128) as usize;
        let len = prop_oneof![
            4 => (0usize..=2).prop_map(move |extra| span.saturating_add(extra)),
            1 => Just(span.saturating_sub(1)),
            1 => any::<usize>(),
        ];
        (Just(layout), len)
    })
}

/// A forward call's operands: mostly consistent shapes, sometimes one that does not fit.
#[allow(clippy::type_complexity)]
fn forward_case() -> impl Strategy<
    Value = (
        (Layout, usize),
        (Layout, usize),
        (Layout, usize),
        (Layout, usize),
        usize,
    ),
> {
    (
        dim(),
        dim(),
        dim(),
        dim(),
        dim(),
        prop_oneof![3 => Just(1usize), 1 => 1usize..=3],
        0u8..12,
    )
        .prop_flat_map(|(b, s_q, s_k, h_kv, d, group, skew)| {
            let q_shape = [b, s_q, h_kv.saturating_mul(group), d];
            let kv_shape = [b, s_k, h_kv, d];
            let off = |i: u8, shape: [usize; 4]| {
                let mut s = shape;
                if skew == i {
                    s[usize::from(i) % 4] = s[usize::from(i) % 4].wrapping_add(1);
                }
                s
            };
            let lse = b
                .saturating_mul(s_q)
                .saturating_mul(h_kv.saturating_mul(group));
            (
                operand(off(0, q_shape)),
                operand(off(1, kv_shape)),
                operand(off(2, kv_shape)),
                operand(off(3, q_shape)),
                prop_oneof![4 => Just(lse), 1 => Just(lse.saturating_sub(1)), 1 => any::<usize>()],
            )
        })
}

/// One generated call: the operands' layouts and buffer lengths, the config's window and scale,
/// and whether it is a backward.
type Call = (
    (
        (Layout, usize),
        (Layout, usize),
        (Layout, usize),
        (Layout, usize),
        usize,
    ),
    (Option<usize>, Option<usize>),
    Option<f32>,
    bool,
);

fn accepted_call_stays_inside_its_buffers(call: Call) -> Result<(), TestCaseError> {
    let (((q, lq), (k, lk), (v, lv), (o, lo), llse), window, scale, backward) = call;
    let cfg = AttentionConfig {
        softmax_scale: scale,
        ..AttentionConfig::new()
    }
    .window(window.0, window.1);
    let checked = if backward {
        check_backward(
            DType::F32,
            [(&q, lq), (&k, lk), (&v, lv), (&o, lo), (&o, lo)],
            llse,
            [(&q, lq), (&k, lk), (&v, lv)],
        )
    } else {
        check_forward(DType::F32, [(&q, lq), (&k, lk), (&v, lv)], (&o, lo), llse)
    };
    let Ok(p) = checked else { return Ok(()) };
    // Inside: every operand's largest offset is below its buffer's length.
    for (layout, len) in [(&q, lq), (&k, lk), (&v, lv), (&o, lo)] {
        prop_assert!(reach(layout) < len as u128, "{layout:?} over {len}");
    }
    prop_assert!(p.batch as u128 * p.heads_q as u128 * p.seqlen_q as u128 <= llse as u128);
    // Outputs reach each element once (O; in the backward dQ, dK, dV).
    let outputs: Vec<&Layout> = if backward { vec![&q, &k, &v] } else { vec![&o] };
    for l in outputs {
        prop_assert_ne!(distinct_offsets(l), Some(false), "{:?}", l);
    }
    // The planner, for the host and for a GPU, answers without panicking; a GPU plan
    // keeps to the kernels' limits.
    let op = if backward { Op::Backward } else { Op::Forward };
    let _ = dispatch::plan(op, &p, &cfg, &Memory::Host, BuiltKernels::Nothing);
    let gpu = Problem {
        dtype: DType::BF16,
        ..p
    };
    if dispatch::plan(op, &gpu, &cfg, &fake_h200(), all_gpu_kernels()).is_ok() {
        prop_assert!(p.seqlen_q.max(p.seqlen_k) <= MAX_GPU_SEQLEN);
        prop_assert!(matches!(p.head_dim, 64 | 128 | 256));
    }
    for i in [0, p.seqlen_q / 2, p.seqlen_q - 1] {
        let (lo, hi) = cfg.key_rule(p.seqlen_q, p.seqlen_k).key_range(i);
        prop_assert!(lo <= hi && hi <= p.seqlen_k);
    }
    // Small accepted calls run on the CPU backend over buffers of exactly these lengths.
    let work = [p.batch, p.heads_q, p.seqlen_q, p.seqlen_k, p.head_dim]
        .iter()
        .fold(1u128, |acc, &n| acc.saturating_mul(n as u128));
    let small = [lq, lk, lv, lo, llse].iter().all(|&n| n <= 2048) && work <= 1 << 16;
    if small && !backward && cfg.validate().is_ok() {
        let (qb, kb, vb) = (ramp(lq), ramp(lk), ramp(lv));
        let mut ob = vec![f32::NAN; lo];
        let mut lse = vec![f32::NAN; llse];
        let r = flashattn::forward_into(
            &cfg,
            TensorRef::new(&qb, q),
            TensorRef::new(&kb, k),
            TensorRef::new(&vb, v),
            TensorMut::new(&mut ob, o),
            &mut lse,
        );
        prop_assert!(r.is_ok(), "{r:?}");
    }
    Ok(())
}

#[test]
fn accepted_calls_stay_inside_their_buffers() {
    // Its own thread, for the stack that nested strategies take in unoptimized builds.
    let run = || {
        let config = ProptestConfig {
            cases: 100_000,
            failure_persistence: None,
            ..ProptestConfig::default()
        };
        let calls = (
            forward_case(),
            (
                prop::option::of(any::<usize>()),
                prop::option::of(any::<usize>()),
            ),
            prop_oneof![Just(None), any::<f32>().prop_map(Some)],
            any::<bool>(),
        );
        TestRunner::new(config)
            .run(&calls, accepted_call_stays_inside_its_buffers)
            .unwrap();
    };
    std::thread::Builder::new()
        .stack_size(256 << 20)
        .spawn(run)
        .unwrap()
        .join()
        .unwrap();
}
