//! Views over host memory in the (batch, seqlen, heads, head_dim) layout, and all shape
//! validation. Device views live in [`crate::cuda`] and reuse [`Layout`] and [`Problem`].

use crate::error::{Error, Operand, Result};

/// Element types the crate knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    BF16,
    E4M3,
}

impl DType {
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::E4M3 => 1,
        }
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
    impl Sealed for float8::F8E4M3 {}
}

/// An element type of Q, K, V and O. Arithmetic happens in f32 or wider; this trait only
/// converts (rounding to nearest even on the way in).
pub trait Element: Copy + Send + Sync + Default + 'static + sealed::Sealed {
    const DTYPE: DType;
    fn to_f32(self) -> f32;
    fn from_f32(x: f32) -> Self;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(x: f32) -> Self {
        x
    }
}
impl Element for half::f16 {
    const DTYPE: DType = DType::F16;
    fn to_f32(self) -> f32 {
        half::f16::to_f32(self)
    }
    fn from_f32(x: f32) -> Self {
        half::f16::from_f32(x)
    }
}
impl Element for half::bf16 {
    const DTYPE: DType = DType::BF16;
    fn to_f32(self) -> f32 {
        half::bf16::to_f32(self)
    }
    fn from_f32(x: f32) -> Self {
        half::bf16::from_f32(x)
    }
}
impl Element for float8::F8E4M3 {
    const DTYPE: DType = DType::E4M3;
    fn to_f32(self) -> f32 {
        float8::F8E4M3::to_f32(&self)
    }
    fn from_f32(x: f32) -> Self {
        float8::F8E4M3::from_f32(x)
    }
}

/// Shape `(batch, seqlen, heads, head_dim)` and strides in elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub shape: [usize; 4],
    pub strides: [usize; 4],
}

impl Layout {
    /// Packed row-major layout.
    pub fn contiguous(shape: [usize; 4]) -> Self {
        let [_, s, h, d] = shape;
        Layout {
            shape,
            strides: [s * h * d, h * d, d, 1],
        }
    }

    pub fn with_strides(shape: [usize; 4], strides: [usize; 4]) -> Self {
        Layout { shape, strides }
    }

    pub fn batch(&self) -> usize {
        self.shape[0]
    }
    pub fn seqlen(&self) -> usize {
        self.shape[1]
    }
    pub fn heads(&self) -> usize {
        self.shape[2]
    }
    pub fn head_dim(&self) -> usize {
        self.shape[3]
    }

    pub fn offset(&self, b: usize, s: usize, h: usize, d: usize) -> usize {
        b * self.strides[0] + s * self.strides[1] + h * self.strides[2] + d * self.strides[3]
    }

    /// Number of elements a buffer needs to hold this layout (largest offset + 1), or an
    /// error when that does not fit in a usize.
    pub fn span(&self, operand: Operand) -> Result<usize> {
        let mut last: usize = 0;
        for i in 0..4 {
            let term = (self.shape[i] - 1)
                .checked_mul(self.strides[i])
                .and_then(|t| last.checked_add(t));
            last = term.ok_or_else(|| Error::IndexOverflow {
                operand,
                detail: format!("layout {self:?} spans more than usize::MAX elements"),
            })?;
        }
        Ok(last + 1)
    }

    /// Checks that hold for every backend: no zero dimension, unit head_dim stride.
    pub fn validate(&self, operand: Operand) -> Result<()> {
        if let Some(dim) = self.shape.iter().position(|&n| n == 0) {
            return Err(Error::EmptyDimension { operand, dim });
        }
        if self.strides[3] != 1 {
            return Err(Error::NonUnitHeadDimStride {
                operand,
                stride: self.strides[3],
            });
        }
        self.span(operand).map(|_| ())
    }
}

/// A read-only host tensor.
#[derive(Clone, Copy, Debug)]
pub struct TensorRef<'a, T> {
    pub data: &'a [T],
    pub layout: Layout,
}

/// A writable host tensor.
#[derive(Debug)]
pub struct TensorMut<'a, T> {
    pub data: &'a mut [T],
    pub layout: Layout,
}

/// A buffer of `len` elements holds `layout` (valid, and long enough for its span).
pub(crate) fn check_len(operand: Operand, layout: &Layout, len: usize) -> Result<()> {
    layout.validate(operand)?;
    let needed = layout.span(operand)?;
    if len < needed {
        return Err(Error::BufferTooSmall {
            operand,
            needed,
            len,
        });
    }
    Ok(())
}

