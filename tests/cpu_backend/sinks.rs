//! Attention sinks on the CPU backend: `forward_into` and `backward_into` with sinks (and their
//! gradient) against the f64 reference (`reference_*_sinks`) under the correctness rule, with
//! the baseline's `baseline_*_sinks` as the allowance, for O, the LSE, dQ, dK, dV and the sinks'
//! gradient; rows with no key; sinks that weigh nothing or are not finite; the allocating calls
//! against the others; and the refusals of short vectors and of a gradient without sinks.

use flashattn::reference::{self, compare, pack_f32, Comparison};
use flashattn::{
    AttentionConfig, Backend, BackwardInputs, DType, Element, Error, ForwardInputs, GradientsMut,
    Layout, Operand, TensorMut, TensorRef,
};
use half::bf16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::harness::{poisoned, random, untouched_nan, Case, Storage};
use crate::{case, Outcome};
use DType::{BF16, F16, F32};

/// Sinks around the scores' own range (the scaled scores of N(0,1) inputs are about ±3), one
/// far above it, one far below.
fn random_sinks(heads: usize, rng: &mut StdRng) -> Vec<f32> {
    (0..heads)
        .map(|h| match h % 4 {
            2 => 9.0,
            3 => -30.0,
            _ => rng.random_range(-2.0..4.0),
        })
        .collect()
}

/// What one call pair wrote: O and the gradients in their layouts, the LSE and d_sink packed.
struct Run<T> {
    out: Vec<T>,
    lse: Vec<f32>,
    dq: Vec<T>,
    dk: Vec<T>,
    dv: Vec<T>,
    dsinks: Vec<f32>,
}

/// `forward_into` then `backward_into` with sinks into poisoned (NaN) outputs, each of the
/// LSE and dsinks one slot longer than needed; that slot must stay untouched. With `finite`
/// (finite sinks and inputs), every element of O and of the gradients must have been written.
fn forward_backward<T: Element>(
    c: &Case,
    [q, k, v, dout]: [TensorRef<T>; 4],
    sinks: &[f32],
    finite: bool,
) -> Run<T> {
    let ((lq, lk), (lv, lo)) = (c.layouts(), c.v_layouts());
    let cfg = c.cfg(Backend::Auto);
    let mut ob = poisoned::<T>(&lo);
    let lse_len = c.batch * c.heads_q * c.seqlen_q;
    let mut lse = vec![f32::NAN; lse_len + 1];
    let inputs = ForwardInputs::new(q, k, v).with_sinks(sinks);
    let plan = flashattn::forward_into(&cfg, inputs, TensorMut::new(&mut ob, lo), &mut lse)
        .unwrap_or_else(|e| panic!("{}: {e}", c.name()));
    assert_eq!(plan.backend, Backend::Cpu);
    assert!(lse[lse_len].is_nan(), "{}: wrote past the LSE", c.name());
    lse.truncate(lse_len);
    let (nan, unaddressed) = untouched_nan(&ob, &lo);
    assert!(
        !finite || nan == unaddressed,
        "{}: out poison left",
        c.name()
    );

    let [mut dq, mut dk, mut dv] = [lq, lk, lv].map(|l| poisoned::<T>(&l));
    let mut dsinks = vec![f32::NAN; c.heads_q + 1];
    flashattn::backward_into(
        &cfg,
        BackwardInputs {
            q,
            k,
            v,
            out: TensorRef::new(&ob, lo),
            dout,
            lse: &lse,
            sinks: Some(sinks),
        },
        GradientsMut {
            dq: TensorMut::new(&mut dq, lq),
            dk: TensorMut::new(&mut dk, lk),
            dv: TensorMut::new(&mut dv, lv),
            dsinks: Some(&mut dsinks),
        },
    )
    .unwrap_or_else(|e| panic!("{}: {e}", c.name()));
    assert!(
        dsinks[c.heads_q].is_nan(),
        "{}: wrote past dsinks",
        c.name()
    );
    dsinks.truncate(c.heads_q);
    for (what, buf, l) in [("dQ", &dq, &lq), ("dK", &dk, &lk), ("dV", &dv, &lv)] {
        let (nan, unaddressed) = untouched_nan(buf, l);
        assert!(
            !finite || nan == unaddressed,
            "{}: {what} poison left",
            c.name()
        );
    }
    Run {
        out: ob,
        lse,
        dq,
        dk,
        dv,
        dsinks,
    }
}

