//! KV-cache calls on the CPU backend: each sequence's O and LSE are the dense call's on its Q and
//! its cached keys, bit for bit, whether the cache is dense, dense through `cache_batch_idx`, or
//! paged with shuffled pages (and so the three agree); an e4m3 cache with descales, the f32 call
//! over its dequantized keys; appended keys attended to; the f64
//! reference's rule on one case; inconsistent inputs as typed errors (a refused append writes
//! nothing), and any block table an error or a full answer.

mod harness;

use flashattn::kvcache::{self, KvCache, KvCacheInputs, KvCacheMut};
use flashattn::reference::{self, baseline_forward, compare, reference_forward};
use flashattn::{AttentionConfig, Error, ForwardInputs, TensorMut, TensorRef};
use float8::F8E4M3;
use half::bf16;
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;

use harness::random;

const HQ: usize = 4;
const HK: usize = 2;
const D: usize = 64;
const DV: usize = 32;
/// Keys per sequence the caches hold: 6 pages of 16.
const PAGE: usize = 16;
const PAGES_PER_SEQ: usize = 6;
const CAPACITY: usize = PAGE * PAGES_PER_SEQ;

/// Three sequences' Q and a dense cache of five entries (K and V), N(0, 1) in bf16.
struct Fixture {
    seqlen_q: usize,
    q: Vec<bf16>,
    k: Vec<bf16>,
    v: Vec<bf16>,
}

const BATCH: usize = 3;
const ENTRIES: usize = 5;
/// The paged caches' pages: every entry's, and one spare.
const POOL: usize = ENTRIES * PAGES_PER_SEQ + 1;

impl Fixture {
    fn new(seqlen_q: usize, seed: u64) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        Fixture {
            seqlen_q,
            q: random(BATCH * seqlen_q * HQ * D, &mut rng),
            k: random(ENTRIES * CAPACITY * HK * D, &mut rng),
            v: random(ENTRIES * CAPACITY * HK * DV, &mut rng),
        }
    }
    fn q(&self) -> TensorRef<'_, bf16> {
        TensorRef::contiguous(&self.q, [BATCH, self.seqlen_q, HQ, D])
    }
    fn dense(&self) -> KvCache<'_, bf16> {
        KvCache::dense(
            TensorRef::contiguous(&self.k, [ENTRIES, CAPACITY, HK, D]),
            TensorRef::contiguous(&self.v, [ENTRIES, CAPACITY, HK, DV]),
        )
    }
    /// The first `len` keys of dense entry `e` as a `(1, len, heads, d)` tensor's data.
    fn keys(&self, x: &[bf16], e: usize, len: usize, d: usize) -> Vec<bf16> {
        let entry = CAPACITY * HK * d;
        x[e * entry..e * entry + len * HK * d].to_vec()
    }
    /// The same keys as pages of `PAGE` rows, every page of every entry somewhere in a shuffled
    /// pool (with a spare page of NaN no sequence names), and the table of `entries`'s pages.
    fn paged(&self, entries: &[usize], seed: u64) -> (Vec<bf16>, Vec<bf16>, Vec<i32>) {
        let pages = POOL;
        let mut order: Vec<usize> = (0..pages).collect();
        order.shuffle(&mut StdRng::seed_from_u64(seed));
        let pool = |x: &[bf16], d: usize| {
            let page = PAGE * HK * d;
            let mut out = vec![bf16::NAN; pages * page];
            for (src, &dst) in order.iter().enumerate().take(pages - 1) {
                out[dst * page..(dst + 1) * page].copy_from_slice(&x[src * page..(src + 1) * page]);
            }
            out
        };
        let table = entries
            .iter()
            .flat_map(|&e| (0..PAGES_PER_SEQ).map(move |i| e * PAGES_PER_SEQ + i))
            .map(|src| order[src] as i32)
            .collect();
        (pool(&self.k, D), pool(&self.v, DV), table)
    }
}

/// A dense cache of the fixture's shape over `k` and `v`, to append to.
fn dense_mut<'x, C>(k: &'x mut [C], v: &'x mut [C]) -> KvCacheMut<'x, C> {
    KvCacheMut::Dense {
        k: TensorMut::contiguous(k, [ENTRIES, CAPACITY, HK, D]),
        v: TensorMut::contiguous(v, [ENTRIES, CAPACITY, HK, DV]),
    }
}

fn configs() -> Vec<AttentionConfig> {
    vec![
        AttentionConfig::new(),
        AttentionConfig::new().causal(true),
        AttentionConfig::new().window(Some(20), Some(0)),
        AttentionConfig::new().causal(true).softcap(5.0),
    ]
}

fn bits(x: &[bf16]) -> Vec<u16> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Each sequence of `got` (O and the LSE by sequence) against the dense call on its Q and the first
/// `lens[b]` keys of entry `entries[b]`, bit for bit; a sequence without keys: O = 0, LSE = +inf.
fn check_per_sequence(
    fx: &Fixture,
    cfg: &AttentionConfig,
    entries: &[usize],
    lens: &[i32],
    got: &flashattn::ForwardOutput<bf16>,
) {
    let sq = fx.seqlen_q;
    for b in 0..BATCH {
        let o = &got.out[b * sq * HQ * DV..(b + 1) * sq * HQ * DV];
        // (batch, heads_q, seqlen_q)
        let lse = |h: usize| &got.lse[(b * HQ + h) * sq..(b * HQ + h + 1) * sq];
        let len = lens[b] as usize;
        if len == 0 {
            assert!(o.iter().all(|x| x.to_f32() == 0.0), "sequence {b}: O");
            assert!((0..HQ).all(|h| lse(h).iter().all(|&l| l == f32::INFINITY)));
            continue;
        }
        let (k, v) = (
            fx.keys(&fx.k, entries[b], len, D),
            fx.keys(&fx.v, entries[b], len, DV),
        );
        let q = &fx.q[b * sq * HQ * D..(b + 1) * sq * HQ * D];
        let dense = flashattn::forward(
            cfg,
            ForwardInputs::new(
                TensorRef::contiguous(q, [1, sq, HQ, D]),
                TensorRef::contiguous(&k, [1, len, HK, D]),
                TensorRef::contiguous(&v, [1, len, HK, DV]),
            ),
        )
        .unwrap();
        assert_eq!(bits(o), bits(&dense.out), "sequence {b} O ({cfg:?})");
        for h in 0..HQ {
            let want = &dense.lse[h * sq..(h + 1) * sq];
            assert!(
                lse(h)
                    .iter()
                    .zip(want)
                    .all(|(a, w)| a.to_bits() == w.to_bits()),
                "sequence {b} LSE ({cfg:?})"
            );
        }
    }
}

#[test]
fn every_cache_layout_matches_the_dense_call_per_sequence() {
    // Empty, a page and a bit, full, and fewer keys than queries; decoding (1 query) and chunks
    // of 5.
    let full = CAPACITY as i32;
    for (seqlen_q, seed, lens) in [
        (1, 1, [0, 17, full]),
        (5, 2, [0, 17, full]),
        (5, 3, [3, full, 1]),
    ] {
        let fx = Fixture::new(seqlen_q, seed);
        for cfg in configs() {
            let dense = kvcache::forward(&cfg, KvCacheInputs::new(fx.q(), fx.dense(), &lens))
                .unwrap_or_else(|e| panic!("{cfg:?}: {e}"));
            check_per_sequence(&fx, &cfg, &[0, 1, 2], &lens, &dense);

            let idx = [4, 0, 3];
            let picked = kvcache::forward(
                &cfg,
                KvCacheInputs::new(fx.q(), fx.dense(), &lens).with_cache_batch_idx(&idx),
            )
            .unwrap();
            check_per_sequence(&fx, &cfg, &[4, 0, 3], &lens, &picked);

            let (k, v, table) = fx.paged(&[4, 0, 3], seed + 10);
            let paged = KvCache::paged(
                TensorRef::contiguous(&k, [POOL, PAGE, HK, D]),
                TensorRef::contiguous(&v, [POOL, PAGE, HK, DV]),
                &table,
                PAGES_PER_SEQ,
            );
            let got = kvcache::forward(&cfg, KvCacheInputs::new(fx.q(), paged, &lens)).unwrap();
            assert_eq!(bits(&got.out), bits(&picked.out), "paged O ({cfg:?})");
            assert_eq!(got.lse, picked.lse, "paged LSE ({cfg:?})");
        }
    }
}

