//! The FP8 (e4m3) forward on the GPU: the quantize step, from bf16/fp16 (or e4m3 quantized
//! elsewhere) into the layouts the kernel reads, and the forward over its output.
//!
//! Q and K are e4m3 rows like their sources; V is key-major — (batch, heads_kv, head_dim, keys),
//! keys padded to whole key blocks and ordered within each 32-key group as the kernel's P, head
//! dims ordered within each group of 32 so that O leaves the kernel by 16-byte stores — since
//! the FP8 tensor-core GEMM reads both operands K-major. Descales: one per
//! [`fp8_query_block`] query rows and per [`fp8_key_block`] keys of one head, chosen as
//! [`crate::fp8::Fp8Tensor::quantize`] chooses them (the GPU step agrees with it bit for bit).
//!
//! Packed (varlen) batches ([`Device::varlen_quantize_fp8`], [`Device::varlen_forward_fp8_into`]):
//! every sequence is quantized in blocks of its own, so that it gets the descales a dense call
//! on its rows would. Per head, sequence b's blocks are numbered from `start / block + b` on
//! (`start`: its first row), `total / block + batch` blocks in all (`total`: the tensors' rows),
//! which leaves room for each sequence's last, partial block: the descales are (heads, blocks)
//! and V's key-major rows hold `blocks · key_block` keys.

use std::sync::Arc;

use cudarc::driver::DeviceRepr;
use cudarc::driver::{
    CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceSlice,
};
use float8::F8E4M3;

mod quantize;

use super::{driver_error, Device, DeviceForwardInputs, DeviceSeqlens, DeviceTensorMut};
use crate::backend::gpu::{self, RawTensor};
use crate::config::{AttentionConfig, Backend};
use crate::dispatch::{Op, Plan};
use crate::error::{Error, Operand, Result};
use crate::ffi;
use crate::tensor::{check_output_len, check_sinks, DType, Element, Layout, Problem};

/// Query rows per Q descale.
pub fn fp8_query_block() -> usize {
    // SAFETY: a constant of the compiled library.
    unsafe { ffi::flashattn_fp8_query_block() as usize }
}

/// Keys per K and V descale (the FP8 forward's key block) at `head_dim`; `None` where the
/// registry has no FP8 kernel (d96 and d192 have a key block also in builds without their
/// features). A property of the library's kernels that may change between versions: descales
/// kept from another version must be made again, by the quantize step or by the host with this
/// value.
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
    /// matrix of this seed ([`RandomSignHadamard`](crate::fp8::RandomSignHadamard)) before rounding.
    pub hadamard_seed: Option<u64>,
}

/// Q, K and V in e4m3 in the FP8 forward's layouts, with their descales, on one device.
#[derive(Debug)]
pub struct Fp8Inputs {
    /// The attention problem: dense, or packed (one entry per sequence, the longest lengths).
    problem: Problem,
    /// The tensors' own (batch-1 for packed inputs) problem.
    rows: Problem,
    q: CudaSlice<F8E4M3>,
    k: CudaSlice<F8E4M3>,
    v: CudaSlice<F8E4M3>,
    q_descale: CudaSlice<f32>,
    k_descale: CudaSlice<f32>,
    v_descale: CudaSlice<f32>,
    /// Keys per V row (seqlen_k rounded up to whole key blocks; packed: the packed blocks').
    v_keys: usize,
}

impl Fp8Inputs {
    /// The attention problem (dtype E4M3); packed inputs: one batch entry per sequence, the
    /// longest sequence's lengths.
    pub fn problem(&self) -> &Problem {
        &self.problem
    }
    /// Descales of Q (batch, heads_q, query blocks), K and V (batch, heads_kv, key blocks);
    /// packed inputs: (heads, packed blocks), see the module docs.
    pub fn descales(&self) -> [&CudaSlice<f32>; 3] {
        [&self.q_descale, &self.k_descale, &self.v_descale]
    }
    /// Q and K as e4m3 (batch, seqlen, heads, head_dim), packed.
    pub fn q_k(&self) -> [&CudaSlice<F8E4M3>; 2] {
        [&self.q, &self.k]
    }
    /// V key-major, (batch, heads_kv, head_dim, keys) packed, with its number of keys per row
    /// (seqlen_k padded with zeros to whole key blocks, or for packed inputs each sequence's;
    /// rows ordered by [`v_row_head_dim`], columns by [`v_key_column`]).
    pub fn v_key_major(&self) -> (&CudaSlice<F8E4M3>, usize) {
        (&self.v, self.v_keys)
    }
}

