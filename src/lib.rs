//! # flashattn
//!
//! Exact attention, `softmax(Q·Kᵀ·scale)·V`, computed block by block without materializing the
//! score matrix (the FlashAttention algorithm), with its backward pass.
//!
//! Tensors are `(batch, seqlen, heads, head_dim)` with a unit head_dim stride and free other
//! strides; K and V may have fewer heads than Q (GQA/MQA, `heads_q % heads_kv == 0`), and V
//! another head dim than Q and K (`head_dim_v`, as DeepSeek's MLA's 192 and 128), which O, dO
//! and dV share. The log-sum-exp `lse` is `(batch, heads_q, seqlen_q)` f32 in natural log.
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
           [`fp8_inputs_from_e4m3`](cuda::Device::fp8_inputs_from_e4m3), \
           [`kvcache_forward_into`](cuda::Device::kvcache_forward_into), \
           [`kvcache_step_into`](cuda::Device::kvcache_step_into), \
           [`combine_into`](cuda::Device::combine_into), \
           [`ring_forward_into`](cuda::Device::ring_forward_into), \
           [`ring_backward_into`](cuda::Device::ring_backward_into))."
)]
//!
//! Packed batches of sequences of different lengths: [`varlen`]. Partial results over disjoint
//! keys merged by their LSE: [`combine`]; a sequence sharded over ranks as a ring: [`ring`]. A KV
//! cache, dense or paged,
//! with each sequence's cached key count: [`kvcache`] (the GPU: `cuda::Device::kvcache_forward_into`,
//! dense and paged caches).
//!
//! With the `candle` feature, `candle::flash_attn` is the attention as a differentiable op over
//! candle tensors (its gradient is this crate's backward).
//!
//! Fully masked query rows (an [`AttentionMask`] that leaves a row no key) give `O = 0` and
//! `lse = +inf`, so that a backward pass computes `exp(s - lse) = 0` and zero gradients. A row
//! that sees a NaN score gets NaN in `O` and `lse`, on every backend.
//!
//! Attention sinks (GPT-OSS style): [`ForwardInputs::sinks`] holds one f32 logit per query head
//! that joins each of its rows' softmax as one more score without a value row, and
//! [`GradientsMut::dsinks`] asks the backward for the sinks' gradient. There a row with no key
//! gets `O = 0` and `lse` = its head's sink.
//!
//! The sm90 forward's split-KV workspace comes, in stream order, from a memory pool of this
//! library's that keeps up to 128 MiB per device across synchronizations. Calls can be captured
//! into CUDA graphs; with cudarc, capture with its event tracking off
//! (`CudaContext::disable_event_tracking`) for the slices the captured calls use.
//!
//! ```
//! use flashattn::{AttentionConfig, ForwardInputs, TensorRef};
//! let (b, s, h, d) = (1, 4, 2, 8);
//! let x: Vec<f32> = (0..b * s * h * d).map(|i| (i as f32 * 0.37).sin()).collect();
//! let t = TensorRef::contiguous(&x, [b, s, h, d]);
//! let fwd = flashattn::forward(&AttentionConfig::new().causal(true), ForwardInputs::new(t, t, t))
//!     .unwrap();
//! assert_eq!(fwd.out.len(), x.len());
//! assert_eq!(fwd.lse.len(), b * h * s);
//! ```

mod backend;
#[cfg(feature = "candle")]
pub mod candle;
pub mod combine;
pub mod config;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod dispatch;
pub mod error;
#[cfg(feature = "cuda")]
mod ffi;
pub mod fp8;
pub mod kvcache;
pub mod reference;
pub mod registry;
pub mod ring;
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

/// Output of a host forward call: `out` packed (batch, seqlen_q, heads_q, head_dim_v), `lse`
/// packed (batch, heads_q, seqlen_q).
#[derive(Clone, Debug)]
pub struct ForwardOutput<T> {
    pub out: Vec<T>,
    pub lse: Vec<f32>,
    pub plan: Plan,
}

