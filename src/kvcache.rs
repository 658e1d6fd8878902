//! Attention over a KV cache, as serving runs it: each sequence's queries attend to the first
//! `cache_seqlens[b]` keys of its cache, in the spirit of FlashAttention's
//! `flash_attn_with_kvcache`.
//!
//! Q is `(batch, seqlen_q, heads_q, head_dim)`: the last `seqlen_q` positions of each sequence,
//! so causal and window masks align bottom-right with the sequence's cached keys, as in a dense
//! call with `seqlen_q ≤ seqlen_k`. The cache is one of
//! - dense: K `(batch_cache, seqlen_cache, heads_kv, head_dim)` and V with `head_dim_v`;
//!   sequence `b` reads entry `cache_batch_idx[b]` (entry `b` without it);
//! - paged: K `(num_pages, page_size, heads_kv, head_dim)` and V alike, with a block table of
//!   `batch × max_pages` page numbers (row-major): key `j` of sequence `b` lies in page
//!   `block_table[b · max_pages + j / page_size]`, row `j % page_size`.
//!
//! The cache holds Q's element type, or FP8 e4m3 (`float8::F8E4M3`) with descales
//! ([`CacheDescales`], flash-attn's `k_descale` and `v_descale`: one f32 per sequence and KV head
//! that its stored keys and values are multiplied by): the call attends to the dequantized cache
//! (the f32 products), O in Q's type; [`append_fp8`] stores new rows into such a cache by the
//! descales, and [`step`] takes it too.
//!
//! O is `(batch, seqlen_q, heads_q, head_dim_v)`; the LSE is f32 `(batch, heads_q, seqlen_q)`, a
//! dense call's (and `flash_attn_with_kvcache`'s). A sequence
//! with no cached key gets O = 0 and LSE = +inf (its head's sink with attention sinks).
//! [`append`] writes new keys and values after each sequence's cached ones (FlashAttention's
//! `k`, `v` arguments), for a [`forward`] over `cache_seqlens[b] + seqlen_new` keys; [`step`]
//! does both in one call, with rotary embedding ([`Rotary`]) of Q and the new keys at their
//! positions, as `flash_attn_with_kvcache` does.
//!
//! This module runs on the CPU backend (host memory, every value checked on the host);
//! [`crate::cuda::Device::kvcache_forward_into`] runs dense and paged caches of Q's type on the
//! GPU (FP8 caches not yet).
//!
//! ```
//! use flashattn::kvcache::{self, KvCache, KvCacheInputs};
//! use flashattn::{AttentionConfig, TensorRef};
//!
//! // Two sequences decoding one token each over a paged cache of 4 pages of 16 keys.
//! let x = |n: usize| -> Vec<f32> { (0..n).map(|i| (i as f32 * 0.37).sin()).collect() };
//! let (q, cache) = (x(2 * 2 * 8), x(4 * 16 * 2 * 8));
//! let q = TensorRef::contiguous(&q, [2, 1, 2, 8]);
//! let kv = TensorRef::contiguous(&cache, [4, 16, 2, 8]);
//! let table = [3, 1, 0, 2]; // sequence 0: pages 3, 1; sequence 1: pages 0, 2
//! let paged = KvCache::paged(kv, kv, &table, 2);
//! let fwd = kvcache::forward(&AttentionConfig::new().causal(true),
//!                            KvCacheInputs::new(q, paged, &[20, 5]))?;
//! assert_eq!(fwd.lse.len(), 2 * 2); // (batch, heads_q, seqlen_q)
//! # Ok::<(), flashattn::Error>(())
//! ```

use float8::F8E4M3;

use crate::backend;
use crate::config::{AttentionConfig, AttentionMask};
use crate::dispatch::{self, BuiltKernels, Memory, Op};
use crate::error::{Error, Operand, Result};
use crate::fp8;
use crate::tensor::{self, DType, Element, Layout, Problem, TensorMut, TensorRef};
use crate::varlen::{self, Seqlens};
use crate::{alloc, ForwardInputs, ForwardOutput};

/// Where the cached keys and values lie (see the module's documentation), over tensors `X`:
/// read-only ([`KvCache`]) or writable ([`KvCacheMut`], to append to).
#[derive(Clone, Copy, Debug)]
pub enum Cache<'a, X> {
    /// K `(batch_cache, seqlen_cache, heads_kv, head_dim)`, V with its own head dim.
    Dense { k: X, v: X },
    /// K `(num_pages, page_size, heads_kv, head_dim)`, V alike; `block_table` holds
    /// `batch × max_pages` page numbers, row-major.
    Paged {
        k: X,
        v: X,
        block_table: &'a [i32],
        max_pages: usize,
    },
}

/// A cache to attend to.
pub type KvCache<'a, T> = Cache<'a, TensorRef<'a, T>>;

/// A cache to append to.
pub type KvCacheMut<'a, T> = Cache<'a, TensorMut<'a, T>>;

impl<'a, T> KvCache<'a, T> {
    /// A dense cache.
    pub fn dense(k: TensorRef<'a, T>, v: TensorRef<'a, T>) -> Self {
        KvCache::Dense { k, v }
    }

    /// A paged cache: `block_table` of `batch × max_pages` page numbers.
    pub fn paged(
        k: TensorRef<'a, T>,
        v: TensorRef<'a, T>,
        block_table: &'a [i32],
        max_pages: usize,
    ) -> Self {
        KvCache::Paged {
            k,
            v,
            block_table,
            max_pages,
        }
    }

