//! What the GPU correctness tests share on the device side: the device, poisoned outputs, the
//! forward call of a case and its download, and a forward and backward's tensors on the device
//! with the calls over them. The case itself and the host side are in tests/harness, which each
//! test crate declares beside this module.
#![allow(dead_code)] // each test crate uses its own part

use std::sync::Arc;

use cudarc::driver::{CudaSlice, DeviceRepr};
use flashattn::cuda::{
    CudaStream, Device, DeviceBackwardInputs, DeviceForwardInputs, DeviceGradientsMut,
    DeviceSeqlens, DeviceTensor, DeviceTensorMut,
};
use flashattn::{AttentionConfig, Element, Layout, Plan};

use crate::harness::{Case, Outputs};

/// The head dims outside the default build that this one has (`hdim96`, `hdim192`; the
/// forwards').
pub fn optional_head_dims() -> Vec<usize> {
    let mut dims = vec![];
    if cfg!(feature = "hdim96") {
        dims.push(96);
    }
    if cfg!(feature = "hdim192") {
        dims.push(192);
    }
    dims
}

/// Device 0 and a new stream on it; panics without a GPU.
pub fn device() -> (Device, Arc<CudaStream>) {
    let dev = Device::new(0).expect("a CUDA device (run these tests on the GPU machine)");
    let stream = dev.new_stream().unwrap();
    (dev, stream)
}

/// O (`len` elements) and the LSE of `case` on the device, poisoned with NaN so that an element
/// the kernel leaves unwritten shows.
pub fn poisoned_outputs<T: Element + DeviceRepr>(
    stream: &Arc<CudaStream>,
    case: &Case,
    len: usize,
) -> (CudaSlice<T>, CudaSlice<f32>) {
    let lse_len = case.batch * case.heads_q * case.seqlen_q;
    (
        stream
            .clone_htod(&vec![T::from_f32(f32::NAN); len])
            .unwrap(),
        stream.clone_htod(&vec![f32::NAN; lse_len]).unwrap(),
    )
}

/// NaN again into O and the LSE, in place.
pub fn poison<T: Element + DeviceRepr>(
    stream: &Arc<CudaStream>,
    (o, lse): &mut (CudaSlice<T>, CudaSlice<f32>),
) {
    stream
        .memcpy_htod(&vec![T::from_f32(f32::NAN); o.len()], o)
        .unwrap();
    stream.memcpy_htod(&vec![f32::NAN; lse.len()], lse).unwrap();
}

/// `dev.forward_into` of `case` (its layouts) over Q, K and V on the device, into `out` (O, LSE).
pub fn forward_into<T: Element + DeviceRepr>(
    dev: &Device,
    stream: &Arc<CudaStream>,
    case: &Case,
    cfg: &AttentionConfig,
    [q, k, v]: [&CudaSlice<T>; 3],
    (o, lse): &mut (CudaSlice<T>, CudaSlice<f32>),
) -> flashattn::Result<Plan> {
    let (lq, lk) = case.layouts();
    let (q, k, v) = (
        DeviceTensor::new(q.as_view(), lq),
        DeviceTensor::new(k.as_view(), lk),
        DeviceTensor::new(v.as_view(), lk),
    );
    dev.forward_into(
        stream,
        cfg,
        DeviceForwardInputs::new(&q, &k, &v),
        &mut DeviceTensorMut::new(o.as_view_mut(), lq),
        &mut lse.as_view_mut(),
    )
}

/// The tensors of a forward and its backward on the device: Q, K, V, dO and the sinks (where
/// the calls have them) as given; O, the LSE, dQ, dK, dV and (with sinks) the sinks' gradient
/// poisoned with NaN, so that an element a kernel leaves unwritten shows.
pub struct OnDevice<T> {
    pub q: CudaSlice<T>,
    pub k: CudaSlice<T>,
    pub v: CudaSlice<T>,
    pub dout: CudaSlice<T>,
    pub sinks: Option<CudaSlice<f32>>,
    pub out: CudaSlice<T>,
    pub lse: CudaSlice<f32>,
    pub dq: CudaSlice<T>,
    pub dk: CudaSlice<T>,
    pub dv: CudaSlice<T>,
    pub dsinks: Option<CudaSlice<f32>>,
}

