//! An e4m3 KV cache on the Hopper and Ampere forwards (`kvcache-fp8`): K and V stored in e4m3,
//! widened to Q's type in shared memory, each sequence's keys scaled by its descales. Every
//! sequence's O and LSE against the f64 reference over its dequantized keys and values (the
//! stored values times their descales), under DESIGN's rule with the baseline of a framework
//! that dequantizes to bf16 and then attends: paged (pages of 16, 64, 100 and 160 rows, out of
//! order) and dense, GQA with and without packed query heads, causal and softcap, key splits,
//! with and without descales, the rows past each length poisoned (keys of e4m3's largest
//! finite value, values NaN, as an uninitialized cache may hold). Whole steps over such caches
//! (append quantized by the descales, rotary embedding, forward) against the host step.
#![cfg(feature = "kvcache-fp8")]

use cudarc::driver::CudaSlice;
use flashattn::cuda::{DeviceCacheDescales, DeviceKvCacheInputs, DeviceTensor, DeviceTensorMut};
use flashattn::{AttentionConfig, Backend, Element};
use float8::F8E4M3;
use half::bf16;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use super::common::device;
use super::kvcache::{check_sequence_over, Outputs};
use super::kvcache_step::{step_case, Layout};

/// One case: head dims, query and KV heads, query rows, page size (0: a dense cache of 320
/// rows), cached keys per sequence, descales, key splits.
struct Case {
    d: usize,
    heads: (usize, usize),
    seqlen_q: usize,
    page_size: usize,
    lens: Vec<i32>,
    descales: bool,
    num_splits: usize,
    cfg: AttentionConfig,
}

const DENSE_ROWS: usize = 320;

