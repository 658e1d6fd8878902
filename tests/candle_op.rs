//! `flashattn::candle::flash_attn` on the CPU against attention written with candle ops: the
//! forward in f64, and the gradients of candle's autograd through that f64 attention against
//! those of our op (its fused backward) in f32, under every mask (rows that see no key too),
//! GQA, softcap, odd lengths, V's head dim apart from Q's, and strided or offset views; f16 and
//! bf16 against f32 with their rounding's tolerance.
#![cfg(feature = "candle")]

mod candle_naive;

use candle_core::{DType, Result, Tensor, Var};
use flashattn::candle::{as_flash_error, flash_attn, flash_attn_varlen, flash_attn_with_kvcache};
use flashattn::{AttentionConfig, Error};

use candle_naive::{naive, naive_packed};

/// N(0, 1) values of `shape`, f32 on the CPU, from a seeded generator.
fn randn(shape: &[usize], seed: u64) -> Tensor {
    candle_naive::randn(shape, seed, &candle_core::Device::Cpu)
}

/// max|a − b| over f64 copies.
fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    let a = a.to_dtype(DType::F64).unwrap();
    let b = b.to_dtype(DType::F64).unwrap();
    (&a - &b)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar()
        .unwrap()
}

/// `max|got − want| ≤ rel · max|want| + 1e-6`, over f64 copies.
fn assert_close(got: &Tensor, want: &Tensor, rel: f64, what: &str) {
    assert_eq!(got.dims(), want.dims(), "{what}: shape");
    let err = max_abs_diff(got, want);
    let want = want.to_dtype(DType::F64).unwrap();
    let scale: f64 = want.abs().unwrap().max_all().unwrap().to_scalar().unwrap();
    assert!(scale > 0.0, "{what}: the reference is all zeros");
    assert!(
        err <= rel * scale + 1e-6,
        "{what}: max error {err:.3e} against max |ref| {scale:.3e} (allowed {:.3e})",
        rel * scale + 1e-6
    );
}

/// Q, K and V made of a case's leaves.
type Views = fn(&[Tensor]) -> Result<(Tensor, Tensor, Tensor)>;

/// Leaf tensors of a case and how Q, K and V are made of them (views, for the strided cases).
struct Case {
    leaves: Vec<Tensor>,
    views: Views,
}

impl Case {
    /// Separate Q (b, s_q, h_q, d), K and V (b, s_k, h_kv, d).
    fn packed(b: usize, s_q: usize, s_k: usize, h_q: usize, h_kv: usize, d: usize) -> Case {
        Case::apart([b, s_q, s_k, h_q, h_kv], (d, d))
    }

    /// Separate Q (b, s_q, h_q, d), K (b, s_k, h_kv, d) and V (b, s_k, h_kv, dv).
    fn apart([b, s_q, s_k, h_q, h_kv]: [usize; 5], (d, dv): (usize, usize)) -> Case {
        Case {
            leaves: vec![
                randn(&[b, s_q, h_q, d], 1),
                randn(&[b, s_k, h_kv, d], 2),
                randn(&[b, s_k, h_kv, dv], 3),
            ],
            views: |t| Ok((t[0].clone(), t[1].clone(), t[2].clone())),
        }
    }
}

/// Our op in f32 against the naive attention in f64 over the same values: O, and the gradients
/// of `sum(O · W)` for a random W with respect to every leaf.
fn grad_check(case: &Case, cfg: &AttentionConfig) {
    grad_check_of(case, &|q, k, v| flash_attn(q, k, v, cfg), &|q, k, v| {
        naive(q, k, v, cfg)
    });
}

/// Attention over Q, K and V.
type Attention<'a> = &'a dyn Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>;

