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
//! FP8 (e4m3) forward on `Sm90`: [`cuda::Device::forward_fp8`] quantizes bf16/fp16 Q, K, V
//! (one scale per block, optionally after a random-sign Hadamard transform of Q and K) and runs
//! the QGMMA kernel; [`cuda::Device::quantize_fp8`] and [`cuda::Device::fp8_inputs_from_e4m3`]
//! give inputs to reuse or quantized elsewhere. The quantize step's host definition: [`fp8`].
//!
//! Fully masked query rows (a window or causal mask that leaves no key) give `O = 0` and
//! `lse = +inf`, so that a backward pass computes `exp(s - lse) = 0` and zero gradients. A row
//! that sees a NaN score gets NaN in `O` and `lse`, on every backend.
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
pub mod tensor;

/// The README's examples, compiled as doctests (the GPU one needs the `cuda` feature).
#[cfg(all(doctest, feature = "cuda"))]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

pub use config::{AttentionConfig, Backend, Mask, PingPong, Sm90Schedule, TailSplit};
pub use dispatch::{BuiltKernels, DeviceInfo, Memory, Op, Plan};
pub use error::{Error, Operand, Result};
pub use tensor::{DType, Element, Layout, Problem, TensorMut, TensorRef};

/// Output of a host forward call: `out` packed like Q, `lse` packed (batch, heads_q, seqlen_q).
#[derive(Clone, Debug)]
pub struct ForwardOutput<T> {
    pub out: Vec<T>,
    pub lse: Vec<f32>,
    pub plan: Plan,
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
fn alloc<T: Clone + Default>(len: usize) -> Result<Vec<T>> {
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
    backend::cpu::forward(cfg, &problem, q, k, v, out, lse);
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
    backend::cpu::forward(cfg, &problem, q, k, v, o, &mut lse);
    Ok(ForwardOutput { out, lse, plan })
}

/// Backward pass over host tensors into caller-owned gradients: recomputes P from `lse` and
/// writes dQ (shaped like Q), dK and dV (shaped like K and V), each reaching every element once.
#[allow(clippy::too_many_arguments)]
pub fn backward_into<T: Element>(
    cfg: &AttentionConfig,
    q: TensorRef<T>,
    k: TensorRef<T>,
    v: TensorRef<T>,
    out: TensorRef<T>,
    dout: TensorRef<T>,
    lse: &[f32],
    dq: TensorMut<T>,
    dk: TensorMut<T>,
    dv: TensorMut<T>,
) -> Result<Plan> {
    let problem = tensor::check_backward(
        T::DTYPE,
        [
            q.operand(),
            k.operand(),
            v.operand(),
            out.operand(),
            dout.operand(),
        ],
        lse.len(),
        [dq.operand(), dk.operand(), dv.operand()],
    )?;
    let plan = host_plan(Op::Backward, cfg, &problem)?;
    backend::cpu::backward(
        cfg,
        &problem,
        backend::cpu::BackwardInputs {
            q,
            k,
            v,
            out,
            dout,
            lse,
        },
        dq,
        dk,
        dv,
    );
    Ok(plan)
}

/// Backward pass over host tensors: recomputes P from `lse` and returns dQ, dK, dV packed.
#[allow(clippy::too_many_arguments)]
pub fn backward<T: Element>(
    cfg: &AttentionConfig,
    q: TensorRef<T>,
    k: TensorRef<T>,
    v: TensorRef<T>,
    out: TensorRef<T>,
    dout: TensorRef<T>,
    lse: &[f32],
) -> Result<Gradients<T>> {
    let (problem, _) = plan_host(Op::Backward, cfg, &q, &k, &v)?;
    let (q_shape, kv_shape) = (problem.q_shape(), problem.kv_shape());
    let mut dq = alloc(Layout::contiguous(q_shape).numel(Operand::DQ)?)?;
    let mut dk = alloc(Layout::contiguous(kv_shape).numel(Operand::DK)?)?;
    let mut dv = alloc(Layout::contiguous(kv_shape).numel(Operand::DV)?)?;
    let plan = backward_into(
        cfg,
        q,
        k,
        v,
        out,
        dout,
        lse,
        TensorMut::contiguous(&mut dq, q_shape),
        TensorMut::contiguous(&mut dk, kv_shape),
        TensorMut::contiguous(&mut dv, kv_shape),
    )?;
    Ok(Gradients { dq, dk, dv, plan })
}
