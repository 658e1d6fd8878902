//! The FP8 (e4m3) forward on the GPU: the quantize step, from bf16/fp16 (or e4m3 quantized
//! elsewhere) into the layouts the kernel reads, and the forward over its output.
//!
//! Q and K are e4m3 rows like their sources; V is key-major — (batch, heads_kv, head_dim, keys),
//! keys padded to whole key blocks and ordered within each 32-key group as the kernel's P, head
//! dims ordered within each group of 32 so that O leaves the kernel by 16-byte stores — since
//! the FP8 tensor-core GEMM reads both operands K-major. Descales: one per
//! [`fp8_query_block`] query rows and per [`fp8_key_block`] keys of one head, chosen as
//! [`crate::fp8::Fp8Tensor::quantize`] chooses them (the GPU step agrees with it bit for bit).

use std::sync::Arc;

use cudarc::driver::DeviceRepr;
use cudarc::driver::{
    CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceSlice,
};
use float8::F8E4M3;

use super::{driver_error, Device, DeviceTensor, DeviceTensorMut};
use crate::backend::gpu::{self, RawTensor};
use crate::config::{AttentionConfig, Backend};
use crate::dispatch::{Op, Plan};
use crate::error::{Error, Operand, Result};
use crate::ffi;
use crate::fp8::RandomSignHadamard;
use crate::tensor::{check_len, check_output_len, DType, Element, Layout, Problem};

/// Query rows per Q descale.
pub fn fp8_query_block() -> usize {
    // SAFETY: a constant of the compiled library.
    unsafe { ffi::flashattn_fp8_query_block() as usize }
}

/// Keys per K and V descale (the FP8 forward's key block) at `head_dim`; `None` where no FP8
/// kernel is built.
pub fn fp8_key_block(head_dim: usize) -> Option<usize> {
    let d = i32::try_from(head_dim).ok()?;
    // SAFETY: a pure function of the compiled library.
    let n = unsafe { ffi::flashattn_fp8_key_block(d) };
    (n > 0).then_some(n as usize)
}

/// The column of `key` in V's key-major rows (csrc/sm90/fp8_layout.h): within each 32-key
/// group, key 16h + 8a + 2t + c (a, c < 2, t < 4) sits at 16h + 4t + 2a + c, the order in which
/// the kernel's P holds its keys.
pub fn v_key_column(key: usize) -> usize {
    let j = key % 32;
    key - j + 16 * (j / 16) + 4 * ((j / 2) % 4) + 2 * ((j / 8) % 2) + j % 2
}

/// The head-dim index that row `row` of V's key-major layout holds (csrc/sm90/fp8_v_rows.h; its
/// own inverse): within each group of 32, row 8i + 2t + c (i, t < 4, c < 2) holds head dim
/// 8t + 2i + c, so that each lane of the kernel's accumulator quads holds 8 consecutive head dims
/// of O.
pub fn v_row_head_dim(row: usize) -> usize {
    let j = row % 32;
    row - j + 8 * ((j / 2) % 4) + 2 * (j / 8) + j % 2
}

/// How the FP8 inputs are quantized.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Fp8Options {
    /// Incoherent processing: Q and K multiplied along head_dim by the random-sign Hadamard
    /// matrix of this seed ([`RandomSignHadamard`]) before rounding.
    pub hadamard_seed: Option<u64>,
}

/// Q, K and V in e4m3 in the FP8 forward's layouts, with their descales, on one device.
#[derive(Debug)]
pub struct Fp8Inputs {
    problem: Problem,
    q: CudaSlice<F8E4M3>,
    k: CudaSlice<F8E4M3>,
    v: CudaSlice<F8E4M3>,
    q_descale: CudaSlice<f32>,
    k_descale: CudaSlice<f32>,
    v_descale: CudaSlice<f32>,
    /// Keys per V row (seqlen_k rounded up to whole key blocks).
    v_keys: usize,
}

impl Fp8Inputs {
    /// The attention problem (dtype E4M3).
    pub fn problem(&self) -> &Problem {
        &self.problem
    }
    /// Descales of Q (batch, heads_q, query blocks), K and V (batch, heads_kv, key blocks).
    pub fn descales(&self) -> [&CudaSlice<f32>; 3] {
        [&self.q_descale, &self.k_descale, &self.v_descale]
    }
    /// Q and K as e4m3 (batch, seqlen, heads, head_dim), packed.
    pub fn q_k(&self) -> [&CudaSlice<F8E4M3>; 2] {
        [&self.q, &self.k]
    }
    /// V key-major, (batch, heads_kv, head_dim, keys) packed, with its number of keys per row
    /// (seqlen_k padded with zeros to whole key blocks; rows ordered by [`v_row_head_dim`],
    /// columns by [`v_key_column`]).
    pub fn v_key_major(&self) -> (&CudaSlice<F8E4M3>, usize) {
        (&self.v, self.v_keys)
    }
}

