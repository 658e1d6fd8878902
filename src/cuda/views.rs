//! Views over device memory in the (batch, seqlen, heads, head_dim) layout, and the operand
//! bundles of the forward and backward passes.

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut};

// The errors the docs name.
#[cfg(doc)]
use crate::error::{Error, Operand};
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

/// A forward's keys and values: of Q's element type, or an e4m3 KV cache's with its K and V
/// descales (`[k, v]`, `batch × heads_kv` f32 each, by sequence; `None`: an e4m3 cache read as
/// it is stored, or a 16-bit K and V).
#[derive(Clone, Copy, Debug)]
pub(crate) struct KeysValues<'a, C> {
    pub(crate) k: &'a DeviceTensor<'a, C>,
    pub(crate) v: &'a DeviceTensor<'a, C>,
    pub(crate) e4m3_descales: Option<[&'a CudaView<'a, f32>; 2]>,
}

/// What a device forward pass reads: Q, K, V and, where the model has them, the attention sinks.
#[derive(Clone, Copy, Debug)]
pub struct DeviceForwardInputs<'a, T> {
    pub q: &'a DeviceTensor<'a, T>,
    pub k: &'a DeviceTensor<'a, T>,
    pub v: &'a DeviceTensor<'a, T>,
    /// Attention sinks, where given: one f32 logit per query head (its first heads_q values are
    /// used; a shorter vector is refused with [`Error::BufferTooSmall`] for
    /// [`Operand::Sinks`]), which joins every row's softmax in the units of the scaled (and
    /// capped) scores and takes no value row, so that LSE = log(exp(sink) + Σ exp(s)) and a row
    /// that sees no key gets O = 0 and LSE = sink. The forward adds them in a pass over O and
    /// the LSE after its kernels. The backward of such a forward takes them as
    /// [`DeviceBackwardInputs::sinks`].
    pub sinks: Option<&'a CudaView<'a, f32>>,
}

impl<'a, T> DeviceForwardInputs<'a, T> {
    /// Q, K and V, without sinks.
    pub fn new(
        q: &'a DeviceTensor<'a, T>,
        k: &'a DeviceTensor<'a, T>,
        v: &'a DeviceTensor<'a, T>,
    ) -> Self {
        DeviceForwardInputs {
            q,
            k,
            v,
            sinks: None,
        }
    }

    /// The same inputs with attention sinks ([`DeviceForwardInputs::sinks`]).
    pub fn with_sinks(self, sinks: &'a CudaView<'a, f32>) -> Self {
        DeviceForwardInputs {
            sinks: Some(sinks),
            ..self
        }
    }
}

/// What a device backward pass reads: the forward's inputs, its output and LSE, and dO.
#[derive(Clone, Copy, Debug)]
pub struct DeviceBackwardInputs<'a, T> {
    pub q: &'a DeviceTensor<'a, T>,
    pub k: &'a DeviceTensor<'a, T>,
    pub v: &'a DeviceTensor<'a, T>,
    /// The forward's output O, shaped like Q with V's head dim.
    pub out: &'a DeviceTensor<'a, T>,
    /// The gradient of the loss with respect to O, shaped like O.
    pub dout: &'a DeviceTensor<'a, T>,
    /// The forward's LSE: f32 (batch, heads_q, seqlen_q) packed, natural log.
    pub lse: &'a CudaView<'a, f32>,
    /// The attention sinks the forward took ([`DeviceForwardInputs::sinks`]), where it took
    /// them: at least heads_q values (a shorter vector is refused with
    /// [`Error::BufferTooSmall`] for [`Operand::Sinks`]). dQ, dK and dV need only the LSE,
    /// which holds them; the sinks' gradient ([`DeviceGradientsMut::dsinks`]) is computed from
    /// them.
    pub sinks: Option<&'a CudaView<'a, f32>>,
}

/// Where a device backward pass writes: dQ shaped like Q, dK and dV shaped like K and V, each
/// reaching every element once. `'a` is the borrow of the views, `'v` the views' own lifetime
/// (two, so that a view can be lent to one call and reused by the next).
#[derive(Debug)]
pub struct DeviceGradientsMut<'a, 'v, T> {
    pub dq: &'a mut DeviceTensorMut<'v, T>,
    pub dk: &'a mut DeviceTensorMut<'v, T>,
    pub dv: &'a mut DeviceTensorMut<'v, T>,
    /// Where given, the attention sinks' gradient
    /// d_sink = −Σ_i exp(sink − LSE_i)·Σ_j P_ij·dP_ij over each query head's rows of every batch
    /// entry (of a packed batch: every sequence) into its first heads_q values, summed in a
    /// fixed order (bit-identical run to run). The kernels sum `Σ_j P_ij·dP_ij` from their own P
    /// and dP; with softcap only the Sm80 kernels do (`Auto` takes them for such a call, a
    /// forced [`Backend::Sm90`](crate::Backend::Sm90) refuses it). It needs
    /// [`DeviceBackwardInputs::sinks`] (without them it is refused with
    /// [`Error::InvalidConfig`]) and at least heads_q values (a shorter vector is refused with
    /// [`Error::BufferTooSmall`] for [`Operand::DSinks`]).
    pub dsinks: Option<&'a mut CudaViewMut<'v, f32>>,
}