    fn k(&self) -> &TensorRef<'a, T> {
        match self {
            KvCache::Dense { k, .. } | KvCache::Paged { k, .. } => k,
        }
    }

    fn v(&self) -> &TensorRef<'a, T> {
        match self {
            KvCache::Dense { v, .. } | KvCache::Paged { v, .. } => v,
        }
    }

    /// The keys one sequence can hold.
    fn capacity(&self) -> Result<usize> {
        match self {
            KvCache::Dense { k, .. } => Ok(k.layout.shape[1]),
            KvCache::Paged { k, max_pages, .. } => {
                k.layout.shape[1]
                    .checked_mul(*max_pages)
                    .ok_or(Error::IndexOverflow {
                        operand: Operand::K,
                        detail: format!("{max_pages} pages of {} keys", k.layout.shape[1]),
                    })
            }
        }
    }
}

/// A cache's descales, as flash-attn's `k_descale` and `v_descale`: `batch × heads_kv` f32
/// values each, row-major and finite. Sequence `b`'s cached keys of KV head `h` stand for their
/// stored values times `k[b · heads_kv + h]` (by sequence, not by cache entry: with
/// `cache_batch_idx` too), and its values alike times `v[b · heads_kv + h]`.
#[derive(Clone, Copy, Debug)]
pub struct CacheDescales<'a> {
    pub k: &'a [f32],
    pub v: &'a [f32],
}

/// A KV-cache call's inputs: Q, the cache (of Q's element type `T`, or of `C` = e4m3), each
/// sequence's cached key count, and optionally the dense cache's entry per sequence, attention
/// sinks (one logit per query head) and the cache's descales (none: 1).
#[derive(Clone, Copy, Debug)]
pub struct KvCacheInputs<'a, T, C = T> {
    pub q: TensorRef<'a, T>,
    pub cache: KvCache<'a, C>,
    pub cache_seqlens: &'a [i32],
    pub cache_batch_idx: Option<&'a [i32]>,
    pub sinks: Option<&'a [f32]>,
    pub descales: Option<CacheDescales<'a>>,
}

impl<'a, T, C> KvCacheInputs<'a, T, C> {
    pub fn new(q: TensorRef<'a, T>, cache: KvCache<'a, C>, cache_seqlens: &'a [i32]) -> Self {
        KvCacheInputs {
            q,
            cache,
            cache_seqlens,
            cache_batch_idx: None,
            sinks: None,
            descales: None,
        }
    }

    /// The cache's descales (an FP8 cache's quantization scales).
    pub fn with_descales(self, k: &'a [f32], v: &'a [f32]) -> Self {
        KvCacheInputs {
            descales: Some(CacheDescales { k, v }),
            ..self
        }
    }

    /// Sequence `b` reads dense cache entry `cache_batch_idx[b]`.
    pub fn with_cache_batch_idx(self, cache_batch_idx: &'a [i32]) -> Self {
        KvCacheInputs {
            cache_batch_idx: Some(cache_batch_idx),
            ..self
        }
    }

    /// Attention sinks, as [`ForwardInputs::with_sinks`].
    pub fn with_sinks(self, sinks: &'a [f32]) -> Self {
        KvCacheInputs {
            sinks: Some(sinks),
            ..self
        }
    }
}

/// Where keys `keys` of sequence `b` lie: for each, the cache entry (dense: `b`, or
/// `cache_batch_idx[b]`) or page (paged), and the row within it.
fn key_rows<T>(
    cache: &KvCache<T>,
    cache_batch_idx: Option<&[i32]>,
    b: usize,
    keys: std::ops::Range<usize>,
) -> Vec<(usize, usize)> {
    match cache {
        KvCache::Dense { .. } => {
            let entry = cache_batch_idx.map_or(b, |idx| idx[b] as usize);
            keys.map(|j| (entry, j)).collect()
        }
        KvCache::Paged {
            k,
            block_table,
            max_pages,
            ..
        } => {
            let page_size = k.layout.shape[1];
            keys.map(|j| {
                let page = block_table[b * *max_pages + j / page_size] as usize;
                (page, j % page_size)
            })
            .collect()
        }
    }
}

/// The rows `rows` of a tensor gathered into a contiguous `(1, rows.len(), heads, d)` of `U`,
/// row i of head h times `scale(i, h)` (in f32; a scale of 1 between the same types, or into a
/// wider one, copies the values exactly, NaN payloads aside).
fn gather<X: Element, U: Element>(
    t: &TensorRef<X>,
    rows: &[(usize, usize)],
    scale: impl Fn(usize, usize) -> f32,
) -> Result<Vec<U>> {
    let [_, _, heads, d] = t.layout.shape;
    let s = t.layout.strides;
    let mut out = alloc::<U>(rows.len() * heads * d)?;
    for (i, (dst, &(entry, row))) in out.chunks_exact_mut(heads * d).zip(rows).enumerate() {
        for (h, dst) in dst.chunks_exact_mut(d).enumerate() {
            let start = entry * s[0] + row * s[1] + h * s[2];
            let factor = scale(i, h);
            for (y, x) in dst.iter_mut().zip(&t.data[start..start + d]) {
                *y = U::from_f32(x.to_f32() * factor);
            }
        }
    }
    Ok(out)
}