/// What the FP8 forward reads: Q, K and V quantized, and where the model has them, the
/// attention sinks.
#[derive(Clone, Copy, Debug)]
pub struct Fp8ForwardInputs<'a> {
    /// Q, K and V in e4m3 with their descales.
    pub qkv: &'a Fp8Inputs,
    /// Attention sinks, one f32 logit per query head, as the 16-bit forward takes them
    /// ([`DeviceForwardInputs::sinks`]): added to O (bf16 or fp16) and the LSE in a pass after
    /// the kernel.
    pub sinks: Option<&'a CudaView<'a, f32>>,
}

impl<'a> Fp8ForwardInputs<'a> {
    /// The quantized Q, K and V, without sinks.
    pub fn new(qkv: &'a Fp8Inputs) -> Self {
        Fp8ForwardInputs { qkv, sinks: None }
    }

    /// The same inputs with attention sinks ([`Fp8ForwardInputs::sinks`]).
    pub fn with_sinks(self, sinks: &'a CudaView<'a, f32>) -> Self {
        Fp8ForwardInputs {
            sinks: Some(sinks),
            ..self
        }
    }
}

/// The descale blocks per head and batch entry of the tensors, and the key block (V's keys per
/// row are `kv · key_block`).
struct Blocks {
    q: usize,
    kv: usize,
    key_block: usize,
}

