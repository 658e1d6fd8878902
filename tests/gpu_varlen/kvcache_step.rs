//! A KV-cache step on the GPU (`Device::kvcache_step_into`): Q and the new keys rotated (rotary
//! embedding, interleaved pairs or halves, over all or part of the head), the new keys and values
//! appended after each sequence's cached ones in a dense or a paged cache, then the forward over
//! the longer caches. The cache afterwards bit-identical to the host step's
//! (`flashattn::kvcache::step`), each sequence's O and LSE against the f64 reference over its
//! keys in that cache; the f16 append alike; counts past the capacity and page numbers out of
//! range written nowhere outside the buffers.

use cudarc::driver::CudaSlice;
use flashattn::cuda::{
    DeviceKvCacheAppend, DeviceKvCacheStep, DeviceRotary, DeviceTensor, DeviceTensorMut,
};
use flashattn::kvcache::{self, KvCacheMut, KvCacheStep, Rotary};
use flashattn::{AttentionConfig, Backend, TensorMut, TensorRef};
use half::bf16;

use super::common::device;
use super::harness::random;
use super::kvcache::{check_sequence, Outputs};

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
struct Layout {
    slots: usize,
    rows: usize,
    table: Option<Vec<i32>>,
    entries: Option<Vec<i32>>,
    pages_per_seq: usize,
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

/// One step on the host and on the device from the same cache: the device's cache equal to the
/// host's bit for bit, and each sequence's O and LSE against the reference. The failures.
#[allow(clippy::too_many_arguments)]
fn step_case(
    cfg: &AttentionConfig,
    layout: &Layout,
    (hq, hk, d): (usize, usize, usize),
    lens: &[i32],
    (seqlen_q, seqlen_new): (usize, usize),
    rotary: Option<(usize, bool)>,
    seed: u64,
) -> Vec<String> {
    let mut rng = rand::SeedableRng::seed_from_u64(seed);
    let batch = lens.len();
    let row = hk * d;
    let cache_shape = [layout.slots, layout.rows, hk, d];
    let k0: Vec<bf16> = random(layout.slots * layout.rows * row, &mut rng);
    let v0: Vec<bf16> = random(layout.slots * layout.rows * row, &mut rng);
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
                descales: None,
            },
        )
        .unwrap_or_else(|e| panic!("host step {cfg:?}: {e}"));
    }

    // The device's, its outputs poisoned first.
    let (dev, stream) = device();
    let up = |x: &[bf16]| stream.clone_htod(x).unwrap();
    let (mut kc, mut vc) = (up(&k0), up(&v0));
    let (qd, knd, vnd) = (up(&q), up(&k_new), up(&v_new));
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
        "{cfg:?} ({}), {} cache, lens {lens:?} + {seqlen_new}, {seqlen_q} query rows, \
         rotary {rotary:?}",
        plan.explain(),
        match (&layout.table, &layout.entries) {
            (Some(_), _) => "paged",
            (None, Some(_)) => "dense (cache_batch_idx)",
            (None, None) => "dense",
        }
    );
    let mut failures = vec![];
    let same_bits =
        |a: &[bf16], b: &[bf16]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
    if !same_bits(&gk, &hk_cache) || !same_bits(&gv, &hv_cache) {
        failures.push(format!("{what}: the cache differs from the host step's"));
    }
    // The appended rows hold the new values (not the old cache's): the host step wrote them.
    let same_position = matches!(cfg.mask.bounds(), (None, None));
    let q_used = match &host_rotary {
        Some(r) => rotate_q(&q, [batch, seqlen_q, hq, d], r, lens, same_position),
        None => q.clone(),
    };
    for (b, &len) in lens.iter().enumerate() {
        let keys = len as usize + seqlen_new;
        let gather = |x: &[bf16]| -> Vec<bf16> {
            (0..keys)
                .flat_map(|j| x[layout.at(b, j, row)..][..row].to_vec())
                .collect()
        };
        failures.extend(check_sequence(
            cfg,
            &format!("{what}, sequence {b}"),
            Outputs { out: &go, lse: &gl },
            b,
            (seqlen_q, hq, hk, d, d),
            &q_used,
            (&gather(&hk_cache), &gather(&hv_cache)),
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
                    failures.extend(step_case(
                        cfg,
                        layout,
                        (hq, hk, d),
                        &lens,
                        rows,
                        rotary,
                        seed,
                    ));
                }
            }
        }
    }
    // The Ampere forward after the same append (dense caches).
    let sm80 = AttentionConfig::new().causal(true).backend(Backend::Sm80);
    failures.extend(step_case(
        &sm80,
        &dense,
        (hq, hk, d),
        &[5, 130, 0],
        (3, 3),
        Some((128, false)),
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
            },
        )
        .unwrap_or_else(|e| panic!("paged {paged}: {e}"));
        // V's rows are copied unrotated: sequence 0's 4 new rows at rows 0..4 of entry (page)
        // 0 either way; paged, sequence 2's first two at rows 126, 127 of page 3 (its second
        // page clamped), its last two past the capacity; every other row as it was.
        let got = stream.clone_dtoh(&vc).unwrap();
        stream.synchronize().unwrap();
        let mut want = cache.clone();
        want[..4 * hk * d].copy_from_slice(&new[..4 * hk * d]);
        if paged {
            let seq2 = &new[2 * 4 * hk * d..][..2 * hk * d];
            want[3 * entry + 126 * hk * d..][..2 * hk * d].copy_from_slice(seq2);
        }
        assert!(
            got.iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "paged {paged}: the V cache holds other rows than the clamped counts name"
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
