//! Packed (variable-length) batches on the GPU: the sequence offsets as device arrays, and the
//! forward and backward over them ([`crate::varlen`] has the layout and the CPU calls).

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream, CudaView, CudaViewMut, DevicePtr, DeviceRepr};
use cudarc::driver::{DeviceSlice, SyncOnDrop};

use super::{
    Device, DeviceBackwardInputs, DeviceForwardInputs, DeviceGradientsMut, DeviceTensorMut,
};
use crate::backend::gpu::{CacheTiles, PackedRows, PagedKeys};
use crate::config::AttentionConfig;
use crate::dispatch::{self, Plan};
use crate::error::{CallPart, Error, Operand, Result};
use crate::tensor::{check_forward, check_len, DType, Element, Layout, Operand4, Problem};

/// The sequence boundaries of a packed batch in device memory: `batch + 1` i32 offsets for
/// queries and for keys (from 0, non-decreasing, the last one the tensors' row count), the
/// bounds on every sequence's lengths, and optionally the keys each sequence uses.
///
/// The offsets stay on the device: checking their values would synchronize the stream, so only
/// their counts are checked here. The kernels clamp every sequence into the tensors (start into
/// `0..=rows`, end into `start..=rows`, lengths to the maxima given here, `seqused_k` into
/// `0..=length`): offsets that describe no packing give unspecified values in the rows they
/// name, never an access outside a buffer, and rows that no sequence names are not written.
#[derive(Debug)]
pub struct DeviceSeqlens<'a> {
    cu_q: CudaView<'a, i32>,
    keys: Keys<'a>,
    used_k: Option<CudaView<'a, i32>>,
    max_q: usize,
    max_k: usize,
    /// The forward's LSE by sequence, `(batch, heads_q, max_seqlen_q)` (a KV cache's), instead
    /// of over the packed rows.
    lse_by_sequence: bool,
    /// A KV-cache call's tiles on the Hopper forward.
    cache_tiles: CacheTiles,
}

/// Where a packed call's keys lie: rows of K and V named by offsets, or a paged KV cache's pages.
#[derive(Debug)]
enum Keys<'a> {
    Rows(CudaView<'a, i32>),
    Pages(DevicePages<'a>),
}

/// A paged KV cache on the device (the C ABI's page table): K and V `num_pages` pages of
/// `page_size` rows, and `table` `(batch, pages_per_seq)` i32 page numbers (row stride
/// `pages_per_seq`), each sequence's keys `pages_per_seq · page_size` rows.
#[derive(Debug)]
pub(crate) struct DevicePages<'a> {
    pub table: CudaView<'a, i32>,
    pub pages_per_seq: usize,
    pub page_size: usize,
    pub num_pages: usize,
}

impl DevicePages<'_> {
    /// The keys each sequence's row of the table addresses.
    fn capacity(&self) -> usize {
        self.pages_per_seq * self.page_size
    }

    /// [`check_forward`] for packed Q and O over K and V in pages: the pages within their
    /// buffers and of this cache's shape, then the call as if each sequence's keys were rows.
    fn check_forward(
        &self,
        dtype: DType,
        [q, k, v]: [Operand4<'_>; 3],
        out: Operand4<'_>,
        lse_len: usize,
    ) -> Result<Problem> {
        check_len(Operand::K, k.0, k.1)?;
        check_len(Operand::V, v.0, v.1)?;
        let [pages, page_size, heads_kv, d] = k.0.shape;
        if pages != self.num_pages || page_size != self.page_size {
            return Err(Error::ShapeMismatch {
                operand: Operand::K,
                expected: [self.num_pages, self.page_size, heads_kv, d],
                found: k.0.shape,
            });
        }
        if v.0.shape[..3] != k.0.shape[..3] {
            return Err(Error::ShapeMismatch {
                operand: Operand::V,
                expected: [pages, page_size, heads_kv, v.0.shape[3]],
                found: v.0.shape,
            });
        }
        // Only their shapes: the pages' spans were checked above.
        let rows = |l: &Layout| Layout::contiguous([1, self.capacity(), l.shape[2], l.shape[3]]);
        let (k_rows, v_rows) = (rows(k.0), rows(v.0));
        check_forward(
            dtype,
            [q, (&k_rows, usize::MAX), (&v_rows, usize::MAX)],
            out,
            lse_len,
        )
    }
}

