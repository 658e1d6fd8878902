//! The backward as candle ops: the gradients of a [`super::flash_attn`] call, computed by this
//! crate's fused backward over the operands candle holds for the call.

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
#[cfg(feature = "candle-cuda")]
use candle_core::CudaStorage;
use candle_core::{CpuStorage, CustomOp2, CustomOp3, Shape, Tensor};

#[cfg(feature = "candle-cuda")]
use super::gpu;
use super::{cpu, lock_error, wrap, Lse, Packed};
use crate::{AttentionConfig, Layout, Operand};

/// The packed gradient buffer of dQ, dK and dV (`counts`: Q's, K's and V's elements): where dK
/// and dV start (dQ at 0), on 128-element boundaries so that on the GPU each gradient starts as
/// aligned as the buffer, and its length. An error where that passes usize (a broadcast
/// operand's logical shape may be huge), not an overflow.
pub(super) fn grad_offsets([nq, nk, nv]: [usize; 3]) -> candle_core::Result<GradOffsets> {
    let round = |n: usize| n.checked_next_multiple_of(128);
    let offsets = (|| {
        let kv_start = round(nq)?;
        let v_start = kv_start.checked_add(round(nk)?)?;
        Some(GradOffsets {
            counts: [nq, nk, nv],
            kv_start,
            v_start,
            len: v_start.checked_add(nv)?,
        })
    })();
    offsets.ok_or_else(|| {
        candle_core::Error::msg(format!(
            "flash_attn: gradients of {nq}, {nk} and {nv} elements pass usize"
        ))
    })
}

/// [`grad_offsets`] of gradients shaped as Q, K and V (`shapes`), their element counts checked
/// as the library checks its own tensors' (a typed error past usize, never an overflow).
pub(super) fn grad_buffer(shapes: [[usize; 4]; 3]) -> candle_core::Result<GradOffsets> {
    let operands = [Operand::DQ, Operand::DK, Operand::DV];
    let mut counts = [0; 3];
    for ((n, shape), operand) in counts.iter_mut().zip(shapes).zip(operands) {
        *n = Layout::contiguous(shape).numel(operand).map_err(wrap)?;
    }
    grad_offsets(counts)
}

/// The packed gradient buffer ([`grad_offsets`]): dQ's, dK's and dV's element counts, where dK
/// and dV start, and its length.
#[derive(Clone, Copy, Debug)]
pub(super) struct GradOffsets {
    pub(super) counts: [usize; 3],
    pub(super) kv_start: usize,
    pub(super) v_start: usize,
    pub(super) len: usize,
}

/// The backward as a candle op over Q, K and V (no gradient of its own): its output is dQ, dK
/// and dV packed in one buffer (at 0 and [`grad_offsets`]), which `bwd` cuts into three views.
/// O and dO come in through a nested op ([`WithOutputs`]), so that candle holds every operand's
/// storage for the call in the way it holds the operands of its own ops.
pub(super) struct Backward<'a> {
    pub(super) cfg: &'a AttentionConfig,
    pub(super) packed: Option<&'a Packed>,
    pub(super) lse: &'a Lse,
    pub(super) out: &'a Tensor,
    pub(super) dout: &'a Tensor,
}

/// The inner op over O and dO, holding the outer op's Q, K and V: it computes the gradients
/// into `grads` and returns an empty placeholder, which is dropped (a custom op returns one
/// storage, and the gradients must outlive the outer op's borrow of Q, K and V).
struct WithOutputs<'a, S> {
    bwd: &'a Backward<'a>,
    qkv: [(&'a S, &'a candle_core::Layout); 3],
    grads: Mutex<Option<S>>,
}

impl Backward<'_> {
    fn run<S>(&self, qkv: [(&S, &candle_core::Layout); 3]) -> candle_core::Result<(S, Shape)>
    where
        for<'a> WithOutputs<'a, S>: CustomOp2,
    {
        let inner = WithOutputs {
            bwd: self,
            qkv,
            grads: Mutex::new(None),
        };
        self.out.apply_op2_no_bwd(self.dout, &inner)?;
        let grads = inner.grads.into_inner().map_err(lock_error)?;
        let Some(grads) = grads else {
            candle_core::bail!("flash_attn: the backward produced no gradients");
        };
        let counts = qkv.map(|(_, l)| l.shape().elem_count());
        Ok((grads, Shape::from(grad_offsets(counts)?.len)))
    }
}

impl CustomOp3 for Backward<'_> {
    fn name(&self) -> &'static str {
        "flash-attn-bwd"
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
        self.run([(q, lq), (k, lk), (v, lv)])
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
        self.run([(q, lq), (k, lk), (v, lv)])
    }
}

impl CustomOp2 for WithOutputs<'_, CpuStorage> {
    fn name(&self) -> &'static str {
        "flash-attn-bwd-outputs"
    }

    fn cpu_fwd(
        &self,
        out: &CpuStorage,
        lo: &candle_core::Layout,
        dout: &CpuStorage,
        ldo: &candle_core::Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let lse = self.bwd.lse.host()?;
        let [q, k, v] = self.qkv;
        let ops = [q, k, v, (out, lo), (dout, ldo)];
        let (cfg, packed) = (self.bwd.cfg, self.bwd.packed);
        let grads = with_element!(
            q.0.dtype(),
            "flash_attn on the CPU takes f32, f16 or bf16 tensors",
            |T| cpu::backward::<T>(cfg, packed, ops, lse)
        )?;
        *self.grads.lock().map_err(lock_error)? = Some(grads);
        Ok((CpuStorage::F32(Vec::new()), Shape::from(0)))
    }
}

#[cfg(feature = "candle-cuda")]
impl CustomOp2 for WithOutputs<'_, CudaStorage> {
    fn name(&self) -> &'static str {
        "flash-attn-bwd-outputs"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &candle_core::Layout,
        _: &CpuStorage,
        _: &candle_core::Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        Err(Lse::elsewhere())
    }

    fn cuda_fwd(
        &self,
        out: &CudaStorage,
        lo: &candle_core::Layout,
        dout: &CudaStorage,
        ldo: &candle_core::Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let lse = self.bwd.lse.device()?;
        let [q, k, v] = self.qkv;
        let ops = [q, k, v, (out, lo), (dout, ldo)];
        let (cfg, packed) = (self.bwd.cfg, self.bwd.packed);
        let grads = with_element!(
            q.0.dtype(),
            "flash_attn on CUDA takes bf16 or f16 tensors",
            |T| gpu::backward::<T>(cfg, packed, ops, lse)
        )?;
        let placeholder = out.device.alloc_zeros::<f32>(1)?;
        *self.grads.lock().map_err(lock_error)? = Some(grads);
        Ok((
            CudaStorage::wrap_cuda_slice(placeholder, out.device.clone()),
            Shape::from(1),
        ))
    }
}
