//! Attention over [candle](https://crates.io/crates/candle-core) tensors, differentiable: the
//! forward runs this crate's attention and candle's autograd (`loss.backward()`) runs this
//! crate's fused backward for dQ, dK and dV.
//!
//! [`flash_attn`] takes Q `(batch, seqlen_q, heads_q, head_dim)`, K `(batch, seqlen_k,
//! heads_kv, head_dim)` and V `(batch, seqlen_k, heads_kv, head_dim_v)` (GQA/MQA when
//! `heads_kv < heads_q`; V's head dim may differ from Q's and K's), all of one dtype, and
//! returns O `(batch, seqlen_q, heads_q, head_dim_v)`: Q's shape with V's head dim. On the CPU
//! it runs the CPU backend (f32, f16, bf16); on a candle CUDA device (the `candle-cuda` feature:
//! without it a CUDA tensor gets candle's refusal of an op with no CUDA implementation) the GPU
//! kernels (bf16, f16), ordered on candle's own stream
//! (`tests/gpu_candle.rs` checks them there). Strided views and views with a start offset are
//! read in place where the kernels can (a unit head-dim stride; on the GPU also 16-byte aligned
//! offsets and strides); others are copied to a packed tensor first, through candle, so
//! gradients still reach them.
//!
//! ```
//! use candle_core::{Device, Var};
//! use flashattn::AttentionConfig;
//!
//! let dev = Device::Cpu;
//! let q = Var::randn(0f32, 1.0, (2, 16, 4, 64), &dev)?;
//! let k = Var::randn(0f32, 1.0, (2, 24, 2, 64), &dev)?; // 2 KV heads: GQA
//! let v = Var::randn(0f32, 1.0, (2, 24, 2, 64), &dev)?;
//! let out = flashattn::candle::flash_attn(&q, &k, &v, &AttentionConfig::new().causal(true))?;
//! let grads = out.sqr()?.sum_all()?.backward()?;
//! assert_eq!(grads.get(&k).unwrap().dims(), k.dims());
//! # Ok::<(), candle_core::Error>(())
//! ```
//!
//! [`flash_attn_varlen`] takes packed batches of sequences of different lengths, with
//! candle-flash-attn's shapes and `cu_seqlens` offsets; [`flash_attn_with_kvcache`] a serving
//! step's queries over a dense or paged KV cache (forward only).
//!
//! Errors of this crate reach the caller as a [`candle_core::Error`]; [`as_flash_error`] gives
//! back the typed [`crate::Error`] inside.

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
#[cfg(feature = "candle-cuda")]
use candle_core::CudaStorage;
use candle_core::{CpuStorage, CustomOp3, DType, Shape, Tensor};

use backward::{grad_buffer, grad_offsets, Backward, GradOffsets};

use crate::{
    AttentionConfig, BackwardInputs, Element, ForwardInputs, GradientsMut, Layout, TensorMut,
    TensorRef,
};

/// Attention over candle tensors: `softmax(Q·Kᵀ·scale)·V` under `cfg`'s mask, scale and
/// softcap, with this crate's fused backward as its gradient. See the [module docs](self).
///
/// `cfg.backend` is honoured as in the host and device APIs (`Auto` picks the CPU backend for
/// CPU tensors and the best GPU family for CUDA ones).
pub fn flash_attn(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cfg: &AttentionConfig,
) -> candle_core::Result<Tensor> {
    for (name, t) in [("q", q), ("k", k), ("v", v)] {
        if t.rank() != 4 {
            candle_core::bail!(
                "flash_attn: {name} must be (batch, seqlen, heads, head_dim), got shape {:?}",
                t.dims()
            );
        }
    }
    attention(q, k, v, cfg, None)
}