/// Checks a cache against `batch` sequences holding `cache_seqlens` keys, `extra` more to come
/// (an append's): the counts within the capacity, the dense entries or the pages those keys lie
/// in within the cache.
fn check_cache<T>(
    cache: &KvCache<T>,
    batch: usize,
    cache_seqlens: &[i32],
    extra: usize,
    cache_batch_idx: Option<&[i32]>,
) -> Result<()> {
    let k = cache.k();
    k.check(Operand::K)?;
    let [slots, page_rows, heads_kv, head_dim] = k.layout.shape;
    let v = cache.v();
    v.check(Operand::V)?;
    Problem::expect_shape(
        Operand::V,
        &v.layout,
        [slots, page_rows, heads_kv, v.layout.shape[3]],
    )?;
    // The block table's shape first: the capacity counts its pages.
    if let KvCache::Paged {
        block_table,
        max_pages,
        ..
    } = cache
    {
        let needed = batch.checked_mul(*max_pages).ok_or(Error::IndexOverflow {
            operand: Operand::K,
            detail: format!("{batch} sequences of {max_pages} pages"),
        })?;
        if *max_pages == 0 || block_table.len() != needed {
            return Err(Error::InvalidPageTable(format!(
                "{} entries for {batch} sequences of max_pages {max_pages} (need batch × \
                 max_pages, max_pages >= 1)",
                block_table.len()
            )));
        }
    }
    let capacity = cache.capacity()?;
    if cache_seqlens.len() != batch {
        return Err(Error::InvalidSeqlens(format!(
            "cache_seqlens has {} values for {batch} sequences",
            cache_seqlens.len()
        )));
    }
    for (b, &len) in cache_seqlens.iter().enumerate() {
        if len < 0 || len as u64 + extra as u64 > capacity as u64 {
            return Err(Error::InvalidSeqlens(format!(
                "cache_seqlens[{b}] is {len}, outside the cache's 0..={} keys (of {capacity}, \
                 {extra} to be appended)",
                capacity.saturating_sub(extra)
            )));
        }
    }
    match (cache, cache_batch_idx) {
        (KvCache::Dense { .. }, Some(idx)) => {
            if idx.len() != batch {
                return Err(Error::InvalidSeqlens(format!(
                    "cache_batch_idx has {} values for {batch} sequences",
                    idx.len()
                )));
            }
            if let Some((b, &e)) = idx
                .iter()
                .enumerate()
                .find(|(_, &e)| e < 0 || e as u64 >= slots as u64)
            {
                return Err(Error::InvalidPageTable(format!(
                    "cache_batch_idx[{b}] is {e}, outside the cache's {slots} entries"
                )));
            }
        }
        (KvCache::Dense { .. }, None) if slots < batch => {
            return Err(Error::ShapeMismatch {
                operand: Operand::K,
                expected: [batch, page_rows, heads_kv, head_dim],
                found: k.layout.shape,
            });
        }
        (KvCache::Dense { .. }, None) => {}
        (KvCache::Paged { .. }, Some(_)) => {
            return Err(Error::InvalidPageTable(
                "cache_batch_idx with a paged cache: the block table names each sequence's pages"
                    .into(),
            ));
        }
        (
            KvCache::Paged {
                block_table,
                max_pages,
                ..
            },
            None,
        ) => {
            // The pages each sequence's keys lie in must exist; the rest of its row of the
            // table is never read.
            for (b, &len) in cache_seqlens.iter().enumerate() {
                let used = (len as usize + extra).div_ceil(page_rows);
                for (i, &page) in block_table[b * max_pages..][..used].iter().enumerate() {
                    if page < 0 || page as u64 >= slots as u64 {
                        return Err(Error::InvalidPageTable(format!(
                            "sequence {b}'s page {i} is {page}, outside the cache's {slots} pages"
                        )));
                    }
                }
            }
        }
    }
    Ok(())
}

/// Checks the inputs against each other on the host; the call's problem (its keys the longest
/// sequence's) and plan.
fn plan<T: Element, C: Element>(
    cfg: &AttentionConfig,
    inputs: &KvCacheInputs<T, C>,
) -> Result<(Problem, dispatch::Plan)> {
    if C::DTYPE != T::DTYPE && C::DTYPE != DType::E4M3 {
        return Err(Error::Unsupported {
            what: format!(
                "a KV cache of {:?} under {:?} queries (the cache holds Q's type or e4m3)",
                C::DTYPE,
                T::DTYPE
            ),
            backend: cfg.backend,
        });
    }
    let (q, k, v) = (&inputs.q, inputs.cache.k(), inputs.cache.v());
    q.check(Operand::Q)?;
    k.check(Operand::K)?;
    v.check(Operand::V)?;
    let [batch, _, _, head_dim] = q.layout.shape;
    let [slots, page_rows, heads_kv, _] = k.layout.shape;
    let head_dim_v = v.layout.shape[3];
    Problem::expect_shape(
        Operand::K,
        &k.layout,
        [slots, page_rows, heads_kv, head_dim],
    )?;
    Problem::expect_shape(
        Operand::V,
        &v.layout,
        [slots, page_rows, heads_kv, head_dim_v],
    )?;
    check_cache(
        &inputs.cache,
        batch,
        inputs.cache_seqlens,
        0,
        inputs.cache_batch_idx,
    )?;
    if let Some(CacheDescales { k, v }) = inputs.descales {
        check_descale_counts([k.len(), v.len()], batch, heads_kv)?;
        for (name, d) in [("k_descale", k), ("v_descale", v)] {
            if let Some(i) = d.iter().position(|x| !x.is_finite()) {
                return Err(Error::InvalidConfig(format!("{name}[{i}] is {}", d[i])));
            }
        }
    }
    // The problem of a dense call over the longest sequence's keys: it checks the heads and
    // sizes and plans the call (each sequence then runs as a dense call of its own).
    let longest = inputs
        .cache_seqlens
        .iter()
        .max()
        .map_or(1, |&l| l.max(1) as usize);
    let as_dense = |d: usize| Layout::contiguous([batch, longest, heads_kv, d]);
    let problem = Problem::from_layouts(
        &q.layout,
        &as_dense(head_dim),
        &as_dense(head_dim_v),
        T::DTYPE,
    )?;
    tensor::check_sinks(&problem, inputs.sinks.map(<[f32]>::len), None)?;
    let plan = dispatch::plan(
        Op::Forward,
        &problem,
        cfg,
        &Memory::Host,
        BuiltKernels::current(),
    )?;
    Ok((problem, plan))
}