/// One paged case against the f64 reference under DESIGN's rule (the dense CPU call's own
/// accuracy is tests/cpu_backend's; this shows the gathered keys are the right ones).
/// With attention sinks each sequence is the dense call with them, bit for bit (the LSE by
/// sequence carries each head's sink), and a call whose sequences have no key gives every row
/// its head's sink as its LSE.
#[test]
fn sinks_join_each_sequence_as_in_its_dense_call() {
    let fx = Fixture::new(3, 17);
    let sinks: Vec<f32> = (0..HQ).map(|h| h as f32 * 0.7 - 1.0).collect();
    let lens = [0, 40, CAPACITY as i32];
    let cfg = AttentionConfig::new().causal(true);
    let got = kvcache::forward(
        &cfg,
        KvCacheInputs::new(fx.q(), fx.dense(), &lens).with_sinks(&sinks),
    )
    .unwrap();
    let sq = fx.seqlen_q;
    for (b, &len) in lens.iter().enumerate() {
        let lse = &got.lse[b * HQ * sq..(b + 1) * HQ * sq];
        if len == 0 {
            let want: Vec<f32> = sinks.iter().flat_map(|&s| vec![s; sq]).collect();
            assert_eq!(lse, &want[..], "sequence {b}: the sinks alone");
            continue;
        }
        let len = len as usize;
        let (k, v) = (fx.keys(&fx.k, b, len, D), fx.keys(&fx.v, b, len, DV));
        let q = &fx.q[b * sq * HQ * D..(b + 1) * sq * HQ * D];
        let dense = flashattn::forward(
            &cfg,
            ForwardInputs {
                sinks: Some(&sinks),
                ..ForwardInputs::new(
                    TensorRef::contiguous(q, [1, sq, HQ, D]),
                    TensorRef::contiguous(&k, [1, len, HK, D]),
                    TensorRef::contiguous(&v, [1, len, HK, DV]),
                )
            },
        )
        .unwrap();
        let o = &got.out[b * sq * HQ * DV..(b + 1) * sq * HQ * DV];
        assert_eq!(bits(o), bits(&dense.out), "sequence {b} O");
        assert_eq!(lse, &dense.lse[..], "sequence {b} LSE");
    }
    let none = kvcache::forward(
        &cfg,
        KvCacheInputs::new(fx.q(), fx.dense(), &[0, 0, 0]).with_sinks(&sinks),
    )
    .unwrap();
    let want: Vec<f32> = (0..BATCH)
        .flat_map(|_| sinks.iter().flat_map(|&s| vec![s; sq]))
        .collect();
    assert_eq!(none.lse, want, "no keys anywhere");
}

#[test]
fn paged_decode_holds_the_reference_rule() {
    let fx = Fixture::new(3, 7);
    let lens = [40, 96, 1];
    let (k, v, table) = fx.paged(&[2, 1, 0], 8);
    let pages = POOL;
    let cfg = AttentionConfig::new().causal(true);
    let cache = KvCache::paged(
        TensorRef::contiguous(&k, [pages, PAGE, HK, D]),
        TensorRef::contiguous(&v, [pages, PAGE, HK, DV]),
        &table,
        PAGES_PER_SEQ,
    );
    let got = kvcache::forward(&cfg, KvCacheInputs::new(fx.q(), cache, &lens)).unwrap();
    let sq = fx.seqlen_q;
    for (b, &e) in [2usize, 1, 0].iter().enumerate() {
        let len = lens[b] as usize;
        let (kb, vb) = (fx.keys(&fx.k, e, len, D), fx.keys(&fx.v, e, len, DV));
        let q = TensorRef::contiguous(
            &fx.q[b * sq * HQ * D..(b + 1) * sq * HQ * D],
            [1, sq, HQ, D],
        );
        let (kt, vt) = (
            TensorRef::contiguous(&kb, [1, len, HK, D]),
            TensorRef::contiguous(&vb, [1, len, HK, DV]),
        );
        let want = reference_forward(&cfg, q, kt, vt);
        let base = baseline_forward(&cfg, q, kt, vt);
        let o = reference::to_f32(&got.out[b * sq * HQ * DV..(b + 1) * sq * HQ * DV]);
        let c = compare(&o, &want.out, &base.out);
        assert!(c.pass, "sequence {b}: {c:?}");
    }
}

/// The fixture's bf16 values stored as e4m3 (times 64: N(0, 1) values well inside its range).
fn e4m3(x: &[bf16]) -> Vec<F8E4M3> {
    x.iter()
        .map(|v| flashattn::fp8::quantize(v.to_f32(), 1.0 / 64.0))
        .collect()
}

/// Descales of (sequence, KV head) pairs: distinct per pair, about the 1/64 the values were
/// stored at.
fn descales(seed: f32) -> Vec<f32> {
    (0..BATCH * HK)
        .map(|i| (1.0 + seed * i as f32) / 64.0)
        .collect()
}

/// Sequence `b`'s O and LSE in `got` against the f32 dense call on its Q (widened) and the first
/// `len` rows of `k` and `v` (already dequantized, `(1, len, HK, d)` each), O rounded to bf16:
/// bit for bit.
fn check_f32_sequence(
    fx: &Fixture,
    cfg: &AttentionConfig,
    b: usize,
    (k, v): (&[f32], &[f32]),
    got: &flashattn::ForwardOutput<bf16>,
    what: &str,
) {
    let sq = fx.seqlen_q;
    let len = k.len() / (HK * D);
    let q: Vec<f32> = fx.q[b * sq * HQ * D..(b + 1) * sq * HQ * D]
        .iter()
        .map(|x| x.to_f32())
        .collect();
    let dense = flashattn::forward(
        cfg,
        ForwardInputs::new(
            TensorRef::contiguous(&q, [1, sq, HQ, D]),
            TensorRef::contiguous(k, [1, len, HK, D]),
            TensorRef::contiguous(v, [1, len, HK, DV]),
        ),
    )
    .unwrap();
    let want: Vec<bf16> = dense.out.iter().map(|&x| bf16::from_f32(x)).collect();
    let o = &got.out[b * sq * HQ * DV..(b + 1) * sq * HQ * DV];
    assert_eq!(bits(o), bits(&want), "{what}: sequence {b} O ({cfg:?})");
    let lse = &got.lse[b * HQ * sq..(b + 1) * HQ * sq];
    assert_eq!(lse, &dense.lse[..], "{what}: sequence {b} LSE ({cfg:?})");
}

/// The first `len` keys of dense entry `e` of an e4m3 cache, each head's times its descale of
/// sequence `b` (none: 1).
fn dequantized(
    x: &[F8E4M3],
    e: usize,
    len: usize,
    d: usize,
    s: Option<&[f32]>,
    b: usize,
) -> Vec<f32> {
    x[e * CAPACITY * HK * d..][..len * HK * d]
        .iter()
        .enumerate()
        .map(|(i, v)| v.to_f32() * s.map_or(1.0, |s| s[b * HK + i / d % HK]))
        .collect()
}

