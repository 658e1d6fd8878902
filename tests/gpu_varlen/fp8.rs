//! The FP8 forward on packed batches: the quantize step gives every sequence descale blocks of
//! its own, so each sequence's O and LSE must be the dense FP8 forward's on its rows alone, bit
//! for bit; so must e4m3 inputs quantized on the host with their descales in that packed
//! layout, whose wrong lengths are typed errors. Sequences without keys get O = 0 and LSE =
//! +inf, rows no sequence owns stay poisoned, and malformed offsets stay inside the buffers.

use std::sync::Arc;

use cudarc::driver::CudaSlice;
use flashattn::cuda::{
    fp8_key_block, fp8_query_block, CudaStream, CudaViewMut, Device, DeviceForwardInputs,
    DeviceSeqlens, DeviceTensor, DeviceTensorMut, Fp8ForwardInputs, Fp8Options,
};
use flashattn::fp8::{Fp8Tensor, Granularity};
use flashattn::unstable::{Sm90Schedule, TailSplit};
use flashattn::{AttentionConfig, Error, Operand, Plan, TensorRef};
use float8::F8E4M3;
use half::bf16;

use super::common::device;
use super::harness::varlen::{offsets, rows, Batch};

/// Empty query and key sequences, one row, several query tiles and key blocks (192 keys at d64,
/// 256 at d128, 128 at d256), none a block multiple; the last query rows belong to no sequence.
const FP8_Q: [usize; 7] = [37, 0, 1, 300, 130, 5, 77];
const FP8_K: [usize; 7] = [37, 12, 3, 500, 460, 0, 200];
const UNOWNED_Q: usize = 9;

/// O (bf16, NaN-poisoned) and the LSE of one FP8 forward.
struct Fp8Out {
    out: Vec<bf16>,
    lse: Vec<f32>,
}

/// Offsets of a packed call (queries, keys) and its maxima, as given (well formed or not).
type Packing<'a> = ((&'a [i32], &'a [i32]), (usize, usize));

/// Runs `forward` into O (bf16) of Q's shape `q_shape` and its LSE, both poisoned with NaN
/// before it, and downloads them.
fn into_poisoned(
    stream: &Arc<CudaStream>,
    q_shape: [usize; 4],
    forward: impl FnOnce(&mut DeviceTensorMut<bf16>, &mut CudaViewMut<f32>) -> flashattn::Result<Plan>,
) -> flashattn::Result<Fp8Out> {
    let mut out: CudaSlice<bf16> = stream
        .clone_htod(&vec![bf16::NAN; q_shape.iter().product()])
        .unwrap();
    let mut lse = stream
        .clone_htod(&vec![f32::NAN; q_shape[0] * q_shape[1] * q_shape[2]])
        .unwrap();
    forward(
        &mut DeviceTensorMut::contiguous(&mut out, q_shape),
        &mut lse.as_view_mut(),
    )?;
    let got = Fp8Out {
        out: stream.clone_dtoh(&out).unwrap(),
        lse: stream.clone_dtoh(&lse).unwrap(),
    };
    stream.synchronize().unwrap();
    Ok(got)
}

/// `f` over the sequences of `packing`, its offsets uploaded to the device.
fn with_seqs<R>(
    stream: &Arc<CudaStream>,
    ((cu_q, cu_k), max): Packing,
    f: impl FnOnce(&DeviceSeqlens) -> flashattn::Result<R>,
) -> flashattn::Result<R> {
    let (cu_q, cu_k) = (up_i32(stream, cu_q), up_i32(stream, cu_k));
    let seqs = DeviceSeqlens::new(cu_q.as_view(), cu_k.as_view(), max.0, max.1)?;
    f(&seqs)
}

