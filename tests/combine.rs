//! Merging partial results by their LSE (`flashattn::combine`): keys split into chunks (one of a
//! single key) and merged give the one call over all of them (f32 to within f32 rounding, bf16
//! under the reference rule), with GQA, V's own head dim and sinks in one part; a part that saw
//! no key adds nothing, rows no part saw stay empty, NaN stays NaN; bad parts are typed errors.

mod harness;

use flashattn::combine::{self, LseLayout};
use flashattn::kvcache::{self, KvCache, KvCacheInputs};
use flashattn::reference::{self, baseline_forward_sinks, compare, reference_forward_sinks};
use flashattn::{AttentionConfig, Element, Error, ForwardInputs, ForwardOutput, TensorRef};
use half::bf16;
use rand::rngs::StdRng;
use rand::SeedableRng;

use harness::random;

const B: usize = 2;
const SQ: usize = 37;
const SK: usize = 300;
const HQ: usize = 4;
const HK: usize = 2;
const D: usize = 64;
const DV: usize = 32;
/// The chunks the keys are split into.
const CHUNKS: [std::ops::Range<usize>; 3] = [0..100, 100..101, 101..300];

struct Inputs<T> {
    q: Vec<T>,
    k: Vec<T>,
    v: Vec<T>,
    sinks: Vec<f32>,
}

impl<T: Element> Inputs<T> {
    fn new(seed: u64) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        Inputs {
            q: random(B * SQ * HQ * D, &mut rng),
            k: random(B * SK * HK * D, &mut rng),
            v: random(B * SK * HK * DV, &mut rng),
            sinks: vec![0.5, -1.0, 2.0, 0.0],
        }
    }
    fn q(&self) -> TensorRef<'_, T> {
        TensorRef::contiguous(&self.q, [B, SQ, HQ, D])
    }
    /// Keys `keys` of K (head dim `d`) or V as a strided view of the whole tensor.
    fn keys<'a>(&self, x: &'a [T], keys: &std::ops::Range<usize>, d: usize) -> TensorRef<'a, T> {
        let row = HK * d;
        TensorRef::new(
            &x[keys.start * row..],
            flashattn::Layout::with_strides([B, keys.len(), HK, d], [SK * row, row, d, 1]),
        )
    }
    /// The forward over `keys`, sinks in this part where `sinks`.
    fn part(&self, keys: &std::ops::Range<usize>, sinks: bool) -> ForwardOutput<T> {
        let inputs = ForwardInputs::new(
            self.q(),
            self.keys(&self.k, keys, D),
            self.keys(&self.v, keys, DV),
        );
        let inputs = if sinks {
            inputs.with_sinks(&self.sinks)
        } else {
            inputs
        };
        flashattn::forward(&AttentionConfig::new(), inputs).unwrap()
    }
    fn merged(&self) -> (combine::Combined<T>, ForwardOutput<T>) {
        let parts: Vec<_> = CHUNKS
            .iter()
            .enumerate()
            .map(|(i, c)| self.part(c, i == 1))
            .collect();
        let views: Vec<_> = parts
            .iter()
            .map(|p| (TensorRef::contiguous(&p.out, [B, SQ, HQ, DV]), &p.lse[..]))
            .collect();
        let merged = combine::combine(&views, LseLayout::Dense).unwrap();
        (merged, self.part(&(0..SK), true))
    }
}

#[test]
fn split_keys_merge_to_the_whole_call_in_f32() {
    let x = Inputs::<f32>::new(1);
    let (merged, whole) = x.merged();
    let close = |a: &[f32], b: &[f32], tol: f32| {
        a.len() == b.len()
            && a.iter()
                .zip(b)
                .all(|(x, y)| (x - y).abs() <= tol * (1.0 + y.abs()))
    };
    assert!(close(&merged.out, &whole.out, 2e-6), "O");
    assert!(close(&merged.lse, &whole.lse, 2e-6), "LSE");
}

#[test]
fn split_keys_merge_within_the_rule_in_bf16() {
    let x = Inputs::<bf16>::new(2);
    let (merged, _) = x.merged();
    let cfg = AttentionConfig::new();
    let (k, v) = (x.keys(&x.k, &(0..SK), D), x.keys(&x.v, &(0..SK), DV));
    let want = reference_forward_sinks(&cfg, x.q(), k, v, &x.sinks);
    let base = baseline_forward_sinks(&cfg, x.q(), k, v, &x.sinks);
    let o = compare(&reference::to_f32(&merged.out), &want.out, &base.out);
    assert!(o.pass, "O: {o}");
    let lse = compare(&merged.lse, &want.lse, &base.lse);
    assert!(lse.pass, "LSE: {lse}");
}

