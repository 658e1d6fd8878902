//! KV caches on the GPU (`Device::kvcache_forward_into`, the packed kernels with the cache's
//! entries or pages as sequences' keys): each sequence's O and LSE against the f64 reference of
//! its queries over its first `cache_seqlens[b]` cached keys, decoding and a chunk of queries,
//! GQA, causal / window / softcap, dense and paged caches on both families; an empty sequence
//! gives O = 0 and LSE = +inf, the cache's rows past each length take no weight, and malformed
//! counts and page numbers stay inside the buffers. On the Hopper
//! forward also with a KV head's query heads packed as one tile's rows (pack-GQA) and with the
//! keys split over CTAs and merged.

use cudarc::driver::CudaSlice;
use flashattn::cuda::{DeviceKvCacheInputs, DeviceTensor, DeviceTensorMut};
use flashattn::reference::{self, compare};
use flashattn::unstable::{PackGqa, Sm90Schedule};
use flashattn::{AttentionConfig, Backend, TensorRef};
use half::bf16;

use super::common::device;
use super::harness::random;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;

const SEQLEN_CACHE: usize = 300;

/// One KV-cache call's host inputs: Q `(batch, seqlen_q, hq, d)`; K and V of shape `cache`
/// (entries or pages first, V's head dim `dv`), paged where a block table is given; the cached key
/// counts; the sinks.
struct Call<'a> {
    cfg: AttentionConfig,
    q: &'a [bf16],
    q_shape: [usize; 4],
    kv: (&'a [bf16], &'a [bf16]),
    cache: [usize; 4],
    dv: usize,
    table: Option<&'a [i32]>,
    /// A dense cache's entry per sequence (`cache_batch_idx`).
    entries: Option<&'a [i32]>,
    lens: &'a [i32],
    sinks: Option<&'a [f32]>,
    num_splits: usize,
}

/// `c` on `stream`: O, the LSE `(batch, heads_q, seqlen_q)` and the plan, both outputs poisoned
/// with NaN before.
fn launch(
    dev: &flashattn::cuda::Device,
    stream: &std::sync::Arc<cudarc::driver::CudaStream>,
    c: &Call<'_>,
) -> flashattn::Result<(Vec<bf16>, Vec<f32>, flashattn::Plan)> {
    let [batch, seqlen_q, hq, _] = c.q_shape;
    let up = |x: &[bf16]| stream.clone_htod(x).unwrap();
    let (qd, kd, vd) = (up(c.q), up(c.kv.0), up(c.kv.1));
    let o_shape = [batch, seqlen_q, hq, c.dv];
    let mut out: CudaSlice<bf16> = up(&vec![bf16::NAN; o_shape.iter().product()]);
    let mut lse = stream
        .clone_htod(&vec![f32::NAN; hq * batch * seqlen_q])
        .unwrap();
    let lens = stream.clone_htod(c.lens).unwrap();
    let table = c.table.map(|t| stream.clone_htod(t).unwrap());
    let entries_d = c.entries.map(|e| stream.clone_htod(e).unwrap());
    let sinks = c.sinks.map(|s| stream.clone_htod(s).unwrap());
    let sinks_view = sinks.as_ref().map(|s| s.as_view());
    let [entries, rows, hk, _] = c.cache;
    let (qt, kt, vt) = (
        DeviceTensor::contiguous(&qd, c.q_shape),
        DeviceTensor::contiguous(&kd, c.cache),
        DeviceTensor::contiguous(&vd, [entries, rows, hk, c.dv]),
    );
    let plan = dev.kvcache_forward_into(
        stream,
        &c.cfg,
        DeviceKvCacheInputs {
            q: &qt,
            k_cache: &kt,
            v_cache: &vt,
            block_table: table.as_ref().map(|t| t.as_view()),
            cache_batch_idx: entries_d.as_ref().map(|e| e.as_view()),
            cache_seqlens: lens.as_view(),
            sinks: sinks_view.as_ref(),
            num_splits: c.num_splits,
            descales: None,
        },
        &mut DeviceTensorMut::contiguous(&mut out, o_shape),
        &mut lse.as_view_mut(),
    )?;
    let got = (
        stream.clone_dtoh(&out).unwrap(),
        stream.clone_dtoh(&lse).unwrap(),
    );
    stream.synchronize().unwrap();
    Ok((got.0, got.1, plan))
}

/// A dense cache of `entries` entries of `SEQLEN_CACHE` rows (V's head dim Q's) on a fresh
/// device and stream, its keys cut into `num_splits` ranges (0: as the launcher plans).
fn run(
    cfg: &AttentionConfig,
    (q, k, v): (&[bf16], &[bf16], &[bf16]),
    (batch, seqlen_q, entries): (usize, usize, usize),
    (hq, hk, d): (usize, usize, usize),
    lens: &[i32],
    num_splits: usize,
) -> (Vec<bf16>, Vec<f32>, flashattn::Plan) {
    let (dev, stream) = device();
    let call = Call {
        cfg: cfg.clone(),
        q,
        q_shape: [batch, seqlen_q, hq, d],
        kv: (k, v),
        cache: [entries, SEQLEN_CACHE, hk, d],
        dv: d,
        table: None,
        entries: None,
        lens,
        sinks: None,
        num_splits,
    };
    launch(&dev, &stream, &call).unwrap_or_else(|e| panic!("{cfg:?}, {num_splits} splits: {e}"))
}

/// A call's O `(batch, seqlen_q, hq, dv)` and LSE `(batch, hq, seqlen_q)`.
#[derive(Clone, Copy)]
pub(super) struct Outputs<'a> {
    pub(super) out: &'a [bf16],
    pub(super) lse: &'a [f32],
}