impl<'a, T> TensorRef<'a, T> {
    pub fn new(data: &'a [T], layout: Layout) -> Self {
        TensorRef { data, layout }
    }
    pub fn contiguous(data: &'a [T], shape: [usize; 4]) -> Self {
        Self::new(data, Layout::contiguous(shape))
    }
    pub fn check(&self, operand: Operand) -> Result<()> {
        check_len(operand, &self.layout, self.data.len())
    }
}

impl<'a, T> TensorMut<'a, T> {
    pub fn new(data: &'a mut [T], layout: Layout) -> Self {
        TensorMut { data, layout }
    }
    pub fn contiguous(data: &'a mut [T], shape: [usize; 4]) -> Self {
        Self::new(data, Layout::contiguous(shape))
    }
    pub fn check(&self, operand: Operand) -> Result<()> {
        check_len(operand, &self.layout, self.data.len())
    }
    pub fn as_ref(&self) -> TensorRef<'_, T> {
        TensorRef {
            data: self.data,
            layout: self.layout,
        }
    }
}

/// The sizes of one attention problem, derived from validated Q, K, V layouts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Problem {
    pub batch: usize,
    pub seqlen_q: usize,
    pub seqlen_k: usize,
    pub heads_q: usize,
    pub heads_kv: usize,
    pub head_dim: usize,
    pub dtype: DType,
}

impl Problem {
    /// Validates Q (b, s_q, h_q, d), K and V (b, s_k, h_kv, d) and derives the problem.
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
        if v.shape != expected_k {
            return Err(Error::ShapeMismatch {
                operand: Operand::V,
                expected: expected_k,
                found: v.shape,
            });
        }
        if heads_q % heads_kv != 0 {
            return Err(Error::HeadsNotMultiple { heads_q, heads_kv });
        }
        Ok(Problem {
            batch,
            seqlen_q,
            seqlen_k,
            heads_q,
            heads_kv,
            head_dim,
            dtype,
        })
    }

    pub fn q_shape(&self) -> [usize; 4] {
        [self.batch, self.seqlen_q, self.heads_q, self.head_dim]
    }
    pub fn kv_shape(&self) -> [usize; 4] {
        [self.batch, self.seqlen_k, self.heads_kv, self.head_dim]
    }
    /// LSE is (batch, heads_q, seqlen_q), f32, packed.
    pub fn lse_len(&self) -> usize {
        self.batch * self.heads_q * self.seqlen_q
    }
    /// An LSE buffer of `len` f32 is long enough.
    pub fn check_lse_len(&self, len: usize) -> Result<()> {
        if len < self.lse_len() {
            return Err(Error::BufferTooSmall {
                operand: Operand::Lse,
                needed: self.lse_len(),
                len,
            });
        }
        Ok(())
    }
    /// Query heads that share one KV head.
    pub fn group_size(&self) -> usize {
        self.heads_q / self.heads_kv
    }

    /// Forward FLOPs by the FlashAttention convention (4·b·s_q·s_k·h·d, half when causal).
    pub fn forward_flops(&self, causal: bool) -> f64 {
        let f = 4.0
            * self.batch as f64
            * self.seqlen_q as f64
            * self.seqlen_k as f64
            * self.heads_q as f64
            * self.head_dim as f64;
        if causal {
            f / 2.0
        } else {
            f
        }
    }

    /// Checks that `layout` has exactly `shape`; used for outputs and gradients.
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

    /// Kernels index rows with 32-bit integers and tensors with 64-bit strides: every dimension
    /// must fit in i32 and every element offset in i64.
    pub fn check_index_width(&self, layouts: &[(Operand, &Layout)]) -> Result<()> {
        for (operand, layout) in layouts {
            for (i, &n) in layout.shape.iter().enumerate() {
                if n > i32::MAX as usize {
                    return Err(Error::IndexOverflow {
                        operand: *operand,
                        detail: format!("dimension {i} = {n} exceeds i32::MAX"),
                    });
                }
            }
            let span = layout.span(*operand)?;
            if span > i64::MAX as usize {
                return Err(Error::IndexOverflow {
                    operand: *operand,
                    detail: format!("span {span} exceeds i64::MAX"),
                });
            }
        }
        let lse = (self.batch as u128) * (self.heads_q as u128) * (self.seqlen_q as u128);
        if lse > i64::MAX as u128 {
            return Err(Error::IndexOverflow {
                operand: Operand::Lse,
                detail: format!("{lse} elements exceed i64::MAX"),
            });
        }
        Ok(())
    }
}