impl<T: Element + DeviceRepr> OnDevice<T> {
    /// Q, K, V and dO (O as long as dO, dQ as Q, dK as K, dV as V), an LSE of `lse_len` values,
    /// and the sinks with their gradient where `sinks` is given.
    pub fn upload(
        stream: &Arc<CudaStream>,
        [q, k, v, dout]: [&[T]; 4],
        lse_len: usize,
        sinks: Option<&[f32]>,
    ) -> Self {
        let up = |x: &[T]| stream.clone_htod(x).unwrap();
        let nan = |n: usize| stream.clone_htod(&vec![T::from_f32(f32::NAN); n]).unwrap();
        let nan_f32 = |n: usize| stream.clone_htod(&vec![f32::NAN; n]).unwrap();
        OnDevice {
            q: up(q),
            k: up(k),
            v: up(v),
            dout: up(dout),
            sinks: sinks.map(|s| stream.clone_htod(s).unwrap()),
            out: nan(dout.len()),
            lse: nan_f32(lse_len),
            dq: nan(q.len()),
            dk: nan(k.len()),
            dv: nan(v.len()),
            dsinks: sinks.map(|s| nan_f32(s.len())),
        }
    }

    /// The forward, `dev.forward_into` or with `seqs` `dev.varlen_forward_into`, over the
    /// tensors seen in `views`.
    pub fn forward(
        &mut self,
        dev: &Device,
        stream: &Arc<CudaStream>,
        cfg: &AttentionConfig,
        seqs: Option<&DeviceSeqlens>,
        views: impl Into<Views>,
    ) -> flashattn::Result<Plan> {
        let views = views.into();
        let [q, k, v] = qkv([&self.q, &self.k, &self.v], &views);
        let sinks = self.sinks.as_ref().map(|s| s.as_view());
        let inputs = DeviceForwardInputs {
            sinks: sinks.as_ref(),
            ..DeviceForwardInputs::new(&q, &k, &v)
        };
        let out = &mut DeviceTensorMut::new(self.out.as_view_mut(), views.o);
        let lse = &mut self.lse.as_view_mut();
        match seqs {
            Some(seqs) => dev.varlen_forward_into(stream, cfg, seqs, inputs, out, lse),
            None => dev.forward_into(stream, cfg, inputs, out, lse),
        }
    }

    /// The backward from the forward's O and LSE, `dev.backward_into` or with `seqs`
    /// `dev.varlen_backward_into`, in the same layouts as [`OnDevice::forward`]: dQ, dK, dV and
    /// (with sinks) the sinks' gradient.
    pub fn backward(
        &mut self,
        dev: &Device,
        stream: &Arc<CudaStream>,
        cfg: &AttentionConfig,
        seqs: Option<&DeviceSeqlens>,
        views: impl Into<Views>,
    ) -> flashattn::Result<Plan> {
        let views = views.into();
        let [q, k, v] = qkv([&self.q, &self.k, &self.v], &views);
        let out = DeviceTensor::new(self.out.as_view(), views.o);
        let dout = DeviceTensor::new(self.dout.as_view(), views.o);
        let (lse, sinks) = (self.lse.as_view(), self.sinks.as_ref().map(|s| s.as_view()));
        let inputs = DeviceBackwardInputs {
            q: &q,
            k: &k,
            v: &v,
            out: &out,
            dout: &dout,
            lse: &lse,
            sinks: sinks.as_ref(),
        };
        let mut dsinks = self.dsinks.as_mut().map(|s| s.as_view_mut());
        let grads = DeviceGradientsMut {
            dq: &mut DeviceTensorMut::new(self.dq.as_view_mut(), views.q),
            dk: &mut DeviceTensorMut::new(self.dk.as_view_mut(), views.k),
            dv: &mut DeviceTensorMut::new(self.dv.as_view_mut(), views.v),
            dsinks: dsinks.as_mut(),
        };
        match seqs {
            Some(seqs) => dev.varlen_backward_into(stream, cfg, seqs, inputs, grads),
            None => dev.backward_into(stream, cfg, inputs, grads),
        }
    }