/// One case with random N(0,1) inputs and [`random_sinks`], compared with the reference.
fn run<T: Element>(c: &Case, seed: u64) -> Outcome {
    assert_eq!(T::DTYPE, c.dtype);
    let mut rng = StdRng::seed_from_u64(seed);
    let ops = c.random_operands::<T>(&mut rng);
    let sinks = random_sinks(c.heads_q, &mut rng);
    let [q, k, v, dout] = ops.tensors();
    let [lq, lk, lv, lo] = ops.layouts;
    let got = forward_backward(c, [q, k, v, dout], &sinks, true);

    let cfg = c.cfg(Backend::Auto);
    let r = reference::reference_forward_sinks(&cfg, q, k, v, &sinks);
    let bl = reference::baseline_forward_sinks(&cfg, q, k, v, &sinks);
    let (rg, r_ds) = reference::reference_backward_sinks(&cfg, q, k, v, dout, &sinks);
    let (bg, b_ds) = reference::baseline_backward_sinks(&cfg, q, k, v, dout, &sinks);
    let packed = |x: &[T], l: Layout| pack_f32(TensorRef::new(x, l));
    let results: Vec<(&'static str, Comparison)> = vec![
        ("O", compare(&packed(&got.out, lo), &r.out, &bl.out)),
        ("LSE", compare(&got.lse, &r.lse, &bl.lse)),
        ("dQ", compare(&packed(&got.dq, lq), &rg.dq, &bg.dq)),
        ("dK", compare(&packed(&got.dk, lk), &rg.dk, &bg.dk)),
        ("dV", compare(&packed(&got.dv, lv), &rg.dv, &bg.dv)),
        ("dsink", compare(&got.dsinks, &r_ds, &b_ds)),
    ];
    Outcome {
        name: c.name(),
        results,
    }
}

fn run_all(group: u64, cases: &[Case]) {
    let mut failed = Vec::new();
    for (i, c) in cases.iter().enumerate() {
        let outcome = match c.dtype {
            F32 => run::<f32>(c, group * 1000 + i as u64),
            F16 => run::<half::f16>(c, group * 1000 + i as u64),
            BF16 => run::<bf16>(c, group * 1000 + i as u64),
            DType::E4M3 => unreachable!("the CPU backend refuses E4M3"),
        };
        println!("sinks {}", outcome.line());
        for (what, cmp) in &outcome.results {
            if !cmp.pass {
                failed.push(format!("{} {what}: {cmp}", outcome.name));
            }
        }
    }
    assert!(failed.is_empty(), "failed:\n{}", failed.join("\n"));
}

/// GQA 4:2 (sinks per query head, each head its own kind of sink); causal with more queries
/// than keys, so that the first rows see no key (O = 0, LSE = the sink); windows; softcap, whose
/// cap the sinks do not take; batches and strided storage.
#[test]
fn sinks_against_the_reference() {
    let mut cases = Vec::new();
    for dtype in [F32, BF16] {
        cases.extend([
            case(1, 113, 113, 4, 2, 64, dtype),
            case(2, 150, 90, 4, 2, 64, dtype).causal(true),
            case(1, 17, 200, 4, 2, 32, dtype),
            case(1, 130, 130, 4, 2, 64, dtype).window(Some(24), Some(8)),
            case(1, 100, 40, 4, 2, 40, dtype).window(Some(0), Some(0)),
            case(1, 113, 113, 4, 2, 64, dtype).causal(true).softcap(5.0),
            case(2, 70, 50, 4, 2, 128, dtype)
                .causal(true)
                .softcap(30.0)
                .storage(Storage::Padded(3)),
            case(3, 33, 33, 8, 2, 64, dtype).storage(Storage::HeadMajor(0)),
        ]);
    }
    cases.push(case(1, 90, 60, 4, 2, 64, F16).causal(true));
    run_all(11, &cases);
}

/// V's head dim apart from Q's and K's with sinks: O, dV and the sinks' gradient (whose D sums
/// over V's head dim) against the reference; causal with more queries than keys (rows without a
/// key), a window, softcap, strided storage.
#[test]
fn sinks_with_v_head_dim_apart() {
    run_all(
        12,
        &[
            case(1, 113, 80, 4, 2, 192, BF16)
                .head_dim_v(128)
                .causal(true),
            case(2, 70, 70, 4, 2, 64, F32)
                .head_dim_v(32)
                .window(Some(16), Some(4)),
            case(1, 50, 90, 4, 1, 40, F16).head_dim_v(72).softcap(5.0),
            case(2, 33, 47, 4, 2, 40, BF16)
                .head_dim_v(72)
                .causal(true)
                .storage(Storage::HeadMajor(8)),
        ],
    );
}

