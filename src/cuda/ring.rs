//! The ring of [`crate::ring`] on one device: simulated ranks whose shards are buffers of that
//! device, the K and V shards handed around by a local transport (device-to-device copies on a
//! stream of their own, issued so as to overlap the step's attention calls), every query
//! chunk's parts merged by their LSE on the device. The same schedule runs one rank a device
//! across devices (nccl.rs, feature `nccl`), the copies then NCCL's sends and receives in the
//! same order ([`Rotation`]). The arithmetic is the host ring's, call for call (the same pairs
//! of chunks, masks and rows). In the backward each pair's gradients come in the inputs' type
//! and are summed in f32: each shard's dK and dV sums travel with it, every rank adding its
//! queries' part, and come home after the last step; dQ's stay; the sums are rounded once at
//! the end.

use std::sync::Arc;

use cudarc::driver::sys;
use cudarc::driver::{
    CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceRepr, DeviceSlice,
};

use super::{
    check_aligned, check_aligned_out, driver_error, Device, DeviceBackwardInputs,
    DeviceForwardInputs, DeviceGradientsMut, DeviceTensor, DeviceTensorMut,
};
use crate::backend::gpu::{self, RawTensor};
use crate::combine::LseLayout;
use crate::config::AttentionConfig;
use crate::dispatch::{Op, Plan};
use crate::error::CallPart;
use crate::error::{Error, Operand, Result};
use crate::ring::{self, Sharding};
use crate::tensor::{self, DType, Layout, Problem};
use crate::Element;

/// Where a rank's results go: O `(batch, rows, heads_q, d_v)` of its queries over the whole
/// sequence, and their LSE `(batch, heads_q, rows)` f32, contiguous.
#[derive(Debug)]
pub struct DeviceRingOutput<'a, 'o, T> {
    pub out: &'a mut DeviceTensorMut<'o, T>,
    pub lse: &'a mut CudaViewMut<'o, f32>,
}

/// The two streams a device ring runs on: the attention calls and merges on `compute`, the
/// transport's copies on `transport` (another stream of the same device, so that they overlap).
#[derive(Clone, Copy, Debug)]
pub struct RingStreams<'s> {
    pub compute: &'s Arc<CudaStream>,
    pub transport: &'s Arc<CudaStream>,
}

/// Where a rank's gradients go: dQ shaped like its Q shard, dK and dV like its K and V shards.
#[derive(Debug)]
pub struct DeviceRingGradients<'a, 'g, T> {
    pub dq: &'a mut DeviceTensorMut<'g, T>,
    pub dk: &'a mut DeviceTensorMut<'g, T>,
    pub dv: &'a mut DeviceTensorMut<'g, T>,
}

/// The buffers of one pair's backward call, for a whole chunk's rows (the call writes the first
/// of them): its dQ, dK and dV, and its LSE rows where it covers fewer than the chunk's. A rank
/// holds one set for each pair of chunks its steps run (query chunk `ci`, key chunk `cj` of
/// the held shard), taken before the ring starts and reused step after step in stream order.
struct PairGrads<T> {
    dq: CudaSlice<T>,
    dk: CudaSlice<T>,
    dv: CudaSlice<T>,
    lse: Option<CudaSlice<f32>>,
}

/// A rank's K and V shard as the transport holds it: a buffer of each.
struct Shard<T> {
    k: CudaSlice<T>,
    v: CudaSlice<T>,
}

/// The transport's buffers: two shards (K and V of `k_len` and `v_len` elements) for each of
/// the `held` ranks, none where the ring has one rank (a lone rank sends nothing).
fn shard_slots<T: DeviceRepr>(
    compute: &Arc<CudaStream>,
    count: usize,
    held: usize,
    (k_len, v_len): (usize, usize),
) -> Result<Vec<[Shard<T>; 2]>> {
    // SAFETY: each buffer is written whole by a transport copy before any call reads it.
    let slot = || -> Result<Shard<T>> {
        Ok(Shard {
            k: unsafe { compute.alloc::<T>(k_len) }.map_err(driver_error)?,
            v: unsafe { compute.alloc::<T>(v_len) }.map_err(driver_error)?,
        })
    };
    if count <= 1 {
        return Ok(vec![]);
    }
    (0..held).map(|_| Ok([slot()?, slot()?])).collect()
}

/// A query chunk's part over one key chunk: its O `(batch, len, heads_q, d_v)` and LSE `(batch,
/// heads_q, len)`, rows that see no key of the chunk O 0 and LSE +inf; where its call covers
/// only some rows, the LSE of those `(batch, heads_q, rows)` that the call writes.
struct Part<T> {
    out: CudaSlice<T>,
    lse: CudaSlice<f32>,
    call_lse: Option<CudaSlice<f32>>,
}