/// Attention over a packed batch of candle tensors (variable-length sequences, see
/// [`crate::varlen`]), differentiable like [`flash_attn`], with candle-flash-attn's conventions:
/// Q `(total_q, heads_q, head_dim)`, K `(total_k, heads_kv, head_dim)` and V `(total_k,
/// heads_kv, head_dim_v)`, sequence `b`
/// owning query rows `cu_seqlens_q[b]..cu_seqlens_q[b + 1]` and key rows
/// `cu_seqlens_k[b]..cu_seqlens_k[b + 1]` (`batch + 1` offsets each, u32 or i32, on Q's
/// device), `max_seqlen_q` and `max_seqlen_k` at least every sequence's lengths. Returns O
/// `(total_q, heads_q, head_dim_v)`; masks are aligned bottom-right within each sequence.
///
/// On the CPU the offsets are read and checked ([`crate::Error::InvalidSeqlens`]); on a CUDA
/// device they stay there (no synchronization) and the kernels clamp every sequence into the
/// tensors, as `cuda::DeviceSeqlens` says.
///
/// ```
/// use candle_core::{Device, Tensor, Var};
/// use flashattn::AttentionConfig;
///
/// let dev = Device::Cpu;
/// // Two documents of 5 and 3 tokens, 4 heads of 16.
/// let cu = Tensor::new(&[0u32, 5, 8], &dev)?;
/// let q = Var::randn(0f32, 1.0, (8, 4, 16), &dev)?;
/// let k = Var::randn(0f32, 1.0, (8, 4, 16), &dev)?;
/// let v = Var::randn(0f32, 1.0, (8, 4, 16), &dev)?;
/// let cfg = AttentionConfig::new().causal(true);
/// let out = flashattn::candle::flash_attn_varlen(&q, &k, &v, &cu, &cu, 5, 5, &cfg)?;
/// let grads = out.sqr()?.sum_all()?.backward()?;
/// assert_eq!(grads.get(&q).unwrap().dims(), &[8, 4, 16]);
/// # Ok::<(), candle_core::Error>(())
/// ```
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cu_seqlens_q: &Tensor,
    cu_seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    cfg: &AttentionConfig,
) -> candle_core::Result<Tensor> {
    for (name, t) in [("q", q), ("k", k), ("v", v)] {
        if t.rank() != 3 {
            candle_core::bail!(
                "flash_attn_varlen: {name} must be (total, heads, head_dim), got shape {:?}",
                t.dims()
            );
        }
    }
    for (name, t) in [
        ("cu_seqlens_q", cu_seqlens_q),
        ("cu_seqlens_k", cu_seqlens_k),
    ] {
        if t.rank() != 1 || !matches!(t.dtype(), DType::U32 | DType::I32) {
            candle_core::bail!(
                "flash_attn_varlen: {name} must be a vector of u32 or i32 offsets, got {:?} {:?}",
                t.dtype(),
                t.dims()
            );
        }
        if !t.device().same_device(q.device()) {
            candle_core::bail!("flash_attn_varlen: {name} is on another device than q");
        }
    }
    let packed = Packed {
        cu_q: cu_seqlens_q.contiguous()?,
        // A copy of its own: the CUDA path holds both storages' read locks at once, which must
        // not be one lock taken twice (the same tensor for both offsets, say).
        cu_k: cu_seqlens_k.force_contiguous()?,
        max_q: max_seqlen_q,
        max_k: max_seqlen_k,
    };
    let four = |t: &Tensor| t.unsqueeze(0);
    attention(&four(q)?, &four(k)?, &four(v)?, cfg, Some(packed))?.squeeze(0)
}

/// The op over rank-4 Q, K, V, dense or packed.
fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cfg: &AttentionConfig,
    packed: Option<Packed>,
) -> candle_core::Result<Tensor> {
    if k.dtype() != q.dtype() || v.dtype() != q.dtype() {
        candle_core::bail!(
            "flash_attn: q, k and v must have one dtype, got {:?}, {:?}, {:?}",
            q.dtype(),
            k.dtype(),
            v.dtype()
        );
    }
    let (q, k, v) = (readable(q)?, readable(k)?, readable(v)?);
    q.apply_op3(
        &k,
        &v,
        FlashAttn {
            cfg: cfg.clone(),
            packed,
            lse: Mutex::new(None),
        },
    )
}