/// An e4m3 cache with descales (one per sequence and KV head, by sequence also through
/// `cache_batch_idx`) is the f32 call over Q and its dequantized keys and values, O rounded to
/// bf16 once, bit for bit: dense, through `cache_batch_idx`, and paged (which then agree); an
/// e4m3 cache without descales is the call over its values as they are; descales over a bf16
/// cache scale it alike.
#[test]
fn an_fp8_cache_is_the_call_over_its_dequantized_keys() {
    let fx = Fixture::new(3, 23);
    let lens = [0, 41, CAPACITY as i32];
    let (k8, v8) = (e4m3(&fx.k), e4m3(&fx.v));
    let (kd, vd) = (descales(0.25), descales(-0.1));
    let cache = KvCache::dense(
        TensorRef::contiguous(&k8, [ENTRIES, CAPACITY, HK, D]),
        TensorRef::contiguous(&v8, [ENTRIES, CAPACITY, HK, DV]),
    );
    for cfg in configs() {
        let entries = [4usize, 0, 3];
        let idx = entries.map(|e| e as i32);
        let picked = kvcache::forward(
            &cfg,
            KvCacheInputs::new(fx.q(), cache, &lens)
                .with_cache_batch_idx(&idx)
                .with_descales(&kd, &vd),
        )
        .unwrap_or_else(|e| panic!("{cfg:?}: {e}"));
        let plain = kvcache::forward(&cfg, KvCacheInputs::new(fx.q(), cache, &lens)).unwrap();
        for (b, &len) in lens.iter().enumerate().skip(1) {
            let len = len as usize;
            let (e, s) = (entries[b], Some((&kd[..], &vd[..])));
            let (k, v) = (
                dequantized(&k8, e, len, D, s.map(|s| s.0), b),
                dequantized(&v8, e, len, DV, s.map(|s| s.1), b),
            );
            check_f32_sequence(&fx, &cfg, b, (&k, &v), &picked, "descaled");
            let (k, v) = (
                dequantized(&k8, b, len, D, None, b),
                dequantized(&v8, b, len, DV, None, b),
            );
            check_f32_sequence(&fx, &cfg, b, (&k, &v), &plain, "no descales");
        }
        let sq = fx.seqlen_q;
        assert!(picked.out[..sq * HQ * DV].iter().all(|x| x.to_f32() == 0.0));
        assert!(picked.lse[..HQ * sq].iter().all(|&l| l == f32::INFINITY));

        // The same entries' pages, shuffled, as an e4m3 pool.
        let (k, v, table) = fx.paged(&entries, 24);
        let (pk, pv) = (e4m3(&k), e4m3(&v));
        let paged = KvCache::paged(
            TensorRef::contiguous(&pk, [POOL, PAGE, HK, D]),
            TensorRef::contiguous(&pv, [POOL, PAGE, HK, DV]),
            &table,
            PAGES_PER_SEQ,
        );
        let got = kvcache::forward(
            &cfg,
            KvCacheInputs::new(fx.q(), paged, &lens).with_descales(&kd, &vd),
        )
        .unwrap();
        assert_eq!(bits(&got.out), bits(&picked.out), "paged O ({cfg:?})");
        assert_eq!(got.lse, picked.lse, "paged LSE ({cfg:?})");

        // Descales over the bf16 cache.
        let scaled = kvcache::forward(
            &cfg,
            KvCacheInputs::new(fx.q(), fx.dense(), &lens).with_descales(&kd, &vd),
        )
        .unwrap();
        for (b, &len) in lens.iter().enumerate().skip(1) {
            let len = len as usize;
            let widened = |x: &[bf16], d: usize, s: &[f32]| {
                fx.keys(x, b, len, d)
                    .iter()
                    .enumerate()
                    .map(|(i, v)| v.to_f32() * s[b * HK + i / d % HK])
                    .collect::<Vec<f32>>()
            };
            let (k, v) = (widened(&fx.k, D, &kd), widened(&fx.v, DV, &vd));
            check_f32_sequence(&fx, &cfg, b, (&k, &v), &scaled, "bf16 descaled");
        }
    }
}

/// Descales of the wrong length or not finite, and a cache of another 16-bit type than Q's: typed
/// errors; zero and negative descales are numbers like any other.
#[test]
fn bad_descales_and_cache_types_are_typed_errors() {
    let fx = Fixture::new(1, 5);
    let cfg = AttentionConfig::new().causal(true);
    let lens = [5, 5, 5];
    let (k8, v8) = (e4m3(&fx.k), e4m3(&fx.v));
    let cache = KvCache::dense(
        TensorRef::contiguous(&k8, [ENTRIES, CAPACITY, HK, D]),
        TensorRef::contiguous(&v8, [ENTRIES, CAPACITY, HK, DV]),
    );
    let good = descales(0.5);
    let mut odd = good.clone();
    (odd[0], odd[1]) = (0.0, -2.0);
    let got = kvcache::forward(
        &cfg,
        KvCacheInputs::new(fx.q(), cache, &lens).with_descales(&odd, &good),
    )
    .unwrap();
    // Sequence 0's K descales are 0 (scores all 0) and −2 (scores negated and doubled).
    let (k, v) = (
        dequantized(&k8, 0, 5, D, Some(&odd), 0),
        dequantized(&v8, 0, 5, DV, Some(&good), 0),
    );
    check_f32_sequence(&fx, &cfg, 0, (&k, &v), &got, "zero and negative descales");
    let mut nan = good.clone();
    nan[3] = f32::NAN;
    let mut inf = good.clone();
    inf[0] = f32::INFINITY;
    for (k, v) in [
        (&good[1..], &good[..]),
        (&good[..], &good[..good.len() - 1]),
        (&nan[..], &good[..]),
        (&good[..], &inf[..]),
    ] {
        let e = kvcache::forward(
            &cfg,
            KvCacheInputs::new(fx.q(), cache, &lens).with_descales(k, v),
        )
        .unwrap_err();
        assert!(matches!(e, Error::InvalidConfig(_)), "{e:?}");
    }
    let (k16, v16): (Vec<half::f16>, Vec<half::f16>) = (
        fx.k.iter()
            .map(|x| half::f16::from_f32(x.to_f32()))
            .collect(),
        fx.v.iter()
            .map(|x| half::f16::from_f32(x.to_f32()))
            .collect(),
    );
    let f16_cache = KvCache::dense(
        TensorRef::contiguous(&k16, [ENTRIES, CAPACITY, HK, D]),
        TensorRef::contiguous(&v16, [ENTRIES, CAPACITY, HK, DV]),
    );
    let e = kvcache::forward(&cfg, KvCacheInputs::new(fx.q(), f16_cache, &lens)).unwrap_err();
    assert!(matches!(e, Error::Unsupported { .. }), "{e:?}");
}