/// [`grad_check`] of `ours` (run on f32 leaves) against `reference` (on f64 leaves).
fn grad_check_of(case: &Case, ours: Attention, reference: Attention) {
    // The reference: f64 leaves, candle's autograd.
    let leaves64: Vec<Var> = case
        .leaves
        .iter()
        .map(|t| Var::from_tensor(&t.to_dtype(DType::F64).unwrap()).unwrap())
        .collect();
    let tensors64: Vec<Tensor> = leaves64.iter().map(|v| v.as_tensor().clone()).collect();
    let (q, k, v) = (case.views)(&tensors64).unwrap();
    let want = reference(&q, &k, &v).unwrap();
    let w = randn(want.dims(), 4);
    let want_grads = (&want * w.to_dtype(DType::F64).unwrap())
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();

    // Ours: f32 leaves, the op, its fused backward.
    let leaves: Vec<Var> = case
        .leaves
        .iter()
        .map(|t| Var::from_tensor(t).unwrap())
        .collect();
    let tensors: Vec<Tensor> = leaves.iter().map(|v| v.as_tensor().clone()).collect();
    let (q, k, v) = (case.views)(&tensors).unwrap();
    let got = ours(&q, &k, &v).unwrap();
    assert_eq!(got.dtype(), DType::F32);
    assert_close(&got, &want, 1e-5, "O");
    let grads = (&got * &w).unwrap().sum_all().unwrap().backward().unwrap();

    for (i, (ours, theirs)) in leaves.iter().zip(&leaves64).enumerate() {
        let got = grads.get(ours).expect("a gradient for every leaf");
        let want = want_grads.get(theirs).unwrap();
        assert_close(got, want, 1e-4, &format!("gradient of leaf {i}"));
    }
}

#[test]
fn full_attention_with_odd_lengths_and_gqa() {
    grad_check(&Case::packed(2, 37, 53, 4, 2, 64), &AttentionConfig::new());
}

#[test]
fn causal_bottom_right() {
    grad_check(
        &Case::packed(2, 37, 53, 4, 2, 64),
        &AttentionConfig::new().causal(true),
    );
}

/// V's head dim apart from Q's and K's: O of V's head dim, dV shaped like V (the checks compare
/// shapes first), DeepSeek's MLA's 192/128 causal and a wider V under a window with softcap.
#[test]
fn v_head_dim_apart_from_q() {
    grad_check(
        &Case::apart([1, 37, 53, 4, 2], (192, 128)),
        &AttentionConfig::new().causal(true),
    );
    grad_check(
        &Case::apart([2, 17, 29, 4, 1], (40, 72)),
        &AttentionConfig::new().window(Some(7), Some(3)).softcap(5.0),
    );
    let (q, k, v) = (
        randn(&[1, 5, 2, 16], 5),
        randn(&[1, 7, 2, 16], 6),
        randn(&[1, 7, 2, 8], 7),
    );
    let out = flash_attn(&q, &k, &v, &AttentionConfig::new()).unwrap();
    assert_eq!(out.dims(), &[1, 5, 2, 8]);
}

/// Causal with more queries than keys: bottom-right aligned, the first rows see no key. Their O
/// is 0 and they give no gradient; the other rows are the attention of those rows alone (the
/// reference: the naive attention over them, 0 rows before).
#[test]
fn rows_that_see_no_key() {
    let (b, s_q, s_k, h, d) = (2, 9, 5, 2, 16);
    let seen = s_k; // the last s_k rows see keys
    let cfg = AttentionConfig::new().causal(true);
    let ours = |q: &Tensor, k: &Tensor, v: &Tensor| flash_attn(q, k, v, &cfg);
    let reference = |q: &Tensor, k: &Tensor, v: &Tensor| {
        let o = naive(&q.narrow(1, s_q - seen, seen)?, k, v, &cfg)?;
        let none = Tensor::zeros((b, s_q - seen, h, d), o.dtype(), o.device())?;
        Tensor::cat(&[&none, &o], 1)
    };
    grad_check_of(&Case::packed(b, s_q, s_k, h, h, d), &ours, &reference);
}

#[test]
fn sliding_window() {
    let case = Case::packed(1, 37, 53, 4, 2, 64);
    grad_check(&case, &AttentionConfig::new().window(Some(7), Some(3)));
    grad_check(&case, &AttentionConfig::new().window(Some(10), Some(0)));
}

#[test]
fn softcap_with_causal_mask() {
    grad_check(
        &Case::packed(1, 37, 53, 4, 2, 64),
        &AttentionConfig::new().causal(true).softcap(5.0),
    );
}

#[test]
fn multi_query_and_own_scale() {
    grad_check(
        &Case::packed(2, 19, 41, 4, 1, 32),
        &AttentionConfig::new().softmax_scale(0.3),
    );
}