/// A packed call's sequence boundaries ([`flash_attn_varlen`]), kept by its op for the backward.
struct Packed {
    cu_q: Tensor,
    cu_k: Tensor,
    max_q: usize,
    max_k: usize,
}

impl Packed {
    /// The offsets of CPU tensors, as i32 (an offset past `i32::MAX` is refused).
    fn host_offsets(&self) -> candle_core::Result<(Vec<i32>, Vec<i32>)> {
        let seqlens = crate::Error::InvalidSeqlens;
        Ok((
            host_i32(&self.cu_q, seqlens)?,
            host_i32(&self.cu_k, seqlens)?,
        ))
    }
}

/// A CPU tensor of u32 or i32 values (offsets, counts, page numbers), flattened, as i32 (a
/// value past `i32::MAX` is refused with `error`).
fn host_i32(t: &Tensor, error: fn(String) -> crate::Error) -> candle_core::Result<Vec<i32>> {
    let t = t.flatten_all()?;
    match t.dtype() {
        DType::I32 => t.to_vec1::<i32>(),
        _ => t
            .to_vec1::<u32>()?
            .into_iter()
            .map(|x| {
                i32::try_from(x).map_err(|_| wrap(error(format!("value {x} is past i32::MAX"))))
            })
            .collect(),
    }
}

/// The typed error of this crate inside a [`candle_core::Error`] that [`flash_attn`],
/// [`flash_attn_varlen`] (or their backward) or [`flash_attn_with_kvcache`] returned, looking through candle's backtrace and context wrappers.
pub fn as_flash_error(e: &candle_core::Error) -> Option<&crate::Error> {
    use candle_core::Error as E;
    match e {
        E::WithBacktrace { inner, .. } | E::Context { inner, .. } => as_flash_error(inner),
        E::WrappedContext { wrapped, .. } => wrapped.downcast_ref(),
        _ => None,
    }
}

/// A candle error carrying `e`, typed (see [`as_flash_error`]) and with its message.
fn wrap(e: crate::Error) -> candle_core::Error {
    candle_core::Error::WrappedContext {
        context: format!("flashattn: {e}"),
        wrapped: Box::new(e),
    }
    .bt()
}

/// `t`, or a packed copy of it where the kernels cannot read it in place: a head-dim stride
/// other than 1 (every backend), or on the GPU an offset or stride that is not a multiple of
/// 16 bytes. The copy is a candle op, so gradients flow back through it to `t`.
fn readable(t: &Tensor) -> candle_core::Result<Tensor> {
    let layout = t.layout();
    let (dims, strides) = (layout.dims(), layout.stride());
    let unit_head_dim = dims[3] == 1 || strides[3] == 1;
    let aligned = || {
        const ALIGN: usize = 16;
        let bytes = t.dtype().size_in_bytes();
        layout.start_offset() * bytes % ALIGN == 0
            && dims[..3]
                .iter()
                .zip(&strides[..3])
                .all(|(&n, &s)| n == 1 || s * bytes % ALIGN == 0)
    };
    if unit_head_dim && (!t.device().is_cuda() || aligned()) {
        Ok(t.clone())
    } else {
        t.force_contiguous()
    }
}

/// Our layout of a candle layout (rank 4, strides in elements, the start offset applied to the
/// buffer by the caller). A head dim of extent 1 gets stride 1: candle leaves any stride on a
/// dimension of extent 1, and ours must be 1 there.
fn our_layout(l: &candle_core::Layout) -> candle_core::Result<Layout> {
    let (dims, strides) = (l.dims(), l.stride());
    if dims.len() != 4 {
        candle_core::bail!(
            "flash_attn: tensors must be (batch, seqlen, heads, head_dim), got shape {dims:?}"
        );
    }
    let mut s = [strides[0], strides[1], strides[2], strides[3]];
    if dims[3] == 1 {
        s[3] = 1;
    }
    Ok(Layout::with_strides(
        [dims[0], dims[1], dims[2], dims[3]],
        s,
    ))
}