/// New rows appended into an e4m3 cache are stored as `fp8::quantize` by their sequence's
/// descale of their KV head, at the rows `cache_seqlens` and the cache's layout (through
/// `cache_batch_idx`, and paged) give them, every other byte untouched. Descales that are not
/// finite and positive, or of the wrong length, are typed errors that write nothing.
#[test]
fn an_fp8_append_stores_each_row_by_its_descale() {
    let fx = Fixture::new(2, 31);
    let (seqlen_new, lens) = (3, [0, 17, CAPACITY as i32 - 3]);
    let mut rng = StdRng::seed_from_u64(32);
    let k_new: Vec<bf16> = random(BATCH * seqlen_new * HK * D, &mut rng);
    let v_new: Vec<bf16> = random(BATCH * seqlen_new * HK * DV, &mut rng);
    let (kn, vn) = (
        TensorRef::contiguous(&k_new, [BATCH, seqlen_new, HK, D]),
        TensorRef::contiguous(&v_new, [BATCH, seqlen_new, HK, DV]),
    );
    let (kd, vd) = (descales(0.3), descales(0.05));
    let (k8, v8) = (e4m3(&fx.k), e4m3(&fx.v));
    let entries = [4usize, 0, 3];
    let idx = entries.map(|e| e as i32);
    let (mut k, mut v) = (k8.clone(), v8.clone());
    let mut cache = dense_mut(&mut k, &mut v);
    let descaled = kvcache::CacheDescales { k: &kd, v: &vd };
    kvcache::append_fp8(&mut cache, kn, vn, &lens, Some(&idx), descaled).unwrap();
    // The expected cache: the new rows quantized into their entries' rows.
    let (mut want_k, mut want_v) = (k8.clone(), v8.clone());
    for b in 0..BATCH {
        for i in 0..seqlen_new {
            let row = lens[b] as usize + i;
            for h in 0..HK {
                for (want, new, d, s) in [
                    (&mut want_k, &k_new, D, &kd),
                    (&mut want_v, &v_new, DV, &vd),
                ] {
                    let dst = ((entries[b] * CAPACITY + row) * HK + h) * d;
                    let src = ((b * seqlen_new + i) * HK + h) * d;
                    for j in 0..d {
                        want[dst + j] =
                            flashattn::fp8::quantize(new[src + j].to_f32(), s[b * HK + h]);
                    }
                }
            }
        }
    }
    let raw = |x: &[F8E4M3]| x.iter().map(|v| v.to_bits()).collect::<Vec<u8>>();
    assert_eq!(raw(&k), raw(&want_k), "K");
    assert_eq!(raw(&v), raw(&want_v), "V");
    // Paged: the same rows through a shuffled pool, byte for byte where the table puts them.
    let (pk, pv, table) = fx.paged(&entries, 33);
    let (mut pk, mut pv) = (e4m3(&pk), e4m3(&pv));
    let before = (raw(&pk), raw(&pv));
    let mut paged = KvCacheMut::Paged {
        k: TensorMut::contiguous(&mut pk, [POOL, PAGE, HK, D]),
        v: TensorMut::contiguous(&mut pv, [POOL, PAGE, HK, DV]),
        block_table: &table,
        max_pages: PAGES_PER_SEQ,
    };
    kvcache::append_fp8(&mut paged, kn, vn, &lens, None, descaled).unwrap();
    // Each appended row where the table puts it, and no other byte changed.
    for (pool, before, want, d) in [(&pk, &before.0, &want_k, D), (&pv, &before.1, &want_v, DV)] {
        let mut expected = before.clone();
        for b in 0..BATCH {
            for i in 0..seqlen_new {
                let row = lens[b] as usize + i;
                let page = table[b * PAGES_PER_SEQ + row / PAGE] as usize;
                let at = (page * PAGE + row % PAGE) * HK * d;
                let from = (entries[b] * CAPACITY + row) * HK * d;
                expected[at..at + HK * d].copy_from_slice(&raw(&want[from..from + HK * d]));
            }
        }
        assert_eq!(raw(pool), expected, "paged, head dim {d}");
    }

    // Refusals write nothing.
    let mut zero = kd.clone();
    zero[1] = 0.0;
    let mut subnormal = vd.clone();
    subnormal[2] = 1e-40;
    let mut nan = kd.clone();
    nan[0] = f32::NAN;
    let snapshot = (raw(&k), raw(&v));
    for (bad_k, bad_v) in [
        (&zero[..], &vd[..]),
        (&kd[..], &nan[..]),
        (&kd[..], &subnormal[..]),
        (&kd[1..], &vd[..]),
        (&kd[..], &vd[..vd.len() - 1]),
    ] {
        let mut cache = dense_mut(&mut k, &mut v);
        let bad = kvcache::CacheDescales { k: bad_k, v: bad_v };
        let e = kvcache::append_fp8(&mut cache, kn, vn, &lens, Some(&idx), bad).unwrap_err();
        assert!(matches!(e, Error::InvalidConfig(_)), "{e:?}");
    }
    assert_eq!(
        (raw(&k), raw(&v)),
        snapshot,
        "a refused append writes nothing"
    );
}

#[test]
fn inconsistent_inputs_are_typed_errors() {
    let fx = Fixture::new(1, 3);
    let cfg = AttentionConfig::new().causal(true);
    let run = |inputs: KvCacheInputs<'_, bf16>| kvcache::forward(&cfg, inputs).unwrap_err();
    let full = CAPACITY as i32;
    for lens in [&[1, 2, full + 1][..], &[1, -1, 2], &[1, 2]] {
        let e = run(KvCacheInputs::new(fx.q(), fx.dense(), lens));
        assert!(matches!(e, Error::InvalidSeqlens(_)), "{lens:?}: {e:?}");
    }
    let lens = [5, 5, 5];
    // Entries out of range are the dense cache's table's (as the device names them); a count
    // of them other than the sequences' is about the sequences.
    for idx in [&[0, 5, 1][..], &[0, -1, 1]] {
        let e = run(KvCacheInputs::new(fx.q(), fx.dense(), &lens).with_cache_batch_idx(idx));
        assert!(matches!(e, Error::InvalidPageTable(_)), "{idx:?}: {e:?}");
    }
    let e = run(KvCacheInputs::new(fx.q(), fx.dense(), &lens).with_cache_batch_idx(&[0, 1]));
    assert!(matches!(e, Error::InvalidSeqlens(_)), "{e:?}");
    // V's entries or keys apart from K's.
    let v = TensorRef::contiguous(&fx.v[..4 * CAPACITY * HK * DV], [4, CAPACITY, HK, DV]);
    let k = TensorRef::contiguous(&fx.k, [ENTRIES, CAPACITY, HK, D]);
    let e = run(KvCacheInputs::new(fx.q(), KvCache::dense(k, v), &lens));
    assert!(matches!(e, Error::ShapeMismatch { .. }), "{e:?}");
    // Fewer dense entries than sequences, without cache_batch_idx.
    let (k2, v2) = (
        TensorRef::contiguous(&fx.k[..2 * CAPACITY * HK * D], [2, CAPACITY, HK, D]),
        TensorRef::contiguous(&fx.v[..2 * CAPACITY * HK * DV], [2, CAPACITY, HK, DV]),
    );
    let e = run(KvCacheInputs::new(fx.q(), KvCache::dense(k2, v2), &lens));
    assert!(matches!(e, Error::ShapeMismatch { .. }), "{e:?}");

    let (pk, pv, table) = fx.paged(&[0, 1, 2], 4);
    let pages = POOL;
    let (pk, pv) = (
        TensorRef::contiguous(&pk, [pages, PAGE, HK, D]),
        TensorRef::contiguous(&pv, [pages, PAGE, HK, DV]),
    );
    let paged = |t: &'static [i32]| KvCache::paged(pk, pv, t, PAGES_PER_SEQ);
    // A table of the wrong length, and a used page outside the pool.
    let short: &'static [i32] = Box::leak(table[1..].to_vec().into_boxed_slice());
    let e = run(KvCacheInputs::new(fx.q(), paged(short), &lens));
    assert!(matches!(e, Error::InvalidPageTable(_)), "{e:?}");
    let mut bad = table.clone();
    bad[PAGES_PER_SEQ] = pages as i32; // sequence 1's first page
    let bad: &'static [i32] = Box::leak(bad.into_boxed_slice());
    let e = run(KvCacheInputs::new(fx.q(), paged(bad), &lens));
    assert!(matches!(e, Error::InvalidPageTable(_)), "{e:?}");
    // A page past a sequence's cached keys is never read: any value is accepted.
    let mut unused = table.clone();
    unused[PAGES_PER_SEQ + 3] = -7;
    let unused: &'static [i32] = Box::leak(unused.into_boxed_slice());
    kvcache::forward(&cfg, KvCacheInputs::new(fx.q(), paged(unused), &lens)).unwrap();
    // No page per sequence, a table of another length, and more pages than a size can count:
    // each an error about the table, before its pages are counted.
    for (t, max_pages) in [
        (&table[..0], 0),
        (&table[..5], PAGES_PER_SEQ),
        (&table[..3], usize::MAX / 2),
    ] {
        let t: &'static [i32] = Box::leak(t.to_vec().into_boxed_slice());
        let e = run(KvCacheInputs::new(
            fx.q(),
            KvCache::paged(pk, pv, t, max_pages),
            &lens,
        ));
        assert!(
            matches!(e, Error::InvalidPageTable(_) | Error::IndexOverflow { .. }),
            "max_pages {max_pages}: {e:?}"
        );
    }
    // cache_batch_idx beside a block table.
    let table: &'static [i32] = Box::leak(table.into_boxed_slice());
    let e = run(KvCacheInputs::new(fx.q(), paged(table), &lens).with_cache_batch_idx(&[0, 1, 2]));
    assert!(matches!(e, Error::InvalidPageTable(_)), "{e:?}");
}