/// Sequence `b` of `got` against the f64 reference of its queries (of `q`, the call's) over its
/// keys and values gathered in `kv` (as many rows as it has keys), under DESIGN's rule; without
/// keys, O = 0 and LSE = +inf. The failures, each led by `what`.
pub(super) fn check_sequence(
    cfg: &AttentionConfig,
    what: &str,
    got: Outputs<'_>,
    b: usize,
    shape: (usize, usize, usize, usize, usize),
    q: &[bf16],
    (kb, vb): (&[bf16], &[bf16]),
) -> Vec<String> {
    let (kf, vf) = (reference::to_f32(kb), reference::to_f32(vb));
    check_sequence_over(cfg, what, got, b, shape, q, (&kf, &vf))
}

/// [`check_sequence`] over keys and values that bf16 may not hold (an e4m3 cache's times its
/// descales): the reference over them as they are, the baseline a framework's that rounds them
/// to bf16 before it attends.
pub(super) fn check_sequence_over(
    cfg: &AttentionConfig,
    what: &str,
    got: Outputs<'_>,
    b: usize,
    (seqlen_q, hq, hk, d, dv): (usize, usize, usize, usize, usize),
    q: &[bf16],
    (kf, vf): (&[f32], &[f32]),
) -> Vec<String> {
    let len = kf.len() / (hk * d);
    let o = reference::to_f32(&got.out[b * seqlen_q * hq * dv..][..seqlen_q * hq * dv]);
    let l = &got.lse[b * hq * seqlen_q..][..hq * seqlen_q];
    if len == 0 {
        let empty = o.iter().all(|&x| x == 0.0) && l.iter().all(|&x| x == f32::INFINITY);
        return if empty {
            vec![]
        } else {
            vec![format!("{what}: no keys")]
        };
    }
    let q = &q[b * seqlen_q * hq * d..][..seqlen_q * hq * d];
    let qf = reference::to_f32(q);
    let bf = |x: &[f32]| -> Vec<bf16> { x.iter().map(|&v| bf16::from_f32(v)).collect() };
    let (kb, vb) = (bf(kf), bf(vf));
    let (q_shape, k_shape, v_shape) = ([1, seqlen_q, hq, d], [1, len, hk, d], [1, len, hk, dv]);
    let want = reference::reference_forward(
        cfg,
        TensorRef::contiguous(&qf, q_shape),
        TensorRef::contiguous(kf, k_shape),
        TensorRef::contiguous(vf, v_shape),
    );
    let base = reference::baseline_forward(
        cfg,
        TensorRef::contiguous(q, q_shape),
        TensorRef::contiguous(&kb, k_shape),
        TensorRef::contiguous(&vb, v_shape),
    );
    [
        ("O", compare(&o, &want.out, &base.out)),
        ("LSE", compare(l, &want.lse, &base.lse)),
    ]
    .into_iter()
    .filter(|(_, c)| !c.pass)
    .map(|(name, c)| format!("{what} ({seqlen_q}x{len}): {name} {c}"))
    .collect()
}

/// Rows past each sequence's length in a dense cache of `SEQLEN_CACHE` rows of `row` elements:
/// large finite keys, which attended to would move O far from the reference, and NaN values, as
/// an uninitialized cache may hold (the kernels' block loads read them and weigh them 0; 0·NaN
/// would be NaN, so the Hopper forward zeroes them in shared memory, the Ampere one never loads
/// them).
fn poison_past_lengths([k, v]: [&mut Vec<bf16>; 2], lens: &[i32], row: usize) {
    let entry = SEQLEN_CACHE * row;
    for (x, poison) in [(k, 30.0), (v, f32::NAN)] {
        for (b, &len) in lens.iter().enumerate() {
            x[b * entry + len as usize * row..(b + 1) * entry].fill(bf16::from_f32(poison));
        }
    }
}

/// Every sequence of a dense-cache call (V's head dim Q's) against the reference over its
/// entry's first `lens[b]` keys ([`check_sequence`]): the failures, each led by `what`.
fn check_dense_cache(
    cfg: &AttentionConfig,
    what: &str,
    got: Outputs<'_>,
    lens: &[i32],
    (seqlen_q, hq, hk, d): (usize, usize, usize, usize),
    q: &[bf16],
    (k, v): (&[bf16], &[bf16]),
) -> Vec<String> {
    let entry = SEQLEN_CACHE * hk * d;
    let mut failures = vec![];
    for (b, &len) in lens.iter().enumerate() {
        let keys = |x: &[bf16]| x[b * entry..][..len as usize * hk * d].to_vec();
        failures.extend(check_sequence(
            cfg,
            &format!("{what}, sequence {b}"),
            got,
            b,
            (seqlen_q, hq, hk, d, d),
            q,
            (&keys(k), &keys(v)),
        ));
    }
    failures
}

