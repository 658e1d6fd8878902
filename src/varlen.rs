//! Variable-length batches ("varlen"): sequences of different lengths packed along one token
//! axis, as training stacks pack documents without padding, with FlashAttention's varlen
//! conventions.
//!
//! Q is `(1, total_q, heads_q, head_dim)` — the batch axis has extent 1, the sequences follow
//! one another along the token axis — K is `(1, total_k, heads_kv, head_dim)` and V
//! `(1, total_k, heads_kv, head_dim_v)` (V's head dim may differ from Q's and K's). Sequence
//! `b` owns query rows `cu_seqlens_q[b] .. cu_seqlens_q[b + 1]` and key rows `cu_seqlens_k[b] ..
//! cu_seqlens_k[b + 1]`, of which it attends to the first `seqused_k[b]` (all of them without
//! `seqused_k`). Each sequence is its own attention problem: the mask (causal, windows) is
//! aligned bottom-right within it, and no query sees another sequence's keys. O is packed
//! `(1, total_q, heads_q, head_dim_v)`; the LSE is f32 `(heads_q, total_q)` packed. A sequence
//! with no query rows contributes nothing; one whose queries see no key gives O = 0 and
//! LSE = +inf, as in the dense calls.
//!
//! This module runs on the CPU backend (host memory, offsets on the host).
//!
//! ```
//! use flashattn::varlen::{self, Seqlens};
//! use flashattn::{AttentionConfig, ForwardInputs, TensorRef};
//!
//! // Three documents of 5, 0 and 3 tokens, 2 heads of 8.
//! let cu = [0, 5, 5, 8];
//! let seqs = Seqlens::new(&cu, &cu, 5, 5)?;
//! let x: Vec<f32> = (0..8 * 2 * 8).map(|i| (i as f32 * 0.37).sin()).collect();
//! let t = TensorRef::contiguous(&x, [1, 8, 2, 8]);
//! let fwd = varlen::forward(&AttentionConfig::new().causal(true), &seqs, ForwardInputs::new(t, t, t))?;
//! assert_eq!(fwd.lse.len(), 2 * 8); // (heads_q, total_q)
//! # Ok::<(), flashattn::Error>(())
//! ```

use std::ops::Range;

use crate::backend;
use crate::config::AttentionConfig;
use crate::dispatch::{self, BuiltKernels, Memory, Op, Plan};
use crate::error::{Error, Operand, Result};
use crate::tensor::{self, Element, Layout, Problem, TensorMut, TensorRef};
use crate::{alloc, BackwardInputs, ForwardInputs, ForwardOutput, Gradients, GradientsMut};

/// The sequence boundaries of a packed batch, checked: `batch + 1` non-decreasing offsets from
/// 0 for queries and for keys, each sequence within the stated maximum lengths, and the keys
/// each sequence uses within its own.
#[derive(Clone, Copy, Debug)]
pub struct Seqlens<'a> {
    cu_q: &'a [i32],
    cu_k: &'a [i32],
    used_k: Option<&'a [i32]>,
    max_q: usize,
    max_k: usize,
}

fn invalid(detail: String) -> Error {
    Error::InvalidSeqlens(detail)
}

/// The lengths `cu` describes, checked: starts at 0, never decreases, each length at most `max`.
fn lengths(name: &str, cu: &[i32], max: usize) -> Result<()> {
    match cu.first() {
        None => {
            return Err(invalid(format!(
                "{name} is empty (it holds batch + 1 offsets)"
            )))
        }
        Some(&first) if first != 0 => {
            return Err(invalid(format!("{name}[0] is {first}, not 0")));
        }
        _ => {}
    }
    for (b, w) in cu.windows(2).enumerate() {
        let len = i64::from(w[1]) - i64::from(w[0]);
        if len < 0 {
            return Err(invalid(format!(
                "{name} decreases at sequence {b}: {} then {}",
                w[0], w[1]
            )));
        }
        if len as u64 > max as u64 {
            return Err(invalid(format!(
                "sequence {b} has {len} rows in {name}, more than its maximum {max}"
            )));
        }
    }
    Ok(())
}

