//! Context parallelism as a ring: a sequence too long for one device is split across ranks; each
//! rank keeps its queries while the ranks' keys and values travel around the ring, one shard per
//! step, and each rank merges its partial results by their LSE ([`crate::combine`]). In the
//! backward each rank recomputes its queries' rows against every shard with the merged O and LSE,
//! keeps dQ, and sends each shard's dK and dV on with it, so that they arrive home summed.
//!
//! Causal attention shards the sequence *zig-zag* ([`Sharding::ZigZag`]): cut into `2·ranks`
//! equal chunks, rank r holds chunks r and `2·ranks − 1 − r`, so that every rank has as much work
//! (a query chunk sees every earlier chunk whole, its own causally, no later one). Without a mask
//! the chunks are contiguous ([`Sharding::Contiguous`]). Either takes any mask; a sliding window
//! narrower than a chunk balances under either, since every chunk then sees about as much.
//!
//! This module runs that schedule on the CPU over simulated ranks (each rank's shards in host
//! memory, the ring a loop over them): the arithmetic and bookkeeping a multi-GPU ring runs step
//! by step, and the reference it is tested against (`cuda::Device::ring_forward_into`,
//! `ring_backward_into` and their `ring_varlen_*` twins run it on one GPU over the pairs of
//! chunks this module plans). Masks: any (full, causal,
//! sliding windows: each pair of chunks takes the mask's band moved by their distance, and a
//! band that misses the pair's diagonal takes a call over fewer rows or keys); softcap as any
//! call.
//! Attention sinks join the own-chunk part of each query chunk's forward (the merged LSE counts
//! them once);
//! in the backward every part takes them, and its share of the sinks' gradient (which is linear
//! in each row's `D = Σ_j P·dP` over that part's keys) is summed: each rank returns its queries'
//! share, which the ranks sum (as any gradient of a parameter every rank holds).
//! Packed batches ([`varlen_forward`], [`varlen_backward`], shards cut by [`shard_packed`]): each
//! sequence, a whole number of chunks long, runs as its own ring. Each pair's dK and dV come
//! back rounded to the inputs' type and are summed in f32, so a 16-bit ring's gradients carry
//! one rounding per rank they visit.
//!
//! ```
//! use flashattn::ring::{self, Sharding};
//! use flashattn::{AttentionConfig, ForwardInputs, TensorRef};
//!
//! // 16 rows over 2 ranks, causal: rank 0 holds rows 0..4 and 12..16, rank 1 rows 4..12.
//! let x: Vec<f32> = (0..16 * 2 * 8).map(|i| (i as f32 * 0.37).sin()).collect();
//! let t = TensorRef::contiguous(&x, [1, 16, 2, 8]);
//! let shards = (0..2)
//!     .map(|r| ring::shard(t, Sharding::ZigZag, 2, r))
//!     .collect::<Result<Vec<_>, _>>()?;
//! let views: Vec<_> = shards.iter().map(|s| TensorRef::contiguous(s, [1, 8, 2, 8])).collect();
//! let inputs: Vec<_> = views.iter().map(|&v| ForwardInputs::new(v, v, v)).collect();
//! let cfg = AttentionConfig::new().causal(true);
//! let outs = ring::forward(&cfg, Sharding::ZigZag, &inputs)?;
//! let whole = flashattn::forward(&cfg, ForwardInputs::new(t, t, t))?;
//! let o0 = ring::shard(TensorRef::contiguous(&whole.out, [1, 16, 2, 8]), Sharding::ZigZag, 2, 0)?;
//! assert!(outs[0].out.iter().zip(&o0).all(|(a, b)| (a - b).abs() < 1e-5));
//! # Ok::<(), flashattn::Error>(())
//! ```

use std::ops::Range;

use crate::combine::{self, LseLayout};
use crate::config::{AttentionConfig, AttentionMask};
use crate::error::{Error, Operand, Result};
use crate::tensor::{Element, Layout, Problem, TensorRef};
use crate::{alloc, BackwardInputs, ForwardInputs, ForwardOutput};

/// How a sequence's rows are split among the ranks (see the module's documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sharding {
    /// Rank r holds rows `r·s/ranks .. (r + 1)·s/ranks`.
    Contiguous,
    /// Of `2·ranks` equal chunks, rank r holds chunk r, then chunk `2·ranks − 1 − r`.
    ZigZag,
}

