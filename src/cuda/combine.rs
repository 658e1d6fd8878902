//! Partial attention results merged by their LSE on the device: [`crate::combine`]'s merge, for
//! outputs that live there (a KV cache's key splits run by the caller, a ring's shards).

use std::sync::Arc;

use cudarc::driver::{
    CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceRepr, DeviceSlice,
};

use super::{driver_error, CallPart, Device, DeviceTensor, DeviceTensorMut};
use crate::backend::gpu::{self, RawTensor};
use crate::combine::{self, LseLayout};
use crate::config::Backend;
use crate::error::{Error, Operand, Result};
use crate::ffi;
use crate::tensor::DType;
use crate::Element;

impl Device {
    /// [`crate::combine::combine_into`] on the device, ordered on `stream`: each part an O
    /// `(batch, seqlen_q, heads, head_dim_v)` (f16 or bf16) and its f32 LSE in `lse_layout`,
    /// merged into `out` (O's shape, each element reached once) and `lse` (at least as long as a
    /// part's) in f32 arithmetic (the host merges in f64; the two should agree to within f32
    /// rounding, which tests/gpu_varlen/combine.rs checks on a GPU). At most
    /// `FLASHATTN_MAX_COMBINE_PARTS` (64) parts; pointers and strides 16-byte aligned, as every
    /// GPU entry takes them (`Error::Misaligned`).
    pub fn combine_into<T: Element + DeviceRepr>(
        &self,
        stream: &Arc<CudaStream>,
        parts: &[(DeviceTensor<'_, T>, CudaView<'_, f32>)],
        lse_layout: LseLayout,
        out: &mut DeviceTensorMut<T>,
        lse: &mut CudaViewMut<f32>,
    ) -> Result<()> {
        if !matches!(T::DTYPE, DType::F16 | DType::BF16) {
            return Err(Error::UnsupportedDtype {
                dtype: T::DTYPE,
                backend: Backend::Auto,
            });
        }
        let max_parts = ffi::FLASHATTN_MAX_COMBINE_PARTS as usize;
        let (shape, rows) = combine::check_part_shapes(
            parts.iter().map(|(o, l)| (o.layout, o.data.len(), l.len())),
        )?;
        combine::check_merged((shape, rows), &out.layout, out.data.len(), lse.len())?;
        if parts.len() > max_parts {
            return Err(Error::InvalidConfig(format!(
                "{} parts to combine on the GPU (at most {max_parts})",
                parts.len()
            )));
        }
        let [batch, seqlen_q, heads, head_dim_v] = shape;
        let contexts = parts
            .iter()
            .flat_map(|(o, l)| {
                [
                    (CallPart::from(Operand::Out), o.data.stream().context()),
                    (CallPart::from(Operand::Lse), l.stream().context()),
                ]
            })
            .chain([
                (CallPart::from(Operand::Out), out.data.stream().context()),
                (CallPart::from(Operand::Lse), lse.stream().context()),
            ])
            .collect::<Vec<_>>();
        self.check_same_context(stream, contexts)?;
        // Every count the kernel takes in i32, its elements numbered in i64 (a grid of at most
        // 2^31 − 1 blocks of 256 threads).
        let fits = |n: usize| i32::try_from(n).is_ok();
        let within = rows
            .checked_mul(head_dim_v)
            .is_some_and(|e| e <= (i32::MAX as usize) * 256);
        if !within || !shape.into_iter().all(fits) {
            return Err(Error::IndexOverflow {
                operand: Operand::Out,
                detail: format!("a combine over O {shape:?}"),
            });
        }

        let size = std::mem::size_of::<T>();
        let raw = |ptr, layout| RawTensor { ptr, layout }.aligned_ffi(Operand::Out, size);
        let none = gpu::NO_TENSOR;
        let mut p = ffi::flashattn_combine_t {
            dtype: gpu::ffi_dtype(T::DTYPE),
            parts: parts.len() as i32,
            batch: batch as i32,
            seqlen_q: seqlen_q as i32,
            heads: heads as i32,
            head_dim_v: head_dim_v as i32,
            lse_packed: (lse_layout == LseLayout::Packed) as i32,
            part_o: [none; ffi::FLASHATTN_MAX_COMBINE_PARTS as usize],
            part_lse: [std::ptr::null(); ffi::FLASHATTN_MAX_COMBINE_PARTS as usize],
            o: none,
            lse: std::ptr::null_mut(),
        };
        let mut guards = Vec::with_capacity(parts.len());
        for (k, (o, l)) in parts.iter().enumerate() {
            let (o_ptr, o_guard) = o.data.device_ptr(stream);
            let (l_ptr, l_guard) = l.device_ptr(stream);
            p.part_o[k] = raw(o_ptr, o.layout)?;
            p.part_lse[k] = l_ptr as *const f32;
            guards.push((o_guard, l_guard));
        }
        let (o_ptr, _o) = out.data.device_ptr_mut(stream);
        let (lse_ptr, _lse) = lse.device_ptr_mut(stream);
        p.o = raw(o_ptr, out.layout)?;
        p.lse = lse_ptr as *mut f32;
        self.ctx.bind_to_thread().map_err(driver_error)?;
        // SAFETY: every pointer is a live device buffer of this context whose guard outlives the
        // launch; the layouts were checked against their buffers' lengths and the counts against
        // i32 above (the outputs, borrowed mutably, share no memory with the inputs), and the
        // entry point checks the views again before it launches.
        let r = unsafe { ffi::flashattn_combine(&p, stream.cu_stream() as *mut std::ffi::c_void) };
        ffi::check(r, Backend::Auto, "combine")
    }
}
