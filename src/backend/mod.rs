//! The backends: each takes validated operands and computes; none re-checks shapes.

pub mod cpu;
#[cfg(feature = "cuda")]
pub(crate) mod gpu;