#[test]
fn strided_views_read_in_place() {
    // Q, K, V stored (b, h, s, d) and transposed to (b, s, h, d): non-packed strides with a unit
    // head-dim stride, which the op reads as they are.
    let case = Case {
        leaves: vec![
            randn(&[2, 4, 37, 64], 5),
            randn(&[2, 2, 53, 64], 6),
            randn(&[2, 2, 53, 64], 7),
        ],
        views: |t| {
            Ok((
                t[0].transpose(1, 2)?,
                t[1].transpose(1, 2)?,
                t[2].transpose(1, 2)?,
            ))
        },
    };
    let (q, _, _) = (case.views)(&case.leaves).unwrap();
    assert!(!q.is_contiguous());
    grad_check(&case, &AttentionConfig::new().causal(true));
}

#[test]
fn views_without_unit_head_dim_stride_are_copied() {
    // Stored (b, s, d, h): the head dim has stride h, so the op reads a packed copy.
    let case = Case {
        leaves: vec![
            randn(&[1, 37, 64, 4], 8),
            randn(&[1, 53, 64, 2], 9),
            randn(&[1, 53, 64, 2], 10),
        ],
        views: |t| {
            Ok((
                t[0].transpose(2, 3)?,
                t[1].transpose(2, 3)?,
                t[2].transpose(2, 3)?,
            ))
        },
    };
    grad_check(&case, &AttentionConfig::new().window(Some(9), Some(2)));
}

#[test]
fn views_of_one_packed_qkv_tensor() {
    // One projection output (b, s, 3·h, d), Q, K and V cut from it: start offsets and a heads
    // stride of 3·h·d; the gradients meet in the packed tensor.
    let case = Case {
        leaves: vec![randn(&[2, 29, 9, 32], 11)],
        views: |t| {
            Ok((
                t[0].narrow(2, 0, 3)?,
                t[0].narrow(2, 3, 3)?,
                t[0].narrow(2, 6, 3)?,
            ))
        },
    };
    grad_check(&case, &AttentionConfig::new().causal(true));
}

#[test]
fn a_broadcast_output_gradient_and_two_backward_passes() {
    // `sum(O)` makes dO a broadcast of ones (zero strides); a second backward of the same graph
    // uses the LSE the op kept.
    let (q, k, v) = (
        Var::from_tensor(&randn(&[1, 21, 2, 16], 12)).unwrap(),
        Var::from_tensor(&randn(&[1, 21, 2, 16], 13)).unwrap(),
        Var::from_tensor(&randn(&[1, 21, 2, 16], 14)).unwrap(),
    );
    let cfg = AttentionConfig::new().causal(true);
    let out = flash_attn(&q, &k, &v, &cfg).unwrap();
    let loss = out.sum_all().unwrap();
    let first = loss.backward().unwrap();
    let second = loss.backward().unwrap();

    let to64 = |t: &Var| Var::from_tensor(&t.to_dtype(DType::F64).unwrap()).unwrap();
    let (q64, k64, v64) = (to64(&q), to64(&k), to64(&v));
    let want = naive(&q64, &k64, &v64, &cfg)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    for (ours, theirs) in [(&q, &q64), (&k, &k64), (&v, &v64)] {
        let got = first.get(ours).unwrap();
        assert_close(got, want.get(theirs).unwrap(), 1e-4, "gradient of sum(O)");
        let again = second.get(ours).unwrap();
        assert_close(again, got, 0.0, "the second backward");
    }
}