impl<'a> Seqlens<'a> {
    /// `cu_seqlens_q` and `cu_seqlens_k`: `batch + 1` cumulative offsets each, from 0;
    /// `max_seqlen_q` and `max_seqlen_k`: bounds on every sequence's lengths (the GPU kernels
    /// size their grids from them).
    pub fn new(
        cu_seqlens_q: &'a [i32],
        cu_seqlens_k: &'a [i32],
        max_seqlen_q: usize,
        max_seqlen_k: usize,
    ) -> Result<Self> {
        lengths("cu_seqlens_q", cu_seqlens_q, max_seqlen_q)?;
        lengths("cu_seqlens_k", cu_seqlens_k, max_seqlen_k)?;
        if cu_seqlens_k.len() != cu_seqlens_q.len() {
            return Err(invalid(format!(
                "cu_seqlens_q has {} offsets, cu_seqlens_k {}",
                cu_seqlens_q.len(),
                cu_seqlens_k.len()
            )));
        }
        Ok(Seqlens {
            cu_q: cu_seqlens_q,
            cu_k: cu_seqlens_k,
            used_k: None,
            max_q: max_seqlen_q,
            max_k: max_seqlen_k,
        })
    }

    /// Each sequence attends to the first `seqused_k[b]` of its keys only (a KV cache filled
    /// part way, say); `batch` values, each between 0 and the sequence's key count.
    pub fn with_seqused_k(self, seqused_k: &'a [i32]) -> Result<Self> {
        if seqused_k.len() != self.batch() {
            return Err(invalid(format!(
                "seqused_k has {} values for {} sequences",
                seqused_k.len(),
                self.batch()
            )));
        }
        for (b, &used) in seqused_k.iter().enumerate() {
            let len = self.cu_k[b + 1] - self.cu_k[b];
            if used < 0 || used > len {
                return Err(invalid(format!(
                    "seqused_k[{b}] is {used}, outside the sequence's 0..={len} keys"
                )));
            }
        }
        Ok(Seqlens {
            used_k: Some(seqused_k),
            ..self
        })
    }

    /// Number of sequences.
    pub fn batch(&self) -> usize {
        self.cu_q.len() - 1
    }
    /// The bound on every sequence's query rows given to [`Seqlens::new`].
    pub fn max_seqlen_q(&self) -> usize {
        self.max_q
    }
    /// The bound on every sequence's key rows given to [`Seqlens::new`].
    pub fn max_seqlen_k(&self) -> usize {
        self.max_k
    }
    /// Query rows of all sequences together.
    pub fn total_q(&self) -> usize {
        self.cu_q[self.batch()] as usize
    }
    /// Key rows of all sequences together (used or not).
    pub fn total_k(&self) -> usize {
        self.cu_k[self.batch()] as usize
    }
    /// The query rows of sequence `b`.
    pub fn queries(&self, b: usize) -> Range<usize> {
        self.cu_q[b] as usize..self.cu_q[b + 1] as usize
    }
    /// The key rows sequence `b` attends to.
    pub fn keys(&self, b: usize) -> Range<usize> {
        let start = self.cu_k[b] as usize;
        let end = match self.used_k {
            Some(used) => start + used[b] as usize,
            None => self.cu_k[b + 1] as usize,
        };
        start..end
    }
}

/// Validates Q, K, V against `seqs` and plans the call on the host; the packed problem (batch 1,
/// every row: its heads, head dims and dtype are every sequence's) and the plan.
fn plan<T: Element>(
    op: Op,
    cfg: &AttentionConfig,
    seqs: &Seqlens,
    q: &TensorRef<T>,
    k: &TensorRef<T>,
    v: &TensorRef<T>,
) -> Result<(Problem, Plan)> {
    q.check(Operand::Q)?;
    k.check(Operand::K)?;
    v.check(Operand::V)?;
    let problem = Problem::from_layouts(&q.layout, &k.layout, &v.layout, T::DTYPE)?;
    // Packed: a batch axis of 1 and the offsets' row counts.
    for (operand, layout, rows) in [
        (Operand::Q, &q.layout, seqs.total_q()),
        (Operand::K, &k.layout, seqs.total_k()),
    ] {
        let [_, _, heads, d] = layout.shape;
        Problem::expect_shape(operand, layout, [1, rows, heads, d])?;
    }
    let plan = dispatch::plan(op, &problem, cfg, &Memory::Host, BuiltKernels::current())?;
    Ok((problem, plan))
}

