//! The CUDA backends (Sm90, Sm80): fill the C ABI's params from validated operands and launch
//! through it. All raw pointers of the crate pass through here.

use crate::config::{AttentionConfig, Backend};
use crate::dispatch::Plan;
use crate::error::{Error, Operand, Result};
use crate::ffi;
use crate::registry::TileRole;
use crate::tensor::{DType, Layout, Problem};
use crate::unstable::TailSplit;

/// A device operand reduced to what the C ABI needs.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RawTensor {
    pub ptr: u64,
    pub layout: Layout,
}

/// An operand the C ABI call goes without (a null pointer).
pub(crate) const NO_TENSOR: ffi::flashattn_tensor_t = ffi::flashattn_tensor_t {
    ptr: std::ptr::null_mut(),
    batch_stride: 0,
    row_stride: 0,
    head_stride: 0,
};

impl RawTensor {
    /// [`RawTensor::to_ffi`] once its pointer and strides are checked for the kernels' 16-byte
    /// accesses ([`check_alignment`]).
    pub(crate) fn aligned_ffi(
        self,
        operand: Operand,
        elem_bytes: usize,
    ) -> Result<ffi::flashattn_tensor_t> {
        check_alignment(operand, &self, elem_bytes)?;
        Ok(self.to_ffi())
    }

    pub(crate) fn to_ffi(self) -> ffi::flashattn_tensor_t {
        ffi::flashattn_tensor_t {
            ptr: self.ptr as *mut std::ffi::c_void,
            batch_stride: self.layout.strides[0] as i64,
            row_stride: self.layout.strides[1] as i64,
            head_stride: self.layout.strides[2] as i64,
        }
    }
}

/// A packed (varlen) call's sequences as the C ABI takes them: device addresses of the i32
/// offsets (and of the used-key counts, 0 for none) and the packed tensors' row counts.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PackedRows {
    pub cu_seqlens_q: u64,
    pub cu_seqlens_k: u64,
    pub seqused_k: u64,
    pub total_q: usize,
    pub total_k: usize,
    /// A paged KV cache's table (then `cu_seqlens_k` is 0).
    pub pages: Option<PagedKeys>,
    /// The forward's LSE `(batch, heads_q, max_seqlen_q)` by sequence.
    pub lse_by_sequence: bool,
    /// A KV-cache call's tiles on the Hopper 16-bit forward.
    pub cache_tiles: CacheTiles,
}

/// How the Hopper 16-bit forward runs a KV-cache call's tiles (the C ABI's `pack_gqa` and
/// `num_splits`): the query heads of a KV head's group as the rows of one tile, and the key
/// blocks cut into `num_splits` ranges (`Some(0)`: as many as the launcher plans; `None`: none,
/// as every call but a KV cache's).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct CacheTiles {
    pub pack_gqa: bool,
    pub num_splits: Option<usize>,
}

/// A paged KV cache as the C ABI takes it: the page table's device address, its row stride
/// (the pages each sequence addresses), the rows per page and the pages.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PagedKeys {
    pub table: u64,
    pub pages_per_seq: usize,
    pub page_size: usize,
    pub num_pages: usize,
}

/// TMA and 16-byte vector accesses need 16-byte aligned base pointers and strides.
pub(crate) const ALIGN_BYTES: usize = 16;

pub(crate) fn check_alignment(operand: Operand, t: &RawTensor, elem_bytes: usize) -> Result<()> {
    let strides_ok = t.layout.strides[..3]
        .iter()
        .zip(&t.layout.shape[..3])
        // A stride of a dimension of extent 1 is never used.
        .all(|(&s, &n)| {
            n == 1
                || s.checked_mul(elem_bytes)
                    .is_some_and(|bytes| bytes % ALIGN_BYTES == 0)
        });
    if t.ptr % ALIGN_BYTES as u64 != 0 || !strides_ok {
        return Err(Error::Misaligned {
            operand,
            align: ALIGN_BYTES,
        });
    }
    Ok(())
}

