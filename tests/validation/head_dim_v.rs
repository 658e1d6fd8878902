//! V's head dim apart from Q's and K's (no GPU needed): the oracles the backends are judged by
//! (the f64 reference's gradients against finite differences of `Σ dO∘O`; zero columns appended
//! to V, or to Q and K, changing nothing in the reference and the baseline), the shape checks
//! (O, dO and dV take V's head dim, V keeps K's other sizes), and the planner's choice of
//! backend for such a call.

use flashattn::dispatch::{self, Op};
use flashattn::reference::{
    baseline_backward, baseline_forward, reference_backward, reference_backward_sinks,
    reference_forward,
};
use flashattn::{
    AttentionConfig, Backend, BackwardInputs, Error, ForwardInputs, GradientsMut, Memory, Operand,
    Problem, TensorMut, TensorRef,
};

use crate::{all_gpu_kernels, fake_h200, problem, ramp};

use crate::small_problem::{
    check_element_gradient, check_sink_gradient, configs, Grad, Inputs, B, D, HKV, HQ, SINKS, SK,
    SQ,
};

/// V's head dim in the finite-difference problem: wider than Q's and K's.
const DV: usize = 12;

/// The reference's dQ, dK, dV (one element each, in the last columns of each head dim, which a
/// gradient of the wrong width would leave out or misplace) and sink gradient against central
/// differences of the loss, with a mask that leaves rows without a key, softcap and a window.
#[test]
fn the_reference_gradients_are_finite_differences_of_the_loss() {
    let dq_at = ((SQ + 5) * HQ + 2) * D + D - 1;
    let dk_at = ((SK + 2) * HKV + 1) * D + D - 2;
    let dv_at = ((SK + 3) * HKV + 1) * DV + DV - 1;
    let x = Inputs::new(D, DV);
    for cfg in configs() {
        let [q, k, v, dout] = x.tensors();
        let (g, _) = reference_backward_sinks(&cfg, q, k, v, dout, &SINKS);
        // Without sinks the backward is the same code with no sink column.
        let plain = reference_backward(&cfg, q, k, v, dout);
        assert_eq!(plain.dv.len(), B * SK * HKV * DV);
        check_sink_gradient(&x, &cfg, &SINKS);
        for (grad, idx) in [(Grad::Q, dq_at), (Grad::K, dk_at), (Grad::V, dv_at)] {
            check_element_gradient(&x, &cfg, &SINKS, grad, idx);
        }
        assert!(g.dq.iter().chain(&g.dk).chain(&g.dv).all(|x| x.is_finite()));
    }
}

/// `x`, a packed `(…, w)` buffer, with zero columns appended to `w_to`.
fn widen(x: &[f32], w: usize, w_to: usize) -> Vec<f32> {
    x.chunks_exact(w)
        .flat_map(|row| {
            row.iter()
                .copied()
                .chain(std::iter::repeat_n(0.0, w_to - w))
        })
        .collect()
}

/// The first `w` of every `w_from` columns of `x`.
fn narrow<T: Copy>(x: &[T], w_from: usize, w: usize) -> Vec<T> {
    x.chunks_exact(w_from)
        .flat_map(|r| r[..w].to_vec())
        .collect()
}