impl Device {
    /// [`crate::ring::forward`] on this device over `ranks.len()` simulated ranks, rank r's
    /// shards in `ranks[r]` as [`crate::ring::shard`] cuts them (Q `(batch, rows, heads_q, d)`,
    /// K and V `(batch, rows, heads_kv, ·)` contiguous: the transport moves them whole; sinks on
    /// every rank or on none), ordered on `streams.compute` (the inputs must be ready there, and
    /// the outputs are once its work so far has run): step `s` runs every rank's pairs over the shard it holds (that of rank
    /// `(r − s) mod ranks`) while the transport copies each held shard on to the next rank (two
    /// buffers a rank, so that a copy never writes the one being read). Each query chunk's
    /// parts (one per key chunk it sees) are kept until the last step and merged by
    /// [`Device::combine_into`]: at most 64 a chunk (32 ranks zig-zag, 64 contiguous). The
    /// outputs are each rank's O and LSE over the whole sequence. Takes device memory for the
    /// transport's buffers (two shards a rank) and the parts, given back in stream order.
    pub fn ring_forward_into<T: Element + DeviceRepr>(
        &self,
        streams: RingStreams<'_>,
        cfg: &AttentionConfig,
        sharding: Sharding,
        ranks: &[DeviceForwardInputs<'_, T>],
        outputs: &mut [DeviceRingOutput<'_, '_, T>],
    ) -> Result<Plan> {
        let local = Local::of(ranks.len());
        self.ring_forward_with(&local, streams, cfg, sharding, ranks, outputs)
    }

    /// The forward's schedule over the ranks held here (`ranks[i]` is ring rank
    /// `rotation.rank(i)`), the shards handed on by `rotation`.
    pub(super) fn ring_forward_with<T: Element + DeviceRepr, R: Rotation>(
        &self,
        rotation: &R,
        streams: RingStreams<'_>,
        cfg: &AttentionConfig,
        sharding: Sharding,
        ranks: &[DeviceForwardInputs<'_, T>],
        outputs: &mut [DeviceRingOutput<'_, '_, T>],
    ) -> Result<Plan> {
        let RingStreams { compute, transport } = streams;
        // Every check and allocation before the ranks agree to go on (Rotation::agree).
        let setup = (|| -> Result<_> {
            let held_here = check_held_ranks(rotation, sharding, ranks)?;
            let count = rotation.count();
            let per = sharding.chunks_per_rank();
            let max_parts = crate::ffi::FLASHATTN_MAX_COMBINE_PARTS as usize;
            if count * per > max_parts {
                return Err(Error::InvalidConfig(format!(
                "a ring of {count} ranks ({sharding:?}): a query chunk would merge {} parts on \
                 the device (at most {max_parts})",
                count * per
            )));
            }
            if outputs.len() != held_here {
                return Err(Error::InvalidConfig(format!(
                    "{} outputs for {held_here} ranks",
                    outputs.len()
                )));
            }
            let [batch, rows, heads, _] = ranks[0].q.layout.shape;
            let d_v = ranks[0].v.layout.shape[3];
            let len = rows / per;
            for (r, (rank, output)) in ranks.iter().zip(outputs.iter()).enumerate() {
                tensor::check_len(Operand::Q, &rank.q.layout, rank.q.data.len())?;
                for (operand, t) in [(Operand::K, rank.k), (Operand::V, rank.v)] {
                    tensor::check_len(operand, &t.layout, t.data.len())?;
                    check_contiguous(r, operand, &t.layout)?;
                }
                tensor::check_output_len(Operand::Out, &output.out.layout, output.out.data.len())?;
                crate::tensor::Problem::expect_shape(
                    Operand::Out,
                    &output.out.layout,
                    [batch, rows, heads, d_v],
                )?;
                if output.lse.len() != batch * heads * rows {
                    return Err(Error::BufferTooSmall {
                        operand: Operand::Lse,
                        needed: batch * heads * rows,
                        len: output.lse.len(),
                    });
                }
            }
            let mut contexts = vec![(CallPart::Stream, transport.context())];
            for (r, o) in ranks.iter().zip(outputs.iter()) {
                contexts.push((Operand::Q.into(), r.q.data.stream().context()));
                contexts.push((Operand::K.into(), r.k.data.stream().context()));
                contexts.push((Operand::V.into(), r.v.data.stream().context()));
                contexts.extend(
                    r.sinks
                        .map(|s| (Operand::Sinks.into(), s.stream().context())),
                );
                contexts.push((Operand::Out.into(), o.out.data.stream().context()));
                contexts.push((Operand::Lse.into(), o.lse.stream().context()));
            }
            self.check_same_context(compute, contexts)?;

            // A shard's elements (K and V contiguous: their shapes' products).
            let elements = |shape: [usize; 4]| shape.iter().product::<usize>();
            let (k_len, v_len) = (
                elements(ranks[0].k.layout.shape),
                elements(ranks[0].v.layout.shape),
            );
            let slots = shard_slots::<T>(compute, count, held_here, (k_len, v_len))?;
            // Each rank's query chunks' pairs, in ring order, and their parts.
            let pairs = rank_pairs(rotation, cfg, sharding, held_here, len);
            // What the pairs' calls would refuse, refused now (before any rank sends).
            for (rank, out) in ranks.iter().zip(outputs.iter()) {
                if let Some(sinks) = rank.sinks {
                    if sinks.len() < heads {
                        return Err(Error::BufferTooSmall {
                            operand: Operand::Sinks,
                            needed: heads,
                            len: sinks.len(),
                        });
                    }
                }
                check_aligned::<T>(
                    compute,
                    &[
                        (Operand::Q, rank.q),
                        (Operand::K, rank.k),
                        (Operand::V, rank.v),
                    ],
                )?;
                check_aligned_out::<T>(compute, Operand::Out, out.out)?;
            }
            self.plan_pairs::<T>(Op::Forward, &pairs, rank_dims(&ranks[0]))?;
            let parts: Vec<Vec<Vec<Part<T>>>> = pairs
                .iter()
                .map(|chunks| {
                    chunks
                        .iter()
                        .map(|chunk| {
                            chunk
                                .iter()
                                .map(|p| {
                                    self.part(
                                        compute,
                                        (batch * len * heads * d_v, batch * heads * len),
                                        (p.q_rows < len).then_some(batch * heads * p.q_rows),
                                    )
                                })
                                .collect::<Result<_>>()
                        })
                        .collect::<Result<_>>()
                })
                .collect::<Result<_>>()?;
            Ok((count, per, len, (k_len, v_len), slots, pairs, parts))
        })();
        rotation.agree(setup.as_ref().err())?;
        let (count, per, len, (k_len, v_len), mut slots, pairs, mut parts) = setup?;

        let event = |stream: &Arc<CudaStream>| stream.record_event(None).map_err(driver_error);
        // The inputs (and the buffers just taken) are ready on `compute`.
        transport.wait(&event(compute)?).map_err(driver_error)?;
        // From here on `compute` waits for the transport before the buffers are given back, an
        // error included.
        let joined = TransportJoin {
            compute,
            transport,
            read: ranks.iter().flat_map(|r| [&r.k.data, &r.v.data]).collect(),
            armed: true,
        };
        let mut plan = None;
        for step in 0..count {
            // The transport hands each held shard on, into the next rank's buffer that it read in
            // the step before (the transport waited for that step's calls): the copies overlap
            // this step's calls, which read the other buffer.
            if step + 1 < count {
                rotate_shards(rotation, transport, ranks, &mut slots, step, (k_len, v_len))?;
            }
            let sent = event(transport)?;
            // This step's calls: rank r's pairs over rank (r − step)'s chunks.
            for (i, rank) in ranks.iter().enumerate() {
                let src = (rotation.rank(i) + count - step) % count;
                let (k_held, v_held) = held((&rank.k.data, &rank.v.data), &slots, i, step);
                for (ci, chunk_pairs) in pairs[i].iter().enumerate() {
                    for (pi, p) in chunk_pairs.iter().enumerate() {
                        if p.src != src {
                            continue;
                        }
                        let part = &mut parts[i][ci][pi];
                        let done =
                            self.ring_part(compute, (rank, ci, len), (&k_held, &v_held), p, part)?;
                        plan.get_or_insert(done);
                    }
                }
            }
            // The next step reads what the transport sent in this one, and its copies write
            // the buffers this step read.
            compute.wait(&sent).map_err(driver_error)?;
            transport.wait(&event(compute)?).map_err(driver_error)?;
        }
        rotation.settled();
        joined.finish()?;
        // Each query chunk's parts merged into its rows of the rank's outputs.
        for (r, output) in outputs.iter_mut().enumerate() {
            for (ci, chunk_parts) in parts[r].iter().enumerate() {
                self.merge_chunk(compute, chunk_parts, (ci, per, len), output)?;
            }
        }
        plan.ok_or_else(|| Error::InvalidConfig("a ring step saw no keys".into()))
    }

    /// [`crate::ring::backward`] on this device over `ranks.len()` simulated ranks, ordered on
    /// `streams.compute` as [`Device::ring_forward_into`] is: step `s` runs every rank's pairs
    /// over the shard it holds (rank `(r − s) mod ranks`'s), each pair's backward into buffers of
    /// its rows, then adds its dQ into the rank's f32 dQ and its dK and dV into the f32
    /// accumulators that travel with the shard. The transport hands the K and V shards on as
    /// in the forward (issued to overlap the step's calls) and each accumulator on once the
    /// step's adds into it are done (issued to overlap the next step's calls, whose adds wait
    /// for it); after the last step one more hop brings every accumulator home. Each pair's
    /// gradients come in `T` and the f32 sums are rounded to `T` once, at the end. Each rank's
    /// inputs are its shards (as the forward's), O, dO and LSE `(batch, heads_q, rows)`; their
    /// sinks are not read: the sinks' gradient is not computed here (dQ, dK and dV need only
    /// the LSE, which holds the sinks). Takes device memory, all of it before the first step, for
    /// the transport's buffers, the f32 sums (two dK and dV sums a rank), the pairs'
    /// gradients (a chunk's dQ, dK and dV in `T` for each pair of chunks its steps run: one a
    /// rank contiguous, at most four zig-zag, three causal; and their LSE rows where a pair covers
    /// fewer rows than its chunk), the zig-zag chunks' LSE rows, and one backward workspace (the
    /// largest a pair's call takes), given back in stream order.
    pub fn ring_backward_into<T: Element + DeviceRepr>(
        &self,
        streams: RingStreams<'_>,
        cfg: &AttentionConfig,
        sharding: Sharding,
        ranks: &[DeviceBackwardInputs<'_, T>],
        grads: &mut [DeviceRingGradients<'_, '_, T>],
    ) -> Result<Plan> {
        let local = Local::of(ranks.len());
        self.ring_backward_with(&local, streams, cfg, sharding, ranks, grads)
    }

    /// The backward's schedule over the ranks held here (`ranks[i]` is ring rank
    /// `rotation.rank(i)`), the shards and the sums handed on by `rotation`.
    pub(super) fn ring_backward_with<T: Element + DeviceRepr, R: Rotation>(
        &self,
        rotation: &R,
        streams: RingStreams<'_>,
        cfg: &AttentionConfig,
        sharding: Sharding,
        ranks: &[DeviceBackwardInputs<'_, T>],
        grads: &mut [DeviceRingGradients<'_, '_, T>],
    ) -> Result<Plan> {
        let RingStreams { compute, transport } = streams;
        // Every check and allocation before the ranks agree to go on (Rotation::agree).
        let setup = (|| -> Result<_> {
            let held_here = check_held_ranks(rotation, sharding, ranks)?;
            let count = rotation.count();
            if grads.len() != held_here {
                return Err(Error::InvalidConfig(format!(
                    "{} gradients for {held_here} ranks",
                    grads.len()
                )));
            }
            let per = sharding.chunks_per_rank();
            let [batch, rows, heads, d] = ranks[0].q.layout.shape;
            let [_, _, heads_kv, _] = ranks[0].k.layout.shape;
            let d_v = ranks[0].v.layout.shape[3];
            let len = rows / per;
            let (q_shape, k_shape, v_shape) = (
                [batch, rows, heads, d],
                [batch, rows, heads_kv, d],
                [batch, rows, heads_kv, d_v],
            );
            for (r, (rank, g)) in ranks.iter().zip(grads.iter()).enumerate() {
                tensor::check_len(Operand::Q, &rank.q.layout, rank.q.data.len())?;
                for (operand, t) in [(Operand::K, rank.k), (Operand::V, rank.v)] {
                    tensor::check_len(operand, &t.layout, t.data.len())?;
                    check_contiguous(r, operand, &t.layout)?;
                }
                for (operand, t) in [(Operand::Out, rank.out), (Operand::DOut, rank.dout)] {
                    crate::tensor::Problem::expect_shape(
                        operand,
                        &t.layout,
                        [batch, rows, heads, d_v],
                    )?;
                    tensor::check_len(operand, &t.layout, t.data.len())?;
                }
                // Exactly the rank's rows: a whole sequence's LSE here would read as wrong rows.
                if rank.lse.len() != batch * heads * rows {
                    return Err(Error::BufferTooSmall {
                        operand: Operand::Lse,
                        needed: batch * heads * rows,
                        len: rank.lse.len(),
                    });
                }
                for (operand, t, shape) in [
                    (Operand::DQ, &g.dq, q_shape),
                    (Operand::DK, &g.dk, k_shape),
                    (Operand::DV, &g.dv, v_shape),
                ] {
                    crate::tensor::Problem::expect_shape(operand, &t.layout, shape)?;
                    tensor::check_output_len(operand, &t.layout, t.data.len())?;
                }
            }
            let mut contexts = vec![(CallPart::Stream, transport.context())];
            for (r, g) in ranks.iter().zip(grads.iter()) {
                for (operand, t) in [
                    (Operand::Q, r.q),
                    (Operand::K, r.k),
                    (Operand::V, r.v),
                    (Operand::Out, r.out),
                    (Operand::DOut, r.dout),
                ] {
                    contexts.push((operand.into(), t.data.stream().context()));
                }
                contexts.push((Operand::Lse.into(), r.lse.stream().context()));
                for (operand, t) in [
                    (Operand::DQ, &g.dq),
                    (Operand::DK, &g.dk),
                    (Operand::DV, &g.dv),
                ] {
                    contexts.push((operand.into(), t.data.stream().context()));
                }
            }
            self.check_same_context(compute, contexts)?;

            let elements = |shape: [usize; 4]| shape.iter().product::<usize>();
            let (k_len, v_len) = (elements(k_shape), elements(v_shape));
            let zeros = |n: usize| compute.alloc_zeros::<f32>(n).map_err(driver_error);
            // SAFETY (the uninitialized buffers below): each is written whole (a transport copy, or
            // a call) before anything reads it.
            let slots = shard_slots::<T>(compute, count, held_here, (k_len, v_len))?;
            let dq_sums: Vec<CudaSlice<f32>> = (0..held_here)
                .map(|_| zeros(elements(q_shape)))
                .collect::<Result<_>>()?;
            // The travelling dK and dV sums, two a rank: at step s a rank adds into its buffer
            // s % 2, which is zeros at step 0 and later what the hop from the rank before brought
            // (written whole before the adds: buffer 1 needs no zeros).
            let sums: Vec<[Shard<f32>; 2]> = (0..held_here)
                .map(|_| {
                    // SAFETY: see above.
                    let written =
                        |n: usize| unsafe { compute.alloc::<f32>(n) }.map_err(driver_error);
                    Ok([
                        Shard {
                            k: zeros(k_len)?,
                            v: zeros(v_len)?,
                        },
                        Shard {
                            k: written(k_len)?,
                            v: written(v_len)?,
                        },
                    ])
                })
                .collect::<Result<_>>()?;
            // Each query chunk's LSE rows, (batch, heads, len): a zig-zag rank's copied out of its
            // LSE once (its chunks' rows are not contiguous there), a contiguous rank's its own.
            let chunk_lse: Vec<Vec<Option<CudaSlice<f32>>>> = ranks
                .iter()
                .map(|rank| {
                    (0..per)
                        .map(|ci| {
                            if per == 1 {
                                return Ok(None);
                            }
                            // SAFETY: the copy writes every element before a call reads it.
                            let mut l = unsafe { compute.alloc::<f32>(batch * heads * len) }
                                .map_err(driver_error)?;
                            copy_rows_f32(
                                self,
                                compute,
                                (&rank.lse.slice(ci * len..), rows),
                                (&mut l.slice_mut(..), len),
                                (len, batch * heads),
                            )?;
                            Ok(Some(l))
                        })
                        .collect::<Result<_>>()
                })
                .collect::<Result<_>>()?;
            let pairs = rank_pairs(rotation, cfg, sharding, held_here, len);
            let (q_chunk, k_chunk, v_chunk) = (
                [batch, len, heads, d],
                [batch, len, heads_kv, d],
                [batch, len, heads_kv, d_v],
            );
            // A set for each pair of chunks some step runs (a causal zig-zag ring never pairs a
            // rank's first query chunk with a shard's second key chunk), its LSE rows where the
            // pair covers fewer rows than the chunk.
            // SAFETY: each pair's call writes its rows of them, and the LSE copy its rows,
            // before anything reads them, in stream order.
            let take = |n: usize| unsafe { compute.alloc::<T>(n) }.map_err(driver_error);
            let pair_grads: Vec<Vec<Option<PairGrads<T>>>> = pairs
                .iter()
                .map(|chunks| {
                    (0..per * per)
                        .map(|slot| {
                            let mut run = chunks
                                .iter()
                                .enumerate()
                                .flat_map(|(ci, ps)| ps.iter().map(move |p| (ci, p)))
                                .filter(|(ci, p)| ci * per + p.cj == slot)
                                .peekable();
                            if run.peek().is_none() {
                                return Ok(None);
                            }
                            let truncated = run.any(|(_, p)| p.q_rows < len);
                            Ok(Some(PairGrads {
                                dq: take(elements(q_chunk))?,
                                dk: take(elements(k_chunk))?,
                                dv: take(elements(v_chunk))?,
                                lse: truncated
                                    .then(|| {
                                        unsafe { compute.alloc::<f32>(batch * heads * len) }
                                            .map_err(driver_error)
                                    })
                                    .transpose()?,
                            }))
                        })
                        .collect::<Result<_>>()
                })
                .collect::<Result<_>>()?;
            // What the pairs' calls would refuse, refused now (before any rank sends).
            for (rank, g) in ranks.iter().zip(grads.iter()) {
                check_aligned::<T>(
                    compute,
                    &[
                        (Operand::Q, rank.q),
                        (Operand::K, rank.k),
                        (Operand::V, rank.v),
                        (Operand::Out, rank.out),
                        (Operand::DOut, rank.dout),
                    ],
                )?;
                for (operand, t) in [
                    (Operand::DQ, &g.dq),
                    (Operand::DK, &g.dk),
                    (Operand::DV, &g.dv),
                ] {
                    check_aligned_out::<T>(compute, operand, t)?;
                }
            }
            let workspace_bytes =
                self.plan_pairs::<T>(Op::Backward, &pairs, rank_dims(&ranks[0]))?;
            // SAFETY: the kernels zero what they accumulate into and write the rest before
            // reading it (as a call's own workspace); the pairs' calls use it one after another.
            let workspace =
                unsafe { compute.alloc::<u8>(workspace_bytes) }.map_err(driver_error)?;
            Ok((
                (count, per, len),
                (q_shape, k_shape, v_shape),
                (k_len, v_len),
                slots,
                dq_sums,
                sums,
                chunk_lse,
                pairs,
                (pair_grads, workspace),
            ))
        })();
        rotation.agree(setup.as_ref().err())?;
        let (
            (count, per, len),
            (q_shape, k_shape, v_shape),
            (k_len, v_len),
            mut slots,
            mut dq_sums,
            mut sums,
            chunk_lse,
            pairs,
            (mut pair_grads, mut workspace),
        ) = setup?;

        let event = |stream: &Arc<CudaStream>| stream.record_event(None).map_err(driver_error);
        transport.wait(&event(compute)?).map_err(driver_error)?;
        let joined = TransportJoin {
            compute,
            transport,
            read: ranks.iter().flat_map(|r| [&r.k.data, &r.v.data]).collect(),
            armed: true,
        };
        let mut plan = None;
        let mut sums_sent: Option<cudarc::driver::CudaEvent> = None;
        for step in 0..count {
            if step + 1 < count {
                rotate_shards(rotation, transport, ranks, &mut slots, step, (k_len, v_len))?;
            }
            let kv_sent = event(transport)?;
            // This step's calls, each into gradient buffers of its rows.
            let mut done = vec![];
            for (i, rank) in ranks.iter().enumerate() {
                let src = (rotation.rank(i) + count - step) % count;
                let (k_held, v_held) = held((&rank.k.data, &rank.v.data), &slots, i, step);
                for (ci, chunk_pairs) in pairs[i].iter().enumerate() {
                    for p in chunk_pairs.iter().filter(|p| p.src == src) {
                        let lse = match &chunk_lse[i][ci] {
                            Some(l) => l.slice(..),
                            None => rank.lse.slice(..),
                        };
                        let done_plan = self.ring_backward_part(
                            compute,
                            (rank, ci, len, &lse),
                            (&k_held, &v_held),
                            p,
                            (
                                pair_grads[i][ci * per + p.cj]
                                    .as_mut()
                                    .ok_or_else(missing_pair_grads)?,
                                &mut workspace,
                            ),
                        )?;
                        plan.get_or_insert(done_plan);
                        done.push((i, ci, p));
                    }
                }
            }
            // The sums: dQ at home; dK and dV into the travelling ones, once they have come.
            if let Some(sent) = &sums_sent {
                compute.wait(sent).map_err(driver_error)?;
            }
            for &(i, ci, p) in &done {
                let part = pair_grads[i][ci * per + p.cj]
                    .as_ref()
                    .ok_or_else(missing_pair_grads)?;
                // A part's `n` rows (batch, n, h, w), added into rows `first..` of a sum of
                // `shape`.
                let add = |operand: Operand,
                           part: &CudaSlice<T>,
                           sum: &mut CudaSlice<f32>,
                           shape: [usize; 4],
                           first: usize,
                           n: usize| {
                    let strides = Layout::contiguous(shape).strides;
                    let rows_shape = [shape[0], n, shape[2], shape[3]];
                    add_rows(
                        self,
                        compute,
                        operand,
                        (&part.slice(..), Layout::contiguous(rows_shape)),
                        (
                            &mut sum.slice_mut(first * strides[1]..),
                            Layout::with_strides(rows_shape, strides),
                        ),
                    )
                };
                add(
                    Operand::DQ,
                    &part.dq,
                    &mut dq_sums[i],
                    q_shape,
                    ci * len,
                    p.q_rows,
                )?;
                let sum = &mut sums[i][step % 2];
                add(
                    Operand::DK,
                    &part.dk,
                    &mut sum.k,
                    k_shape,
                    p.cj * len,
                    p.k_rows,
                )?;
                add(
                    Operand::DV,
                    &part.dv,
                    &mut sum.v,
                    v_shape,
                    p.cj * len,
                    p.k_rows,
                )?;
            }
            drop(done);
            // The next step reads the K and V sent in this one; the transport's next copies
            // write what this step read, and the sums go on once this step's adds are done
            // (after the last step, home).
            compute.wait(&kv_sent).map_err(driver_error)?;
            transport.wait(&event(compute)?).map_err(driver_error)?;
            let (added, mut filled): (Vec<_>, Vec<_>) = sums
                .iter_mut()
                .map(|pair| {
                    let (read, fill) = read_and_fill(pair, step + 1);
                    (
                        [read.k.slice(..), read.v.slice(..)],
                        [fill.k.slice_mut(..), fill.v.slice_mut(..)],
                    )
                })
                .unzip();
            rotation.rotate(transport, &added, &mut filled)?;
            sums_sent = Some(event(transport)?);
        }
        rotation.settled();
        if let Some(sent) = &sums_sent {
            compute.wait(sent).map_err(driver_error)?;
        }
        joined.finish()?;
        // Every sum home (a rank's in its buffer count % 2), rounded once.
        for (i, g) in grads.iter_mut().enumerate() {
            let home = &sums[i][count % 2];
            for (operand, sum, out) in [
                (Operand::DQ, &dq_sums[i], &mut *g.dq),
                (Operand::DK, &home.k, &mut *g.dk),
                (Operand::DV, &home.v, &mut *g.dv),
            ] {
                round_rows(self, compute, operand, &sum.slice(..), out)?;
            }
        }
        plan.ok_or_else(|| Error::InvalidConfig("a ring step saw no keys".into()))
    }

    /// One pair's backward: rank `rank`'s query chunk `ci` (of `len` rows; its first `p.q_rows`,
    /// with their O, dO and LSE, of the chunk's `chunk_lse` (batch, heads, len)) against key
    /// chunk `p.cj` of the held shard (its first `p.k_rows`), into the first rows of `grads`.
    fn ring_backward_part<T: Element + DeviceRepr>(
        &self,
        stream: &Arc<CudaStream>,
        (rank, ci, len, chunk_lse): (&DeviceBackwardInputs<'_, T>, usize, usize, &CudaView<f32>),
        (k_held, v_held): (&CudaView<T>, &CudaView<T>),
        p: &ring::Pair,
        (grads, workspace): (&mut PairGrads<T>, &mut CudaSlice<u8>),
    ) -> Result<Plan> {
        let [batch, _, heads, d] = rank.q.layout.shape;
        let [_, _, heads_kv, _] = rank.k.layout.shape;
        let d_v = rank.v.layout.shape[3];
        // Rows `first..first + n` of a tensor of `shape` in `data`, in `strides`.
        fn rows_of<'v, T>(
            data: &'v CudaView<'_, T>,
            shape: [usize; 4],
            strides: [usize; 4],
            first: usize,
            n: usize,
        ) -> DeviceTensor<'v, T> {
            DeviceTensor::new(
                data.slice(first * strides[1]..),
                Layout::with_strides([shape[0], n, shape[2], shape[3]], strides),
            )
        }
        let q_first = ci * len;
        let (q, out, dout) = (
            rows_of(
                &rank.q.data,
                rank.q.layout.shape,
                rank.q.layout.strides,
                q_first,
                p.q_rows,
            ),
            rows_of(
                &rank.out.data,
                rank.out.layout.shape,
                rank.out.layout.strides,
                q_first,
                p.q_rows,
            ),
            rows_of(
                &rank.dout.data,
                rank.dout.layout.shape,
                rank.dout.layout.strides,
                q_first,
                p.q_rows,
            ),
        );
        let (k_shape, v_shape) = (rank.k.layout.shape, rank.v.layout.shape);
        let k = rows_of(
            k_held,
            k_shape,
            Layout::contiguous(k_shape).strides,
            p.cj * len,
            p.k_rows,
        );
        let v = rows_of(
            v_held,
            v_shape,
            Layout::contiguous(v_shape).strides,
            p.cj * len,
            p.k_rows,
        );
        // The rows' LSE, (batch, heads, q_rows): the chunk's where it is all of them.
        let lse = if p.q_rows == len {
            chunk_lse.slice(..)
        } else {
            let rows = grads.lse.as_mut().ok_or_else(missing_pair_grads)?;
            copy_rows_f32(
                self,
                stream,
                (chunk_lse, len),
                (&mut rows.slice_mut(..), p.q_rows),
                (p.q_rows, batch * heads),
            )?;
            rows.slice(..batch * heads * p.q_rows)
        };
        let (q_n, k_n) = (batch * p.q_rows * heads, batch * p.k_rows * heads_kv);
        self.backward_launch(
            stream,
            &p.mask,
            None,
            DeviceBackwardInputs {
                q: &q,
                k: &k,
                v: &v,
                out: &out,
                dout: &dout,
                lse: &lse,
                sinks: None,
            },
            DeviceGradientsMut {
                dq: &mut DeviceTensorMut::new(
                    grads.dq.slice_mut(..q_n * d),
                    Layout::contiguous([batch, p.q_rows, heads, d]),
                ),
                dk: &mut DeviceTensorMut::new(
                    grads.dk.slice_mut(..k_n * d),
                    Layout::contiguous([batch, p.k_rows, heads_kv, d]),
                ),
                dv: &mut DeviceTensorMut::new(
                    grads.dv.slice_mut(..k_n * d_v),
                    Layout::contiguous([batch, p.k_rows, heads_kv, d_v]),
                ),
                dsinks: None,
            },
            Some(workspace),
        )
    }

    /// [`crate::ring::varlen_forward`] on this device: packed batches (self-attention,
    /// `cu_seqlens` on the host delimiting each sequence's rows), rank r's shard of every
    /// sequence in `ranks[r]` (as [`crate::ring::shard_packed`] cuts them: Q, K and V `(1,
    /// total / ranks, heads, ·)`), each sequence run as its own ring
    /// ([`Device::ring_forward_into`]) over its rows of the shards, into the rank's O `(1,
    /// total / ranks, heads_q, d_v)` and LSE `(heads_q, total / ranks)` (a packed call's
    /// layouts). Each sequence's length is a whole number of chunks (an empty one has none).
    pub fn ring_varlen_forward_into<T: Element + DeviceRepr>(
        &self,
        streams: RingStreams<'_>,
        cfg: &AttentionConfig,
        sharding: Sharding,
        cu_seqlens: &[i32],
        ranks: &[DeviceForwardInputs<'_, T>],
        outputs: &mut [DeviceRingOutput<'_, '_, T>],
    ) -> Result<Plan> {
        let count = ranks.len();
        let (seqs, rows) = packed_shards(
            cu_seqlens,
            sharding,
            ranks
                .iter()
                .map(|r| [r.q.layout.shape, r.k.layout.shape, r.v.layout.shape]),
            ("outputs", outputs.len()),
            outputs.iter().map(|o| o.lse.len()),
        )?;
        let heads = ranks[0].q.layout.shape[2];
        let mut plan = None;
        for &(len, at) in seqs.iter().filter(|s| s.0 > 0) {
            let n = len / count;
            let views: Vec<[DeviceTensor<T>; 3]> = ranks
                .iter()
                .map(|r| {
                    Ok([
                        sequence_rows(r.q, at, n)?,
                        sequence_rows(r.k, at, n)?,
                        sequence_rows(r.v, at, n)?,
                    ])
                })
                .collect::<Result<_>>()?;
            let seq_ranks: Vec<DeviceForwardInputs<T>> = views
                .iter()
                .zip(ranks)
                .map(|([q, k, v], r)| DeviceForwardInputs {
                    q,
                    k,
                    v,
                    sinks: r.sinks,
                })
                .collect();
            // SAFETY: the ring writes every element before the copy reads it.
            let mut lse: Vec<CudaSlice<f32>> = (0..count)
                .map(|_| unsafe { streams.compute.alloc::<f32>(heads * n) }.map_err(driver_error))
                .collect::<Result<_>>()?;
            {
                let mut outs: Vec<DeviceTensorMut<T>> = outputs
                    .iter_mut()
                    .map(|o| sequence_rows_mut(o.out, at, n))
                    .collect::<Result<_>>()?;
                let mut lse_views: Vec<CudaViewMut<f32>> =
                    lse.iter_mut().map(|l| l.slice_mut(..)).collect();
                let mut seq_outputs: Vec<DeviceRingOutput<T>> = outs
                    .iter_mut()
                    .zip(lse_views.iter_mut())
                    .map(|(out, lse)| DeviceRingOutput { out, lse })
                    .collect();
                let p =
                    self.ring_forward_into(streams, cfg, sharding, &seq_ranks, &mut seq_outputs)?;
                plan.get_or_insert(p);
            }
            // The sequence's LSE rows into the rank's, (heads, total / ranks).
            for (l, o) in lse.iter().zip(outputs.iter_mut()) {
                copy_rows_f32(
                    self,
                    streams.compute,
                    (&l.slice(..), n),
                    (&mut o.lse.slice_mut(at..), rows),
                    (n, heads),
                )?;
            }
        }
        plan.ok_or_else(|| Error::InvalidConfig("a ring over no rows".into()))
    }

    /// [`crate::ring::varlen_backward`] on this device, as [`Device::ring_varlen_forward_into`]
    /// runs the forward: each sequence's ring backward ([`Device::ring_backward_into`]) over its
    /// rows of every rank's shards, O, dO and LSE `(heads_q, total / ranks)` (the forward's),
    /// into its rows of the rank's gradients.
    pub fn ring_varlen_backward_into<T: Element + DeviceRepr>(
        &self,
        streams: RingStreams<'_>,
        cfg: &AttentionConfig,
        sharding: Sharding,
        cu_seqlens: &[i32],
        ranks: &[DeviceBackwardInputs<'_, T>],
        grads: &mut [DeviceRingGradients<'_, '_, T>],
    ) -> Result<Plan> {
        let count = ranks.len();
        let (seqs, rows) = packed_shards(
            cu_seqlens,
            sharding,
            ranks
                .iter()
                .map(|r| [r.q.layout.shape, r.k.layout.shape, r.v.layout.shape]),
            ("gradients", grads.len()),
            ranks.iter().map(|r| r.lse.len()),
        )?;
        let heads = ranks[0].q.layout.shape[2];
        let mut plan = None;
        for &(len, at) in seqs.iter().filter(|s| s.0 > 0) {
            let n = len / count;
            // The sequence's LSE rows of each rank, (1, heads, n).
            let lse: Vec<CudaSlice<f32>> = ranks
                .iter()
                .map(|r| {
                    // SAFETY: the copy writes every element before the ring reads it.
                    let mut l =
                        unsafe { streams.compute.alloc::<f32>(heads * n) }.map_err(driver_error)?;
                    copy_rows_f32(
                        self,
                        streams.compute,
                        (&r.lse.slice(at..), rows),
                        (&mut l.slice_mut(..), n),
                        (n, heads),
                    )?;
                    Ok(l)
                })
                .collect::<Result<_>>()?;
            let lse_views: Vec<CudaView<f32>> = lse.iter().map(|l| l.slice(..)).collect();
            let views: Vec<[DeviceTensor<T>; 5]> = ranks
                .iter()
                .map(|r| {
                    Ok([
                        sequence_rows(r.q, at, n)?,
                        sequence_rows(r.k, at, n)?,
                        sequence_rows(r.v, at, n)?,
                        sequence_rows(r.out, at, n)?,
                        sequence_rows(r.dout, at, n)?,
                    ])
                })
                .collect::<Result<_>>()?;
            let seq_ranks: Vec<DeviceBackwardInputs<T>> = views
                .iter()
                .zip(&lse_views)
                .map(|([q, k, v, out, dout], lse)| DeviceBackwardInputs {
                    q,
                    k,
                    v,
                    out,
                    dout,
                    lse,
                    sinks: None,
                })
                .collect();
            let mut g_views: Vec<[DeviceTensorMut<T>; 3]> = grads
                .iter_mut()
                .map(|g| {
                    Ok([
                        sequence_rows_mut(g.dq, at, n)?,
                        sequence_rows_mut(g.dk, at, n)?,
                        sequence_rows_mut(g.dv, at, n)?,
                    ])
                })
                .collect::<Result<_>>()?;
            let mut seq_grads: Vec<DeviceRingGradients<T>> = g_views
                .iter_mut()
                .map(|[dq, dk, dv]| DeviceRingGradients { dq, dk, dv })
                .collect();
            let p = self.ring_backward_into(streams, cfg, sharding, &seq_ranks, &mut seq_grads)?;
            plan.get_or_insert(p);
        }
        plan.ok_or_else(|| Error::InvalidConfig("a ring over no rows".into()))
    }

    /// A part's buffers of `out` and `lse` elements; where its call writes only some rows
    /// (`call_lse`: its LSE's elements), O zeros and LSE +inf, which the others keep, and the
    /// call's own LSE. Taken before the ring starts, so that no step allocates.
    fn part<T: Element + DeviceRepr>(
        &self,
        stream: &Arc<CudaStream>,
        (out, lse): (usize, usize),
        call_lse: Option<usize>,
    ) -> Result<Part<T>> {
        // SAFETY: every element is set in stream order before any read: by the part's call, and
        // where it writes only some rows, by the fills below first (the call's LSE by the call).
        let mut o = unsafe { stream.alloc::<T>(out) }.map_err(driver_error)?;
        let mut l = unsafe { stream.alloc::<f32>(lse) }.map_err(driver_error)?;
        let call_lse = call_lse
            .map(|n| unsafe { stream.alloc::<f32>(n) }.map_err(driver_error))
            .transpose()?;
        if call_lse.is_some() {
            self.ctx.bind_to_thread().map_err(driver_error)?;
            let (o_ptr, _o) = o.device_ptr_mut(stream);
            let bytes = out * std::mem::size_of::<T>();
            // SAFETY: `bytes` bytes of a live buffer of this context, on its stream.
            unsafe { sys::cuMemsetD8Async(o_ptr, 0, bytes, stream.cu_stream()) }
                .result()
                .map_err(driver_error)?;
            let (l_ptr, _l) = l.device_ptr_mut(stream);
            // SAFETY: `lse` f32 of a live buffer of this context, on its stream.
            unsafe {
                sys::cuMemsetD32Async(l_ptr, f32::INFINITY.to_bits(), lse, stream.cu_stream())
            }
            .result()
            .map_err(driver_error)?;
        }
        Ok(Part {
            out: o,
            lse: l,
            call_lse,
        })
    }

    /// One pair's call: rank `rank`'s query chunk `ci` (of `len` rows) against key chunk `p.cj`
    /// of the held shard, into `part` (its first `p.q_rows` rows; the LSE through the part's
    /// buffer of those rows where they are fewer than the chunk's).
    fn ring_part<T: Element + DeviceRepr>(
        &self,
        stream: &Arc<CudaStream>,
        (rank, ci, len): (&DeviceForwardInputs<'_, T>, usize, usize),
        (k_held, v_held): (&CudaView<T>, &CudaView<T>),
        p: &ring::Pair,
        part: &mut Part<T>,
    ) -> Result<Plan> {
        let [batch, _, heads, d] = rank.q.layout.shape;
        let (k_shape, v_shape) = (rank.k.layout.shape, rank.v.layout.shape);
        let d_v = v_shape[3];
        // Rows `first..first + n` of a (batch, rows, h, w) tensor of `strides`.
        let rows_of = |strides: [usize; 4], h: usize, w: usize, first: usize, n: usize| {
            (
                first * strides[1],
                Layout::with_strides([batch, n, h, w], strides),
            )
        };
        let (q_at, q_layout) = rows_of(rank.q.layout.strides, heads, d, ci * len, p.q_rows);
        let kv_first = p.cj * len;
        let (k_at, k_layout) = rows_of(
            Layout::contiguous(k_shape).strides,
            k_shape[2],
            k_shape[3],
            kv_first,
            p.k_rows,
        );
        let (v_at, v_layout) = rows_of(
            Layout::contiguous(v_shape).strides,
            v_shape[2],
            d_v,
            kv_first,
            p.k_rows,
        );
        let q = DeviceTensor::new(rank.q.data.slice(q_at..), q_layout);
        let k = DeviceTensor::new(k_held.slice(k_at..), k_layout);
        let v = DeviceTensor::new(v_held.slice(v_at..), v_layout);
        let out_layout = Layout::with_strides(
            [batch, p.q_rows, heads, d_v],
            Layout::contiguous([batch, len, heads, d_v]).strides,
        );
        let mut out = DeviceTensorMut::new(part.out.slice_mut(..), out_layout);
        // The sinks join the chunk's own part only: the merge adds each part's LSE.
        let inputs = DeviceForwardInputs::new(&q, &k, &v);
        let inputs = match (p.own, rank.sinks) {
            (true, Some(sinks)) => inputs.with_sinks(sinks),
            _ => inputs,
        };
        let Some(call_lse) = part.call_lse.as_mut() else {
            return self.forward_into(
                stream,
                &p.mask,
                inputs,
                &mut out,
                &mut part.lse.slice_mut(..),
            );
        };
        let plan = self.forward_into(
            stream,
            &p.mask,
            inputs,
            &mut out,
            &mut call_lse.slice_mut(..),
        )?;
        copy_rows_f32(
            self,
            stream,
            (&call_lse.slice(..), p.q_rows),
            (&mut part.lse.slice_mut(..), len),
            (p.q_rows, batch * heads),
        )?;
        Ok(plan)
    }

    /// Query chunk `ci`'s parts merged into its rows of a rank's outputs (its LSE through a
    /// buffer of the chunk's rows where the rank holds more than one chunk).
    fn merge_chunk<T: Element + DeviceRepr>(
        &self,
        stream: &Arc<CudaStream>,
        parts: &[Part<T>],
        (ci, per, len): (usize, usize, usize),
        output: &mut DeviceRingOutput<'_, '_, T>,
    ) -> Result<()> {
        let [batch, rows, heads, d_v] = output.out.layout.shape;
        let shape = [batch, len, heads, d_v];
        let views: Vec<(DeviceTensor<T>, CudaView<f32>)> = parts
            .iter()
            .map(|p| (DeviceTensor::contiguous(&p.out, shape), p.lse.slice(..)))
            .collect();
        let strides = output.out.layout.strides;
        let mut out = DeviceTensorMut::new(
            output.out.data.slice_mut(ci * len * strides[1]..),
            Layout::with_strides(shape, strides),
        );
        if per == 1 {
            return self.combine_into(stream, &views, LseLayout::Dense, &mut out, output.lse);
        }
        // SAFETY: the merge writes every element before the copy reads it, in stream order.
        let mut lse = unsafe { stream.alloc::<f32>(batch * heads * len) }.map_err(driver_error)?;
        self.combine_into(
            stream,
            &views,
            LseLayout::Dense,
            &mut out,
            &mut lse.slice_mut(..),
        )?;
        copy_rows_f32(
            self,
            stream,
            (&lse.slice(..), len),
            (&mut output.lse.slice_mut(ci * len..), rows),
            (len, batch * heads),
        )
    }
}

/// `compute` ordered after all the transport was given, when a ring ends (`finish`) or fails
/// (drop): the buffers the transport wrote are given back on `compute`, and each rank's K and V,
/// which the transport read, then count as last read there (cudarc orders a later writer of them
/// after that).
struct TransportJoin<'a, 'r, T: DeviceRepr> {
    compute: &'a Arc<CudaStream>,
    transport: &'a Arc<CudaStream>,
    /// The ranks' K and V.
    read: Vec<&'a CudaView<'r, T>>,
    armed: bool,
}

impl<T: DeviceRepr> TransportJoin<'_, '_, T> {
    fn join(&self) -> Result<()> {
        self.compute.join(self.transport).map_err(driver_error)?;
        for view in &self.read {
            drop(view.device_ptr(self.compute));
        }
        Ok(())
    }

    fn finish(mut self) -> Result<()> {
        self.armed = false;
        self.join()
    }
}

impl<T: DeviceRepr> Drop for TransportJoin<'_, '_, T> {
    fn drop(&mut self) {
        // On the way out of a failed ring, whose error the caller gets: a failure to join here
        // leaves the frees ordered by cudarc's own events alone.
        if self.armed {
            let _ = self.join();
        }
    }
}

/// The K and V shard that the i-th rank held here holds at step `step`: its own, then the
/// buffer the transport filled in the step before.
fn held<'s, T>(
    (k, v): (&'s CudaView<'_, T>, &'s CudaView<'_, T>),
    slots: &'s [[Shard<T>; 2]],
    i: usize,
    step: usize,
) -> (CudaView<'s, T>, CudaView<'s, T>) {
    if step == 0 {
        (k.slice(..), v.slice(..))
    } else {
        let s = &slots[i][(step - 1) % 2];
        (s.k.slice(..), s.v.slice(..))
    }
}

/// A packed ring's sequences ([`crate::ring::packed_rows`]: each one's length and first row in
/// a rank's shard) and the rows of a rank's shard, once every rank's Q, K and V `(1, rows, ·,
/// ·)` is checked to hold them, the `(what, count)` outputs or gradients are one a rank, and
/// each LSE (`lse_lens`, the outputs' or the inputs') holds `(heads_q, rows)`.
fn packed_shards(
    cu_seqlens: &[i32],
    sharding: Sharding,
    ranks: impl ExactSizeIterator<Item = [[usize; 4]; 3]>,
    (what, outputs): (&str, usize),
    lse_lens: impl Iterator<Item = usize>,
) -> Result<(Vec<(usize, usize)>, usize)> {
    let count = ranks.len();
    let seqs = ring::packed_rows(cu_seqlens, sharding, count)?;
    let rows = seqs.iter().map(|s| s.0).sum::<usize>() / count;
    let mut heads = 0;
    for shapes in ranks {
        heads = shapes[0][2];
        for (operand, shape) in [Operand::Q, Operand::K, Operand::V].into_iter().zip(shapes) {
            if shape[0] != 1 || shape[1] != rows {
                return Err(Error::ShapeMismatch {
                    operand,
                    expected: [1, rows, shape[2], shape[3]],
                    found: shape,
                });
            }
        }
    }
    if outputs != count {
        return Err(Error::InvalidConfig(format!(
            "{outputs} {what} for a ring of {count} ranks"
        )));
    }
    if let Some(len) = lse_lens.into_iter().find(|&l| l != heads * rows) {
        return Err(Error::BufferTooSmall {
            operand: Operand::Lse,
            needed: heads * rows,
            len,
        });
    }
    Ok((seqs, rows))
}

/// Rows `at..at + n` of a packed shard `(1, rows, h, d)` as a tensor of its own: contiguous
/// where the shard is (a ring's K and V must be).
fn sequence_rows<'a, T>(
    t: &'a DeviceTensor<'_, T>,
    at: usize,
    n: usize,
) -> Result<DeviceTensor<'a, T>> {
    let layout = sequence_layout(&t.layout, n);
    let start = at * t.layout.strides[1];
    let data = t
        .data
        .try_slice(start..)
        .ok_or_else(|| Error::BufferTooSmall {
            operand: Operand::Q,
            needed: start,
            len: t.data.len(),
        })?;
    Ok(DeviceTensor::new(data, layout))
}

/// [`sequence_rows`] of an output.
fn sequence_rows_mut<'a, T>(
    t: &'a mut DeviceTensorMut<'_, T>,
    at: usize,
    n: usize,
) -> Result<DeviceTensorMut<'a, T>> {
    let layout = sequence_layout(&t.layout, n);
    let start = at * t.layout.strides[1];
    let len = t.data.len();
    let data = t.data.try_slice_mut(start..).ok_or(Error::BufferTooSmall {
        operand: Operand::Out,
        needed: start,
        len,
    })?;
    Ok(DeviceTensorMut::new(data, layout))
}

/// `n` rows of a `(1, rows, h, d)` layout: its strides, the batch stride that of `n` rows (one
/// entry: it is never stepped), so that a contiguous shard's rows are contiguous.
fn sequence_layout(layout: &Layout, n: usize) -> Layout {
    let [_, _, h, d] = layout.shape;
    let s = layout.strides;
    Layout::with_strides([1, n, h, d], [n * s[1], s[1], s[2], s[3]])
}

/// Rank `r`'s K or V must be contiguous: the transport moves shards whole.
fn check_contiguous(r: usize, operand: Operand, layout: &Layout) -> Result<()> {
    if *layout == Layout::contiguous(layout.shape) {
        return Ok(());
    }
    Err(Error::Unsupported {
        what: format!(
            "rank {r}'s {operand} of strides {:?} in a device ring (the transport moves \
             contiguous shards)",
            layout.strides
        ),
        backend: crate::Backend::Auto,
    })
}

/// `acc` (f32 rows in `acc_layout`) += `x` (rows in `x_layout`, the same shape):
/// flashattn_rows_add.
fn add_rows<T: Element + DeviceRepr>(
    dev: &Device,
    stream: &Arc<CudaStream>,
    operand: Operand,
    (x, x_layout): (&CudaView<T>, Layout),
    (acc, acc_layout): (&mut CudaViewMut<f32>, Layout),
) -> Result<()> {
    tensor::check_len(operand, &x_layout, x.len())?;
    tensor::check_output_len(operand, &acc_layout, acc.len())?;
    let (x_ptr, _x) = x.device_ptr(stream);
    let (acc_ptr, _acc) = acc.device_ptr_mut(stream);
    rows_call::<T>(
        dev,
        stream,
        operand,
        (
            RawTensor {
                ptr: x_ptr,
                layout: x_layout,
            },
            RawTensor {
                ptr: acc_ptr,
                layout: acc_layout,
            },
        ),
        true,
    )
}

/// `out` = `acc` (contiguous f32 of `out`'s shape) rounded to `T`: flashattn_rows_round.
fn round_rows<T: Element + DeviceRepr>(
    dev: &Device,
    stream: &Arc<CudaStream>,
    operand: Operand,
    acc: &CudaView<f32>,
    out: &mut DeviceTensorMut<T>,
) -> Result<()> {
    let acc_layout = Layout::contiguous(out.layout.shape);
    tensor::check_len(operand, &acc_layout, acc.len())?;
    tensor::check_output_len(operand, &out.layout, out.data.len())?;
    let (acc_ptr, _acc) = acc.device_ptr(stream);
    let (out_ptr, _out) = out.data.device_ptr_mut(stream);
    rows_call::<T>(
        dev,
        stream,
        operand,
        (
            RawTensor {
                ptr: out_ptr,
                layout: out.layout,
            },
            RawTensor {
                ptr: acc_ptr,
                layout: acc_layout,
            },
        ),
        false,
    )
}

/// One flashattn_rows_add (`add`) or flashattn_rows_round over `x` (T) and `acc` (f32), whose
/// pointers the caller's guards keep live.
fn rows_call<T: Element>(
    dev: &Device,
    stream: &Arc<CudaStream>,
    operand: Operand,
    (x, acc): (RawTensor, RawTensor),
    add: bool,
) -> Result<()> {
    let [batch, seqlen, heads, head_dim] = x.layout.shape;
    let fits = |n: usize| i32::try_from(n).ok();
    let (Some(batch), Some(seqlen), Some(heads), Some(head_dim)) =
        (fits(batch), fits(seqlen), fits(heads), fits(head_dim))
    else {
        return Err(Error::IndexOverflow {
            operand,
            detail: format!("rows {:?} pass i32", x.layout.shape),
        });
    };
    let p = crate::ffi::flashattn_rows_t {
        dtype: gpu::ffi_dtype(T::DTYPE),
        batch,
        seqlen,
        heads,
        head_dim,
        x: x.aligned_ffi(operand, std::mem::size_of::<T>())?,
        acc: acc.aligned_ffi(operand, std::mem::size_of::<f32>())?,
    };
    dev.ctx.bind_to_thread().map_err(driver_error)?;
    let stream_ptr = stream.cu_stream() as *mut std::ffi::c_void;
    // SAFETY: both views were checked against their buffers, whose guards the caller holds
    // until after the launch; the entry point checks them again.
    let r = unsafe {
        if add {
            crate::ffi::flashattn_rows_add(&p, stream_ptr)
        } else {
            crate::ffi::flashattn_rows_round(&p, stream_ptr)
        }
    };
    crate::ffi::check(r, crate::Backend::Auto, "gradient sums")
}

/// How a ring hands what each rank holds on to the next rank: between ranks simulated on one
/// device ([`Local`]), or between devices (the NCCL ring, one rank held here). The schedule
/// runs over the ranks held here, the i-th being ring rank `rank(i)`.
pub(super) trait Rotation {
    /// The ring's ranks.
    fn count(&self) -> usize;
    /// The ring rank of the i-th rank held here.
    fn rank(&self, i: usize) -> usize;
    /// A call's inputs hold `held` ranks: the number this rotation holds, or an error.
    fn check_held(&self, held: usize) -> Result<()>;
    /// Whether the ring goes on, once each rank held here has checked its part of the call and
    /// taken its buffers (`refused`: the error it met, if any): across devices, every rank
    /// learns whether every other one can go on, so that none waits for a transfer that a
    /// refusing rank will never make.
    fn agree(&self, refused: Option<&Error>) -> Result<()>;
    /// Every transfer of the call is issued, and matched by the other ranks' (what is left is
    /// local: the merges, the sums' rounding).
    fn settled(&self) {}
    /// On `stream`, each rank held here hands its two buffers `from[i]` (K and V, or the dK and
    /// dV sums) on to the next rank, and receives the rank before's into `into[i]`.
    fn rotate<E: DeviceRepr>(
        &self,
        stream: &Arc<CudaStream>,
        from: &[[CudaView<E>; 2]],
        into: &mut [[CudaViewMut<E>; 2]],
    ) -> Result<()>;
}

/// Every rank of the ring held here, on one device: a rotation is a copy from each rank's
/// buffers into the next one's.
pub(super) struct Local {
    count: usize,
}

impl Local {
    fn of(count: usize) -> Self {
        Local { count }
    }
}

impl Rotation for Local {
    fn count(&self) -> usize {
        self.count
    }

