//! The CUDA path: candle's CUDA storages as device tensor views, on candle's stream.

use std::collections::HashMap;
use std::sync::OnceLock;

use candle_core::cuda_backend::{CudaDType, CudaDevice};
use cudarc::driver::DeviceRepr;

use super::*;
use crate::cuda::{CudaSlice, Device, DeviceBackwardInputs, DeviceGradientsMut};
use crate::cuda::{DeviceTensor, DeviceTensorMut};

type Operand<'a> = (&'a CudaStorage, &'a candle_core::Layout);

/// Our `Device` for candle's: one per ordinal, opened once (it queries the device's
/// properties), and refused unless candle's context is the primary context it uses.
fn device(dev: &CudaDevice) -> candle_core::Result<Device> {
    static DEVICES: OnceLock<Mutex<HashMap<usize, Device>>> = OnceLock::new();
    let stream = dev.cuda_stream();
    let ordinal = stream.context().ordinal();
    let ours = {
        let mut devices = DEVICES
            .get_or_init(Default::default)
            .lock()
            .map_err(lock_error)?;
        match devices.get(&ordinal) {
            Some(d) => d.clone(),
            None => {
                let d = Device::new(ordinal).map_err(wrap)?;
                devices.insert(ordinal, d.clone());
                d
            }
        }
    };
    if **ours.context() != **stream.context() {
        candle_core::bail!(
            "flash_attn: candle's CUDA device {ordinal} runs in a context other than the \
             device's primary context, which the kernels use"
        );
    }
    Ok(ours)
}

fn view<'a, T: CudaDType + DeviceRepr>(
    (storage, layout): Operand<'a>,
) -> candle_core::Result<DeviceTensor<'a, T>> {
    let data = storage.as_cuda_slice::<T>()?;
    let data = data
        .try_slice(layout.start_offset()..)
        .ok_or_else(|| candle_core::Error::msg("flash_attn: a layout starts past its storage"))?;
    Ok(DeviceTensor::new(data, our_layout(layout)?))
}

pub(super) fn forward<T: Element + CudaDType + DeviceRepr>(
    cfg: &AttentionConfig,
    [q, k, v]: [Operand; 3],
) -> candle_core::Result<(CudaStorage, CudaSlice<f32>)> {
    let dev = &q.0.device;
    let ours = device(dev)?;
    let (q, k, v) = (view::<T>(q)?, view::<T>(k)?, view::<T>(v)?);
    let [b, s, h, d] = q.layout.shape;
    // SAFETY (both): the forward writes every element of O and the LSE (the GPU tests poison
    // them before each launch and find every one rewritten), and an error drops them unread;
    // no memset on a call that training makes at every layer.
    let mut out = unsafe { dev.alloc::<T>(b * s * h * d) }?;
    let mut lse = unsafe { dev.alloc::<f32>(b * h * s) }?;
    ours.forward_into(
        &dev.cuda_stream(),
        cfg,
        &q,
        &k,
        &v,
        &mut DeviceTensorMut::new(out.as_view_mut(), Layout::contiguous(q.layout.shape)),
        &mut lse.as_view_mut(),
    )
    .map_err(wrap)?;
    Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), lse))
}

pub(super) fn backward<T: Element + CudaDType + DeviceRepr>(
    cfg: &AttentionConfig,
    [q, k, v, out, dout]: [Operand; 5],
    lse: &CudaSlice<f32>,
) -> candle_core::Result<CudaStorage> {
    let dev = &q.0.device;
    let ours = device(dev)?;
    let (q, k, v) = (view::<T>(q)?, view::<T>(k)?, view::<T>(v)?);
    let (out, dout) = (view::<T>(out)?, view::<T>(dout)?);
    let (q_shape, kv_shape) = (q.layout.shape, k.layout.shape);
    let (nq, nk) = (q_shape.iter().product(), kv_shape.iter().product());
    let (kv_start, v_start) = grad_offsets(nq, nk);
    // SAFETY: the backward writes every element of dQ, dK and dV (poisoned and checked whole in
    // the GPU tests); the padding between them is never part of a tensor and never read.
    let mut grads = unsafe { dev.alloc::<T>(v_start + nk) }?;
    {
        let (mut dq, mut rest) = grads.split_at_mut(kv_start);
        let (mut dk, mut dv) = rest.split_at_mut(v_start - kv_start);
        ours.backward_into(
            &dev.cuda_stream(),
            cfg,
            DeviceBackwardInputs {
                q: &q,
                k: &k,
                v: &v,
                out: &out,
                dout: &dout,
                lse: &lse.as_view(),
            },
            DeviceGradientsMut {
                dq: &mut DeviceTensorMut::new(dq.slice_mut(..nq), Layout::contiguous(q_shape)),
                dk: &mut DeviceTensorMut::new(dk.slice_mut(..nk), Layout::contiguous(kv_shape)),
                dv: &mut DeviceTensorMut::new(dv.slice_mut(..nk), Layout::contiguous(kv_shape)),
            },
        )
        .map_err(wrap)?;
    }
    Ok(CudaStorage::wrap_cuda_slice(grads, dev.clone()))
}