/// What a host forward pass reads: Q, K, V and, where the model has them, the attention sinks.
#[derive(Clone, Copy, Debug)]
pub struct ForwardInputs<'a, T> {
    pub q: TensorRef<'a, T>,
    pub k: TensorRef<'a, T>,
    pub v: TensorRef<'a, T>,
    /// Attention sinks (learnable, GPT-OSS style), where given: one f32 logit per query head
    /// (its first heads_q values are used; a shorter one is refused with
    /// [`Error::BufferTooSmall`] for [`Operand::Sinks`]). Query head `h`'s sink joins every one
    /// of its rows' softmax as one more score, in the units of the scaled (and, with softcap,
    /// capped) scores, that takes no value row: `lse_i = log(exp(sinks[h]) + Σ_j exp(s_ij))` and
    /// `O_i = Σ_j exp(s_ij − lse_i)·V_j`, so the sink draws probability away from the keys. With
    /// GQA the sinks are per query head. A row that sees no key gets `O = 0` and
    /// `lse = sinks[h]` (instead of `+inf`). A sink of `−inf` is the same as none; `+inf` or NaN
    /// makes its head's LSE NaN. The backward of such a forward takes them as
    /// [`BackwardInputs::sinks`].
    pub sinks: Option<&'a [f32]>,
}

impl<'a, T> ForwardInputs<'a, T> {
    /// Q, K and V, without sinks.
    pub fn new(q: TensorRef<'a, T>, k: TensorRef<'a, T>, v: TensorRef<'a, T>) -> Self {
        ForwardInputs {
            q,
            k,
            v,
            sinks: None,
        }
    }

    /// The same inputs with attention sinks ([`ForwardInputs::sinks`]).
    pub fn with_sinks(self, sinks: &'a [f32]) -> Self {
        ForwardInputs {
            sinks: Some(sinks),
            ..self
        }
    }
}

/// What a host backward pass reads: the forward's inputs, its output and LSE, and dO.
#[derive(Clone, Copy, Debug)]
pub struct BackwardInputs<'a, T> {
    pub q: TensorRef<'a, T>,
    pub k: TensorRef<'a, T>,
    pub v: TensorRef<'a, T>,
    /// The forward's output O, shaped like Q with V's head dim.
    pub out: TensorRef<'a, T>,
    /// The gradient of the loss with respect to O, shaped like O.
    pub dout: TensorRef<'a, T>,
    /// The forward's LSE: f32 (batch, heads_q, seqlen_q) packed, natural log.
    pub lse: &'a [f32],
    /// The attention sinks the forward took ([`ForwardInputs::sinks`]), where it took them: at
    /// least heads_q values (a shorter vector is refused with [`Error::BufferTooSmall`] for
    /// [`Operand::Sinks`]). dQ, dK and dV need only the LSE, which holds them; the sinks'
    /// gradient ([`GradientsMut::dsinks`]) is computed from them.
    pub sinks: Option<&'a [f32]>,
}

/// Where a host backward pass writes: dQ shaped like Q, dK and dV shaped like K and V, each
/// reaching every element once (see [`Layout::validate_output`]).
#[derive(Debug)]
pub struct GradientsMut<'a, T> {
    pub dq: TensorMut<'a, T>,
    pub dk: TensorMut<'a, T>,
    pub dv: TensorMut<'a, T>,
    /// Where given, the attention sinks' gradient
    /// `dsinks[h] = −Σ_{b,i} exp(sinks[h] − lse_i)·rowsum(dO_i ∘ O_i)` over query head `h`'s rows
    /// `i` of every batch entry `b`, into its first heads_q values (the rest are left as they
    /// are), summed in f64 in a fixed order (the same bits every call). It needs
    /// [`BackwardInputs::sinks`] (without them it is refused with [`Error::InvalidConfig`]) and at
    /// least heads_q values (a shorter one is refused with [`Error::BufferTooSmall`] for
    /// [`Operand::DSinks`]). `D_i` is summed from the recomputed P and dP
    /// (`Σ_j P_ij·dP_ij`, equal to `rowsum(dO_i ∘ O_i)` in exact arithmetic), not from O as
    /// stored, whose rounding to a 16-bit type would enter every term.
    pub dsinks: Option<&'a mut [f32]>,
}