/// O `(B, SQ, HQ, DV)` over `d`.
fn o(d: &[f32]) -> TensorRef<'_, f32> {
    TensorRef::contiguous(d, [B, SQ, HQ, DV])
}

#[test]
fn empty_parts_add_nothing_and_nan_stays_nan() {
    let x = Inputs::<f32>::new(3);
    let part = x.part(&(0..SK), false);
    let n = B * SQ * HQ;
    let (zeros, empty) = (vec![0f32; n * DV], vec![f32::INFINITY; n]);
    let merged = combine::combine(
        &[(o(&zeros), &empty[..]), (o(&part.out), &part.lse[..])],
        LseLayout::Dense,
    )
    .unwrap();
    assert_eq!(merged.out, part.out);
    assert_eq!(merged.lse, part.lse);
    let none = combine::combine(
        &[(o(&zeros), &empty[..]), (o(&zeros), &empty[..])],
        LseLayout::Dense,
    )
    .unwrap();
    assert!(none.out.iter().all(|&x| x == 0.0) && none.lse.iter().all(|&l| l == f32::INFINITY));
    let mut nan_lse = part.lse.clone();
    nan_lse[5] = f32::NAN;
    let merged = combine::combine(
        &[(o(&part.out), &nan_lse[..]), (o(&part.out), &part.lse[..])],
        LseLayout::Dense,
    )
    .unwrap();
    assert!(merged.lse[5].is_nan());
    assert!(merged
        .lse
        .iter()
        .enumerate()
        .all(|(i, l)| i == 5 || l.is_finite()));
}

#[test]
fn bad_parts_are_typed_errors() {
    let n = B * SQ * HQ;
    let (o, lse) = (vec![0f32; n * DV], vec![0f32; n]);
    let t = TensorRef::contiguous(&o, [B, SQ, HQ, DV]);
    let e = combine::combine::<f32>(&[], LseLayout::Dense).unwrap_err();
    assert!(matches!(e, Error::InvalidConfig(_)), "{e:?}");
    let other = TensorRef::contiguous(&o[..n * 16], [B, SQ, HQ, 16]);
    let e = combine::combine(&[(t, &lse[..]), (other, &lse[..])], LseLayout::Dense).unwrap_err();
    assert!(matches!(e, Error::ShapeMismatch { .. }), "{e:?}");
    let e = combine::combine(&[(t, &lse[..n - 1])], LseLayout::Dense).unwrap_err();
    assert!(matches!(e, Error::BufferTooSmall { .. }), "{e:?}");
}

/// A part's LSE longer than its rows (as the merged LSE may be): only its first rows are read,
/// so the merge is that of the parts cut to their rows.
#[test]
fn part_lse_longer_than_the_rows_is_read_to_the_rows() {
    let x = Inputs::<f32>::new(5);
    let (pa, pb) = (x.part(&CHUNKS[0], false), x.part(&CHUNKS[2], false));
    fn o(x: &[f32]) -> TensorRef<'_, f32> {
        TensorRef::contiguous(x, [B, SQ, HQ, DV])
    }
    let longer: Vec<f32> = pa.lse.iter().copied().chain([f32::NAN; 7]).collect();
    let want = combine::combine(
        &[(o(&pa.out), &pa.lse[..]), (o(&pb.out), &pb.lse[..])],
        LseLayout::Dense,
    )
    .unwrap();
    let got = combine::combine(
        &[(o(&pa.out), &longer[..]), (o(&pb.out), &pb.lse[..])],
        LseLayout::Dense,
    )
    .unwrap();
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&got.out), bits(&want.out));
    assert_eq!(bits(&got.lse), bits(&want.lse));
}