#[test]
fn half_precision_forward_and_backward() {
    let cfg = AttentionConfig::new().causal(true);
    let shapes = [[1, 37, 4, 64], [1, 53, 2, 64], [1, 53, 2, 64]];
    for dtype in [DType::BF16, DType::F16] {
        // The same rounded values in both: the error left is the op's arithmetic and the
        // rounding of its outputs.
        let leaves: Vec<Tensor> = shapes
            .iter()
            .zip(20..)
            .map(|(s, seed)| randn(s, seed).to_dtype(dtype).unwrap())
            .collect();
        let vars: Vec<Var> = leaves
            .iter()
            .map(|t| Var::from_tensor(t).unwrap())
            .collect();
        let vars64: Vec<Var> = leaves
            .iter()
            .map(|t| Var::from_tensor(&t.to_dtype(DType::F64).unwrap()).unwrap())
            .collect();
        let got = flash_attn(&vars[0], &vars[1], &vars[2], &cfg).unwrap();
        assert_eq!(got.dtype(), dtype);
        let want = naive(&vars64[0], &vars64[1], &vars64[2], &cfg).unwrap();
        let label = format!("{dtype:?}");
        assert_close(&got, &want, 1e-2, &format!("{label} O"));

        // W rounded to the dtype: candle hands our op dO = W in the dtype, and the reference
        // the same values.
        let w = randn(got.dims(), 4)
            .to_dtype(dtype)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap();
        let grads = (got.to_dtype(DType::F32).unwrap() * &w)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let want_grads = (want * w.to_dtype(DType::F64).unwrap())
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        for (i, (ours, theirs)) in vars.iter().zip(&vars64).enumerate() {
            let got = grads.get(ours).unwrap();
            assert_eq!(got.dtype(), dtype);
            let want = want_grads.get(theirs).unwrap();
            assert_close(got, want, 3e-2, &format!("{label} gradient of leaf {i}"));
        }
    }
}

#[test]
fn bad_calls_are_errors() {
    let cfg = AttentionConfig::new();
    let q = randn(&[1, 8, 3, 16], 30);
    let k = randn(&[1, 8, 2, 16], 31);
    // Three query heads over two KV heads: this crate's typed error, inside candle's.
    let e = flash_attn(&q, &k, &k, &cfg).unwrap_err();
    assert!(
        matches!(
            as_flash_error(&e),
            Some(Error::HeadsNotMultiple {
                heads_q: 3,
                heads_kv: 2
            })
        ),
        "{e}"
    );
    // A rank other than 4, mixed dtypes, f64: refused before the op runs.
    let flat = q.flatten_to(1).unwrap();
    assert!(flash_attn(&flat, &flat, &flat, &cfg).is_err());
    let k16 = q.to_dtype(DType::BF16).unwrap();
    assert!(flash_attn(&q, &k16, &k16, &cfg).is_err());
    let q64 = q.to_dtype(DType::F64).unwrap();
    let e = flash_attn(&q64, &q64, &q64, &cfg).unwrap_err();
    assert!(as_flash_error(&e).is_none(), "{e}");
    // V of another seqlen than K's: this crate's typed error, naming V.
    let v = randn(&[1, 9, 2, 8], 32);
    let e = flash_attn(&q, &k, &v, &cfg).unwrap_err();
    assert!(
        matches!(
            as_flash_error(&e),
            Some(Error::ShapeMismatch {
                operand: flashattn::Operand::V,
                ..
            })
        ),
        "{e}"
    );
    // A backend other than the CPU for CPU tensors: the dispatcher's refusal.
    let gpu = AttentionConfig::new().backend(flashattn::Backend::Sm90);
    let e = flash_attn(&q, &q, &q, &gpu).unwrap_err();
    assert!(as_flash_error(&e).is_some(), "{e}");
}

/// A packed batch through `flash_attn_varlen` against the naive attention of each sequence on
/// its own rows (f64), O and every gradient: sequences of different lengths, one with no
/// queries, GQA, under `cfg`, Q and K of head dim `d`, V of `dv`.
fn varlen_check(cfg: &AttentionConfig, (d, dv): (usize, usize)) {
    let (lens_q, lens_k) = ([5u32, 0, 17, 1, 33], [9u32, 4, 17, 3, 40]);
    let (h_q, h_kv) = (4, 2);
    let offsets = |lens: &[u32]| -> Vec<u32> {
        std::iter::once(0)
            .chain(lens.iter().scan(0, |acc, &l| {
                *acc += l;
                Some(*acc)
            }))
            .collect()
    };
    let (cu_q, cu_k) = (offsets(&lens_q), offsets(&lens_k));
    let (total_q, total_k) = (cu_q[5] as usize, cu_k[5] as usize);
    let case = Case {
        leaves: vec![
            randn(&[total_q, h_q, d], 40),
            randn(&[total_k, h_kv, d], 41),
            randn(&[total_k, h_kv, dv], 42),
        ],
        views: |t| Ok((t[0].clone(), t[1].clone(), t[2].clone())),
    };
    let dev = candle_core::Device::Cpu;
    let (cu_q_t, cu_k_t) = (
        Tensor::new(cu_q.as_slice(), &dev).unwrap(),
        Tensor::new(cu_k.as_slice(), &dev).unwrap(),
    );
    grad_check_of(
        &case,
        &|q, k, v| flash_attn_varlen(q, k, v, &cu_q_t, &cu_k_t, 33, 40, cfg),
        &|q, k, v| naive_packed(q, k, v, &cu_q, &cu_k, cfg),
    );
}