impl<T> ForwardInputs<'_, T> {
    /// Q, K and V as the validation takes them.
    fn operands(&self) -> [tensor::Operand4<'_>; 3] {
        [&self.q, &self.k, &self.v].map(|t| t.operand())
    }
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
    /// The attention sinks' gradient (heads_q values, see [`GradientsMut::dsinks`]) where the
    /// inputs had sinks.
    pub dsinks: Option<Vec<f32>>,
    pub plan: Plan,
}

/// The problem of an allocating forward's inputs, checked, and its plan.
fn plan_host<T: Element>(
    cfg: &AttentionConfig,
    inputs: &ForwardInputs<T>,
) -> Result<(Problem, Plan)> {
    let ForwardInputs { q, k, v, sinks } = inputs;
    q.check(Operand::Q)?;
    k.check(Operand::K)?;
    v.check(Operand::V)?;
    let problem = Problem::from_layouts(&q.layout, &k.layout, &v.layout, T::DTYPE)?;
    tensor::check_sinks(&problem, sinks.map(<[f32]>::len), None)?;
    let plan = host_plan(Op::Forward, cfg, &problem)?;
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
/// once (see [`Layout::validate_output`]). With sinks, see [`ForwardInputs::sinks`].
///
/// ```
/// use flashattn::{AttentionConfig, ForwardInputs, TensorMut, TensorRef};
/// let shape = [1, 4, 2, 8];
/// let x: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin()).collect();
/// let t = TensorRef::contiguous(&x, shape);
/// let (mut out, mut lse) = (vec![0.0; 64], vec![0.0; 8]);
/// let sinks = [0.5, -1.0];
/// let cfg = AttentionConfig::new().causal(true);
/// let o = TensorMut::contiguous(&mut out, shape);
/// flashattn::forward_into(&cfg, ForwardInputs::new(t, t, t).with_sinks(&sinks), o, &mut lse)?;
/// // Each row's LSE counts its sink: it exceeds the sink's logit.
/// assert!(lse[..4].iter().all(|&l| l > 0.5) && lse[4..].iter().all(|&l| l > -1.0));
/// # Ok::<(), flashattn::Error>(())
/// ```
pub fn forward_into<T: Element>(
    cfg: &AttentionConfig,
    inputs: ForwardInputs<'_, T>,
    out: TensorMut<T>,
    lse: &mut [f32],
) -> Result<Plan> {
    let problem = tensor::check_forward(T::DTYPE, inputs.operands(), out.operand(), lse.len())?;
    tensor::check_sinks(&problem, inputs.sinks.map(<[f32]>::len), None)?;
    let plan = host_plan(Op::Forward, cfg, &problem)?;
    backend::cpu::forward(cfg, &problem, inputs, out, lse);
    Ok(plan)
}

/// Forward pass over host tensors; allocates the outputs.
pub fn forward<T: Element>(
    cfg: &AttentionConfig,
    inputs: ForwardInputs<'_, T>,
) -> Result<ForwardOutput<T>> {
    let (problem, plan) = plan_host(cfg, &inputs)?;
    let mut out = alloc(Layout::contiguous(problem.o_shape()).numel(Operand::Out)?)?;
    let mut lse = alloc(problem.lse_len()?)?;
    // Packed outputs of exactly the problem's sizes: nothing left to check.
    let o = TensorMut::contiguous(&mut out, problem.o_shape());
    backend::cpu::forward(cfg, &problem, inputs, o, &mut lse);
    Ok(ForwardOutput { out, lse, plan })
}

/// Backward pass over host tensors into caller-owned gradients: recomputes P from the
/// forward's `lse` and writes dQ (shaped like Q), dK and dV (shaped like K and V), each of which
/// must reach every element once, and where `grads.dsinks` is given, the attention sinks'
/// gradient ([`GradientsMut::dsinks`]; `inputs.sinks` must be those the forward took).
///
/// ```
/// use flashattn::{AttentionConfig, BackwardInputs, ForwardInputs, GradientsMut};
/// use flashattn::{TensorMut, TensorRef};
/// let shape = [1, 4, 2, 8];
/// let x: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin()).collect();
/// let t = TensorRef::contiguous(&x, shape);
/// let cfg = AttentionConfig::new().causal(true);
/// let fwd = flashattn::forward(&cfg, ForwardInputs::new(t, t, t))?;
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
///         sinks: None,
///     },
///     GradientsMut {
///         dq: TensorMut::contiguous(&mut dq, shape),
///         dk: TensorMut::contiguous(&mut dk, shape),
///         dv: TensorMut::contiguous(&mut dv, shape),
///         dsinks: None,
///     },
/// )?;
/// # Ok::<(), flashattn::Error>(())
/// ```
///
/// With attention sinks, and their gradient:
///
/// ```
/// use flashattn::{AttentionConfig, BackwardInputs, ForwardInputs, GradientsMut};
/// use flashattn::{TensorMut, TensorRef};
/// let shape = [1, 4, 2, 8];
/// let x: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin()).collect();
/// let t = TensorRef::contiguous(&x, shape);
/// let cfg = AttentionConfig::new().causal(true);
/// let sinks = [0.5, -1.0];
/// let fwd = flashattn::forward(&cfg, ForwardInputs::new(t, t, t).with_sinks(&sinks))?;
/// let (mut dq, mut dk, mut dv) = (vec![0.0; 64], vec![0.0; 64], vec![0.0; 64]);
/// let mut dsinks = [0.0f32; 2];
/// flashattn::backward_into(
///     &cfg,
///     BackwardInputs {
///         q: t,
///         k: t,
///         v: t,
///         out: TensorRef::contiguous(&fwd.out, shape),
///         dout: t,
///         lse: &fwd.lse,
///         sinks: Some(&sinks),
///     },
///     GradientsMut {
///         dq: TensorMut::contiguous(&mut dq, shape),
///         dk: TensorMut::contiguous(&mut dk, shape),
///         dv: TensorMut::contiguous(&mut dv, shape),
///         dsinks: Some(&mut dsinks),
///     },
/// )?;
/// assert!(dsinks.iter().all(|g| g.is_finite()));
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
    tensor::check_sinks(
        &problem,
        inputs.sinks.map(<[f32]>::len),
        grads.dsinks.as_deref().map(<[f32]>::len),
    )?;
    let plan = host_plan(Op::Backward, cfg, &problem)?;
    backend::cpu::backward(cfg, &problem, inputs, grads);
    Ok(plan)
}