/// The blocks of tensors with `rows`'s problem, dense or (`batch`: the sequences) packed.
fn blocks(rows: &Problem, packed_batch: Option<usize>) -> Result<Blocks> {
    let key_block = fp8_key_block(rows.head_dim).ok_or(Error::UnsupportedHeadDim {
        head_dim: rows.head_dim,
        backend: Backend::Sm90,
    })?;
    let count = |n: usize, block: usize| match packed_batch {
        Some(batch) => n / block + batch,
        None => n.div_ceil(block),
    };
    Ok(Blocks {
        q: count(rows.seqlen_q, fp8_query_block()),
        kv: count(rows.seqlen_k, key_block),
        key_block,
    })
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

    /// The FP8 forward on `stream` into caller-owned outputs: O in bf16 or fp16 (batch,
    /// seqlen_q, heads_q, head_dim) and the LSE, f32 (batch, heads_q, seqlen_q) packed.
    pub fn forward_fp8_into<O: Element + DeviceRepr>(
        &self,
        stream: &Arc<CudaStream>,
        cfg: &AttentionConfig,
        inputs: Fp8ForwardInputs<'_>,
        out: &mut DeviceTensorMut<O>,
        lse: &mut CudaViewMut<f32>,
    ) -> Result<Plan> {
        self.fp8_forward_launch(stream, cfg, None, inputs, out, lse)
    }

    /// The FP8 forward over a packed batch on `stream`: `inputs` from
    /// [`Device::varlen_quantize_fp8`] with the same `seqs`, O `(1, total_q, heads_q, head_dim)`
    /// in bf16 or fp16, `lse` f32 `(heads_q, total_q)`, as in [`Device::varlen_forward_into`].
    /// The offsets are not read on the host: other values than the quantize step's give wrong
    /// rows, never an access outside a buffer.
    pub fn varlen_forward_fp8_into<O: Element + DeviceRepr>(
        &self,
        stream: &Arc<CudaStream>,
        cfg: &AttentionConfig,
        seqs: &DeviceSeqlens,
        inputs: Fp8ForwardInputs<'_>,
        out: &mut DeviceTensorMut<O>,
        lse: &mut CudaViewMut<f32>,
    ) -> Result<Plan> {
        self.fp8_forward_launch(stream, cfg, Some(seqs), inputs, out, lse)
    }

    fn fp8_forward_launch<O: Element + DeviceRepr>(
        &self,
        stream: &Arc<CudaStream>,
        cfg: &AttentionConfig,
        seqs: Option<&DeviceSeqlens>,
        inputs: Fp8ForwardInputs<'_>,
        out: &mut DeviceTensorMut<O>,
        lse: &mut CudaViewMut<f32>,
    ) -> Result<Plan> {
        let Fp8ForwardInputs { qkv: inputs, sinks } = inputs;
        self.check_fp8_device()?;
        // The sequences must be those the inputs were quantized with, as far as the host sees.
        let problem = inputs.problem;
        match seqs {
            Some(seqs) => {
                let called = seqs.problem(&inputs.rows, cfg)?;
                if called != problem {
                    let quantized = if problem.packed {
                        format!(
                            "{} sequences of up to {}x{} rows",
                            problem.batch, problem.seqlen_q, problem.seqlen_k
                        )
                    } else {
                        "a dense call (quantize_fp8)".into()
                    };
                    return Err(Error::InvalidSeqlens(format!(
                        "{} sequences of up to {}x{} rows, the FP8 inputs were quantized for \
                         {quantized}",
                        called.batch, called.seqlen_q, called.seqlen_k
                    )));
                }
                self.check_same_context(stream, seqs.contexts())?;
            }
            None if problem.packed => {
                return Err(Error::InvalidSeqlens(
                    "FP8 inputs of packed sequences need them (varlen_forward_fp8_into)".into(),
                ))
            }
            None => {}
        }
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
        if let Some(sinks) = sinks {
            self.check_same_context(stream, [(Operand::Sinks, sinks.stream().context())])?;
        }
        let rows = inputs.rows;
        check_output_len(Operand::Out, &out.layout, out.data.len())?;
        Problem::expect_shape(Operand::Out, &out.layout, rows.q_shape())?;
        rows.check_lse_len(lse.len())?;
        rows.check_index_width(&[(Operand::Out, &out.layout)])?;
        check_sinks(&problem, sinks.map(|s| s.len()), None)?;
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
        let (sinks_ptr, _g9) = sinks.map(|s| s.device_ptr(stream)).unzip();
        let o = RawTensor {
            ptr: o_ptr,
            layout: out.layout,
        };
        gpu::check_alignment(Operand::Out, &o, std::mem::size_of::<O>())?;
        let keys = inputs.v_keys;
        // V key-major: (batch, heads_kv, d, keys) as (batch_stride, row_stride between d rows,
        // head_stride) in the C ABI's tensor.
        let v_layout = Layout::with_strides(
            [rows.batch, d, rows.heads_kv, keys],
            [rows.heads_kv * d * keys, keys, d * keys, 1],
        );
        let (packed, _seqs_guards) = seqs.map(|s| s.rows(stream, &rows)).unzip();
        self.ctx.bind_to_thread().map_err(driver_error)?;
        gpu::forward_fp8(
            &problem,
            packed.as_ref(),
            cfg,
            self.info.sm_count,
            gpu::Fp8Operands {
                q: RawTensor {
                    ptr: q_ptr,
                    layout: Layout::contiguous(rows.q_shape()),
                },
                k: RawTensor {
                    ptr: k_ptr,
                    layout: Layout::contiguous(rows.kv_shape()),
                },
                v: RawTensor {
                    ptr: v_ptr,
                    layout: v_layout,
                },
                o,
                out_dtype: O::DTYPE,
                lse: lse_ptr,
                descales: [qd_ptr, kd_ptr, vd_ptr],
                sinks: sinks_ptr.unwrap_or(0),
            },
            stream.cu_stream() as *mut std::ffi::c_void,
        )?;
        Ok(plan)
    }

    /// Quantize (per-block descales, optionally with incoherent processing) and the FP8 forward
    /// in one call on `stream`; O in the inputs' type. The quantized inputs are freed in stream
    /// order; keep them with [`Device::quantize_fp8`] to reuse K and V. `inputs.sinks`, where
    /// given, as in [`Fp8ForwardInputs::sinks`].
    pub fn forward_fp8<T: Element + DeviceRepr>(
        &self,
        stream: &Arc<CudaStream>,
        cfg: &AttentionConfig,
        inputs: DeviceForwardInputs<'_, T>,
        out: &mut DeviceTensorMut<T>,
        lse: &mut CudaViewMut<f32>,
        options: Fp8Options,
    ) -> Result<Plan> {
        let DeviceForwardInputs { q, k, v, sinks } = inputs;
        let qkv = self.quantize_fp8(stream, q, k, v, options)?;
        let inputs = Fp8ForwardInputs { qkv: &qkv, sinks };
        self.forward_fp8_into(stream, cfg, inputs, out, lse)
    }

    /// [`Device::varlen_quantize_fp8`] and [`Device::varlen_forward_fp8_into`] in one call on
    /// `stream`; O in the inputs' type.
    #[allow(clippy::too_many_arguments)]
    pub fn varlen_forward_fp8<T: Element + DeviceRepr>(
        &self,
        stream: &Arc<CudaStream>,
        cfg: &AttentionConfig,
        seqs: &DeviceSeqlens,
        inputs: DeviceForwardInputs<'_, T>,
        out: &mut DeviceTensorMut<T>,
        lse: &mut CudaViewMut<f32>,
        options: Fp8Options,
    ) -> Result<Plan> {
        let DeviceForwardInputs { q, k, v, sinks } = inputs;
        let qkv = self.varlen_quantize_fp8(stream, seqs, q, k, v, options)?;
        let inputs = Fp8ForwardInputs { qkv: &qkv, sinks };
        self.varlen_forward_fp8_into(stream, cfg, seqs, inputs, out, lse)
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