    fn rank(&self, i: usize) -> usize {
        i
    }

    fn check_held(&self, held: usize) -> Result<()> {
        debug_assert_eq!(held, self.count);
        Ok(())
    }

    fn agree(&self, refused: Option<&Error>) -> Result<()> {
        refused.map_or(Ok(()), |e| Err(e.clone()))
    }

    fn rotate<E: DeviceRepr>(
        &self,
        stream: &Arc<CudaStream>,
        from: &[[CudaView<E>; 2]],
        into: &mut [[CudaViewMut<E>; 2]],
    ) -> Result<()> {
        let n = into.len();
        for (i, [a, b]) in from.iter().enumerate() {
            let [to_a, to_b] = &mut into[(i + 1) % n];
            stream.memcpy_dtod(a, to_a).map_err(driver_error)?;
            stream.memcpy_dtod(b, to_b).map_err(driver_error)?;
        }
        Ok(())
    }
}

/// The pairs of chunks of each rank held here, query chunk by query chunk, in ring order.
fn rank_pairs<R: Rotation>(
    rotation: &R,
    cfg: &AttentionConfig,
    sharding: Sharding,
    held: usize,
    len: usize,
) -> Vec<Vec<Vec<ring::Pair>>> {
    let count = rotation.count();
    (0..held)
        .map(|i| {
            let r = rotation.rank(i);
            sharding
                .chunk_ids(count, r)
                .into_iter()
                .map(|qc| ring::ring_pairs(cfg, sharding, count, r, qc, len))
                .collect()
        })
        .collect()
}

/// A rank's batch, query heads, KV heads and head dims (Q's, V's): what its pairs' problems
/// share.
fn rank_dims<T, I: RingRank<T>>(rank: &I) -> [usize; 5] {
    let [q, k, v] = rank.shapes();
    [q[0], q[2], k[2], q[3], v[3]]
}

impl Device {
    /// Plans each distinct pair's call (its rows, keys and mask) without running it: a pair the
    /// dispatcher would refuse is refused before the ring starts. Returns the most workspace a
    /// pair's backward takes (0 for the forward), which the ring takes beforehand.
    fn plan_pairs<T: Element>(
        &self,
        op: Op,
        pairs: &[Vec<Vec<ring::Pair>>],
        [batch, heads_q, heads_kv, head_dim, head_dim_v]: [usize; 5],
    ) -> Result<usize> {
        let mut workspace = 0;
        let mut planned: Vec<(usize, usize, &AttentionConfig)> = vec![];
        for p in pairs.iter().flatten().flatten() {
            let key = (p.q_rows, p.k_rows, &p.mask);
            if planned.contains(&key) {
                continue;
            }
            let problem = Problem {
                batch,
                seqlen_q: p.q_rows,
                seqlen_k: p.k_rows,
                heads_q,
                heads_kv,
                head_dim,
                head_dim_v,
                dtype: T::DTYPE,
                packed: false,
            };
            let plan = self.plan(op, &problem, &p.mask)?;
            if op == Op::Backward {
                workspace = workspace.max(gpu::bwd_workspace_bytes(
                    &problem,
                    None,
                    plan.backend,
                    p.mask.deterministic,
                    self.info.sm_count,
                    false,
                ));
            }
            planned.push(key);
        }
        Ok(workspace)
    }
}

/// A rank's inputs to a ring call, forward or backward: its Q, K and V shards, and whether the
/// call has sinks (the backward reads none: the LSE holds them).
pub(super) trait RingRank<T> {
    fn qkv(&self) -> [&DeviceTensor<'_, T>; 3];
    fn ring_sinks(&self) -> bool;

    fn shapes(&self) -> [[usize; 4]; 3] {
        self.qkv().map(|t| t.layout.shape)
    }
}

impl<T> RingRank<T> for DeviceForwardInputs<'_, T> {
    fn qkv(&self) -> [&DeviceTensor<'_, T>; 3] {
        [self.q, self.k, self.v]
    }