#[test]
fn packed_sequences_causal() {
    varlen_check(&AttentionConfig::new().causal(true), (32, 32));
}

#[test]
fn packed_sequences_windowed_with_softcap() {
    varlen_check(
        &AttentionConfig::new().window(Some(6), Some(2)).softcap(4.0),
        (32, 32),
    );
}

#[test]
fn packed_sequences_with_v_head_dim_apart() {
    varlen_check(&AttentionConfig::new().causal(true), (192, 128));
    varlen_check(&AttentionConfig::new().window(Some(6), Some(2)), (24, 40));
}

#[test]
fn packed_calls_with_bad_offsets_are_errors() {
    let dev = candle_core::Device::Cpu;
    let cfg = AttentionConfig::new();
    let q = randn(&[8, 2, 16], 50);
    let call = |cu: &[u32], max: usize| {
        let cu = Tensor::new(cu, &dev).unwrap();
        flash_attn_varlen(&q, &q, &q, &cu, &cu, max, max, &cfg)
    };
    assert!(call(&[0, 5, 8], 5).is_ok());
    // Decreasing offsets, a length above the maximum, a last offset past the rows: typed errors.
    for (cu, max) in [(&[0u32, 5, 3][..], 5), (&[0, 5, 8], 4), (&[0, 5, 9], 5)] {
        let e = call(cu, max).unwrap_err();
        assert!(as_flash_error(&e).is_some(), "{cu:?} max {max}: {e}");
    }
    // An offset past i32::MAX: a typed error, not a wrapped-around one.
    let e = call(&[0, 5, 1 << 31], 5).unwrap_err();
    assert!(
        matches!(as_flash_error(&e), Some(Error::InvalidSeqlens(_))),
        "{e}"
    );
    // i32 offsets: the same call.
    let cu32 = Tensor::new(&[0i32, 5, 8], &dev).unwrap();
    let a = flash_attn_varlen(&q, &q, &q, &cu32, &cu32, 5, 5, &cfg).unwrap();
    let b = call(&[0, 5, 8], 5).unwrap();
    assert_eq!(max_abs_diff(&a, &b), 0.0, "i32 and u32 offsets");
    // Offsets of the wrong dtype or rank, Q of rank 4: refused before the op runs.
    let f = Tensor::new(&[0f32, 5., 8.], &dev).unwrap();
    assert!(flash_attn_varlen(&q, &q, &q, &f, &f, 5, 5, &cfg).is_err());
    let q4 = q.unsqueeze(0).unwrap();
    let cu = Tensor::new(&[0u32, 5, 8], &dev).unwrap();
    assert!(flash_attn_varlen(&q4, &q4, &q4, &cu, &cu, 5, 5, &cfg).is_err());
}

/// Sequence `b`'s first `len` rows of a cache: its dense entry, or its pages (`table` row `b`
/// of `max_pages`) laid end to end; `(1, len, heads, d)`.
fn cache_rows(cache: &Tensor, table: Option<(&[u32], usize)>, b: usize, len: usize) -> Tensor {
    match table {
        None => cache.narrow(0, b, 1).unwrap().narrow(1, 0, len).unwrap(),
        Some((t, max_pages)) => {
            let pages: Vec<Tensor> = t[b * max_pages..(b + 1) * max_pages]
                .iter()
                .map(|&p| cache.narrow(0, p as usize, 1).unwrap())
                .collect();
            Tensor::cat(&pages, 1).unwrap().narrow(1, 0, len).unwrap()
        }
    }
}

