//! # flashattn
//!
//! Exact attention, `softmax(Q·Kᵀ·scale)·V`, computed block by block without materializing the
//! score matrix (the FlashAttention algorithm), with its backward pass.
//!
//! Tensors are `(batch, seqlen, heads, head_dim)` with a unit head_dim stride and free other
//! strides; K and V may have fewer heads than Q (GQA/MQA, `heads_q % heads_kv == 0`). The
//! log-sum-exp `lse` is `(batch, heads_q, seqlen_q)` f32 in natural log.
//!
//! Backends: FlashAttention-3-style CUDA kernels on compute capability 9.0 (`Sm90`),
//! FlashAttention-2-style kernels on sm80..sm89 (`Sm80`), and a multithreaded CPU backend
//! (`Cpu`) with the same semantics. [`dispatch::plan`] picks one and explains the choice.
//!
//! FP8 (e4m3) forward on `Sm90`: `cuda::Device::forward_fp8` quantizes bf16/fp16 Q, K, V
//! (one scale per block, optionally after a random-sign Hadamard transform of Q and K) and runs
//! the QGMMA kernel; `cuda::Device::quantize_fp8` and `cuda::Device::fp8_inputs_from_e4m3`
//! give inputs to reuse or quantized elsewhere, `varlen_quantize_fp8` and `varlen_forward_fp8`
//! the same over packed batches. The quantize step's host definition: [`fp8`].
// The cuda module exists with its feature only: links to it there.
#![cfg_attr(
    feature = "cuda",
    doc = "\nThe GPU API: [`cuda::Device`] ([`forward_into`](cuda::Device::forward_into), \
           [`backward_into`](cuda::Device::backward_into), \
           [`forward_fp8`](cuda::Device::forward_fp8), \
           [`quantize_fp8`](cuda::Device::quantize_fp8), \
           [`fp8_inputs_from_e4m3`](cuda::Device::fp8_inputs_from_e4m3))."
)]
//!
//! With the `candle` feature, `candle::flash_attn` is the attention as a differentiable op over
//! candle tensors (its gradient is this crate's backward).
//!
//! Fully masked query rows (an [`AttentionMask`] that leaves a row no key) give `O = 0` and
//! `lse = +inf`, so that a backward pass computes `exp(s - lse) = 0` and zero gradients. A row
//! that sees a NaN score gets NaN in `O` and `lse`, on every backend.
//!
//! Attention sinks (GPT-OSS style): [`forward_sinks_into`] takes one f32 logit per query head
//! that joins each of its rows' softmax as one more score without a value row, and
//! [`backward_sinks_into`] also gives the sinks' gradient. There a row with no key gets `O = 0`
//! and `lse` = its head's sink.
//!
//! The sm90 forward's split-KV workspace comes, in stream order, from a memory pool of this
//! library's that keeps up to 128 MiB per device across synchronizations. Calls can be captured
//! into CUDA graphs; with cudarc, capture with its event tracking off
//! (`CudaContext::disable_event_tracking`) for the slices the captured calls use.
//!
//! ```
//! use flashattn::{AttentionConfig, TensorRef};
//! let (b, s, h, d) = (1, 4, 2, 8);
//! let x: Vec<f32> = (0..b * s * h * d).map(|i| (i as f32 * 0.37).sin()).collect();
//! let t = TensorRef::contiguous(&x, [b, s, h, d]);
//! let fwd = flashattn::forward(&AttentionConfig::new().causal(true), t, t, t).unwrap();
//! assert_eq!(fwd.out.len(), x.len());
//! assert_eq!(fwd.lse.len(), b * h * s);
//! ```

mod backend;
#[cfg(feature = "candle")]
pub mod candle;
pub mod config;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod dispatch;
pub mod error;
#[cfg(feature = "cuda")]
mod ffi;
pub mod fp8;
pub mod reference;
pub mod registry;
// The registry's tests beside it: build.rs includes registry.rs alone.
#[cfg(test)]
#[path = "registry/tests.rs"]
mod registry_tests;
pub mod tensor;
pub mod unstable;
pub mod varlen;

/// The README's examples, compiled as doctests (the GPU one needs the `cuda` feature).
#[cfg(all(doctest, feature = "cuda"))]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

pub use config::{AttentionConfig, AttentionMask, Backend, KeyRule};
pub use dispatch::{BuiltKernels, DeviceInfo, Memory, Op, Plan};
pub use error::{CallPart, Error, Operand, Result};
pub use tensor::{DType, Element, Layout, Problem, TensorMut, TensorRef};

/// Output of a host forward call: `out` packed like Q, `lse` packed (batch, heads_q, seqlen_q).
#[derive(Clone, Debug)]
pub struct ForwardOutput<T> {
    pub out: Vec<T>,
    pub lse: Vec<f32>,
    pub plan: Plan,
}