    fn ring_sinks(&self) -> bool {
        self.sinks.is_some()
    }
}

impl<T> RingRank<T> for DeviceBackwardInputs<'_, T> {
    fn qkv(&self) -> [&DeviceTensor<'_, T>; 3] {
        [self.q, self.k, self.v]
    }

    fn ring_sinks(&self) -> bool {
        false
    }
}

/// A pair without the buffers the ring took for it: the two disagree on the pairs (not expected).
fn missing_pair_grads() -> Error {
    Error::InvalidConfig("a ring pair without its gradient buffers".into())
}

/// The ranks held here, as every ring call first checks them: their shapes
/// ([`ring::check_ring_shapes`]), as many as the rotation holds, an element type the ring takes.
/// Returns how many are held.
fn check_held_ranks<T: Element, I: RingRank<T>, R: Rotation>(
    rotation: &R,
    sharding: Sharding,
    ranks: &[I],
) -> Result<usize> {
    let held =
        ring::check_ring_shapes(sharding, ranks.iter().map(|r| (r.shapes(), r.ring_sinks())))?;
    rotation.check_held(held)?;
    check_ring_dtype::<T>()?;
    Ok(held)
}

/// The element types a ring takes: the 16-bit ones (its merges' and its calls'); an FP8 ring
/// would pass the dispatcher's plan and fail at its first call.
fn check_ring_dtype<T: Element>() -> Result<()> {
    match T::DTYPE {
        DType::F16 | DType::BF16 => Ok(()),
        dtype => Err(Error::UnsupportedDtype {
            dtype,
            backend: crate::Backend::Auto,
        }),
    }
}

