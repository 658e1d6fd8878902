//! Packed (varlen) batches for the CPU and GPU tests: the sequences' lengths and tensors, and
//! the check of every sequence's outputs against the f64 reference of its own dense problem
//! under the correctness rule.

use flashattn::reference::{self, compare, compare_gradient};
use flashattn::{AttentionConfig, Element, Layout, TensorRef};
use rand::rngs::StdRng;
use rand::SeedableRng;

use super::{random, Outputs};

pub fn offsets(lengths: &[usize]) -> Vec<i32> {
    let mut cu = vec![0i32];
    for &l in lengths {
        cu.push(cu.last().unwrap() + l as i32);
    }
    cu
}

/// Rows `rows` of a packed `(1, total, heads, d)` buffer, copied as a dense `(1, n, heads, d)` one.
pub fn rows<T: Copy>(x: &[T], rows: std::ops::Range<usize>, heads: usize, d: usize) -> Vec<T> {
    x[rows.start * heads * d..rows.end * heads * d].to_vec()
}

/// One packed batch: lengths per sequence, its tensors, and a dO.
pub struct Batch<T> {
    pub q_lens: Vec<usize>,
    pub k_lens: Vec<usize>,
    pub heads_q: usize,
    pub heads_kv: usize,
    /// Q's and K's head dim.
    pub d: usize,
    /// V's head dim, and so O's, dO's and dV's.
    pub dv: usize,
    pub q: Vec<T>,
    pub k: Vec<T>,
    pub v: Vec<T>,
    pub dout: Vec<T>,
}

impl<T: Element> Batch<T> {
    /// A batch whose V has Q's and K's head dim `d`.
    pub fn new(
        q_lens: &[usize],
        k_lens: &[usize],
        heads: (usize, usize),
        d: usize,
        seed: u64,
    ) -> Self {
        Self::with_head_dim_v(q_lens, k_lens, heads, (d, d), seed)
    }
    /// A batch with Q and K of head dim `d`, V (and O, dO) of `dv`: Q, K, V and dO drawn in
    /// that order (as [`Batch::new`] draws them).
    pub fn with_head_dim_v(
        q_lens: &[usize],
        k_lens: &[usize],
        heads: (usize, usize),
        (d, dv): (usize, usize),
        seed: u64,
    ) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let (tq, tk): (usize, usize) = (q_lens.iter().sum(), k_lens.iter().sum());
        Batch {
            q_lens: q_lens.to_vec(),
            k_lens: k_lens.to_vec(),
            heads_q: heads.0,
            heads_kv: heads.1,
            d,
            dv,
            q: random(tq * heads.0 * d, &mut rng),
            k: random(tk * heads.1 * d, &mut rng),
            v: random(tk * heads.1 * dv, &mut rng),
            dout: random(tq * heads.0 * dv, &mut rng),
        }
    }
    pub fn cu(&self) -> (Vec<i32>, Vec<i32>) {
        (offsets(&self.q_lens), offsets(&self.k_lens))
    }
    pub fn max(&self) -> (usize, usize) {
        let m = |l: &[usize]| l.iter().copied().max().unwrap_or(0);
        (m(&self.q_lens), m(&self.k_lens))
    }
    pub fn q_view<'a>(&self, x: &'a [T]) -> TensorRef<'a, T> {
        TensorRef::contiguous(x, [1, self.q_lens.iter().sum(), self.heads_q, self.d])
    }
    pub fn k_view<'a>(&self, x: &'a [T]) -> TensorRef<'a, T> {
        TensorRef::contiguous(x, [1, self.k_lens.iter().sum(), self.heads_kv, self.d])
    }
    /// A packed V (or dV) of the batch.
    pub fn v_view<'a>(&self, x: &'a [T]) -> TensorRef<'a, T> {
        TensorRef::contiguous(x, [1, self.k_lens.iter().sum(), self.heads_kv, self.dv])
    }
    /// A packed O (or dO) of the batch.
    pub fn o_view<'a>(&self, x: &'a [T]) -> TensorRef<'a, T> {
        TensorRef::contiguous(x, [1, self.q_lens.iter().sum(), self.heads_q, self.dv])
    }
}