pub(crate) fn ffi_dtype(dtype: DType) -> i32 {
    match dtype {
        DType::F16 => ffi::FLASHATTN_F16 as i32,
        DType::BF16 => ffi::FLASHATTN_BF16 as i32,
        DType::E4M3 => ffi::FLASHATTN_E4M3 as i32,
        DType::F32 => -1, // refused by the dispatcher before we get here
    }
}

fn window(side: Option<usize>) -> i32 {
    side.map_or(-1, |w| w.min(i32::MAX as usize) as i32)
}

fn sm90_flags(cfg: &AttentionConfig, problem: &Problem) -> u32 {
    let mut flags = 0;
    if !cfg.sm90_schedule.pingpong.takes_turns(problem.dtype) {
        flags |= ffi::FLASHATTN_SM90_NO_PINGPONG;
    }
    if !cfg.sm90_schedule.intra_wg_overlap {
        flags |= ffi::FLASHATTN_SM90_NO_INTRA_WG_OVERLAP;
    }
    if cfg.sm90_schedule.persistent_causal {
        flags |= ffi::FLASHATTN_SM90_PERSISTENT_CAUSAL;
    }
    match cfg.sm90_schedule.split_tail {
        TailSplit::Auto => {}
        TailSplit::Off => flags |= ffi::FLASHATTN_SM90_NO_SPLIT_TAIL,
        TailSplit::Always => flags |= ffi::FLASHATTN_SM90_SPLIT_TAIL_ALWAYS,
    }
    flags
}

/// Parameters shared by forward and backward; `packed` for a packed problem (`problem.packed`,
/// whose lengths are then the longest sequence's).
pub(crate) fn base_params(
    problem: &Problem,
    packed: Option<&PackedRows>,
    cfg: &AttentionConfig,
    sm_count: i32,
) -> ffi::flashattn_params_t {
    let (left, right) = cfg.mask.bounds();
    // A right side of 0 goes to the kernels as the causal flag with no right window, as
    // `Causal` always has, so that a window with right 0 runs exactly as `Causal` does: sent as
    // a window, flash_api.cu would drop it to unbounded when seqlen_q is 1 (same keys, another
    // kernel path).
    let causal = right == Some(0);
    let p = ffi::flashattn_params_t {
        batch: problem.batch as i32,
        seqlen_q: problem.seqlen_q as i32,
        seqlen_k: problem.seqlen_k as i32,
        heads_q: problem.heads_q as i32,
        heads_kv: problem.heads_kv as i32,
        head_dim: problem.head_dim as i32,
        head_dim_v: problem.head_dim_v as i32,
        dtype: ffi_dtype(problem.dtype),
        softmax_scale: cfg.scale_for(problem.head_dim),
        softcap: cfg.softcap.unwrap_or(0.0),
        causal: causal as i32,
        window_left: window(left),
        window_right: if causal { -1 } else { window(right) },
        deterministic: cfg.deterministic as i32,
        sm_count,
        sm90_flags: sm90_flags(cfg, problem),
        ..Default::default()
    };
    match packed {
        None => p,
        Some(rows) => ffi::flashattn_params_t {
            seqlen_q: rows.total_q as i32,
            seqlen_k: rows.total_k as i32,
            cu_seqlens_q: rows.cu_seqlens_q as *const i32,
            cu_seqlens_k: rows.cu_seqlens_k as *const i32,
            seqused_k: rows.seqused_k as *const i32,
            max_seqlen_q: problem.seqlen_q as i32,
            max_seqlen_k: problem.seqlen_k as i32,
            page_table: rows
                .pages
                .map_or(std::ptr::null(), |t| t.table as *const i32),
            page_table_batch_stride: rows.pages.map_or(0, |t| t.pages_per_seq as i64),
            page_size: rows.pages.map_or(0, |t| t.page_size as i32),
            num_pages: rows.pages.map_or(0, |t| t.num_pages as i32),
            lse_by_sequence: rows.lse_by_sequence as i32,
            ..p
        },
    }
}

