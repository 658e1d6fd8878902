//! A KV-cache step on the GPU (`Device::kvcache_step_into`): Q and the new keys rotated (rotary
//! embedding, interleaved pairs or halves, over all or part of the head), the new keys and values
//! appended after each sequence's cached ones in a dense or a paged cache, then the forward over
//! the longer caches. The cache afterwards bit-identical to the host step's
//! (`flashattn::kvcache::step`), each sequence's O and LSE against the f64 reference over its
//! keys in that cache; the f16 append alike; counts past the capacity and page numbers out of
//! range written nowhere outside the buffers; new rows quantized into e4m3 caches as the host's
//! `append_fp8` quantizes them (kvcache_fp8.rs runs whole steps over such caches); a step its
//! forward would refuse refused before it writes the cache.

use cudarc::driver::{CudaSlice, DeviceRepr};
use flashattn::cuda::{
    DeviceCacheDescales, DeviceKvCacheAppend, DeviceKvCacheStep, DeviceRotary, DeviceTensor,
    DeviceTensorMut,
};
use flashattn::kvcache::{self, CacheDescales, KvCacheMut, KvCacheStep, Rotary};
use flashattn::{AttentionConfig, Backend, Element, Operand, TensorMut, TensorRef};
use half::bf16;
use rand::rngs::StdRng;
use rand::Rng;

use super::common::device;
use super::harness::random;
use super::kvcache::{check_sequence_over, Outputs};

/// Angles for `positions` positions of a `dim`-wide rotation: (cos, sin), each
/// `(positions, dim / 2)`.
fn angles(positions: usize, dim: usize) -> (Vec<f32>, Vec<f32>) {
    let half = dim / 2;
    let theta = |p: usize, i: usize| p as f32 * 10000f32.powf(-(i as f32) / half as f32);
    let all = |f: fn(f32) -> f32| {
        (0..positions * half)
            .map(|x| f(theta(x / half, x % half)))
            .collect()
    };
    (all(f32::cos), all(f32::sin))
}

/// `q` (batch, seqlen_q, heads, d) rotated as the step rotates it: row i of sequence b at
/// `lens[b] + i` (or `lens[b]` with `same_position`), each product and sum rounded in f32.
fn rotate_q(
    q: &[bf16],
    [batch, seqlen_q, heads, d]: [usize; 4],
    r: &Rotary,
    lens: &[i32],
    same_position: bool,
) -> Vec<bf16> {
    let half = r.dim / 2;
    let mut out = q.to_vec();
    for (at, row) in out.chunks_exact_mut(d).enumerate() {
        let (i, b) = (at / heads % seqlen_q, at / heads / seqlen_q);
        assert!(b < batch);
        let pos = lens[b] as usize + if same_position { 0 } else { i };
        for j in 0..half {
            let (a, c) = if r.interleaved {
                (2 * j, 2 * j + 1)
            } else {
                (j, j + half)
            };
            let (x0, x1) = (row[a].to_f32(), row[c].to_f32());
            let (cs, sn) = (r.cos[pos * half + j], r.sin[pos * half + j]);
            row[a] = bf16::from_f32(x0 * cs - x1 * sn);
            row[c] = bf16::from_f32(x0 * sn + x1 * cs);
        }
    }
    out
}

/// Where a step writes and reads: a dense cache of `slots` entries of `rows` rows (sequence `b`
/// in entry `entries[b]`, or `b`), or `slots` pages of `rows` rows with a block table of
/// `pages_per_seq` pages per sequence.
pub(super) struct Layout {
    pub(super) slots: usize,
    pub(super) rows: usize,
    pub(super) table: Option<Vec<i32>>,
    pub(super) entries: Option<Vec<i32>>,
    pub(super) pages_per_seq: usize,
}

impl Layout {
    /// Row `j` of sequence `b`'s keys: its first element in K or V of `width` elements a row.
    fn at(&self, b: usize, j: usize, width: usize) -> usize {
        match &self.table {
            None => {
                let entry = self.entries.as_ref().map_or(b, |e| e[b] as usize);
                (entry * self.rows + j) * width
            }
            Some(t) => {
                let page = t[b * self.pages_per_seq + j / self.rows] as usize;
                (page * self.rows + j % self.rows) * width
            }
        }
    }
}