/// The case's failures, each naming it.
fn run_case(c: &Case, seed: u64) -> Vec<String> {
    let mut rng = StdRng::seed_from_u64(seed);
    let (hq, hk) = c.heads;
    let (d, batch, seqlen_q) = (c.d, c.lens.len(), c.seqlen_q);
    let row = hk * d;
    // The cache: rows of e4m3 values in [-4, 4], pages in shuffled order (or dense entries).
    let (slots, rows) = if c.page_size == 0 {
        (batch, DENSE_ROWS)
    } else {
        let pages_per_seq = DENSE_ROWS.div_ceil(c.page_size);
        (batch * pages_per_seq, c.page_size)
    };
    let e4m3 = |rng: &mut StdRng| F8E4M3::from_f32(rng.random_range(-4.0f32..4.0));
    let mut k: Vec<F8E4M3> = (0..slots * rows * row).map(|_| e4m3(&mut rng)).collect();
    let mut v: Vec<F8E4M3> = (0..slots * rows * row).map(|_| e4m3(&mut rng)).collect();
    let mut order: Vec<i32> = (0..slots as i32).collect();
    order.shuffle(&mut rng);
    let table = (c.page_size > 0).then_some(order);
    let pages_per_seq = slots / batch;
    // Where sequence b's key j lies, as a row index into the cache.
    let at = |b: usize, j: usize| match &table {
        Some(t) => t[b * pages_per_seq + j / rows] as usize * rows + j % rows,
        None => b * rows + j,
    };
    // Rows past each length: keys of e4m3's largest finite value, which attended to would move
    // O far, and NaN values, which would make O NaN if multiplied by their weight of 0.
    for (b, &len) in c.lens.iter().enumerate() {
        for j in len as usize..pages_per_seq * rows {
            let r = at(b, j);
            k[r * row..][..row].fill(F8E4M3::from_f32(448.0));
            v[r * row..][..row].fill(F8E4M3::NAN);
        }
    }
    let q: Vec<bf16> = (0..batch * seqlen_q * hq * d)
        .map(|_| bf16::from_f32(rng.random_range(-1.0f32..1.0)))
        .collect();
    let descale = |rng: &mut StdRng| {
        (0..batch * hk)
            .map(|_| rng.random_range(0.3f32..1.9))
            .collect()
    };
    let (kd, vd): (Vec<f32>, Vec<f32>) = if c.descales {
        (descale(&mut rng), descale(&mut rng))
    } else {
        (vec![1.0; batch * hk], vec![1.0; batch * hk])
    };

    let (dev, stream) = device();
    let up_q = stream.clone_htod(&q).unwrap();
    let (up_k, up_v): (CudaSlice<F8E4M3>, CudaSlice<F8E4M3>) = (
        stream.clone_htod(&k).unwrap(),
        stream.clone_htod(&v).unwrap(),
    );
    let (kd_d, vd_d) = (
        stream.clone_htod(&kd).unwrap(),
        stream.clone_htod(&vd).unwrap(),
    );
    let (kd_v, vd_v) = (kd_d.as_view(), vd_d.as_view());
    let lens_d = stream.clone_htod(&c.lens).unwrap();
    let table_d = table.as_ref().map(|t| stream.clone_htod(t).unwrap());
    let o_shape = [batch, seqlen_q, hq, d];
    let mut out = stream
        .clone_htod(&vec![bf16::NAN; o_shape.iter().product()])
        .unwrap();
    let mut lse = stream
        .clone_htod(&vec![f32::NAN; batch * hq * seqlen_q])
        .unwrap();
    let cache = [slots, rows, hk, d];
    let (qt, kt, vt) = (
        DeviceTensor::contiguous(&up_q, [batch, seqlen_q, hq, d]),
        DeviceTensor::contiguous(&up_k, cache),
        DeviceTensor::contiguous(&up_v, cache),
    );
    let what = format!(
        "d{d} {hq}/{hk} heads, {seqlen_q} queries, pages of {} (0: dense), lens {:?}, \
         descales {}, {} splits, {:?}",
        c.page_size, c.lens, c.descales, c.num_splits, c.cfg.mask
    );
    let inputs = DeviceKvCacheInputs {
        q: &qt,
        k_cache: &kt,
        v_cache: &vt,
        block_table: table_d.as_ref().map(|t| t.as_view()),
        cache_batch_idx: None,
        cache_seqlens: lens_d.as_view(),
        sinks: None,
        num_splits: c.num_splits,
        descales: c
            .descales
            .then_some(DeviceCacheDescales { k: &kd_v, v: &vd_v }),
    };
    let plan = match dev.kvcache_forward_into(
        &stream,
        &c.cfg,
        inputs,
        &mut DeviceTensorMut::contiguous(&mut out, o_shape),
        &mut lse.as_view_mut(),
    ) {
        Ok(plan) => plan,
        Err(e) => return vec![format!("{what}: {e}")],
    };
    let (out, lse) = (
        stream.clone_dtoh(&out).unwrap(),
        stream.clone_dtoh(&lse).unwrap(),
    );
    stream.synchronize().unwrap();
    let mut failures = vec![];
    let backend = match c.cfg.backend {
        Backend::Auto => Backend::Sm90,
        forced => forced,
    };
    if plan.backend != backend {
        failures.push(format!("{what}: ran on {:?}", plan.backend));
    }
    for (b, &len) in c.lens.iter().enumerate() {
        // Its keys and values dequantized (f32; the reference widens to f64).
        let deq = |x: &[F8E4M3], s: &[f32]| -> Vec<f32> {
            (0..len as usize)
                .flat_map(|j| {
                    let r = at(b, j);
                    (0..row).map(move |i| (r, i))
                })
                .map(|(r, i)| x[r * row + i].to_f32() * s[b * hk + i / d])
                .collect()
        };
        failures.extend(check_sequence_over(
            &c.cfg,
            &format!("{what}, sequence {b}"),
            Outputs {
                out: &out,
                lse: &lse,
            },
            b,
            (seqlen_q, hq, hk, d, d),
            &q,
            (&deq(&k, &kd), &deq(&v, &vd)),
        ));
    }
    failures
}

