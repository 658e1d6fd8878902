//! The property test: every call the validation layer accepts stays inside its buffers.

use flashattn::dispatch::{self, BuiltKernels, Memory, Op};
use flashattn::tensor::{check_backward, check_forward, MAX_GPU_SEQLEN};
use flashattn::{AttentionConfig, DType, ForwardInputs, Layout, Problem, TensorMut, TensorRef};
use proptest::prelude::*;
use proptest::test_runner::{TestCaseError, TestRunner};

use crate::{all_gpu_kernels, fake_h200, ramp};

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
        prop_assert!(matches!(p.head_dim, 64 | 96 | 128 | 192 | 256));
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
            ForwardInputs::new(
                TensorRef::new(&qb, q),
                TensorRef::new(&kb, k),
                TensorRef::new(&vb, v),
            ),
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