/// Causal with s_q > s_k: the rows that see no key get O = 0 exactly and their head's sink as
/// the LSE exactly; the others an LSE above the sink.
#[test]
fn rows_without_a_key_get_the_sink_as_their_lse() {
    let c = case(2, 40, 15, 4, 2, 32, BF16).causal(true);
    let mut rng = StdRng::seed_from_u64(21);
    let ops = c.random_operands::<bf16>(&mut rng);
    let [lq, ..] = ops.layouts;
    let sinks = [0.75, -3.5, 9.0, -30.0];
    let tensors = ops.tensors();
    let got = forward_backward(&c, tensors, &sinks, true);
    let keys = c.cfg(Backend::Auto).key_rule(c.seqlen_q, c.seqlen_k);
    let mut without = 0;
    for b in 0..c.batch {
        for (h, &sink) in sinks.iter().enumerate() {
            for i in 0..c.seqlen_q {
                let lse = got.lse[(b * c.heads_q + h) * c.seqlen_q + i];
                let off = lq.offset(b, i, h, 0);
                let row = &got.out[off..off + c.head_dim];
                let (lo, hi) = keys.key_range(i);
                if lo >= hi {
                    without += 1;
                    assert_eq!(lse, sink, "b{b} h{h} row {i}");
                    assert!(row.iter().all(|x| x.to_f32() == 0.0), "b{b} h{h} row {i}");
                } else {
                    assert!(lse > sink, "b{b} h{h} row {i}: LSE {lse}");
                }
            }
        }
    }
    assert_eq!(without, c.batch * c.heads_q * (c.seqlen_q - c.seqlen_k));
    assert!(got.dsinks.iter().all(|x| x.is_finite()));
}

/// A sink of −inf weighs nothing: the same bits as the forward and backward without sinks, and
/// a zero gradient. Longer vectors are read up to heads_q. The sinks' gradient, and the rest,
/// repeat bit for bit, and do not depend on whether the gradient is asked for.
#[test]
fn sinks_of_minus_infinity_change_nothing_and_results_repeat() {
    let c = case(2, 50, 30, 4, 2, 64, F32).causal(true);
    let mut rng = StdRng::seed_from_u64(22);
    let ops = c.random_operands::<f32>(&mut rng);
    let [lq, lk, ..] = ops.layouts;
    let [q, k, v, dout] = ops.tensors();
    let cfg = c.cfg(Backend::Auto);
    let none = forward_backward(&c, [q, k, v, dout], &[f32::NEG_INFINITY; 4], true);
    let fwd = flashattn::forward(&cfg, ForwardInputs::new(q, k, v)).unwrap();
    assert_eq!(pack_f32(TensorRef::new(&none.out, lq)), fwd.out);
    assert_eq!(none.lse, fwd.lse);
    let g = flashattn::backward(
        &cfg,
        BackwardInputs {
            q,
            k,
            v,
            out: TensorRef::contiguous(&fwd.out, c.q_shape()),
            dout,
            lse: &fwd.lse,
            sinks: None,
        },
    )
    .unwrap();
    assert_eq!(g.dsinks, None);
    assert_eq!(none.dq, g.dq);
    assert_eq!((&none.dk, &none.dv), (&g.dk, &g.dv));
    assert!(none.dsinks.iter().all(|&x| x == 0.0), "{:?}", none.dsinks);

    let sinks = random_sinks(c.heads_q, &mut rng);
    let first = forward_backward(&c, [q, k, v, dout], &sinks, true);
    let mut longer = sinks.clone();
    longer.extend([f32::NAN, 100.0]);
    let again = forward_backward(&c, [q, k, v, dout], &longer, true);
    assert_eq!(first.out, again.out);
    assert_eq!(first.lse, again.lse);
    assert_eq!(
        (&first.dq, &first.dk, &first.dv),
        (&again.dq, &again.dk, &again.dv)
    );
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&first.dsinks), bits(&again.dsinks));
    assert!(first.dsinks.iter().all(|&x| x != 0.0 && x.is_finite()));

    // Without dsinks: the same dQ, dK, dV.
    let inputs = BackwardInputs {
        q,
        k,
        v,
        out: TensorRef::new(&first.out, lq),
        dout,
        lse: &first.lse,
        sinks: Some(&sinks),
    };
    let [mut dq, mut dk, mut dv] = [lq, lk, lk].map(|l| poisoned::<f32>(&l));
    flashattn::backward_into(
        &cfg,
        inputs,
        GradientsMut {
            dq: TensorMut::new(&mut dq, lq),
            dk: TensorMut::new(&mut dk, lk),
            dv: TensorMut::new(&mut dv, lk),
            dsinks: None,
        },
    )
    .unwrap();
    assert_eq!((&first.dq, &first.dk, &first.dv), (&dq, &dk, &dv));
}