/// Of a rank's two buffers at step `step`: the one it reads (filled at step − 1) and the one
/// the rotation fills (read at step + 1).
fn read_and_fill<X>(pair: &mut [X; 2], step: usize) -> (&X, &mut X) {
    let (first, second) = pair.split_at_mut(1);
    if step % 2 == 0 {
        (&second[0], &mut first[0])
    } else {
        (&first[0], &mut second[0])
    }
}

/// Step `step`'s hand-on of the K and V shards: each rank held here sends the shard it holds
/// (its own at step 0) and receives the next one into its buffer `step % 2`.
fn rotate_shards<T: DeviceRepr, I: RingRank<T>, R: Rotation>(
    rotation: &R,
    transport: &Arc<CudaStream>,
    ranks: &[I],
    slots: &mut [[Shard<T>; 2]],
    step: usize,
    (k_len, v_len): (usize, usize),
) -> Result<()> {
    let (from, mut into): (Vec<_>, Vec<_>) = ranks
        .iter()
        .zip(slots.iter_mut())
        .map(|(rank, pair)| {
            let (read, fill) = read_and_fill(pair, step);
            let from = if step == 0 {
                let [_, k, v] = rank.qkv();
                [k.data.slice(..k_len), v.data.slice(..v_len)]
            } else {
                [read.k.slice(..), read.v.slice(..)]
            };
            (from, [fill.k.slice_mut(..), fill.v.slice_mut(..)])
        })
        .unzip();
    rotation.rotate(transport, &from, &mut into)
}

