//! The validation layer against hostile input (no GPU needed): strides cast from negative ones,
//! broadcast (zero-stride) views, overlapping outputs, windows meaning "unbounded", sizes past
//! what the GPU kernels index, problems built by hand. Each must be a typed error or the
//! documented result, never a panic, an abort or a write outside a buffer; a property test
//! checks that every accepted call stays inside its buffers. `sinks` checks the CPU oracles
//! (reference and baseline) of attention sinks, `head_dim_v` the shapes, the planning and the
//! oracles of a V head dim apart from Q's.

mod head_dim_v;
mod limits;
mod property;
mod sinks;
mod small_problem;

use flashattn::dispatch::{self, BuiltKernels, DeviceInfo, Memory, Op};
use flashattn::{
    AttentionConfig, Backend, BackwardInputs, DType, Error, ForwardInputs, GradientsMut, Layout,
    Operand, Problem, TensorMut, TensorRef,
};

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
        head_dim_v: d,
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
    let cpu = flashattn::forward(
        &AttentionConfig::new(),
        ForwardInputs::new(t4(), t4(), t4()),
    )
    .unwrap();
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
    let e = flashattn::forward(&AttentionConfig::new(), ForwardInputs::new(t, t, t)).unwrap_err();
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
        ForwardInputs::new(qt, qt, qt),
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
            ForwardInputs::new(t, t, t),
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
    let fwd = flashattn::forward(&AttentionConfig::new(), ForwardInputs::new(t, t, t)).unwrap();
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
            sinks: None,
        },
        GradientsMut {
            dq: TensorMut::new(&mut dq, contiguous),
            dk: TensorMut::new(&mut dk, aliased),
            dv: TensorMut::new(&mut dv, contiguous),
            dsinks: None,
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
        ForwardInputs::new(
            qt,
            TensorRef::new(&kv, broadcast),
            TensorRef::new(&kv, broadcast),
        ),
    )
    .unwrap();
    let c = TensorRef::contiguous(&copied, [b, s, h, d]);
    let e = flashattn::forward(&cfg, ForwardInputs::new(qt, c, c)).unwrap();
    assert_eq!(a.out, e.out);
    assert_eq!(a.lse, e.lse);
}