/// The allocating calls with sinks give the bits of the calls into caller-owned buffers: O and
/// the LSE, and dQ, dK, dV with the sinks' gradient.
#[test]
fn allocating_calls_with_sinks_match_the_calls_into_buffers() {
    let c = case(2, 50, 30, 4, 2, 64, BF16).causal(true);
    let mut rng = StdRng::seed_from_u64(25);
    let ops = c.random_operands::<bf16>(&mut rng);
    let [lq, lk, ..] = ops.layouts;
    let [q, k, v, dout] = ops.tensors();
    let sinks = random_sinks(c.heads_q, &mut rng);
    let into = forward_backward(&c, [q, k, v, dout], &sinks, true);
    let cfg = c.cfg(Backend::Auto);
    let fwd = flashattn::forward(&cfg, ForwardInputs::new(q, k, v).with_sinks(&sinks)).unwrap();
    assert_eq!(into.lse, fwd.lse);
    let packed = |x: &[bf16], l: Layout| pack_f32(TensorRef::new(x, l));
    assert_eq!(
        packed(&into.out, lq),
        packed(&fwd.out, Layout::contiguous(c.q_shape()))
    );
    let g = flashattn::backward(
        &cfg,
        BackwardInputs {
            q,
            k,
            v,
            out: TensorRef::contiguous(&fwd.out, c.q_shape()),
            dout,
            lse: &fwd.lse,
            sinks: Some(&sinks),
        },
    )
    .unwrap();
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&into.dsinks), bits(g.dsinks.as_deref().unwrap()));
    assert_eq!(
        packed(&into.dq, lq),
        packed(&g.dq, Layout::contiguous(c.q_shape()))
    );
    assert_eq!(
        packed(&into.dk, lk),
        packed(&g.dk, Layout::contiguous(c.kv_shape()))
    );
    assert_eq!(
        packed(&into.dv, lk),
        packed(&g.dv, Layout::contiguous(c.kv_shape()))
    );
}

/// A NaN or +inf sink makes its head's LSE (and O) NaN, as the math says, and its gradients
/// NaN (dQ of its rows, dK and dV of its KV head, as the GPU's), and nothing panics; the other
/// heads' LSE and sinks' gradient are as with finite sinks alone.
#[test]
fn non_finite_sinks_propagate_without_panics() {
    let c = case(1, 24, 16, 4, 2, 32, F32).causal(true);
    let mut rng = StdRng::seed_from_u64(23);
    let ops = c.random_operands::<f32>(&mut rng);
    let [lq, lk, lv, _] = ops.layouts;
    let tensors = ops.tensors();
    let finite = [0.5, -1.0, 2.0, 0.25];
    let bad = [0.5, f32::NAN, 2.0, f32::INFINITY];
    let want = forward_backward(&c, tensors, &finite, true);
    let got = forward_backward(&c, tensors, &bad, false);
    let sq = c.seqlen_q;
    for (h, sink) in bad.iter().enumerate() {
        let (lse, lse_want) = (&got.lse[h * sq..][..sq], &want.lse[h * sq..][..sq]);
        if sink.is_finite() {
            assert_eq!(lse, lse_want, "head {h}");
            assert_eq!(got.dsinks[h], want.dsinks[h], "head {h}");
        } else {
            assert!(lse.iter().all(|x| x.is_nan()), "head {h}: {lse:?}");
            assert!(got.dsinks[h].is_nan(), "head {h}");
            for i in 0..sq {
                let off = lq.offset(0, i, h, 0);
                assert!(got.out[off..off + c.head_dim].iter().all(|x| x.is_nan()));
                assert!(
                    got.dq[off..off + c.head_dim].iter().all(|x| x.is_nan()),
                    "head {h} dQ"
                );
            }
            let hk = h / (c.heads_q / c.heads_kv);
            for j in 0..c.seqlen_k {
                let (ok, ov) = (lk.offset(0, j, hk, 0), lv.offset(0, j, hk, 0));
                assert!(
                    got.dk[ok..ok + c.head_dim].iter().all(|x| x.is_nan()),
                    "head {h} dK"
                );
                assert!(
                    got.dv[ov..ov + c.head_dim_v].iter().all(|x| x.is_nan()),
                    "head {h} dV"
                );
            }
        }
    }
}