/// The FP8 forward over host tensors Q `shapes[0]`, K and V `shapes[1]`: packed with `packing`,
/// else dense; O (bf16) and the LSE poisoned with NaN before it, downloaded after.
fn fp8_forward(
    dev: &Device,
    stream: &Arc<CudaStream>,
    [q, k, v]: [&[bf16]; 3],
    [q_shape, k_shape]: [[usize; 4]; 2],
    cfg: &AttentionConfig,
    options: Fp8Options,
    packing: Option<Packing>,
) -> flashattn::Result<Fp8Out> {
    let up = |x: &[bf16]| stream.clone_htod(x).unwrap();
    let (q, k, v) = (up(q), up(k), up(v));
    let (q, k, v) = (
        DeviceTensor::contiguous(&q, q_shape),
        DeviceTensor::contiguous(&k, k_shape),
        DeviceTensor::contiguous(&v, k_shape),
    );
    let inputs = DeviceForwardInputs::new(&q, &k, &v);
    match packing {
        Some(packing) => with_seqs(stream, packing, |seqs| {
            into_poisoned(stream, q_shape, |o, lse| {
                dev.varlen_forward_fp8(stream, cfg, seqs, inputs, o, lse, options)
            })
        }),
        None => into_poisoned(stream, q_shape, |o, lse| {
            dev.forward_fp8(stream, cfg, inputs, o, lse, options)
        }),
    }
}

fn up_i32(stream: &Arc<CudaStream>, x: &[i32]) -> CudaSlice<i32> {
    stream.clone_htod(x).unwrap()
}

/// The FP8 forward's head dims in this build: 64, 128, 256 and, with their features, 96 and 192.
fn fp8_head_dims() -> Vec<usize> {
    let mut dims = vec![64, 128, 256];
    if cfg!(feature = "hdim96") {
        dims.push(96);
    }
    if cfg!(feature = "hdim192") {
        dims.push(192);
    }
    dims
}

/// Each sequence of `packed` (the packed forward over `q_rows` query rows of `hq` heads of `d`,
/// the sequences' lengths `lens`) against `dense(b)`, the dense forward on sequence b's rows
/// alone: O and LSE bit for bit, O written; a sequence without keys: O = 0 and LSE = +inf; rows
/// past the sequences' still poisoned. Returns the sequences compared with a dense call.
fn check_each_sequence(
    packed: &Fp8Out,
    (q_lens, k_lens): (&[usize], &[usize]),
    (q_rows, hq, d): (usize, usize, usize),
    what: &str,
    mut dense: impl FnMut(usize) -> Fp8Out,
) -> usize {
    let bits = |x: &[bf16]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    let cu_q = offsets(q_lens);
    let mut cases = 0;
    for b in 0..q_lens.len() {
        let q0 = cu_q[b] as usize;
        let (sq, sk) = (q_lens[b], k_lens[b]);
        if sq == 0 {
            continue;
        }
        let got_o = rows(&packed.out, q0..q0 + sq, hq, d);
        let got_lse: Vec<f32> = (0..hq)
            .flat_map(|h| packed.lse[h * q_rows + q0..h * q_rows + q0 + sq].to_vec())
            .collect();
        if sk == 0 {
            assert!(
                got_o.iter().all(|x| x.to_f32() == 0.0)
                    && got_lse.iter().all(|&x| x == f32::INFINITY),
                "{what} sequence {b}: no keys, O = 0 and LSE = +inf"
            );
            continue;
        }
        let dense = dense(b);
        assert!(
            !got_o.iter().any(|x| x.is_nan()),
            "{what} sequence {b} ({sq}x{sk}): O unwritten"
        );
        assert_eq!(
            bits(&got_o),
            bits(&dense.out),
            "{what} sequence {b} ({sq}x{sk}): O"
        );
        let same_lse = got_lse
            .iter()
            .zip(&dense.lse)
            .all(|(a, w)| a.to_bits() == w.to_bits());
        assert!(same_lse, "{what} sequence {b} ({sq}x{sk}): LSE");
        cases += 1;
    }
    let total_q: usize = q_lens.iter().sum();
    let unowned = &packed.out[total_q * hq * d..];
    assert!(
        unowned.iter().all(|x| x.is_nan()),
        "{what}: rows no sequence owns were written"
    );
    cases
}

