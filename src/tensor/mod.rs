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

mod problem;
pub(crate) use problem::host_numel;
pub use problem::{Problem, MAX_GPU_SEQLEN, MAX_HOST_ELEMENTS};

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
/// readable within their buffers, `out` shaped like Q but with V's head dim and writable (one
/// element per index),
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
    Problem::expect_shape(Operand::Out, out.0, problem.o_shape())?;
    problem.check_lse_len(lse_len)?;
    Ok(problem)
}

/// Validates the operands of a backward call as [`check_forward`] does: Q, K, V, O and dO
/// readable, dQ (shaped like Q), dK (like K) and dV (like V) writable, the LSE long enough.
pub fn check_backward(
    dtype: DType,
    inputs: [Operand4; 5],
    lse_len: usize,
    [dq, dk, dv]: [Operand4; 3],
) -> Result<Problem> {
    let problem = check_backward_inputs(dtype, inputs, lse_len)?;
    for (operand, (layout, len), shape) in [
        (Operand::DQ, dq, problem.q_shape()),
        (Operand::DK, dk, problem.kv_shape()),
        (Operand::DV, dv, problem.v_shape()),
    ] {
        check_output_len(operand, layout, len)?;
        Problem::expect_shape(operand, layout, shape)?;
    }
    Ok(problem)
}

/// [`check_backward`]'s checks of the backward's inputs alone: Q, K, V, O, dO and the LSE.
pub(crate) fn check_backward_inputs(
    dtype: DType,
    [q, k, v, out, dout]: [Operand4; 5],
    lse_len: usize,
) -> Result<Problem> {
    check_len(Operand::Q, q.0, q.1)?;
    check_len(Operand::K, k.0, k.1)?;
    check_len(Operand::V, v.0, v.1)?;
    let problem = Problem::from_layouts(q.0, k.0, v.0, dtype)?;
    for (operand, (layout, len)) in [(Operand::Out, out), (Operand::DOut, dout)] {
        check_len(operand, layout, len)?;
        Problem::expect_shape(operand, layout, problem.o_shape())?;
    }
    problem.check_lse_len(lse_len)?;
    Ok(problem)
}

/// Validates a call's attention sinks and their gradient's buffer, given by their lengths where
/// the call has them: each holds at least heads_q values (the first heads_q are the ones used),
/// and the gradient is only asked for beside the sinks it is the gradient of (as the C ABI has
/// it: `dsinks` without `sinks` is refused).
pub(crate) fn check_sinks(
    problem: &Problem,
    sinks: Option<usize>,
    dsinks: Option<usize>,
) -> Result<()> {
    if dsinks.is_some() && sinks.is_none() {
        return Err(Error::InvalidConfig(
            "the sinks' gradient (dsinks) was asked for without the sinks".into(),
        ));
    }
    for (operand, len) in [(Operand::Sinks, sinks), (Operand::DSinks, dsinks)] {
        match len {
            Some(len) if len < problem.heads_q => {
                return Err(Error::BufferTooSmall {
                    operand,
                    needed: problem.heads_q,
                    len,
                })
            }
            _ => {}
        }
    }
    Ok(())
}
