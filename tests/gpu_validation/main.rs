//! Hostile input through the device API (GPU; run with `--include-ignored`): views whose offsets
//! wrap past usize::MAX, outputs that reach an element twice, streams and buffers of another
//! CUDA context, broadcast inputs, short buffers, FP8 descales that are not positive numbers.
//! Each is a typed error (buffers around the views unchanged) or the documented result.
#![cfg(feature = "cuda")]

#[path = "../common/mod.rs"]
mod common;
#[path = "../harness/mod.rs"]
mod harness;

mod fp8;
mod outputs;

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use flashattn::cuda::{
    DeviceBackwardInputs, DeviceForwardInputs, DeviceGradientsMut, DeviceTensor, DeviceTensorMut,
    Fp8ForwardInputs, Fp8Options,
};
use flashattn::reference::{self, compare};
use flashattn::{AttentionConfig, Backend, Error, Layout, Operand, TensorRef};
use half::bf16;
use rand::rngs::StdRng;
use rand::SeedableRng;

use common::device;
use harness::random;

/// A sentinel the refused calls must leave in place.
const UNTOUCHED: f32 = 7.25;

fn sentinel(stream: &Arc<CudaStream>, n: usize) -> CudaSlice<bf16> {
    stream
        .clone_htod(&vec![bf16::from_f32(UNTOUCHED); n])
        .unwrap()
}

fn assert_untouched(stream: &Arc<CudaStream>, buf: &CudaSlice<bf16>, what: &str) {
    let host: Vec<bf16> = stream.clone_dtoh(buf).unwrap();
    stream.synchronize().unwrap();
    let changed = host.iter().filter(|x| x.to_f32() != UNTOUCHED).count();
    assert_eq!(
        changed, 0,
        "{what}: a refused call wrote {changed} elements"
    );
}

/// The review's construction: a [2,1,1,64] view of 64 elements in the middle of a buffer whose
/// batch stride is usize::MAX - 63, so that batch 1's row would sit before the view.
fn wrapping_layout() -> Layout {
    Layout::with_strides([2, 1, 1, 64], [usize::MAX - 63, 0, 0, 1])
}

#[test]
#[ignore = "needs a GPU"]
fn views_that_wrap_past_usize_max_are_refused_on_the_device() {
    let (dev, stream) = device();
    let mut rng = StdRng::seed_from_u64(1);
    let x = stream.clone_htod(&random::<bf16>(128, &mut rng)).unwrap();
    let lay = Layout::contiguous([2, 1, 1, 64]);
    let t = DeviceTensor::new(x.as_view(), lay);
    let mut lse = stream.clone_htod(&vec![f32::NAN; 2]).unwrap();
    for backend in [Backend::Sm90, Backend::Sm80] {
        let cfg = AttentionConfig::new().backend(backend);
        // O.
        let mut big = sentinel(&stream, 1024);
        let e = dev
            .forward_into(
                &stream,
                &cfg,
                DeviceForwardInputs::new(&t, &t, &t),
                &mut DeviceTensorMut::new(big.slice_mut(512..576), wrapping_layout()),
                &mut lse.as_view_mut(),
            )
            .unwrap_err();
        assert!(
            matches!(
                e,
                Error::IndexOverflow {
                    operand: Operand::Out,
                    ..
                }
            ),
            "{e:?}"
        );
        assert_untouched(&stream, &big, "forward O");
        // dQ, dK, dV in turn.
        for which in 0..3 {
            let mut big = sentinel(&stream, 1024);
            let mut grads: Vec<CudaSlice<bf16>> = (0..3).map(|_| sentinel(&stream, 128)).collect();
            let [g0, g1, g2] = &mut grads[..] else {
                unreachable!()
            };
            let mut views: Vec<DeviceTensorMut<bf16>> = [g0, g1, g2]
                .into_iter()
                .map(|g| DeviceTensorMut::new(g.as_view_mut(), lay))
                .collect();
            views[which] = DeviceTensorMut::new(big.slice_mut(512..576), wrapping_layout());
            let [dq, dk, dv] = &mut views[..] else {
                unreachable!()
            };
            let e = dev
                .backward_into(
                    &stream,
                    &cfg,
                    DeviceBackwardInputs {
                        q: &t,
                        k: &t,
                        v: &t,
                        out: &t,
                        dout: &t,
                        lse: &lse.as_view(),
                        sinks: None,
                    },
                    DeviceGradientsMut {
                        dq,
                        dk,
                        dv,
                        dsinks: None,
                    },
                )
                .unwrap_err();
            assert!(matches!(e, Error::IndexOverflow { .. }), "{e:?}");
            drop(views);
            assert_untouched(&stream, &big, "backward gradient");
        }
    }
    // The quantize step's source.
    let big = sentinel(&stream, 1024);
    let src = DeviceTensor::new(big.slice(512..576), wrapping_layout());
    let e = dev
        .quantize_fp8(&stream, &src, &t, &t, Fp8Options::default())
        .unwrap_err();
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
}