/// The packed FP8 forward over `q_rows` query rows (the sequences' and any beyond them) and the
/// keys of `batch`.
fn packed_fp8(
    dev: &Device,
    stream: &Arc<CudaStream>,
    batch: &Batch<bf16>,
    q_rows: usize,
    (cfg, options): (&AttentionConfig, Fp8Options),
    packing: Packing,
) -> flashattn::Result<Fp8Out> {
    let (hq, hk, d) = (batch.heads_q, batch.heads_kv, batch.d);
    let total_k: usize = batch.k_lens.iter().sum();
    let mut q = batch.q.clone();
    q.resize(q_rows * hq * d, bf16::from_f32(0.5));
    let shapes = [[1, q_rows, hq, d], [1, total_k, hk, d]];
    let qkv = [&q[..], &batch.k[..], &batch.v[..]];
    fp8_forward(dev, stream, qkv, shapes, cfg, options, Some(packing))
}

#[test]
#[ignore = "needs a GPU"]
fn fp8_each_sequence_matches_the_dense_fp8_forward_bit_for_bit() {
    let (dev, stream) = device();
    // The dense calls unsplit: a split tail merges pieces, and packed calls never split.
    let unsplit = Sm90Schedule {
        split_tail: TailSplit::Off,
        ..Default::default()
    };
    let configs = [
        AttentionConfig::new(),
        AttentionConfig::new().causal(true),
        AttentionConfig::new().window(Some(150), Some(20)),
    ];
    let (cu_q, cu_k) = (offsets(&FP8_Q), offsets(&FP8_K));
    let total_q: usize = FP8_Q.iter().sum();
    let q_rows = total_q + UNOWNED_Q;
    let max = (*FP8_Q.iter().max().unwrap(), *FP8_K.iter().max().unwrap());
    let mut cases = 0;
    // d96 and d192 with their features, without Hadamard (it needs a power-of-two head dim).
    let dims = fp8_head_dims();
    let n_dims = dims.len();
    for d in dims {
        let (hq, hk) = (4, 2);
        let batch = Batch::<bf16>::new(&FP8_Q, &FP8_K, (hq, hk), d, 40 + d as u64);
        for (i, cfg) in configs.iter().enumerate() {
            let options = Fp8Options {
                hadamard_seed: (i % 2 == 1 && d.is_power_of_two()).then_some(7),
            };
            let cfg = cfg.clone().sm90_schedule(unsplit);
            let packed = packed_fp8(
                &dev,
                &stream,
                &batch,
                q_rows,
                (&cfg, options),
                ((&cu_q, &cu_k), max),
            )
            .unwrap_or_else(|e| panic!("d{d} {cfg:?}: {e}"));
            let what = format!("d{d} {cfg:?}");
            cases += check_each_sequence(&packed, (&FP8_Q, &FP8_K), (q_rows, hq, d), &what, |b| {
                let (q0, k0) = (cu_q[b] as usize, cu_k[b] as usize);
                let (sq, sk) = (FP8_Q[b], FP8_K[b]);
                fp8_forward(
                    &dev,
                    &stream,
                    [
                        &rows(&batch.q, q0..q0 + sq, hq, d),
                        &rows(&batch.k, k0..k0 + sk, hk, d),
                        &rows(&batch.v, k0..k0 + sk, hk, d),
                    ],
                    [[1, sq, hq, d], [1, sk, hk, d]],
                    &cfg,
                    options,
                    None,
                )
                .unwrap()
            });
            println!("fp8 packed d{d} {cfg:?} {options:?}: every sequence = dense, bit for bit");
        }
    }
    assert_eq!(cases, n_dims * 3 * 5, "sequences compared");
}

