//! Attention over a dense or paged KV cache on the GPU ([`crate::kvcache`] has the layout and the
//! CPU calls).

use std::sync::Arc;

use cudarc::driver::{
    CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceRepr, DeviceSlice,
};

use super::varlen::DevicePages;
use super::views::KeysValues;
use super::{
    check_aligned, check_aligned_out, driver_error, Device, DeviceSeqlens, DeviceTensor,
    DeviceTensorMut,
};
use crate::backend::gpu::{self, CacheTiles, RawTensor};
use crate::config::{AttentionConfig, Backend};
use crate::dispatch::Plan;
use crate::error::{CallPart, Error, Operand, Result};
use crate::ffi;
use crate::kvcache;
use crate::registry::{self, Family, TileRole};
use crate::tensor::{self, DType, Layout, Problem};
use crate::unstable::Sm90Schedule;
use crate::Element;

/// A KV-cache call's device inputs: Q `(batch, seqlen_q, heads_q, head_dim)`, the cache, `batch`
/// cached key counts, and optionally attention sinks. The cache is dense without a block table:
/// K `(batch_cache, seqlen_cache, heads_kv, head_dim)` and V with `head_dim_v`, sequence `b`
/// reading entry `b` (`batch_cache ≥ batch`; with `cache_batch_idx`, entry
/// `cache_batch_idx[b]`). With one, it is paged: K `(num_pages, page_size, heads_kv, head_dim)`
/// and V with `head_dim_v`, and sequence `b`'s key `j` lies in row `j % page_size` of page
/// `block_table[b][j / page_size]`. The cache holds Q's element type, or e4m3 (`C` =
/// `float8::F8E4M3`, with the `kvcache-fp8` feature; the Hopper and the Ampere forwards),
/// which the kernels widen to Q's type in shared memory, and then optionally its
/// [`DeviceCacheDescales`].
#[derive(Debug)]
pub struct DeviceKvCacheInputs<'a, T, C = T> {
    pub q: &'a DeviceTensor<'a, T>,
    pub k_cache: &'a DeviceTensor<'a, C>,
    pub v_cache: &'a DeviceTensor<'a, C>,
    /// The paged cache's `(batch, max_pages)` i32 page numbers, row-major on the device; each
    /// sequence's keys are `max_pages · page_size` rows. The kernels clamp every entry into
    /// `0..num_pages` (the host does not read them). Pages of any size: on the Hopper forward
    /// pages of whole key blocks of its tile (multiples of 128 rows at head dims 64, 96, 128 and
    /// (192, 128), of 112 at 192 and of 80 at 256) are loaded a block at a time, pages of
    /// multiples of 16 rows a piece of 16 or 64 rows at a time, others row by row, each row from
    /// its page (docs/PERFORMANCE.md says what each way reads at); an e4m3 cache's pages of
    /// multiples of 16 rows are staged in such pieces and widened at head dims 64 and 128, its
    /// other pages (and all at d256) copied row by row and widened. The Ampere
    /// forward (`Backend::Sm80`, and `Auto` off Hopper) copies every row from its page. The
    /// forward without intra-warpgroup overlap, and the CPU backend, are `Error::Unsupported`
    /// here (the CPU takes any page size through [`crate::kvcache::forward`]).
    pub block_table: Option<CudaView<'a, i32>>,
    /// A dense cache's entry per sequence: sequence `b` reads entry `cache_batch_idx[b]`
    /// (`batch` i32 values on the device; entry `b` without), as flash-attn's
    /// `cache_batch_idx`. The kernels clamp each into `0..batch_cache` (the host does not read
    /// them). The call then runs the dense cache as a paged one whose pages are its entries (of
    /// `seqlen_cache` rows) and whose block table is these values, so it takes what a paged
    /// cache takes: the Hopper forward with intra-warpgroup overlap, or the Ampere forward, and
    /// any `seqlen_cache`. With `block_table` it is
    /// `Error::InvalidPageTable`.
    pub cache_batch_idx: Option<CudaView<'a, i32>>,
    /// Each sequence's cached keys, `batch` i32 values on the device. The kernels clamp them into
    /// `0..=seqlen_cache` (paged: `0..=max_pages · page_size`; the host does not read them: that
    /// would synchronize the stream). The cache's rows past them in the blocks read (of the
    /// sequence's entry or pages) are read by whole-block loads and take weight 0, their values
    /// zeroed before P·V: they may hold anything (an uninitialized cache's NaN included).
    pub cache_seqlens: CudaView<'a, i32>,
    pub sinks: Option<&'a CudaView<'a, f32>>,
    /// Key splits (split-KV) of the Hopper forward: each tile's keys cut into this many ranges
    /// computed on different SMs and merged by their LSE, as flash-attn's `num_splits`. 0 lets
    /// the launcher choose (splits where the tiles would leave SMs idle: small batches of long
    /// caches), 1 runs every tile whole; at most 256 (else `Error::InvalidConfig`), and no more
    /// than the cache's key blocks (of the forward's tile: 128 or 160 keys at d128). Splits need
    /// the forward with intra-warpgroup overlap (the default schedule; else
    /// `Error::Unsupported`). The Ampere backend runs every tile whole (more than one split
    /// asked of `Backend::Sm80` is `Error::Unsupported`).
    pub num_splits: usize,
    /// An e4m3 cache's descales (`None`: 1); with a 16-bit cache `Error::Unsupported` (the CPU
    /// takes them: [`crate::kvcache::forward`]).
    pub descales: Option<DeviceCacheDescales<'a>>,
}

/// An e4m3 cache's descales on the device, as [`crate::kvcache::CacheDescales`] on the host:
/// `batch × heads_kv` f32 values each (else `Error::InvalidConfig`), sequence `b`'s KV head `h`
/// at `b · heads_kv + h` (by sequence, with `cache_batch_idx` too). K's multiplies the scores
/// (before softcap), V's the values. Read on the device only: finite and positive is the
/// caller's to keep (the host does not see them); an append stores NaN where one is not a
/// positive normal number.
#[derive(Clone, Copy, Debug)]
pub struct DeviceCacheDescales<'a> {
    pub k: &'a CudaView<'a, f32>,
    pub v: &'a CudaView<'a, f32>,
}

/// Rotary position embedding on the device, as [`crate::kvcache::Rotary`] applies it on the
/// host (the same pairs, and bit-identical results but for NaN payloads): `cos` and `sin` f32 `(positions, dim / 2)`
/// row-major. The kernels read the angles of a position past the table's last row from that
/// last row (the host cannot see the cached key counts to check them): give angles for each
/// sequence's cached keys plus the step's rows.
#[derive(Clone, Copy, Debug)]
pub struct DeviceRotary<'a> {
    pub cos: &'a CudaView<'a, f32>,
    pub sin: &'a CudaView<'a, f32>,
    pub dim: usize,
    pub interleaved: bool,
}

