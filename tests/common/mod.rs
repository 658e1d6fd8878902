//! What the GPU correctness tests share on the device side: the device, poisoned outputs, the
//! forward call of a case and its download. The case itself and the host side are in
//! tests/harness, which each test crate declares beside this module.
#![allow(dead_code)] // each test crate uses its own part

use std::sync::Arc;

use cudarc::driver::{CudaSlice, DeviceRepr};
use flashattn::cuda::{CudaStream, Device, DeviceForwardInputs, DeviceTensor, DeviceTensorMut};
use flashattn::{AttentionConfig, Element};

use crate::harness::Case;

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
) -> flashattn::Result<flashattn::Plan> {
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