/// `height` rows of `width` f32 from `src` (rows `src_pitch` elements apart) into `dst` (rows
/// `dst_pitch` apart), on `stream`: a part's LSE rows into a chunk's, a chunk's into a rank's.
fn copy_rows_f32(
    dev: &Device,
    stream: &Arc<CudaStream>,
    (src, src_pitch): (&CudaView<f32>, usize),
    (dst, dst_pitch): (&mut CudaViewMut<f32>, usize),
    (width, height): (usize, usize),
) -> Result<()> {
    let span = |pitch: usize| (height.max(1) - 1) * pitch + width;
    if width > src_pitch.min(dst_pitch)
        || span(src_pitch) > src.len()
        || span(dst_pitch) > dst.len()
    {
        return Err(Error::IndexOverflow {
            operand: Operand::Lse,
            detail: format!(
                "{height} rows of {width} from rows {src_pitch} apart into rows {dst_pitch} apart"
            ),
        });
    }
    if width == 0 || height == 0 {
        return Ok(());
    }
    let f = std::mem::size_of::<f32>();
    let (src_ptr, _src) = src.device_ptr(stream);
    let (dst_ptr, _dst) = dst.device_ptr_mut(stream);
    let copy = sys::CUDA_MEMCPY2D {
        srcXInBytes: 0,
        srcY: 0,
        srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
        srcHost: std::ptr::null(),
        srcDevice: src_ptr,
        srcArray: std::ptr::null_mut(),
        srcPitch: src_pitch * f,
        dstXInBytes: 0,
        dstY: 0,
        dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
        dstHost: std::ptr::null_mut(),
        dstDevice: dst_ptr,
        dstArray: std::ptr::null_mut(),
        dstPitch: dst_pitch * f,
        WidthInBytes: width * f,
        Height: height,
    };
    dev.ctx.bind_to_thread().map_err(driver_error)?;
    // SAFETY: both spans were checked within their live buffers of this context above.
    let status = unsafe { sys::cuMemcpy2DAsync_v2(&copy, stream.cu_stream()) };
    if status != sys::CUresult::CUDA_ERROR_INVALID_VALUE {
        return status.result().map_err(driver_error);
    }
    // The driver may refuse device-to-device pitches it did not choose itself: row by row.
    for row in 0..height {
        let at = |ptr: sys::CUdeviceptr, pitch: usize| ptr + (row * pitch * f) as u64;
        // SAFETY: a row of the spans checked above.
        unsafe {
            sys::cuMemcpyDtoDAsync_v2(
                at(dst_ptr, dst_pitch),
                at(src_ptr, src_pitch),
                width * f,
                stream.cu_stream(),
            )
        }
        .result()
        .map_err(driver_error)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::read_and_fill;

    /// The schedule's buffer bookkeeping on the host, with labels for buffers: each step's
    /// rotation hands what every rank read (its own shard at step 0) into the next rank's buffer
    /// `read_and_fill` fills, as `Local::rotate` does; then rank i must hold rank (i − step)'s
    /// shard where `held` looks (its buffer (step − 1) % 2), add into the sum that travels with
    /// that shard (buffer step % 2), and after the last hop find its own shard's sum, with every
    /// rank's part, in buffer count % 2.
    #[test]
    fn shards_and_sums_go_around_the_ring_as_the_schedule_reads_them() {
        for count in 1..=8usize {
            // Shard labels in the K/V slots; (shard, ranks that added) in the sums.
            let mut slots = vec![[usize::MAX; 2]; count];
            let mut sums: Vec<[(usize, u32); 2]> =
                (0..count).map(|i| [(i, 0), (usize::MAX, 0)]).collect();
            for step in 0..count {
                if step + 1 < count {
                    let sent: Vec<usize> = (0..count)
                        .map(|i| {
                            if step == 0 {
                                i
                            } else {
                                *read_and_fill(&mut slots[i], step).0
                            }
                        })
                        .collect();
                    for (i, shard) in sent.into_iter().enumerate() {
                        *read_and_fill(&mut slots[(i + 1) % count], step).1 = shard;
                    }
                }
                for i in 0..count {
                    let held = if step == 0 {
                        i
                    } else {
                        slots[i][(step - 1) % 2]
                    };
                    assert_eq!(
                        held,
                        (i + count - step) % count,
                        "{count} ranks, step {step}"
                    );
                    let sum = &mut sums[i][step % 2];
                    assert_eq!(
                        sum.0, held,
                        "{count} ranks, step {step}: the sum of another shard"
                    );
                    sum.1 |= 1 << i;
                }
                let sent: Vec<(usize, u32)> = sums
                    .iter_mut()
                    .map(|pair| *read_and_fill(pair, step + 1).0)
                    .collect();
                for (i, sum) in sent.into_iter().enumerate() {
                    *read_and_fill(&mut sums[(i + 1) % count], step + 1).1 = sum;
                }
            }
            for (i, pair) in sums.iter().enumerate() {
                assert_eq!(
                    pair[count % 2],
                    (i, (1u32 << count) - 1),
                    "{count} ranks, rank {i}"
                );
            }
        }
    }
}