/// One step on the host and on the device from the same cache of `C` (Q's bf16, or e4m3, then
/// with random descales where `descales`): the device's cache equal to the host's bit for bit
/// (but for NaN payloads), and each sequence's O and LSE against the reference over its keys
/// there (dequantized). The failures.
#[allow(clippy::too_many_arguments)]
pub(super) fn step_case<C: Element + DeviceRepr>(
    cfg: &AttentionConfig,
    layout: &Layout,
    (hq, hk, d): (usize, usize, usize),
    lens: &[i32],
    (seqlen_q, seqlen_new): (usize, usize),
    rotary: Option<(usize, bool)>,
    descales: bool,
    seed: u64,
) -> Vec<String> {
    let mut rng: StdRng = rand::SeedableRng::seed_from_u64(seed);
    let batch = lens.len();
    let row = hk * d;
    let cache_shape = [layout.slots, layout.rows, hk, d];
    let k0: Vec<C> = random(layout.slots * layout.rows * row, &mut rng);
    let v0: Vec<C> = random(layout.slots * layout.rows * row, &mut rng);
    let descale = |rng: &mut StdRng| -> Vec<f32> {
        (0..batch * hk)
            .map(|_| rng.random_range(0.05f32..1.5))
            .collect()
    };
    let (kd, vd) = if descales {
        (descale(&mut rng), descale(&mut rng))
    } else {
        (vec![1.0; batch * hk], vec![1.0; batch * hk])
    };
    let q: Vec<bf16> = random(batch * seqlen_q * hq * d, &mut rng);
    let k_new: Vec<bf16> = random(batch * seqlen_new * row, &mut rng);
    let v_new: Vec<bf16> = random(batch * seqlen_new * row, &mut rng);
    let capacity = layout.rows * layout.pages_per_seq;
    let (cos, sin) = angles(capacity + seqlen_new, rotary.map_or(2, |r| r.0));
    let host_rotary = rotary.map(|(dim, interleaved)| Rotary {
        cos: &cos,
        sin: &sin,
        dim,
        interleaved,
    });
    let new_shape = [batch, seqlen_new, hk, d];

    // The host's step.
    let (mut hk_cache, mut hv_cache) = (k0.clone(), v0.clone());
    {
        let (k, v) = (
            TensorMut::contiguous(&mut hk_cache, cache_shape),
            TensorMut::contiguous(&mut hv_cache, cache_shape),
        );
        let mut cache = match &layout.table {
            None => KvCacheMut::Dense { k, v },
            Some(t) => KvCacheMut::Paged {
                k,
                v,
                block_table: t,
                max_pages: layout.pages_per_seq,
            },
        };
        kvcache::step(
            &cfg.clone().backend(Backend::Auto),
            KvCacheStep {
                q: TensorRef::contiguous(&q, [batch, seqlen_q, hq, d]),
                cache: &mut cache,
                new: Some((
                    TensorRef::contiguous(&k_new, new_shape),
                    TensorRef::contiguous(&v_new, new_shape),
                )),
                cache_seqlens: lens,
                rotary: host_rotary,
                cache_batch_idx: layout.entries.as_deref(),
                sinks: None,
                descales: descales.then_some(CacheDescales { k: &kd, v: &vd }),
            },
        )
        .unwrap_or_else(|e| panic!("host step {cfg:?}: {e}"));
    }

    // The device's, its outputs poisoned first.
    let (dev, stream) = device();
    let up = |x: &[bf16]| stream.clone_htod(x).unwrap();
    let (mut kc, mut vc) = (
        stream.clone_htod(&k0).unwrap(),
        stream.clone_htod(&v0).unwrap(),
    );
    let (qd, knd, vnd) = (up(&q), up(&k_new), up(&v_new));
    let (kd_d, vd_d) = (
        stream.clone_htod(&kd).unwrap(),
        stream.clone_htod(&vd).unwrap(),
    );
    let (kd_v, vd_v) = (kd_d.as_view(), vd_d.as_view());
    let lens_d = stream.clone_htod(lens).unwrap();
    let table_d = layout.table.as_ref().map(|t| stream.clone_htod(t).unwrap());
    let entries_d = layout
        .entries
        .as_ref()
        .map(|e| stream.clone_htod(e).unwrap());
    let (cos_d, sin_d) = (
        stream.clone_htod(&cos).unwrap(),
        stream.clone_htod(&sin).unwrap(),
    );
    let (cos_v, sin_v) = (cos_d.as_view(), sin_d.as_view());
    let o_shape = [batch, seqlen_q, hq, d];
    let mut out: CudaSlice<bf16> = up(&vec![bf16::NAN; o_shape.iter().product()]);
    let mut lse = stream
        .clone_htod(&vec![f32::NAN; batch * hq * seqlen_q])
        .unwrap();
    let (qt, knt, vnt) = (
        DeviceTensor::contiguous(&qd, [batch, seqlen_q, hq, d]),
        DeviceTensor::contiguous(&knd, new_shape),
        DeviceTensor::contiguous(&vnd, new_shape),
    );
    let plan = {
        let (mut kt, mut vt) = (
            DeviceTensorMut::contiguous(&mut kc, cache_shape),
            DeviceTensorMut::contiguous(&mut vc, cache_shape),
        );
        dev.kvcache_step_into(
            &stream,
            cfg,
            DeviceKvCacheStep {
                q: &qt,
                k_cache: &mut kt,
                v_cache: &mut vt,
                block_table: table_d.as_ref().map(|t| t.as_view()),
                cache_batch_idx: entries_d.as_ref().map(|e| e.as_view()),
                cache_seqlens: lens_d.as_view(),
                new: Some((&knt, &vnt)),
                rotary: rotary.map(|(dim, interleaved)| DeviceRotary {
                    cos: &cos_v,
                    sin: &sin_v,
                    dim,
                    interleaved,
                }),
                sinks: None,
                num_splits: 0,
                descales: descales.then_some(DeviceCacheDescales { k: &kd_v, v: &vd_v }),
            },
            &mut DeviceTensorMut::contiguous(&mut out, o_shape),
            &mut lse.as_view_mut(),
        )
        .unwrap_or_else(|e| panic!("device step {cfg:?}: {e}"))
    };
    let (gk, gv) = (
        stream.clone_dtoh(&kc).unwrap(),
        stream.clone_dtoh(&vc).unwrap(),
    );
    let (go, gl) = (
        stream.clone_dtoh(&out).unwrap(),
        stream.clone_dtoh(&lse).unwrap(),
    );
    stream.synchronize().unwrap();

    let what = format!(
        "{cfg:?} ({}), {} cache of {:?}, lens {lens:?} + {seqlen_new}, {seqlen_q} query rows, \
         rotary {rotary:?}, descales {descales}",
        plan.explain(),
        match (&layout.table, &layout.entries) {
            (Some(_), _) => "paged",
            (None, Some(_)) => "dense (cache_batch_idx)",
            (None, None) => "dense",
        },
        C::DTYPE
    );
    let mut failures = vec![];
    // Both element types widen to f32 exactly, one value to one f32 (NaN aside).
    let same_bits = |a: &[C], b: &[C]| {
        a.iter().zip(b).all(|(x, y)| {
            let (x, y) = (x.to_f32(), y.to_f32());
            x.to_bits() == y.to_bits() || x.is_nan() && y.is_nan()
        })
    };
    if !same_bits(&gk, &hk_cache) || !same_bits(&gv, &hv_cache) {
        failures.push(format!("{what}: the cache differs from the host step's"));
    }
    // The appended rows hold the new values (not the old cache's): the host step wrote them.
    // FlashAttention-3's rule (tests/kvcache.rs states it case by case on the host).
    let same_position = kvcache::queries_at_one_position(cfg.mask, capacity, seqlen_q);
    let q_used = match &host_rotary {
        Some(r) => rotate_q(&q, [batch, seqlen_q, hq, d], r, lens, same_position),
        None => q.clone(),
    };
    for (b, &len) in lens.iter().enumerate() {
        let keys = len as usize + seqlen_new;
        // Sequence b's keys, each head's times its descale.
        let gather = |x: &[C], s: &[f32]| -> Vec<f32> {
            (0..keys)
                .flat_map(|j| &x[layout.at(b, j, row)..][..row])
                .enumerate()
                .map(|(i, x)| x.to_f32() * s[b * hk + i / d % hk])
                .collect()
        };
        failures.extend(check_sequence_over(
            cfg,
            &format!("{what}, sequence {b}"),
            Outputs { out: &go, lse: &gl },
            b,
            (seqlen_q, hq, hk, d, d),
            &q_used,
            (&gather(&hk_cache, &kd), &gather(&hv_cache, &vd)),
        ));
    }
    failures
}