/// Rows `rows` of a packed view, as a batch-1 view of their own (with the view's heads and head
/// dim).
fn rows_of<'t, T>(t: &TensorRef<'t, T>, rows: &Range<usize>) -> TensorRef<'t, T> {
    let [_, _, heads, d] = t.layout.shape;
    let strides = t.layout.strides;
    let layout = Layout::with_strides([1, rows.len(), heads, d], strides);
    TensorRef::new(&t.data[rows.start * strides[1]..], layout)
}

/// The problem of sequence `b`: its own query and key counts.
fn sequence(shape: &Problem, seqs: &Seqlens, b: usize) -> Problem {
    Problem {
        batch: 1,
        seqlen_q: seqs.queries(b).len(),
        seqlen_k: seqs.keys(b).len(),
        ..*shape
    }
}

/// Forward pass over a packed batch: O packed `(1, total_q, heads_q, head_dim_v)`, the LSE
/// `(heads_q, total_q)`. Attention sinks (`inputs.sinks`, one per query head) join every
/// sequence's rows as in [`crate::forward_into`]; a sequence with no key gets O = 0 and, with a
/// sink, LSE = the sink (+inf without one or with −inf, NaN with +inf or NaN).
pub fn forward<T: Element>(
    cfg: &AttentionConfig,
    seqs: &Seqlens,
    inputs: ForwardInputs<'_, T>,
) -> Result<ForwardOutput<T>> {
    let ForwardInputs { q, k, v, sinks } = inputs;
    let (shape, plan) = plan(Op::Forward, cfg, seqs, &q, &k, &v)?;
    tensor::check_sinks(&shape, sinks.map(<[f32]>::len), None)?;
    let (heads, d_v, total) = (shape.heads_q, shape.head_dim_v, seqs.total_q());
    let mut out = alloc::<T>(Layout::contiguous([1, total, heads, d_v]).numel(Operand::Out)?)?;
    let mut lse = alloc::<f32>(heads.checked_mul(total).ok_or(Error::IndexOverflow {
        operand: Operand::Lse,
        detail: format!("{heads} heads of {total} rows"),
    })?)?;
    let row = heads * d_v;
    let mut seq_lse = Vec::new();
    for b in 0..seqs.batch() {
        let (rows, keys) = (seqs.queries(b), seqs.keys(b));
        if rows.is_empty() {
            continue;
        }
        if keys.is_empty() {
            // No key: O stays 0, the LSE is the sink's, or +inf without one.
            for h in 0..heads {
                let keyless = backend::cpu::keyless_lse(sinks.map(|s| s[h]));
                lse[h * total + rows.start..h * total + rows.end].fill(keyless);
            }
            continue;
        }
        let p = sequence(&shape, seqs, b);
        seq_lse.clear();
        seq_lse.resize(heads * rows.len(), 0.0);
        let o = TensorMut::contiguous(&mut out[rows.start * row..rows.end * row], p.o_shape());
        let inputs = ForwardInputs {
            sinks,
            ..ForwardInputs::new(rows_of(&q, &rows), rows_of(&k, &keys), rows_of(&v, &keys))
        };
        backend::cpu::forward(cfg, &p, inputs, o, &mut seq_lse);
        for h in 0..heads {
            lse[h * total + rows.start..h * total + rows.end]
                .copy_from_slice(&seq_lse[h * rows.len()..(h + 1) * rows.len()]);
        }
    }
    Ok(ForwardOutput { out, lse, plan })
}

