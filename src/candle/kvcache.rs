//! Attention over a KV cache through candle: a serving step's forward (no gradient), on the CPU
//! through [`crate::kvcache::forward`] and on a CUDA device through
//! [`crate::cuda::Device::kvcache_forward_into`].

use super::*;
use crate::kvcache::{KvCache, KvCacheInputs};

/// Attention of Q over a KV cache, as flash-attn's `flash_attn_with_kvcache` (without appending
/// new keys): Q `(batch, seqlen_q, heads_q, head_dim)`; the cache dense, K `(batch_cache,
/// seqlen_cache, heads_kv, head_dim)` and V `(batch_cache, seqlen_cache, heads_kv, head_dim_v)`
/// with sequence `b` in entry `b`, or paged with `block_table` `(batch, max_pages)` (K
/// `(num_pages, page_size, heads_kv, head_dim)`, sequence `b`'s key `j` in row `j % page_size`
/// of page `block_table[b][j / page_size]`); `cache_seqlens` `(batch)` each sequence's cached
/// keys. `cache_seqlens` and `block_table` are u32 or i32 tensors on Q's device. Each
/// sequence's queries are the last positions of its keys (masks align bottom-right). Returns O
/// `(batch, seqlen_q, heads_q, head_dim_v)`. The op records no backward: it is a serving step
/// (gradients do not flow through it).
///
/// On the CPU every count and page number is checked (typed errors); on a CUDA device they
/// stay there and the kernels clamp them, as [`crate::cuda::DeviceKvCacheInputs`] says (rows
/// past each count may hold anything, NaN included; a paged cache runs on the Hopper forward or
/// the Ampere one; the CUDA path not yet run on a GPU). There Q and a dense cache are read as one
/// run of rows: views whose entries do not follow each other (a transposed Q of several rows, a
/// cache narrowed along its rows) are copied first.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use flashattn::AttentionConfig;
///
/// let dev = Device::Cpu;
/// // Two sequences decoding one token each over a dense cache of 32 rows (5 and 17 cached).
/// let q = Tensor::randn(0f32, 1.0, (2, 1, 8, 64), &dev)?;
/// let k = Tensor::randn(0f32, 1.0, (2, 32, 2, 64), &dev)?;
/// let v = Tensor::randn(0f32, 1.0, (2, 32, 2, 64), &dev)?;
/// let lens = Tensor::new(&[5u32, 17], &dev)?;
/// let cfg = AttentionConfig::new().causal(true);
/// let o = flashattn::candle::flash_attn_with_kvcache(&q, &k, &v, &lens, None, &cfg)?;
/// assert_eq!(o.dims(), &[2, 1, 8, 64]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn flash_attn_with_kvcache(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    cache_seqlens: &Tensor,
    block_table: Option<&Tensor>,
    cfg: &AttentionConfig,
) -> candle_core::Result<Tensor> {
    for (name, t) in [("q", q), ("k_cache", k_cache), ("v_cache", v_cache)] {
        if t.rank() != 4 {
            candle_core::bail!(
                "flash_attn_with_kvcache: {name} must be of rank 4, got shape {:?}",
                t.dims()
            );
        }
    }
    if k_cache.dtype() != q.dtype() || v_cache.dtype() != q.dtype() {
        candle_core::bail!(
            "flash_attn_with_kvcache: q and the cache must have one dtype, got {:?}, {:?}, {:?}",
            q.dtype(),
            k_cache.dtype(),
            v_cache.dtype()
        );
    }
    let indices = [
        ("cache_seqlens", Some(cache_seqlens), 1),
        ("block_table", block_table, 2),
    ];
    for (name, t, rank) in indices {
        let Some(t) = t else { continue };
        if t.rank() != rank || !matches!(t.dtype(), DType::U32 | DType::I32) {
            candle_core::bail!(
                "flash_attn_with_kvcache: {name} must be a rank-{rank} tensor of u32 or i32, got \
                 {:?} {:?}",
                t.dtype(),
                t.dims()
            );
        }
        if !t.device().same_device(q.device()) {
            candle_core::bail!("flash_attn_with_kvcache: {name} is on another device than q");
        }
        // One row (one count) per sequence: a table of other rows would read as other pages.
        if t.dims()[0] != q.dims()[0] {
            candle_core::bail!(
                "flash_attn_with_kvcache: {name} has {} rows for {} sequences",
                t.dims()[0],
                q.dims()[0]
            );
        }
    }
    let op = KvCacheAttn {
        cfg: cfg.clone(),
        cache_seqlens: cache_seqlens.contiguous()?,
        // A copy of its own: the CUDA path holds both storages' read locks at once, which must
        // not be one lock taken twice.
        block_table: block_table.map(Tensor::force_contiguous).transpose()?,
    };
    // On CUDA, Q and a dense cache are read as one sequence of rows: each entry's rows after
    // the last's (one-row Q, a decode step's, any way).
    let in_order = |t: &Tensor| -> candle_core::Result<Tensor> {
        let t = readable(t)?;
        let (dims, strides) = (t.dims(), t.layout().stride());
        if t.device().is_cuda() && dims[0] > 1 && dims[1] > 1 && strides[0] != dims[1] * strides[1]
        {
            return t.force_contiguous();
        }
        Ok(t)
    };
    let dense = block_table.is_none();
    let (q, k, v) = if dense {
        (in_order(q)?, in_order(k_cache)?, in_order(v_cache)?)
    } else {
        (in_order(q)?, readable(k_cache)?, readable(v_cache)?)
    };
    q.apply_op3_no_bwd(&k, &v, &op)
}