#[test]
#[ignore = "needs a GPU"]
fn device_step_matches_the_host_step_and_the_reference() {
    let (hq, hk, d) = (8, 2, 128);
    let dense = Layout {
        slots: 3,
        rows: 300,
        table: None,
        entries: None,
        pages_per_seq: 1,
    };
    // Sequences in entries 4, 0 and 2 of five, of 304 rows (no whole key blocks: gathered).
    let indexed = Layout {
        slots: 5,
        rows: 304,
        table: None,
        entries: Some(vec![4, 0, 2]),
        pages_per_seq: 1,
    };
    // Pages of 128 rows out of order; sequence 0's new rows cross from its first page into its
    // second.
    let paged = Layout {
        slots: 10,
        rows: 128,
        table: Some(vec![7, 2, 9, 0, 5, 3, 8, 1, 6]),
        entries: None,
        pages_per_seq: 3,
    };
    let cfgs = [
        AttentionConfig::new(),
        AttentionConfig::new().causal(true),
        AttentionConfig::new().window(Some(40), Some(0)),
        // As wide as the dense cache (300 rows, a left side of 299 or more bounds nothing): no
        // mask there, a window on the others (304 rows, and three pages of 128), which rotary
        // tells apart.
        AttentionConfig::new().window(Some(300), None),
    ];
    let rotaries = [None, Some((128, false)), Some((64, true))];
    let mut failures = vec![];
    let mut seed = 90;
    for cfg in &cfgs {
        for rotary in rotaries {
            // Decode, a chunk, and steps whose query rows are fewer or more than their new keys.
            for rows in [(1, 1), (3, 3), (1, 3), (3, 1)] {
                seed += 1;
                let layouts = [
                    (&dense, [5, 130, 0]),
                    (&paged, [126, 250, 0]),
                    (&indexed, [40, 290, 0]),
                ];
                for (layout, lens) in layouts {
                    failures.extend(step_case::<bf16>(
                        cfg,
                        layout,
                        (hq, hk, d),
                        &lens,
                        rows,
                        rotary,
                        false,
                        seed,
                    ));
                }
            }
        }
    }
    // The Ampere forward after the same append (dense caches).
    let sm80 = AttentionConfig::new().causal(true).backend(Backend::Sm80);
    failures.extend(step_case::<bf16>(
        &sm80,
        &dense,
        (hq, hk, d),
        &[5, 130, 0],
        (3, 3),
        Some((128, false)),
        false,
        7,
    ));
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The append kernel's f16 path: new keys and values appended with rotary embedding (halves
/// over the whole head, pairs over half of it) leave the dense cache the host step leaves, bit
/// for bit.
#[test]
#[ignore = "needs a GPU"]
fn f16_append_matches_the_host_step() {
    use half::f16;
    let (dev, stream) = device();
    let (batch, rows, hq, hk, d, seqlen_new) = (2, 64, 4, 2, 64, 2);
    let lens = [3i32, 60];
    let cache_shape = [batch, rows, hk, d];
    let new_shape = [batch, seqlen_new, hk, d];
    for (dim, interleaved) in [(64, false), (32, true)] {
        let mut rng = rand::SeedableRng::seed_from_u64(dim as u64);
        let cache: Vec<f16> = random(batch * rows * hk * d, &mut rng);
        let (k_new, v_new): (Vec<f16>, Vec<f16>) = (
            random(batch * seqlen_new * hk * d, &mut rng),
            random(batch * seqlen_new * hk * d, &mut rng),
        );
        let q: Vec<f16> = random(batch * seqlen_new * hq * d, &mut rng);
        let (cos, sin) = angles(rows + seqlen_new, dim);
        let (mut hk_cache, mut hv_cache) = (cache.clone(), cache.clone());
        kvcache::step(
            &AttentionConfig::new().causal(true),
            KvCacheStep {
                q: TensorRef::contiguous(&q, [batch, seqlen_new, hq, d]),
                cache: &mut KvCacheMut::Dense {
                    k: TensorMut::contiguous(&mut hk_cache, cache_shape),
                    v: TensorMut::contiguous(&mut hv_cache, cache_shape),
                },
                new: Some((
                    TensorRef::contiguous(&k_new, new_shape),
                    TensorRef::contiguous(&v_new, new_shape),
                )),
                cache_seqlens: &lens,
                rotary: Some(Rotary {
                    cos: &cos,
                    sin: &sin,
                    dim,
                    interleaved,
                }),
                cache_batch_idx: None,
                sinks: None,
                descales: None,
            },
        )
        .unwrap();

        let up = |x: &[f16]| stream.clone_htod(x).unwrap();
        let (mut kc, mut vc, knd, vnd) = (up(&cache), up(&cache), up(&k_new), up(&v_new));
        let lens_d = stream.clone_htod(&lens).unwrap();
        let (cos_d, sin_d) = (
            stream.clone_htod(&cos).unwrap(),
            stream.clone_htod(&sin).unwrap(),
        );
        let (cos_v, sin_v) = (cos_d.as_view(), sin_d.as_view());
        dev.kvcache_append(
            &stream,
            DeviceKvCacheAppend {
                k_cache: &mut DeviceTensorMut::contiguous(&mut kc, cache_shape),
                v_cache: &mut DeviceTensorMut::contiguous(&mut vc, cache_shape),
                block_table: None,
                cache_batch_idx: None,
                cache_seqlens: lens_d.as_view(),
                k_new: &DeviceTensor::contiguous(&knd, new_shape),
                v_new: &DeviceTensor::contiguous(&vnd, new_shape),
                rotary: Some(DeviceRotary {
                    cos: &cos_v,
                    sin: &sin_v,
                    dim,
                    interleaved,
                }),
                descales: None,
            },
        )
        .unwrap();
        let (gk, gv) = (
            stream.clone_dtoh(&kc).unwrap(),
            stream.clone_dtoh(&vc).unwrap(),
        );
        stream.synchronize().unwrap();
        let bits = |x: &[f16]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&gk),
            bits(&hk_cache),
            "K, rotary ({dim}, {interleaved})"
        );
        assert_eq!(
            bits(&gv),
            bits(&hv_cache),
            "V, rotary ({dim}, {interleaved})"
        );
    }
}

