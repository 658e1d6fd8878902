//! The crate's one error type. Every bad input is a value of this enum, never a panic.

use std::fmt;

use crate::config::Backend;
use crate::tensor::DType;

/// Which tensor an error is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Operand {
    Q,
    K,
    V,
    Out,
    Lse,
    DOut,
    DQ,
    DK,
    DV,
    /// The attention sinks (one f32 logit per query head).
    Sinks,
    /// The attention sinks' gradient.
    DSinks,
}

impl fmt::Display for Operand {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            Operand::Q => "q",
            Operand::K => "k",
            Operand::V => "v",
            Operand::Out => "out",
            Operand::Lse => "lse",
            Operand::DOut => "dout",
            Operand::DQ => "dq",
            Operand::DK => "dk",
            Operand::DV => "dv",
            Operand::Sinks => "sinks",
            Operand::DSinks => "dsinks",
        };
        f.write_str(name)
    }
}

/// What an [`Error::WrongDevice`] is about: the stream, one of the tensors of the call, or a
/// packed batch's sequence offsets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum CallPart {
    Stream,
    Tensor(Operand),
    /// The sequence offsets (or used-key counts) of a packed batch.
    Seqlens,
}

impl From<Operand> for CallPart {
    fn from(operand: Operand) -> CallPart {
        CallPart::Tensor(operand)
    }
}

impl fmt::Display for CallPart {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CallPart::Stream => f.write_str("the stream"),
            CallPart::Tensor(operand) => write!(f, "{operand}"),
            CallPart::Seqlens => f.write_str("the sequence offsets"),
        }
    }
}

/// New variants may come in a minor release: match with a `_` arm.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum Error {
    /// A dimension is zero (attention over nothing is not a problem we accept).
    EmptyDimension { operand: Operand, dim: usize },
    /// The last (head_dim) stride must be 1.
    NonUnitHeadDimStride { operand: Operand, stride: usize },
    /// Two tensors disagree on a dimension that must match.
    ShapeMismatch {
        operand: Operand,
        expected: [usize; 4],
        found: [usize; 4],
    },
    /// heads_q must be a multiple of heads_kv (GQA/MQA).
    HeadsNotMultiple { heads_q: usize, heads_kv: usize },
    /// The slice given is shorter than the layout's span.
    BufferTooSmall {
        operand: Operand,
        needed: usize,
        len: usize,
    },
    /// An output whose strides reach some element from two index tuples (zero or overlapping
    /// strides): its value would depend on which write came last.
    OverlappingOutput {
        operand: Operand,
        strides: [usize; 4],
    },
    /// Element offsets would overflow the index width a kernel uses.
    IndexOverflow { operand: Operand, detail: String },
    /// A head dimension the backend does not implement (on `Sm90`, also a head dim the FP8
    /// path has no descale blocks for; its Hadamard transform at d96 and d192 is `Unsupported`).
    UnsupportedHeadDim { head_dim: usize, backend: Backend },
    /// An element type the backend does not implement.
    UnsupportedDtype { dtype: DType, backend: Backend },
    /// A feature (softcap, window, ...) or operation the backend does not implement yet. With
    /// `backend: Auto`, no backend took the call and `what` says why each refused.
    Unsupported { what: String, backend: Backend },
    /// A backend was forced where it cannot run (no GPU, wrong architecture, host memory...).
    BackendUnavailable { backend: Backend, reason: String },
    /// A configuration value is out of range (negative scale, NaN softcap...), or optional
    /// inputs of a call that do not go together (the sinks' gradient asked for without the
    /// sinks). The C ABI's refusals of an argument come as this too.
    InvalidConfig(String),
    /// Sequence offsets or lengths of a packed (varlen) batch that describe no packing: not
    /// starting at 0, decreasing, past their maximum, of the wrong count.
    InvalidSeqlens(String),
    /// A KV cache's block table names a page outside the cache, or has another length than
    /// `batch × max_pages`.
    InvalidPageTable(String),
    /// Device pointer not aligned as the kernels require.
    Misaligned { operand: Operand, align: usize },
    /// A stream, view or FP8 input that belongs to another CUDA context than the device the
    /// call was made on.
    WrongDevice { what: CallPart, detail: String },
    /// A host allocation of this many bytes failed.
    OutOfMemory { bytes: usize },
    /// No CUDA device or driver on this machine.
    NoDevice(String),
    /// A CUDA call failed: its numeric code and name.
    Cuda { code: i32, name: String },
    /// The NCCL library is missing, or one of its calls failed: what, and NCCL's own words.
    Nccl { what: String, detail: String },
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::EmptyDimension { operand, dim } => {
                write!(f, "{operand}: dimension {dim} is zero")
            }
            Error::NonUnitHeadDimStride { operand, stride } => {
                write!(f, "{operand}: head_dim stride must be 1, got {stride}")
            }
            Error::ShapeMismatch {
                operand,
                expected,
                found,
            } => write!(f, "{operand}: expected shape {expected:?}, found {found:?}"),
            Error::HeadsNotMultiple { heads_q, heads_kv } => write!(
                f,
                "heads_q ({heads_q}) must be a multiple of heads_kv ({heads_kv})"
            ),
            Error::BufferTooSmall {
                operand,
                needed,
                len,
            } => write!(
                f,
                "{operand}: buffer holds {len} elements, layout needs {needed}"
            ),
            Error::OverlappingOutput { operand, strides } => write!(
                f,
                "{operand}: strides {strides:?} reach some element twice; an output needs one \
                 element per index"
            ),
            Error::IndexOverflow { operand, detail } => {
                write!(f, "{operand}: index overflow: {detail}")
            }
            Error::UnsupportedHeadDim { head_dim, backend } => {
                write!(
                    f,
                    "head_dim {head_dim} is not supported by the {backend} backend"
                )
            }
            Error::UnsupportedDtype { dtype, backend } => {
                write!(
                    f,
                    "dtype {dtype:?} is not supported by the {backend} backend"
                )
            }
            Error::Unsupported { what, backend } => {
                write!(f, "{what} is not supported by the {backend} backend")
            }
            Error::BackendUnavailable { backend, reason } => {
                write!(f, "backend {backend} cannot run here: {reason}")
            }
            Error::InvalidConfig(msg) => write!(f, "invalid configuration: {msg}"),
            Error::InvalidSeqlens(msg) => write!(f, "invalid sequence lengths: {msg}"),
            Error::InvalidPageTable(msg) => write!(f, "invalid page table: {msg}"),
            Error::Misaligned { operand, align } => {
                write!(
                    f,
                    "{operand}: pointer or stride not aligned to {align} bytes"
                )
            }
            Error::WrongDevice { what, detail } => {
                write!(f, "{what} is not on this call's device: {detail}")
            }
            Error::OutOfMemory { bytes } => write!(f, "could not allocate {bytes} bytes"),
            Error::NoDevice(msg) => write!(f, "no CUDA device: {msg}"),
            Error::Cuda { code, name } => write!(f, "CUDA error {code} ({name})"),
            Error::Nccl { what, detail } => write!(f, "NCCL: {what}: {detail}"),
        }
    }
}

impl std::error::Error for Error {}

pub type Result<T> = std::result::Result<T, Error>;