/// The op: the call's configuration and its index tensors (contiguous).
struct KvCacheAttn {
    cfg: AttentionConfig,
    cache_seqlens: Tensor,
    block_table: Option<Tensor>,
}

impl KvCacheAttn {
    /// Pages a sequence addresses (the table's columns); 0 for a dense cache.
    fn max_pages(&self) -> usize {
        self.block_table.as_ref().map_or(0, |t| t.dims()[1])
    }

    fn cpu_forward<T: Element + candle_core::WithDType>(
        &self,
        [q, k, v]: [cpu::Operand; 3],
    ) -> candle_core::Result<CpuStorage> {
        let (q, k, v) = (cpu::view::<T>(q)?, cpu::view::<T>(k)?, cpu::view::<T>(v)?);
        let lens = host_i32(&self.cache_seqlens, crate::Error::InvalidSeqlens)?;
        let table = self
            .block_table
            .as_ref()
            .map(|t| host_i32(t, crate::Error::InvalidPageTable))
            .transpose()?;
        let cache = match &table {
            None => KvCache::dense(k, v),
            Some(t) => KvCache::paged(k, v, t, self.max_pages()),
        };
        let out = crate::kvcache::forward(&self.cfg, KvCacheInputs::new(q, cache, &lens))
            .map_err(wrap)?;
        Ok(T::to_cpu_storage_owned(out.out))
    }
}

impl candle_core::CustomOp3 for KvCacheAttn {
    fn name(&self) -> &'static str {
        "flash-attn-kvcache"
    }

    fn cpu_fwd(
        &self,
        q: &CpuStorage,
        lq: &candle_core::Layout,
        k: &CpuStorage,
        lk: &candle_core::Layout,
        v: &CpuStorage,
        lv: &candle_core::Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let ops = [(q, lq), (k, lk), (v, lv)];
        let out = with_element!(
            q.dtype(),
            "flash_attn_with_kvcache on the CPU takes f32, f16 or bf16 tensors",
            |T| self.cpu_forward::<T>(ops)
        )?;
        Ok((out, out_shape(lq, lv)))
    }

    #[cfg(feature = "candle-cuda")]
    fn cuda_fwd(
        &self,
        q: &CudaStorage,
        lq: &candle_core::Layout,
        k: &CudaStorage,
        lk: &candle_core::Layout,
        v: &CudaStorage,
        lv: &candle_core::Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let ops = [(q, lq), (k, lk), (v, lv)];
        let index = (&self.cache_seqlens, self.block_table.as_ref());
        let out = with_element!(
            q.dtype(),
            "flash_attn_with_kvcache on CUDA takes bf16 or f16 tensors",
            |T| gpu::kvcache_forward::<T>(&self.cfg, index, ops)
        )?;
        Ok((out, out_shape(lq, lv)))
    }
}