/// Cached counts past the capacity and below 0, page numbers out of range: the append clamps
/// them (rows past the capacity are not written) and every access stays inside the buffers
/// (run under memcheck); shapes that disagree are typed errors before anything runs.
#[test]
#[ignore = "needs a GPU"]
fn sanitizer_kvcache_append_out_of_range_stays_in_bounds() {
    let (dev, stream) = device();
    let (hk, d, rows, pages) = (2, 64, 128, 4);
    let mut rng = rand::SeedableRng::seed_from_u64(5);
    let up = |x: &[bf16]| stream.clone_htod(x).unwrap();
    let cache: Vec<bf16> = random(pages * rows * hk * d, &mut rng);
    let (mut kc, mut vc) = (up(&cache), up(&cache));
    let new: Vec<bf16> = random(3 * 4 * hk * d, &mut rng);
    let nd = up(&new);
    let (cos, sin) = angles(8, 32);
    let (cos_d, sin_d) = (
        stream.clone_htod(&cos).unwrap(),
        stream.clone_htod(&sin).unwrap(),
    );
    let (cos_v, sin_v) = (cos_d.as_view(), sin_d.as_view());
    let lens = stream.clone_htod(&[-7i32, 100_000, 254]).unwrap();
    // Sequence 0's first page below 0, sequence 2's second past the pages (its rows 254, 255).
    let table = stream.clone_htod(&[-3i32, 0, 1, 1000, 2, 1000]).unwrap();
    let nt = DeviceTensor::contiguous(&nd, [3, 4, hk, d]);
    let shape = [pages, rows, hk, d];
    let entry = rows * hk * d;
    for paged in [false, true] {
        let (mut kt, mut vt) = (
            DeviceTensorMut::contiguous(&mut kc, shape),
            DeviceTensorMut::contiguous(&mut vc, shape),
        );
        dev.kvcache_append(
            &stream,
            DeviceKvCacheAppend {
                k_cache: &mut kt,
                v_cache: &mut vt,
                block_table: paged.then(|| table.as_view()),
                cache_batch_idx: None,
                cache_seqlens: lens.as_view(),
                k_new: &nt,
                v_new: &nt,
                rotary: Some(DeviceRotary {
                    cos: &cos_v,
                    sin: &sin_v,
                    dim: 32,
                    interleaved: false,
                }),
                descales: None,
            },
        )
        .unwrap_or_else(|e| panic!("paged {paged}: {e}"));
        // Sequence 0's 4 new rows at rows 0..4 of entry (page) 0 either way; paged, sequence
        // 2's first two at rows 126, 127 of page 3 (its second page clamped), its last two past
        // the capacity; every other row as it was. V's rows are copied as they are, K's rotated
        // to their positions (0..4; 254 and 255 clamped to the angles' last, 7).
        let (got_k, got_v) = (
            stream.clone_dtoh(&kc).unwrap(),
            stream.clone_dtoh(&vc).unwrap(),
        );
        stream.synchronize().unwrap();
        let row = hk * d;
        let host_rotary = Rotary {
            cos: &cos,
            sin: &sin,
            dim: 32,
            interleaved: false,
        };
        let rotated =
            |x: &[bf16], pos: i32| rotate_q(x, [1, 1, hk, d], &host_rotary, &[pos], false);
        let (mut want_k, mut want_v) = (cache.clone(), cache.clone());
        for i in 0..4 {
            let x = &new[i * row..][..row];
            want_v[i * row..][..row].copy_from_slice(x);
            want_k[i * row..][..row].copy_from_slice(&rotated(x, i as i32));
        }
        if paged {
            for i in 0..2 {
                let x = &new[(2 * 4 + i) * row..][..row];
                let at = 3 * entry + (126 + i) * row;
                want_v[at..][..row].copy_from_slice(x);
                want_k[at..][..row].copy_from_slice(&rotated(x, 7));
            }
        }
        let same =
            |a: &[bf16], b: &[bf16]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(
            same(&got_v, &want_v),
            "paged {paged}: the V cache holds other rows than the clamped counts name"
        );
        assert!(
            same(&got_k, &want_k),
            "paged {paged}: the K cache holds other rows than the clamped counts and positions name"
        );
    }
    // A new-keys tensor of another head count, and a rotary dim past the head: typed errors.
    let wrong = DeviceTensor::contiguous(&nd, [3, 2, 2 * hk, d]);
    for (k_new, dim) in [(&wrong, 32), (&nt, 2 * d)] {
        let (mut kt, mut vt) = (
            DeviceTensorMut::contiguous(&mut kc, shape),
            DeviceTensorMut::contiguous(&mut vc, shape),
        );
        let r = dev.kvcache_append(
            &stream,
            DeviceKvCacheAppend {
                k_cache: &mut kt,
                v_cache: &mut vt,
                block_table: None,
                cache_batch_idx: None,
                cache_seqlens: lens.as_view(),
                k_new,
                v_new: &nt,
                rotary: Some(DeviceRotary {
                    cos: &cos_v,
                    sin: &sin_v,
                    dim,
                    interleaved: true,
                }),
                descales: None,
            },
        );
        let named = match (&r, dim) {
            (Err(flashattn::Error::ShapeMismatch { .. }), 32) => true,
            (Err(flashattn::Error::InvalidConfig(why)), _) => why.starts_with("rotary dim"),
            _ => false,
        };
        assert!(named, "{dim}: {r:?}");
    }
}