impl Sharding {
    pub(crate) fn chunks_per_rank(self) -> usize {
        match self {
            Sharding::Contiguous => 1,
            Sharding::ZigZag => 2,
        }
    }

    /// The global chunk indices rank `rank` holds, in its order.
    pub(crate) fn chunk_ids(self, ranks: usize, rank: usize) -> Vec<usize> {
        match self {
            Sharding::Contiguous => vec![rank],
            Sharding::ZigZag => vec![rank, 2 * ranks - 1 - rank],
        }
    }

    /// The rows of a sequence of `seqlen` that rank `rank` of `ranks` holds, chunk by chunk;
    /// an error where the chunks would not be equal.
    pub fn rows(self, seqlen: usize, ranks: usize, rank: usize) -> Result<Vec<Range<usize>>> {
        let chunks = ranks.checked_mul(self.chunks_per_rank()).unwrap_or(0);
        if chunks == 0 || rank >= ranks || seqlen == 0 || seqlen % chunks != 0 {
            return Err(Error::InvalidConfig(format!(
                "rank {rank} of {ranks} over {seqlen} rows: {:?} needs a rank below the ranks \
                 and rows in {chunks} equal chunks",
                self
            )));
        }
        let c = seqlen / chunks;
        Ok(self
            .chunk_ids(ranks, rank)
            .into_iter()
            .map(|i| i * c..(i + 1) * c)
            .collect())
    }
}

/// Rank `rank`'s shard of `x` `(batch, seqlen, heads, d)`: its rows (in its order), contiguous
/// `(batch, seqlen / ranks, heads, d)`.
pub fn shard<T: Element>(
    x: TensorRef<T>,
    sharding: Sharding,
    ranks: usize,
    rank: usize,
) -> Result<Vec<T>> {
    x.check(Operand::Q)?;
    let [batch, seqlen, heads, d] = x.layout.shape;
    let rows = sharding.rows(seqlen, ranks, rank)?;
    let s = x.layout.strides;
    let mut out = alloc::<T>(batch * (seqlen / ranks) * heads * d)?;
    let mut at = 0;
    for b in 0..batch {
        for r in rows.iter().flat_map(|r| r.clone()) {
            for h in 0..heads {
                let src = b * s[0] + r * s[1] + h * s[2];
                out[at..at + d].copy_from_slice(&x.data[src..src + d]);
                at += d;
            }
        }
    }
    Ok(out)
}

/// Chunk `c` (of `chunks` per rank) of a rank's shard `(batch, shard_rows, heads, d)` as a view.
fn chunk<'a, T>(t: &TensorRef<'a, T>, chunks: usize, c: usize) -> TensorRef<'a, T> {
    let [batch, rows, heads, d] = t.layout.shape;
    let len = rows / chunks;
    let s = t.layout.strides;
    TensorRef::new(
        &t.data[c * len * s[1]..],
        Layout::with_strides([batch, len, heads, d], s),
    )
}

/// What a query chunk sees of one key chunk: its first `q_rows` rows (the others see none of
/// the chunk's keys), against the chunk's first `k_rows` keys (no row sees the others), under
/// `mask`; `own` where the key chunk is the query chunk.
pub(crate) struct Pair {
    pub(crate) src: usize,
    pub(crate) cj: usize,
    pub(crate) q_rows: usize,
    pub(crate) k_rows: usize,
    pub(crate) mask: AttentionConfig,
    pub(crate) own: bool,
}

/// The key chunks query chunk `qc` of `rank` meets as the shards go around the ring (its own
/// rank's first), chunks of `len` rows: each one's rank, its index there and what the query
/// chunk sees of it; the chunks it sees nothing of are left out.
pub(crate) fn ring_pairs(
    cfg: &AttentionConfig,
    sharding: Sharding,
    ranks: usize,
    rank: usize,
    qc: usize,
    len: usize,
) -> Vec<Pair> {
    (0..ranks)
        .map(|step| (rank + ranks - step) % ranks)
        .flat_map(|src| {
            let ids = sharding.chunk_ids(ranks, src);
            ids.into_iter()
                .enumerate()
                .map(move |(cj, kc)| (src, cj, kc))
        })
        .filter_map(|(src, cj, kc)| pair_view(cfg, qc, kc, len).map(|v| Pair { src, cj, ..v }))
        .collect()
}

