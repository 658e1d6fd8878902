//! Views over device memory in the (batch, seqlen, heads, head_dim) layout, and the operand
//! bundles of the backward pass.

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut};

use crate::tensor::{Layout, Operand4};

/// A read-only device tensor.
#[derive(Debug)]
pub struct DeviceTensor<'a, T> {
    pub data: CudaView<'a, T>,
    pub layout: Layout,
}

/// A writable device tensor.
#[derive(Debug)]
pub struct DeviceTensorMut<'a, T> {
    pub data: CudaViewMut<'a, T>,
    pub layout: Layout,
}

impl<'a, T> DeviceTensor<'a, T> {
    pub fn new(data: CudaView<'a, T>, layout: Layout) -> Self {
        DeviceTensor { data, layout }
    }
    pub(super) fn operand(&self) -> Operand4<'_> {
        (&self.layout, self.data.len())
    }
    pub fn contiguous(data: &'a CudaSlice<T>, shape: [usize; 4]) -> Self {
        Self::new(data.as_view(), Layout::contiguous(shape))
    }
}

impl<'a, T> DeviceTensorMut<'a, T> {
    pub fn new(data: CudaViewMut<'a, T>, layout: Layout) -> Self {
        DeviceTensorMut { data, layout }
    }
    pub(super) fn operand(&self) -> Operand4<'_> {
        (&self.layout, self.data.len())
    }
    pub fn contiguous(data: &'a mut CudaSlice<T>, shape: [usize; 4]) -> Self {
        Self::new(data.as_view_mut(), Layout::contiguous(shape))
    }
}

/// What a device backward pass reads: the forward's inputs, its output and LSE, and dO.
#[derive(Clone, Copy, Debug)]
pub struct DeviceBackwardInputs<'a, T> {
    pub q: &'a DeviceTensor<'a, T>,
    pub k: &'a DeviceTensor<'a, T>,
    pub v: &'a DeviceTensor<'a, T>,
    /// The forward's output O, shaped like Q.
    pub out: &'a DeviceTensor<'a, T>,
    /// The gradient of the loss with respect to O, shaped like Q.
    pub dout: &'a DeviceTensor<'a, T>,
    /// The forward's LSE: f32 (batch, heads_q, seqlen_q) packed, natural log.
    pub lse: &'a CudaView<'a, f32>,
}

/// Where a device backward pass writes: dQ shaped like Q, dK and dV shaped like K and V, each
/// reaching every element once. `'a` is the borrow of the views, `'v` the views' own lifetime
/// (two, so that a view can be lent to one call and reused by the next).
#[derive(Debug)]
pub struct DeviceGradientsMut<'a, 'v, T> {
    pub dq: &'a mut DeviceTensorMut<'v, T>,
    pub dk: &'a mut DeviceTensorMut<'v, T>,
    pub dv: &'a mut DeviceTensorMut<'v, T>,
}