/// New rows quantized into an e4m3 cache by their descales (`DeviceKvCacheAppend::descales`):
/// the cache the host's `kvcache::append_fp8` leaves, bit for bit but for NaN payloads, from
/// bf16 and f16 rows holding values past ±448 · descale (saturating), infinities, NaN and values
/// below e4m3's smallest normal, into pages out of order and into a dense cache (by entry
/// index, and without descales); a descale that is not a positive normal number stores NaN in
/// its rows (the host refuses it).
#[test]
#[ignore = "needs a GPU"]
fn e4m3_append_matches_the_host_append() {
    e4m3_append_case::<bf16>(21);
    e4m3_append_case::<half::f16>(22);
}

fn e4m3_append_case<T: Element + DeviceRepr>(seed: u64) {
    use float8::F8E4M3;
    let mut rng: StdRng = rand::SeedableRng::seed_from_u64(seed);
    let (dev, stream) = device();
    let (batch, hk, d, seqlen_new) = (3, 2, 64, 5);
    // Sequence 2's new rows fill its capacity (64 rows) to the last.
    let lens = [0i32, 27, 59];
    let new_shape = [batch, seqlen_new, hk, d];
    let new = |rng: &mut StdRng| -> Vec<T> {
        let mut x: Vec<f32> = random::<T>(batch * seqlen_new * hk * d, rng)
            .iter()
            .map(|v| v.to_f32() * 3.0)
            .collect();
        // Sequence 0's first row of head 0 (whose descales are 1): around and past e4m3's
        // largest finite value (448; from 464 on past it) and below its smallest normal; far
        // past it, infinite, NaN.
        let specials = [
            448.5,
            463.9,
            464.0,
            -460.0,
            1e5,
            -1e5,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            1e-4,
            -3e-3,
        ];
        for (i, special) in specials.into_iter().enumerate() {
            x[i * 5 + 1] = special;
        }
        x.into_iter().map(T::from_f32).collect()
    };
    let (k_new, v_new) = (new(&mut rng), new(&mut rng));
    let descale = |rng: &mut StdRng| -> Vec<f32> {
        (0..batch * hk)
            .map(|_| rng.random_range(0.01f32..2.0))
            .collect()
    };
    let (mut kd, mut vd) = (descale(&mut rng), descale(&mut rng));
    (kd[0], vd[0]) = (1.0, 1.0);
    // Pages of 16 rows, 4 a sequence, out of order; a dense cache of 4 entries of 64 rows.
    let (pages, page) = (12, 16);
    let table: Vec<i32> = (0..pages as i32)
        .map(|i| (i * 5 + 3) % pages as i32)
        .collect();
    let entries = [3i32, 0, 2];
    let cases: [(&str, [usize; 4], bool, bool); 3] = [
        ("paged", [pages, page, hk, d], true, true),
        ("dense by entry", [4, 64, hk, d], false, true),
        ("dense without descales", [3, 64, hk, d], false, false),
    ];
    let ones = vec![1f32; batch * hk];
    for (name, cache_shape, paged, with_descales) in cases {
        let what = format!("{name}, {:?}", T::DTYPE);
        let cache0: Vec<F8E4M3> = (0..cache_shape.iter().product())
            .map(|_| F8E4M3::from_f32(rng.random_range(-8.0f32..8.0)))
            .collect();
        let (hkd, hvd) = if with_descales {
            (&kd, &vd)
        } else {
            (&ones, &ones)
        };
        let by_entry = (!paged && with_descales).then_some(&entries[..]);
        // The host's append.
        let (mut hk_cache, mut hv_cache) = (cache0.clone(), cache0.clone());
        {
            let (k, v) = (
                TensorMut::contiguous(&mut hk_cache, cache_shape),
                TensorMut::contiguous(&mut hv_cache, cache_shape),
            );
            let mut cache = if paged {
                KvCacheMut::Paged {
                    k,
                    v,
                    block_table: &table,
                    max_pages: pages / batch,
                }
            } else {
                KvCacheMut::Dense { k, v }
            };
            kvcache::append_fp8(
                &mut cache,
                TensorRef::contiguous(&k_new, new_shape),
                TensorRef::contiguous(&v_new, new_shape),
                &lens,
                by_entry,
                CacheDescales { k: hkd, v: hvd },
            )
            .unwrap_or_else(|e| panic!("{what}: host append: {e}"));
        }
        // The device's.
        let (mut kc, mut vc) = (
            stream.clone_htod(&cache0).unwrap(),
            stream.clone_htod(&cache0).unwrap(),
        );
        let (knd, vnd) = (
            stream.clone_htod(&k_new).unwrap(),
            stream.clone_htod(&v_new).unwrap(),
        );
        let (kd_d, vd_d) = (
            stream.clone_htod(hkd).unwrap(),
            stream.clone_htod(hvd).unwrap(),
        );
        let (kd_v, vd_v) = (kd_d.as_view(), vd_d.as_view());
        let lens_d = stream.clone_htod(&lens).unwrap();
        let table_d = stream.clone_htod(&table).unwrap();
        let entries_d = stream.clone_htod(&entries).unwrap();
        dev.kvcache_append(
            &stream,
            DeviceKvCacheAppend {
                k_cache: &mut DeviceTensorMut::contiguous(&mut kc, cache_shape),
                v_cache: &mut DeviceTensorMut::contiguous(&mut vc, cache_shape),
                block_table: paged.then(|| table_d.as_view()),
                cache_batch_idx: by_entry.map(|_| entries_d.as_view()),
                cache_seqlens: lens_d.as_view(),
                k_new: &DeviceTensor::contiguous(&knd, new_shape),
                v_new: &DeviceTensor::contiguous(&vnd, new_shape),
                rotary: None,
                descales: with_descales.then_some(DeviceCacheDescales { k: &kd_v, v: &vd_v }),
            },
        )
        .unwrap_or_else(|e| panic!("{what}: device append: {e}"));
        let (gk, gv) = (
            stream.clone_dtoh(&kc).unwrap(),
            stream.clone_dtoh(&vc).unwrap(),
        );
        stream.synchronize().unwrap();
        let same = |a: &F8E4M3, b: &F8E4M3| a.to_bits() == b.to_bits() || a.is_nan() && b.is_nan();
        for (tensor, got, want) in [("K", &gk, &hk_cache), ("V", &gv, &hv_cache)] {
            if let Some(i) = (0..got.len()).find(|&i| !same(&got[i], &want[i])) {
                panic!(
                    "{what}: {tensor} cache element {i} is {:#04x}, the host's {:#04x}",
                    got[i].to_bits(),
                    want[i].to_bits()
                );
            }
        }
    }

    // Bad descales: sequence 1's K descale of head 0 is 0, its V descale of head 1 NaN, and
    // sequence 2's K descale of head 1 infinite, V's of head 0 subnormal. Their rows hold NaN;
    // every other row as the good descales store it.
    let mut bad_kd = kd.clone();
    let mut bad_vd = vd.clone();
    (bad_kd[hk], bad_vd[hk + 1]) = (0.0, f32::NAN);
    (bad_kd[2 * hk + 1], bad_vd[2 * hk]) = (f32::INFINITY, 1e-40);
    let cache_shape = [3, 64, hk, d];
    let cache0 = vec![F8E4M3::from_f32(1.0); cache_shape.iter().product()];
    let (mut hk_cache, mut hv_cache) = (cache0.clone(), cache0.clone());
    kvcache::append_fp8(
        &mut KvCacheMut::Dense {
            k: TensorMut::contiguous(&mut hk_cache, cache_shape),
            v: TensorMut::contiguous(&mut hv_cache, cache_shape),
        },
        TensorRef::contiguous(&k_new, new_shape),
        TensorRef::contiguous(&v_new, new_shape),
        &lens,
        None,
        CacheDescales { k: &kd, v: &vd },
    )
    .unwrap();
    let (mut kc, mut vc) = (
        stream.clone_htod(&cache0).unwrap(),
        stream.clone_htod(&cache0).unwrap(),
    );
    let (knd, vnd) = (
        stream.clone_htod(&k_new).unwrap(),
        stream.clone_htod(&v_new).unwrap(),
    );
    let (kd_d, vd_d) = (
        stream.clone_htod(&bad_kd).unwrap(),
        stream.clone_htod(&bad_vd).unwrap(),
    );
    let (kd_v, vd_v) = (kd_d.as_view(), vd_d.as_view());
    let lens_d = stream.clone_htod(&lens).unwrap();
    dev.kvcache_append(
        &stream,
        DeviceKvCacheAppend {
            k_cache: &mut DeviceTensorMut::contiguous(&mut kc, cache_shape),
            v_cache: &mut DeviceTensorMut::contiguous(&mut vc, cache_shape),
            block_table: None,
            cache_batch_idx: None,
            cache_seqlens: lens_d.as_view(),
            k_new: &DeviceTensor::contiguous(&knd, new_shape),
            v_new: &DeviceTensor::contiguous(&vnd, new_shape),
            rotary: None,
            descales: Some(DeviceCacheDescales { k: &kd_v, v: &vd_v }),
        },
    )
    .unwrap();
    let (gk, gv) = (
        stream.clone_dtoh(&kc).unwrap(),
        stream.clone_dtoh(&vc).unwrap(),
    );
    stream.synchronize().unwrap();
    for (tensor, got, want, descales) in [
        ("K", &gk, &hk_cache, &bad_kd),
        ("V", &gv, &hv_cache, &bad_vd),
    ] {
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            // Element i's (entry, row, head): entry b's rows from lens[b] are sequence b's new.
            let (h, row, b) = (i / d % hk, i / (hk * d) % 64, i / (64 * hk * d));
            let appended = (lens[b] as usize..lens[b] as usize + seqlen_new).contains(&row);
            let bad = appended && !(descales[b * hk + h].is_normal() && descales[b * hk + h] > 0.0);
            let ok = if bad {
                g.is_nan()
            } else {
                g.to_bits() == w.to_bits() || g.is_nan() && w.is_nan()
            };
            assert!(
                ok,
                "{:?}, bad descales: {tensor} element {i} (entry {b}, row {row}, head {h}) is \
                 {:#04x}, want {}",
                T::DTYPE,
                g.to_bits(),
                if bad {
                    "NaN".into()
                } else {
                    format!("{:#04x}", w.to_bits())
                }
            );
        }
    }
}