#[test]
#[ignore = "needs a GPU"]
fn dense_cache_matches_the_reference_per_sequence() {
    let (hq, hk, d, entries) = (8, 2, 128, 4);
    let mut rng = rand::SeedableRng::seed_from_u64(36);
    let mut failures = vec![];
    // [300, 0, 17]: a full entry whose last key block runs into the next entry's rows, which
    // hold no key (NaN values).
    for (seqlen_q, lens) in [(1, [0, 1, 257]), (4, [300, 129, 4]), (1, [300, 0, 17])] {
        let batch = lens.len();
        let q: Vec<bf16> = random(batch * seqlen_q * hq * d, &mut rng);
        let mut k: Vec<bf16> = random(entries * SEQLEN_CACHE * hk * d, &mut rng);
        let mut v: Vec<bf16> = random(entries * SEQLEN_CACHE * hk * d, &mut rng);
        poison_past_lengths([&mut k, &mut v], &lens, hk * d);
        for backend in [Backend::Auto, Backend::Sm80] {
            for cfg in [
                AttentionConfig::new(),
                AttentionConfig::new().causal(true),
                AttentionConfig::new().window(Some(50), Some(0)),
                AttentionConfig::new().causal(true).softcap(20.0),
            ] {
                let cfg = cfg.backend(backend);
                let (out, lse, plan) = run(
                    &cfg,
                    (&q, &k, &v),
                    (batch, seqlen_q, entries),
                    (hq, hk, d),
                    &lens,
                    0,
                );
                failures.extend(check_dense_cache(
                    &cfg,
                    &format!("{cfg:?} ({})", plan.explain()),
                    Outputs {
                        out: &out,
                        lse: &lse,
                    },
                    &lens,
                    (seqlen_q, hq, hk, d),
                    &q,
                    (&k, &v),
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Cached key counts past the cache, or negative: the kernels clamp them (into
/// `0..=seqlen_cache`), so that each sequence's O and LSE are those over its clamped count of
/// keys (none: O 0, LSE +inf), and every access stays inside the buffers (run under memcheck).
#[test]
#[ignore = "needs a GPU"]
fn sanitizer_kvcache_lengths_out_of_range_stay_in_bounds() {
    let (hq, hk, d, entries, batch, seqlen_q) = (4, 4, 64, 3, 3, 2);
    let mut rng = rand::SeedableRng::seed_from_u64(37);
    let q: Vec<bf16> = random(batch * seqlen_q * hq * d, &mut rng);
    let k: Vec<bf16> = random(entries * SEQLEN_CACHE * hk * d, &mut rng);
    let cfg = AttentionConfig::new().causal(true);
    let (out, lse, _) = run(
        &cfg,
        (&q, &k, &k),
        (batch, seqlen_q, entries),
        (hq, hk, d),
        &[-5, SEQLEN_CACHE as i32 + 1000, i32::MAX],
        0,
    );
    let clamped = [0, SEQLEN_CACHE as i32, SEQLEN_CACHE as i32];
    let failures = check_dense_cache(
        &cfg,
        "clamped counts",
        Outputs {
            out: &out,
            lse: &lse,
        },
        &clamped,
        (seqlen_q, hq, hk, d),
        &q,
        (&k, &k),
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A paged cache of `num_pages` pages of `page_size` rows, V's head dim `dv`, on a fresh device
/// and stream.
#[allow(clippy::too_many_arguments)]
fn run_paged(
    cfg: &AttentionConfig,
    (q, k, v): (&[bf16], &[bf16], &[bf16]),
    (batch, seqlen_q): (usize, usize),
    (num_pages, page_size): (usize, usize),
    (hq, hk, d, dv): (usize, usize, usize, usize),
    (table, lens): (&[i32], &[i32]),
    num_splits: usize,
) -> flashattn::Result<(Vec<bf16>, Vec<f32>, flashattn::Plan)> {
    let (dev, stream) = device();
    let call = Call {
        cfg: cfg.clone(),
        q,
        q_shape: [batch, seqlen_q, hq, d],
        kv: (k, v),
        cache: [num_pages, page_size, hk, d],
        dv,
        table: Some(table),
        entries: None,
        lens,
        sinks: None,
        num_splits,
    };
    launch(&dev, &stream, &call)
}

/// Pages of 128 and 256 rows (one and two key blocks each), of 16, 48, 80 and 64 rows and of
/// sizes no multiple of 16 (1, 24, 100): no whole number of blocks, so gathered row by row, each
/// row from its page (past 1k keys without a mask the Base tiles run: d64's 192-key blocks over
/// three pages of 64, or over exactly 32 pages of 6 (a page for each lane of a warp) and 64 of 3
/// (a lookup a row), d128's 160-key ones over 32 pages of 5 and 40 of 4; over pages of 16 they
/// take their blocks in 16-row pieces, 12 and 10 to a block), out of order, one page shared by
/// two sequences, the rows past the first two sequences' lengths poisoned (large keys,
/// NaN values): each sequence's O and LSE against the reference over its
/// keys gathered from its pages, with the launcher's key splits and with 3.
#[test]
#[ignore = "needs a GPU"]
fn paged_cache_matches_the_reference_per_sequence() {
    let cases = [
        ((128, 128), (128, 3), 1, [0, 1, 200, 384]),
        ((64, 64), (128, 3), 4, [129, 4, 384, 255]),
        ((128, 128), (256, 3), 4, [5, 700, 256, 768]),
        ((128, 128), (16, 24), 1, [0, 17, 200, 384]),
        ((64, 64), (48, 8), 4, [129, 4, 384, 255]),
        ((128, 128), (80, 10), 3, [5, 700, 161, 800]),
        ((128, 128), (64, 6), 2, [0, 17, 200, 384]),
        ((64, 64), (64, 18), 2, [1100, 3, 700, 1152]),
        ((128, 128), (64, 18), 2, [0, 1152, 1030, 17]),
        ((128, 128), (1, 130), 2, [0, 17, 130, 64]),
        ((64, 64), (24, 9), 1, [216, 3, 100, 25]),
        ((128, 128), (100, 4), 4, [399, 100, 1, 257]),
        ((64, 64), (6, 200), 2, [1200, 3, 700, 1151]),
        ((64, 64), (3, 400), 1, [1199, 1200, 5, 640]),
        ((128, 128), (5, 240), 2, [1200, 161, 2, 1119]),
        ((128, 128), (4, 300), 1, [7, 1200, 1000, 321]),
        ((64, 64), (16, 72), 2, [1152, 5, 1030, 300]),
        ((128, 128), (16, 72), 1, [1100, 17, 1152, 600]),
    ];
    assert_paged_cases(Backend::Auto, &cases);
}

/// Both forwards' per-row page lookups where a copied row is 4 threads wide (d96) and where V's
/// rows are narrower than K's ((192, 128)), over pages of 16, 40 and 64 rows (`Auto`: the
/// Hopper forward on Hopper; past 1k keys d96's 192-key Base tile).
#[test]
#[ignore = "needs a GPU"]
#[cfg(all(feature = "hdim96", feature = "hdim192"))]
fn paged_rows_at_96_and_192_128() {
    for backend in [Backend::Sm80, Backend::Auto] {
        assert_paged_cases(
            backend,
            &[
                ((96, 96), (16, 20), 1, [1, 300, 77, 320]),
                ((96, 96), (40, 8), 3, [320, 41, 0, 129]),
                ((96, 96), (16, 75), 1, [1200, 3, 700, 1181]),
                ((192, 128), (64, 5), 2, [129, 300, 0, 320]),
                ((192, 128), (40, 8), 1, [5, 320, 39, 200]),
            ],
        );
    }
}

/// DeepSeek's (192, 128) over pages of its tile's 128-key blocks (the Base tile: it has no
/// Masked one), and over pages of 32 and 320 rows (in pieces of 16 and of 64 rows); d192
/// (112-key blocks) over pages of 16 (pieces) and 112 (whole blocks); d256 over pages of 16
/// (pieces) and 24 (gathered).
#[test]
#[ignore = "needs a Hopper GPU"]
#[cfg(feature = "hdim192")]
fn paged_cache_at_192_128() {
    assert_paged_cases(
        Backend::Auto,
        &[
            ((192, 128), (128, 3), 4, [129, 300, 0, 384]),
            ((192, 128), (32, 12), 2, [129, 300, 0, 384]),
            ((192, 128), (320, 2), 2, [129, 300, 0, 640]),
            ((192, 192), (16, 20), 2, [1, 300, 77, 320]),
            ((192, 192), (112, 4), 1, [448, 113, 0, 300]),
            ((256, 256), (16, 20), 2, [1, 300, 77, 320]),
            ((256, 256), (24, 9), 1, [216, 3, 100, 25]),
        ],
    );
}

/// The Ampere forward over paged caches, out of order and shared as above, at d64, d128 and
/// d256, decode and a chunk of queries: pages of its 64-key blocks, of two and of four, and
/// pages holding no whole block (16, 48, and sizes no multiple of 16: 1, 24, 100), each copied
/// row at its own page.
#[test]
#[ignore = "needs a GPU"]
fn paged_cache_on_sm80_matches_the_reference_per_sequence() {
    let cases = [
        ((128, 128), (64, 6), 1, [0, 17, 200, 384]),
        ((64, 64), (128, 3), 4, [129, 4, 384, 255]),
        ((128, 128), (256, 3), 3, [5, 700, 256, 768]),
        ((256, 256), (64, 5), 2, [1, 300, 77, 320]),
        ((128, 128), (16, 20), 1, [1, 300, 77, 320]),
        ((64, 64), (48, 7), 3, [336, 5, 129, 200]),
        ((128, 128), (1, 130), 2, [0, 17, 130, 64]),
        ((256, 256), (24, 9), 1, [216, 3, 100, 25]),
        ((128, 128), (100, 4), 4, [399, 100, 1, 257]),
    ];
    assert_paged_cases(Backend::Sm80, &cases);
}

/// A paged case: head dims (d, dv), pages (rows, per sequence), queries per sequence, and the
/// four sequences' cached key counts.
type PagedCase = ((usize, usize), (usize, usize), usize, [i32; 4]);

/// Every case of `cases` on `backend` passes (the failures listed if not).
fn assert_paged_cases(backend: Backend, cases: &[PagedCase]) {
    let failures: Vec<String> = cases
        .iter()
        .flat_map(|&(dims, pages, seqlen_q, lens)| {
            paged_case(backend, dims, pages, seqlen_q, &lens)
        })
        .collect();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// One paged case on `backend` over every mask, pages of `page_size` rows and `pages_per_seq` of
/// them per sequence, with the launcher's key splits and with 3 (the Ampere forward without:
/// it has none): the failures, empty when all pass.
fn paged_case(
    backend: Backend,
    (d, dv): (usize, usize),
    (page_size, pages_per_seq): (usize, usize),
    seqlen_q: usize,
    lens: &[i32],
) -> Vec<String> {
    let (hq, hk) = (8, 2);
    let hopper = flashattn::cuda::query_device(0).is_ok_and(|i| i.major == 9);
    let mut rng: StdRng = rand::SeedableRng::seed_from_u64(38 + d as u64 + page_size as u64);
    let mut failures = vec![];
    let batch = lens.len();
    // Sequences 0 and 1 have their poisoned pages to themselves; the last two share one.
    assert!(batch >= 4, "four sequences or more");
    let capacity = pages_per_seq * page_size;
    let num_pages = batch * pages_per_seq;
    let q: Vec<bf16> = random(batch * seqlen_q * hq * d, &mut rng);
    let mut k: Vec<bf16> = random(num_pages * page_size * hk * d, &mut rng);
    let mut v: Vec<bf16> = random(num_pages * page_size * hk * dv, &mut rng);
    // Pages out of order, the last two sequences sharing their first page (both read it; the
    // page the last one would have had goes unused).
    let mut table: Vec<i32> = (0..num_pages as i32).collect();
    table.shuffle(&mut rng);
    table[(batch - 1) * pages_per_seq] = table[(batch - 2) * pages_per_seq];
    // Key j of sequence b: its row's first element in K (or V) of `width` elements a row.
    let at = |b: usize, j: usize, width: usize| {
        let page = table[b * pages_per_seq + j / page_size] as usize;
        (page * page_size + j % page_size) * hk * width
    };
    // Rows past the first two sequences' lengths (in pages no other sequence reads): large
    // keys, which attended to would move O far from the reference, and NaN values, as an
    // uninitialized cache may hold (weighed 0, and zeroed before P·V on the Hopper forward).
    for (b, &len) in lens.iter().enumerate().take(2) {
        for j in len as usize..capacity {
            k[at(b, j, d)..][..hk * d].fill(bf16::from_f32(30.0));
            v[at(b, j, dv)..][..hk * dv].fill(bf16::NAN);
        }
    }
    let cfgs = [
        AttentionConfig::new(),
        AttentionConfig::new().causal(true),
        AttentionConfig::new().window(Some(50), Some(0)),
        AttentionConfig::new().causal(true).softcap(20.0),
    ];
    let splits: &[usize] = if backend == Backend::Sm80 {
        &[0]
    } else {
        &[0, 3]
    };
    for (cfg, splits) in cfgs
        .iter()
        .map(|c| c.clone().backend(backend))
        .flat_map(|c| splits.iter().map(move |&n| (c.clone(), n)))
    {
        let cfg = &cfg;
        let (out, lse, plan) = run_paged(
            cfg,
            (&q, &k, &v),
            (batch, seqlen_q),
            (num_pages, page_size),
            (hq, hk, d, dv),
            (&table, lens),
            splits,
        )
        .unwrap_or_else(|e| panic!("{cfg:?}: {e}"));
        // `Auto` on Hopper takes the Hopper forward (its row gather where pages hold no block).
        if backend == Backend::Auto && hopper {
            assert_eq!(plan.backend, Backend::Sm90, "{cfg:?}: {}", plan.explain());
        }
        for (b, &len) in lens.iter().enumerate() {
            let gather = |x: &[bf16], width: usize| -> Vec<bf16> {
                (0..len as usize)
                    .flat_map(|j| x[at(b, j, width)..][..hk * width].to_vec())
                    .collect()
            };
            let what = format!(
                "{cfg:?} ({}) ({d}, {dv}) pages of {page_size}, {splits} splits, sequence {b}",
                plan.explain()
            );
            failures.extend(check_sequence(
                cfg,
                &what,
                Outputs {
                    out: &out,
                    lse: &lse,
                },
                b,
                (seqlen_q, hq, hk, d, dv),
                &q,
                (&gather(&k, d), &gather(&v, dv)),
            ));
        }
    }
    failures
}

/// A dense cache read through `cache_batch_idx`: three sequences in entries 4, 0 and 2 of five,
/// entries of 256 rows (whole key blocks), 304 and 320 (gathered row by row), the
/// other entries' rows large: each sequence's O and LSE against the reference over its own
/// entry's keys, with the launcher's key splits and with 3, and on the Ampere forward.
#[test]
#[ignore = "needs a Hopper GPU"]
fn dense_cache_by_cache_batch_idx() {
    let (hq, hk, d, slots, seqlen_q) = (8, 2, 128, 5, 2);
    let entries = [4i32, 0, 2];
    let mut failures = vec![];
    for (rows, lens) in [
        (256, [256, 5, 0]),
        (304, [300, 17, 129]),
        (320, [320, 64, 1]),
    ] {
        let mut rng: StdRng = rand::SeedableRng::seed_from_u64(rows as u64);
        let batch = lens.len();
        let q: Vec<bf16> = random(batch * seqlen_q * hq * d, &mut rng);
        let mut k: Vec<bf16> = random(slots * rows * hk * d, &mut rng);
        let mut v: Vec<bf16> = random(slots * rows * hk * d, &mut rng);
        // Entries no sequence reads: attended to, they would move O far from the reference.
        for slot in [1, 3] {
            k[slot * rows * hk * d..][..rows * hk * d].fill(bf16::from_f32(30.0));
            v[slot * rows * hk * d..][..rows * hk * d].fill(bf16::from_f32(30.0));
        }
        for cfg in [
            AttentionConfig::new().causal(true),
            AttentionConfig::new().window(Some(50), Some(0)),
        ] {
            let runs = [(Backend::Auto, 0), (Backend::Auto, 3), (Backend::Sm80, 0)];
            for (backend, splits) in runs {
                let cfg = cfg.clone().backend(backend);
                let (dev, stream) = device();
                let call = Call {
                    cfg: cfg.clone(),
                    q: &q,
                    q_shape: [batch, seqlen_q, hq, d],
                    kv: (&k, &v),
                    cache: [slots, rows, hk, d],
                    dv: d,
                    table: None,
                    entries: Some(&entries),
                    lens: &lens,
                    sinks: None,
                    num_splits: splits,
                };
                let (out, lse, plan) = launch(&dev, &stream, &call)
                    .unwrap_or_else(|e| panic!("{cfg:?}, {rows} rows: {e}"));
                for (b, &len) in lens.iter().enumerate() {
                    let at = entries[b] as usize * rows * hk * d;
                    let keys = |x: &[bf16]| x[at..][..len as usize * hk * d].to_vec();
                    let what = format!(
                        "{cfg:?} ({}) entries of {rows} rows, {splits} splits, sequence {b}",
                        plan.explain()
                    );
                    failures.extend(check_sequence(
                        &cfg,
                        &what,
                        Outputs {
                            out: &out,
                            lse: &lse,
                        },
                        b,
                        (seqlen_q, hq, hk, d, d),
                        &q,
                        (&keys(&k), &keys(&v)),
                    ));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// `cache_batch_idx` out of range is clamped into the cache's entries (run under memcheck);
/// with a block table, or a count that is not the batch's, it is a typed error; both forwards
/// take entries of any size (152 and 160 rows here, checked against the reference).
#[test]
#[ignore = "needs a Hopper GPU"]
fn sanitizer_cache_batch_idx_out_of_range_stays_in_bounds() {
    let (hq, hk, d, slots, batch) = (4, 2, 64, 3, 3);
    let mut rng: StdRng = rand::SeedableRng::seed_from_u64(41);
    let q: Vec<bf16> = random(batch * hq * d, &mut rng);
    let k: Vec<bf16> = random(slots * 320 * hk * d, &mut rng);
    let (dev, stream) = device();
    let mut call = Call {
        cfg: AttentionConfig::new().causal(true),
        q: &q,
        q_shape: [batch, 1, hq, d],
        kv: (&k, &k),
        cache: [slots, 320, hk, d],
        dv: d,
        table: None,
        entries: Some(&[-3, 99, i32::MAX]),
        lens: &[100, 320, 7],
        sinks: None,
        num_splits: 0,
    };
    // Sequence b's results against its entry's first keys (`entry_keys[b]`: the entry and how
    // many), in a cache of `rows` rows an entry.
    let check_entries = |cfg: &AttentionConfig,
                         what: &str,
                         rows: usize,
                         (out, lse): (&[bf16], &[f32]),
                         entry_keys: [(usize, usize); 3]| {
        let mut failures = vec![];
        for (b, (entry, len)) in entry_keys.into_iter().enumerate() {
            let keys = k[entry * rows * hk * d..][..len * hk * d].to_vec();
            failures.extend(check_sequence(
                cfg,
                &format!("{what}, sequence {b}"),
                Outputs { out, lse },
                b,
                (1, hq, hk, d, d),
                &q,
                (&keys, &keys),
            ));
        }
        failures
    };
    let (out, lse, _) = launch(&dev, &stream, &call).unwrap();
    // The values clamped into the entries: 0, 2 and 2.
    let mut failures = check_entries(
        &call.cfg,
        "clamped cache_batch_idx",
        320,
        (&out, &lse),
        [(0, 100), (2, 320), (2, 7)],
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    let refused = |call: &Call| launch(&dev, &stream, call).err();
    call.table = Some(&[0, 1, 2]);
    assert!(
        matches!(refused(&call), Some(flashattn::Error::InvalidPageTable(_))),
        "with a block table"
    );
    call.table = None;
    call.entries = Some(&[0, 1]);
    assert!(
        matches!(refused(&call), Some(flashattn::Error::InvalidSeqlens(_))),
        "two entries for three sequences"
    );
    // Entries of 152 and 160 rows, the lengths clamped to them, on both forwards.
    call.entries = Some(&[2, 1, 0]);
    for (rows, backend) in [(152, Backend::Auto), (160, Backend::Sm80)] {
        call.cache = [slots * 2, rows, hk, d];
        call.cfg = AttentionConfig::new().causal(true).backend(backend);
        let (out, lse, _) = launch(&dev, &stream, &call).unwrap();
        failures.extend(check_entries(
            &call.cfg,
            &format!("entries of {rows} rows on {backend:?}"),
            rows,
            (&out, &lse),
            [(2, 100), (1, rows), (0, 7)],
        ));
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Page numbers and cache lengths out of range: the kernels clamp them (pages into
/// `0..num_pages`, lengths into the keys a table row addresses), so that each sequence's O and
/// LSE are those over the keys of its clamped pages and count, and every access stays inside
/// the buffers (run under memcheck), pages of whole key blocks and pages gathered row by row
/// alike, on both forwards; a table that is no whole number of rows is a typed error.
#[test]
#[ignore = "needs a GPU"]
fn sanitizer_paged_cache_out_of_range_stays_in_bounds() {
    let (hq, hk, d, num_pages, batch) = (4, 4, 128, 3, 3);
    let mut rng = rand::SeedableRng::seed_from_u64(39);
    let q: Vec<bf16> = random(batch * 2 * hq * d, &mut rng);
    let k: Vec<bf16> = random(num_pages * 128 * hk * d, &mut rng);
    let cfg = AttentionConfig::new().causal(true);
    // Two pages per sequence: every sequence with keys reads a page number out of range, in
    // pages of whole key blocks and in pages of 16 and 24 rows (each row's page number clamped
    // alike), with key splits and without (the Ampere forward has none).
    let small = random(num_pages * 16 * hk * d, &mut rng);
    let odd = random(num_pages * 24 * hk * d, &mut rng);
    let table = [1, -7, 2, 99, i32::MAX, 0];
    let page_sizes = [
        (&k, 128, [300, 200, i32::MAX]),
        (&small, 16, [30, 20, i32::MAX]),
        (&odd, 24, [40, 47, i32::MAX]),
    ];
    let runs = [(Backend::Auto, 0), (Backend::Auto, 5), (Backend::Sm80, 0)];
    let mut failures = vec![];
    for (cache, rows, lens) in page_sizes {
        // Each sequence's keys as the clamped table and count give them.
        let row = hk * d;
        let clamped_keys = |b: usize| -> Vec<bf16> {
            let len = (lens[b].max(0) as usize).min(2 * rows);
            (0..len)
                .flat_map(|j| {
                    let page = table[b * 2 + j / rows].clamp(0, num_pages as i32 - 1) as usize;
                    cache[(page * rows + j % rows) * row..][..row]
                        .iter()
                        .copied()
                })
                .collect()
        };
        for (backend, splits) in runs {
            let cfg = cfg.clone().backend(backend);
            let (out, lse, _) = run_paged(
                &cfg,
                (&q, cache, cache),
                (batch, 2),
                (num_pages, rows),
                (hq, hk, d, d),
                (&table, &lens),
                splits,
            )
            .unwrap();
            let what = format!("{backend:?}, pages of {rows}, {splits} splits");
            for b in 0..batch {
                let keys = clamped_keys(b);
                failures.extend(check_sequence(
                    &cfg,
                    &format!("{what}, sequence {b}"),
                    Outputs {
                        out: &out,
                        lse: &lse,
                    },
                    b,
                    (2, hq, hk, d, d),
                    &q,
                    (&keys, &keys),
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    let refused = run_paged(
        &cfg,
        (&q, &k, &k),
        (batch, 2),
        (num_pages, 128),
        (hq, hk, d, d),
        (&table[..5], &[1, 2, 3]),
        0,
    );
    assert!(
        matches!(refused, Err(flashattn::Error::InvalidPageTable(_))),
        "a table of 5 entries for 3 sequences"
    );
}

/// A causal call over a dense cache of `SEQLEN_CACHE` rows (K and V alike, `k`) with
/// `lens.len()` sequences of `seqlen_q` queries drawn from `seed`, on `stream`, optionally with
/// sinks: O and the LSE.
fn dense_call(
    dev: &flashattn::cuda::Device,
    stream: &std::sync::Arc<cudarc::driver::CudaStream>,
    (k, hk): (&[bf16], usize),
    lens: &[i32],
    (seqlen_q, hq, d): (usize, usize, usize),
    seed: u64,
    sinks: Option<&[f32]>,
) -> (Vec<bf16>, Vec<f32>) {
    let batch = lens.len();
    let q: Vec<bf16> = random(
        batch * seqlen_q * hq * d,
        &mut rand::SeedableRng::seed_from_u64(seed),
    );
    let call = Call {
        cfg: AttentionConfig::new().causal(true),
        q: &q,
        q_shape: [batch, seqlen_q, hq, d],
        kv: (k, k),
        cache: [k.len() / (SEQLEN_CACHE * hk * d), SEQLEN_CACHE, hk, d],
        dv: d,
        table: None,
        entries: None,
        lens,
        sinks,
        num_splits: 0,
    };
    let (out, lse, _) = launch(dev, stream, &call).unwrap();
    (out, lse)
}

/// The device keeps its offset arrays after a shape's first call: later calls on another stream
/// (ordered after the upload by cudarc), calls of a smaller batch (a prefix of the array) and of
/// a larger one (a longer array beside it) give the bits of the same sequences' first call.
#[test]
#[ignore = "needs a GPU"]
fn kept_offsets_serve_later_calls_on_other_streams() {
    let (dev, first) = device();
    let (hq, hk, d, entries) = (4, 2, 64, 3);
    let mut rng = rand::SeedableRng::seed_from_u64(40);
    let k: Vec<bf16> = random(entries * SEQLEN_CACHE * hk * d, &mut rng);
    let lens = [120, 300, 7];
    let call = |stream, lens: &[i32], seqlen_q| {
        dense_call(&dev, stream, (&k, hk), lens, (seqlen_q, hq, d), 41, None)
    };
    let once = call(&first, &lens[..2], 1);
    let chunk = call(&first, &lens[..2], 4);
    let second = dev.new_stream().unwrap();
    assert_eq!(
        call(&second, &lens[..2], 4),
        chunk,
        "a 4-query chunk again, on another stream"
    );
    assert_eq!(
        call(&second, &lens[..2], 1),
        once,
        "decoding again, on another stream"
    );
    // Three sequences (a longer array) then one (a prefix); the queries of the first sequences
    // are the same draws.
    let three = call(&second, &lens, 1);
    assert_eq!(
        three.0[..2 * hq * d],
        once.0[..],
        "the first two of three, O"
    );
    assert_eq!(three.1[..2 * hq], once.1[..], "the first two of three, LSE");
    let one = call(&first, &lens[..1], 1);
    assert_eq!(one.0[..], once.0[..hq * d], "the first alone, O");
    assert_eq!(one.1[..], once.1[..hq], "the first alone, LSE");
    assert!(once.0.iter().all(|x| x.is_finite()), "O");
}

/// Sinks over the LSE by sequence: each row's LSE with sinks is log(e^sink + e^LSE) of the call
/// without and its O that call's times e^(LSE − LSE with sinks) (two bf16 roundings apart), and
/// a sequence without keys gets its head's sink and O 0.
#[test]
#[ignore = "needs a GPU"]
fn sinks_rescale_each_sequence_by_its_heads() {
    let (dev, stream) = device();
    let (hq, hk, d, entries, seqlen_q) = (4, 2, 64, 3, 2);
    let mut rng = rand::SeedableRng::seed_from_u64(42);
    let k: Vec<bf16> = random(entries * SEQLEN_CACHE * hk * d, &mut rng);
    let sinks: Vec<f32> = (0..hq).map(|h| h as f32 - 1.5).collect();
    let lens = [0, 120, 300];
    let dims = (seqlen_q, hq, d);
    let (o_plain, plain) = dense_call(&dev, &stream, (&k, hk), &lens, dims, 43, None);
    let (o_with, with) = dense_call(&dev, &stream, (&k, hk), &lens, dims, 43, Some(&sinks));
    for (b, &len) in lens.iter().enumerate() {
        for (h, &sink) in sinks.iter().enumerate() {
            for i in 0..seqlen_q {
                let at = (b * hq + h) * seqlen_q + i;
                let want = if len == 0 {
                    sink
                } else {
                    let (s, l) = (sink as f64, plain[at] as f64);
                    (s.max(l) + (-(s - l).abs()).exp().ln_1p()) as f32
                };
                assert!(
                    (with[at] - want).abs() <= 1e-4 * (1.0 + want.abs()),
                    "sequence {b} head {h} row {i}: {} vs {want}",
                    with[at]
                );
                let scale = if len == 0 {
                    0.0
                } else {
                    (plain[at] as f64 - with[at] as f64).exp()
                };
                let o = ((b * seqlen_q + i) * hq + h) * d;
                for j in o..o + d {
                    let (got, want) = (
                        o_with[j].to_f32() as f64,
                        o_plain[j].to_f32() as f64 * scale,
                    );
                    assert!(
                        (got - want).abs() <= 8e-3 * want.abs() + 1e-3,
                        "sequence {b} head {h} row {i}, O[{}]: {got} vs {want}",
                        j - o
                    );
                }
            }
        }
    }
}

/// Pack-GQA and key splits on the Hopper forward: 8 query heads per KV head at d64, d128 and
/// d256 (one Q buffer), decoding and chunks of 3 and 40 queries (packed tiles of 24 and 320
/// rows: several per KV head, paired under a mask), every mask; packing off and on, key splits
/// none, the launcher's, 5, and 256 (more than a sequence's key blocks: as many as those). Each
/// sequence against the reference. Without a left window (whose blocks a row sees none of may
/// differ between the two tilings, and a visit rescales by an exact-or-not 1) every row visits
/// blocks with the same keys either way, and packing alone (no splits) changes no bit.
#[test]
#[ignore = "needs a Hopper GPU"]
fn pack_gqa_and_key_splits_match_the_reference() {
    let failures: Vec<String> = [64, 128, 256].into_iter().flat_map(packed_case).collect();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// One head dim of the pack-GQA and key-split cases: the failures.
fn packed_case(d: usize) -> Vec<String> {
    let (hq, hk, entries) = (16, 2, 5);
    let lens = [0, 1, 257, 300, 130];
    let batch = lens.len();
    let mut rng = rand::SeedableRng::seed_from_u64(44 + d as u64);
    let mut failures = vec![];
    let mut k: Vec<bf16> = random(entries * SEQLEN_CACHE * hk * d, &mut rng);
    let mut v: Vec<bf16> = random(entries * SEQLEN_CACHE * hk * d, &mut rng);
    poison_past_lengths([&mut k, &mut v], &lens, hk * d);
    for seqlen_q in [1, 3, 40] {
        let q: Vec<bf16> = random(batch * seqlen_q * hq * d, &mut rng);
        for cfg in [
            AttentionConfig::new(),
            AttentionConfig::new().causal(true),
            AttentionConfig::new().window(Some(50), Some(0)),
            AttentionConfig::new().causal(true).softcap(20.0),
        ] {
            let mut unpacked = None;
            for (pack_gqa, num_splits) in [
                (PackGqa::Off, 1),
                (PackGqa::On, 1),
                (PackGqa::On, 0),
                (PackGqa::On, 5),
                (PackGqa::Off, 3),
                (PackGqa::On, 256),
            ] {
                let cfg = cfg
                    .clone()
                    .backend(Backend::Sm90)
                    .sm90_schedule(Sm90Schedule {
                        pack_gqa,
                        ..Sm90Schedule::default()
                    });
                let (out, lse, _) = run(
                    &cfg,
                    (&q, &k, &v),
                    (batch, seqlen_q, entries),
                    (hq, hk, d),
                    &lens,
                    num_splits,
                );
                let what = format!("d{d} {cfg:?}, {num_splits} splits");
                if num_splits == 1 && cfg.mask.bounds().0.is_none() {
                    match &unpacked {
                        None => unpacked = Some((out.clone(), lse.clone())),
                        Some((o, l)) => {
                            let same = |a: &[bf16], b: &[bf16]| {
                                a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
                            };
                            let same_lse = |a: &[f32], b: &[f32]| {
                                a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
                            };
                            if !same(&out, o) || !same_lse(&lse, l) {
                                failures.push(format!("{what} ({seqlen_q} queries): packed bits"));
                            }
                        }
                    }
                }
                failures.extend(check_dense_cache(
                    &cfg,
                    &what,
                    Outputs {
                        out: &out,
                        lse: &lse,
                    },
                    &lens,
                    (seqlen_q, hq, hk, d),
                    &q,
                    (&k, &v),
                ));
            }
        }
    }
    failures
}

/// Pack-GQA with key splits over cached key counts out of range (clamped): each sequence's O
/// and LSE those over its clamped count of keys, every access inside the buffers (run under
/// memcheck), and too many splits a typed error.
#[test]
#[ignore = "needs a Hopper GPU"]
fn sanitizer_kvcache_packed_and_split_stay_in_bounds() {
    let (hq, hk, d, entries, batch, seqlen_q) = (8, 2, 64, 3, 3, 3);
    let mut rng = rand::SeedableRng::seed_from_u64(45);
    let q: Vec<bf16> = random(batch * seqlen_q * hq * d, &mut rng);
    let k: Vec<bf16> = random(entries * SEQLEN_CACHE * hk * d, &mut rng);
    let (dev, stream) = device();
    let cfg = AttentionConfig::new()
        .causal(true)
        .sm90_schedule(Sm90Schedule {
            pack_gqa: PackGqa::On,
            ..Sm90Schedule::default()
        });
    let mut call = Call {
        cfg,
        q: &q,
        q_shape: [batch, seqlen_q, hq, d],
        kv: (&k, &k),
        cache: [entries, SEQLEN_CACHE, hk, d],
        dv: d,
        table: None,
        entries: None,
        lens: &[-5, SEQLEN_CACHE as i32 + 1000, i32::MAX],
        sinks: None,
        num_splits: 7,
    };
    let (out, lse, _) = launch(&dev, &stream, &call).unwrap();
    let failures = check_dense_cache(
        &call.cfg,
        "packed, 7 splits, clamped counts",
        Outputs {
            out: &out,
            lse: &lse,
        },
        &[0, SEQLEN_CACHE as i32, SEQLEN_CACHE as i32],
        (seqlen_q, hq, hk, d),
        &q,
        (&k, &k),
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    call.num_splits = 257;
    assert!(
        matches!(
            launch(&dev, &stream, &call),
            Err(flashattn::Error::InvalidConfig(_))
        ),
        "257 splits"
    );
}