/// `flash_attn_with_kvcache` over dense and paged caches (pages out of order, of 16 rows) equals,
/// sequence by sequence, `flash_attn` over that sequence's cached keys (under the same
/// bottom-right mask); bf16 equals the host KV-cache call bit for bit; u32 and i32 counts agree.
#[test]
fn kvcache_attention_equals_attention_over_each_sequences_keys() {
    let (hq, hk, d, seqlen_q) = (8, 2, 64, 3);
    let lens = [5u32, 48, 0, 33];
    let batch = lens.len();
    let q = randn(&[batch, seqlen_q, hq, d], 60);
    let dense_k = randn(&[batch, 48, hk, d], 61);
    let dense_v = randn(&[batch, 48, hk, d], 62);
    // 16 pages of 16 rows, 3 a sequence, out of order.
    let (pages, max_pages) = (16usize, 3usize);
    let table: Vec<u32> = (0..(batch * max_pages) as u32)
        .map(|i| (i * 5 + 2) % pages as u32)
        .collect();
    let paged_k = randn(&[pages, 16, hk, d], 63);
    let paged_v = randn(&[pages, 16, hk, d], 64);
    let dev = candle_core::Device::Cpu;
    let lens_t = Tensor::new(&lens[..], &dev).unwrap();
    let table_t = Tensor::from_vec(table.clone(), (batch, max_pages), &dev).unwrap();
    for cfg in [
        AttentionConfig::new(),
        AttentionConfig::new().causal(true),
        AttentionConfig::new().window(Some(7), Some(0)),
    ] {
        for (k, v, paged) in [(&dense_k, &dense_v, false), (&paged_k, &paged_v, true)] {
            let what = format!("{:?}, paged {paged}", cfg.mask);
            let table_arg = paged.then_some(&table_t);
            let o = flash_attn_with_kvcache(&q, k, v, &lens_t, table_arg, &cfg).unwrap();
            assert_eq!(o.dims(), &[batch, seqlen_q, hq, d], "{what}");
            for (b, &len) in lens.iter().enumerate() {
                let got = o.narrow(0, b, 1).unwrap();
                if len == 0 {
                    assert_eq!(
                        got.abs()
                            .unwrap()
                            .max_all()
                            .unwrap()
                            .to_scalar::<f32>()
                            .unwrap(),
                        0.0
                    );
                    continue;
                }
                let t = paged.then_some((&table[..], max_pages));
                let (kb, vb) = (
                    cache_rows(k, t, b, len as usize),
                    cache_rows(v, t, b, len as usize),
                );
                let want = flash_attn(&q.narrow(0, b, 1).unwrap(), &kb, &vb, &cfg).unwrap();
                assert_close(&got, &want, 1e-5, &format!("{what}, sequence {b}"));
            }
            // i32 counts and table: the same call.
            let lens32: Vec<i32> = lens.iter().map(|&l| l as i32).collect();
            let lens32 = Tensor::new(&lens32[..], &dev).unwrap();
            let again = flash_attn_with_kvcache(&q, k, v, &lens32, table_arg, &cfg).unwrap();
            assert_eq!(max_abs_diff(&o, &again), 0.0, "{what}: again");
        }
    }
    // bf16: the host call, bit for bit.
    let bf = |t: &Tensor| t.to_dtype(DType::BF16).unwrap();
    let (qb, kb, vb) = (bf(&q), bf(&paged_k), bf(&paged_v));
    let lens_i32: Vec<i32> = lens.iter().map(|&l| l as i32).collect();
    let table_i32: Vec<i32> = table.iter().map(|&p| p as i32).collect();
    let lens_i = Tensor::new(&lens_i32[..], &dev).unwrap();
    let table_i = Tensor::from_vec(table_i32.clone(), (batch, max_pages), &dev).unwrap();
    let cfg = AttentionConfig::new().causal(true);
    let got = flash_attn_with_kvcache(&qb, &kb, &vb, &lens_i, Some(&table_i), &cfg).unwrap();
    let host = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<half::bf16>().unwrap();
    let (qh, kh, vh) = (host(&qb), host(&kb), host(&vb));
    let want = flashattn::kvcache::forward(
        &cfg,
        flashattn::kvcache::KvCacheInputs::new(
            flashattn::TensorRef::contiguous(&qh, [batch, seqlen_q, hq, d]),
            flashattn::kvcache::KvCache::paged(
                flashattn::TensorRef::contiguous(&kh, [pages, 16, hk, d]),
                flashattn::TensorRef::contiguous(&vh, [pages, 16, hk, d]),
                &table_i32,
                max_pages,
            ),
            &lens_i32,
        ),
    )
    .unwrap();
    let bits = |x: &[half::bf16]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert_eq!(
        bits(&host(&got)),
        bits(&want.out),
        "bf16 against the host call"
    );
}