#[test]
#[ignore = "needs a GPU"]
fn streams_and_buffers_of_another_context_are_refused() {
    let (dev, stream) = device();
    let other = CudaContext::new_non_primary(0, 0).unwrap();
    let other_stream = other.default_stream();
    let mut rng = StdRng::seed_from_u64(2);
    let (s, h, d) = (128, 2, 64);
    let lay = Layout::contiguous([1, s, h, d]);
    let data = random::<bf16>(s * h * d, &mut rng);
    let here = stream.clone_htod(&data).unwrap();
    let there = other_stream.clone_htod(&data).unwrap();
    let mut o = stream.clone_htod(&vec![bf16::NAN; s * h * d]).unwrap();
    let mut lse = stream.clone_htod(&vec![f32::NAN; h * s]).unwrap();
    let cfg = AttentionConfig::new();
    let mine = DeviceTensor::new(here.as_view(), lay);
    let theirs = DeviceTensor::new(there.as_view(), lay);
    // Attention sinks, and their gradient's buffer, of the other context.
    let sinks_here = stream.clone_htod(&[0.5f32; 2]).unwrap();
    let sinks_there = other_stream.clone_htod(&[0.5f32; 2]).unwrap();
    let mut dsinks_there = other_stream.clone_htod(&[f32::NAN; 2]).unwrap();
    let e = dev
        .forward_into(
            &stream,
            &cfg,
            DeviceForwardInputs::new(&mine, &mine, &mine).with_sinks(&sinks_there.as_view()),
            &mut DeviceTensorMut::new(o.as_view_mut(), lay),
            &mut lse.as_view_mut(),
        )
        .unwrap_err();
    assert!(matches!(e, Error::WrongDevice { .. }), "sinks: {e:?}");
    let mut grads = [(); 3].map(|_| stream.clone_htod(&vec![bf16::NAN; s * h * d]).unwrap());
    let [g_q, g_k, g_v] = &mut grads;
    let e = dev
        .backward_into(
            &stream,
            &cfg,
            DeviceBackwardInputs {
                q: &mine,
                k: &mine,
                v: &mine,
                out: &mine,
                dout: &mine,
                lse: &lse.as_view(),
                sinks: Some(&sinks_here.as_view()),
            },
            DeviceGradientsMut {
                dq: &mut DeviceTensorMut::new(g_q.as_view_mut(), lay),
                dk: &mut DeviceTensorMut::new(g_k.as_view_mut(), lay),
                dv: &mut DeviceTensorMut::new(g_v.as_view_mut(), lay),
                dsinks: Some(&mut dsinks_there.as_view_mut()),
            },
        )
        .unwrap_err();
    assert!(matches!(e, Error::WrongDevice { .. }), "dsinks: {e:?}");
    let mut forward = |stream: &Arc<CudaStream>, k: &DeviceTensor<bf16>| {
        dev.forward_into(
            stream,
            &cfg,
            DeviceForwardInputs::new(&mine, k, &mine),
            &mut DeviceTensorMut::new(o.as_view_mut(), lay),
            &mut lse.as_view_mut(),
        )
    };
    let e = forward(&other_stream, &mine).unwrap_err();
    assert!(matches!(e, Error::WrongDevice { .. }), "stream: {e:?}");
    let e = forward(&stream, &theirs).unwrap_err();
    assert!(matches!(e, Error::WrongDevice { .. }), "K: {e:?}");
    // The FP8 path: its quantize step on the other context's stream, then its forward into an
    // output of the other context.
    if dev.info().compute_capability() == (9, 0) {
        let e = dev
            .quantize_fp8(&other_stream, &mine, &mine, &mine, Fp8Options::default())
            .unwrap_err();
        assert!(
            matches!(e, Error::WrongDevice { .. }),
            "quantize stream: {e:?}"
        );
        let e = dev
            .quantize_fp8(&stream, &mine, &theirs, &mine, Fp8Options::default())
            .unwrap_err();
        assert!(matches!(e, Error::WrongDevice { .. }), "quantize K: {e:?}");
        let inputs = dev
            .quantize_fp8(&stream, &mine, &mine, &mine, Fp8Options::default())
            .unwrap();
        let mut o_there = other_stream
            .clone_htod(&vec![bf16::NAN; s * h * d])
            .unwrap();
        let mut lse8 = stream.clone_htod(&vec![f32::NAN; h * s]).unwrap();
        let e = dev
            .forward_fp8_into(
                &stream,
                &cfg,
                Fp8ForwardInputs::new(&inputs),
                &mut DeviceTensorMut::new(o_there.as_view_mut(), lay),
                &mut lse8.as_view_mut(),
            )
            .unwrap_err();
        assert!(matches!(e, Error::WrongDevice { .. }), "FP8 output: {e:?}");
    }
    // The context survived: a correct call still runs.
    forward(&stream, &mine).unwrap();
    stream.synchronize().unwrap();
}