/// A forward's device pointers beside its tensors: the LSE, the attention sinks (0: none), and
/// for K and V in an e4m3 KV cache its K and V descales (0: none).
pub(crate) struct ForwardExtras {
    pub lse: u64,
    pub sinks: u64,
    pub e4m3_descales: Option<[u64; 2]>,
}

/// Launches the forward `plan` chose (its backend, and on sm90 its tile) on `stream` (a
/// CUstream).
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward(
    plan: &Plan,
    problem: &Problem,
    packed: Option<&PackedRows>,
    cfg: &AttentionConfig,
    sm_count: i32,
    [q, k, v, o]: [RawTensor; 4],
    extras: ForwardExtras,
    stream: *mut std::ffi::c_void,
) -> Result<()> {
    let mut p = base_params(problem, packed, cfg, sm_count);
    p.q = q.to_ffi();
    p.k = k.to_ffi();
    p.v = v.to_ffi();
    p.o = o.to_ffi();
    p.lse = extras.lse as *mut f32;
    p.sinks = extras.sinks as *const f32;
    if let Some([kd, vd]) = extras.e4m3_descales {
        p.kv_cache_e4m3 = 1;
        p.k_descale = kd as *const f32;
        p.v_descale = vd as *const f32;
    }
    if plan.tile().is_some_and(|row| row.role == TileRole::Masked) {
        p.sm90_flags |= ffi::FLASHATTN_SM90_MASKED_TILE;
    }
    let backend = plan.backend;
    // Only the Hopper 16-bit forward has them; the others run the same call without.
    if let (Backend::Sm90, Some(rows)) = (backend, packed) {
        p.pack_gqa = rows.cache_tiles.pack_gqa as i32;
        match rows.cache_tiles.num_splits {
            None => {}
            Some(0) => p.sm90_flags |= ffi::FLASHATTN_SM90_PLAN_KEY_SPLITS,
            Some(n) => p.num_splits = n as i32,
        }
    }
    // SAFETY: every pointer was taken from a live cudarc buffer whose guard outlives this call,
    // and its layout was checked against the buffer length.
    let r = unsafe {
        match backend {
            Backend::Sm90 => ffi::flashattn_fwd_sm90(&p, stream),
            _ => ffi::flashattn_fwd_sm80(&p, stream),
        }
    };
    ffi::check(r, backend, "forward")
}

/// Operands of the FP8 forward: e4m3 Q, K (rows) and V (key-major, see src/cuda/fp8/), O in
/// `out_dtype`, the LSE, the Q, K, V descales and the attention sinks (0: none).
pub(crate) struct Fp8Operands {
    pub q: RawTensor,
    pub k: RawTensor,
    pub v: RawTensor,
    pub o: RawTensor,
    pub out_dtype: DType,
    pub lse: u64,
    pub descales: [u64; 3],
    pub sinks: u64,
}

/// Launches the sm90 FP8 forward on `stream` (a CUstream); `packed` as in [`base_params`].
pub(crate) fn forward_fp8(
    problem: &Problem,
    packed: Option<&PackedRows>,
    cfg: &AttentionConfig,
    sm_count: i32,
    ops: Fp8Operands,
    stream: *mut std::ffi::c_void,
) -> Result<()> {
    let mut p = base_params(problem, packed, cfg, sm_count);
    p.q = ops.q.to_ffi();
    p.k = ops.k.to_ffi();
    p.v = ops.v.to_ffi();
    p.o = ops.o.to_ffi();
    p.lse = ops.lse as *mut f32;
    p.out_dtype = ffi_dtype(ops.out_dtype);
    p.q_descale = ops.descales[0] as *const f32;
    p.k_descale = ops.descales[1] as *const f32;
    p.v_descale = ops.descales[2] as *const f32;
    p.sinks = ops.sinks as *const f32;
    // SAFETY: every pointer was taken from a live cudarc buffer whose guard outlives this call;
    // the quantized operands and descales were sized by the quantize step for this problem.
    let r = unsafe { ffi::flashattn_fwd_sm90(&p, stream) };
    ffi::check(r, Backend::Sm90, "FP8 forward")
}