/// O's shape: Q's, with V's head dim (its last dimension; the op runs over rank-4 tensors).
fn out_shape(lq: &candle_core::Layout, lv: &candle_core::Layout) -> Shape {
    let mut dims = lq.dims().to_vec();
    if let (Some(d), Some(&dv)) = (dims.last_mut(), lv.dims().last()) {
        *d = dv;
    }
    Shape::from(dims)
}

/// The forward's LSE, kept by the op for its backward.
enum Lse {
    Cpu(Vec<f32>),
    #[cfg(feature = "candle-cuda")]
    Cuda(crate::cuda::CudaSlice<f32>),
}

impl Lse {
    fn host(&self) -> candle_core::Result<&[f32]> {
        match self {
            Lse::Cpu(lse) => Ok(lse),
            #[cfg(feature = "candle-cuda")]
            Lse::Cuda(_) => Err(Self::elsewhere()),
        }
    }

    #[cfg(feature = "candle-cuda")]
    fn device(&self) -> candle_core::Result<&crate::cuda::CudaSlice<f32>> {
        match self {
            Lse::Cuda(lse) => Ok(lse),
            Lse::Cpu(_) => Err(Self::elsewhere()),
        }
    }

    #[cfg(feature = "candle-cuda")]
    fn elsewhere() -> candle_core::Error {
        candle_core::Error::msg("flash_attn: the backward runs on another device than the forward")
    }
}

/// Evaluates `$call` (a `candle_core::Result`) with `$t` the element type for candle's `$dtype`:
/// f32, f16 or bf16. Any other dtype is refused with `"{$refusal}, got {dtype:?}"`, where
/// `$refusal` says what the op takes on its device. All three types go through on every device,
/// so that one a device cannot run is refused by the dispatcher with a typed error (f32 on CUDA,
/// which that device's `$refusal` therefore does not list). A macro, not a function: each op
/// calls a function generic over the element type, under its device's bounds, and closures
/// cannot be generic.
macro_rules! with_element {
    ($dtype:expr, $refusal:literal, |$t:ident| $call:expr) => {
        match $dtype {
            candle_core::DType::F32 => {
                type $t = f32;
                $call
            }
            candle_core::DType::F16 => {
                type $t = half::f16;
                $call
            }
            candle_core::DType::BF16 => {
                type $t = half::bf16;
                $call
            }
            other => Err(candle_core::Error::msg(format!(
                "{}, got {other:?}",
                $refusal
            ))),
        }
    };
}

/// The op candle records in the graph: one per [`flash_attn`] call, so the LSE it keeps is that
/// call's (candle hands the same instance to `bwd`).
struct FlashAttn {
    cfg: AttentionConfig,
    packed: Option<Packed>,
    lse: Mutex<Option<Lse>>,
}

fn lock_error<T>(_: T) -> candle_core::Error {
    candle_core::Error::msg("flash_attn: the op's LSE lock was poisoned by a panic")
}