/// What an append step writes into a KV cache on the device, as [`crate::kvcache::append`] does
/// on the host: `k_new` `(batch, seqlen_new, heads_kv, head_dim)` and `v_new` (with V's head
/// dim) into each sequence's cache rows `cache_seqlens[b] ..` (dense: entry `b`; paged: the
/// rows of the pages `block_table` gives), the new keys rotated to their positions first when
/// `rotary` is given. The counts are read on the device only: each is clamped into the
/// sequence's capacity (the dense cache's rows, or `max_pages · page_size`), rows past it are
/// not written, and page numbers are clamped into the cache's pages. Sequences must not share
/// the rows they append into (nor, with `cache_batch_idx`, an entry). The cache holds the new
/// rows' type, or e4m3 (`C` = `float8::F8E4M3`, any build), into which each new element is
/// quantized by its descale as [`crate::kvcache::append_fp8`] quantizes it, bit for bit (the
/// GPU tests check it against the host append).
#[derive(Debug)]
pub struct DeviceKvCacheAppend<'a, 'c, T, C = T> {
    pub k_cache: &'a mut DeviceTensorMut<'c, C>,
    pub v_cache: &'a mut DeviceTensorMut<'c, C>,
    /// A paged cache's `(batch, max_pages)` i32 page numbers, row-major; `None`: dense.
    pub block_table: Option<CudaView<'a, i32>>,
    /// A dense cache's entry per sequence, as [`DeviceKvCacheInputs::cache_batch_idx`] (values on
    /// the device, clamped into the entries; any entry rows, where the forward takes multiples
    /// of 16).
    pub cache_batch_idx: Option<CudaView<'a, i32>>,
    pub cache_seqlens: CudaView<'a, i32>,
    pub k_new: &'a DeviceTensor<'a, T>,
    pub v_new: &'a DeviceTensor<'a, T>,
    pub rotary: Option<DeviceRotary<'a>>,
    /// An e4m3 cache's descales (`None`: 1), as [`DeviceKvCacheInputs::descales`]; a 16-bit
    /// cache takes none (`Error::InvalidConfig`). New element `x` of sequence `b`'s KV head `h`
    /// is stored as `x · (1 / descale[b · heads_kv + h])` rounded to the nearest e4m3 (±448 past
    /// its largest finite value). The host does not read them: a descale that is not a positive
    /// normal number (which the host append refuses) stores NaN in the rows it scales.
    pub descales: Option<DeviceCacheDescales<'a>>,
}

/// One decoding or prefill step over a KV cache on the device, as [`crate::kvcache::step`] runs
/// it on the host and flash-attn's `flash_attn_with_kvcache` on the GPU: Q and the new keys
/// rotated (with `rotary`), the new keys and values appended, then the forward over
/// `cache_seqlens[b] + seqlen_new` keys. `cache_seqlens` keeps its values (the caller advances
/// them). The rest as [`DeviceKvCacheInputs`] and [`DeviceKvCacheAppend`] say; an e4m3 cache
/// (`C` = `float8::F8E4M3`) takes its descales for both the append and the forward, which
/// needs the `kvcache-fp8` kernels; a step over a 16-bit cache refuses
/// descales (`Error::InvalidConfig`, as the host step) before it writes anything.
#[derive(Debug)]
pub struct DeviceKvCacheStep<'a, 'c, T, C = T> {
    pub q: &'a DeviceTensor<'a, T>,
    pub k_cache: &'a mut DeviceTensorMut<'c, C>,
    pub v_cache: &'a mut DeviceTensorMut<'c, C>,
    pub block_table: Option<CudaView<'a, i32>>,
    pub cache_batch_idx: Option<CudaView<'a, i32>>,
    pub cache_seqlens: CudaView<'a, i32>,
    /// `k_new` and `v_new`, `(batch, seqlen_new, heads_kv, ·)`.
    pub new: Option<(&'a DeviceTensor<'a, T>, &'a DeviceTensor<'a, T>)>,
    pub rotary: Option<DeviceRotary<'a>>,
    pub sinks: Option<&'a CudaView<'a, f32>>,
    /// As [`DeviceKvCacheInputs::num_splits`].
    pub num_splits: usize,
    /// As [`DeviceKvCacheAppend::descales`] and [`DeviceKvCacheInputs::descales`].
    pub descales: Option<DeviceCacheDescales<'a>>,
}

/// What an append launch takes beside the cache and the new rows: rotary embedding, an e4m3
/// cache's descales, Q to rotate, and where the step's key counts go.
struct AppendExtras<'a, 'q, T> {
    rotary: Option<&'a DeviceRotary<'a>>,
    descales: Option<DeviceCacheDescales<'a>>,
    q_rot: Option<RotatedQ<'a, 'q, T>>,
    seqlens_out: Option<&'a mut CudaSlice<i32>>,
}

/// Q rotated by an append launch into `out` (contiguous, Q's shape), each row at the sequence's
/// cached count (plus its row index unless `same_position`).
struct RotatedQ<'a, 'q, T> {
    q: &'a DeviceTensor<'q, T>,
    out: &'a mut CudaSlice<T>,
    same_position: bool,
}

/// `layout` (batch, rows, heads, d) as one sequence of `batch · rows` rows, where an entry's
/// rows follow the last entry's (batch stride = rows × row stride; with one row per entry, as a
/// decode step's Q, any batch stride).
fn as_rows(operand: Operand, layout: &Layout) -> Result<Layout> {
    let [batch, rows, heads, d] = layout.shape;
    let s = layout.strides;
    let overflow = || Error::IndexOverflow {
        operand,
        detail: format!("{batch} entries of {rows} rows as one sequence"),
    };
    let row_stride = if rows == 1 { s[0] } else { s[1] };
    let entry_rows = rows.checked_mul(s[1]).ok_or_else(overflow)?;
    if batch > 1 && rows > 1 && s[0] != entry_rows {
        return Err(Error::Unsupported {
            what: format!(
                "{operand} of a KV-cache call on the GPU with batch stride {} (the GPU path reads \
                 each entry's rows after the last's: batch stride {rows} × row stride {})",
                s[0], s[1]
            ),
            backend: Backend::Auto,
        });
    }
    let total = batch.checked_mul(rows).ok_or_else(overflow)?;
    let span = total.checked_mul(row_stride).ok_or_else(overflow)?;
    Ok(Layout::with_strides(
        [1, total, heads, d],
        [span, row_stride, s[2], s[3]],
    ))
}