/// The problem's block counts and the key-block padding of V.
struct Blocks {
    q: usize,
    kv: usize,
    key_block: usize,
}

fn blocks(problem: &Problem) -> Result<Blocks> {
    let key_block = fp8_key_block(problem.head_dim).ok_or(Error::UnsupportedHeadDim {
        head_dim: problem.head_dim,
        backend: Backend::Sm90,
    })?;
    Ok(Blocks {
        q: problem.seqlen_q.div_ceil(fp8_query_block()),
        kv: problem.seqlen_k.div_ceil(key_block),
        key_block,
    })
}

/// The Hadamard signs as the C ABI takes them: bit i set for a negated column i.
fn sign_bits(hadamard: &RandomSignHadamard) -> [u64; 4] {
    let mut bits = [0u64; 4];
    for (i, &s) in hadamard.signs().iter().enumerate() {
        if s < 0.0 {
            bits[i / 64] |= 1 << (i % 64);
        }
    }
    bits
}

impl Device {
    fn check_fp8_device(&self) -> Result<()> {
        let family = crate::registry::Family::Sm90Fp8Fwd;
        if !crate::registry::KERNELS
            .iter()
            .any(|k| k.family == family && k.built())
        {
            return Err(Error::Unsupported {
                what: format!(
                    "the FP8 forward (not in this build: it needs the Cargo features cuda, {} and \
                     a head dim's)",
                    family.features().join(", ")
                ),
                backend: Backend::Sm90,
            });
        }
        if self.info.compute_capability() != (9, 0) {
            return Err(Error::BackendUnavailable {
                backend: Backend::Sm90,
                reason: format!(
                    "the FP8 forward runs on compute capability 9.0 (device {} is {}.{})",
                    self.info.name, self.info.major, self.info.minor
                ),
            });
        }
        Ok(())
    }

    /// One tensor through the quantize step into `dst`: rows like the source (packed), or
    /// key-major with `key_major` keys per row; its descales into `descale` when given.
    #[allow(clippy::too_many_arguments)]
    fn quantize_one<T: Element + DeviceRepr>(
        &self,
        stream: &Arc<CudaStream>,
        operand: Operand,
        src: &DeviceTensor<T>,
        key_major: Option<usize>,
        block_rows: usize,
        hadamard: Option<&RandomSignHadamard>,
        dst: &mut CudaSlice<F8E4M3>,
        descale: Option<&mut CudaSlice<f32>>,
    ) -> Result<()> {
        let [batch, seqlen, heads, d] = src.layout.shape;
        let (src_ptr, _src_guard) = src.data.device_ptr(stream);
        gpu::check_alignment(
            operand,
            &RawTensor {
                ptr: src_ptr,
                layout: src.layout,
            },
            std::mem::size_of::<T>(),
        )?;
        let (dst_ptr, _dst_guard) = dst.device_ptr_mut(stream);
        let (desc_ptr, _desc_guard) = match descale {
            Some(s) => {
                let (p, g) = s.device_ptr_mut(stream);
                (p, Some(g))
            }
            None => (0, None),
        };
        // Rows: packed (batch, seqlen, heads, d). Key-major: (batch, heads, d, keys).
        let (bs, rs, hs, layout) = match key_major {
            None => (seqlen * heads * d, heads * d, d, ffi::FLASHATTN_FP8_ROWS),
            Some(keys) => (
                heads * d * keys,
                keys,
                d * keys,
                ffi::FLASHATTN_FP8_KEY_MAJOR,
            ),
        };
        let p = ffi::flashattn_fp8_quantize_t {
            src: RawTensor {
                ptr: src_ptr,
                layout: src.layout,
            }
            .to_ffi(),
            src_dtype: gpu::ffi_dtype(T::DTYPE),
            dst: dst_ptr as *mut std::ffi::c_void,
            dst_batch_stride: bs as i64,
            dst_row_stride: rs as i64,
            dst_head_stride: hs as i64,
            descale: desc_ptr as *mut f32,
            batch: batch as i32,
            seqlen: seqlen as i32,
            heads: heads as i32,
            head_dim: d as i32,
            block_rows: block_rows as i32,
            layout: layout as i32,
            hadamard: hadamard.is_some() as i32,
            hadamard_signs: hadamard.map(sign_bits).unwrap_or_default(),
        };
        self.ctx.bind_to_thread().map_err(driver_error)?;
        // SAFETY: src, dst and descale are live device buffers whose guards outlive the launch;
        // src's layout was checked against its length, dst holds batch·heads·d·(keys or seqlen)
        // bytes and descale batch·heads·ceil(seqlen / block_rows) f32.
        let r =
            unsafe { ffi::flashattn_fp8_quantize(&p, stream.cu_stream() as *mut std::ffi::c_void) };
        ffi::check(r, Backend::Sm90, "FP8 quantize")
    }