impl CustomOp3 for FlashAttn {
    fn name(&self) -> &'static str {
        "flash-attn"
    }

    fn cpu_fwd(
        &self,
        q: &CpuStorage,
        lq: &candle_core::Layout,
        k: &CpuStorage,
        lk: &candle_core::Layout,
        v: &CpuStorage,
        lv: &candle_core::Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let ops = [(q, lq), (k, lk), (v, lv)];
        let (out, lse) = with_element!(
            q.dtype(),
            "flash_attn on the CPU takes f32, f16 or bf16 tensors",
            |T| cpu::forward::<T>(&self.cfg, self.packed.as_ref(), ops)
        )?;
        *self.lse.lock().map_err(lock_error)? = Some(Lse::Cpu(lse));
        Ok((out, out_shape(lq, lv)))
    }

    #[cfg(feature = "candle-cuda")]
    fn cuda_fwd(
        &self,
        q: &CudaStorage,
        lq: &candle_core::Layout,
        k: &CudaStorage,
        lk: &candle_core::Layout,
        v: &CudaStorage,
        lv: &candle_core::Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let ops = [(q, lq), (k, lk), (v, lv)];
        let (out, lse) = with_element!(
            q.dtype(),
            "flash_attn on CUDA takes bf16 or f16 tensors",
            |T| gpu::forward::<T>(&self.cfg, self.packed.as_ref(), ops)
        )?;
        *self.lse.lock().map_err(lock_error)? = Some(Lse::Cuda(lse));
        Ok((out, out_shape(lq, lv)))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        dout: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        // Held through the backward: a second backward of the same graph waits for this one.
        let lse = self.lse.lock().map_err(lock_error)?;
        let Some(lse) = lse.as_ref() else {
            candle_core::bail!("flash_attn: backward before the forward ran");
        };
        // dO is whatever candle's autograd made of the loss, often a broadcast (zero strides).
        let (out, dout) = (readable(out)?, readable(dout)?);
        let packed = q.apply_op3_no_bwd(
            k,
            v,
            &Backward {
                cfg: &self.cfg,
                packed: self.packed.as_ref(),
                lse,
                out: &out,
                dout: &dout,
            },
        )?;
        let (nq, nk, nv) = (q.elem_count(), k.elem_count(), v.elem_count());
        let GradOffsets {
            kv_start, v_start, ..
        } = grad_offsets([nq, nk, nv])?;
        let dq = packed.narrow(0, 0, nq)?.reshape(q.shape())?;
        let dk = packed.narrow(0, kv_start, nk)?.reshape(k.shape())?;
        let dv = packed.narrow(0, v_start, nv)?.reshape(v.shape())?;
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

mod backward;
mod cpu;
mod kvcache;

pub use kvcache::flash_attn_with_kvcache;

#[cfg(feature = "candle-cuda")]
mod gpu;

#[cfg(test)]
mod tests {
    use super::readable;
    use candle_core::{DType, Device, Tensor};

    /// Whether `a` and `b` are one storage seen through one layout (no copy was made).
    fn same_view(a: &Tensor, b: &Tensor) -> bool {
        let (sa, la) = a.storage_and_layout();
        let (sb, lb) = b.storage_and_layout();
        std::ptr::eq(&*sa, &*sb) && la == lb
    }

    #[test]
    fn views_the_kernels_can_read_are_not_copied() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        // (b, h, s, d) transposed to (b, s, h, d): strided, unit head-dim stride: read in place.
        let t = Tensor::randn(0f32, 1., (2, 3, 5, 8), &dev)?.transpose(1, 2)?;
        assert!(!t.is_contiguous());
        assert!(same_view(&readable(&t)?, &t));
        // Q narrowed out of a packed QKV tensor: an offset and a wider row stride, in place.
        let qkv = Tensor::randn(0f32, 1., (2, 5, 3, 24), &dev)?;
        let k = qkv.narrow(3, 8, 8)?;
        assert!(same_view(&readable(&k)?, &k));
        Ok(())
    }

    #[test]
    fn views_the_kernels_cannot_read_are_copied() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        // Head dim along a non-unit stride: copied to a packed tensor.
        let t = Tensor::randn(0f32, 1., (2, 5, 8, 3), &dev)?.transpose(2, 3)?;
        let r = readable(&t)?;
        assert!(!same_view(&r, &t) && r.is_contiguous());
        // A head dim broadcast from one element (stride 0): copied.
        let b = Tensor::ones((2, 5, 3, 1), DType::F32, &dev)?.broadcast_as((2, 5, 3, 8))?;
        let r = readable(&b)?;
        assert!(!same_view(&r, &b) && r.is_contiguous());
        Ok(())
    }
}