/// Sinks or a dsinks buffer shorter than heads_q: [`Error::BufferTooSmall`] for the operand;
/// dsinks without sinks: [`Error::InvalidConfig`]; nothing written.
#[test]
fn short_sinks_and_dsinks_are_refused() {
    let (b, s, hq, hkv, d) = (1, 8, 4, 2, 16);
    let mut rng = StdRng::seed_from_u64(24);
    let (qv, kv, vv) = (
        random::<f32>(b * s * hq * d, &mut rng),
        random::<f32>(b * s * hkv * d, &mut rng),
        random::<f32>(b * s * hkv * d, &mut rng),
    );
    let (sq, sk) = ([b, s, hq, d], [b, s, hkv, d]);
    let (q, k, v) = (
        TensorRef::contiguous(&qv, sq),
        TensorRef::contiguous(&kv, sk),
        TensorRef::contiguous(&vv, sk),
    );
    let cfg = AttentionConfig::new().causal(true);
    let too_small = |e: Error, operand: Operand, len: usize| {
        assert!(
            matches!(e, Error::BufferTooSmall { operand: o, needed: 4, len: l } if o == operand && l == len),
            "{e:?}"
        );
    };
    let mut out = vec![f32::NAN; qv.len()];
    let mut lse = vec![f32::NAN; b * hq * s];
    for short in [&[][..], &[0.5; 3][..]] {
        let inputs = ForwardInputs::new(q, k, v).with_sinks(short);
        let e =
            flashattn::forward_into(&cfg, inputs, TensorMut::contiguous(&mut out, sq), &mut lse)
                .unwrap_err();
        too_small(e, Operand::Sinks, short.len());
        let e = flashattn::forward(&cfg, inputs).unwrap_err();
        too_small(e, Operand::Sinks, short.len());
    }
    assert!(out.iter().chain(&lse).all(|x| x.is_nan()));

    let sinks = [0.5f32; 4];
    let inputs = ForwardInputs::new(q, k, v).with_sinks(&sinks);
    flashattn::forward_into(&cfg, inputs, TensorMut::contiguous(&mut out, sq), &mut lse).unwrap();
    let inputs = BackwardInputs {
        q,
        k,
        v,
        out: TensorRef::contiguous(&out, sq),
        dout: q,
        lse: &lse,
        sinks: None,
    };
    // The call into fresh poisoned gradients; whether they were left untouched.
    let backward = |sinks: Option<&[f32]>, dsinks: Option<&mut [f32]>| {
        let [mut dq, mut dk, mut dv] = [qv.len(), kv.len(), vv.len()].map(|n| vec![f32::NAN; n]);
        let r = flashattn::backward_into(
            &cfg,
            BackwardInputs { sinks, ..inputs },
            GradientsMut {
                dq: TensorMut::contiguous(&mut dq, sq),
                dk: TensorMut::contiguous(&mut dk, sk),
                dv: TensorMut::contiguous(&mut dv, sk),
                dsinks,
            },
        );
        (r, dq.iter().chain(&dk).chain(&dv).all(|x| x.is_nan()))
    };
    let mut dsinks = vec![f32::NAN; 4];
    let refused = [
        (
            backward(Some(&sinks[..3]), Some(&mut dsinks)),
            Operand::Sinks,
            3,
        ),
        (backward(Some(&sinks[..2]), None), Operand::Sinks, 2),
        (
            backward(Some(&sinks), Some(&mut dsinks[..3])),
            Operand::DSinks,
            3,
        ),
        (
            backward(Some(&sinks), Some(&mut [][..])),
            Operand::DSinks,
            0,
        ),
    ];
    for ((r, untouched), operand, len) in refused {
        too_small(r.unwrap_err(), operand, len);
        assert!(untouched);
    }
    let e = flashattn::backward(
        &cfg,
        BackwardInputs {
            sinks: Some(&sinks[..2]),
            ..inputs
        },
    )
    .unwrap_err();
    too_small(e, Operand::Sinks, 2);
    let (r, untouched) = backward(None, Some(&mut dsinks));
    assert!(matches!(r, Err(Error::InvalidConfig(_))), "{r:?}");
    assert!(untouched);
    assert!(dsinks.iter().all(|x| x.is_nan()));
    let (r, _) = backward(Some(&sinks), Some(&mut dsinks));
    r.unwrap();
    assert!(dsinks.iter().all(|x| x.is_finite()));
}