/// One packed e4m3 tensor quantized on the host sequence by sequence, as by a caller that
/// quantizes elsewhere: each sequence's rows and descales are its own dense quantization's, the
/// descales at the packed indices `varlen_fp8_inputs_from_e4m3` reads (NaN at the indices no
/// sequence takes, so that a read of one shows in O), the rows no sequence owns a nonzero filler.
struct PackedE4m3 {
    data: Vec<F8E4M3>,
    descales: Vec<f32>,
    /// Each sequence's `(1, len, heads, d)` quantization; none for an empty one.
    seqs: Vec<Option<Fp8Tensor>>,
}

impl PackedE4m3 {
    /// `x`: the sequences of `lens` packed, `(1, sum of lens, heads, d)`; the tensor has `total`
    /// rows (the sequences' first) and descale blocks of `n` rows.
    fn new(x: &[bf16], lens: &[usize], (total, heads, d): (usize, usize, usize), n: usize) -> Self {
        let blocks = total / n + lens.len();
        let mut data = vec![F8E4M3::from_f32(0.75); total * heads * d];
        let mut descales = vec![f32::NAN; heads * blocks];
        let mut seqs = vec![];
        let mut start = 0;
        for (b, &len) in lens.iter().enumerate() {
            let own = (len > 0).then(|| {
                let x = rows(x, start..start + len, heads, d);
                let x = TensorRef::contiguous(&x, [1, len, heads, d]);
                Fp8Tensor::quantize(x, Granularity::PerBlock { rows: n }, Operand::Q).unwrap()
            });
            if let Some(t) = &own {
                data[start * heads * d..(start + len) * heads * d].copy_from_slice(t.data());
                // The dense descales are (1, heads, ceil(len / n)); sequence b's packed ones
                // start at block start / n + b of each head.
                let per_head = len.div_ceil(n);
                for h in 0..heads {
                    for j in 0..per_head {
                        let at = h * blocks + start / n + b + j;
                        assert!(descales[at].is_nan(), "descale {at} taken twice");
                        descales[at] = t.scales()[h * per_head + j];
                    }
                }
            }
            seqs.push(own);
            start += len;
        }
        PackedE4m3 {
            data,
            descales,
            seqs,
        }
    }
}

/// The FP8 forward over e4m3 Q `shapes[0]`, K and V `shapes[1]` with their descales: packed
/// with `packing` through `varlen_fp8_inputs_from_e4m3`, else through `fp8_inputs_from_e4m3`;
/// O (bf16) and the LSE poisoned with NaN before it, downloaded after.
fn e4m3_forward(
    dev: &Device,
    stream: &Arc<CudaStream>,
    [q, k, v]: [&[F8E4M3]; 3],
    [qd, kd, vd]: [&[f32]; 3],
    [q_shape, k_shape]: [[usize; 4]; 2],
    cfg: &AttentionConfig,
    packing: Option<Packing>,
) -> flashattn::Result<Fp8Out> {
    let (q, k, v) = [q, k, v].map(|x| stream.clone_htod(x).unwrap()).into();
    let (qd, kd, vd) = [qd, kd, vd].map(|x| stream.clone_htod(x).unwrap()).into();
    let (q, k, v) = (
        DeviceTensor::contiguous(&q, q_shape),
        DeviceTensor::contiguous(&k, k_shape),
        DeviceTensor::contiguous(&v, k_shape),
    );
    let (qd, kd, vd) = (qd.as_view(), kd.as_view(), vd.as_view());
    match packing {
        Some(packing) => with_seqs(stream, packing, |seqs| {
            let qkv = dev.varlen_fp8_inputs_from_e4m3(stream, seqs, &q, &k, &v, &qd, &kd, &vd)?;
            into_poisoned(stream, q_shape, |o, lse| {
                let inputs = Fp8ForwardInputs::new(&qkv);
                dev.varlen_forward_fp8_into(stream, cfg, seqs, inputs, o, lse)
            })
        }),
        None => {
            let qkv = dev.fp8_inputs_from_e4m3(stream, &q, &k, &v, &qd, &kd, &vd)?;
            into_poisoned(stream, q_shape, |o, lse| {
                dev.forward_fp8_into(stream, cfg, Fp8ForwardInputs::new(&qkv), o, lse)
            })
        }
    }
}