impl<'a> DeviceSeqlens<'a> {
    /// `cu_seqlens_q` and `cu_seqlens_k`: `batch + 1` offsets each (at least one sequence);
    /// `max_seqlen_q` and `max_seqlen_k`: at least 1, at least every sequence's lengths (the
    /// grids are sized from them), at most the tensors' rows.
    pub fn new(
        cu_seqlens_q: CudaView<'a, i32>,
        cu_seqlens_k: CudaView<'a, i32>,
        max_seqlen_q: usize,
        max_seqlen_k: usize,
    ) -> Result<Self> {
        if cu_seqlens_q.len() < 2 || cu_seqlens_k.len() != cu_seqlens_q.len() {
            return Err(Error::InvalidSeqlens(format!(
                "cu_seqlens_q has {} offsets and cu_seqlens_k {}: both need batch + 1, batch >= 1",
                cu_seqlens_q.len(),
                cu_seqlens_k.len()
            )));
        }
        if max_seqlen_q == 0 || max_seqlen_k == 0 {
            return Err(Error::InvalidSeqlens(
                "max_seqlen_q and max_seqlen_k must be at least 1".into(),
            ));
        }
        Ok(DeviceSeqlens {
            cu_q: cu_seqlens_q,
            keys: Keys::Rows(cu_seqlens_k),
            used_k: None,
            max_q: max_seqlen_q,
            max_k: max_seqlen_k,
            lse_by_sequence: false,
            cache_tiles: CacheTiles::default(),
        })
    }

    /// Packed queries over a paged KV cache: `cu_seqlens_q` and `max_seqlen_q` as in
    /// [`DeviceSeqlens::new`], each sequence attending to the first `cache_seqlens[b]` keys of
    /// its pages (clamped into the keys its row of the table addresses).
    pub(crate) fn paged(
        cu_seqlens_q: CudaView<'a, i32>,
        max_seqlen_q: usize,
        pages: DevicePages<'a>,
        cache_seqlens: CudaView<'a, i32>,
    ) -> Result<Self> {
        if cu_seqlens_q.len() < 2 || max_seqlen_q == 0 || pages.capacity() == 0 {
            return Err(Error::InvalidSeqlens(
                "a paged call needs a sequence, a query and a page per sequence".into(),
            ));
        }
        let max_k = pages.capacity();
        DeviceSeqlens {
            cu_q: cu_seqlens_q,
            keys: Keys::Pages(pages),
            used_k: None,
            max_q: max_seqlen_q,
            max_k,
            lse_by_sequence: false,
            cache_tiles: CacheTiles::default(),
        }
        .with_seqused_k(cache_seqlens)
    }

    /// The forward's LSE `(batch, heads_q, max_seqlen_q)`, sequence by sequence.
    pub(crate) fn with_lse_by_sequence(self) -> Self {
        DeviceSeqlens {
            lse_by_sequence: true,
            ..self
        }
    }

    /// How the Hopper forward runs a KV-cache call's tiles.
    pub(crate) fn with_cache_tiles(self, cache_tiles: CacheTiles) -> Self {
        DeviceSeqlens {
            cache_tiles,
            ..self
        }
    }