/// What query chunk `q_chunk` sees of key chunk `k_chunk` (chunks of `len` rows), or nothing.
/// Row i of the query chunk sees key j of the key chunk where `lo <= j - i <= hi`, the mask's
/// band moved by the chunks' distance `delta` (its bounds, None where unbounded). A dense call
/// of `len` rows over `len` keys takes a band around its diagonal `j = i`; one of `len - u` rows
/// over `len` keys has its diagonal at `j = i + u` (bottom-right alignment), and one of `len`
/// rows over `len - e` keys at `j = i - e`: so a band wholly right of the diagonal drops the
/// `u = lo` last rows (which see none of the chunk), one wholly left of it the `e = -hi` last
/// keys (which no row sees).
fn pair_view(cfg: &AttentionConfig, q_chunk: usize, k_chunk: usize, len: usize) -> Option<Pair> {
    let (left, right) = cfg.mask.bounds();
    let (n, delta) = (
        len as i128,
        (q_chunk as i128 - k_chunk as i128) * len as i128,
    );
    // Bounds past the chunk's reach (|j - i| < len) bind no pair: unbounded.
    let lo = left.map(|l| delta - l as i128).filter(|&lo| lo > -(n - 1));
    let hi = right.map(|r| delta + r as i128).filter(|&hi| hi < n - 1);
    if lo.is_some_and(|lo| lo > n - 1) || hi.is_some_and(|hi| hi < -(n - 1)) {
        return None;
    }
    let (mut q_rows, mut k_rows, mut band) = (len, len, (lo, hi));
    if let Some(h) = hi.filter(|&h| h < 0) {
        k_rows = (n + h) as usize;
        band = (lo.map(|lo| lo - h), Some(0));
    } else if let Some(l) = lo.filter(|&l| l > 0) {
        q_rows = (n - l) as usize;
        band = (Some(0), hi.map(|h| h - l));
    }
    let mask = match band {
        (None, None) => AttentionMask::Full,
        (None, Some(0)) => AttentionMask::Causal,
        (lo, hi) => AttentionMask::Window {
            left: lo.map(|lo| (-lo) as usize),
            right: hi.map(|hi| hi as usize),
        },
    };
    Some(Pair {
        src: 0,
        cj: 0,
        q_rows,
        k_rows,
        mask: cfg.clone().mask(mask),
        own: q_chunk == k_chunk,
    })
}

/// A part over a chunk's first rows (`shape`), grown to `len` rows: the others saw no key of it
/// (O 0, LSE +inf).
fn keyless_rows<T: Element>(
    part: ForwardOutput<T>,
    [batch, rows, heads, d_v]: [usize; 4],
    len: usize,
) -> Result<ForwardOutput<T>> {
    let mut out = alloc::<T>(batch * len * heads * d_v)?;
    let mut lse = alloc::<f32>(batch * heads * len)?;
    lse.fill(f32::INFINITY);
    for b in 0..batch {
        out[b * len * heads * d_v..][..rows * heads * d_v]
            .copy_from_slice(&part.out[b * rows * heads * d_v..][..rows * heads * d_v]);
        for h in 0..heads {
            lse[(b * heads + h) * len..][..rows]
                .copy_from_slice(&part.lse[(b * heads + h) * rows..][..rows]);
        }
    }
    Ok(ForwardOutput {
        out,
        lse,
        plan: part.plan,
    })
}

/// The first `rows` rows of a `(batch, ·, heads, d)` view.
fn first_rows<'a, T>(t: &TensorRef<'a, T>, rows: usize) -> TensorRef<'a, T> {
    let [batch, _, heads, d] = t.layout.shape;
    TensorRef::new(
        t.data,
        Layout::with_strides([batch, rows, heads, d], t.layout.strides),
    )
}

/// Checks a ring's inputs: each rank's shards within their buffers, then their shapes
/// ([`check_ring_shapes`]). Returns the number of ranks.
fn check_ring<'a, T: 'a>(
    sharding: Sharding,
    ranks: impl Iterator<Item = ForwardInputs<'a, T>>,
) -> Result<usize> {
    let mut shapes = vec![];
    for ForwardInputs { q, k, v, sinks } in ranks {
        q.check(Operand::Q)?;
        k.check(Operand::K)?;
        v.check(Operand::V)?;
        shapes.push((
            [q.layout.shape, k.layout.shape, v.layout.shape],
            sinks.is_some(),
        ));
    }
    check_ring_shapes(sharding, shapes)
}

