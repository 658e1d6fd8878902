//! The CUDA path: candle's CUDA storages as device tensor views, on candle's stream.

use std::collections::HashMap;
use std::sync::OnceLock;

use candle_core::cuda_backend::{CudaDType, CudaDevice};
use cudarc::driver::{DeviceRepr, ValidAsZeroBits};

use super::*;
use crate::cuda::{
    CudaSlice, CudaView, Device, DeviceBackwardInputs, DeviceForwardInputs, DeviceGradientsMut,
};
use crate::cuda::{DeviceSeqlens, DeviceTensor, DeviceTensorMut};

pub(super) type Operand<'a> = (&'a CudaStorage, &'a candle_core::Layout);

/// Our `Device` for candle's: one per ordinal, opened once (it queries the device's
/// properties), and refused unless candle's context is the primary context it uses.
pub(super) fn device(dev: &CudaDevice) -> candle_core::Result<Device> {
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

pub(super) fn view<'a, T: CudaDType + DeviceRepr>(
    (storage, layout): Operand<'a>,
) -> candle_core::Result<DeviceTensor<'a, T>> {
    let data = storage.as_cuda_slice::<T>()?;
    let data = data
        .try_slice(layout.start_offset()..)
        .ok_or_else(|| candle_core::Error::msg("flash_attn: a layout starts past its storage"))?;
    Ok(DeviceTensor::new(data, our_layout(layout)?))
}

/// A contiguous tensor of u32 or i32 values (offsets, counts, page numbers) as an i32 view of
/// its device memory (u32 values past `i32::MAX` read as negative, which the kernels clamp like
/// any malformed value); `what` names it in errors.
pub(super) fn i32_values<'a>(
    storage: &'a candle_core::Storage,
    layout: &candle_core::Layout,
    what: &str,
) -> candle_core::Result<CudaView<'a, i32>> {
    let candle_core::Storage::Cuda(storage) = storage else {
        candle_core::bail!("flash_attn: {what} is not on the CUDA device");
    };
    let range = layout.start_offset()..layout.start_offset() + layout.shape().elem_count();
    let missing = || candle_core::Error::msg(format!("flash_attn: {what} past its storage"));
    match storage.dtype() {
        DType::I32 => storage
            .as_cuda_slice::<i32>()?
            .try_slice(range)
            .ok_or_else(missing),
        _ => {
            let n = range.len();
            let u = storage
                .as_cuda_slice::<u32>()?
                .try_slice(range)
                .ok_or_else(missing)?;
            // SAFETY: u32 and i32 share size and alignment, and every bit pattern is an i32.
            unsafe { u.transmute::<i32>(n) }.ok_or_else(missing)
        }
    }
}

/// A packed call's offsets as the kernels read them ([`i32_values`]), handed to `f` while
/// candle's storages are held.
fn with_seqlens<R>(
    p: &Packed,
    f: impl FnOnce(&DeviceSeqlens) -> candle_core::Result<R>,
) -> candle_core::Result<R> {
    let (storage_q, layout_q) = p.cu_q.storage_and_layout();
    let (storage_k, layout_k) = p.cu_k.storage_and_layout();
    let seqs = DeviceSeqlens::new(
        i32_values(&storage_q, layout_q, "cu_seqlens_q")?,
        i32_values(&storage_k, layout_k, "cu_seqlens_k")?,
        p.max_q,
        p.max_k,
    )
    .map_err(wrap)?;
    f(&seqs)
}

pub(super) fn forward<T: Element + CudaDType + DeviceRepr + ValidAsZeroBits>(
    cfg: &AttentionConfig,
    packed: Option<&Packed>,
    [q, k, v]: [Operand; 3],
) -> candle_core::Result<(CudaStorage, CudaSlice<f32>)> {
    let dev = &q.0.device;
    let ours = device(dev)?;
    let (q, k, v) = (view::<T>(q)?, view::<T>(k)?, view::<T>(v)?);
    let ([b, s, h, _], dv) = (q.layout.shape, v.layout.head_dim());
    let o_layout = Layout::contiguous([b, s, h, dv]);
    if let Some(p) = packed {
        // Zeroed: rows that no sequence names (offsets short of the tensors) are not written.
        let mut out = dev.alloc_zeros::<T>(b * s * h * dv)?;
        let mut lse = dev.alloc_zeros::<f32>(h * s)?;
        with_seqlens(p, |seqs| {
            ours.varlen_forward_into(
                &dev.cuda_stream(),
                cfg,
                seqs,
                DeviceForwardInputs::new(&q, &k, &v),
                &mut DeviceTensorMut::new(out.as_view_mut(), o_layout),
                &mut lse.as_view_mut(),
            )
            .map_err(wrap)
        })?;
        return Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), lse));
    }
    // SAFETY (both): the forward writes every element of O and the LSE (the GPU tests poison
    // them before each launch and find every one rewritten), and an error drops them unread;
    // no memset on a call that training makes at every layer.
    let mut out = unsafe { dev.alloc::<T>(b * s * h * dv) }?;
    let mut lse = unsafe { dev.alloc::<f32>(b * h * s) }?;
    ours.forward_into(
        &dev.cuda_stream(),
        cfg,
        DeviceForwardInputs::new(&q, &k, &v),
        &mut DeviceTensorMut::new(out.as_view_mut(), o_layout),
        &mut lse.as_view_mut(),
    )
    .map_err(wrap)?;
    Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), lse))
}

