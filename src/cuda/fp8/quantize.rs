//! The quantize step: bf16/fp16 Q, K, V (or e4m3 quantized elsewhere, with its descales) into
//! the layouts the FP8 forward reads (see the parent module).

use std::sync::Arc;

use cudarc::driver::DeviceRepr;
use cudarc::driver::{CudaSlice, CudaStream, CudaView, DevicePtr, DevicePtrMut, DeviceSlice};
use float8::F8E4M3;

use super::{blocks, fp8_query_block, Fp8Inputs, Fp8Options};
use crate::backend::gpu::{self, RawTensor};
use crate::config::{AttentionConfig, Backend};
use crate::cuda::{driver_error, Device, DeviceSeqlens, DeviceTensor};
use crate::error::{Error, Operand, Result};
use crate::ffi;
use crate::fp8::RandomSignHadamard;
use crate::tensor::{check_len, DType, Element, Layout, Problem};

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

/// A packed source's sequences as the quantize step takes them: the device address of its
/// `batch + 1` offsets, the sequences' count and the longest one's rows.
#[derive(Clone, Copy)]
struct PackedSource {
    cu_seqlens: u64,
    batch: usize,
    max_seqlen: usize,
}

impl Device {
    /// One tensor through the quantize step into `dst`: rows like the source (packed), or
    /// key-major with `key_major` keys per row; its descales into `descale` when given.
    #[allow(clippy::too_many_arguments)]
    fn quantize_one<T: Element + DeviceRepr>(
        &self,
        stream: &Arc<CudaStream>,
        operand: Operand,
        src: &DeviceTensor<T>,
        packed: Option<PackedSource>,
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
            batch: packed.map_or(batch, |p| p.batch) as i32,
            seqlen: seqlen as i32,
            heads: heads as i32,
            head_dim: d as i32,
            block_rows: block_rows as i32,
            layout: layout as i32,
            hadamard: hadamard.is_some() as i32,
            hadamard_signs: hadamard.map(sign_bits).unwrap_or_default(),
            cu_seqlens: packed.map_or(0, |p| p.cu_seqlens) as *const i32,
            max_seqlen: packed.map_or(0, |p| p.max_seqlen) as i32,
        };
        self.ctx.bind_to_thread().map_err(driver_error)?;
        // SAFETY: src, dst, descale and a packed source's offsets are live device buffers whose
        // guards outlive the launch; src's layout was checked against its length, dst holds
        // batch·heads·d·(keys or seqlen) bytes and descale batch·heads·blocks f32 (`blocks`).
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
        seqs: Option<&DeviceSeqlens>,
        [q, k, v]: [&DeviceTensor<T>; 3],
        hadamard_seed: Option<u64>,
        descales: Option<[&CudaView<f32>; 3]>,
    ) -> Result<Fp8Inputs> {
        // Sources to quantize are bf16 or fp16 (e4m3 ones come with their descales).
        if descales.is_none() && !matches!(T::DTYPE, DType::BF16 | DType::F16) {
            return Err(Error::UnsupportedDtype {
                dtype: T::DTYPE,
                backend: Backend::Sm90,
            });
        }
        self.check_fp8_device()?;
        if let Some(seqs) = seqs {
            self.check_same_context(stream, seqs.contexts())?;
        }
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
        let rows = Problem::from_layouts(&q.layout, &k.layout, &v.layout, DType::E4M3)?;
        if rows.head_dim_v != rows.head_dim {
            return Err(Error::Unsupported {
                what: format!(
                    "the FP8 forward with V's head dim {} apart from Q's {} (not built)",
                    rows.head_dim_v, rows.head_dim
                ),
                backend: Backend::Sm90,
            });
        }
        // The transform is defined at power-of-two lengths: refused at d96 and d192 before
        // anything is allocated or launched.
        if hadamard_seed.is_some() && !rows.head_dim.is_power_of_two() {
            return Err(Error::Unsupported {
                what: format!(
                    "incoherent processing (the random-sign Hadamard transform) at head dim {}: it needs a \
                     power-of-two head dim",
                    rows.head_dim
                ),
                backend: Backend::Sm90,
            });
        }
        rows.check_index_width(&[
            (Operand::Q, &q.layout),
            (Operand::K, &k.layout),
            (Operand::V, &v.layout),
        ])?;
        // The quantize step has no mask: the sequences are checked against the rows alone.
        let problem = match seqs {
            Some(seqs) => seqs.problem(&rows, &AttentionConfig::new())?,
            None => rows,
        };
        // The quantize step runs a CTA per (block, head, batch entry or sequence): grid y and z.
        for (what, n) in [("batch", problem.batch), ("heads_q", problem.heads_q)] {
            if n > 65535 {
                return Err(Error::IndexOverflow {
                    operand: Operand::Q,
                    detail: format!("{what} {n} exceeds the FP8 quantize step's 65535"),
                });
            }
        }
        let b = blocks(&rows, seqs.map(|s| s.batch()))?;
        let hadamard = hadamard_seed
            .map(|seed| RandomSignHadamard::new(problem.head_dim, seed))
            .transpose()?;
        let hadamard = hadamard.as_ref();
        let v_keys = b.kv * b.key_block;
        let err = driver_error;
        let count = |operand, dims: [usize; 4]| Layout::contiguous(dims).numel(operand);
        let q_len = count(Operand::Q, rows.q_shape())?;
        let kv_len = count(Operand::K, rows.kv_shape())?;
        let [batch, heads_q, heads_kv, d] =
            [rows.batch, rows.heads_q, rows.heads_kv, rows.head_dim];
        let v_len = count(Operand::V, [batch, heads_kv, d, v_keys])?;
        let q_desc_len = count(Operand::Q, [batch, heads_q, b.q, 1])?;
        let kv_desc_len = count(Operand::K, [batch, heads_kv, b.kv, 1])?;
        // Given descales are refused before anything is allocated or launched unless each holds
        // exactly its blocks.
        for (operand, given, need) in descales.iter().flat_map(|[qd, kd, vd]| {
            [
                (Operand::Q, qd.len(), q_desc_len),
                (Operand::K, kd.len(), kv_desc_len),
                (Operand::V, vd.len(), kv_desc_len),
            ]
        }) {
            if given != need {
                return Err(Error::BufferTooSmall {
                    operand,
                    needed: need,
                    len: given,
                });
            }
        }
        // Dense: the quantize step writes every element of the data, and every descale when it
        // computes them (given descales are copied in below). Packed: it writes the sequences'
        // rows and blocks only, so the rest (rows and blocks no sequence owns) starts zeroed.
        fn alloc<T: DeviceRepr + cudarc::driver::ValidAsZeroBits>(
            stream: &Arc<CudaStream>,
            n: usize,
            zeroed: bool,
        ) -> Result<CudaSlice<T>> {
            if zeroed {
                stream.alloc_zeros::<T>(n).map_err(driver_error)
            } else {
                // SAFETY: every element is written on the stream before any read (above).
                unsafe { stream.alloc::<T>(n) }.map_err(driver_error)
            }
        }
        let zeroed = seqs.is_some();
        let mut out = Fp8Inputs {
            problem,
            rows,
            q: alloc(stream, q_len, zeroed)?,
            k: alloc(stream, kv_len, zeroed)?,
            v: alloc(stream, v_len, zeroed)?,
            q_descale: alloc(stream, q_desc_len, zeroed)?,
            k_descale: alloc(stream, kv_desc_len, zeroed)?,
            v_descale: alloc(stream, kv_desc_len, zeroed)?,
            v_keys,
        };
        let computed = descales.is_none();
        if let Some([qd, kd, vd]) = descales {
            for (given, need, dst) in [
                (qd, q_desc_len, &mut out.q_descale),
                (kd, kv_desc_len, &mut out.k_descale),
                (vd, kv_desc_len, &mut out.v_descale),
            ] {
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
        // Packed: each tensor's sequences by its own offsets (queries' for Q, keys' for K and V).
        let rows_guards = seqs.map(|s| s.rows(stream, &rows));
        let packed = |keys: bool| {
            rows_guards
                .as_ref()
                .zip(seqs)
                .map(|((r, _), s)| PackedSource {
                    cu_seqlens: if keys { r.cu_seqlens_k } else { r.cu_seqlens_q },
                    batch: s.batch(),
                    max_seqlen: if keys {
                        problem.seqlen_k
                    } else {
                        problem.seqlen_q
                    },
                })
        };
        let fp8_rows = fp8_query_block();
        self.quantize_one(
            stream,
            Operand::Q,
            q,
            packed(false),
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
            packed(true),
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
            packed(true),
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
        self.build_fp8_inputs(stream, None, [q, k, v], options.hadamard_seed, None)
    }

    /// The quantize step over a packed batch on `stream`: bf16 or fp16 Q `(1, total_q, heads_q,
    /// head_dim)`, K and V `(1, total_k, heads_kv, head_dim)` with the sequences of `seqs`, each
    /// sequence in descale blocks of its own (the descales a dense call on its rows gets), for
    /// [`Device::varlen_forward_fp8_into`] with the same `seqs`. A sequence's K and V blocks cover
    /// every key its offsets give it, `seqused_k` or not. Rows and blocks that no sequence owns
    /// are zeros.
    pub fn varlen_quantize_fp8<T: Element + DeviceRepr>(
        &self,
        stream: &Arc<CudaStream>,
        seqs: &DeviceSeqlens,
        q: &DeviceTensor<T>,
        k: &DeviceTensor<T>,
        v: &DeviceTensor<T>,
        options: Fp8Options,
    ) -> Result<Fp8Inputs> {
        self.build_fp8_inputs(stream, Some(seqs), [q, k, v], options.hadamard_seed, None)
    }

    /// Q, K, V quantized elsewhere: e4m3 (batch, seqlen, heads, head_dim) with their descales,
    /// f32 (batch, heads, blocks) packed — Q per [`fp8_query_block`] rows, K and V per
    /// [`fp8_key_block`](super::fp8_key_block) keys — copied on `stream` into the layouts the FP8 forward reads.
    /// Descales must be normal numbers from 2^-126 to 2^126 (the quantize step's are; they are
    /// read on the device only, never synchronized to the host): any other value (zero,
    /// negative, subnormal, larger, not finite) is copied as NaN, so that the rows it touches
    /// are NaN rather than wrong (the forward divides by V's and keeps O in their units).
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
            None,
            [q, k, v],
            None,
            Some([q_descale, k_descale, v_descale]),
        )
    }

    /// [`Device::fp8_inputs_from_e4m3`] over a packed batch, for
    /// [`Device::varlen_forward_fp8_into`] with the same `seqs`: e4m3 Q `(1, total_q, heads_q,
    /// head_dim)`, K and V `(1, total_k, heads_kv, head_dim)` with the sequences of `seqs`, and
    /// their descales in the blocks [`Device::varlen_quantize_fp8`] gives each sequence, copied
    /// on `stream` into the layouts the FP8 forward reads.
    ///
    /// Each descale view is f32 `(1, heads, blocks)` packed, `blocks = total / n + batch`
    /// (`batch`: the sequences): for Q, n = [`fp8_query_block`] rows, `total` = total_q and
    /// `heads` = heads_q; for K and V, n = [`fp8_key_block`](super::fp8_key_block) keys at
    /// head_dim, `total` = total_k and `heads` = heads_kv. Sequence b's block j of head h
    /// (its rows `j·n` up to `(j + 1)·n`, the last block partial) is at index
    /// `h · blocks + start / n + b + j` for `j < ceil(len / n)`, `start` and `len` being its
    /// first row and length (`cu_seqlens_q` for Q, `cu_seqlens_k` for K and V): per head, the
    /// descales a dense [`Device::fp8_inputs_from_e4m3`] on its rows alone takes, in order.
    /// Indices no sequence's blocks take (gaps this numbering leaves, and the blocks past the
    /// last sequence's) are never used: whatever they hold reaches no output. Rows no sequence
    /// owns are not copied (zeros). The layout follows the offsets alone: `seqused_k` neither
    /// moves nor shrinks a sequence's K and V blocks, which cover every key its offsets give it
    /// (the forward reads those of its used keys).
    ///
    /// Descales as [`Device::fp8_inputs_from_e4m3`] takes them (normal numbers from 2^-126 to
    /// 2^126; any other copied as NaN, so that the rows it touches are NaN). A view of another
    /// length than its `heads · blocks` is refused ([`Error::BufferTooSmall`]).
    #[allow(clippy::too_many_arguments)]
    pub fn varlen_fp8_inputs_from_e4m3(
        &self,
        stream: &Arc<CudaStream>,
        seqs: &DeviceSeqlens,
        q: &DeviceTensor<F8E4M3>,
        k: &DeviceTensor<F8E4M3>,
        v: &DeviceTensor<F8E4M3>,
        q_descale: &CudaView<f32>,
        k_descale: &CudaView<f32>,
        v_descale: &CudaView<f32>,
    ) -> Result<Fp8Inputs> {
        self.build_fp8_inputs(
            stream,
            Some(seqs),
            [q, k, v],
            None,
            Some([q_descale, k_descale, v_descale]),
        )
    }
}