/// A ring's shapes, rank by rank (Q's, K's and V's, and whether it has sinks): at least one
/// rank, sinks on every rank or on none, K with Q's rows (the chunks pair up) and head dim, V
/// with K's shape but its head dim, whole chunks, and every rank's shapes the first one's. Returns the number
/// of ranks. The host and device rings check them alike.
pub(crate) fn check_ring_shapes(
    sharding: Sharding,
    ranks: impl IntoIterator<Item = ([[usize; 4]; 3], bool)>,
) -> Result<usize> {
    let mut count = 0;
    let mut first: Option<[[usize; 4]; 3]> = None;
    let mut with_sinks = None;
    for (shapes, sinks) in ranks {
        if *with_sinks.get_or_insert(sinks) != sinks {
            return Err(Error::InvalidConfig(
                "attention sinks on some ranks of a ring and not on others".into(),
            ));
        }
        let [q, k, v] = shapes;
        let [batch, rows, _, d] = q;
        let heads_kv = k[2];
        let expect = |operand, found: [usize; 4], expected: [usize; 4]| {
            if found == expected {
                Ok(())
            } else {
                Err(Error::ShapeMismatch {
                    operand,
                    expected,
                    found,
                })
            }
        };
        expect(Operand::K, k, [batch, rows, heads_kv, d])?;
        expect(Operand::V, v, [batch, rows, heads_kv, v[3]])?;
        if rows % sharding.chunks_per_rank() != 0 {
            return Err(Error::InvalidConfig(format!(
                "{rows} rows per rank in {} equal chunks ({sharding:?})",
                sharding.chunks_per_rank()
            )));
        }
        let want = *first.get_or_insert(shapes);
        for (operand, want, got) in [
            (Operand::Q, want[0], shapes[0]),
            (Operand::K, want[1], shapes[1]),
            (Operand::V, want[2], shapes[2]),
        ] {
            expect(operand, got, want)?;
        }
        count += 1;
    }
    if count == 0 {
        return Err(Error::InvalidConfig(
            "a ring needs at least one rank".into(),
        ));
    }
    Ok(count)
}