/// A block table of `len` entries as `batch` rows: the pages each sequence addresses.
fn pages_per_seq(len: usize, batch: usize) -> Result<usize> {
    if batch == 0 || len == 0 || len % batch != 0 {
        return Err(Error::InvalidPageTable(format!(
            "{len} entries are not {batch} rows of at least one page"
        )));
    }
    Ok(len / batch)
}

/// The block table a call runs with: a paged cache's, or, for a dense cache with
/// `cache_batch_idx`, those values, which make the cache's entries its pages (one per
/// sequence).
fn cache_table<'a>(
    block_table: Option<CudaView<'a, i32>>,
    cache_batch_idx: Option<CudaView<'a, i32>>,
    batch: usize,
) -> Result<Option<CudaView<'a, i32>>> {
    match (block_table, cache_batch_idx) {
        (Some(_), Some(_)) => Err(Error::InvalidPageTable(
            "cache_batch_idx with a paged cache: the block table names each sequence's pages"
                .into(),
        )),
        (None, Some(idx)) if idx.len() != batch => Err(Error::InvalidSeqlens(format!(
            "cache_batch_idx has {} values for {batch} sequences",
            idx.len()
        ))),
        (table, idx) => Ok(table.or(idx)),
    }
}

/// The Hopper forward loads a paged cache's key blocks, where its pages hold no whole block but
/// whole pieces of 16 rows, a piece at a time (one TMA copy each); in pieces of this many rows
/// where the pages and the key block are multiples of it (fewer, larger copies). As
/// csrc/sm90/fwd_traits.h has it.
const WIDE_PIECE_ROWS: usize = 64;

/// A paged cache's pages as the kernels of `backend` take them, and the call's configuration for
/// them: pages of any size. The Hopper forward (`Backend::Sm90`) takes a key block at a time
/// where a page holds whole blocks of its tile, else in pieces of 16 or [`WIDE_PIECE_ROWS`] rows
/// where a page holds whole ones, else row by row; the Ampere forward (`Backend::Sm80`) copies
/// each row from its page.
fn pages<'a>(
    k_cache: &Layout,
    head_dim_v: usize,
    table: CudaView<'a, i32>,
    batch: usize,
    cfg: &AttentionConfig,
    backend: Backend,
) -> Result<(DevicePages<'a>, AttentionConfig)> {
    let [num_pages, page_size, _, head_dim] = k_cache.shape;
    let pages_per_seq = pages_per_seq(table.len(), batch)?;
    let key_block = |family: Family, role: TileRole| {
        registry::TILES
            .iter()
            .find(|r| {
                r.family == family
                    && (r.head_dim, r.head_dim_v) == (head_dim, head_dim_v)
                    && r.role == role
            })
            .map(|r| r.tile.shape().1)
    };
    let unsupported = |why: String| {
        Error::Unsupported {
        what: format!("a paged KV cache with pages of {page_size} rows at head dims ({head_dim}, {head_dim_v}): {why}"),
        backend,
    }
    };
    let fits = |n: usize| i32::try_from(n).is_ok();
    let checked = |cfg: AttentionConfig| match pages_per_seq.checked_mul(page_size) {
        Some(keys) if fits(keys) && fits(num_pages) => Ok((
            DevicePages {
                table,
                pages_per_seq,
                page_size,
                num_pages,
            },
            cfg,
        )),
        _ => Err(Error::IndexOverflow {
            operand: Operand::K,
            detail: format!(
                "{num_pages} pages, {pages_per_seq} of {page_size} keys per sequence, pass i32"
            ),
        }),
    };
    if backend == Backend::Sm80 {
        if key_block(Family::Sm80Fwd, TileRole::Base).is_none() {
            return Err(unsupported("no Ampere forward at these head dims".into()));
        }
        return checked(cfg.clone());
    }
    if !cfg.sm90_schedule.intra_wg_overlap {
        return Err(unsupported(
            "the forward without intra-warpgroup overlap takes no paged cache".into(),
        ));
    }
    let Some(base) = key_block(Family::Sm90Fwd, TileRole::Base) else {
        return Err(unsupported("no Hopper forward at these head dims".into()));
    };
    // The Masked tile where the Base tile's blocks do not fill the pages but its narrower ones do
    // (whole blocks loading as one box each), or where only its blocks take wide pieces: as the
    // launcher chooses (run_fwd_tiled).
    let wide = |block: usize| block % WIDE_PIECE_ROWS == 0 && page_size % WIDE_PIECE_ROWS == 0;
    let schedule = match key_block(Family::Sm90Fwd, TileRole::Masked) {
        Some(masked)
            if page_size % base != 0
                && (page_size % masked == 0 || (wide(masked) && !wide(base))) =>
        {
            Sm90Schedule {
                narrow_key_blocks: true,
                ..cfg.sm90_schedule
            }
        }
        _ => cfg.sm90_schedule,
    };
    checked(cfg.clone().sm90_schedule(schedule))
}

/// How the Hopper forward runs a KV-cache call's tiles: the query heads of a group packed as the
/// schedule's `pack_gqa` says (with intra-warpgroup overlap: the kernel that packs has it), and
/// the caller's key splits. Sm80 drops the packing (the same results); asked of `Backend::Sm80`,
/// more than one split is refused (`Auto`, falling back to Sm80, drops them).
fn cache_tiles(
    cfg: &AttentionConfig,
    seqlen_q: usize,
    heads_q: usize,
    heads_kv: usize,
    num_splits: usize,
) -> Result<CacheTiles> {
    if num_splits > 256 {
        return Err(Error::InvalidConfig(format!(
            "num_splits is {num_splits}; at most 256 (0 lets the launcher choose)"
        )));
    }
    if num_splits > 1 && cfg.backend == Backend::Sm80 {
        return Err(Error::Unsupported {
            what: format!("{num_splits} key splits (the Hopper forward has them)"),
            backend: Backend::Sm80,
        });
    }
    let group = heads_q.checked_div(heads_kv).unwrap_or(1);
    let schedule = &cfg.sm90_schedule;
    Ok(CacheTiles {
        pack_gqa: schedule.intra_wg_overlap && schedule.pack_gqa.packs(seqlen_q, group),
        num_splits: Some(num_splits),
    })
}

