//! Sizes past what the kernels index, kernels not built, hand-built problems, windows, huge inputs.

use flashattn::dispatch::{self, BuiltKernels, Memory, Op};
use flashattn::fp8::{fwht, Fp8Tensor, Granularity, RandomSignHadamard};
use flashattn::registry::{Family, KernelDtype};
use flashattn::tensor::MAX_GPU_SEQLEN;
use flashattn::{
    AttentionConfig, Backend, DType, Error, ForwardInputs, Layout, Operand, Problem, TensorMut,
    TensorRef,
};

use crate::{all_gpu_kernels, fake_h200, problem, ramp};

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
            Family::Sm90Fp8CacheFwd => (Op::ForwardOverFp8Cache, Backend::Sm90),
            Family::Sm90Bwd => (Op::Backward, Backend::Sm90),
            Family::Sm80Fwd => (Op::Forward, Backend::Sm80),
            Family::Sm80Bwd => (Op::Backward, Backend::Sm80),
            Family::Sm80Fp8CacheFwd => (Op::ForwardOverFp8Cache, Backend::Sm80),
        };
        let dtype = match k.dtype {
            KernelDtype::Bf16 => DType::BF16,
            KernelDtype::Fp16 => DType::F16,
            KernelDtype::E4m3 => DType::E4M3,
        };
        let p = Problem {
            dtype,
            head_dim_v: k.head_dim_v,
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
fn the_optional_head_dims_take_the_sm90_backward_and_the_fp8_forward() {
    let plan = |op, d, backend, dtype| {
        dispatch::plan(
            op,
            &Problem {
                dtype,
                ..problem(2, 300, 300, 4, d)
            },
            &AttentionConfig::new().backend(backend),
            &fake_h200(),
            all_gpu_kernels(),
        )
    };
    // d96 and d192 have both backwards: Auto takes the sm90 one, forced sm80 its own.
    for d in [96, 192] {
        for (backend, want) in [
            (Backend::Auto, Backend::Sm90),
            (Backend::Sm90, Backend::Sm90),
            (Backend::Sm80, Backend::Sm80),
        ] {
            let bwd = plan(Op::Backward, d, backend, DType::BF16).unwrap();
            assert_eq!(bwd.backend, want, "d{d} {backend:?}");
        }
    }
    // The FP8 forward has its d96 and d192 kernels; a head dim no family has is refused as such.
    for d in [96, 192] {
        let fwd = plan(Op::Forward, d, Backend::Sm90, DType::E4M3).unwrap();
        let text = fwd.explain();
        assert!(text.contains(&format!("sm90 fp8 fwd d{d} e4m3")), "{text}");
    }
    let e = plan(Op::Forward, 80, Backend::Sm90, DType::E4M3).unwrap_err();
    assert!(
        matches!(e, Error::UnsupportedHeadDim { head_dim: 80, .. }),
        "{e}"
    );
}

#[test]
fn softcap_in_the_deterministic_backward_is_refused_on_sm90_and_taken_by_sm80() {
    let plan = |cfg: AttentionConfig| {
        dispatch::plan(
            Op::Backward,
            &problem(2, 300, 300, 4, 128),
            &cfg,
            &fake_h200(),
            all_gpu_kernels(),
        )
    };
    let cfg = AttentionConfig::new().softcap(30.0).deterministic(true);
    let e = plan(cfg.clone().backend(Backend::Sm90)).unwrap_err();
    assert!(
        matches!(e, Error::Unsupported { .. }) && e.to_string().contains("softcap"),
        "{e}"
    );
    assert_eq!(plan(cfg).unwrap().backend, Backend::Sm80);
    // Without deterministic mode the sm90 backward takes softcap.
    let plain = plan(AttentionConfig::new().softcap(30.0)).unwrap();
    assert_eq!(plain.backend, Backend::Sm90);
}

#[test]
fn softcap_with_the_sinks_gradient_is_refused_on_sm90_and_taken_by_sm80() {
    let plan = |op, cfg: AttentionConfig| {
        dispatch::plan(
            op,
            &problem(2, 300, 300, 4, 128),
            &cfg,
            &fake_h200(),
            all_gpu_kernels(),
        )
    };
    let cfg = AttentionConfig::new().softcap(30.0);
    let e = plan(
        Op::BackwardWithSinkGradient,
        cfg.clone().backend(Backend::Sm90),
    )
    .unwrap_err();
    assert!(
        matches!(e, Error::Unsupported { .. }) && e.to_string().contains("sinks"),
        "{e}"
    );
    let auto = plan(Op::BackwardWithSinkGradient, cfg.clone()).unwrap();
    assert_eq!(auto.backend, Backend::Sm80);
    // Without softcap, or without the gradient, the sm90 backward takes the call.
    for (op, cfg) in [
        (Op::BackwardWithSinkGradient, AttentionConfig::new()),
        (Op::Backward, cfg),
    ] {
        assert_eq!(plan(op, cfg).unwrap().backend, Backend::Sm90);
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
    let plain = flashattn::forward(&AttentionConfig::new(), ForwardInputs::new(t, t, t)).unwrap();
    let wide = AttentionConfig::new().window(Some(usize::MAX), Some(usize::MAX));
    let w = flashattn::forward(&wide, ForwardInputs::new(t, t, t)).unwrap();
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
    let e =
        flashattn::forward(&AttentionConfig::new(), ForwardInputs::new(big_q, k, k)).unwrap_err();
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
    let e = flashattn::forward(
        &AttentionConfig::new(),
        ForwardInputs::new(one, endless, endless),
    )
    .unwrap_err();
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
        ForwardInputs::new(t, t, t),
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