    /// Allocates the quantized tensors and runs the quantize step over Q, K and V (after the
    /// random-sign Hadamard transform of `hadamard_seed`, if any); `descales` given means the
    /// sources are e4m3 already (copied with those descales).
    fn build_fp8_inputs<T: Element + DeviceRepr>(
        &self,
        stream: &Arc<CudaStream>,
        [q, k, v]: [&DeviceTensor<T>; 3],
        hadamard_seed: Option<u64>,
        descales: Option<[&CudaView<f32>; 3]>,
    ) -> Result<Fp8Inputs> {
        self.check_fp8_device()?;
        let descale_contexts = descales.iter().flat_map(|[qd, kd, vd]| {
            [
                (Operand::Q, qd.stream().context()),
                (Operand::K, kd.stream().context()),
                (Operand::V, vd.stream().context()),
            ]
        });
        self.check_same_context(
            stream,
            [
                (Operand::Q, q.data.stream().context()),
                (Operand::K, k.data.stream().context()),
                (Operand::V, v.data.stream().context()),
            ]
            .into_iter()
            .chain(descale_contexts),
        )?;
        check_len(Operand::Q, &q.layout, q.data.len())?;
        check_len(Operand::K, &k.layout, k.data.len())?;
        check_len(Operand::V, &v.layout, v.data.len())?;
        let problem = Problem::from_layouts(&q.layout, &k.layout, &v.layout, DType::E4M3)?;
        problem.check_index_width(&[
            (Operand::Q, &q.layout),
            (Operand::K, &k.layout),
            (Operand::V, &v.layout),
        ])?;
        // The quantize step runs a CTA per (block, head, batch entry): grid y and z.
        for (what, n) in [("batch", problem.batch), ("heads_q", problem.heads_q)] {
            if n > 65535 {
                return Err(Error::IndexOverflow {
                    operand: Operand::Q,
                    detail: format!("{what} {n} exceeds the FP8 quantize step's 65535"),
                });
            }
        }
        let b = blocks(&problem)?;
        let hadamard = hadamard_seed
            .map(|seed| RandomSignHadamard::new(problem.head_dim, seed))
            .transpose()?;
        let hadamard = hadamard.as_ref();
        let v_keys = b.kv * b.key_block;
        let err = driver_error;
        let count = |operand, dims: [usize; 4]| Layout::contiguous(dims).numel(operand);
        let q_len = count(Operand::Q, problem.q_shape())?;
        let kv_len = count(Operand::K, problem.kv_shape())?;
        let [batch, heads_q, heads_kv, d] = [
            problem.batch,
            problem.heads_q,
            problem.heads_kv,
            problem.head_dim,
        ];
        let v_len = count(Operand::V, [batch, heads_kv, d, v_keys])?;
        let q_desc_len = count(Operand::Q, [batch, heads_q, b.q, 1])?;
        let kv_desc_len = count(Operand::K, [batch, heads_kv, b.kv, 1])?;
        // SAFETY (the four allocations): the quantize step writes every element of the data,
        // and every descale when it computes them; given descales are copied in below.
        let mut out = Fp8Inputs {
            problem,
            q: unsafe { stream.alloc::<F8E4M3>(q_len) }.map_err(err)?,
            k: unsafe { stream.alloc::<F8E4M3>(kv_len) }.map_err(err)?,
            v: unsafe { stream.alloc::<F8E4M3>(v_len) }.map_err(err)?,
            q_descale: unsafe { stream.alloc::<f32>(q_desc_len) }.map_err(err)?,
            k_descale: unsafe { stream.alloc::<f32>(kv_desc_len) }.map_err(err)?,
            v_descale: unsafe { stream.alloc::<f32>(kv_desc_len) }.map_err(err)?,
            v_keys,
        };
        let computed = descales.is_none();
        if let Some([qd, kd, vd]) = descales {
            for (operand, given, need, dst) in [
                (Operand::Q, qd, q_desc_len, &mut out.q_descale),
                (Operand::K, kd, kv_desc_len, &mut out.k_descale),
                (Operand::V, vd, kv_desc_len, &mut out.v_descale),
            ] {
                if given.len() != need {
                    return Err(Error::BufferTooSmall {
                        operand,
                        needed: need,
                        len: given.len(),
                    });
                }
                let (src_ptr, _src_guard) = given.device_ptr(stream);
                let (dst_ptr, _dst_guard) = dst.device_ptr_mut(stream);
                self.ctx.bind_to_thread().map_err(err)?;
                // SAFETY: both are live device buffers of `need` f32 on this context, their
                // guards outlive the launch; the C side checks the count and alignment again.
                let r = unsafe {
                    ffi::flashattn_fp8_sanitize_descales(
                        src_ptr as *const f32,
                        dst_ptr as *mut f32,
                        need as i64,
                        stream.cu_stream() as *mut std::ffi::c_void,
                    )
                };
                ffi::check(r, Backend::Sm90, "FP8 descale copy")?;
            }
        }
        let fp8_rows = fp8_query_block();
        self.quantize_one(
            stream,
            Operand::Q,
            q,
            None,
            fp8_rows,
            hadamard,
            &mut out.q,
            computed.then_some(&mut out.q_descale),
        )?;
        self.quantize_one(
            stream,
            Operand::K,
            k,
            None,
            b.key_block,
            hadamard,
            &mut out.k,
            computed.then_some(&mut out.k_descale),
        )?;
        self.quantize_one(
            stream,
            Operand::V,
            v,
            Some(v_keys),
            b.key_block,
            None,
            &mut out.v,
            computed.then_some(&mut out.v_descale),
        )?;
        Ok(out)
    }