/// Bytes of workspace the backward needs (layout in csrc/common/bwd_workspace.h, which
/// refuses a smaller one): the f32 dQ accumulator (one slice, or on Sm80 in deterministic mode
/// one per `bwd_dq_splits`), LSE·log2(e)
/// and rowsum(dO ∘ O) (each with seqlen_q rounded up to 128 rows per head), with GQA f32 dK
/// and dV sums (per KV head, or per query head in deterministic mode), and in deterministic mode
/// the sm90 backward's dQ semaphores (an i32 per 64 rows and warpgroup) and for packed calls a flag
/// that says whether their offsets fit the semaphores' layout; for packed calls the tables of
/// which sequence owns each 128 query workspace rows and each packed key block; where the call
/// asks for the sinks' gradient (`sink_grad`), its parts ([`bwd_sink_parts`]); each padded to
/// 256 bytes.
/// Packed (`packed`), the accumulator rows of a head are the packed rows rounded up to 128 plus
/// 128 per sequence (each sequence's rows start on a multiple of 128), and the dK and dV sums
/// have the packed key rows.
pub(crate) fn bwd_workspace_bytes(
    problem: &Problem,
    packed: Option<&PackedRows>,
    backend: Backend,
    deterministic: bool,
    sm_count: i32,
    sink_grad: bool,
) -> usize {
    let align = |x: usize| x.div_ceil(256) * 256;
    let (rows_dq_per_head, rows_k_per_head) = match packed {
        None => (
            problem.batch * problem.seqlen_q.div_ceil(128) * 128,
            problem.batch * problem.seqlen_k,
        ),
        Some(rows) => (
            rows.total_q.div_ceil(128) * 128 + 128 * problem.batch,
            rows.total_k,
        ),
    };
    let rows_dq = problem.heads_q * rows_dq_per_head;
    let heads_k = if deterministic {
        problem.heads_q
    } else {
        problem.heads_kv
    };
    let rows_k = heads_k * rows_k_per_head;
    let d = problem.head_dim;
    let gqa = problem.heads_q != problem.heads_kv;
    let slices = if backend == Backend::Sm90 {
        1
    } else {
        bwd_dq_splits(problem, deterministic, sm_count)
    };
    slices * align(rows_dq * d * 4)
        + 2 * align(rows_dq * 4)
        + if gqa {
            align(rows_k * d * 4) + align(rows_k * problem.head_dim_v * 4)
        } else {
            0
        }
        + if deterministic {
            align(rows_dq / 64 * 2 * 4)
        } else {
            0
        }
        + if deterministic && packed.is_some() {
            256
        } else {
            0
        }
        + match packed {
            // The entry tables: an i32 per 128 query workspace rows of a head and per packed
            // key block of 64 keys (`total_k / 64 + batch`).
            Some(rows) => {
                align(rows_dq_per_head / 128 * 4) + align((rows.total_k / 64 + problem.batch) * 4)
            }
            None => 0,
        }
        + if sink_grad {
            align(bwd_sink_parts(problem, packed) * 4)
        } else {
            0
        }
}

/// Floats of the sinks' gradient parts (the kernels' sums of dS weighted by the sink's share,
/// which keep O's rounding out of d_sink): 8 per query head and key block of 64 keys of every
/// entry, or packed, of the packed key blocks where they are more (csrc/common/bwd_workspace.h,
/// bwd_sink_parts).
fn bwd_sink_parts(problem: &Problem, packed: Option<&PackedRows>) -> usize {
    let mut blocks = problem.batch * problem.seqlen_k.div_ceil(64);
    if let Some(rows) = packed {
        blocks = blocks.max(rows.total_k / 64 + problem.batch);
    }
    blocks * problem.heads_q * 8
}