/// Forward pass over a KV cache: O `(batch, seqlen_q, heads_q, head_dim_v)` and the LSE
/// `(batch, heads_q, seqlen_q)` (as a dense call's and `flash_attn_with_kvcache`'s). Each
/// sequence's result is that of [`crate::forward`] on its Q and its first `cache_seqlens[b]`
/// cached keys: in Q's type, or over an e4m3 cache or with descales, in f32 over Q and the
/// dequantized keys and values (the f32 products of the stored values and their descales), O
/// then rounded to Q's type.
pub fn forward<T: Element, C: Element>(
    cfg: &AttentionConfig,
    inputs: KvCacheInputs<'_, T, C>,
) -> Result<ForwardOutput<T>> {
    let (shape, plan) = plan(cfg, &inputs)?;
    let (batch, seqlen_q, heads) = (shape.batch, shape.seqlen_q, shape.heads_q);
    let heads_kv = shape.heads_kv;
    let lens = inputs.cache_seqlens;
    if lens.iter().all(|&l| l == 0) {
        // No sequence has a key (a packed call has no empty tensors): O = 0, the keyless LSE.
        let mut lse = alloc::<f32>(heads * batch * seqlen_q)?;
        for (bh, row) in lse.chunks_exact_mut(seqlen_q).enumerate() {
            row.fill(backend::cpu::keyless_lse(
                inputs.sinks.map(|s| s[bh % heads]),
            ));
        }
        let out = alloc::<T>(Layout::contiguous(shape.o_shape()).numel(Operand::Out)?)?;
        return Ok(ForwardOutput { out, lse, plan });
    }
    // The sequences packed one after another: Q's rows, and each sequence's cached keys
    // gathered from its entry or pages; then a packed call (crate::varlen).
    let q_rows: Vec<(usize, usize)> = (0..batch)
        .flat_map(|b| (0..seqlen_q).map(move |i| (b, i)))
        .collect();
    let keys: Vec<(usize, usize)> = (0..batch)
        .flat_map(|b| {
            key_rows(
                &inputs.cache,
                inputs.cache_batch_idx,
                b,
                0..lens[b] as usize,
            )
        })
        .collect();
    // Offsets within i32, as the packed calls take them.
    let offset = |n: usize| {
        i32::try_from(n).map_err(|_| Error::IndexOverflow {
            operand: Operand::K,
            detail: format!("{n} packed rows pass i32 offsets"),
        })
    };
    let cu_q = (0..=batch)
        .map(|b| offset(b * seqlen_q))
        .collect::<Result<Vec<i32>>>()?;
    let mut cu_k = vec![0];
    for &l in lens {
        cu_k.push(offset(*cu_k.last().unwrap() as usize + l as usize)?);
    }
    let longest = lens.iter().map(|&l| l as usize).max().unwrap_or(0);
    let seqs = Seqlens::new(&cu_q, &cu_k, seqlen_q, longest)?;
    if C::DTYPE == T::DTYPE && inputs.descales.is_none() {
        let one = |_: usize, _: usize| 1.0;
        let (q, k, v) = (
            gather::<T, T>(&inputs.q, &q_rows, one)?,
            gather::<C, T>(inputs.cache.k(), &keys, one)?,
            gather::<C, T>(inputs.cache.v(), &keys, one)?,
        );
        return packed_forward(cfg, &seqs, &shape, (&q, &k, &v), keys.len(), inputs.sinks);
    }
    // Packed key i's descale of head h: that of its sequence (keys are packed in order).
    let key_seq: Vec<usize> = (0..batch)
        .flat_map(|b| std::iter::repeat_n(b, lens[b] as usize))
        .collect();
    let (k_descale, v_descale) = (inputs.descales.map(|d| d.k), inputs.descales.map(|d| d.v));
    let at =
        |d: Option<&[f32]>, i: usize, h: usize| d.map_or(1.0, |d| d[key_seq[i] * heads_kv + h]);
    let (q, k, v) = (
        gather::<T, f32>(&inputs.q, &q_rows, |_, _| 1.0)?,
        gather::<C, f32>(inputs.cache.k(), &keys, |i, h| at(k_descale, i, h))?,
        gather::<C, f32>(inputs.cache.v(), &keys, |i, h| at(v_descale, i, h))?,
    );
    let in_f32 = packed_forward(cfg, &seqs, &shape, (&q, &k, &v), keys.len(), inputs.sinks)?;
    let mut out = alloc::<T>(in_f32.out.len())?;
    for (y, &x) in out.iter_mut().zip(&in_f32.out) {
        *y = T::from_f32(x);
    }
    Ok(ForwardOutput {
        out,
        lse: in_f32.lse,
        plan,
    })
}