/// The first `batch` entries of a dense cache.
fn used(layout: &Layout, batch: usize) -> Layout {
    let [_, rows, heads, d] = layout.shape;
    Layout::with_strides([batch, rows, heads, d], layout.strides)
}

/// Is a cache of `C` under rows of `T` an e4m3 one? A cache holds `T`, or e4m3 under 16-bit
/// rows (else `Error::InvalidConfig`).
fn e4m3_cache<T: Element, C: Element>() -> Result<bool> {
    let e4m3 = C::DTYPE == DType::E4M3 && T::DTYPE != DType::E4M3;
    if !e4m3 && C::DTYPE != T::DTYPE {
        return Err(Error::InvalidConfig(format!(
            "a KV cache of {:?} under Q of {:?} (the cache holds Q's type, or e4m3)",
            C::DTYPE,
            T::DTYPE
        )));
    }
    Ok(e4m3)
}

/// A call's cache descales as the kernels take them, `[k, v]`: an e4m3 cache's, `batch ×
/// heads_kv` values each; a 16-bit cache takes none (`refusal`).
fn cache_descales<'a>(
    descales: Option<DeviceCacheDescales<'a>>,
    e4m3: bool,
    batch: usize,
    heads_kv: usize,
    refusal: impl FnOnce() -> Error,
) -> Result<Option<[&'a CudaView<'a, f32>; 2]>> {
    match descales {
        None => Ok(None),
        Some(_) if !e4m3 => Err(refusal()),
        Some(DeviceCacheDescales { k, v }) => {
            kvcache::check_descale_counts([k.len(), v.len()], batch, heads_kv)?;
            Ok(Some([k, v]))
        }
    }
}

/// A KV-cache forward's shapes, as [`Device::cache_rows`] takes them.
struct CacheCall<'a> {
    q: &'a Layout,
    k_cache: &'a Layout,
    v_cache: &'a Layout,
    table: Option<CudaView<'a, i32>>,
    seqlens: usize,
    num_splits: usize,
    dtype: DType,
}

/// What a KV-cache forward writes, and its sinks, as [`Device::cache_rows`] checks them: O's
/// layout and length, the LSE's length, the sinks' count.
struct CacheOutputs<'a> {
    out: &'a Layout,
    out_len: usize,
    lse_len: usize,
    sinks: Option<usize>,
}

/// How the packed kernels take a KV-cache call: Q's and O's rows, the tiles, and the keys.
struct CacheRows<'a> {
    q: Layout,
    out: Layout,
    tiles: CacheTiles,
    keys: CacheKeys<'a>,
}

enum CacheKeys<'a> {
    /// The pages, and the configuration that serves them.
    Pages(DevicePages<'a>, AttentionConfig),
    /// The first `batch` entries of a dense cache as rows.
    Rows { k: Layout, v: Layout },
}

impl Device {
    /// `b · n` for b in `0..=batch` on the device, as the first `batch + 1` values of an array
    /// the device keeps for every `n` it has seen (of at least twice the last batch when a
    /// larger one comes; the smaller arrays stay, since work queued earlier, or a captured
    /// graph, may still read them): a decoding loop's calls upload nothing. The first upload
    /// of an `n` is ordered on `stream`, and cudarc orders later calls on any stream after it.
    fn uniform_offsets(
        &self,
        stream: &Arc<CudaStream>,
        batch: usize,
        n: usize,
    ) -> Result<Arc<CudaSlice<i32>>> {
        let lock = || {
            self.uniform_offsets
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
        };
        let fits =
            |arrays: &Vec<Arc<CudaSlice<i32>>>| arrays.last().filter(|a| a.len() > batch).cloned();
        if let Some(offsets) = lock().get(&n).and_then(fits) {
            return Ok(offsets);
        }
        // Uploaded without the lock: a copy waits for its stream, which other threads' calls
        // need not.
        // Room to grow, within i32 offsets.
        let grown = lock()
            .get(&n)
            .and_then(|a| a.last())
            .map_or(0, |a| 2 * a.len());
        let count = batch.max(grown.min(i32::MAX as usize / n.max(1)));
        let cu: Vec<i32> = (0..=count)
            .map(|b| i32::try_from(b * n))
            .collect::<std::result::Result<_, _>>()
            .map_err(|_| Error::IndexOverflow {
                operand: Operand::Q,
                detail: format!("{batch} sequences of {n} rows pass i32 offsets"),
            })?;
        let uploaded = Arc::new(stream.clone_htod(&cu).map_err(super::driver_error)?);
        let mut kept = lock();
        let arrays = kept.entry(n).or_default();
        if let Some(offsets) = fits(arrays) {
            return Ok(offsets); // another thread's came first
        }
        arrays.push(uploaded.clone());
        Ok(uploaded)
    }

    /// The block table a forward over a cache reads by: `table`, or for a dense e4m3 cache (read
    /// as pages of its entries, sequence `b`'s entry `b`) the kept offsets of one row each,
    /// `0, 1, 2, ...`, which the caller slices to `batch` values and keeps while they are used.
    fn identity_pages(
        &self,
        stream: &Arc<CudaStream>,
        table: &Option<CudaView<i32>>,
        k_cache: &Layout,
        batch: usize,
        e4m3: bool,
    ) -> Result<Option<Arc<CudaSlice<i32>>>> {
        if table.is_some() || !e4m3 {
            return Ok(None);
        }
        let [entries, rows, heads_kv, head_dim] = k_cache.shape;
        if entries < batch {
            return Err(Error::ShapeMismatch {
                operand: Operand::K,
                expected: [batch, rows, heads_kv, head_dim],
                found: k_cache.shape,
            });
        }
        self.uniform_offsets(stream, batch, 1).map(Some)
    }