/// The forward over a ring of `inputs.len()` ranks: rank r's `inputs[r]` holds its shards
/// `(batch, seqlen / ranks, ·, ·)` of Q, K and V (as [`shard`] cuts them); each rank gets the O
/// and LSE `(batch, heads_q, seqlen / ranks)` of its queries over the whole sequence.
pub fn forward<T: Element>(
    cfg: &AttentionConfig,
    sharding: Sharding,
    inputs: &[ForwardInputs<'_, T>],
) -> Result<Vec<ForwardOutput<T>>> {
    let ranks = check_ring(sharding, inputs.iter().copied())?;
    let per = sharding.chunks_per_rank();
    let mut outs = Vec::with_capacity(ranks);
    for (rank, own) in inputs.iter().enumerate() {
        let [batch, rows, heads, _] = own.q.layout.shape;
        let d_v = own.v.layout.shape[3];
        let mut out = alloc::<T>(batch * rows * heads * d_v)?;
        let mut lse = alloc::<f32>(batch * heads * rows)?;
        let mut plan = None;
        let len = rows / per;
        for (ci, &qc) in sharding.chunk_ids(ranks, rank).iter().enumerate() {
            let q = chunk(&own.q, per, ci);
            // One part per key chunk this query chunk sees, the shards taken around the ring.
            let mut parts = vec![];
            for p in ring_pairs(cfg, sharding, ranks, rank, qc, len) {
                let (k, v) = (
                    chunk(&inputs[p.src].k, per, p.cj),
                    chunk(&inputs[p.src].v, per, p.cj),
                );
                // The sinks join the chunk's own part only (every row sees some of its keys):
                // the merge adds each part's LSE.
                let sinks = if p.own { own.sinks } else { None };
                let mut part = crate::forward(
                    &p.mask,
                    ForwardInputs {
                        sinks,
                        ..ForwardInputs::new(
                            first_rows(&q, p.q_rows),
                            first_rows(&k, p.k_rows),
                            first_rows(&v, p.k_rows),
                        )
                    },
                )?;
                plan.get_or_insert(part.plan.clone());
                if p.q_rows < len {
                    part = keyless_rows(part, [batch, p.q_rows, heads, d_v], len)?;
                }
                parts.push(part);
            }
            let views: Vec<_> = parts
                .iter()
                .map(|p| {
                    (
                        TensorRef::contiguous(&p.out, [batch, len, heads, d_v]),
                        &p.lse[..],
                    )
                })
                .collect();
            let merged = combine::combine(&views, LseLayout::Dense)?;
            // Into the rank's rows of this chunk.
            for b in 0..batch {
                let src = &merged.out[b * len * heads * d_v..][..len * heads * d_v];
                let dst = (b * rows + ci * len) * heads * d_v;
                out[dst..dst + len * heads * d_v].copy_from_slice(src);
                for h in 0..heads {
                    let src = &merged.lse[(b * heads + h) * len..][..len];
                    let dst = (b * heads + h) * rows + ci * len;
                    lse[dst..dst + len].copy_from_slice(src);
                }
            }
        }
        let plan = plan.ok_or_else(|| Error::InvalidConfig("a ring step saw no keys".into()))?;
        outs.push(ForwardOutput { out, lse, plan });
    }
    Ok(outs)
}

/// One rank's gradients in a ring backward: dQ of its queries, dK and dV of its keys and values
/// (each summed over every rank's queries), shaped like its shards; with sinks, its queries'
/// share of the sinks' gradient (heads_q values; the ranks' shares sum to the whole call's).
#[derive(Debug)]
pub struct RankGradients<T> {
    pub dq: Vec<T>,
    pub dk: Vec<T>,
    pub dv: Vec<T>,
    pub dsinks: Option<Vec<f32>>,
}

/// The backward over a ring: rank r's `inputs[r]` holds its shards of Q, K, V, its O, dO and LSE
/// (as [`forward`] gave them); each rank's queries run against every shard with those, dQ stays,
/// and each shard's dK and dV are summed (in f32) over the ranks they visit.
pub fn backward<T: Element>(
    cfg: &AttentionConfig,
    sharding: Sharding,
    inputs: &[BackwardInputs<'_, T>],
) -> Result<Vec<RankGradients<T>>> {
    let ranks = check_ring(
        sharding,
        inputs.iter().map(|i| ForwardInputs {
            sinks: i.sinks,
            ..ForwardInputs::new(i.q, i.k, i.v)
        }),
    )?;
    let [batch, rows, heads, d] = inputs[0].q.layout.shape;
    let d_v = inputs[0].v.layout.shape[3];
    // Each rank's O, dO and LSE of its queries, before any is sliced.
    for i in inputs {
        for (operand, t) in [(Operand::Out, &i.out), (Operand::DOut, &i.dout)] {
            t.check(operand)?;
            Problem::expect_shape(operand, &t.layout, [batch, rows, heads, d_v])?;
        }
        // Exactly the rank's rows: a whole sequence's LSE here would read as wrong rows.
        if i.lse.len() != batch * heads * rows {
            return Err(Error::BufferTooSmall {
                operand: Operand::Lse,
                needed: batch * heads * rows,
                len: i.lse.len(),
            });
        }
    }
    let per = sharding.chunks_per_rank();
    let [_, _, heads_kv, _] = inputs[0].k.layout.shape;
    let len = rows / per;
    let zeros = |n: usize| alloc::<f32>(n);
    let mut dq: Vec<Vec<f32>> = (0..ranks)
        .map(|_| zeros(batch * rows * heads * d))
        .collect::<Result<_>>()?;
    let mut dk: Vec<Vec<f32>> = (0..ranks)
        .map(|_| zeros(batch * rows * heads_kv * d))
        .collect::<Result<_>>()?;
    let mut dv: Vec<Vec<f32>> = (0..ranks)
        .map(|_| zeros(batch * rows * heads_kv * d_v))
        .collect::<Result<_>>()?;
    let mut dsinks: Vec<Option<Vec<f64>>> = inputs
        .iter()
        .map(|i| i.sinks.map(|_| vec![0f64; heads]))
        .collect();
    // `part` (batch, n, h, w) added into the first n rows of chunk `c` of the rank's `acc`
    // (batch, rows, h, w).
    let add = |acc: &mut [f32], part: &[T], c: usize, n: usize, h: usize, w: usize| {
        for b in 0..batch {
            let src = &part[b * n * h * w..][..n * h * w];
            let dst = &mut acc[(b * rows + c * len) * h * w..][..n * h * w];
            for (a, x) in dst.iter_mut().zip(src) {
                *a += x.to_f32();
            }
        }
    };
    for (rank, own) in inputs.iter().enumerate() {
        for (ci, &qc) in sharding.chunk_ids(ranks, rank).iter().enumerate() {
            let (q, o, dout) = (
                chunk(&own.q, per, ci),
                chunk(&own.out, per, ci),
                chunk(&own.dout, per, ci),
            );
            // This chunk's LSE rows, (batch, heads, len).
            let mut lse = alloc::<f32>(batch * heads * len)?;
            for bh in 0..batch * heads {
                lse[bh * len..][..len].copy_from_slice(&own.lse[bh * rows + ci * len..][..len]);
            }
            for p in ring_pairs(cfg, sharding, ranks, rank, qc, len) {
                let (k, v) = (
                    chunk(&inputs[p.src].k, per, p.cj),
                    chunk(&inputs[p.src].v, per, p.cj),
                );
                // The pair's rows of the chunk's LSE, (batch, heads, q_rows).
                let part_lse;
                let lse = if p.q_rows < len {
                    let mut l = alloc::<f32>(batch * heads * p.q_rows)?;
                    for bh in 0..batch * heads {
                        l[bh * p.q_rows..][..p.q_rows]
                            .copy_from_slice(&lse[bh * len..][..p.q_rows]);
                    }
                    part_lse = l;
                    &part_lse[..]
                } else {
                    &lse[..]
                };
                let (src, cj) = (p.src, p.cj);
                let g = crate::backward(
                    &p.mask,
                    BackwardInputs {
                        q: first_rows(&q, p.q_rows),
                        k: first_rows(&k, p.k_rows),
                        v: first_rows(&v, p.k_rows),
                        out: first_rows(&o, p.q_rows),
                        dout: first_rows(&dout, p.q_rows),
                        lse,
                        sinks: own.sinks,
                    },
                )?;
                if let (Some(acc), Some(part)) = (&mut dsinks[rank], &g.dsinks) {
                    for (a, &x) in acc.iter_mut().zip(part) {
                        *a += f64::from(x);
                    }
                }
                add(&mut dq[rank], &g.dq, ci, p.q_rows, heads, d);
                add(&mut dk[src], &g.dk, cj, p.k_rows, heads_kv, d);
                add(&mut dv[src], &g.dv, cj, p.k_rows, heads_kv, d_v);
            }
        }
    }
    let round = |x: Vec<f32>| x.into_iter().map(T::from_f32).collect::<Vec<T>>();
    Ok(dq
        .into_iter()
        .zip(dk)
        .zip(dv)
        .zip(dsinks)
        .map(|(((dq, dk), dv), dsinks)| RankGradients {
            dq: round(dq),
            dk: round(dk),
            dv: round(dv),
            dsinks: dsinks.map(|s| s.into_iter().map(|x| x as f32).collect()),
        })
        .collect())
}

/// Each sequence's rows on a rank of a packed ring: for sequence b of `cu_seqlens` (self-attention,
/// its queries' and keys' offsets alike), its length and where its rows start in the rank's
/// shard (`len / ranks` of them). An error where the offsets describe no packing or a sequence's
/// length is no whole number of chunks (an empty sequence has none).
pub(crate) fn packed_rows(
    cu_seqlens: &[i32],
    sharding: Sharding,
    ranks: usize,
) -> Result<Vec<(usize, usize)>> {
    if ranks == 0 {
        return Err(Error::InvalidConfig(
            "a ring needs at least one rank".into(),
        ));
    }
    let longest = cu_seqlens
        .windows(2)
        .map(|w| w[1].saturating_sub(w[0]).max(0) as usize)
        .max()
        .unwrap_or(0);
    crate::varlen::Seqlens::new(cu_seqlens, cu_seqlens, longest, longest)?;
    let mut start = 0;
    cu_seqlens
        .windows(2)
        .map(|w| {
            let len = (w[1] - w[0]) as usize;
            if len > 0 {
                sharding.rows(len, ranks, 0)?;
            }
            let at = start;
            start += len / ranks;
            Ok((len, at))
        })
        .collect()
}

/// Rank `rank`'s shard of a packed `x` `(1, total, heads, d)` whose sequences `cu_seqlens`
/// delimits: each sequence's rows as [`Sharding::rows`] gives them for its length, the sequences
/// one after another, contiguous `(1, total / ranks, heads, d)`.
pub fn shard_packed<T: Element>(
    x: TensorRef<T>,
    cu_seqlens: &[i32],
    sharding: Sharding,
    ranks: usize,
    rank: usize,
) -> Result<Vec<T>> {
    x.check(Operand::Q)?;
    let [batch, total, heads, d] = x.layout.shape;
    let seqs = packed_rows(cu_seqlens, sharding, ranks)?;
    if batch != 1 || rank >= ranks || seqs.iter().map(|s| s.0).sum::<usize>() != total {
        return Err(Error::InvalidConfig(format!(
            "rank {rank} of {ranks}, over {batch} entries of {total} rows that cu_seqlens \
             {cu_seqlens:?} packs (one entry)"
        )));
    }
    let s = x.layout.strides;
    let mut out = alloc::<T>(total / ranks * heads * d)?;
    let mut at = 0;
    for (b, &(len, _)) in seqs.iter().enumerate() {
        if len == 0 {
            continue;
        }
        let first = cu_seqlens[b] as usize;
        for r in sharding.rows(len, ranks, rank)?.into_iter().flatten() {
            for h in 0..heads {
                let src = (first + r) * s[1] + h * s[2];
                out[at..at + d].copy_from_slice(&x.data[src..src + d]);
                at += d;
            }
        }
    }
    Ok(out)
}

/// Rows `at .. at + rows` of a rank's packed `(1, total, heads, d)` shard as one sequence's dense
/// `(1, rows, heads, d)` view.
fn sequence_rows<'a, T>(t: &TensorRef<'a, T>, at: usize, rows: usize) -> TensorRef<'a, T> {
    let [_, _, heads, d] = t.layout.shape;
    let s = t.layout.strides;
    TensorRef::new(
        &t.data[at * s[1]..],
        Layout::with_strides([1, rows, heads, d], s),
    )
}

