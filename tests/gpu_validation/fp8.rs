//! FP8 through the device API: descales that are not positive numbers, quantize sizes refused.

use flashattn::cuda::{DeviceTensor, DeviceTensorMut, Fp8ForwardInputs, Fp8Options};
use flashattn::fp8::{Fp8Tensor, Granularity};
use flashattn::{AttentionConfig, Error, Layout, Operand, TensorRef};
use half::bf16;
use rand::rngs::StdRng;
use rand::SeedableRng;

use crate::common::device;
use crate::harness::random;

/// Descales given with e4m3 inputs that are not positive finite numbers give NaN in the rows
/// they touch, and leave the others as with valid descales.
#[test]
#[ignore = "needs an sm_90 GPU"]
fn fp8_descales_that_are_not_positive_give_nan_rows() {
    let (dev, stream) = device();
    let mut rng = StdRng::seed_from_u64(5);
    let (s, h, d) = (300, 2, 128);
    let lay = Layout::contiguous([1, s, h, d]);
    let x: Vec<Vec<bf16>> = (0..3)
        .map(|_| random::<bf16>(s * h * d, &mut rng))
        .collect();
    let quantize = |i: usize, rows| {
        Fp8Tensor::quantize(
            TensorRef::new(&x[i], lay),
            Granularity::PerBlock { rows },
            Operand::Q,
        )
        .unwrap()
    };
    let block_k = flashattn::cuda::fp8_key_block(d).unwrap();
    let (hq, hk, hv) = (
        quantize(0, flashattn::cuda::fp8_query_block()),
        quantize(1, block_k),
        quantize(2, block_k),
    );
    let up8 = |t: &Fp8Tensor| stream.clone_htod(t.data()).unwrap();
    let (q8, k8, v8) = (up8(&hq), up8(&hk), up8(&hv));
    let run = |q_descale: &[f32]| -> Vec<f32> {
        let qs = stream.clone_htod(q_descale).unwrap();
        let ks = stream.clone_htod(hk.scales()).unwrap();
        let vs = stream.clone_htod(hv.scales()).unwrap();
        let inputs = dev
            .fp8_inputs_from_e4m3(
                &stream,
                &DeviceTensor::new(q8.as_view(), lay),
                &DeviceTensor::new(k8.as_view(), lay),
                &DeviceTensor::new(v8.as_view(), lay),
                &qs.as_view(),
                &ks.as_view(),
                &vs.as_view(),
            )
            .unwrap();
        let mut o = stream.clone_htod(&vec![bf16::NAN; s * h * d]).unwrap();
        let mut lse = stream.clone_htod(&vec![f32::NAN; h * s]).unwrap();
        dev.forward_fp8_into(
            &stream,
            &AttentionConfig::new(),
            Fp8ForwardInputs::new(&inputs),
            &mut DeviceTensorMut::new(o.as_view_mut(), lay),
            &mut lse.as_view_mut(),
        )
        .unwrap();
        let o: Vec<bf16> = stream.clone_dtoh(&o).unwrap();
        stream.synchronize().unwrap();
        o.iter().map(|x| x.to_f32()).collect()
    };
    let good = run(hq.scales());
    assert!(
        good.iter().all(|x| x.is_finite()),
        "valid descales gave a non-finite output"
    );
    let query_block = flashattn::cuda::fp8_query_block();
    for bad in [0.0, -1.0, f32::INFINITY, f32::NAN] {
        // Q descales are (batch, heads, query blocks): head 0's first block made bad.
        let mut descales = hq.scales().to_vec();
        descales[0] = bad;
        let out = run(&descales);
        for (row, (got, want)) in out.chunks(d).zip(good.chunks(d)).enumerate() {
            let (i, head) = (row / h, row % h);
            if head == 0 && i < query_block {
                assert!(
                    got.iter().all(|x| x.is_nan()),
                    "descale {bad}: row {i} not NaN"
                );
            } else {
                assert_eq!(got, want, "descale {bad}: row {i} head {head} changed");
            }
        }
    }
}

#[test]
#[ignore = "needs an sm_90 GPU"]
fn fp8_quantize_refuses_sizes_before_allocating() {
    let (dev, stream) = device();
    let x = stream.clone_htod(&vec![bf16::from_f32(0.5); 4096]).unwrap();
    // A head dim of 2^40 with a Hadamard seed: refused before a matrix of that size is built.
    let wide = Layout::with_strides([1, 1, 1, 1 << 40], [0, 0, 0, 1]);
    let t = DeviceTensor::new(x.as_view(), wide);
    let e = dev
        .quantize_fp8(
            &stream,
            &t,
            &t,
            &t,
            Fp8Options {
                hadamard_seed: Some(1),
            },
        )
        .unwrap_err();
    assert!(matches!(e, Error::BufferTooSmall { .. }), "{e:?}");
    // 65536 batch entries (broadcast, so that memory stays small): past the quantize grid.
    let many = Layout::with_strides([65536, 1, 1, 64], [0, 64, 64, 1]);
    let t = DeviceTensor::new(x.slice(0..64), many);
    let e = dev
        .quantize_fp8(&stream, &t, &t, &t, Fp8Options::default())
        .unwrap_err();
    assert!(matches!(e, Error::IndexOverflow { .. }), "{e:?}");
}