/// Descales belong to e4m3 caches: an append or a step over a 16-bit cache that gives them is
/// refused (`InvalidConfig`, as the host step refuses them) and leaves the cache as it was.
#[test]
#[ignore = "needs a GPU"]
fn descales_of_a_16_bit_cache_are_refused() {
    let (dev, stream) = device();
    let (batch, rows, hk, d) = (2, 32, 2, 64);
    let mut rng: StdRng = rand::SeedableRng::seed_from_u64(3);
    let cache: Vec<bf16> = random(batch * rows * hk * d, &mut rng);
    let new: Vec<bf16> = random(batch * hk * d, &mut rng);
    let (mut kc, mut vc) = (
        stream.clone_htod(&cache).unwrap(),
        stream.clone_htod(&cache).unwrap(),
    );
    let (nd, qd) = (
        stream.clone_htod(&new).unwrap(),
        stream.clone_htod(&new).unwrap(),
    );
    let ones = stream.clone_htod(&vec![1f32; batch * hk]).unwrap();
    let ones = ones.as_view();
    let descales = Some(DeviceCacheDescales { k: &ones, v: &ones });
    let lens = stream.clone_htod(&[3i32, 9]).unwrap();
    let shape = [batch, rows, hk, d];
    let nt = DeviceTensor::contiguous(&nd, [batch, 1, hk, d]);
    let qt = DeviceTensor::contiguous(&qd, [batch, 1, hk, d]);
    let mut out = stream.clone_htod(&vec![bf16::NAN; batch * hk * d]).unwrap();
    let mut lse = stream.clone_htod(&vec![f32::NAN; batch * hk]).unwrap();
    let refused = |r: flashattn::Result<()>, what: &str| {
        assert!(
            matches!(&r, Err(flashattn::Error::InvalidConfig(why)) if why.contains("descales")),
            "{what}: {r:?}"
        );
    };
    {
        let (mut kt, mut vt) = (
            DeviceTensorMut::contiguous(&mut kc, shape),
            DeviceTensorMut::contiguous(&mut vc, shape),
        );
        let append = DeviceKvCacheAppend {
            k_cache: &mut kt,
            v_cache: &mut vt,
            block_table: None,
            cache_batch_idx: None,
            cache_seqlens: lens.as_view(),
            k_new: &nt,
            v_new: &nt,
            rotary: None,
            descales,
        };
        refused(dev.kvcache_append(&stream, append), "append");
        for new in [Some((&nt, &nt)), None] {
            let step = DeviceKvCacheStep {
                q: &qt,
                k_cache: &mut kt,
                v_cache: &mut vt,
                block_table: None,
                cache_batch_idx: None,
                cache_seqlens: lens.as_view(),
                new,
                rotary: None,
                sinks: None,
                num_splits: 0,
                descales,
            };
            let r = dev.kvcache_step_into(
                &stream,
                &AttentionConfig::new(),
                step,
                &mut DeviceTensorMut::contiguous(&mut out, [batch, 1, hk, d]),
                &mut lse.as_view_mut(),
            );
            refused(r.map(|_| ()), &format!("step, new rows {}", new.is_some()));
        }
    }
    assert_cache_unchanged(
        &stream,
        [&kc, &vc],
        &cache,
        "a refused call wrote the cache",
    );
}