/// Bad KV-cache calls: counts of another dtype or rank, a block table of rank 1, Q of another
/// dtype than the cache (refused before the op runs); a page number past the cache and a count
/// past the capacity (typed errors of the host call).
#[test]
fn bad_kvcache_calls_are_errors() {
    let dev = candle_core::Device::Cpu;
    let cfg = AttentionConfig::new();
    let q = randn(&[2, 1, 4, 32], 70);
    let k = randn(&[4, 16, 2, 32], 71);
    let lens = Tensor::new(&[3u32, 16], &dev).unwrap();
    let table = Tensor::new(&[[0u32, 1], [2, 3]], &dev).unwrap();
    assert!(flash_attn_with_kvcache(&q, &k, &k, &lens, Some(&table), &cfg).is_ok());
    let f = Tensor::new(&[3f32, 16.], &dev).unwrap();
    assert!(flash_attn_with_kvcache(&q, &k, &k, &f, Some(&table), &cfg).is_err());
    let flat = table.flatten_all().unwrap();
    assert!(flash_attn_with_kvcache(&q, &k, &k, &lens, Some(&flat), &cfg).is_err());
    let q16 = q.to_dtype(DType::F16).unwrap();
    assert!(flash_attn_with_kvcache(&q16, &k, &k, &lens, Some(&table), &cfg).is_err());
    // Sequence 1's keys 16.. on its second page, page 9 of 4.
    let past = Tensor::new(&[[0u32, 1], [2, 9]], &dev).unwrap();
    let lens20 = Tensor::new(&[3u32, 20], &dev).unwrap();
    let e = flash_attn_with_kvcache(&q, &k, &k, &lens20, Some(&past), &cfg).unwrap_err();
    assert!(
        matches!(as_flash_error(&e), Some(Error::InvalidPageTable(_))),
        "{e}"
    );
    let long = Tensor::new(&[3u32, 33], &dev).unwrap();
    let e = flash_attn_with_kvcache(&q, &k, &k, &long, Some(&table), &cfg).unwrap_err();
    assert!(as_flash_error(&e).is_some(), "{e}");
    // A table or counts of other rows than the sequences: refused before the op runs.
    let three = Tensor::new(&[[0u32, 1], [2, 3], [0, 1]], &dev).unwrap();
    assert!(flash_attn_with_kvcache(&q, &k, &k, &lens, Some(&three), &cfg).is_err());
    let lens3 = Tensor::new(&[3u32, 16, 1], &dev).unwrap();
    assert!(flash_attn_with_kvcache(&q, &k, &k, &lens3, Some(&table), &cfg).is_err());
}

/// The counts as a narrowed view (an offset into their storage) and Q as a transposed view: the
/// same results as contiguous copies of them.
#[test]
fn kvcache_views_read_as_their_values() {
    let dev = candle_core::Device::Cpu;
    let cfg = AttentionConfig::new().causal(true);
    let k = randn(&[2, 32, 2, 32], 80);
    let v = randn(&[2, 32, 2, 32], 81);
    // Q (2, 3, 4, 32) as a transpose of (2, 4, 3, 32).
    let q_t = randn(&[2, 4, 3, 32], 82).transpose(1, 2).unwrap();
    let q = q_t.contiguous().unwrap();
    let all = Tensor::new(&[7u32, 5, 30, 9], &dev).unwrap();
    let lens_view = all.narrow(0, 1, 2).unwrap();
    let lens = Tensor::new(&[5u32, 30], &dev).unwrap();
    let want = flash_attn_with_kvcache(&q, &k, &v, &lens, None, &cfg).unwrap();
    let got = flash_attn_with_kvcache(&q_t, &k, &v, &lens_view, None, &cfg).unwrap();
    assert_eq!(max_abs_diff(&got, &want), 0.0);
}
