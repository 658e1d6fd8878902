//! Merging partial results by their LSE (`flashattn::combine`): keys split into chunks (one of a
//! single key) and merged give the one call over all of them (f32 to within f32 rounding, bf16
//! under the reference rule), with GQA, V's own head dim and sinks in one part; a part that saw
//! no key adds nothing, rows no part saw stay empty, NaN stays NaN; bad parts are typed errors.

mod harness;

use flashattn::combine;
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
        let merged = combine::combine(&views).unwrap();
        (merged, self.part(&(0..SK), true))
    }
}

#[test]
fn split_keys_merge_to_the_whole_call_in_f32() {
    let x = Inputs::<f32>::new(1);
    let (merged, whole) = x.merged();
    let close = |a: &[f32], b: &[f32], tol: f32| {
        a.iter()
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
    let merged =
        combine::combine(&[(o(&zeros), &empty[..]), (o(&part.out), &part.lse[..])]).unwrap();
    assert_eq!(merged.out, part.out);
    assert_eq!(merged.lse, part.lse);
    let none = combine::combine(&[(o(&zeros), &empty[..]), (o(&zeros), &empty[..])]).unwrap();
    assert!(none.out.iter().all(|&x| x == 0.0) && none.lse.iter().all(|&l| l == f32::INFINITY));
    let mut nan_lse = part.lse.clone();
    nan_lse[5] = f32::NAN;
    let merged =
        combine::combine(&[(o(&part.out), &nan_lse[..]), (o(&part.out), &part.lse[..])]).unwrap();
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
    let e = combine::combine::<f32>(&[]).unwrap_err();
    assert!(matches!(e, Error::InvalidConfig(_)), "{e:?}");
    let other = TensorRef::contiguous(&o[..n * 16], [B, SQ, HQ, 16]);
    let e = combine::combine(&[(t, &lse[..]), (other, &lse[..])]).unwrap_err();
    assert!(matches!(e, Error::ShapeMismatch { .. }), "{e:?}");
    let e = combine::combine(&[(t, &lse[..n - 1])]).unwrap_err();
    assert!(matches!(e, Error::BufferTooSmall { .. }), "{e:?}");
}
