//! The sizes of one attention problem, derived from validated layouts, and the limits each
//! backend puts on them.

use super::{DType, Layout};
use crate::error::{Error, Operand, Result};

/// The sizes of one attention problem, derived from validated Q, K, V layouts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Problem {
    pub batch: usize,
    pub seqlen_q: usize,
    pub seqlen_k: usize,
    pub heads_q: usize,
    pub heads_kv: usize,
    /// Head dim of Q and K.
    pub head_dim: usize,
    /// Head dim of V, and so of O, dO and dV: `head_dim`, or another (DeepSeek's MLA trains with
    /// 192 and 128).
    pub head_dim_v: usize,
    pub dtype: DType,
    /// The batch entries are sequences packed one after another along the tensors' rows
    /// ([`crate::varlen`]); `seqlen_q` and `seqlen_k` are then the longest entry's lengths.
    pub packed: bool,
}

impl Problem {
    /// Validates Q (b, s_q, h_q, d), K (b, s_k, h_kv, d) and V (b, s_k, h_kv, d_v) and derives
    /// the problem.
    pub fn from_layouts(q: &Layout, k: &Layout, v: &Layout, dtype: DType) -> Result<Problem> {
        q.validate(Operand::Q)?;
        k.validate(Operand::K)?;
        v.validate(Operand::V)?;
        let [batch, seqlen_q, heads_q, head_dim] = q.shape;
        let [_, seqlen_k, heads_kv, _] = k.shape;
        let expected_k = [batch, seqlen_k, heads_kv, head_dim];
        if k.shape != expected_k {
            return Err(Error::ShapeMismatch {
                operand: Operand::K,
                expected: expected_k,
                found: k.shape,
            });
        }
        let head_dim_v = v.shape[3];
        let expected_v = [batch, seqlen_k, heads_kv, head_dim_v];
        if v.shape != expected_v {
            return Err(Error::ShapeMismatch {
                operand: Operand::V,
                expected: expected_v,
                found: v.shape,
            });
        }
        let problem = Problem {
            batch,
            seqlen_q,
            seqlen_k,
            heads_q,
            heads_kv,
            head_dim,
            head_dim_v,
            dtype,
            packed: false,
        };
        problem.validate()?;
        Ok(problem)
    }

    /// Checks a problem built by hand (its fields are public): no zero size, heads_q a
    /// multiple of heads_kv, and element counts of Q, K, V, O and the LSE that fit in a usize.
    pub fn validate(&self) -> Result<()> {
        for (operand, shape) in [
            (Operand::Q, self.q_shape()),
            (Operand::K, self.kv_shape()),
            (Operand::V, self.v_shape()),
            (Operand::Out, self.o_shape()),
        ] {
            let layout = Layout::contiguous(shape);
            layout.validate(operand)?;
        }
        if self.heads_q % self.heads_kv != 0 {
            return Err(Error::HeadsNotMultiple {
                heads_q: self.heads_q,
                heads_kv: self.heads_kv,
            });
        }
        self.lse_len().map(|_| ())
    }

    /// Q's shape, and dQ's.
    pub fn q_shape(&self) -> [usize; 4] {
        [self.batch, self.seqlen_q, self.heads_q, self.head_dim]
    }
    /// K's shape, and dK's.
    pub fn kv_shape(&self) -> [usize; 4] {
        [self.batch, self.seqlen_k, self.heads_kv, self.head_dim]
    }
    /// V's shape, and dV's.
    pub fn v_shape(&self) -> [usize; 4] {
        [self.batch, self.seqlen_k, self.heads_kv, self.head_dim_v]
    }
    /// O's shape, and dO's.
    pub fn o_shape(&self) -> [usize; 4] {
        [self.batch, self.seqlen_q, self.heads_q, self.head_dim_v]
    }
    /// LSE is (batch, heads_q, seqlen_q), f32, packed: its length, or an error when that does
    /// not fit in a usize.
    pub fn lse_len(&self) -> Result<usize> {
        Layout::contiguous([self.batch, self.heads_q, self.seqlen_q, 1]).numel(Operand::Lse)
    }
    /// An LSE buffer of `len` f32 is long enough.
    pub fn check_lse_len(&self, len: usize) -> Result<()> {
        let needed = self.lse_len()?;
        if len < needed {
            return Err(Error::BufferTooSmall {
                operand: Operand::Lse,
                needed,
                len,
            });
        }
        Ok(())
    }
    /// Query heads that share one KV head (0 for a problem without KV heads, which
    /// [`Problem::validate`] refuses).
    pub fn group_size(&self) -> usize {
        self.heads_q.checked_div(self.heads_kv).unwrap_or(0)
    }