    /// A KV-cache forward as the packed kernels take it, and every refusal of it that needs no
    /// plan (its shapes, O's and the LSE's, the sinks' count, the rows, the page size, the
    /// splits): a step runs it before it writes the cache.
    fn cache_rows<'a>(
        &self,
        cfg: &AttentionConfig,
        call: CacheCall<'a>,
        outputs: CacheOutputs<'_>,
    ) -> Result<CacheRows<'a>> {
        let CacheOutputs {
            out,
            out_len,
            lse_len,
            sinks,
        } = outputs;
        let [batch, seqlen_q, heads_q, head_dim] = call.q.shape;
        let [entries, cache_rows, heads_kv, _] = call.k_cache.shape;
        let head_dim_v = call.v_cache.shape[3];
        if call.seqlens != batch {
            return Err(Error::InvalidSeqlens(format!(
                "cache_seqlens has {} values for {batch} sequences",
                call.seqlens
            )));
        }
        Problem::expect_shape(
            Operand::K,
            call.k_cache,
            [entries, cache_rows, heads_kv, head_dim],
        )?;
        Problem::expect_shape(
            Operand::V,
            call.v_cache,
            [entries, cache_rows, heads_kv, head_dim_v],
        )?;
        // Sizes and the GQA group, as the forward's problem has them.
        let problem = Problem {
            batch,
            seqlen_q,
            seqlen_k: cache_rows,
            heads_q,
            heads_kv,
            head_dim,
            head_dim_v,
            dtype: call.dtype,
            packed: false,
        };
        problem.validate()?;
        Problem::expect_shape(Operand::Out, out, [batch, seqlen_q, heads_q, head_dim_v])?;
        tensor::check_output_len(Operand::Out, out, out_len)?;
        problem.check_lse_len(lse_len)?;
        tensor::check_sinks(&problem, sinks, None)?;
        let keys = match call.table {
            Some(table) => {
                let hopper = (self.info.major, self.info.minor) == (9, 0);
                let backend = match cfg.backend {
                    Backend::Auto | Backend::Sm90 if hopper => Backend::Sm90,
                    Backend::Auto | Backend::Sm80 if self.info.major >= 8 => Backend::Sm80,
                    _ => {
                        return Err(Error::Unsupported {
                            what: format!(
                                "a paged KV cache (or cache_batch_idx, which runs the dense \
                                 cache as pages) on {:?} of sm_{}{} (the Hopper and Ampere \
                                 forwards take it)",
                                cfg.backend, self.info.major, self.info.minor
                            ),
                            backend: cfg.backend,
                        })
                    }
                };
                let (pages, cfg) = pages(call.k_cache, head_dim_v, table, batch, cfg, backend)?;
                CacheKeys::Pages(pages, cfg)
            }
            None => {
                if entries < batch {
                    return Err(Error::ShapeMismatch {
                        operand: Operand::K,
                        expected: [batch, cache_rows, heads_kv, head_dim],
                        found: call.k_cache.shape,
                    });
                }
                CacheKeys::Rows {
                    k: as_rows(Operand::K, &used(call.k_cache, batch))?,
                    v: as_rows(Operand::V, &used(call.v_cache, batch))?,
                }
            }
        };
        Ok(CacheRows {
            q: as_rows(Operand::Q, call.q)?,
            out: as_rows(Operand::Out, out)?,
            tiles: cache_tiles(cfg, seqlen_q, heads_q, heads_kv, call.num_splits)?,
            keys,
        })
    }

    /// Forward pass over a dense or paged KV cache into caller-owned device outputs, ordered on
    /// `stream`: O `(batch, seqlen_q, heads_q, head_dim_v)` and `lse` f32
    /// `(batch, heads_q, seqlen_q)` as [`crate::kvcache`] describes (each sequence's queries the
    /// last positions of its first `cache_seqlens[b]` cached keys: masks align bottom-right
    /// within them). It runs the packed kernels ([`Device::varlen_forward_into`]) with `batch`
    /// sequences and `cache_seqlens` as their used keys, over the cache's entries or pages; the
    /// offsets of that call (arrays of `b · n`) are copied to the device on `stream` the first
    /// time a length `n` (or a larger batch) comes, and kept: capture a call into a CUDA graph
    /// only after a call of its shape has run outside the capture. Q, O and a dense cache must
    /// hold their entries' rows one after the other (batch stride = rows × row stride), which
    /// one-row Q and O (a decode step's) need not. Paged caches of any page size run on the Hopper
    /// and the Ampere forward. An e4m3 cache (`C` = `float8::F8E4M3`) runs on either, always as
    /// pages (a dense one's entries its pages, as with `cache_batch_idx`).
    pub fn kvcache_forward_into<T: Element + DeviceRepr, C: Element + DeviceRepr>(
        &self,
        stream: &Arc<CudaStream>,
        cfg: &AttentionConfig,
        inputs: DeviceKvCacheInputs<'_, T, C>,
        out: &mut DeviceTensorMut<T>,
        lse: &mut CudaViewMut<f32>,
    ) -> Result<Plan> {
        let DeviceKvCacheInputs {
            q,
            k_cache,
            v_cache,
            block_table,
            cache_batch_idx,
            cache_seqlens,
            sinks,
            num_splits,
            descales,
        } = inputs;
        // Before anything is uploaded on it.
        self.check_same_context(stream, [(Operand::Q, q.data.stream().context())])?;
        let batch = q.layout.shape[0];
        let e4m3 = e4m3_cache::<T, C>()?;
        let e4m3_descales = cache_descales(descales, e4m3, batch, k_cache.layout.shape[2], || {
            Error::Unsupported {
                what: "descales of a 16-bit KV cache on the GPU (the CPU takes them: \
                           kvcache::forward)"
                    .into(),
                backend: cfg.backend,
            }
        })?;
        // An e4m3 cache is read as pages: a dense one's entries.
        let table = cache_table(block_table, cache_batch_idx, batch)?;
        let identity = self.identity_pages(stream, &table, &k_cache.layout, batch, e4m3)?;
        let table = table.or_else(|| identity.as_ref().map(|i| i.slice(..batch)));
        let rows = self.cache_rows(
            cfg,
            CacheCall {
                q: &q.layout,
                k_cache: &k_cache.layout,
                v_cache: &v_cache.layout,
                table,
                seqlens: cache_seqlens.len(),
                num_splits,
                dtype: T::DTYPE,
            },
            CacheOutputs {
                out: &out.layout,
                out_len: out.data.len(),
                lse_len: lse.len(),
                sinks: sinks.map(|s| s.len()),
            },
        )?;
        let seqlen_q = q.layout.shape[1];
        let q_rows = DeviceTensor::new(q.data.slice(..), rows.q);
        let mut o_rows = DeviceTensorMut::new(out.data.slice_mut(..), rows.out);
        let q_offsets = self.uniform_offsets(stream, batch, seqlen_q)?;
        let cu_q = q_offsets.slice(..=batch);
        let (k_layout, v_layout) = match rows.keys {
            CacheKeys::Pages(pages, cfg) => {
                let seqs = DeviceSeqlens::paged(cu_q, seqlen_q, pages, cache_seqlens)?
                    .with_lse_by_sequence()
                    .with_cache_tiles(rows.tiles);
                let kv = KeysValues {
                    k: k_cache,
                    v: v_cache,
                    e4m3_descales,
                };
                return self.forward_launch_over(
                    stream,
                    &cfg,
                    Some(&seqs),
                    (&q_rows, kv, sinks),
                    &mut o_rows,
                    lse,
                );
            }
            CacheKeys::Rows { k, v } => (k, v),
        };
        let k_rows = DeviceTensor::new(k_cache.data.slice(..), k_layout);
        let v_rows = DeviceTensor::new(v_cache.data.slice(..), v_layout);
        let seqlen_cache = k_cache.layout.shape[1];
        let k_offsets = self.uniform_offsets(stream, batch, seqlen_cache)?;
        let cu_k = k_offsets.slice(..=batch);
        let seqs = DeviceSeqlens::new(cu_q, cu_k, seqlen_q, seqlen_cache)?
            .with_seqused_k(cache_seqlens)?
            .with_lse_by_sequence()
            .with_cache_tiles(rows.tiles);
        let kv = KeysValues {
            k: &k_rows,
            v: &v_rows,
            e4m3_descales: None,
        };
        self.forward_launch_over(
            stream,
            cfg,
            Some(&seqs),
            (&q_rows, kv, sinks),
            &mut o_rows,
            lse,
        )
    }
}