/// K and V broadcast over heads (head stride 0) and Q over batch entries (batch stride 0) read as
/// the layouts say, on both GPU families, under the correctness rule (docs/ARCHITECTURE.md) against
/// the f64 reference.
#[test]
#[ignore = "needs a GPU"]
fn broadcast_inputs_read_as_their_layouts_say() {
    let (dev, stream) = device();
    let mut rng = StdRng::seed_from_u64(4);
    let (b, s, h, d) = (2, 200, 4, 128);
    let q = random::<bf16>(s * h * d, &mut rng);
    let k = random::<bf16>(b * s * d, &mut rng);
    let v = random::<bf16>(b * s * d, &mut rng);
    let lq = Layout::with_strides([b, s, h, d], [0, h * d, d, 1]);
    let lk = Layout::with_strides([b, s, h, d], [s * d, d, 0, 1]);
    let lo = Layout::contiguous([b, s, h, d]);
    let (qd, kd, vd) = (
        stream.clone_htod(&q).unwrap(),
        stream.clone_htod(&k).unwrap(),
        stream.clone_htod(&v).unwrap(),
    );
    let (tq, tk, tv) = (
        TensorRef::new(&q, lq),
        TensorRef::new(&k, lk),
        TensorRef::new(&v, lk),
    );
    for backend in [Backend::Sm90, Backend::Sm80] {
        for causal in [false, true] {
            let cfg = AttentionConfig::new().causal(causal).backend(backend);
            let mut o = stream.clone_htod(&vec![bf16::NAN; b * s * h * d]).unwrap();
            let mut lse = stream.clone_htod(&vec![f32::NAN; b * h * s]).unwrap();
            dev.forward_into(
                &stream,
                &cfg,
                DeviceForwardInputs::new(
                    &DeviceTensor::new(qd.as_view(), lq),
                    &DeviceTensor::new(kd.as_view(), lk),
                    &DeviceTensor::new(vd.as_view(), lk),
                ),
                &mut DeviceTensorMut::new(o.as_view_mut(), lo),
                &mut lse.as_view_mut(),
            )
            .unwrap_or_else(|e| panic!("{backend:?}: {e}"));
            let o: Vec<bf16> = stream.clone_dtoh(&o).unwrap();
            let lse: Vec<f32> = stream.clone_dtoh(&lse).unwrap();
            stream.synchronize().unwrap();
            let got: Vec<f32> = o.iter().map(|x| x.to_f32()).collect();
            let want = reference::reference_forward(&cfg, tq, tk, tv);
            let base = reference::baseline_forward(&cfg, tq, tk, tv);
            let (co, cl) = (
                compare(&got, &want.out, &base.out),
                compare(&lse, &want.lse, &base.lse),
            );
            println!("broadcast {backend:?} causal={causal}: O {co}, LSE {cl}");
            assert!(
                co.pass && cl.pass,
                "{backend:?} causal={causal}: O {co}; LSE {cl}"
            );
        }
    }
}