/// Backward pass over a packed batch: recomputes P from the forward's LSE `(heads_q, total_q)`
/// and returns dQ packed like Q, dK like K and dV like V (zero on keys no query sees, those past
/// `seqused_k` among them); O and dO are `(1, total_q, heads_q, head_dim_v)`. With attention
/// sinks (`inputs.sinks`, those the forward took) it returns their gradient too, each
/// sequence's summed in sequence order.
pub fn backward<T: Element>(
    cfg: &AttentionConfig,
    seqs: &Seqlens,
    inputs: BackwardInputs<'_, T>,
) -> Result<Gradients<T>> {
    let BackwardInputs {
        q,
        k,
        v,
        out,
        dout,
        lse,
        sinks,
    } = inputs;
    let (shape, plan) = plan(Op::Backward, cfg, seqs, &q, &k, &v)?;
    tensor::check_sinks(&shape, sinks.map(<[f32]>::len), None)?;
    let (heads, heads_kv) = (shape.heads_q, shape.heads_kv);
    let (d, d_v) = (shape.head_dim, shape.head_dim_v);
    let total_q = seqs.total_q();
    for (operand, t) in [(Operand::Out, &out), (Operand::DOut, &dout)] {
        t.check(operand)?;
        Problem::expect_shape(operand, &t.layout, [1, total_q, heads, d_v])?;
    }
    if lse.len() < heads * total_q {
        return Err(Error::BufferTooSmall {
            operand: Operand::Lse,
            needed: heads * total_q,
            len: lse.len(),
        });
    }
    let mut dq = alloc::<T>(Layout::contiguous(q.layout.shape).numel(Operand::DQ)?)?;
    let mut dk = alloc::<T>(Layout::contiguous(k.layout.shape).numel(Operand::DK)?)?;
    let mut dv = alloc::<T>(Layout::contiguous(v.layout.shape).numel(Operand::DV)?)?;
    let (row_q, row_k, row_v) = (heads * d, heads_kv * d, heads_kv * d_v);
    let mut seq_lse = Vec::new();
    let mut dsinks = match sinks {
        Some(_) => Some(alloc::<f32>(heads)?),
        None => None,
    };
    let mut seq_dsinks = vec![0f32; if sinks.is_some() { heads } else { 0 }];
    for b in 0..seqs.batch() {
        let (rows, keys) = (seqs.queries(b), seqs.keys(b));
        if rows.is_empty() || keys.is_empty() {
            // O does not depend on any key: every gradient here is 0, the sinks' too (their
            // rows' Σ P·dP is empty).
            continue;
        }
        let p = sequence(&shape, seqs, b);
        seq_lse.clear();
        for h in 0..heads {
            seq_lse.extend_from_slice(&lse[h * total_q + rows.start..h * total_q + rows.end]);
        }
        let (q_shape, kv_shape, v_shape) = (p.q_shape(), p.kv_shape(), p.v_shape());
        let grads = GradientsMut {
            dq: TensorMut::contiguous(&mut dq[rows.start * row_q..rows.end * row_q], q_shape),
            dk: TensorMut::contiguous(&mut dk[keys.start * row_k..keys.end * row_k], kv_shape),
            dv: TensorMut::contiguous(&mut dv[keys.start * row_v..keys.end * row_v], v_shape),
            dsinks: sinks.map(|_| &mut seq_dsinks[..]),
        };
        let inputs = BackwardInputs {
            q: rows_of(&q, &rows),
            k: rows_of(&k, &keys),
            v: rows_of(&v, &keys),
            out: rows_of(&out, &rows),
            dout: rows_of(&dout, &rows),
            lse: &seq_lse,
            sinks,
        };
        backend::cpu::backward(cfg, &p, inputs, grads);
        if let Some(total) = dsinks.as_mut() {
            total.iter_mut().zip(&seq_dsinks).for_each(|(t, s)| *t += s);
        }
    }
    Ok(Gradients {
        dq,
        dk,
        dv,
        dsinks,
        plan,
    })
}