impl Device {
    /// Appends new keys and values to a KV cache on the device, ordered on `stream`
    /// ([`DeviceKvCacheAppend`]).
    pub fn kvcache_append<T: Element + DeviceRepr, C: Element + DeviceRepr>(
        &self,
        stream: &Arc<CudaStream>,
        append: DeviceKvCacheAppend<'_, '_, T, C>,
    ) -> Result<()> {
        let DeviceKvCacheAppend {
            k_cache,
            v_cache,
            block_table,
            cache_batch_idx,
            cache_seqlens,
            k_new,
            v_new,
            rotary,
            descales,
        } = append;
        let table = cache_table(block_table, cache_batch_idx, k_new.layout.shape[0])?;
        self.launch_append(
            stream,
            [k_cache, v_cache],
            table.as_ref(),
            &cache_seqlens,
            (k_new, v_new),
            AppendExtras {
                rotary: rotary.as_ref(),
                descales,
                q_rot: None,
                seqlens_out: None,
            },
        )
    }

    /// One step over a KV cache on the device into caller-owned outputs, ordered on `stream`
    /// ([`DeviceKvCacheStep`]; O and the LSE as [`Device::kvcache_forward_into`] writes them).
    /// With new keys it takes device memory for the step's key counts (and with rotary
    /// embedding for the rotated Q), given back in stream order. Everything the forward checks
    /// (shapes, lengths, devices, alignment, the sinks' count, the page size, the splits) is
    /// checked before the cache is written (the devices before anything is uploaded), but the
    /// forward's plan (a head dim or backend this build lacks): such an error leaves the new
    /// rows in the cache.
    pub fn kvcache_step_into<T: Element + DeviceRepr, C: Element + DeviceRepr>(
        &self,
        stream: &Arc<CudaStream>,
        cfg: &AttentionConfig,
        step: DeviceKvCacheStep<'_, '_, T, C>,
        out: &mut DeviceTensorMut<T>,
        lse: &mut CudaViewMut<f32>,
    ) -> Result<Plan> {
        let DeviceKvCacheStep {
            q,
            k_cache,
            v_cache,
            block_table,
            cache_batch_idx,
            cache_seqlens,
            new,
            rotary,
            sinks,
            num_splits,
            descales,
        } = step;
        let [batch, seqlen_q, heads_q, head_dim] = q.layout.shape;
        // Before anything is uploaded on `stream` or the cache written: the devices of what the
        // step's forward reads beside the cache (the append checks the cache's and the new
        // rows') and of what it writes, and the alignment of Q (unless the forward reads a
        // rotated copy of it) and of O.
        let mut contexts = vec![
            (CallPart::from(Operand::Q), q.data.stream().context()),
            (Operand::Out.into(), out.data.stream().context()),
            (Operand::Lse.into(), lse.stream().context()),
            (CallPart::Seqlens, cache_seqlens.stream().context()),
        ];
        contexts.extend(sinks.map(|s| (Operand::Sinks.into(), s.stream().context())));
        contexts.extend(
            [&block_table, &cache_batch_idx]
                .into_iter()
                .flatten()
                .map(|t| (CallPart::Seqlens, t.stream().context())),
        );
        self.check_same_context(stream, contexts)?;
        if rotary.is_none() {
            check_aligned(stream, &[(Operand::Q, q)])?;
        }
        check_aligned_out(stream, Operand::Out, out)?;
        let e4m3 = e4m3_cache::<T, C>()?;
        if descales.is_some() && !e4m3 {
            return Err(Error::InvalidConfig(
                "descales in a step over a 16-bit cache (they are an e4m3 cache's)".into(),
            ));
        }
        let block_table = cache_table(block_table, cache_batch_idx, batch)?;
        if new.is_none() && rotary.is_some() {
            return Err(Error::InvalidConfig(
                "rotary embedding without new keys: it rotates the keys a step appends".into(),
            ));
        }
        let forward = |dev: &Self,
                       q: &DeviceTensor<T>,
                       seqlens: CudaView<i32>,
                       k_cache: &DeviceTensorMut<C>,
                       v_cache: &DeviceTensorMut<C>,
                       out: &mut DeviceTensorMut<T>,
                       lse: &mut CudaViewMut<f32>| {
            let k = DeviceTensor::new(k_cache.data.slice(..), k_cache.layout);
            let v = DeviceTensor::new(v_cache.data.slice(..), v_cache.layout);
            let inputs = DeviceKvCacheInputs {
                q,
                k_cache: &k,
                v_cache: &v,
                block_table: block_table.as_ref().map(|t| t.slice(..)),
                cache_batch_idx: None,
                cache_seqlens: seqlens,
                sinks,
                num_splits,
                descales,
            };
            dev.kvcache_forward_into(stream, cfg, inputs, out, lse)
        };
        let Some(new) = new else {
            return forward(self, q, cache_seqlens, k_cache, v_cache, out, lse);
        };
        // The forward's refusals that need no plan, before the cache is written.
        tensor::check_len(Operand::Q, &q.layout, q.data.len())?;
        let identity = self.identity_pages(stream, &block_table, &k_cache.layout, batch, e4m3)?;
        self.cache_rows(
            cfg,
            CacheCall {
                q: &q.layout,
                k_cache: &k_cache.layout,
                v_cache: &v_cache.layout,
                table: block_table
                    .as_ref()
                    .map(|t| t.slice(..))
                    .or_else(|| identity.as_ref().map(|i| i.slice(..batch))),
                seqlens: cache_seqlens.len(),
                num_splits,
                dtype: T::DTYPE,
            },
            CacheOutputs {
                out: &out.layout,
                out_len: out.data.len(),
                lse_len: lse.len(),
                sinks: sinks.map(|s| s.len()),
            },
        )?;
        let mut lens = stream.alloc_zeros::<i32>(batch).map_err(driver_error)?;
        let mut q_rot = match rotary {
            // SAFETY: the append launch writes every element (each head's row whole) before
            // the forward reads it, in stream order.
            Some(_) => Some(
                unsafe { stream.alloc::<T>(batch * seqlen_q * heads_q * head_dim) }
                    .map_err(driver_error)?,
            ),
            None => None,
        };
        // A sequence's capacity: the dense cache's rows, or its pages' (a dense cache with
        // cache_batch_idx: one page, an entry, a sequence).
        let pages = match &block_table {
            Some(t) => pages_per_seq(t.len(), batch)?,
            None => 1,
        };
        let capacity = k_cache.layout.shape[1].saturating_mul(pages);
        let same_position = kvcache::queries_at_one_position(cfg.mask, capacity, seqlen_q);
        self.launch_append(
            stream,
            [&mut *k_cache, &mut *v_cache],
            block_table.as_ref(),
            &cache_seqlens,
            new,
            AppendExtras {
                rotary: rotary.as_ref(),
                descales,
                q_rot: q_rot.as_mut().map(|out| RotatedQ {
                    q,
                    out,
                    same_position,
                }),
                seqlens_out: Some(&mut lens),
            },
        )?;
        let rotated;
        let q = match &q_rot {
            Some(buf) => {
                rotated = DeviceTensor::contiguous(buf, q.layout.shape);
                &rotated
            }
            None => q,
        };
        forward(self, q, lens.slice(..), k_cache, v_cache, out, lse)
    }