/// The packed call over `q`, `k` and `v` (`keys` packed keys): its O is a KV-cache call's
/// layout, and its LSE, `(heads_q, batch · seqlen_q)`, goes to that call's by sequence.
fn packed_forward<U: Element>(
    cfg: &AttentionConfig,
    seqs: &Seqlens,
    shape: &Problem,
    (q, k, v): (&[U], &[U], &[U]),
    keys: usize,
    sinks: Option<&[f32]>,
) -> Result<ForwardOutput<U>> {
    let (batch, seqlen_q, heads) = (shape.batch, shape.seqlen_q, shape.heads_q);
    let (heads_kv, d, d_v) = (shape.heads_kv, shape.head_dim, shape.head_dim_v);
    let packed_inputs = ForwardInputs {
        sinks,
        ..ForwardInputs::new(
            TensorRef::contiguous(q, [1, batch * seqlen_q, heads, d]),
            TensorRef::contiguous(k, [1, keys, heads_kv, d]),
            TensorRef::contiguous(v, [1, keys, heads_kv, d_v]),
        )
    };
    let packed = varlen::forward(cfg, seqs, packed_inputs)?;
    let mut lse = alloc::<f32>(packed.lse.len())?;
    for (bh, row) in lse.chunks_exact_mut(seqlen_q).enumerate() {
        let (b, h) = (bh / heads, bh % heads);
        row.copy_from_slice(&packed.lse[(h * batch + b) * seqlen_q..][..seqlen_q]);
    }
    Ok(ForwardOutput { lse, ..packed })
}

impl<'a, T> KvCacheMut<'a, T> {
    /// The same cache, read-only.
    pub fn as_ref(&self) -> KvCache<'_, T> {
        match self {
            KvCacheMut::Dense { k, v } => KvCache::dense(k.as_ref(), v.as_ref()),
            KvCacheMut::Paged {
                k,
                v,
                block_table,
                max_pages,
            } => KvCache::paged(k.as_ref(), v.as_ref(), block_table, *max_pages),
        }
    }
}

/// Writes `k_new` `(batch, seqlen_new, heads_kv, head_dim)` and `v_new` (with V's head dim) into
/// each sequence's cache rows `cache_seqlens[b] .. cache_seqlens[b] + seqlen_new` (dense: entry
/// `b` or `cache_batch_idx[b]`; paged: the pages the block table gives those rows), as
/// FlashAttention's `flash_attn_with_kvcache` appends `k` and `v`: a [`forward`] with
/// `cache_seqlens[b] + seqlen_new` keys then attends to them. Sequences must not share the rows
/// they append into (the later sequence's rows would win).
pub fn append<T: Element>(
    cache: &mut KvCacheMut<'_, T>,
    k_new: TensorRef<'_, T>,
    v_new: TensorRef<'_, T>,
    cache_seqlens: &[i32],
    cache_batch_idx: Option<&[i32]>,
) -> Result<()> {
    append_as(
        cache,
        (k_new, v_new),
        cache_seqlens,
        cache_batch_idx,
        |_, _| Ok(()),
        (|x, _| x, |x, _| x),
    )
}

/// [`append`] into an e4m3 cache: sequence `b`'s new keys of KV head `h` are stored as
/// [`crate::fp8::quantize`]`(x, descales.k[b · heads_kv + h])` (rounded to the nearest e4m3,
/// saturating at ±448), its values alike with `descales.v`, so that a [`forward`] with the same
/// descales reads them back to within e4m3's rounding (and their reciprocals'), up to ±448 times
/// the descale. The descales must be positive normal numbers (`quantize` multiplies by their
/// reciprocals).
pub fn append_fp8<T: Element>(
    cache: &mut KvCacheMut<'_, F8E4M3>,
    k_new: TensorRef<'_, T>,
    v_new: TensorRef<'_, T>,
    cache_seqlens: &[i32],
    cache_batch_idx: Option<&[i32]>,
    descales: CacheDescales<'_>,
) -> Result<()> {
    let (kd, vd) = (descales.k, descales.v);
    append_as(
        cache,
        (k_new, v_new),
        cache_seqlens,
        cache_batch_idx,
        |batch, heads_kv| check_append_descales(descales, batch, heads_kv),
        (
            |x: T, bh| fp8::quantize(x.to_f32(), kd[bh]),
            |x: T, bh| fp8::quantize(x.to_f32(), vd[bh]),
        ),
    )
}