/// What a host backward pass reads: the forward's inputs, its output and LSE, and dO.
#[derive(Clone, Copy, Debug)]
pub struct BackwardInputs<'a, T> {
    pub q: TensorRef<'a, T>,
    pub k: TensorRef<'a, T>,
    pub v: TensorRef<'a, T>,
    /// The forward's output O, shaped like Q.
    pub out: TensorRef<'a, T>,
    /// The gradient of the loss with respect to O, shaped like Q.
    pub dout: TensorRef<'a, T>,
    /// The forward's LSE: f32 (batch, heads_q, seqlen_q) packed, natural log.
    pub lse: &'a [f32],
}

/// Where a host backward pass writes: dQ shaped like Q, dK and dV shaped like K and V, each
/// reaching every element once (see [`Layout::validate_output`]).
#[derive(Debug)]
pub struct GradientsMut<'a, T> {
    pub dq: TensorMut<'a, T>,
    pub dk: TensorMut<'a, T>,
    pub dv: TensorMut<'a, T>,
}

impl<T> BackwardInputs<'_, T> {
    /// Q, K, V, O and dO as the validation takes them.
    fn operands(&self) -> [tensor::Operand4<'_>; 5] {
        [&self.q, &self.k, &self.v, &self.out, &self.dout].map(|t| t.operand())
    }
}

impl<T> GradientsMut<'_, T> {
    /// dQ, dK and dV as the validation takes them.
    fn operands(&self) -> [tensor::Operand4<'_>; 3] {
        [&self.dq, &self.dk, &self.dv].map(|t| t.operand())
    }
}

/// Gradients of a host backward call, each packed like its input.
#[derive(Clone, Debug)]
pub struct Gradients<T> {
    pub dq: Vec<T>,
    pub dk: Vec<T>,
    pub dv: Vec<T>,
    pub plan: Plan,
}

fn plan_host<T: Element>(
    op: Op,
    cfg: &AttentionConfig,
    q: &TensorRef<T>,
    k: &TensorRef<T>,
    v: &TensorRef<T>,
) -> Result<(Problem, Plan)> {
    q.check(Operand::Q)?;
    k.check(Operand::K)?;
    v.check(Operand::V)?;
    let problem = Problem::from_layouts(&q.layout, &k.layout, &v.layout, T::DTYPE)?;
    let plan = host_plan(op, cfg, &problem)?;
    Ok((problem, plan))
}

fn host_plan(op: Op, cfg: &AttentionConfig, problem: &Problem) -> Result<Plan> {
    dispatch::plan(op, problem, cfg, &Memory::Host, BuiltKernels::current())
}

/// A buffer of `len` default values, or [`Error::OutOfMemory`] where the allocator refuses
/// (a broadcast input can stand for more elements than memory holds).
pub(crate) fn alloc<T: Clone + Default>(len: usize) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|_| Error::OutOfMemory {
        bytes: len.saturating_mul(std::mem::size_of::<T>()),
    })?;
    v.resize(len, T::default());
    Ok(v)
}

/// Forward pass over host tensors into caller-owned outputs. `out` must reach each element
/// once (see [`Layout::validate_output`]).
pub fn forward_into<T: Element>(
    cfg: &AttentionConfig,
    q: TensorRef<T>,
    k: TensorRef<T>,
    v: TensorRef<T>,
    out: TensorMut<T>,
    lse: &mut [f32],
) -> Result<Plan> {
    let problem = tensor::check_forward(
        T::DTYPE,
        [q.operand(), k.operand(), v.operand()],
        out.operand(),
        lse.len(),
    )?;
    let plan = host_plan(Op::Forward, cfg, &problem)?;
    backend::cpu::forward(cfg, &problem, q, k, v, out, lse, None);
    Ok(plan)
}

/// A per-query-head vector (the attention sinks, their gradient) holds at least heads_q values
/// (the first heads_q are the ones used).
fn check_per_head(operand: Operand, len: usize, problem: &Problem) -> Result<()> {
    if len < problem.heads_q {
        return Err(Error::BufferTooSmall {
            operand,
            needed: problem.heads_q,
            len,
        });
    }
    Ok(())
}