/// E4M3 Q, K and V quantized on the host sequence by sequence, with their descales in the
/// packed layout (NaN at the indices no sequence takes): each sequence's O and LSE are the dense
/// FP8 forward's on its rows alone with its own descales, bit for bit (empty sequences, lengths
/// that are no block multiples, rows past the sequences; GQA 4:2, full and causal).
#[test]
#[ignore = "needs a GPU"]
fn fp8_e4m3_with_packed_descales_matches_the_dense_call_bit_for_bit() {
    let (dev, stream) = device();
    // The dense calls unsplit, as in the test above.
    let unsplit = Sm90Schedule {
        split_tail: TailSplit::Off,
        ..Default::default()
    };
    let (cu_q, cu_k) = (offsets(&FP8_Q), offsets(&FP8_K));
    let total_q: usize = FP8_Q.iter().sum();
    let total_k: usize = FP8_K.iter().sum();
    let q_rows = total_q + UNOWNED_Q;
    let max = (*FP8_Q.iter().max().unwrap(), *FP8_K.iter().max().unwrap());
    let (hq, hk) = (4, 2);
    let mut cases = 0;
    let dims = fp8_head_dims();
    let n_dims = dims.len();
    for d in dims {
        let batch = Batch::<bf16>::new(&FP8_Q, &FP8_K, (hq, hk), d, 80 + d as u64);
        let key_block = fp8_key_block(d).unwrap();
        let q = PackedE4m3::new(&batch.q, &FP8_Q, (q_rows, hq, d), fp8_query_block());
        let k = PackedE4m3::new(&batch.k, &FP8_K, (total_k, hk, d), key_block);
        let v = PackedE4m3::new(&batch.v, &FP8_K, (total_k, hk, d), key_block);
        for (name, t) in [("Q", &q), ("K", &k), ("V", &v)] {
            let owned: Vec<f32> = t.descales.iter().copied().filter(|x| !x.is_nan()).collect();
            assert!(
                owned.iter().any(|&x| x != owned[0]) && owned.iter().all(|&x| x > 0.0),
                "d{d}: {name}'s descales"
            );
        }
        for cfg in [AttentionConfig::new(), AttentionConfig::new().causal(true)] {
            let cfg = cfg.sm90_schedule(unsplit);
            let packed = e4m3_forward(
                &dev,
                &stream,
                [&q.data, &k.data, &v.data],
                [&q.descales, &k.descales, &v.descales],
                [[1, q_rows, hq, d], [1, total_k, hk, d]],
                &cfg,
                Some(((&cu_q, &cu_k), max)),
            )
            .unwrap_or_else(|e| panic!("d{d} {cfg:?}: {e}"));
            let what = format!("e4m3 d{d} {cfg:?}");
            cases += check_each_sequence(&packed, (&FP8_Q, &FP8_K), (q_rows, hq, d), &what, |b| {
                let [qb, kb, vb] = [&q, &k, &v].map(|t| t.seqs[b].as_ref().unwrap());
                e4m3_forward(
                    &dev,
                    &stream,
                    [qb.data(), kb.data(), vb.data()],
                    [qb.scales(), kb.scales(), vb.scales()],
                    [[1, FP8_Q[b], hq, d], [1, FP8_K[b], hk, d]],
                    &cfg,
                    None,
                )
                .unwrap()
            });
            println!("fp8 e4m3 packed d{d} {cfg:?}: every sequence = dense, bit for bit");
        }
    }
    assert_eq!(cases, n_dims * 2 * 5, "sequences compared");
}

