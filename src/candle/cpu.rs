//! The CPU path: candle's CPU storages as host tensor views.

use super::*;
use crate::varlen::Seqlens;
use candle_core::WithDType;

pub(super) type Operand<'a> = (&'a CpuStorage, &'a candle_core::Layout);

pub(super) fn view<'a, T: WithDType>(
    (storage, layout): Operand<'a>,
) -> candle_core::Result<TensorRef<'a, T>> {
    let data = T::cpu_storage_as_slice(storage)?;
    let data = data
        .get(layout.start_offset()..)
        .ok_or_else(|| candle_core::Error::msg("flash_attn: a layout starts past its storage"))?;
    Ok(TensorRef::new(data, our_layout(layout)?))
}

pub(super) fn forward<T: Element + WithDType>(
    cfg: &AttentionConfig,
    packed: Option<&Packed>,
    [q, k, v]: [Operand; 3],
) -> candle_core::Result<(CpuStorage, Vec<f32>)> {
    let (q, k, v) = (view::<T>(q)?, view::<T>(k)?, view::<T>(v)?);
    if let Some(p) = packed {
        let (cu_q, cu_k) = p.host_offsets()?;
        let seqs = Seqlens::new(&cu_q, &cu_k, p.max_q, p.max_k).map_err(wrap)?;
        let fwd =
            crate::varlen::forward(cfg, &seqs, crate::ForwardInputs::new(q, k, v)).map_err(wrap)?;
        return Ok((T::to_cpu_storage_owned(fwd.out), fwd.lse));
    }
    // The library's own allocation: a typed error for sizes past memory, never an abort.
    let fwd = crate::forward(cfg, ForwardInputs::new(q, k, v)).map_err(wrap)?;
    Ok((T::to_cpu_storage_owned(fwd.out), fwd.lse))
}

pub(super) fn backward<T: Element + WithDType>(
    cfg: &AttentionConfig,
    packed: Option<&Packed>,
    [q, k, v, out, dout]: [Operand; 5],
    lse: &[f32],
) -> candle_core::Result<CpuStorage> {
    let (q, k, v) = (view::<T>(q)?, view::<T>(k)?, view::<T>(v)?);
    let (out, dout) = (view::<T>(out)?, view::<T>(dout)?);
    // Sizes checked and the buffer taken as the library takes its own: typed errors for sizes
    // past usize or memory (a broadcast operand's logical shape may be huge), never an abort.
    let GradOffsets {
        counts: [nq, nk, nv],
        kv_start,
        v_start,
        len,
    } = grad_buffer([q.layout.shape, k.layout.shape, v.layout.shape])?;
    let mut grads = crate::alloc::<T>(len).map_err(wrap)?;
    if let Some(p) = packed {
        let (cu_q, cu_k) = p.host_offsets()?;
        let seqs = Seqlens::new(&cu_q, &cu_k, p.max_q, p.max_k).map_err(wrap)?;
        let inputs = BackwardInputs {
            q,
            k,
            v,
            out,
            dout,
            lse,
            sinks: None,
        };
        let g = crate::varlen::backward(cfg, &seqs, inputs).map_err(wrap)?;
        grads[..nq].copy_from_slice(&g.dq);
        grads[kv_start..kv_start + nk].copy_from_slice(&g.dk);
        grads[v_start..v_start + nv].copy_from_slice(&g.dv);
        return Ok(T::to_cpu_storage_owned(grads));
    }
    let (dq, rest) = grads.split_at_mut(kv_start);
    let (dk, dv) = rest.split_at_mut(v_start - kv_start);
    crate::backward_into(
        cfg,
        BackwardInputs {
            q,
            k,
            v,
            out,
            dout,
            lse,
            sinks: None,
        },
        GradientsMut {
            dq: TensorMut::contiguous(&mut dq[..nq], q.layout.shape),
            dk: TensorMut::contiguous(&mut dk[..nk], k.layout.shape),
            dv: TensorMut::contiguous(&mut dv[..nv], v.layout.shape),
            dsinks: None,
        },
    )
    .map_err(wrap)?;
    Ok(T::to_cpu_storage_owned(grads))
}