/// [`forward_into`] with attention sinks (learnable, GPT-OSS style): `sinks` holds one f32
/// logit per query head (its first heads_q values are used; a shorter one is refused with
/// [`Error::BufferTooSmall`] for [`Operand::Sinks`]). Query head `h`'s sink joins every one of
/// its rows' softmax as one more score, in the units of the scaled (and, with softcap, capped)
/// scores, that takes no value row: `lse_i = log(exp(sinks[h]) + Σ_j exp(s_ij))` and
/// `O_i = Σ_j exp(s_ij − lse_i)·V_j`, so the sink draws probability away from the keys. With
/// GQA the sinks are per query head. A row that sees no key gets `O = 0` and
/// `lse = sinks[h]` (instead of `+inf`). A sink of `−inf` is the same as none; `+inf` or NaN
/// makes its head's LSE NaN. The backward of this forward is [`backward_sinks_into`].
///
/// ```
/// use flashattn::{AttentionConfig, TensorMut, TensorRef};
/// let shape = [1, 4, 2, 8];
/// let x: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin()).collect();
/// let t = TensorRef::contiguous(&x, shape);
/// let (mut out, mut lse) = (vec![0.0; 64], vec![0.0; 8]);
/// let sinks = [0.5, -1.0];
/// let cfg = AttentionConfig::new().causal(true);
/// let o = TensorMut::contiguous(&mut out, shape);
/// flashattn::forward_sinks_into(&cfg, t, t, t, &sinks, o, &mut lse)?;
/// // Each row's LSE counts its sink: it exceeds the sink's logit.
/// assert!(lse[..4].iter().all(|&l| l > 0.5) && lse[4..].iter().all(|&l| l > -1.0));
/// # Ok::<(), flashattn::Error>(())
/// ```
pub fn forward_sinks_into<T: Element>(
    cfg: &AttentionConfig,
    q: TensorRef<T>,
    k: TensorRef<T>,
    v: TensorRef<T>,
    sinks: &[f32],
    out: TensorMut<T>,
    lse: &mut [f32],
) -> Result<Plan> {
    let problem = tensor::check_forward(
        T::DTYPE,
        [q.operand(), k.operand(), v.operand()],
        out.operand(),
        lse.len(),
    )?;
    check_per_head(Operand::Sinks, sinks.len(), &problem)?;
    let plan = host_plan(Op::Forward, cfg, &problem)?;
    let sinks = &sinks[..problem.heads_q];
    backend::cpu::forward(cfg, &problem, q, k, v, out, lse, Some(sinks));
    Ok(plan)
}

/// Forward pass over host tensors; allocates the outputs.
pub fn forward<T: Element>(
    cfg: &AttentionConfig,
    q: TensorRef<T>,
    k: TensorRef<T>,
    v: TensorRef<T>,
) -> Result<ForwardOutput<T>> {
    let (problem, plan) = plan_host(Op::Forward, cfg, &q, &k, &v)?;
    let mut out = alloc(Layout::contiguous(problem.q_shape()).numel(Operand::Out)?)?;
    let mut lse = alloc(problem.lse_len()?)?;
    // Packed outputs of exactly the problem's sizes: nothing left to check.
    let o = TensorMut::contiguous(&mut out, problem.q_shape());
    backend::cpu::forward(cfg, &problem, q, k, v, o, &mut lse, None);
    Ok(ForwardOutput { out, lse, plan })
}

/// Backward pass over host tensors into caller-owned gradients: recomputes P from the
/// forward's `lse` and writes dQ (shaped like Q), dK and dV (shaped like K and V), each of which
/// must reach every element once.
///
/// ```
/// use flashattn::{AttentionConfig, BackwardInputs, GradientsMut, TensorMut, TensorRef};
/// let shape = [1, 4, 2, 8];
/// let x: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin()).collect();
/// let t = TensorRef::contiguous(&x, shape);
/// let cfg = AttentionConfig::new().causal(true);
/// let fwd = flashattn::forward(&cfg, t, t, t)?;
/// let (mut dq, mut dk, mut dv) = (vec![0.0; 64], vec![0.0; 64], vec![0.0; 64]);
/// flashattn::backward_into(
///     &cfg,
///     BackwardInputs {
///         q: t,
///         k: t,
///         v: t,
///         out: TensorRef::contiguous(&fwd.out, shape),
///         dout: t,
///         lse: &fwd.lse,
///     },
///     GradientsMut {
///         dq: TensorMut::contiguous(&mut dq, shape),
///         dk: TensorMut::contiguous(&mut dk, shape),
///         dv: TensorMut::contiguous(&mut dv, shape),
///     },
/// )?;
/// # Ok::<(), flashattn::Error>(())
/// ```
pub fn backward_into<T: Element>(
    cfg: &AttentionConfig,
    inputs: BackwardInputs<'_, T>,
    grads: GradientsMut<'_, T>,
) -> Result<Plan> {
    let problem = tensor::check_backward(
        T::DTYPE,
        inputs.operands(),
        inputs.lse.len(),
        grads.operands(),
    )?;
    let plan = host_plan(Op::Backward, cfg, &problem)?;
    backend::cpu::backward(cfg, &problem, inputs, grads, None);
    Ok(plan)
}