    /// Checks and launches one append step (flashattn_kvcache_append): the new rows into the
    /// cache (quantized by the descales into an e4m3 one), Q rotated into `q_rot`, the step's
    /// key counts into `seqlens_out`.
    fn launch_append<T: Element + DeviceRepr, C: Element + DeviceRepr>(
        &self,
        stream: &Arc<CudaStream>,
        [k_cache, v_cache]: [&mut DeviceTensorMut<C>; 2],
        block_table: Option<&CudaView<i32>>,
        cache_seqlens: &CudaView<i32>,
        (k_new, v_new): (&DeviceTensor<T>, &DeviceTensor<T>),
        extras: AppendExtras<T>,
    ) -> Result<()> {
        let AppendExtras {
            rotary,
            descales,
            q_rot,
            seqlens_out,
        } = extras;
        let e4m3 = e4m3_cache::<T, C>()?;
        if !matches!(T::DTYPE, DType::F16 | DType::BF16) {
            return Err(Error::Unsupported {
                what: format!("a KV-cache append of {:?} on the GPU", T::DTYPE),
                backend: Backend::Auto,
            });
        }
        let mut contexts = vec![
            (Operand::K, k_cache.data.stream().context()),
            (Operand::V, v_cache.data.stream().context()),
            (Operand::K, k_new.data.stream().context()),
            (Operand::V, v_new.data.stream().context()),
        ];
        if let Some(r) = rotary {
            contexts.push((Operand::Q, r.cos.stream().context()));
            contexts.push((Operand::Q, r.sin.stream().context()));
        }
        if let Some(r) = &q_rot {
            contexts.push((Operand::Q, r.q.data.stream().context()));
        }
        if let Some(DeviceCacheDescales { k, v }) = descales {
            contexts.push((Operand::K, k.stream().context()));
            contexts.push((Operand::V, v.stream().context()));
        }
        self.check_same_context(stream, contexts)?;
        let mut seqlens = vec![cache_seqlens.stream().context()];
        seqlens.extend(block_table.map(|t| t.stream().context()));
        self.check_same_context(
            stream,
            seqlens.into_iter().map(|c| (super::CallPart::Seqlens, c)),
        )?;

        tensor::check_output_len(Operand::K, &k_cache.layout, k_cache.data.len())?;
        tensor::check_output_len(Operand::V, &v_cache.layout, v_cache.data.len())?;
        tensor::check_len(Operand::K, &k_new.layout, k_new.data.len())?;
        tensor::check_len(Operand::V, &v_new.layout, v_new.data.len())?;
        let [entries, cache_rows, heads_kv, head_dim] = k_cache.layout.shape;
        let head_dim_v = v_cache.layout.shape[3];
        let batch = k_new.layout.shape[0];
        let seqlen_new = kvcache::check_new_rows(
            [&k_cache.layout, &v_cache.layout],
            [&k_new.layout, &v_new.layout],
            batch,
        )?;
        let descales = cache_descales(descales, e4m3, batch, heads_kv, || {
            Error::InvalidConfig(
                "descales in an append to a 16-bit cache (they are an e4m3 cache's)".into(),
            )
        })?;
        if cache_seqlens.len() != batch {
            return Err(Error::InvalidSeqlens(format!(
                "cache_seqlens has {} values for {batch} sequences",
                cache_seqlens.len()
            )));
        }
        let max_pages = match block_table {
            Some(t) => pages_per_seq(t.len(), batch)?,
            None if entries < batch => {
                return Err(Error::ShapeMismatch {
                    operand: Operand::K,
                    expected: [batch, cache_rows, heads_kv, head_dim],
                    found: k_cache.layout.shape,
                })
            }
            None => 0,
        };
        if let Some(r) = rotary {
            kvcache::check_rotary(r.dim, [r.cos.len(), r.sin.len()], head_dim)?;
        }
        if head_dim.max(head_dim_v) > 512 {
            return Err(Error::Unsupported {
                what: format!(
                    "a KV-cache append at head dims ({head_dim}, {head_dim_v}) (at most 512)"
                ),
                backend: Backend::Auto,
            });
        }
        // Every count the kernel takes in i32, with room for a row number past the capacity,
        // and its rows (new keys, new values, Q's) numbered in i32 too.
        let seqlen_q = q_rot.as_ref().map_or(0, |r| r.q.layout.shape[1]);
        let capacity = cache_rows.checked_mul(max_pages.max(1));
        let fits = |n: usize| i32::try_from(n).is_ok();
        let kv_rows = batch
            .checked_mul(seqlen_new)
            .and_then(|n| n.checked_mul(heads_kv));
        let within = capacity
            .and_then(|c| c.checked_add(seqlen_new.max(seqlen_q)))
            .is_some_and(fits)
            && kv_rows.is_some_and(fits)
            && [batch, entries, max_pages, heads_kv].into_iter().all(fits)
            && rotary.is_none_or(|r| fits(r.cos.len() / (r.dim / 2)));
        if !within {
            return Err(Error::IndexOverflow {
                operand: Operand::K,
                detail: format!(
                    "a KV-cache append of {batch} sequences of {seqlen_new} rows into \
                     {entries} × {cache_rows} rows"
                ),
            });
        }

        let (size, cache_size) = (std::mem::size_of::<T>(), std::mem::size_of::<C>());
        let (kc_ptr, _kc) = k_cache.data.device_ptr_mut(stream);
        let (vc_ptr, _vc) = v_cache.data.device_ptr_mut(stream);
        let (kn_ptr, _kn) = k_new.data.device_ptr(stream);
        let (vn_ptr, _vn) = v_new.data.device_ptr(stream);
        let (len_ptr, _len) = cache_seqlens.device_ptr(stream);
        let (table_ptr, _table) = block_table.map(|t| t.device_ptr(stream)).unzip();
        let (cos_ptr, _cos) = rotary.map(|r| r.cos.device_ptr(stream)).unzip();
        let (sin_ptr, _sin) = rotary.map(|r| r.sin.device_ptr(stream)).unzip();
        let (out_ptr, _out) = seqlens_out.map(|s| s.device_ptr_mut(stream)).unzip();
        let (kd_ptr, _kd) = descales.map(|[k, _]| k.device_ptr(stream)).unzip();
        let (vd_ptr, _vd) = descales.map(|[_, v]| v.device_ptr(stream)).unzip();
        let raw_of = |size| {
            move |operand, ptr, layout: &Layout| {
                RawTensor {
                    ptr,
                    layout: *layout,
                }
                .aligned_ffi(operand, size)
            }
        };
        let (raw, raw_cache) = (raw_of(size), raw_of(cache_size));
        let none = gpu::NO_TENSOR;
        let (mut q_in, mut q_out, mut heads_q, mut same_position) = (none, none, 0, false);
        let mut _q_guards = None;
        if let Some(RotatedQ {
            q,
            out,
            same_position: same,
        }) = q_rot
        {
            tensor::check_len(Operand::Q, &q.layout, q.data.len())?;
            let [qb, _, hq, qd] = q.layout.shape;
            if qb != batch || qd != head_dim || rotary.is_none() || !fits(qb * seqlen_q * hq) {
                return Err(Error::InvalidConfig(format!(
                    "Q {:?} rotated for {batch} sequences at head dim {head_dim}",
                    q.layout.shape
                )));
            }
            let out_layout = Layout::contiguous(q.layout.shape);
            tensor::check_output_len(Operand::Q, &out_layout, out.len())?;
            let (qp, qg) = q.data.device_ptr(stream);
            let (op, og) = out.device_ptr_mut(stream);
            q_in = raw(Operand::Q, qp, &q.layout)?;
            q_out = raw(Operand::Q, op, &out_layout)?;
            (heads_q, same_position) = (hq, same);
            _q_guards = Some((qg, og));
        }
        let p = ffi::flashattn_kvcache_append_t {
            k_new: raw(Operand::K, kn_ptr, &k_new.layout)?,
            v_new: raw(Operand::V, vn_ptr, &v_new.layout)?,
            k_cache: raw_cache(Operand::K, kc_ptr, &k_cache.layout)?,
            v_cache: raw_cache(Operand::V, vc_ptr, &v_cache.layout)?,
            dtype: gpu::ffi_dtype(T::DTYPE),
            batch: batch as i32,
            seqlen_new: seqlen_new as i32,
            heads_kv: heads_kv as i32,
            head_dim: head_dim as i32,
            head_dim_v: head_dim_v as i32,
            entries: entries as i32,
            cache_rows: cache_rows as i32,
            cache_seqlens: len_ptr as *const i32,
            page_table: table_ptr.unwrap_or(0) as *const i32,
            max_pages: max_pages as i32,
            seqlens_out: out_ptr.unwrap_or(0) as *mut i32,
            rotary_cos: cos_ptr.unwrap_or(0) as *const f32,
            rotary_sin: sin_ptr.unwrap_or(0) as *const f32,
            rotary_dim: rotary.map_or(0, |r| r.dim) as i32,
            rotary_positions: rotary.map_or(0, |r| r.cos.len() / (r.dim / 2)) as i32,
            rotary_interleaved: rotary.is_some_and(|r| r.interleaved) as i32,
            q: q_in,
            q_out,
            seqlen_q: seqlen_q as i32,
            heads_q: heads_q as i32,
            q_same_position: same_position as i32,
            cache_e4m3: e4m3 as i32,
            k_descale: kd_ptr.unwrap_or(0) as *const f32,
            v_descale: vd_ptr.unwrap_or(0) as *const f32,
        };
        self.ctx.bind_to_thread().map_err(driver_error)?;
        // SAFETY: every pointer is a live device buffer of this context whose guard outlives the
        // launch; the layouts were checked against their buffers' lengths and the counts against
        // i32 above, and the entry point checks the views again before it launches.
        let r = unsafe {
            ffi::flashattn_kvcache_append(&p, stream.cu_stream() as *mut std::ffi::c_void)
        };
        ffi::check(r, Backend::Auto, "KV-cache append")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_become_one_sequence_of_rows() {
        // Contiguous (batch 3, 5 rows, 2 heads, 8): 15 rows of 16.
        let l = Layout::contiguous([3, 5, 2, 8]);
        let p = as_rows(Operand::K, &l).unwrap();
        assert_eq!((p.shape, p.strides), ([1, 15, 2, 8], [240, 16, 8, 1]));
        // One row per entry at a padded batch stride (a decode step's Q from a longer tensor).
        let q = Layout::with_strides([4, 1, 2, 8], [160, 16, 8, 1]);
        let p = as_rows(Operand::Q, &q).unwrap();
        assert_eq!((p.shape, p.strides), ([1, 4, 2, 8], [640, 160, 8, 1]));
        // Several rows per entry, entries apart: refused.
        let gap = Layout::with_strides([3, 5, 2, 8], [100, 16, 8, 1]);
        assert!(matches!(
            as_rows(Operand::K, &gap),
            Err(Error::Unsupported { .. })
        ));
        // Counts past usize: a typed error, not a wrap.
        let huge = Layout::with_strides([usize::MAX / 2, 4, 1, 1], [4, 1, 1, 1]);
        assert!(matches!(
            as_rows(Operand::K, &huge),
            Err(Error::IndexOverflow { .. })
        ));
    }
}
