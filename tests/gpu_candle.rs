//! `flashattn::candle::flash_attn`, `flash_attn_varlen` and `flash_attn_with_kvcache` on a candle
//! CUDA device, bf16, against
//! attention written with candle ops on the GPU, under the correctness rule of
//! docs/ARCHITECTURE.md: the reference is that attention in f32 over the same rounded inputs (and
//! its autograd for dQ, dK, dV), the baseline the same attention in bf16; O and every gradient
//! must be within twice the baseline's error of the reference. `#[ignore]`d: run on the device
//! with `--include-ignored` (each test fails without a GPU).
#![cfg(feature = "candle-cuda")]

mod candle_naive;

use candle_core::{DType, Device, Result, Tensor, Var};
use flashattn::candle::{flash_attn, flash_attn_varlen, flash_attn_with_kvcache};
use flashattn::reference::compare;
use flashattn::AttentionConfig;

use candle_naive::{naive, naive_packed, randn};

fn gpu() -> Device {
    Device::new_cuda(0).expect("a CUDA device (run these tests on the GPU machine)")
}

fn host_f32(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

fn host_f64(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// Q, K and V made of a case's leaves.
type Views = fn(&[Tensor]) -> Result<(Tensor, Tensor, Tensor)>;

fn separate(t: &[Tensor]) -> Result<(Tensor, Tensor, Tensor)> {
    Ok((t[0].clone(), t[1].clone(), t[2].clone()))
}

/// O and the gradients of `sum(O · W)` with respect to `leaves` (as `dtype` leaves), with
/// `attention` over the views of them.
fn run(
    leaves: &[Tensor],
    dtype: DType,
    views: Views,
    w: &Tensor,
    attention: impl Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>,
) -> (Tensor, Vec<Tensor>) {
    let vars: Vec<Var> = leaves
        .iter()
        .map(|t| Var::from_tensor(&t.to_dtype(dtype).unwrap()).unwrap())
        .collect();
    let tensors: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let (q, k, v) = views(&tensors).unwrap();
    let out = attention(&q, &k, &v).unwrap();
    let grads = (out.to_dtype(DType::F32).unwrap() * w)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let grads = vars
        .iter()
        .map(|v| grads.get(v).expect("a gradient for every leaf").clone())
        .collect();
    (out, grads)
}

/// Our op in bf16 against the reference (f32) and the baseline (bf16) of the naive attention
/// over the same bf16-rounded leaves, forward and gradients.
fn check(label: &str, shapes: &[&[usize]], views: Views, cfg: &AttentionConfig) {
    check_op(
        label,
        shapes,
        views,
        &|q, k, v| flash_attn(q, k, v, cfg),
        &|q, k, v| naive(q, k, v, cfg),
    );
}

/// Attention over Q, K and V.
type Attention<'a> = &'a dyn Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>;

/// [`check`] of `ours` against `reference`.
fn check_op(label: &str, shapes: &[&[usize]], views: Views, ours: Attention, reference: Attention) {
    let dev = gpu();
    let leaves: Vec<Tensor> = shapes
        .iter()
        .zip(1..)
        .map(|(s, seed)| {
            randn(s, seed, &dev)
                .to_dtype(DType::BF16)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap()
        })
        .collect();
    let (q, _, _) = views(&leaves).unwrap();
    // W rounded to bf16, so that every run gets the same dO.
    let w = randn(q.dims(), 99, &dev)
        .to_dtype(DType::BF16)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap();

    let (got, got_grads) = run(&leaves, DType::BF16, views, &w, ours);
    assert_eq!(got.dtype(), DType::BF16);
    let (want, want_grads) = run(&leaves, DType::F32, views, &w, reference);
    let (base, base_grads) = run(&leaves, DType::BF16, views, &w, reference);

    let c = compare(&host_f32(&got), &host_f64(&want), &host_f32(&base));
    assert!(c.pass, "{label} O: {c}");
    for (i, ((g, r), b)) in got_grads
        .iter()
        .zip(&want_grads)
        .zip(&base_grads)
        .enumerate()
    {
        assert_eq!(g.dtype(), DType::BF16);
        assert_eq!(g.dims(), leaves[i].dims());
        let c = compare(&host_f32(g), &host_f64(r), &host_f32(b));
        assert!(c.pass, "{label} gradient of leaf {i}: {c}");
    }
}

#[test]
#[ignore]
fn bf16_masks_and_gqa() {
    for d in [64, 128] {
        let shapes: [&[usize]; 3] = [&[2, 300, 8, d], &[2, 517, 2, d], &[2, 517, 2, d]];
        for (name, cfg) in [
            ("full", AttentionConfig::new()),
            ("causal", AttentionConfig::new().causal(true)),
            ("window", AttentionConfig::new().window(Some(96), Some(32))),
        ] {
            check(&format!("d{d} {name}"), &shapes, separate, &cfg);
        }
    }
}

#[test]
#[ignore]
fn bf16_softcap() {
    let shapes: [&[usize]; 3] = [&[1, 256, 4, 128], &[1, 384, 4, 128], &[1, 384, 4, 128]];
    let cfg = AttentionConfig::new().causal(true).softcap(30.0);
    check("softcap", &shapes, separate, &cfg);
}

#[test]
#[ignore]
fn bf16_strided_and_packed_views() {
    // Stored (b, h, s, d), read as (b, s, h, d) in place.
    let shapes: [&[usize]; 3] = [&[2, 8, 200, 64], &[2, 4, 333, 64], &[2, 4, 333, 64]];
    let transposed: Views = |t| {
        Ok((
            t[0].transpose(1, 2)?,
            t[1].transpose(1, 2)?,
            t[2].transpose(1, 2)?,
        ))
    };
    check(
        "transposed",
        &shapes,
        transposed,
        &AttentionConfig::new().causal(true),
    );
    // One (b, s, 3·h, d) projection output, Q, K, V cut from it at 16-byte aligned offsets.
    let packed: Views = |t| {
        Ok((
            t[0].narrow(2, 0, 4)?,
            t[0].narrow(2, 4, 4)?,
            t[0].narrow(2, 8, 4)?,
        ))
    };
    check(
        "packed qkv",
        &[&[2, 257, 12, 128]],
        packed,
        &AttentionConfig::new().causal(true),
    );
}

#[test]
#[ignore]
fn bf16_packed_sequences() {
    // Five sequences: 300 x 300, 1 query over 3 keys, no queries over 5 keys, 129 x 200, 77 x 77.
    let (cu_q, cu_k): (&[u32], &[u32]) =
        (&[0, 300, 301, 301, 430, 507], &[0, 300, 303, 308, 508, 585]);
    for d in [64, 128] {
        let shapes: [&[usize]; 3] = [&[507, 8, d], &[585, 2, d], &[585, 2, d]];
        for (name, cfg) in [
            ("causal", AttentionConfig::new().causal(true)),
            ("window", AttentionConfig::new().window(Some(40), Some(8))),
        ] {
            check_op(
                &format!("packed d{d} {name}"),
                &shapes,
                separate,
                // The offsets on Q's device (a candle device is one stream).
                &|q, k, v| {
                    let (cq, ck) = (
                        Tensor::new(cu_q, q.device())?,
                        Tensor::new(cu_k, q.device())?,
                    );
                    flash_attn_varlen(q, k, v, &cq, &ck, 300, 300, &cfg)
                },
                &|q, k, v| naive_packed(q, k, v, cu_q, cu_k, &cfg),
            );
        }
    }
}

#[test]
#[ignore]
fn f32_is_refused_with_the_dispatchers_error() {
    let dev = gpu();
    let q = randn(&[1, 64, 2, 64], 1, &dev);
    let e = flash_attn(&q, &q, &q, &AttentionConfig::new()).unwrap_err();
    assert!(flashattn::candle::as_flash_error(&e).is_some(), "{e}");
}

/// `flash_attn_with_kvcache` on the GPU over a dense cache and a paged one (pages of 16 rows, out
/// of order): each sequence's O against the naive attention over its cached keys (reference in
/// f32, baseline in bf16, the same bf16-rounded values).
#[test]
#[ignore]
fn bf16_kvcache_attention() {
    let dev = gpu();
    let (hq, hk, d, seqlen_q) = (8, 2, 128, 2);
    // At least seqlen_q keys where any (the causal rows see some), and an empty sequence.
    let lens = [5u32, 48, 2, 33, 0];
    let batch = lens.len();
    let rounded = |shape: &[usize], seed| {
        randn(shape, seed, &dev)
            .to_dtype(DType::BF16)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
    };
    let q = rounded(&[batch, seqlen_q, hq, d], 1);
    let (pages, max_pages) = (16usize, 3usize);
    let table: Vec<u32> = (0..(batch * max_pages) as u32)
        .map(|i| (i * 5 + 2) % pages as u32)
        .collect();
    let lens_t = Tensor::new(&lens[..], &dev).unwrap();
    let table_t = Tensor::from_vec(table.clone(), (batch, max_pages), &dev).unwrap();
    let cfg = AttentionConfig::new().causal(true);
    for paged in [false, true] {
        let shape = if paged {
            [pages, 16, hk, d]
        } else {
            [batch, 48, hk, d]
        };
        let (k, v) = (rounded(&shape, 2), rounded(&shape, 3));
        let bf = |t: &Tensor| t.to_dtype(DType::BF16).unwrap();
        let o = flash_attn_with_kvcache(
            &bf(&q),
            &bf(&k),
            &bf(&v),
            &lens_t,
            paged.then_some(&table_t),
            &cfg,
        )
        .unwrap();
        for (b, &len) in lens.iter().enumerate() {
            let got = o.narrow(0, b, 1).unwrap();
            if len == 0 {
                let zero = host_f32(&got).iter().all(|&x| x == 0.0);
                assert!(zero, "paged {paged}, sequence {b}: no keys, O not 0");
                continue;
            }
            let rows = |c: &Tensor| {
                if paged {
                    let p: Vec<Tensor> = table[b * max_pages..(b + 1) * max_pages]
                        .iter()
                        .map(|&p| c.narrow(0, p as usize, 1).unwrap())
                        .collect();
                    Tensor::cat(&p, 1)
                        .unwrap()
                        .narrow(1, 0, len as usize)
                        .unwrap()
                } else {
                    c.narrow(0, b, 1)
                        .unwrap()
                        .narrow(1, 0, len as usize)
                        .unwrap()
                }
            };
            let (qb, kb, vb) = (q.narrow(0, b, 1).unwrap(), rows(&k), rows(&v));
            let want = naive(&qb, &kb, &vb, &cfg).unwrap();
            let base = naive(&bf(&qb), &bf(&kb), &bf(&vb), &cfg).unwrap();
            let c = compare(&host_f32(&got), &host_f64(&want), &host_f32(&base));
            assert!(c.pass, "paged {paged}, sequence {b} ({len} keys): {c}");
        }
    }
}