/// A cache's K and V descales (their `counts` of values, host or device) hold `batch × heads_kv`
/// values each.
pub(crate) fn check_descale_counts(
    counts: [usize; 2],
    batch: usize,
    heads_kv: usize,
) -> Result<()> {
    for (name, n) in ["k_descale", "v_descale"].into_iter().zip(counts) {
        if Some(n) != batch.checked_mul(heads_kv) {
            return Err(Error::InvalidConfig(format!(
                "{name} has {n} values for {batch} sequences of {heads_kv} KV heads"
            )));
        }
    }
    Ok(())
}

/// An append's descales, once the shapes and counts are known good: `batch × heads_kv` positive
/// normal numbers each (the append multiplies by their reciprocals).
fn check_append_descales(descales: CacheDescales, batch: usize, heads_kv: usize) -> Result<()> {
    check_descale_counts([descales.k.len(), descales.v.len()], batch, heads_kv)?;
    for (name, d) in [("k_descale", descales.k), ("v_descale", descales.v)] {
        if let Some(i) = d.iter().position(|x| !(x.is_normal() && *x > 0.0)) {
            return Err(Error::InvalidConfig(format!(
                "{name}[{i}] is {}: an append multiplies by its reciprocal",
                d[i]
            )));
        }
    }
    Ok(())
}

/// [`append`] of new rows of `X` into a cache of `C`, each element of sequence `b`, head `h`
/// stored as `to_k(x, b · heads_kv + h)` (K) or `to_v(...)` (V), after every check (the caller's
/// `check(batch, heads_kv)` last) has passed.
fn append_as<X: Copy, C: Copy>(
    cache: &mut KvCacheMut<'_, C>,
    (k_new, v_new): (TensorRef<'_, X>, TensorRef<'_, X>),
    cache_seqlens: &[i32],
    cache_batch_idx: Option<&[i32]>,
    check: impl FnOnce(usize, usize) -> Result<()>,
    (to_k, to_v): (impl Fn(X, usize) -> C, impl Fn(X, usize) -> C),
) -> Result<()> {
    // The cache as an output (each element reached once), before anything is written.
    match &*cache {
        KvCacheMut::Dense { k, v } | KvCacheMut::Paged { k, v, .. } => {
            k.check(Operand::K)?;
            v.check(Operand::V)?;
        }
    }
    let dest_rows = {
        let view = cache.as_ref();
        k_new.check(Operand::K)?;
        v_new.check(Operand::V)?;
        let batch = k_new.layout.shape[0];
        let seqlen_new = check_new_rows(
            [&view.k().layout, &view.v().layout],
            [&k_new.layout, &v_new.layout],
            batch,
        )?;
        check_cache(&view, batch, cache_seqlens, seqlen_new, cache_batch_idx)?;
        check(batch, view.k().layout.shape[2])?;
        (0..batch)
            .map(|b| {
                let start = cache_seqlens[b] as usize;
                key_rows(&view, cache_batch_idx, b, start..start + seqlen_new)
            })
            .collect::<Vec<_>>()
    };
    let (k, v) = match cache {
        KvCacheMut::Dense { k, v } | KvCacheMut::Paged { k, v, .. } => (k, v),
    };
    scatter(k, &k_new, &dest_rows, to_k);
    scatter(v, &v_new, &dest_rows, to_v);
    Ok(())
}

/// Row `i` of sequence `b` of `new` into the cache row `rows[b][i]` names, every head `h`, each
/// element as `convert(x, b · heads + h)`.
fn scatter<X: Copy, C: Copy>(
    cache: &mut TensorMut<C>,
    new: &TensorRef<X>,
    rows: &[Vec<(usize, usize)>],
    convert: impl Fn(X, usize) -> C,
) {
    let [_, _, heads, d] = new.layout.shape;
    let (c, n) = (cache.layout.strides, new.layout.strides);
    for (b, rows) in rows.iter().enumerate() {
        for (i, &(entry, row)) in rows.iter().enumerate() {
            for h in 0..heads {
                let (dst, src) = (
                    entry * c[0] + row * c[1] + h * c[2],
                    b * n[0] + i * n[1] + h * n[2],
                );
                for (y, &x) in cache.data[dst..dst + d]
                    .iter_mut()
                    .zip(&new.data[src..src + d])
                {
                    *y = convert(x, b * heads + h);
                }
            }
        }
    }
}

/// Rotary position embedding as FlashAttention's KV-cache call applies it: `cos` and `sin` are
/// `(seqlen_ro, dim / 2)` f32 row-major; the first `dim` (even, at most the head dim) elements
/// of each head rotate by the angle of the row's position, in pairs `(2i, 2i + 1)` when
/// `interleaved`, else `(i, i + dim / 2)` (GPT-NeoX's halves); the rest pass unchanged. A step
/// ([`step`]) with rotary embedding appends new keys, and needs angles for positions up to the
/// longest cached count plus its new keys (or its query rows, where more).
#[derive(Clone, Copy, Debug)]
pub struct Rotary<'a> {
    pub cos: &'a [f32],
    pub sin: &'a [f32],
    pub dim: usize,
    pub interleaved: bool,
}