/// A kind of refusal: the error a call gives for one kind of bad input.
#[derive(Debug, PartialEq)]
enum Refusal {
    Seqlens,
    PageTable,
    Config,
}

/// What a call over a paged cache must refuse, by the kind of error (several where its input is
/// wrong in several ways; none where it must succeed): cached counts outside
/// `0..=capacity − extra` (`extra` the rows an append adds), pages a sequence uses (those of its
/// first `len + extra` rows) outside the pool of `pages`, and what `also` adds.
fn paged_refusals(
    (table, max_pages, page_size, pages): (&[i32], usize, usize, usize),
    lens: &[i32],
    extra: usize,
    also: Option<Refusal>,
) -> Vec<Refusal> {
    let capacity = max_pages * page_size;
    let mut refusals = vec![];
    if lens.iter().any(|&l| l < 0 || l as usize + extra > capacity) {
        refusals.push(Refusal::Seqlens);
    }
    let page_out = lens.iter().enumerate().any(|(b, &l)| {
        let used = (l.max(0) as usize + extra)
            .div_ceil(page_size)
            .min(max_pages);
        table[b * max_pages..][..used]
            .iter()
            .any(|&p| p < 0 || p as usize >= pages)
    });
    if page_out {
        refusals.push(Refusal::PageTable);
    }
    refusals.extend(also);
    refusals
}

/// `result` is what `refusals` says: success where it is empty, else an error of one of its
/// kinds.
fn check_refusals<T>(result: &Result<T, Error>, refusals: &[Refusal]) -> Result<(), TestCaseError> {
    let as_expected = match result {
        Ok(_) => refusals.is_empty(),
        Err(e) => {
            let kind = match e {
                Error::InvalidSeqlens(_) => Some(Refusal::Seqlens),
                Error::InvalidPageTable(_) => Some(Refusal::PageTable),
                Error::InvalidConfig(_) => Some(Refusal::Config),
                _ => None,
            };
            kind.is_some_and(|k| refusals.contains(&k))
        }
    };
    if as_expected {
        return Ok(());
    }
    let got = result.as_ref().map(|_| "accepted");
    Err(TestCaseError::fail(format!(
        "{got:?}; expected {refusals:?}"
    )))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]
    /// Any page numbers and cache lengths: a typed error, or each sequence's O and LSE those of
    /// the dense call over the keys its pages hold, bit for bit; never a panic.
    #[test]
    fn any_block_table_gives_an_error_or_the_dense_answer(
        table in prop::collection::vec(-2i32..12, 6),
        lens in prop::collection::vec(-3i32..40, 2),
        max_pages in 1usize..=3,
        page_size in 1usize..9,
    ) {
        // Ten pages of distinct keys; a table row of max_pages entries per sequence.
        let (pages, heads, d) = (10, 2, 8);
        let page = page_size * heads * d;
        let k: Vec<f32> = (0..pages * page).map(|i| (i as f32 * 0.37).sin()).collect();
        let q: Vec<f32> = (0..2 * heads * d).map(|i| (i as f32 * 0.21).cos()).collect();
        let table = &table[..2 * max_pages];
        let kt = TensorRef::contiguous(&k, [pages, page_size, heads, d]);
        let cache = KvCache::paged(kt, kt, table, max_pages);
        let cfg = AttentionConfig::new().causal(true);
        let inputs = KvCacheInputs::new(TensorRef::contiguous(&q, [2, 1, heads, d]), cache, &lens);
        let result = kvcache::forward(&cfg, inputs);
        check_refusals(&result, &paged_refusals((table, max_pages, page_size, pages), &lens, 0, None))?;
        if let Ok(f) = result {
                for (b, &len) in lens.iter().enumerate() {
                    let len = len as usize;
                    let keys: Vec<f32> = (0..len)
                        .flat_map(|j| {
                            let p = table[b * max_pages + j / page_size] as usize;
                            let at = (p * page_size + j % page_size) * heads * d;
                            k[at..at + heads * d].to_vec()
                        })
                        .collect();
                    let lse = [f.lse[2 * b], f.lse[2 * b + 1]];
                    if len == 0 {
                        prop_assert!(lse.iter().all(|&l| l == f32::INFINITY));
                        continue;
                    }
                    let kb = TensorRef::contiguous(&keys, [1, len, heads, d]);
                    let qb = TensorRef::contiguous(&q[b * heads * d..(b + 1) * heads * d], [1, 1, heads, d]);
                    let want = flashattn::forward(&cfg, ForwardInputs::new(qb, kb, kb)).unwrap();
                    prop_assert_eq!(&f.out[b * heads * d..(b + 1) * heads * d], &want.out[..]);
                    prop_assert_eq!(&lse[..], &want.lse[..]);
                    prop_assert!(f.out[b * heads * d..(b + 1) * heads * d].iter().all(|x| x.is_finite()));
                }
        }
    }

    /// Any descales (of any length and value) and page numbers over an e4m3 cache, forward and
    /// append: a typed error, or the f32 call over the dequantized keys bit for bit (forward) and
    /// rows stored at their pages (append); never a panic.
    #[test]
    fn any_fp8_descales_give_an_error_or_the_dequantized_answer(
        table in prop::collection::vec(prop_oneof![8 => 0i32..10, 1 => -2i32..12], 4),
        lens in prop::collection::vec(0i32..12, 2),
        k_descale in prop::collection::vec(
            prop_oneof![
                8 => 0.01f32..2.0,
                1 => -2.0f32..0.0,
                1 => Just(0.0),
                1 => Just(f32::NAN),
                1 => Just(f32::INFINITY),
                1 => Just(1e-40),
            ],
            4,
        ),
        k_descales in prop_oneof![6 => Just(4usize), 1 => Just(3usize), 1 => Just(5usize)],
        v_descale in prop::collection::vec(0.01f32..2.0, 4),
        page_size in 1usize..7,
    ) {
        // k_descales values of k_descale's (a fifth one a copy): the right count or not.
        let k_descale: Vec<f32> = k_descale.iter().cycle().take(k_descales).copied().collect();
        // Ten pages of distinct e4m3 keys (V the same bytes), 2 sequences of 2 pages, 2 KV heads.
        let (pages, heads, d, max_pages) = (10, 2, 8, 2);
        let page = page_size * heads * d;
        let mut k: Vec<F8E4M3> = (0..pages * page)
            .map(|i| F8E4M3::from_f32((i as f32 * 0.37).sin() * 3.0))
            .collect();
        let q: Vec<f32> = (0..2 * heads * d).map(|i| (i as f32 * 0.21).cos()).collect();
        let cfg = AttentionConfig::new().causal(true);
        let result = {
            let kt = TensorRef::contiguous(&k, [pages, page_size, heads, d]);
            let cache = KvCache::paged(kt, kt, &table, max_pages);
            let inputs = KvCacheInputs::new(TensorRef::contiguous(&q, [2, 1, heads, d]), cache, &lens)
                .with_descales(&k_descale, &v_descale);
            kvcache::forward(&cfg, inputs)
        };
        // The forward reads descales of the right count and finite (zero and negative ones
        // included); an append stores by positive normal ones.
        let counts_ok = k_descale.len() == 4;
        let finite = k_descale.iter().chain(&v_descale).all(|x| x.is_finite());
        let positive_normal = k_descale.iter().chain(&v_descale).all(|x| x.is_normal() && *x > 0.0);
        let config = |ok: bool| (!ok).then_some(Refusal::Config);
        let cache_of = (&table[..], max_pages, page_size, pages);
        check_refusals(&result, &paged_refusals(cache_of, &lens, 0, config(counts_ok && finite)))?;
        if let Ok(f) = result {
                for (b, &len) in lens.iter().enumerate().filter(|(_, &l)| l > 0) {
                    let len = len as usize;
                    let dequantized = |s: &[f32]| -> Vec<f32> {
                        (0..len * heads * d)
                            .map(|i| {
                                let (j, h) = (i / (heads * d), i / d % heads);
                                let p = table[b * max_pages + j / page_size] as usize;
                                let at = (p * page_size + j % page_size) * heads * d + i % (heads * d);
                                k[at].to_f32() * s[b * heads + h]
                            })
                            .collect()
                    };
                    let (kb, vb) = (dequantized(&k_descale), dequantized(&v_descale));
                    let qb = TensorRef::contiguous(&q[b * heads * d..(b + 1) * heads * d], [1, 1, heads, d]);
                    let want = flashattn::forward(
                        &cfg,
                        ForwardInputs::new(
                            qb,
                            TensorRef::contiguous(&kb, [1, len, heads, d]),
                            TensorRef::contiguous(&vb, [1, len, heads, d]),
                        ),
                    )
                    .unwrap();
                    let got = &f.out[b * heads * d..(b + 1) * heads * d];
                    prop_assert_eq!(
                        got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                        want.out.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
                    );
                }
        }
        // One new row per sequence appended after its keys, by the same descales.
        let new: Vec<f32> = (0..2 * heads * d).map(|i| (i as f32 * 0.11).sin()).collect();
        let nt = TensorRef::contiguous(&new, [2, 1, heads, d]);
        let before: Vec<u8> = k.iter().map(|x| x.to_bits()).collect();
        let mut v = k.clone();
        let appended = {
            let mut cache = KvCacheMut::Paged {
                k: TensorMut::contiguous(&mut k, [pages, page_size, heads, d]),
                v: TensorMut::contiguous(&mut v, [pages, page_size, heads, d]),
                block_table: &table,
                max_pages,
            };
            let descales = kvcache::CacheDescales { k: &k_descale, v: &v_descale };
            kvcache::append_fp8(&mut cache, nt, nt, &lens, None, descales)
        };
        let refusals = paged_refusals(cache_of, &lens, 1, config(counts_ok && positive_normal));
        check_refusals(&appended, &refusals)?;
        match appended {
            Ok(()) => {
                for (b, &len) in lens.iter().enumerate() {
                    let j = len as usize;
                    let p = table[b * max_pages + j / page_size] as usize;
                    for h in 0..heads {
                        let at = (p * page_size + j % page_size) * heads * d + h * d;
                        let want = |descale: &[f32]| -> Vec<u8> {
                            new[(b * heads + h) * d..][..d]
                                .iter()
                                .map(|&x| flashattn::fp8::quantize(x, descale[b * heads + h]).to_bits())
                                .collect()
                        };
                        let stored = |c: &[F8E4M3]| c[at..at + d].iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        // The two sequences may share a page: the later one's row wins there.
                        let shared = b == 0 && table[max_pages + (lens[1] as usize) / page_size] as usize == p
                            && (lens[1] as usize) % page_size == j % page_size;
                        if !shared {
                            prop_assert_eq!(stored(&k), want(&k_descale));
                            prop_assert_eq!(stored(&v), want(&v_descale));
                        }
                    }
                }
            }
            Err(_) => {
                prop_assert_eq!(&k.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), &before);
                prop_assert_eq!(&v.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), &before);
            }
        }
    }
}