/// A NaN in a part's O (its LSE finite) makes that element NaN; strided parts (O laid out
/// `(batch, heads, seqlen_q, d)`) and a padded `out` merge as contiguous ones; an `out` that
/// reaches an element twice is refused.
#[test]
fn nan_rows_strided_parts_and_overlapping_outputs() {
    let x = Inputs::<f32>::new(4);
    let (a, b) = (x.part(&CHUNKS[0], false), x.part(&CHUNKS[2], false));
    let mut a_nan = a.out.clone();
    a_nan[3 * DV + 1] = f32::NAN; // entry 0, query 0, head 3
    let merged = combine::combine(
        &[(o(&a_nan), &a.lse[..]), (o(&b.out), &b.lse[..])],
        LseLayout::Dense,
    )
    .unwrap();
    for (j, y) in merged.out.iter().enumerate() {
        assert_eq!(y.is_nan(), j == 3 * DV + 1, "element {j}");
    }

    let plain = combine::combine(
        &[(o(&a.out), &a.lse[..]), (o(&b.out), &b.lse[..])],
        LseLayout::Dense,
    )
    .unwrap();
    // A's O copied into (batch, heads, seqlen_q, d) and seen through strides.
    let mut bhsd = vec![0f32; a.out.len()];
    for bi in 0..B {
        for i in 0..SQ {
            for h in 0..HQ {
                let src = ((bi * SQ + i) * HQ + h) * DV;
                let dst = ((bi * HQ + h) * SQ + i) * DV;
                bhsd[dst..dst + DV].copy_from_slice(&a.out[src..src + DV]);
            }
        }
    }
    let strided = TensorRef::new(
        &bhsd,
        flashattn::Layout::with_strides([B, SQ, HQ, DV], [HQ * SQ * DV, DV, SQ * DV, 1]),
    );
    // Out with a row stride padded by 3 heads' worth.
    let row = (HQ + 3) * DV;
    let mut padded = vec![f32::NAN; B * SQ * row];
    let mut lse = vec![0f32; B * HQ * SQ];
    combine::combine_into(
        &[(strided, &a.lse[..]), (o(&b.out), &b.lse[..])],
        LseLayout::Dense,
        flashattn::TensorMut::new(
            &mut padded,
            flashattn::Layout::with_strides([B, SQ, HQ, DV], [SQ * row, row, DV, 1]),
        ),
        &mut lse,
    )
    .unwrap();
    for bi in 0..B {
        for i in 0..SQ {
            let got = &padded[(bi * SQ + i) * row..][..HQ * DV];
            let want = &plain.out[(bi * SQ + i) * HQ * DV..][..HQ * DV];
            assert_eq!(got, want);
        }
    }
    assert_eq!(lse, plain.lse);
    let mut small = vec![0f32; DV * 4];
    let e = combine::combine_into(
        &[(o(&a.out), &a.lse[..])],
        LseLayout::Dense,
        flashattn::TensorMut::new(
            &mut small,
            flashattn::Layout::with_strides([B, SQ, HQ, DV], [0, 0, DV, 1]),
        ),
        &mut lse,
    )
    .unwrap_err();
    assert!(matches!(e, Error::OverlappingOutput { .. }), "{e:?}");
}

/// Two KV-cache calls over halves of each sequence's cached keys (the dense LSE order), merged,
/// give the call over all of them.
#[test]
fn kv_cache_halves_merge_in_the_dense_order() {
    let x = Inputs::<f32>::new(5);
    // The K and V of each entry as a dense cache of SK rows; Q decodes 37 rows per sequence.
    let dense = |k: &[f32], v: &[f32], lens: &[i32]| {
        let cache = KvCache::dense(
            TensorRef::contiguous(k, [B, SK, HK, D]),
            TensorRef::contiguous(v, [B, SK, HK, DV]),
        );
        kvcache::forward(
            &AttentionConfig::new(),
            KvCacheInputs::new(x.q(), cache, lens),
        )
        .unwrap()
    };
    let whole = dense(&x.k, &x.v, &[SK as i32, 120]);
    // First halves: the first 150 / 60 keys; second halves: the rest, moved to the front.
    let first = dense(&x.k, &x.v, &[150, 60]);
    let shift = |t: &[f32], d: usize, by: [usize; 2]| {
        let mut out = vec![0f32; t.len()];
        for (bi, &n) in by.iter().enumerate() {
            let (e, row) = (bi * SK * HK * d, HK * d);
            out[e..e + (SK - n) * row].copy_from_slice(&t[e + n * row..e + SK * row]);
        }
        out
    };
    let (k2, v2) = (shift(&x.k, D, [150, 60]), shift(&x.v, DV, [150, 60]));
    let second = dense(&k2, &v2, &[150, 60]);
    let merged = combine::combine(
        &[
            (
                TensorRef::contiguous(&first.out, [B, SQ, HQ, DV]),
                &first.lse[..],
            ),
            (
                TensorRef::contiguous(&second.out, [B, SQ, HQ, DV]),
                &second.lse[..],
            ),
        ],
        LseLayout::Dense,
    )
    .unwrap();
    let close = |a: &[f32], b: &[f32]| {
        a.len() == b.len()
            && a.iter()
                .zip(b)
                .all(|(x, y)| (x - y).abs() <= 2e-6 * (1.0 + y.abs()))
    };
    assert!(close(&merged.out, &whole.out), "O");
    assert!(close(&merged.lse, &whole.lse), "LSE");
}