/// A packed ring's sequences ([`packed_rows`]) and each rank's rows (`total / ranks`), once every
/// rank's shards of Q, K and V (`shards`, one item per rank) are checked to lie within their
/// buffers and hold those rows, one batch entry; an error for a ring of no rank.
fn packed_ring<'a, T: 'a>(
    cu_seqlens: &[i32],
    sharding: Sharding,
    shards: impl ExactSizeIterator<Item = [&'a TensorRef<'a, T>; 3]>,
) -> Result<(Vec<(usize, usize)>, usize)> {
    let ranks = shards.len();
    if ranks == 0 {
        return Err(Error::InvalidConfig(
            "a ring needs at least one rank".into(),
        ));
    }
    let seqs = packed_rows(cu_seqlens, sharding, ranks)?;
    let rows = seqs.iter().map(|s| s.0).sum::<usize>() / ranks;
    for rank in shards {
        for (operand, t) in [Operand::Q, Operand::K, Operand::V].into_iter().zip(rank) {
            t.check(operand)?;
            let [batch, r, _, _] = t.layout.shape;
            if batch != 1 || r != rows {
                return Err(Error::ShapeMismatch {
                    operand,
                    expected: [1, rows, t.layout.shape[2], t.layout.shape[3]],
                    found: t.layout.shape,
                });
            }
        }
    }
    Ok((seqs, rows))
}

