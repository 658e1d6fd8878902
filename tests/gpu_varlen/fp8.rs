//! The FP8 forward on packed batches: the quantize step gives every sequence descale blocks of
//! its own, so each sequence's O and LSE must be the dense FP8 forward's on its rows alone, bit
//! for bit; sequences without keys get O = 0 and LSE = +inf, rows no sequence owns stay
//! poisoned, and malformed offsets stay inside the buffers.

use std::sync::Arc;

use cudarc::driver::CudaSlice;
use flashattn::cuda::{
    CudaStream, Device, DeviceForwardInputs, DeviceSeqlens, DeviceTensor, DeviceTensorMut,
    Fp8Options,
};
use flashattn::unstable::{Sm90Schedule, TailSplit};
use flashattn::AttentionConfig;
use half::bf16;

use super::common::device;
use super::harness::varlen::{offsets, rows, Batch};

/// Empty query and key sequences, one row, several query tiles and key blocks (192 keys at d64,
/// 224 at d128, 128 at d256), none a block multiple; the last query rows belong to no sequence.
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
    let mut out: CudaSlice<bf16> = up(&vec![bf16::NAN; q.len()]);
    let mut lse = stream
        .clone_htod(&vec![f32::NAN; q_shape[0] * q_shape[1] * q_shape[2]])
        .unwrap();
    let (q, k, v) = (
        DeviceTensor::contiguous(&q, q_shape),
        DeviceTensor::contiguous(&k, k_shape),
        DeviceTensor::contiguous(&v, k_shape),
    );
    let mut o = DeviceTensorMut::contiguous(&mut out, q_shape);
    match packing {
        Some(((cu_q, cu_k), max)) => {
            let (cu_q, cu_k) = (up_i32(stream, cu_q), up_i32(stream, cu_k));
            let seqs = DeviceSeqlens::new(cu_q.as_view(), cu_k.as_view(), max.0, max.1)?;
            let mut lse = lse.as_view_mut();
            dev.varlen_forward_fp8(
                stream,
                cfg,
                &seqs,
                DeviceForwardInputs::new(&q, &k, &v),
                &mut o,
                &mut lse,
                options,
            )?
        }
        None => dev.forward_fp8(
            stream,
            cfg,
            DeviceForwardInputs::new(&q, &k, &v),
            &mut o,
            &mut lse.as_view_mut(),
            options,
        )?,
    };
    let got = Fp8Out {
        out: stream.clone_dtoh(&out).unwrap(),
        lse: stream.clone_dtoh(&lse).unwrap(),
    };
    stream.synchronize().unwrap();
    Ok(got)
}

fn up_i32(stream: &Arc<CudaStream>, x: &[i32]) -> CudaSlice<i32> {
    stream.clone_htod(x).unwrap()
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
    let bits = |x: &[bf16]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    let mut cases = 0;
    // d96 and d192 with their features, without Hadamard (it needs a power-of-two head dim).
    let mut dims = vec![64, 128, 256];
    if cfg!(feature = "hdim96") {
        dims.push(96);
    }
    if cfg!(feature = "hdim192") {
        dims.push(192);
    }
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
            for b in 0..FP8_Q.len() {
                let (q0, k0) = (cu_q[b] as usize, cu_k[b] as usize);
                let (sq, sk) = (FP8_Q[b], FP8_K[b]);
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
                        "d{d} sequence {b}: no keys, O = 0 and LSE = +inf"
                    );
                    continue;
                }
                let dense = fp8_forward(
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
                .unwrap();
                assert_eq!(
                    bits(&got_o),
                    bits(&dense.out),
                    "d{d} {cfg:?} sequence {b} ({sq}x{sk}): O"
                );
                let same_lse = got_lse
                    .iter()
                    .zip(&dense.lse)
                    .all(|(a, w)| a.to_bits() == w.to_bits());
                assert!(same_lse, "d{d} {cfg:?} sequence {b} ({sq}x{sk}): LSE");
                cases += 1;
            }
            let unowned = &packed.out[total_q * hq * d..];
            assert!(
                unowned.iter().all(|x| x.is_nan()),
                "d{d}: rows no sequence owns were written"
            );
            println!("fp8 packed d{d} {cfg:?} {options:?}: every sequence = dense, bit for bit");
        }
    }
    assert_eq!(cases, n_dims * 3 * 5, "sequences compared");
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