    /// Forward FLOPs by the FlashAttention convention (2·b·s_q·s_k·h·(d + d_v): 4·b·s_q·s_k·h·d
    /// where V's head dim is Q's; half when causal).
    pub fn forward_flops(&self, causal: bool) -> f64 {
        let f = 2.0
            * self.batch as f64
            * self.seqlen_q as f64
            * self.seqlen_k as f64
            * self.heads_q as f64
            * (self.head_dim + self.head_dim_v) as f64;
        if causal {
            f / 2.0
        } else {
            f
        }
    }

    /// Checks that `layout` has exactly `shape`.
    pub fn expect_shape(operand: Operand, layout: &Layout, shape: [usize; 4]) -> Result<()> {
        layout.validate(operand)?;
        if layout.shape != shape {
            return Err(Error::ShapeMismatch {
                operand,
                expected: shape,
                found: layout.shape,
            });
        }
        Ok(())
    }

    /// The sizes the CPU backend takes: at most [`MAX_HOST_ELEMENTS`] logical elements in each
    /// of Q, K, V and O (it converts the inputs to f32 whole).
    pub fn check_cpu_limits(&self) -> Result<()> {
        self.validate()?;
        host_numel(Operand::Q, &Layout::contiguous(self.q_shape()))?;
        host_numel(Operand::K, &Layout::contiguous(self.kv_shape()))?;
        host_numel(Operand::V, &Layout::contiguous(self.v_shape()))?;
        host_numel(Operand::Out, &Layout::contiguous(self.o_shape())).map(|_| ())
    }

    /// The sizes the GPU kernels take, which number rows, blocks and grid blocks with 32-bit
    /// integers (the C ABI checks the same): sequences of at most [`MAX_GPU_SEQLEN`],
    /// `(max(seqlen_q, seqlen_k) / 64 + 1) · batch · heads_q` work items within i32, and
    /// `max(seqlen_q, seqlen_k) · batch · heads_q · max(head_dim, head_dim_v)` within 2^42
    /// elements.
    pub fn check_gpu_limits(&self) -> Result<()> {
        self.validate()?;
        for (operand, seqlen) in [(Operand::Q, self.seqlen_q), (Operand::K, self.seqlen_k)] {
            if seqlen > MAX_GPU_SEQLEN {
                return Err(Error::IndexOverflow {
                    operand,
                    detail: format!("seqlen {seqlen} exceeds the GPU kernels' {MAX_GPU_SEQLEN}"),
                });
            }
        }
        let longest = self.seqlen_q.max(self.seqlen_k) as u128;
        let heads = self.batch as u128 * self.heads_q as u128;
        let items = (longest / 64 + 1) * heads;
        if items > i32::MAX as u128 {
            return Err(Error::IndexOverflow {
                operand: Operand::Q,
                detail: format!("{items} blocks of 64 rows over all heads exceed i32::MAX"),
            });
        }
        // (Packed calls: their packed rows are checked against the same bound by
        // `cuda::DeviceSeqlens`, which knows them.)
        let elements = longest * heads * self.head_dim.max(self.head_dim_v) as u128;
        if elements > 1 << 42 {
            return Err(Error::IndexOverflow {
                operand: Operand::Q,
                detail: format!("{elements} elements per operand exceed the GPU kernels' 2^42"),
            });
        }
        Ok(())
    }

    /// [`Problem::check_gpu_limits`], and every element offset of `layouts` within i64 (the
    /// kernels' strides are 64-bit).
    pub fn check_index_width(&self, layouts: &[(Operand, &Layout)]) -> Result<()> {
        self.check_gpu_limits()?;
        for (operand, layout) in layouts {
            let span = layout.span(*operand)?;
            if span > i64::MAX as usize {
                return Err(Error::IndexOverflow {
                    operand: *operand,
                    detail: format!("span {span} exceeds i64::MAX"),
                });
            }
        }
        Ok(())
    }
}

/// Most logical elements of one operand the host code takes (the CPU backend and the FP8 host
/// helpers convert whole operands to f32, broadcast ones included): 2^32, 16 GiB of f32.
pub const MAX_HOST_ELEMENTS: usize = 1 << 32;

/// `layout`'s element count, refused past [`MAX_HOST_ELEMENTS`].
pub(crate) fn host_numel(operand: Operand, layout: &Layout) -> Result<usize> {
    let n = layout.numel(operand)?;
    if n > MAX_HOST_ELEMENTS {
        return Err(Error::IndexOverflow {
            operand,
            detail: format!("{n} elements exceed the host code's {MAX_HOST_ELEMENTS}"),
        });
    }
    Ok(n)
}

/// Longest sequence (queries or keys) the GPU kernels take: they number rows and blocks with
/// 32-bit integers, and this leaves every such number room (the C ABI's FLASHATTN_MAX_SEQLEN).
pub const MAX_GPU_SEQLEN: usize = 1 << 30;