/// Zero columns appended to V and dO (where V is narrower than Q) or to Q and K (where it is
/// wider), under a fixed scale, make the problem one of equal head dims whose results are the
/// narrower problem's padded with zeros: every sum only gains `+ 0` terms, so the reference and
/// the bf16 baseline must agree bit for bit, O, the LSE and every gradient.
#[test]
fn zero_columns_change_nothing_in_the_oracles() {
    let cfgs = [
        AttentionConfig::new().causal(true).softmax_scale(0.3),
        AttentionConfig::new()
            .window(Some(3), Some(1))
            .softcap(2.0)
            .softmax_scale(0.3),
    ];
    for (d, dv) in [(8, 12), (12, 8)] {
        let w = d.max(dv);
        let Inputs { q, k, v, dout, .. } = Inputs::new(d, dv);
        let bf =
            |x: &[f32]| -> Vec<half::bf16> { x.iter().map(|&y| half::bf16::from_f32(y)).collect() };
        let (qw, kw, vw, dow) = (
            widen(&q, d, w),
            widen(&k, d, w),
            widen(&v, dv, w),
            widen(&dout, dv, w),
        );
        let apart = [
            TensorRef::contiguous(&q, [B, SQ, HQ, d]),
            TensorRef::contiguous(&k, [B, SK, HKV, d]),
            TensorRef::contiguous(&v, [B, SK, HKV, dv]),
            TensorRef::contiguous(&dout, [B, SQ, HQ, dv]),
        ];
        let equal = [
            TensorRef::contiguous(&qw, [B, SQ, HQ, w]),
            TensorRef::contiguous(&kw, [B, SK, HKV, w]),
            TensorRef::contiguous(&vw, [B, SK, HKV, w]),
            TensorRef::contiguous(&dow, [B, SQ, HQ, w]),
        ];
        let (qb, kb, vb, dob) = (bf(&q), bf(&k), bf(&v), bf(&dout));
        let (qwb, kwb, vwb, dowb) = (bf(&qw), bf(&kw), bf(&vw), bf(&dow));
        let apart_bf = [
            TensorRef::contiguous(&qb, [B, SQ, HQ, d]),
            TensorRef::contiguous(&kb, [B, SK, HKV, d]),
            TensorRef::contiguous(&vb, [B, SK, HKV, dv]),
            TensorRef::contiguous(&dob, [B, SQ, HQ, dv]),
        ];
        let equal_bf = [
            TensorRef::contiguous(&qwb, [B, SQ, HQ, w]),
            TensorRef::contiguous(&kwb, [B, SK, HKV, w]),
            TensorRef::contiguous(&vwb, [B, SK, HKV, w]),
            TensorRef::contiguous(&dowb, [B, SQ, HQ, w]),
        ];
        for cfg in &cfgs {
            let [q1, k1, v1, do1] = apart;
            let [q2, k2, v2, do2] = equal;
            let (f1, f2) = (
                reference_forward(cfg, q1, k1, v1),
                reference_forward(cfg, q2, k2, v2),
            );
            assert_eq!(f1.out, narrow(&f2.out, w, dv), "d{d} dv{dv} O");
            assert_eq!(f1.lse, f2.lse, "d{d} dv{dv} LSE");
            let (g1, g2) = (
                reference_backward(cfg, q1, k1, v1, do1),
                reference_backward(cfg, q2, k2, v2, do2),
            );
            assert_eq!(g1.dq, narrow(&g2.dq, w, d), "d{d} dv{dv} dQ");
            assert_eq!(g1.dk, narrow(&g2.dk, w, d), "d{d} dv{dv} dK");
            assert_eq!(g1.dv, narrow(&g2.dv, w, dv), "d{d} dv{dv} dV");

            let [q1, k1, v1, do1] = apart_bf;
            let [q2, k2, v2, do2] = equal_bf;
            let (f1, f2) = (
                baseline_forward(cfg, q1, k1, v1),
                baseline_forward(cfg, q2, k2, v2),
            );
            assert_eq!(f1.out, narrow(&f2.out, w, dv), "d{d} dv{dv} baseline O");
            assert_eq!(f1.lse, f2.lse, "d{d} dv{dv} baseline LSE");
            let (g1, g2) = (
                baseline_backward(cfg, q1, k1, v1, do1),
                baseline_backward(cfg, q2, k2, v2, do2),
            );
            assert_eq!(g1.dq, narrow(&g2.dq, w, d), "d{d} dv{dv} baseline dQ");
            assert_eq!(g1.dk, narrow(&g2.dk, w, d), "d{d} dv{dv} baseline dK");
            assert_eq!(g1.dv, narrow(&g2.dv, w, dv), "d{d} dv{dv} baseline dV");
        }
    }
}

#[test]
fn o_do_and_dv_take_v_s_head_dim() {
    let (q, k, v) = (
        ramp(B * SQ * HQ * D),
        ramp(B * SK * HKV * D),
        ramp(B * SK * HKV * DV),
    );
    let tq = TensorRef::contiguous(&q, [B, SQ, HQ, D]);
    let tk = TensorRef::contiguous(&k, [B, SK, HKV, D]);
    let tv = TensorRef::contiguous(&v, [B, SK, HKV, DV]);
    let cfg = AttentionConfig::new();
    let mut lse = vec![0f32; B * HQ * SQ];
    // O with Q's head dim: refused before anything is written.
    let mut wide = vec![0f32; B * SQ * HQ * D];
    let e = flashattn::forward_into(
        &cfg,
        ForwardInputs::new(tq, tk, tv),
        TensorMut::contiguous(&mut wide, [B, SQ, HQ, D]),
        &mut lse,
    )
    .unwrap_err();
    assert_eq!(
        e,
        Error::ShapeMismatch {
            operand: Operand::Out,
            expected: [B, SQ, HQ, DV],
            found: [B, SQ, HQ, D],
        }
    );
    assert!(wide.iter().all(|&x| x == 0.0), "a refused call wrote");

    let fwd = flashattn::forward(&cfg, ForwardInputs::new(tq, tk, tv)).unwrap();
    assert_eq!(fwd.out.len(), B * SQ * HQ * DV);
    let o = TensorRef::contiguous(&fwd.out, [B, SQ, HQ, DV]);
    let q_like = TensorRef::contiguous(&wide, [B, SQ, HQ, D]);
    let [mut dq, mut dk, mut dv] = [q.len(), k.len(), v.len()].map(|n| vec![0f32; n]);
    let mut dv_like_k = vec![0f32; k.len()];
    let inputs = |out, dout| BackwardInputs {
        q: tq,
        k: tk,
        v: tv,
        out,
        dout,
        lse: &fwd.lse,
        sinks: None,
    };
    // O or dO with Q's head dim.
    for (operand, out, dout) in [(Operand::Out, q_like, o), (Operand::DOut, o, q_like)] {
        let e = flashattn::backward_into(
            &cfg,
            inputs(out, dout),
            GradientsMut {
                dq: TensorMut::contiguous(&mut dq, [B, SQ, HQ, D]),
                dk: TensorMut::contiguous(&mut dk, [B, SK, HKV, D]),
                dv: TensorMut::contiguous(&mut dv, [B, SK, HKV, DV]),
                dsinks: None,
            },
        )
        .unwrap_err();
        assert_eq!(
            e,
            Error::ShapeMismatch {
                operand,
                expected: [B, SQ, HQ, DV],
                found: [B, SQ, HQ, D],
            }
        );
    }
    // dV shaped like K.
    let e = flashattn::backward_into(
        &cfg,
        inputs(o, o),
        GradientsMut {
            dq: TensorMut::contiguous(&mut dq, [B, SQ, HQ, D]),
            dk: TensorMut::contiguous(&mut dk, [B, SK, HKV, D]),
            dv: TensorMut::contiguous(&mut dv_like_k, [B, SK, HKV, D]),
            dsinks: None,
        },
    )
    .unwrap_err();
    assert_eq!(
        e,
        Error::ShapeMismatch {
            operand: Operand::DV,
            expected: [B, SK, HKV, DV],
            found: [B, SK, HKV, D],
        }
    );
    let written = [&dq, &dk, &dv, &dv_like_k];
    assert!(
        written.iter().all(|g| g.iter().all(|&x| x == 0.0)),
        "a refused call wrote"
    );
    // Shaped right, the same call goes through: dV of V's head dim.
    let g = flashattn::backward(&cfg, inputs(o, o)).unwrap();
    assert_eq!(
        (g.dq.len(), g.dk.len(), g.dv.len()),
        (q.len(), k.len(), v.len())
    );
}