    /// The quantize step on `stream`: bf16 or fp16 Q, K, V (batch, seqlen, heads, head_dim) to
    /// e4m3 with one descale per block (optionally after the random-sign Hadamard transform of
    /// Q and K), in the layouts the FP8 forward reads.
    pub fn quantize_fp8<T: Element + DeviceRepr>(
        &self,
        stream: &Arc<CudaStream>,
        q: &DeviceTensor<T>,
        k: &DeviceTensor<T>,
        v: &DeviceTensor<T>,
        options: Fp8Options,
    ) -> Result<Fp8Inputs> {
        if !matches!(T::DTYPE, DType::BF16 | DType::F16) {
            return Err(Error::UnsupportedDtype {
                dtype: T::DTYPE,
                backend: Backend::Sm90,
            });
        }
        self.build_fp8_inputs(stream, [q, k, v], options.hadamard_seed, None)
    }

    /// Q, K, V quantized elsewhere: e4m3 (batch, seqlen, heads, head_dim) with their descales,
    /// f32 (batch, heads, blocks) packed — Q per [`fp8_query_block`] rows, K and V per
    /// [`fp8_key_block`] keys — copied on `stream` into the layouts the FP8 forward reads.
    /// Descales must be finite and > 0 (they are read on the device only, never synchronized
    /// to the host): any other value is copied as NaN, so that the rows it touches are NaN.
    #[allow(clippy::too_many_arguments)]
    pub fn fp8_inputs_from_e4m3(
        &self,
        stream: &Arc<CudaStream>,
        q: &DeviceTensor<F8E4M3>,
        k: &DeviceTensor<F8E4M3>,
        v: &DeviceTensor<F8E4M3>,
        q_descale: &CudaView<f32>,
        k_descale: &CudaView<f32>,
        v_descale: &CudaView<f32>,
    ) -> Result<Fp8Inputs> {
        self.build_fp8_inputs(
            stream,
            [q, k, v],
            None,
            Some([q_descale, k_descale, v_descale]),
        )
    }

