//! Views over host memory in the (batch, seqlen, heads, head_dim) layout, and all shape
//! validation.
// The cuda module exists with its feature only: a link to it there, a plain name otherwise.
#![cfg_attr(
    feature = "cuda",
    doc = "Device views live in [`crate::cuda`] and reuse [`Layout`] and [`Problem`]."
)]
#![cfg_attr(
    not(feature = "cuda"),
    doc = "Device views live in `flashattn::cuda` (the `cuda` feature) and reuse [`Layout`] and \
           [`Problem`]."
)]

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
    /// Packed row-major layout. Strides that would not fit in a usize saturate, so that
    /// [`Layout::span`] refuses the layout instead of wrapping.
    pub fn contiguous(shape: [usize; 4]) -> Self {
        let [_, s, h, d] = shape;
        let hd = h.saturating_mul(d);
        Layout {
            shape,
            strides: [s.saturating_mul(hd), hd, d, 1],
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
    /// error when a dimension is zero or that number does not fit in a usize. (A stride cast
    /// from a negative one, `-n as usize`, lands here: its offsets pass `usize::MAX`.)
    pub fn span(&self, operand: Operand) -> Result<usize> {
        let overflow = || Error::IndexOverflow {
            operand,
            detail: format!("layout {self:?} spans more than usize::MAX elements"),
        };
        let mut last: usize = 0;
        for (dim, (&n, &stride)) in self.shape.iter().zip(&self.strides).enumerate() {
            let extent = n
                .checked_sub(1)
                .ok_or(Error::EmptyDimension { operand, dim })?;
            last = extent
                .checked_mul(stride)
                .and_then(|t| last.checked_add(t))
                .ok_or_else(overflow)?;
        }
        last.checked_add(1).ok_or_else(overflow)
    }

    /// Number of logical elements (the product of the shape), or an error when it does not
    /// fit in a usize. Larger than [`Layout::span`] when strides repeat elements (broadcast).
    pub fn numel(&self, operand: Operand) -> Result<usize> {
        self.shape
            .iter()
            .try_fold(1usize, |acc, &n| acc.checked_mul(n))
            .ok_or_else(|| Error::IndexOverflow {
                operand,
                detail: format!("shape {:?} has more than usize::MAX elements", self.shape),
            })
    }

    /// Checks that hold for every backend: no zero dimension, unit head_dim stride, a span and
    /// an element count that fit in a usize.
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
        self.span(operand)?;
        self.numel(operand).map(|_| ())
    }

    /// Whether no two index tuples reach the same element, as an output needs (on the GPU
    /// many threads write at once, and no backend can say which of two writes to one element
    /// the caller meant). Sufficient test: ordered by stride, each dimension longer than 1 has
    /// a stride past the furthest offset of the dimensions below it.
    pub fn is_one_to_one(&self) -> bool {
        let mut dims: Vec<(usize, usize)> = self
            .shape
            .iter()
            .zip(&self.strides)
            .filter(|(&n, _)| n > 1)
            .map(|(&n, &s)| (s, n))
            .collect();
        dims.sort_unstable();
        let mut reach = 0usize;
        for (stride, n) in dims {
            if stride <= reach {
                return false;
            }
            match (n - 1)
                .checked_mul(stride)
                .and_then(|t| reach.checked_add(t))
            {
                Some(r) => reach = r,
                None => return false,
            }
        }
        true
    }

    /// [`Layout::validate`] for a layout that is written: also one element per index tuple.
    pub fn validate_output(&self, operand: Operand) -> Result<()> {
        self.validate(operand)?;
        if !self.is_one_to_one() {
            return Err(Error::OverlappingOutput {
                operand,
                strides: self.strides,
            });
        }
        Ok(())
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
    check_span(operand, layout, len)
}

/// A buffer of `len` elements holds the output `layout` (valid, one element per index tuple,
/// and long enough for its span).
pub(crate) fn check_output_len(operand: Operand, layout: &Layout, len: usize) -> Result<()> {
    layout.validate_output(operand)?;
    check_span(operand, layout, len)
}

fn check_span(operand: Operand, layout: &Layout, len: usize) -> Result<()> {
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
    /// Its layout and buffer length, as [`check_forward`] takes them.
    pub fn operand(&self) -> Operand4<'_> {
        (&self.layout, self.data.len())
    }
}