/// dQ slices of the deterministic backward: as many CTAs per (batch, head) as fit in one wave on
/// the SMs, at most one per 128 keys (csrc/common/bwd_workspace.h, bwd_dq_splits).
fn bwd_dq_splits(problem: &Problem, deterministic: bool, sm_count: i32) -> usize {
    if !deterministic {
        return 1;
    }
    let heads = problem.batch * problem.heads_q;
    let fill = sm_count.max(0) as usize / heads;
    fill.clamp(1, problem.seqlen_k.div_ceil(128).max(1))
}

/// Operands of a backward launch: forward inputs and output, dO, and the gradients to write.
pub(crate) struct BackwardOperands {
    pub q: RawTensor,
    pub k: RawTensor,
    pub v: RawTensor,
    pub out: RawTensor,
    pub dout: RawTensor,
    pub dq: RawTensor,
    pub dk: RawTensor,
    pub dv: RawTensor,
    pub lse: u64,
    /// The attention sinks and their gradient's buffer (0: none).
    pub sinks: u64,
    pub dsinks: u64,
    pub workspace: u64,
    pub workspace_bytes: usize,
}

/// Launches the backward of `backend` on `stream` (a CUstream).
pub(crate) fn backward(
    backend: Backend,
    problem: &Problem,
    packed: Option<&PackedRows>,
    cfg: &AttentionConfig,
    sm_count: i32,
    ops: &BackwardOperands,
    stream: *mut std::ffi::c_void,
) -> Result<()> {
    let mut p = base_params(problem, packed, cfg, sm_count);
    p.q = ops.q.to_ffi();
    p.k = ops.k.to_ffi();
    p.v = ops.v.to_ffi();
    p.o = ops.out.to_ffi();
    p.dout = ops.dout.to_ffi();
    p.dq = ops.dq.to_ffi();
    p.dk = ops.dk.to_ffi();
    p.dv = ops.dv.to_ffi();
    p.lse = ops.lse as *mut f32;
    p.sinks = ops.sinks as *const f32;
    p.dsinks = ops.dsinks as *mut f32;
    p.workspace = ops.workspace as *mut std::ffi::c_void;
    p.workspace_bytes = ops.workspace_bytes as i64;
    // SAFETY: every pointer was taken from a live cudarc buffer whose guard outlives this call,
    // its layout was checked against the buffer length, and the workspace holds
    // bwd_workspace_bytes(problem) bytes.
    let r = unsafe {
        match backend {
            Backend::Sm90 => ffi::flashattn_bwd_sm90(&p, stream),
            _ => ffi::flashattn_bwd_sm80(&p, stream),
        }
    };
    ffi::check(r, backend, "backward")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alignment_rules() {
        let layout = Layout::contiguous([2, 16, 4, 64]);
        let t = |ptr, layout| RawTensor { ptr, layout };
        assert!(check_alignment(Operand::Q, &t(4096, layout), 2).is_ok());
        assert!(matches!(
            check_alignment(Operand::Q, &t(4098, layout), 2),
            Err(Error::Misaligned { .. })
        ));
        // A row stride of 65 bf16 elements (130 bytes) cannot be a TMA stride.
        let odd = Layout::with_strides([2, 16, 1, 64], [16 * 65, 65, 64, 1]);
        assert!(check_alignment(Operand::K, &t(4096, odd), 2).is_err());
        // ...unless that dimension has extent 1.
        let single = Layout::with_strides([1, 1, 1, 64], [7, 65, 3, 1]);
        assert!(check_alignment(Operand::K, &t(4096, single), 2).is_ok());
    }
}