/// A step with new rows that its forward would refuse (a short LSE, too few sinks, a short or
/// misaligned O) is refused before it writes the cache: the cache is as it was.
#[test]
#[ignore = "needs a GPU"]
fn refused_steps_leave_the_cache_unwritten() {
    let (dev, stream) = device();
    let (batch, rows, hq, hk, d) = (2, 32, 4, 2, 64);
    let mut rng: StdRng = rand::SeedableRng::seed_from_u64(11);
    let cache: Vec<bf16> = random(batch * rows * hk * d, &mut rng);
    let new: Vec<bf16> = random(batch * hk * d, &mut rng);
    let q: Vec<bf16> = random(batch * hq * d, &mut rng);
    let (mut kc, mut vc) = (
        stream.clone_htod(&cache).unwrap(),
        stream.clone_htod(&cache).unwrap(),
    );
    let (nd, qd) = (
        stream.clone_htod(&new).unwrap(),
        stream.clone_htod(&q).unwrap(),
    );
    let sinks = stream.clone_htod(&vec![0.5f32; hq]).unwrap();
    let lens = stream.clone_htod(&[3i32, 9]).unwrap();
    let shape = [batch, rows, hk, d];
    let o_shape = [batch, 1, hq, d];
    let nt = DeviceTensor::contiguous(&nd, [batch, 1, hk, d]);
    let qt = DeviceTensor::contiguous(&qd, o_shape);
    // One element more than O, so that O can start one element in (misaligned).
    let o_len = batch * hq * d;
    let mut out = stream.clone_htod(&vec![bf16::NAN; o_len + 1]).unwrap();
    let mut lse = stream.clone_htod(&vec![f32::NAN; batch * hq]).unwrap();
    #[derive(Debug, PartialEq)]
    enum Case {
        ShortLse,
        FewSinks,
        ShortO,
        MisalignedO,
    }
    for case in [
        Case::ShortLse,
        Case::FewSinks,
        Case::ShortO,
        Case::MisalignedO,
    ] {
        let (mut kt, mut vt) = (
            DeviceTensorMut::contiguous(&mut kc, shape),
            DeviceTensorMut::contiguous(&mut vc, shape),
        );
        let sinks_view = if case == Case::FewSinks {
            sinks.slice(..hq - 1)
        } else {
            sinks.slice(..)
        };
        let step = DeviceKvCacheStep {
            q: &qt,
            k_cache: &mut kt,
            v_cache: &mut vt,
            block_table: None,
            cache_batch_idx: None,
            cache_seqlens: lens.as_view(),
            new: Some((&nt, &nt)),
            rotary: None,
            sinks: Some(&sinks_view),
            num_splits: 0,
            descales: None,
        };
        let o_view = match case {
            Case::ShortO => out.slice_mut(..o_len - 1),
            Case::MisalignedO => out.slice_mut(1..),
            _ => out.slice_mut(..o_len),
        };
        let lse_len = if case == Case::ShortLse {
            batch * hq - 1
        } else {
            batch * hq
        };
        let r = dev.kvcache_step_into(
            &stream,
            &AttentionConfig::new(),
            step,
            &mut DeviceTensorMut::new(o_view, flashattn::Layout::contiguous(o_shape)),
            &mut lse.slice_mut(..lse_len),
        );
        let too_small = |which: Operand| matches!(&r, Err(flashattn::Error::BufferTooSmall { operand, .. }) if *operand == which);
        let expected = match case {
            Case::ShortLse => too_small(Operand::Lse),
            Case::FewSinks => too_small(Operand::Sinks),
            Case::ShortO => too_small(Operand::Out),
            Case::MisalignedO => matches!(&r, Err(flashattn::Error::Misaligned { .. })),
        };
        assert!(expected, "{case:?}: {r:?}");
    }
    assert_cache_unchanged(
        &stream,
        [&kc, &vc],
        &cache,
        "a refused step wrote the cache",
    );
}

/// K and V of a cache on the device still hold `cache`, bit for bit.
fn assert_cache_unchanged(
    stream: &std::sync::Arc<cudarc::driver::CudaStream>,
    kv: [&CudaSlice<bf16>; 2],
    cache: &[bf16],
    what: &str,
) {
    for x in kv {
        let got = stream.clone_dtoh(x).unwrap();
        stream.synchronize().unwrap();
        let same = got
            .iter()
            .zip(cache)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(got.len() == cache.len() && same, "{what}");
    }
}