/// `append` writes each sequence's new keys after its cached ones, in a dense cache (through
/// `cache_batch_idx`) and in a paged one: attending over `cache_seqlens + seqlen_new` keys then
/// gives the bits of the dense call over a cache the test wrote by hand.
#[test]
fn appended_keys_are_attended_to() {
    let fx = Fixture::new(2, 5);
    let (lens, entries, s_new) = ([0, 17, 90], [4usize, 0, 3], 3);
    let idx = entries.map(|e| e as i32);
    let mut rng = StdRng::seed_from_u64(6);
    let k_new: Vec<bf16> = random(BATCH * s_new * HK * D, &mut rng);
    let v_new: Vec<bf16> = random(BATCH * s_new * HK * DV, &mut rng);
    let (kn, vn) = (
        TensorRef::contiguous(&k_new, [BATCH, s_new, HK, D]),
        TensorRef::contiguous(&v_new, [BATCH, s_new, HK, DV]),
    );
    let after: Vec<i32> = lens.iter().map(|&l| l + s_new as i32).collect();
    // By hand: the new rows copied into the dense entries.
    let mut want = Fixture::new(2, 5);
    for (b, &e) in entries.iter().enumerate() {
        for (x, new, d) in [(&mut want.k, &k_new, D), (&mut want.v, &v_new, DV)] {
            let at = (e * CAPACITY + lens[b] as usize) * HK * d;
            x[at..at + s_new * HK * d]
                .copy_from_slice(&new[b * s_new * HK * d..][..s_new * HK * d]);
        }
    }
    let cfg = AttentionConfig::new().causal(true);
    let expected = kvcache::forward(
        &cfg,
        KvCacheInputs::new(want.q(), want.dense(), &after).with_cache_batch_idx(&idx),
    )
    .unwrap();
    check_per_sequence(&want, &cfg, &entries, &after, &expected);

    let (mut k, mut v) = (fx.k.clone(), fx.v.clone());
    let mut dense = dense_mut(&mut k, &mut v);
    kvcache::append(&mut dense, kn, vn, &lens, Some(&idx)).unwrap();
    let got = kvcache::forward(
        &cfg,
        KvCacheInputs::new(fx.q(), dense.as_ref(), &after).with_cache_batch_idx(&idx),
    )
    .unwrap();
    assert_eq!(bits(&got.out), bits(&expected.out), "dense O");
    assert_eq!(got.lse, expected.lse, "dense LSE");

    let (mut pk, mut pv, table) = fx.paged(&entries, 7);
    let mut paged = KvCacheMut::Paged {
        k: TensorMut::contiguous(&mut pk, [POOL, PAGE, HK, D]),
        v: TensorMut::contiguous(&mut pv, [POOL, PAGE, HK, DV]),
        block_table: &table,
        max_pages: PAGES_PER_SEQ,
    };
    kvcache::append(&mut paged, kn, vn, &lens, None).unwrap();
    let got = kvcache::forward(&cfg, KvCacheInputs::new(fx.q(), paged.as_ref(), &after)).unwrap();
    assert_eq!(bits(&got.out), bits(&expected.out), "paged O");
    assert_eq!(got.lse, expected.lse, "paged LSE");

    // Past the capacity, into a page outside the pool, or new keys of another shape: refused,
    // nothing written.
    let (before, before_v) = (pk.clone(), pv.clone());
    let mut paged = KvCacheMut::Paged {
        k: TensorMut::contiguous(&mut pk, [POOL, PAGE, HK, D]),
        v: TensorMut::contiguous(&mut pv, [POOL, PAGE, HK, DV]),
        block_table: &table,
        max_pages: PAGES_PER_SEQ,
    };
    let full = [0, 0, CAPACITY as i32 - 2];
    let e = kvcache::append(&mut paged, kn, vn, &full, None).unwrap_err();
    assert!(matches!(e, Error::InvalidSeqlens(_)), "{e:?}");
    let mut bad = table.clone();
    bad[PAGES_PER_SEQ + 1] = -1; // sequence 1's second page, where its new rows 17..20 go
    let mut paged_bad = KvCacheMut::Paged {
        k: TensorMut::contiguous(&mut pk, [POOL, PAGE, HK, D]),
        v: TensorMut::contiguous(&mut pv, [POOL, PAGE, HK, DV]),
        block_table: &bad,
        max_pages: PAGES_PER_SEQ,
    };
    let e = kvcache::append(&mut paged_bad, kn, vn, &lens, None).unwrap_err();
    assert!(matches!(e, Error::InvalidPageTable(_)), "{e:?}");
    let short = TensorRef::contiguous(&k_new[..BATCH * 2 * HK * D], [BATCH, 2, HK, D]);
    let e = kvcache::append(&mut paged_bad, short, vn, &lens, None).unwrap_err();
    assert!(matches!(e, Error::ShapeMismatch { .. }), "{e:?}");
    assert_eq!(bits(&pk), bits(&before), "a refused append wrote K");
    assert_eq!(bits(&pv), bits(&before_v), "a refused append wrote V");
}