/// [`forward`] over packed batches (self-attention: `cu_seqlens` delimits the queries and the
/// keys alike): rank r's `inputs[r]` holds its shard of every sequence ([`shard_packed`]), each
/// sequence's length a whole number of chunks; each rank gets its rows' O
/// `(1, total / ranks, heads_q, d_v)` and LSE `(heads_q, total / ranks)` (a packed call's
/// layouts). Each sequence runs as its own ring.
pub fn varlen_forward<T: Element>(
    cfg: &AttentionConfig,
    sharding: Sharding,
    cu_seqlens: &[i32],
    inputs: &[ForwardInputs<'_, T>],
) -> Result<Vec<ForwardOutput<T>>> {
    let (seqs, rows) = packed_ring(
        cu_seqlens,
        sharding,
        inputs.iter().map(|i| [&i.q, &i.k, &i.v]),
    )?;
    let ranks = inputs.len();
    let (heads, d_v) = (inputs[0].q.layout.shape[2], inputs[0].v.layout.shape[3]);
    let mut outs = Vec::with_capacity(ranks);
    for _ in 0..ranks {
        outs.push((
            alloc::<T>(rows * heads * d_v)?,
            alloc::<f32>(heads * rows)?,
            None,
        ));
    }
    for &(len, at) in seqs.iter().filter(|s| s.0 > 0) {
        let n = len / ranks;
        let views: Vec<_> = inputs
            .iter()
            .map(|i| ForwardInputs {
                sinks: i.sinks,
                ..ForwardInputs::new(
                    sequence_rows(&i.q, at, n),
                    sequence_rows(&i.k, at, n),
                    sequence_rows(&i.v, at, n),
                )
            })
            .collect();
        for (got, (out, lse, plan)) in forward(cfg, sharding, &views)?.into_iter().zip(&mut outs) {
            out[at * heads * d_v..][..n * heads * d_v].copy_from_slice(&got.out);
            for h in 0..heads {
                lse[h * rows + at..][..n].copy_from_slice(&got.lse[h * n..][..n]);
            }
            plan.get_or_insert(got.plan);
        }
    }
    outs.into_iter()
        .map(|(out, lse, plan)| {
            let plan = plan.ok_or_else(|| Error::InvalidConfig("a ring over no rows".into()))?;
            Ok(ForwardOutput { out, lse, plan })
        })
        .collect()
}

/// [`backward`] over packed batches, as [`varlen_forward`] shards them: rank r's `inputs[r]`
/// holds its shards of Q, K, V, O and dO `(1, total / ranks, ·, ·)` and its LSE
/// `(heads_q, total / ranks)`; each rank gets dQ, dK and dV of its rows (and its share of the
/// sinks' gradient, summed over the sequences).
pub fn varlen_backward<T: Element>(
    cfg: &AttentionConfig,
    sharding: Sharding,
    cu_seqlens: &[i32],
    inputs: &[BackwardInputs<'_, T>],
) -> Result<Vec<RankGradients<T>>> {
    let (seqs, rows) = packed_ring(
        cu_seqlens,
        sharding,
        inputs.iter().map(|i| [&i.q, &i.k, &i.v]),
    )?;
    let ranks = inputs.len();
    let first = &inputs[0];
    let ([_, _, heads, d], [_, _, heads_kv, _], d_v) = (
        first.q.layout.shape,
        first.k.layout.shape,
        first.v.layout.shape[3],
    );
    for i in inputs {
        for (operand, t) in [(Operand::Out, &i.out), (Operand::DOut, &i.dout)] {
            t.check(operand)?;
            Problem::expect_shape(operand, &t.layout, [1, rows, heads, d_v])?;
        }
        if i.lse.len() != heads * rows {
            return Err(Error::BufferTooSmall {
                operand: Operand::Lse,
                needed: heads * rows,
                len: i.lse.len(),
            });
        }
    }
    let mut grads = Vec::with_capacity(ranks);
    for i in inputs {
        grads.push(RankGradients {
            dq: alloc::<T>(rows * heads * d)?,
            dk: alloc::<T>(rows * heads_kv * d)?,
            dv: alloc::<T>(rows * heads_kv * d_v)?,
            dsinks: i.sinks.map(|_| vec![0f32; heads]),
        });
    }
    for &(len, at) in seqs.iter().filter(|s| s.0 > 0) {
        let n = len / ranks;
        // Each rank's LSE rows of this sequence, (1, heads, n).
        let lses = inputs
            .iter()
            .map(|i| {
                let mut l = alloc::<f32>(heads * n)?;
                for h in 0..heads {
                    l[h * n..][..n].copy_from_slice(&i.lse[h * rows + at..][..n]);
                }
                Ok(l)
            })
            .collect::<Result<Vec<_>>>()?;
        let views: Vec<_> = inputs
            .iter()
            .zip(&lses)
            .map(|(i, lse)| BackwardInputs {
                q: sequence_rows(&i.q, at, n),
                k: sequence_rows(&i.k, at, n),
                v: sequence_rows(&i.v, at, n),
                out: sequence_rows(&i.out, at, n),
                dout: sequence_rows(&i.dout, at, n),
                lse,
                sinks: i.sinks,
            })
            .collect();
        for (got, g) in backward(cfg, sharding, &views)?.into_iter().zip(&mut grads) {
            g.dq[at * heads * d..][..n * heads * d].copy_from_slice(&got.dq);
            g.dk[at * heads_kv * d..][..n * heads_kv * d].copy_from_slice(&got.dk);
            g.dv[at * heads_kv * d_v..][..n * heads_kv * d_v].copy_from_slice(&got.dv);
            if let (Some(acc), Some(part)) = (&mut g.dsinks, &got.dsinks) {
                for (a, x) in acc.iter_mut().zip(part) {
                    *a += x;
                }
            }
        }
    }
    Ok(grads)
}