/// [`backward_into`] of a forward with attention sinks ([`forward_sinks_into`]; `inputs.lse`
/// is its LSE, which holds them): dQ, dK and dV as without sinks, from `P = exp(s − lse)`, and
/// where `dsinks` is given, the sinks' gradient
/// `dsinks[h] = −Σ_{b,i} exp(sinks[h] − lse_i)·rowsum(dO_i ∘ O_i)` over query head `h`'s rows
/// `i` of every batch entry `b`, into its first heads_q values (the rest are left as they
/// are), summed in f64 in a fixed order (the same bits every call). `sinks` and `dsinks` each
/// hold at least heads_q values (a shorter one is refused with [`Error::BufferTooSmall`] for
/// [`Operand::Sinks`] or [`Operand::DSinks`]); `sinks` must be those the forward used. With
/// `dsinks` = `None`, this is [`backward_into`] (the sinks are only checked). `D_i` is summed
/// from the recomputed P and dP (`Σ_j P_ij·dP_ij`, equal to `rowsum(dO_i ∘ O_i)` in exact
/// arithmetic), not from O as stored, whose rounding to a 16-bit type would enter every term.
///
/// ```
/// use flashattn::{AttentionConfig, BackwardInputs, GradientsMut, TensorMut, TensorRef};
/// let shape = [1, 4, 2, 8];
/// let x: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin()).collect();
/// let t = TensorRef::contiguous(&x, shape);
/// let cfg = AttentionConfig::new().causal(true);
/// let sinks = [0.5, -1.0];
/// let (mut out, mut lse) = (vec![0.0; 64], vec![0.0; 8]);
/// let o = TensorMut::contiguous(&mut out, shape);
/// flashattn::forward_sinks_into(&cfg, t, t, t, &sinks, o, &mut lse)?;
/// let (mut dq, mut dk, mut dv) = (vec![0.0; 64], vec![0.0; 64], vec![0.0; 64]);
/// let mut dsinks = [0.0f32; 2];
/// flashattn::backward_sinks_into(
///     &cfg,
///     BackwardInputs {
///         q: t,
///         k: t,
///         v: t,
///         out: TensorRef::contiguous(&out, shape),
///         dout: t,
///         lse: &lse,
///     },
///     GradientsMut {
///         dq: TensorMut::contiguous(&mut dq, shape),
///         dk: TensorMut::contiguous(&mut dk, shape),
///         dv: TensorMut::contiguous(&mut dv, shape),
///     },
///     &sinks,
///     Some(&mut dsinks),
/// )?;
/// assert!(dsinks.iter().all(|g| g.is_finite()));
/// # Ok::<(), flashattn::Error>(())
/// ```
pub fn backward_sinks_into<T: Element>(
    cfg: &AttentionConfig,
    inputs: BackwardInputs<'_, T>,
    grads: GradientsMut<'_, T>,
    sinks: &[f32],
    dsinks: Option<&mut [f32]>,
) -> Result<Plan> {
    let problem = tensor::check_backward(
        T::DTYPE,
        inputs.operands(),
        inputs.lse.len(),
        grads.operands(),
    )?;
    check_per_head(Operand::Sinks, sinks.len(), &problem)?;
    if let Some(dsinks) = &dsinks {
        check_per_head(Operand::DSinks, dsinks.len(), &problem)?;
    }
    let plan = host_plan(Op::Backward, cfg, &problem)?;
    let sinks = dsinks.map(|dsinks| (sinks, dsinks));
    backend::cpu::backward(cfg, &problem, inputs, grads, sinks);
    Ok(plan)
}

/// Backward pass over host tensors: recomputes P from the forward's `lse` and returns dQ, dK,
/// dV packed.
pub fn backward<T: Element>(
    cfg: &AttentionConfig,
    inputs: BackwardInputs<'_, T>,
) -> Result<Gradients<T>> {
    let problem = tensor::check_backward_inputs(T::DTYPE, inputs.operands(), inputs.lse.len())?;
    let plan = host_plan(Op::Backward, cfg, &problem)?;
    let (q_shape, kv_shape) = (problem.q_shape(), problem.kv_shape());
    let mut dq = alloc(Layout::contiguous(q_shape).numel(Operand::DQ)?)?;
    let mut dk = alloc(Layout::contiguous(kv_shape).numel(Operand::DK)?)?;
    let mut dv = alloc(Layout::contiguous(kv_shape).numel(Operand::DV)?)?;
    // Packed gradients of exactly the problem's sizes: nothing left to check.
    let grads = GradientsMut {
        dq: TensorMut::contiguous(&mut dq, q_shape),
        dk: TensorMut::contiguous(&mut dk, kv_shape),
        dv: TensorMut::contiguous(&mut dv, kv_shape),
    };
    backend::cpu::backward(cfg, &problem, inputs, grads, None);
    Ok(Gradients { dq, dk, dv, plan })
}