/// The test's own rotation of one head's row to position `pos`: pairs `(2i, 2i + 1)` or
/// `(i, i + dim / 2)` turned by `pos · base^(−2i / dim)`.
fn rotate_by_hand(
    x: &mut [bf16],
    pos: usize,
    dim: usize,
    interleaved: bool,
    angles: &(Vec<f32>, Vec<f32>),
) {
    let half = dim / 2;
    for i in 0..half {
        let (a, b) = if interleaved {
            (2 * i, 2 * i + 1)
        } else {
            (i, i + half)
        };
        let (c, s) = (angles.0[pos * half + i], angles.1[pos * half + i]);
        let (x0, x1) = (x[a].to_f32(), x[b].to_f32());
        x[a] = bf16::from_f32(x0 * c - x1 * s);
        x[b] = bf16::from_f32(x0 * s + x1 * c);
    }
}

/// `step` = rotate Q and the new keys, append, attend: against the same done by hand (the rows
/// rotated by the test's own code at their positions, written into a copy of the cache), bit for
/// bit; causal and windowed (queries at their own positions), full and windows as wide as the
/// cache (every query at the first new position), halves and interleaved pairs, a rotary dim below the head dim; bad rotary inputs
/// refused with the cache untouched.
#[test]
fn a_step_rotates_appends_and_attends() {
    let dim = 32;
    let lens = [0, 17, 90];
    let positions = CAPACITY;
    let angles: (Vec<f32>, Vec<f32>) = (0..positions)
        .flat_map(|p| {
            (0..dim / 2).map(move |i| p as f32 / 10000f32.powf(2.0 * i as f32 / dim as f32))
        })
        .map(|t| (t.cos(), t.sin()))
        .unzip();
    let mut rng = StdRng::seed_from_u64(9);
    // As many new keys as queries, and more new keys than queries (so that the queries'
    // positions, len + i, are not the bottom-right ones).
    for (s_new, seqlen_q, interleaved) in [(2, 2, false), (2, 2, true), (3, 1usize, false)] {
        let k_new: Vec<bf16> = random(BATCH * s_new * HK * D, &mut rng);
        let v_new: Vec<bf16> = random(BATCH * s_new * HK * DV, &mut rng);
        // FlashAttention-3's rule: each query row at its own position under a mask that bounds
        // some key, every row at the first new position otherwise; a left side of CAPACITY − 1
        // or more and a right side of seqlen_q − 1 or more bound none (with one query row the
        // two are the same).
        let wide = |left, right| AttentionConfig::new().window(left, right);
        for (cfg, same) in [
            (AttentionConfig::new().causal(true), false),
            (AttentionConfig::new(), true),
            (wide(Some(CAPACITY - 2), None), false),
            (wide(Some(CAPACITY - 1), None), true),
            (wide(None, Some(0)), false),
            (wide(None, Some(seqlen_q - 1)), true),
            (wide(Some(CAPACITY), Some(CAPACITY)), true),
        ] {
            let fx = Fixture::new(seqlen_q, 10);
            let rotary = kvcache::Rotary {
                cos: &angles.0,
                sin: &angles.1,
                dim,
                interleaved,
            };
            // By hand.
            let mut want = Fixture::new(seqlen_q, 10);
            for (b, &len) in lens.iter().enumerate() {
                for i in 0..seqlen_q {
                    for h in 0..HQ {
                        let at = ((b * seqlen_q + i) * HQ + h) * D;
                        let pos = len as usize + if same { 0 } else { i };
                        rotate_by_hand(&mut want.q[at..at + D], pos, dim, interleaved, &angles);
                    }
                }
                for i in 0..s_new {
                    let row = (len as usize + i) * HK;
                    for h in 0..HK {
                        let (src, dst) = (
                            ((b * s_new + i) * HK + h) * D,
                            (b * CAPACITY * HK + row + h) * D,
                        );
                        want.k[dst..dst + D].copy_from_slice(&k_new[src..src + D]);
                        rotate_by_hand(
                            &mut want.k[dst..dst + D],
                            len as usize + i,
                            dim,
                            interleaved,
                            &angles,
                        );
                        let (src, dst) = (
                            ((b * s_new + i) * HK + h) * DV,
                            (b * CAPACITY * HK + row + h) * DV,
                        );
                        want.v[dst..dst + DV].copy_from_slice(&v_new[src..src + DV]);
                    }
                }
            }
            let after: Vec<i32> = lens.iter().map(|&l| l + s_new as i32).collect();
            let expected =
                kvcache::forward(&cfg, KvCacheInputs::new(want.q(), want.dense(), &after)).unwrap();

            let (mut k, mut v) = (fx.k.clone(), fx.v.clone());
            let mut cache = dense_mut(&mut k, &mut v);
            let step = kvcache::KvCacheStep {
                q: fx.q(),
                cache: &mut cache,
                new: Some((
                    TensorRef::contiguous(&k_new, [BATCH, s_new, HK, D]),
                    TensorRef::contiguous(&v_new, [BATCH, s_new, HK, DV]),
                )),
                cache_seqlens: &lens,
                rotary: Some(rotary),
                cache_batch_idx: None,
                sinks: None,
                descales: None,
            };
            let got = kvcache::step(&cfg, step).unwrap();
            assert_eq!(
                bits(&got.out),
                bits(&expected.out),
                "O ({cfg:?}, interleaved {interleaved})"
            );
            assert_eq!(got.lse, expected.lse);
            assert_eq!(bits(&k), bits(&want.k), "the cache's K");
            assert_eq!(bits(&v), bits(&want.v), "the cache's V");
        }
    }

    // An odd rotary dim, and too few positions: refused, the cache untouched.
    let (s_new, seqlen_q) = (2, 2);
    let k_new: Vec<bf16> = random(BATCH * s_new * HK * D, &mut rng);
    let v_new: Vec<bf16> = random(BATCH * s_new * HK * DV, &mut rng);
    let fx = Fixture::new(seqlen_q, 11);
    let (mut k, mut v) = (fx.k.clone(), fx.v.clone());
    for (dim, n) in [(31, positions), (dim, 91)] {
        let mut cache = dense_mut(&mut k, &mut v);
        let half = dim / 2;
        let step = kvcache::KvCacheStep {
            q: fx.q(),
            cache: &mut cache,
            new: Some((
                TensorRef::contiguous(&k_new, [BATCH, s_new, HK, D]),
                TensorRef::contiguous(&v_new, [BATCH, s_new, HK, DV]),
            )),
            cache_seqlens: &lens,
            rotary: Some(kvcache::Rotary {
                cos: &angles.0[..n * half],
                sin: &angles.1[..n * half],
                dim,
                interleaved: false,
            }),
            cache_batch_idx: None,
            sinks: None,
            descales: None,
        };
        let e = kvcache::step(&AttentionConfig::new().causal(true), step).unwrap_err();
        assert!(
            matches!(e, Error::InvalidConfig(_)),
            "dim {dim}, {n} positions: {e:?}"
        );
    }
    assert_eq!(bits(&k), bits(&fx.k), "a refused step wrote K");
    assert_eq!(bits(&v), bits(&fx.v), "a refused step wrote V");
}