pub(super) fn backward<T: Element + CudaDType + DeviceRepr + ValidAsZeroBits>(
    cfg: &AttentionConfig,
    packed: Option<&Packed>,
    [q, k, v, out, dout]: [Operand; 5],
    lse: &CudaSlice<f32>,
) -> candle_core::Result<CudaStorage> {
    let dev = &q.0.device;
    let ours = device(dev)?;
    let (q, k, v) = (view::<T>(q)?, view::<T>(k)?, view::<T>(v)?);
    let (out, dout) = (view::<T>(out)?, view::<T>(dout)?);
    let (q_shape, kv_shape, v_shape) = (q.layout.shape, k.layout.shape, v.layout.shape);
    let GradOffsets {
        counts: [nq, nk, nv],
        kv_start,
        v_start,
        len,
    } = grad_buffer([q_shape, kv_shape, v_shape])?;
    let mut grads = match packed {
        // Zeroed: rows that no sequence names are not written.
        Some(_) => dev.alloc_zeros::<T>(len)?,
        // SAFETY: the backward writes every element of dQ, dK and dV (poisoned and checked
        // whole in the GPU tests); the padding between them is never part of a tensor and never
        // read.
        None => unsafe { dev.alloc::<T>(len) }?,
    };
    {
        let (mut dq, mut rest) = grads.split_at_mut(kv_start);
        let (mut dk, mut dv) = rest.split_at_mut(v_start - kv_start);
        let inputs = DeviceBackwardInputs {
            q: &q,
            k: &k,
            v: &v,
            out: &out,
            dout: &dout,
            lse: &lse.as_view(),
            sinks: None,
        };
        let grads = DeviceGradientsMut {
            dq: &mut DeviceTensorMut::new(dq.slice_mut(..nq), Layout::contiguous(q_shape)),
            dk: &mut DeviceTensorMut::new(dk.slice_mut(..nk), Layout::contiguous(kv_shape)),
            dv: &mut DeviceTensorMut::new(dv.slice_mut(..nv), Layout::contiguous(v_shape)),
            dsinks: None,
        };
        let stream = dev.cuda_stream();
        match packed {
            Some(p) => with_seqlens(p, |seqs| {
                ours.varlen_backward_into(&stream, cfg, seqs, inputs, grads)
                    .map_err(wrap)
            })?,
            None => ours
                .backward_into(&stream, cfg, inputs, grads)
                .map_err(wrap)?,
        };
    }
    Ok(CudaStorage::wrap_cuda_slice(grads, dev.clone()))
}

/// [`super::flash_attn_with_kvcache`] on candle's stream: the counts (and the block table) as
/// i32 views of their device memory ([`i32_values`]), O zeroed first (a serving step's few
/// rows: the cost of the fill is small, and no row is left unwritten).
pub(super) fn kvcache_forward<T: Element + CudaDType + DeviceRepr + ValidAsZeroBits>(
    cfg: &AttentionConfig,
    (cache_seqlens, block_table): (&Tensor, Option<&Tensor>),
    [q, k, v]: [Operand; 3],
) -> candle_core::Result<CudaStorage> {
    let dev = &q.0.device;
    let ours = device(dev)?;
    let (q, k, v) = (view::<T>(q)?, view::<T>(k)?, view::<T>(v)?);
    let ([b, s, h, _], dv) = (q.layout.shape, v.layout.head_dim());
    let (lens_storage, lens_layout) = cache_seqlens.storage_and_layout();
    let lens = i32_values(&lens_storage, lens_layout, "cache_seqlens")?;
    let table_storage = block_table.map(|t| t.storage_and_layout());
    let table = match &table_storage {
        Some((storage, layout)) => Some(i32_values(storage, layout, "block_table")?),
        None => None,
    };
    let mut out = dev.alloc_zeros::<T>(b * s * h * dv)?;
    // SAFETY: nothing reads it (the op returns O alone; the forward writes it whole anyway).
    let mut lse = unsafe { dev.alloc::<f32>(b * h * s) }?;
    ours.kvcache_forward_into(
        &dev.cuda_stream(),
        cfg,
        crate::cuda::DeviceKvCacheInputs {
            q: &q,
            k_cache: &k,
            v_cache: &v,
            block_table: table,
            cache_batch_idx: None,
            cache_seqlens: lens,
            sinks: None,
            num_splits: 0,
            descales: None,
        },
        &mut DeviceTensorMut::new(out.as_view_mut(), Layout::contiguous([b, s, h, dv])),
        &mut lse.as_view_mut(),
    )
    .map_err(wrap)?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}