/// Packed descales of another length than `heads · (total / n + batch)` (one short, one over,
/// and the dense layout's count) are refused with `BufferTooSmall` naming the operand, where
/// those of the right length run.
#[test]
#[ignore = "needs a GPU"]
fn fp8_e4m3_packed_descales_of_the_wrong_length_are_refused() {
    let (dev, stream) = device();
    let (lens, (hq, hk), d) = ([37, 0, 300], (4, 2), 128);
    let total: usize = lens.iter().sum();
    let batch = Batch::<bf16>::new(&lens, &lens, (hq, hk), d, 3);
    let (query_block, key_block) = (fp8_query_block(), fp8_key_block(d).unwrap());
    let q = PackedE4m3::new(&batch.q, &lens, (total, hq, d), query_block);
    let k = PackedE4m3::new(&batch.k, &lens, (total, hk, d), key_block);
    let v = PackedE4m3::new(&batch.v, &lens, (total, hk, d), key_block);
    let cu = offsets(&lens);
    let shapes = [[1, total, hq, d], [1, total, hk, d]];
    let cfg = AttentionConfig::new();
    let run = |descales: [&[f32]; 3]| {
        let packing = ((&cu[..], &cu[..]), (300, 300));
        let data = [&q.data[..], &k.data[..], &v.data[..]];
        e4m3_forward(&dev, &stream, data, descales, shapes, &cfg, Some(packing))
    };
    let right = [&q.descales[..], &k.descales[..], &v.descales[..]];
    run(right).unwrap_or_else(|e| panic!("the right lengths: {e}"));
    for (i, operand) in [Operand::Q, Operand::K, Operand::V].into_iter().enumerate() {
        let (n, heads) = if i == 0 {
            (query_block, hq)
        } else {
            (key_block, hk)
        };
        let needed = right[i].len();
        assert_eq!(needed, heads * (total / n + lens.len()));
        let dense = heads * lens.iter().map(|l| l.div_ceil(n)).sum::<usize>();
        for len in [needed - 1, needed + 1, dense] {
            if len == needed {
                continue;
            }
            let mut wrong = right[i].to_vec();
            wrong.resize(len, 1.0);
            let mut descales = right;
            descales[i] = &wrong;
            let e = run(descales).err();
            let refused = matches!(
                e,
                Some(Error::BufferTooSmall { operand: o, needed: want, len: got })
                    if o == operand && want == needed && got == len
            );
            assert!(
                refused,
                "{operand:?} descales of {len} (not {needed}): {e:?}"
            );
        }
    }
}

/// Offsets that describe no packing: the quantize step and the forward clamp every sequence
/// into the tensors, so the calls run, and under compute-sanitizer's memcheck (the device run's
/// sanitizer step) no access leaves the buffers.
#[test]
#[ignore = "needs a GPU"]
fn sanitizer_fp8_malformed_offsets_stay_in_bounds() {
    let (dev, stream) = device();
    let bad: [(&[i32], &[i32]); 4] = [
        (&[0, 200, 100], &[0, 100, 256]),
        (&[-50, 300, i32::MAX], &[i32::MIN, -1, 10_000]),
        (&[256, 0, 0], &[256, 256, 0]),
        (&[0, 64, 64], &[0, 256, 0]),
    ];
    for d in [64, 256] {
        let batch = Batch::<bf16>::new(&[128, 128], &[128, 128], (2, 2), d, 9);
        for (cu_q, cu_k) in bad {
            for cfg in [AttentionConfig::new(), AttentionConfig::new().causal(true)] {
                let options = Fp8Options::default();
                packed_fp8(
                    &dev,
                    &stream,
                    &batch,
                    256,
                    (&cfg, options),
                    ((cu_q, cu_k), (128, 128)),
                )
                .unwrap_or_else(|e| panic!("d{d} {cu_q:?} {cu_k:?}: {e}"));
            }
        }
    }
}