/// A step over an e4m3 cache: the new rows, rotated or not, stored as the same step over the
/// bf16 cache stores them but quantized by their descales (byte for byte); without rotary
/// embedding (Q as it is), O and the LSE those of a forward over the expected cache with the
/// descales, bit for bit. Descales over a bf16 cache, and a zero descale where the step appends,
/// are refused before anything is written.
#[test]
fn a_step_over_an_fp8_cache_quantizes_what_it_appends() {
    let (dim, lens, s_new, seqlen_q) = (32, [0, 17, 90], 2, 2);
    let angles: (Vec<f32>, Vec<f32>) = (0..CAPACITY)
        .flat_map(|p| {
            (0..dim / 2).map(move |i| p as f32 / 10000f32.powf(2.0 * i as f32 / dim as f32))
        })
        .map(|t| (t.cos(), t.sin()))
        .unzip();
    let rotary = kvcache::Rotary {
        cos: &angles.0,
        sin: &angles.1,
        dim,
        interleaved: false,
    };
    let mut rng = StdRng::seed_from_u64(19);
    let k_new: Vec<bf16> = random(BATCH * s_new * HK * D, &mut rng);
    let v_new: Vec<bf16> = random(BATCH * s_new * HK * DV, &mut rng);
    let new = (
        TensorRef::contiguous(&k_new, [BATCH, s_new, HK, D]),
        TensorRef::contiguous(&v_new, [BATCH, s_new, HK, DV]),
    );
    let (kd, vd) = (descales(0.2), descales(0.07));
    let fx = Fixture::new(seqlen_q, 20);
    let cfg = AttentionConfig::new().causal(true);
    let raw = |x: &[F8E4M3]| x.iter().map(|v| v.to_bits()).collect::<Vec<u8>>();
    let grown: Vec<i32> = lens.iter().map(|&l| l + s_new as i32).collect();
    for with_rotary in [true, false] {
        // The bf16 step, for the rotated rows it stores.
        let (mut k16, mut v16) = (fx.k.clone(), fx.v.clone());
        kvcache::step(
            &cfg,
            kvcache::KvCacheStep {
                q: fx.q(),
                cache: &mut dense_mut(&mut k16, &mut v16),
                new: Some(new),
                cache_seqlens: &lens,
                rotary: with_rotary.then_some(rotary),
                cache_batch_idx: None,
                sinks: None,
                descales: None,
            },
        )
        .unwrap();
        let (k8, v8) = (e4m3(&fx.k), e4m3(&fx.v));
        let (mut k, mut v) = (k8.clone(), v8.clone());
        let got = kvcache::step(
            &cfg,
            kvcache::KvCacheStep {
                q: fx.q(),
                cache: &mut dense_mut(&mut k, &mut v),
                new: Some(new),
                cache_seqlens: &lens,
                rotary: with_rotary.then_some(rotary),
                cache_batch_idx: None,
                sinks: None,
                descales: Some(kvcache::CacheDescales { k: &kd, v: &vd }),
            },
        )
        .unwrap();
        // The appended rows: the bf16 step's, quantized by their sequence's descales.
        let (mut want_k, mut want_v) = (k8.clone(), v8.clone());
        for (b, &len) in lens.iter().enumerate() {
            for i in 0..s_new {
                let row = len as usize + i;
                for h in 0..HK {
                    for (want, x16, d, s) in
                        [(&mut want_k, &k16, D, &kd), (&mut want_v, &v16, DV, &vd)]
                    {
                        let at = ((b * CAPACITY + row) * HK + h) * d;
                        for j in at..at + d {
                            want[j] = flashattn::fp8::quantize(x16[j].to_f32(), s[b * HK + h]);
                        }
                    }
                }
            }
        }
        assert_eq!(raw(&k), raw(&want_k), "K (rotary {with_rotary})");
        assert_eq!(raw(&v), raw(&want_v), "V (rotary {with_rotary})");
        // O and the LSE: the forward over the expected cache with the descales (Q as it is).
        if !with_rotary {
            let want = kvcache::forward(
                &cfg,
                KvCacheInputs::new(
                    fx.q(),
                    KvCache::dense(
                        TensorRef::contiguous(&want_k, [ENTRIES, CAPACITY, HK, D]),
                        TensorRef::contiguous(&want_v, [ENTRIES, CAPACITY, HK, DV]),
                    ),
                    &grown,
                )
                .with_descales(&kd, &vd),
            )
            .unwrap();
            assert_eq!(bits(&got.out), bits(&want.out), "O");
            assert_eq!(got.lse, want.lse, "LSE");
        }
    }
    // Descales over a bf16 cache: refused before anything is written.
    let (mut k, mut v) = (fx.k.clone(), fx.v.clone());
    let e = kvcache::step(
        &cfg,
        kvcache::KvCacheStep {
            q: fx.q(),
            cache: &mut dense_mut(&mut k, &mut v),
            new: Some(new),
            cache_seqlens: &lens,
            rotary: None,
            cache_batch_idx: None,
            sinks: None,
            descales: Some(kvcache::CacheDescales { k: &kd, v: &vd }),
        },
    )
    .unwrap_err();
    assert!(matches!(e, Error::InvalidConfig(_)), "{e:?}");
    assert_eq!(bits(&k), bits(&fx.k), "a refused step wrote K");
    assert_eq!(bits(&v), bits(&fx.v), "a refused step wrote V");
    // A zero descale where the step appends: refused, the e4m3 cache untouched.
    let (k8, v8) = (e4m3(&fx.k), e4m3(&fx.v));
    let (mut k, mut v) = (k8.clone(), v8.clone());
    let mut zero = vd.clone();
    zero[3] = 0.0;
    let e = kvcache::step(
        &cfg,
        kvcache::KvCacheStep {
            q: fx.q(),
            cache: &mut dense_mut(&mut k, &mut v),
            new: Some(new),
            cache_seqlens: &lens,
            rotary: None,
            cache_batch_idx: None,
            sinks: None,
            descales: Some(kvcache::CacheDescales { k: &kd, v: &zero }),
        },
    )
    .unwrap_err();
    assert!(matches!(e, Error::InvalidConfig(_)), "{e:?}");
    assert_eq!(
        (raw(&k), raw(&v)),
        (raw(&k8), raw(&v8)),
        "a refused step wrote the cache"
    );
}