impl Rotary<'_> {
    /// Positions it has angles for.
    fn positions(&self) -> usize {
        self.cos.len() / (self.dim / 2).max(1)
    }

    fn check(&self, head_dim: usize) -> Result<()> {
        check_rotary(self.dim, [self.cos.len(), self.sin.len()], head_dim)
    }

    /// `x` (one head's row) rotated to position `pos`.
    fn rotate<T: Element>(&self, x: &mut [T], pos: usize) {
        let half = self.dim / 2;
        let (cos, sin) = (
            &self.cos[pos * half..][..half],
            &self.sin[pos * half..][..half],
        );
        for i in 0..half {
            let (a, b) = if self.interleaved {
                (2 * i, 2 * i + 1)
            } else {
                (i, i + half)
            };
            let (x0, x1) = (x[a].to_f32(), x[b].to_f32());
            x[a] = T::from_f32(x0 * cos[i] - x1 * sin[i]);
            x[b] = T::from_f32(x0 * sin[i] + x1 * cos[i]);
        }
    }
}

/// A rotation of `dim` elements of heads of `head_dim` with angle tables of `lens` values (cos,
/// sin): `dim` even, from 2 to the head dim; both tables `(positions, dim / 2)`, at least one
/// position. Host and device steps check it alike.
pub(crate) fn check_rotary(dim: usize, [cos, sin]: [usize; 2], head_dim: usize) -> Result<()> {
    if dim == 0 || dim % 2 != 0 || dim > head_dim {
        return Err(Error::InvalidConfig(format!(
            "rotary dim {dim} (it must be even, from 2 to the head dim {head_dim})"
        )));
    }
    if cos != sin || cos == 0 || cos % (dim / 2) != 0 {
        return Err(Error::InvalidConfig(format!(
            "rotary cos and sin of {cos} and {sin} values: both (positions, {}), at least one \
             position",
            dim / 2
        )));
    }
    Ok(())
}

/// The new keys and values of an append, `[k_new, v_new]`, against the cache's `[k, v]`:
/// `(batch, seqlen_new, heads_kv, ·)` with the cache's heads and head dims, and V's cache
/// shaped as K's but for its head dim. Returns `seqlen_new`. Host and device appends check it
/// alike.
pub(crate) fn check_new_rows(
    [k, v]: [&Layout; 2],
    [k_new, v_new]: [&Layout; 2],
    batch: usize,
) -> Result<usize> {
    let [slots, rows, heads_kv, head_dim] = k.shape;
    let head_dim_v = v.shape[3];
    Problem::expect_shape(Operand::V, v, [slots, rows, heads_kv, head_dim_v])?;
    let seqlen_new = k_new.shape[1];
    Problem::expect_shape(Operand::K, k_new, [batch, seqlen_new, heads_kv, head_dim])?;
    Problem::expect_shape(Operand::V, v_new, [batch, seqlen_new, heads_kv, head_dim_v])?;
    Ok(seqlen_new)
}

/// One decoding or prefill step over a cache, as FlashAttention's `flash_attn_with_kvcache`
/// takes it: Q `(batch, seqlen_q, heads_q, head_dim)`, the cache to append to, new keys and
/// values `(batch, seqlen_new, heads_kv, ·)` (optional), each sequence's cached key count before
/// the step, and optionally rotary embedding, the dense cache's entry per sequence and sinks.
#[derive(Debug)]
pub struct KvCacheStep<'a, 'c, T, C = T> {
    pub q: TensorRef<'a, T>,
    pub cache: &'a mut KvCacheMut<'c, C>,
    pub new: Option<(TensorRef<'a, T>, TensorRef<'a, T>)>,
    pub cache_seqlens: &'a [i32],
    pub rotary: Option<Rotary<'a>>,
    pub cache_batch_idx: Option<&'a [i32]>,
    pub sinks: Option<&'a [f32]>,
    /// An e4m3 cache's descales (none: 1): the new rows are stored by them as [`append_fp8`]
    /// stores them (so they must be positive normal numbers where the step appends), and the
    /// forward reads the cache through them. A 16-bit cache takes none.
    pub descales: Option<CacheDescales<'a>>,
}

/// Whether rotary embedding puts all of a sequence's `seqlen_q` query rows at one position (its
/// cached count) rather than each at its own (the count plus its row), as FlashAttention-3
/// decides it: where the mask, its windows normalized as FlashAttention-3 normalizes them (and
/// as this crate's kernels do), bounds nothing. A left side of `capacity − 1` or more (the keys
/// a sequence's cache holds) and a right side of `seqlen_q − 1` or more bound nothing; `Causal`
/// is a right side of 0. (FlashAttention-2 drops only sides of the capacity or more.)
pub fn queries_at_one_position(mask: AttentionMask, capacity: usize, seqlen_q: usize) -> bool {
    let rule = mask.key_rule(seqlen_q, capacity);
    !rule.bounds_some_row_on_the_left() && !rule.bounds_some_row_on_the_right()
}

/// `x` (batch, rows, heads, d) copied, each head's row `i` of entry `b` rotated to position
/// `start[b] + i`, or `start[b]` for every row when `same_position`.
fn rotated<T: Element>(
    x: &TensorRef<T>,
    rotary: &Rotary,
    start: &[i32],
    same_position: bool,
) -> Result<Vec<T>> {
    let [batch, rows, heads, d] = x.layout.shape;
    let s = x.layout.strides;
    let mut out = alloc::<T>(batch * rows * heads * d)?;
    for (at, y) in out.chunks_exact_mut(d).enumerate() {
        let (h, i, b) = (at % heads, at / heads % rows, at / heads / rows);
        let src = b * s[0] + i * s[1] + h * s[2];
        y.copy_from_slice(&x.data[src..src + d]);
        let pos = start[b] as usize + if same_position { 0 } else { i };
        rotary.rotate(y, pos);
    }
    Ok(out)
}