#[test]
#[ignore = "needs a GPU"]
fn e4m3_cache_matches_the_reference_over_its_dequantized_keys() {
    let causal = AttentionConfig::new().causal(true);
    let sm80 = AttentionConfig::new().backend(Backend::Sm80);
    // A decode step (one query row) over pages of 16 with descales, no mask, the launcher's
    // splits: what each case below changes.
    let decode = |d: usize, heads: (usize, usize), lens: Vec<i32>| Case {
        d,
        heads,
        seqlen_q: 1,
        page_size: 16,
        lens,
        descales: true,
        num_splits: 0,
        cfg: AttentionConfig::new(),
    };
    let cases = [
        // Decoding, GQA 8:1 (query heads packed), pages of 16 and 64, ragged lengths.
        Case {
            cfg: causal.clone(),
            ..decode(128, (16, 2), vec![1, 300, 17, 0, 160])
        },
        Case {
            page_size: 64,
            num_splits: 3,
            ..decode(128, (16, 2), vec![320, 129, 64])
        },
        // A chunk of queries over a dense cache (its entries as pages), without descales.
        Case {
            seqlen_q: 40,
            page_size: 0,
            descales: false,
            cfg: causal.clone(),
            ..decode(64, (4, 4), vec![300, 40, 193])
        },
        // Pages of 100 and 160 rows (100 gathered row by row, 160 staged in pieces of 16 rows),
        // softcap, and d256 (gathered: its tile leaves no room for staging slots).
        Case {
            seqlen_q: 3,
            page_size: 100,
            num_splits: 1,
            cfg: AttentionConfig::new().softcap(30.0),
            ..decode(128, (8, 2), vec![250, 3, 320])
        },
        Case {
            seqlen_q: 64,
            page_size: 160,
            cfg: causal,
            ..decode(128, (4, 1), vec![320, 70])
        },
        // 300 sequences of distinct descales: each persistent CTA runs many tiles, the last P·V
        // of one beside the first Q·Kᵀ of the next (whose descales differ).
        Case {
            num_splits: 1,
            ..decode(64, (8, 2), (0..300).map(|i| 1 + (i * 37) % 320).collect())
        },
        Case {
            page_size: 0,
            num_splits: 1,
            ..decode(128, (4, 4), (0..300).map(|i| 1 + (i * 53) % 320).collect())
        },
        Case {
            seqlen_q: 2,
            page_size: 64,
            num_splits: 2,
            cfg: AttentionConfig::new().window(Some(100), Some(0)),
            ..decode(256, (8, 4), vec![200, 33])
        },
        // The Ampere forward: decoding over pages of 16 (d128, two stages), a chunk over a
        // dense cache with softcap at d256 (one stage: K and V widened at their own barriers),
        // pages of 100 at d64 (Q's fragments in registers).
        Case {
            cfg: sm80.clone(),
            ..decode(128, (16, 2), vec![1, 300, 17, 0, 160])
        },
        Case {
            seqlen_q: 40,
            page_size: 0,
            cfg: sm80.clone().causal(true).softcap(20.0),
            ..decode(256, (4, 2), vec![300, 40, 193])
        },
        Case {
            seqlen_q: 3,
            page_size: 100,
            descales: false,
            cfg: sm80,
            ..decode(64, (8, 8), vec![250, 3, 320])
        },
    ];
    let failures: Vec<String> = cases
        .iter()
        .enumerate()
        .flat_map(|(i, c)| run_case(c, 90 + i as u64))
        .collect();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Whole steps over an e4m3 cache (`Device::kvcache_step_into` with descales): Q and the new keys
/// rotated, the new rows quantized into the cache by their sequences' descales, then the forward
/// over the longer caches; the cache the host step leaves, bit for bit, and each sequence against
/// the reference over its dequantized keys. Pages of 16 (decode, GQA 8:1) and of 64 (a chunk whose
/// new rows cross a page), a dense cache and one by entry index.
#[test]
#[ignore = "needs a GPU"]
fn e4m3_steps_match_the_host_step_and_the_reference() {
    let paged = |page: usize, slots: usize, pages_per_seq: usize| Layout {
        slots,
        rows: page,
        // Out of order: page i of the table is slot (7 i + 3) mod slots.
        table: Some(
            (0..3 * pages_per_seq)
                .map(|i| ((7 * i + 3) % slots) as i32)
                .collect(),
        ),
        entries: None,
        pages_per_seq,
    };
    let dense = Layout {
        slots: 3,
        rows: 200,
        table: None,
        entries: None,
        pages_per_seq: 1,
    };
    let indexed = Layout {
        slots: 5,
        rows: 200,
        table: None,
        entries: Some(vec![4, 0, 2]),
        pages_per_seq: 1,
    };
    let causal = AttentionConfig::new().causal(true);
    let cases = [
        // Decode, GQA 8:1 over pages of 16, rotary over the whole head.
        (
            AttentionConfig::new(),
            paged(16, 40, 13),
            (16, 2),
            [0, 17, 190],
            (1, 1),
            Some((128, false)),
        ),
        // A chunk of 3 queries and 3 new keys over pages of 64 (sequence 1's cross into its
        // second page), interleaved pairs over half the head.
        (
            causal.clone(),
            paged(64, 13, 4),
            (8, 2),
            [5, 62, 130],
            (3, 3),
            Some((64, true)),
        ),
        (causal, dense, (4, 4), [1, 100, 196], (2, 2), None),
        (
            AttentionConfig::new().window(Some(30), Some(0)),
            indexed,
            (8, 1),
            [40, 0, 150],
            (1, 1),
            Some((128, false)),
        ),
        // The Ampere forward after the same append.
        (
            AttentionConfig::new().causal(true).backend(Backend::Sm80),
            paged(16, 40, 13),
            (8, 2),
            [3, 100, 180],
            (2, 2),
            Some((128, false)),
        ),
    ];
    let mut failures = vec![];
    for (i, (cfg, layout, (hq, hk), lens, rows, rotary)) in cases.into_iter().enumerate() {
        failures.extend(step_case::<F8E4M3>(
            &cfg,
            &layout,
            (hq, hk, 128),
            &lens,
            rows,
            rotary,
            true,
            200 + i as u64,
        ));
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Every e4m3 code widened exactly, NaN included: one key per sequence, K zero and V's row the
/// 256 codes (two heads of 128, or one of 256), so that O is V's row as the kernel widened it,
/// each element the code's value (which bf16 holds exactly) or NaN; on the Hopper forward
/// (entries of 16 rows staged, of 24 gathered; d256 gathered) and on the Ampere forward's two
/// schedules (d128: two stages; d256: one).
#[test]
#[ignore = "needs a GPU"]
fn every_e4m3_code_widens_exactly() {
    let (dev, stream) = device();
    let codes: Vec<F8E4M3> = (0..=255u8).map(F8E4M3::from_bits).collect();
    let mut failures = vec![];
    for (backend, d, rows) in [
        (Backend::Sm90, 128, 16),
        (Backend::Sm90, 128, 24),
        (Backend::Sm90, 256, 16),
        (Backend::Sm80, 128, 16),
        (Backend::Sm80, 256, 16),
    ] {
        let heads = 256 / d;
        // Two sequences, dense entries of `rows` rows, one key each.
        let batch = 2;
        let mut k = vec![F8E4M3::from_f32(0.0); batch * rows * heads * d];
        let mut v = k.clone();
        for b in 0..batch {
            v[b * rows * heads * d..][..heads * d].copy_from_slice(&codes);
            // Rows past the key: large, which attended to would show.
            k[(b * rows + 1) * heads * d..(b + 1) * rows * heads * d].fill(F8E4M3::from_f32(448.0));
        }
        let q: Vec<bf16> = (0..batch * heads * d)
            .map(|i| bf16::from_f32(((i % 7) as f32 - 3.0) / 3.0))
            .collect();
        let (up_q, up_k, up_v) = (
            stream.clone_htod(&q).unwrap(),
            stream.clone_htod(&k).unwrap(),
            stream.clone_htod(&v).unwrap(),
        );
        let lens = stream.clone_htod(&vec![1i32; batch]).unwrap();
        let mut out = stream
            .clone_htod(&vec![bf16::from_f32(7.0); batch * heads * d])
            .unwrap();
        let mut lse = stream.clone_htod(&vec![f32::NAN; batch * heads]).unwrap();
        let cache = [batch, rows, heads, d];
        let (qt, kt, vt) = (
            DeviceTensor::contiguous(&up_q, [batch, 1, heads, d]),
            DeviceTensor::contiguous(&up_k, cache),
            DeviceTensor::contiguous(&up_v, cache),
        );
        let cfg = AttentionConfig::new().backend(backend);
        let inputs = DeviceKvCacheInputs {
            q: &qt,
            k_cache: &kt,
            v_cache: &vt,
            block_table: None,
            cache_batch_idx: None,
            cache_seqlens: lens.as_view(),
            sinks: None,
            num_splits: 0,
            descales: None,
        };
        let what = format!("{backend:?} d{d}, entries of {rows} rows");
        if let Err(e) = dev.kvcache_forward_into(
            &stream,
            &cfg,
            inputs,
            &mut DeviceTensorMut::contiguous(&mut out, [batch, 1, heads, d]),
            &mut lse.as_view_mut(),
        ) {
            failures.push(format!("{what}: {e}"));
            continue;
        }
        let out = stream.clone_dtoh(&out).unwrap();
        stream.synchronize().unwrap();
        for (i, o) in out.iter().enumerate() {
            let want = codes[i % 256].to_f32();
            // Equal as f32 (exact for these values; -0 sums to +0 in the accumulator).
            let exact = if want.is_nan() {
                o.is_nan()
            } else {
                o.to_f32() == want
            };
            if !exact {
                failures.push(format!(
                    "{what}: code {:#04x} ({want}) widened to {o} (sequence {})",
                    i % 256,
                    i / 256
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