/// Backward pass over host tensors: recomputes P from the forward's `lse` and returns dQ, dK,
/// dV packed, and where `inputs.sinks` is given, the sinks' gradient too (as
/// [`GradientsMut::dsinks`] computes it).
pub fn backward<T: Element>(
    cfg: &AttentionConfig,
    inputs: BackwardInputs<'_, T>,
) -> Result<Gradients<T>> {
    let problem = tensor::check_backward_inputs(T::DTYPE, inputs.operands(), inputs.lse.len())?;
    tensor::check_sinks(&problem, inputs.sinks.map(<[f32]>::len), None)?;
    let plan = host_plan(Op::Backward, cfg, &problem)?;
    let (q_shape, kv_shape, v_shape) = (problem.q_shape(), problem.kv_shape(), problem.v_shape());
    let mut dq = alloc(Layout::contiguous(q_shape).numel(Operand::DQ)?)?;
    let mut dk = alloc(Layout::contiguous(kv_shape).numel(Operand::DK)?)?;
    let mut dv = alloc(Layout::contiguous(v_shape).numel(Operand::DV)?)?;
    let mut dsinks = match inputs.sinks {
        Some(_) => Some(alloc(problem.heads_q)?),
        None => None,
    };
    // Packed gradients of exactly the problem's sizes: nothing left to check.
    let grads = GradientsMut {
        dq: TensorMut::contiguous(&mut dq, q_shape),
        dk: TensorMut::contiguous(&mut dk, kv_shape),
        dv: TensorMut::contiguous(&mut dv, v_shape),
        dsinks: dsinks.as_deref_mut(),
    };
    backend::cpu::backward(cfg, &problem, inputs, grads);
    Ok(Gradients {
        dq,
        dk,
        dv,
        dsinks,
        plan,
    })
}