    /// The paged cache the keys lie in, if they do.
    pub(super) fn pages(&self) -> Option<&DevicePages<'a>> {
        match &self.keys {
            Keys::Pages(pages) => Some(pages),
            Keys::Rows(_) => None,
        }
    }

    /// [`check_forward`] of a packed call's operands, K and V in pages where the keys lie there,
    /// the LSE by sequence where it is so.
    pub(super) fn check_forward(
        &self,
        dtype: DType,
        inputs: [Operand4<'_>; 3],
        out: Operand4<'_>,
        lse_len: usize,
    ) -> Result<Problem> {
        let rows_lse = if self.lse_by_sequence {
            usize::MAX
        } else {
            lse_len
        };
        let rows = match &self.keys {
            Keys::Rows(_) => check_forward(dtype, inputs, out, rows_lse)?,
            Keys::Pages(pages) => pages.check_forward(dtype, inputs, out, rows_lse)?,
        };
        if self.lse_by_sequence {
            let by_sequence = Problem {
                batch: self.batch(),
                seqlen_q: self.max_q,
                ..rows
            };
            by_sequence.check_lse_len(lse_len)?;
        }
        Ok(rows)
    }

    /// Each sequence attends to the first `seqused_k[b]` of its keys only; `batch` i32 values.
    pub fn with_seqused_k(self, seqused_k: CudaView<'a, i32>) -> Result<Self> {
        if seqused_k.len() != self.batch() {
            return Err(Error::InvalidSeqlens(format!(
                "seqused_k has {} values for {} sequences",
                seqused_k.len(),
                self.batch()
            )));
        }
        Ok(DeviceSeqlens {
            used_k: Some(seqused_k),
            ..self
        })
    }

    /// Number of sequences.
    pub fn batch(&self) -> usize {
        self.cu_q.len() - 1
    }

    pub(super) fn contexts(&self) -> impl Iterator<Item = (CallPart, &Arc<CudaContext>)> {
        let keys = match &self.keys {
            Keys::Rows(cu_k) => cu_k,
            Keys::Pages(pages) => &pages.table,
        };
        [Some(&self.cu_q), Some(keys), self.used_k.as_ref()]
            .into_iter()
            .flatten()
            .map(|view| (CallPart::Seqlens, view.stream().context()))
    }

    /// The packed problem of tensors whose batch-1 `rows` problem is `dense`: one entry per
    /// sequence, the maxima as lengths. Checks what the C side checks of the packed rows: the
    /// rows as one sequence, the backward's 128-row pad per sequence, a left window against them.
    pub(super) fn problem(&self, dense: &Problem, cfg: &AttentionConfig) -> Result<Problem> {
        dense.check_gpu_limits()?;
        dispatch::check_left_window(cfg, dense.seqlen_k)?;
        let rows = dense.seqlen_q.max(dense.seqlen_k) as u128 + 128 * self.batch() as u128;
        let elements = rows * dense.heads_q as u128 * dense.head_dim.max(dense.head_dim_v) as u128;
        if elements > 1 << 42 {
            return Err(Error::IndexOverflow {
                operand: Operand::Q,
                detail: format!(
                    "{elements} elements of packed rows with a 128-row pad per sequence exceed \
                     the GPU kernels' 2^42"
                ),
            });
        }
        if dense.batch != 1 {
            return Err(Error::InvalidSeqlens(format!(
                "packed tensors have a batch axis of 1, not {}",
                dense.batch
            )));
        }
        for (name, max, rows) in [
            ("max_seqlen_q", self.max_q, dense.seqlen_q),
            ("max_seqlen_k", self.max_k, dense.seqlen_k),
        ] {
            if max > rows {
                return Err(Error::InvalidSeqlens(format!(
                    "{name} is {max}, more than the tensors' {rows} rows"
                )));
            }
        }
        Ok(Problem {
            batch: self.batch(),
            seqlen_q: self.max_q,
            seqlen_k: self.max_k,
            packed: true,
            ..*dense
        })
    }

    /// The C ABI's view of the sequences of tensors with `dense`'s rows, ordered on `stream`
    /// while the guards live.
    pub(super) fn rows<'s>(
        &'s self,
        stream: &'s CudaStream,
        dense: &Problem,
    ) -> (PackedRows, [Option<SyncOnDrop<'s>>; 3]) {
        let (cu_q, g_q) = self.cu_q.device_ptr(stream);
        let (keys, g_k) = match &self.keys {
            Keys::Rows(cu_k) => cu_k.device_ptr(stream),
            Keys::Pages(pages) => pages.table.device_ptr(stream),
        };
        let (used_k, g_used) = match &self.used_k {
            Some(view) => {
                let (ptr, guard) = view.device_ptr(stream);
                (ptr, Some(guard))
            }
            None => (0, None),
        };
        let rows = PackedRows {
            cu_seqlens_q: cu_q,
            cu_seqlens_k: if self.pages().is_none() { keys } else { 0 },
            lse_by_sequence: self.lse_by_sequence,
            cache_tiles: self.cache_tiles,
            seqused_k: used_k,
            pages: self.pages().map(|pages| PagedKeys {
                table: keys,
                pages_per_seq: pages.pages_per_seq,
                page_size: pages.page_size,
                num_pages: pages.num_pages,
            }),
            total_q: dense.seqlen_q,
            total_k: dense.seqlen_k,
        };
        (rows, [Some(g_q), Some(g_k), g_used])
    }
}

impl Device {
    /// Forward pass over a packed batch into caller-owned device outputs, ordered on `stream`:
    /// Q `(1, total_q, heads_q, head_dim)`, K `(1, total_k, heads_kv, head_dim)`, V
    /// `(1, total_k, heads_kv, head_dim_v)`, O like Q with V's head dim, `lse` f32
    /// `(heads_q, total_q)`; every sequence is its own problem (masks bottom-right within it).
    /// A sequence whose queries see no key gets O = 0 and LSE = +inf, or with sinks
    /// ([`DeviceForwardInputs::sinks`]), LSE = its head's sink.
    pub fn varlen_forward_into<T: Element + DeviceRepr>(
        &self,
        stream: &Arc<CudaStream>,
        cfg: &AttentionConfig,
        seqs: &DeviceSeqlens,
        inputs: DeviceForwardInputs<'_, T>,
        out: &mut DeviceTensorMut<T>,
        lse: &mut CudaViewMut<f32>,
    ) -> Result<Plan> {
        self.forward_launch(stream, cfg, Some(seqs), inputs, out, lse)
    }

    /// Backward pass over a packed batch, ordered on `stream`: the tensors as in
    /// [`Device::varlen_forward_into`], dQ like Q, dK like K and dV like V. Key rows a sequence
    /// does not use (past `seqused_k`) get dK = dV = 0. The sinks' gradient, where
    /// `grads.dsinks` is given, sums every sequence's rows of each query head
    /// ([`DeviceGradientsMut::dsinks`]).
    pub fn varlen_backward_into<T: Element + DeviceRepr>(
        &self,
        stream: &Arc<CudaStream>,
        cfg: &AttentionConfig,
        seqs: &DeviceSeqlens,
        inputs: DeviceBackwardInputs<'_, T>,
        grads: DeviceGradientsMut<'_, '_, T>,
    ) -> Result<Plan> {
        self.backward_launch(stream, cfg, Some(seqs), inputs, grads, None)
    }
}
