//! Bad outputs (short, overlapping, misaligned) refused with typed errors, buffers left untouched.

use flashattn::cuda::{
    DeviceBackwardInputs, DeviceForwardInputs, DeviceGradientsMut, DeviceTensor, DeviceTensorMut,
};
use flashattn::{AttentionConfig, Error, Layout, Operand};
use half::bf16;
use rand::rngs::StdRng;
use rand::SeedableRng;

use crate::common::device;
use crate::harness::random;
use crate::{assert_untouched, sentinel};

#[test]
#[ignore = "needs a GPU"]
fn device_calls_refuse_bad_outputs_with_typed_errors() {
    let (dev, stream) = device();
    let mut rng = StdRng::seed_from_u64(3);
    let (b, s, h, hkv, d) = (2, 96, 4, 2, 128);
    let lq = Layout::contiguous([b, s, h, d]);
    let lk = Layout::contiguous([b, s, hkv, d]);
    let mut up = |n| stream.clone_htod(&random::<bf16>(n, &mut rng)).unwrap();
    let (q, k, v) = (up(b * s * h * d), up(b * s * hkv * d), up(b * s * hkv * d));
    let (tq, tk, tv) = (
        DeviceTensor::new(q.as_view(), lq),
        DeviceTensor::new(k.as_view(), lk),
        DeviceTensor::new(v.as_view(), lk),
    );
    let mut o = sentinel(&stream, b * s * h * d);
    let mut lse = stream.clone_htod(&vec![f32::NAN; b * h * s]).unwrap();
    let cfg = AttentionConfig::new();
    // Short LSE, short O, O rows on top of each other, misaligned Q rows.
    let e = dev
        .forward_into(
            &stream,
            &cfg,
            DeviceForwardInputs::new(&tq, &tk, &tv),
            &mut DeviceTensorMut::new(o.as_view_mut(), lq),
            &mut lse.slice_mut(1..),
        )
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::BufferTooSmall {
                operand: Operand::Lse,
                ..
            }
        ),
        "{e:?}"
    );
    let e = dev
        .forward_into(
            &stream,
            &cfg,
            DeviceForwardInputs::new(&tq, &tk, &tv),
            &mut DeviceTensorMut::new(o.slice_mut(1..), lq),
            &mut lse.as_view_mut(),
        )
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::BufferTooSmall {
                operand: Operand::Out,
                ..
            }
        ),
        "{e:?}"
    );
    let zero_rows = Layout::with_strides([b, s, h, d], [s * h * d, 0, d, 1]);
    let e = dev
        .forward_into(
            &stream,
            &cfg,
            DeviceForwardInputs::new(&tq, &tk, &tv),
            &mut DeviceTensorMut::new(o.as_view_mut(), zero_rows),
            &mut lse.as_view_mut(),
        )
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::OverlappingOutput {
                operand: Operand::Out,
                ..
            }
        ),
        "{e:?}"
    );
    let odd = Layout::with_strides([1, 2, 1, d], [2 * 130, 130, d, 1]);
    let e = dev
        .forward_into(
            &stream,
            &cfg,
            DeviceForwardInputs::new(
                &DeviceTensor::new(q.slice(0..2 * 130), odd),
                &DeviceTensor::new(k.slice(0..2 * 130), odd),
                &DeviceTensor::new(v.slice(0..2 * 130), odd),
            ),
            &mut DeviceTensorMut::new(o.slice_mut(0..2 * 130), odd),
            &mut lse.slice_mut(0..2),
        )
        .unwrap_err();
    assert!(
        matches!(e, Error::Misaligned { .. }),
        "odd row stride: {e:?}"
    );
    assert_untouched(&stream, &o, "refused forwards");
    // dQ shaped like K (GQA), dO of another shape.
    let mut g = (0..3)
        .map(|_| sentinel(&stream, b * s * h * d))
        .collect::<Vec<_>>();
    let [gq, gk, gv] = &mut g[..] else {
        unreachable!()
    };
    let e = dev
        .backward_into(
            &stream,
            &cfg,
            DeviceBackwardInputs {
                q: &tq,
                k: &tk,
                v: &tv,
                out: &tq,
                dout: &tq,
                lse: &lse.as_view(),
                sinks: None,
            },
            DeviceGradientsMut {
                dq: &mut DeviceTensorMut::new(gq.as_view_mut(), lk),
                dk: &mut DeviceTensorMut::new(gk.as_view_mut(), lk),
                dv: &mut DeviceTensorMut::new(gv.as_view_mut(), lk),
                dsinks: None,
            },
        )
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::ShapeMismatch {
                operand: Operand::DQ,
                ..
            }
        ),
        "{e:?}"
    );
    let e = dev
        .backward_into(
            &stream,
            &cfg,
            DeviceBackwardInputs {
                q: &tq,
                k: &tk,
                v: &tv,
                out: &tq,
                dout: &tk,
                lse: &lse.as_view(),
                sinks: None,
            },
            DeviceGradientsMut {
                dq: &mut DeviceTensorMut::new(gq.as_view_mut(), lq),
                dk: &mut DeviceTensorMut::new(gk.as_view_mut(), lk),
                dv: &mut DeviceTensorMut::new(gv.as_view_mut(), lk),
                dsinks: None,
            },
        )
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::ShapeMismatch {
                operand: Operand::DOut,
                ..
            }
        ),
        "{e:?}"
    );
    for (i, x) in g.iter().enumerate() {
        assert_untouched(&stream, x, &format!("gradient {i} of refused backwards"));
    }
    // E4M3 is the FP8 forward's, not forward_into's.
    let e8 = stream
        .clone_htod(&vec![float8::F8E4M3::from_f32(1.0); b * s * h * d])
        .unwrap();
    let t8 = DeviceTensor::new(e8.as_view(), lq);
    let mut o8 = stream
        .clone_htod(&vec![float8::F8E4M3::from_f32(0.0); b * s * h * d])
        .unwrap();
    let e = dev
        .forward_into(
            &stream,
            &cfg,
            DeviceForwardInputs::new(&t8, &t8, &t8),
            &mut DeviceTensorMut::new(o8.as_view_mut(), lq),
            &mut lse.as_view_mut(),
        )
        .unwrap_err();
    assert!(matches!(e, Error::Unsupported { .. }), "{e:?}");
}