#[test]
fn v_keeps_k_s_batch_seqlen_and_heads() {
    let (q, k) = (ramp(B * SQ * HQ * D), ramp(B * SK * HKV * D));
    let tq = TensorRef::contiguous(&q, [B, SQ, HQ, D]);
    let tk = TensorRef::contiguous(&k, [B, SK, HKV, D]);
    let big = ramp(4 * SK * HQ * DV);
    for shape in [
        [1, SK, HKV, DV],
        [B, SK + 1, HKV, DV],
        [B, SK, HKV * 2, DV],
        [B, SQ, HKV, DV],
    ] {
        let tv = TensorRef::contiguous(&big, shape);
        let e = flashattn::forward(&AttentionConfig::new(), ForwardInputs::new(tq, tk, tv))
            .unwrap_err();
        assert_eq!(
            e,
            Error::ShapeMismatch {
                operand: Operand::V,
                expected: [B, SK, HKV, DV],
                found: shape,
            }
        );
    }
}

/// The CPU backend takes any pair of head dims; the GPU families take the pairs they have
/// kernels for (192/128: the 16-bit forwards and backwards of both) and refuse the others naming
/// which have them.
#[test]
fn the_planner_sends_v_head_dims_apart_where_they_are_built() {
    let mla = Problem {
        head_dim_v: 128,
        ..problem(2, 300, 300, 4, 192)
    };
    let odd = Problem {
        head_dim_v: 72,
        ..problem(2, 300, 300, 4, 40)
    };
    for p in [mla, odd] {
        for op in [Op::Forward, Op::Backward] {
            let plan = dispatch::plan(
                op,
                &p,
                &AttentionConfig::new(),
                &Memory::Host,
                all_gpu_kernels(),
            )
            .unwrap();
            assert_eq!(plan.backend, Backend::Cpu, "{op:?} {p:?}");
        }
    }
    let gpu = |op, backend| {
        dispatch::plan(
            op,
            &mla,
            &AttentionConfig::new().backend(backend),
            &fake_h200(),
            all_gpu_kernels(),
        )
    };
    for op in [Op::Forward, Op::Backward] {
        assert_eq!(gpu(op, Backend::Auto).unwrap().backend, Backend::Sm90);
        let plan = gpu(op, Backend::Sm80).unwrap();
        assert_eq!(plan.backend, Backend::Sm80, "{op:?}");
        assert!(
            plan.explain().contains("d192/128"),
            "{op:?}: {}",
            plan.explain()
        );
    }
    // A pair no family has, at head dims that exist alone: refused, saying none has it.
    let unbuilt = Problem {
        head_dim_v: 64,
        ..problem(2, 300, 300, 4, 128)
    };
    for backend in [Backend::Sm90, Backend::Sm80] {
        let e = dispatch::plan(
            Op::Forward,
            &unbuilt,
            &AttentionConfig::new().backend(backend),
            &fake_h200(),
            all_gpu_kernels(),
        )
        .unwrap_err();
        assert!(
            matches!(e, Error::Unsupported { .. })
                && e.to_string().contains("128/64")
                && e.to_string().contains("none"),
            "{backend:?}: {e}"
        );
    }
}