    /// The FP8 forward on `stream` into caller-owned outputs: O in bf16 or fp16 (batch,
    /// seqlen_q, heads_q, head_dim) and the LSE, f32 (batch, heads_q, seqlen_q) packed.
    pub fn forward_fp8_into<O: Element + DeviceRepr>(
        &self,
        stream: &Arc<CudaStream>,
        cfg: &AttentionConfig,
        inputs: &Fp8Inputs,
        out: &mut DeviceTensorMut<O>,
        lse: &mut CudaViewMut<f32>,
    ) -> Result<Plan> {
        self.check_fp8_device()?;
        if !matches!(O::DTYPE, DType::BF16 | DType::F16) {
            return Err(Error::UnsupportedDtype {
                dtype: O::DTYPE,
                backend: Backend::Sm90,
            });
        }
        self.check_same_context(
            stream,
            [
                (Operand::Q, inputs.q.context()),
                (Operand::K, inputs.k.context()),
                (Operand::V, inputs.v.context()),
                (Operand::Out, out.data.stream().context()),
                (Operand::Lse, lse.stream().context()),
            ],
        )?;
        let problem = inputs.problem;
        check_output_len(Operand::Out, &out.layout, out.data.len())?;
        Problem::expect_shape(Operand::Out, &out.layout, problem.q_shape())?;
        problem.check_lse_len(lse.len())?;
        problem.check_index_width(&[(Operand::Out, &out.layout)])?;
        // The dispatcher takes E4M3 on Sm90's forward only (dispatch::check_backend).
        let plan = self.plan(Op::Forward, &problem, cfg)?;
        let d = problem.head_dim;
        let (q_ptr, _g1) = inputs.q.device_ptr(stream);
        let (k_ptr, _g2) = inputs.k.device_ptr(stream);
        let (v_ptr, _g3) = inputs.v.device_ptr(stream);
        let (qd_ptr, _g4) = inputs.q_descale.device_ptr(stream);
        let (kd_ptr, _g5) = inputs.k_descale.device_ptr(stream);
        let (vd_ptr, _g6) = inputs.v_descale.device_ptr(stream);
        let (o_ptr, _g7) = out.data.device_ptr_mut(stream);
        let (lse_ptr, _g8) = lse.device_ptr_mut(stream);
        let o = RawTensor {
            ptr: o_ptr,
            layout: out.layout,
        };
        gpu::check_alignment(Operand::Out, &o, std::mem::size_of::<O>())?;
        let keys = inputs.v_keys;
        // V key-major: (batch, heads_kv, d, keys) as (batch_stride, row_stride between d rows,
        // head_stride) in the C ABI's tensor.
        let v_layout = Layout::with_strides(
            [problem.batch, d, problem.heads_kv, keys],
            [problem.heads_kv * d * keys, keys, d * keys, 1],
        );
        self.ctx.bind_to_thread().map_err(driver_error)?;
        gpu::forward_fp8(
            &problem,
            cfg,
            self.info.sm_count,
            gpu::Fp8Operands {
                q: RawTensor {
                    ptr: q_ptr,
                    layout: Layout::contiguous(problem.q_shape()),
                },
                k: RawTensor {
                    ptr: k_ptr,
                    layout: Layout::contiguous(problem.kv_shape()),
                },
                v: RawTensor {
                    ptr: v_ptr,
                    layout: v_layout,
                },
                o,
                out_dtype: O::DTYPE,
                lse: lse_ptr,
                descales: [qd_ptr, kd_ptr, vd_ptr],
            },
            stream.cu_stream() as *mut std::ffi::c_void,
        )?;
        Ok(plan)
    }

    /// Quantize (per-block descales, optionally with incoherent processing) and the FP8 forward
    /// in one call on `stream`; O in the inputs' type. The quantized inputs are freed in stream
    /// order; keep them with [`Device::quantize_fp8`] to reuse K and V.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_fp8<T: Element + DeviceRepr>(
        &self,
        stream: &Arc<CudaStream>,
        cfg: &AttentionConfig,
        q: &DeviceTensor<T>,
        k: &DeviceTensor<T>,
        v: &DeviceTensor<T>,
        out: &mut DeviceTensorMut<T>,
        lse: &mut CudaViewMut<f32>,
        options: Fp8Options,
    ) -> Result<Plan> {
        let inputs = self.quantize_fp8(stream, q, k, v, options)?;
        self.forward_fp8_into(stream, cfg, &inputs, out, lse)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v_rows_give_each_lane_whole_16_byte_chunks_of_o() {
        for row in 0..256 {
            assert_eq!(v_row_head_dim(v_row_head_dim(row)), row, "its own inverse");
            assert_eq!(v_row_head_dim(row) / 32, row / 32, "within its group of 32");
        }
        // Lane t of a quad holds accumulator columns 8j + 2t + c; groups 4g .. 4g + 3 must be
        // head dims 32g + 8t .. 32g + 8t + 7 in order.
        for g in 0..8 {
            for t in 0..4 {
                let dims: Vec<usize> = (0..4)
                    .flat_map(|i| (0..2).map(move |c| v_row_head_dim(8 * (4 * g + i) + 2 * t + c)))
                    .collect();
                assert_eq!(
                    dims,
                    (32 * g + 8 * t..32 * g + 8 * t + 8).collect::<Vec<_>>()
                );
            }
        }
    }
}