/// Checks each sequence of `batch` against its own dense f64 reference under the rule, `used`
/// keys per sequence (all without): O, LSE, dQ, dK, dV; keys past `used` (and keys of a
/// sequence without queries) with zero gradients; rows of a sequence without keys with O = 0,
/// LSE = +inf and dQ = 0.
pub fn check_outputs<T: Element>(
    batch: &Batch<T>,
    cfg: &AttentionConfig,
    used: Option<&[i32]>,
    got: &Outputs<T>,
) {
    let Outputs {
        out,
        lse,
        dq,
        dk,
        dv: dv_got,
        ..
    } = got;
    let mut failures = vec![];
    let (hq, hk, d, dv) = (batch.heads_q, batch.heads_kv, batch.d, batch.dv);
    let total_q: usize = batch.q_lens.iter().sum();
    let f32s = reference::to_f32;
    for b in 0..batch.q_lens.len() {
        // The test's own bookkeeping of which rows are whose, not the library's.
        let q0: usize = batch.q_lens[..b].iter().sum();
        let k0: usize = batch.k_lens[..b].iter().sum();
        let all_keys = k0..k0 + batch.k_lens[b];
        let qr = q0..q0 + batch.q_lens[b];
        let kr = k0..k0 + used.map_or(batch.k_lens[b], |u| u[b] as usize);
        // Keys past seqused_k: no query sees them, their gradients are 0.
        for (x, w) in [(dk, d), (dv_got, dv)] {
            let unused = &x[kr.end * hk * w..all_keys.end * hk * w];
            assert!(
                unused.iter().all(|g| g.to_f32() == 0.0),
                "sequence {b}: unused keys"
            );
        }
        if qr.is_empty() {
            // No query: no gradient reaches this sequence's keys.
            for (x, w) in [(dk, d), (dv_got, dv)] {
                let keys = &x[all_keys.start * hk * w..all_keys.end * hk * w];
                assert!(
                    keys.iter().all(|g| g.to_f32() == 0.0),
                    "sequence {b}: no queries"
                );
            }
            continue;
        }
        let got_lse: Vec<f32> = (0..hq)
            .flat_map(|h| lse[h * total_q + qr.start..h * total_q + qr.end].to_vec())
            .collect();
        let got_o = f32s(&rows(out, qr.clone(), hq, dv));
        let got_dq = f32s(&rows(dq, qr.clone(), hq, d));
        if kr.is_empty() {
            // No key: O = 0, LSE = +inf, no gradient.
            assert!(
                got_o.iter().chain(&got_dq).all(|&x| x == 0.0),
                "sequence {b}"
            );
            assert!(got_lse.iter().all(|&x| x == f32::INFINITY), "sequence {b}");
            continue;
        }
        let (sq, sk) = (qr.len(), kr.len());
        let (q_rows, k_rows, v_rows, do_rows) = (
            rows(&batch.q, qr.clone(), hq, d),
            rows(&batch.k, kr.clone(), hk, d),
            rows(&batch.v, kr.clone(), hk, dv),
            rows(&batch.dout, qr.clone(), hq, dv),
        );
        let tq = TensorRef::new(&q_rows, Layout::contiguous([1, sq, hq, d]));
        let tk = TensorRef::new(&k_rows, Layout::contiguous([1, sk, hk, d]));
        let tv = TensorRef::new(&v_rows, Layout::contiguous([1, sk, hk, dv]));
        let tdo = TensorRef::new(&do_rows, Layout::contiguous([1, sq, hq, dv]));
        let want = reference::reference_forward(cfg, tq, tk, tv);
        let base = reference::baseline_forward(cfg, tq, tk, tv);
        let o = compare(&got_o, &want.out, &base.out);
        let lse = compare(&got_lse, &want.lse, &base.lse);
        let want_g = reference::reference_backward(cfg, tq, tk, tv, tdo);
        // Gradients under FlashAttention-3's form of the rule, every sequence's alike: packed
        // batches hold sequences of a few keys, where every FlashAttention-family backward errs
        // past twice the baseline's error (reference::compare_gradient).
        let base_g = reference::baseline_backward(cfg, tq, tk, tv, tdo);
        let grad = |got: &[f32], want: &[f64], base: &[f32]| compare_gradient::<T>(got, want, base);
        let dq = grad(&got_dq, &want_g.dq, &base_g.dq);
        let got_dk = f32s(&rows(dk, kr.clone(), hk, d));
        let dk = grad(&got_dk, &want_g.dk, &base_g.dk);
        let got_dv = f32s(&rows(dv_got, kr.clone(), hk, dv));
        let grad_v = grad(&got_dv, &want_g.dv, &base_g.dv);
        for (name, c) in [
            ("O", o),
            ("LSE", lse),
            ("dQ", dq),
            ("dK", dk),
            ("dV", grad_v),
        ] {
            if !c.pass {
                failures.push(format!("sequence {b} ({sq}x{sk}) {cfg:?}: {name} {c}"));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