/// A whole step: with rotary embedding, Q and the new keys rotated (the new keys to their
/// positions in the cache, `cache_seqlens[b] + i`; Q likewise under a mask that bounds some
/// key, else every query row at `cache_seqlens[b]`: [`queries_at_one_position`]); the new keys
/// and values appended ([`append`], or into an e4m3 cache as [`append_fp8`] stores them); then
/// [`forward`] over `cache_seqlens[b] + seqlen_new` keys. Every check runs before the cache is
/// written.
pub fn step<T: Element, C: Element>(
    cfg: &AttentionConfig,
    step: KvCacheStep<'_, '_, T, C>,
) -> Result<ForwardOutput<T>> {
    let KvCacheStep {
        q,
        cache,
        new,
        cache_seqlens,
        rotary,
        cache_batch_idx,
        sinks,
        descales,
    } = step;
    let fp8 = C::DTYPE == DType::E4M3;
    if descales.is_some() && !fp8 {
        return Err(Error::InvalidConfig(
            "descales in a step over a 16-bit cache (they are an e4m3 cache's)".into(),
        ));
    }
    q.check(Operand::Q)?;
    let [batch, seqlen_q, heads_q, head_dim] = q.layout.shape;
    let seqlen_new = new.map_or(0, |(k, _)| k.layout.shape[1]);
    // The new keys and values against Q and the cache, before any of them is rotated.
    if let Some((k_new, v_new)) = &new {
        let view = cache.as_ref();
        k_new.check(Operand::K)?;
        v_new.check(Operand::V)?;
        check_new_rows(
            [&view.k().layout, &view.v().layout],
            [&k_new.layout, &v_new.layout],
            batch,
        )?;
    } else if rotary.is_some() {
        return Err(Error::InvalidConfig(
            "rotary embedding without new keys: it rotates the keys a step appends".into(),
        ));
    }
    check_cache(
        &cache.as_ref(),
        batch,
        cache_seqlens,
        seqlen_new,
        cache_batch_idx,
    )?;
    let same_position = queries_at_one_position(cfg.mask, cache.as_ref().capacity()?, seqlen_q);
    if let Some(r) = &rotary {
        r.check(head_dim)?;
        // One past the last position a row takes: an appended key's or a query row's.
        let rows = seqlen_new.max(if same_position { 1 } else { seqlen_q });
        let needed = cache_seqlens.iter().map(|&l| l as usize).max().unwrap_or(0) + rows;
        if r.positions() < needed {
            return Err(Error::InvalidConfig(format!(
                "rotary angles for {} positions; the step reaches position {}",
                r.positions(),
                needed - 1
            )));
        }
    }
    let q_rot;
    let q = match &rotary {
        Some(r) => {
            q_rot = rotated(&q, r, cache_seqlens, same_position)?;
            TensorRef::contiguous(&q_rot, [batch, seqlen_q, heads_q, head_dim])
        }
        None => q,
    };
    // Within the capacity (checked above), which may pass i32 on a large paged cache.
    let lens = cache_seqlens
        .iter()
        .map(|&l| {
            i32::try_from(l as usize + seqlen_new).map_err(|_| {
                Error::InvalidSeqlens(format!("{l} cached and {seqlen_new} new keys pass i32"))
            })
        })
        .collect::<Result<Vec<i32>>>()?;
    // The forward's checks (Q against the cache, sinks, the plan) before anything is written.
    plan(
        cfg,
        &KvCacheInputs {
            q,
            cache: cache.as_ref(),
            cache_seqlens: &lens,
            cache_batch_idx,
            sinks,
            descales,
        },
    )?;
    if let Some((k_new, v_new)) = new {
        let k_rot;
        let k_new = match &rotary {
            Some(r) => {
                k_new.check(Operand::K)?;
                k_rot = rotated(&k_new, r, cache_seqlens, false)?;
                TensorRef::contiguous(&k_rot, k_new.layout.shape)
            }
            None => k_new,
        };
        // Into a cache of Q's type as they are (C is T: exact); into an e4m3 one quantized by
        // the descales (1 without), as append_fp8 stores them.
        let ones;
        let scales = match descales {
            Some(d) => d,
            None => {
                ones = vec![1f32; k_new.layout.shape[0] * k_new.layout.shape[2]];
                CacheDescales { k: &ones, v: &ones }
            }
        };
        let to_cache = |x: T, s: f32| {
            let x = x.to_f32();
            C::from_f32(if fp8 { fp8::quantize(x, s).to_f32() } else { x })
        };
        append_as(
            cache,
            (k_new, v_new),
            cache_seqlens,
            cache_batch_idx,
            |batch, heads_kv| {
                if fp8 {
                    check_append_descales(scales, batch, heads_kv)
                } else {
                    Ok(())
                }
            },
            (
                |x, bh| to_cache(x, scales.k[bh]),
                |x, bh| to_cache(x, scales.v[bh]),
            ),
        )?;
    }
    forward(
        cfg,
        KvCacheInputs {
            q,
            cache: cache.as_ref(),
            cache_seqlens: &lens,
            cache_batch_idx,
            sinks,
            descales,
        },
    )
}