impl<'a, T> TensorMut<'a, T> {
    pub fn new(data: &'a mut [T], layout: Layout) -> Self {
        TensorMut { data, layout }
    }
    pub fn contiguous(data: &'a mut [T], shape: [usize; 4]) -> Self {
        Self::new(data, Layout::contiguous(shape))
    }
    /// Valid as an output (see [`Layout::validate_output`]) over a long enough buffer.
    pub fn check(&self, operand: Operand) -> Result<()> {
        check_output_len(operand, &self.layout, self.data.len())
    }
    /// Its layout and buffer length, as [`check_forward`] takes them.
    pub fn operand(&self) -> Operand4<'_> {
        (&self.layout, self.data.len())
    }
    pub fn as_ref(&self) -> TensorRef<'_, T> {
        TensorRef {
            data: self.data,
            layout: self.layout,
        }
    }
}

/// One operand of a call: its layout and the length, in elements, of the buffer it views.
pub type Operand4<'a> = (&'a Layout, usize);

/// Validates the operands of a forward call, on every backend before anything runs: Q, K, V
/// readable within their buffers, `out` shaped like Q and writable (one element per index),
/// the LSE buffer long enough. Returns the problem they describe.
pub fn check_forward(
    dtype: DType,
    [q, k, v]: [Operand4; 3],
    out: Operand4,
    lse_len: usize,
) -> Result<Problem> {
    check_len(Operand::Q, q.0, q.1)?;
    check_len(Operand::K, k.0, k.1)?;
    check_len(Operand::V, v.0, v.1)?;
    let problem = Problem::from_layouts(q.0, k.0, v.0, dtype)?;
    check_output_len(Operand::Out, out.0, out.1)?;
    Problem::expect_shape(Operand::Out, out.0, problem.q_shape())?;
    problem.check_lse_len(lse_len)?;
    Ok(problem)
}

/// Validates the operands of a backward call as [`check_forward`] does: Q, K, V, O and dO
/// readable, dQ (shaped like Q), dK and dV (shaped like K) writable, the LSE long enough.
pub fn check_backward(
    dtype: DType,
    [q, k, v, out, dout]: [Operand4; 5],
    lse_len: usize,
    [dq, dk, dv]: [Operand4; 3],
) -> Result<Problem> {
    check_len(Operand::Q, q.0, q.1)?;
    check_len(Operand::K, k.0, k.1)?;
    check_len(Operand::V, v.0, v.1)?;
    let problem = Problem::from_layouts(q.0, k.0, v.0, dtype)?;
    let (q_shape, kv_shape) = (problem.q_shape(), problem.kv_shape());
    for (operand, (layout, len), shape) in
        [(Operand::Out, out, q_shape), (Operand::DOut, dout, q_shape)]
    {
        check_len(operand, layout, len)?;
        Problem::expect_shape(operand, layout, shape)?;
    }
    for (operand, (layout, len), shape) in [
        (Operand::DQ, dq, q_shape),
        (Operand::DK, dk, kv_shape),
        (Operand::DV, dv, kv_shape),
    ] {
        check_output_len(operand, layout, len)?;
        Problem::expect_shape(operand, layout, shape)?;
    }
    problem.check_lse_len(lse_len)?;
    Ok(problem)
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
        let problem = Problem {
            batch,
            seqlen_q,
            seqlen_k,
            heads_q,
            heads_kv,
            head_dim,
            dtype,
        };
        problem.validate()?;
        Ok(problem)
    }

    /// Checks a problem built by hand (its fields are public): no zero size, heads_q a
    /// multiple of heads_kv, and element counts of Q, K and the LSE that fit in a usize.
    pub fn validate(&self) -> Result<()> {
        for (operand, shape) in [(Operand::Q, self.q_shape()), (Operand::K, self.kv_shape())] {
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

    pub fn q_shape(&self) -> [usize; 4] {
        [self.batch, self.seqlen_q, self.heads_q, self.head_dim]
    }
    pub fn kv_shape(&self) -> [usize; 4] {
        [self.batch, self.seqlen_k, self.heads_kv, self.head_dim]
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

    /// The sizes the CPU backend takes: at most [`MAX_HOST_ELEMENTS`] logical elements in Q
    /// and in K (it converts them, and V, to f32 whole).
    pub fn check_cpu_limits(&self) -> Result<()> {
        self.validate()?;
        host_numel(Operand::Q, &Layout::contiguous(self.q_shape()))?;
        host_numel(Operand::K, &Layout::contiguous(self.kv_shape())).map(|_| ())
    }

    /// The sizes the GPU kernels take, which number rows, blocks and grid blocks with 32-bit
    /// integers (the C ABI checks the same): sequences of at most [`MAX_GPU_SEQLEN`],
    /// `(max(seqlen_q, seqlen_k) / 64 + 1) · batch · heads_q` work items within i32, and
    /// `max(seqlen_q, seqlen_k) · batch · heads_q · head_dim` within 2^42 elements.
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
        let elements = longest * heads * self.head_dim as u128;
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