    /// Every output back on the host, after everything queued on `stream` before.
    pub fn download(&self, stream: &Arc<CudaStream>) -> Outputs<T> {
        let down = |x: &CudaSlice<T>| stream.clone_dtoh(x).unwrap();
        let outputs = Outputs {
            out: down(&self.out),
            lse: stream.clone_dtoh(&self.lse).unwrap(),
            dq: down(&self.dq),
            dk: down(&self.dk),
            dv: down(&self.dv),
            dsinks: self.dsinks.as_ref().map(|s| stream.clone_dtoh(s).unwrap()),
        };
        stream.synchronize().unwrap();
        outputs
    }
}

/// The layouts [`OnDevice`]'s tensors are seen in: Q's (dQ's), K's (dK's), V's (dV's) and
/// O's (dO's). From a pair (Q's, K's) where V's head dim is Q's: V as K, O as Q.
#[derive(Clone, Copy, Debug)]
pub struct Views {
    pub q: Layout,
    pub k: Layout,
    pub v: Layout,
    pub o: Layout,
}

impl Views {
    /// A case's layouts of Q, K, V and O in its storage.
    pub fn of(case: &Case) -> Self {
        let ((q, k), (v, o)) = (case.layouts(), case.v_layouts());
        Views { q, k, v, o }
    }
}

impl From<(Layout, Layout)> for Views {
    fn from((q, k): (Layout, Layout)) -> Self {
        Views { q, k, v: k, o: q }
    }
}

/// Q, K and V seen in their views.
fn qkv<'a, T: DeviceRepr>(
    [q, k, v]: [&'a CudaSlice<T>; 3],
    views: &Views,
) -> [DeviceTensor<'a, T>; 3] {
    [
        DeviceTensor::new(q.as_view(), views.q),
        DeviceTensor::new(k.as_view(), views.k),
        DeviceTensor::new(v.as_view(), views.v),
    ]
}

/// O and the LSE back on the host, after everything queued on `stream` before.
pub fn download<T: Element + DeviceRepr>(
    stream: &Arc<CudaStream>,
    (o, lse): &(CudaSlice<T>, CudaSlice<f32>),
) -> (Vec<T>, Vec<f32>) {
    let o: Vec<T> = stream.clone_dtoh(o).unwrap();
    let lse: Vec<f32> = stream.clone_dtoh(lse).unwrap();
    stream.synchronize().unwrap();
    (o, lse)
}

/// O and the LSE of a call whose head 0 has a NaN key that all its rows see, outputs poisoned
/// with NaN before it: head 0's rows NaN throughout, every other row written and free of NaN.
pub fn assert_nan_in_head_0<T: Element>(case: &Case, o: &[T], lse: &[f32], label: &str) {
    for (row, values) in o.chunks(case.head_dim).enumerate() {
        let (head, i) = (row % case.heads_q, row / case.heads_q);
        let nan = values.iter().filter(|x| x.to_f32().is_nan()).count();
        let want = if head == 0 { case.head_dim } else { 0 };
        assert_eq!(nan, want, "{label}: row {i} head {head}");
        let lse = lse[head * case.seqlen_q + i];
        assert_eq!(
            lse.is_nan(),
            head == 0,
            "{label}: row {i} head {head}: LSE {lse}"
        );
    }
}
