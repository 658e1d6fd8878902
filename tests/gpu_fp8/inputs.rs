//! The quantize step against its host definition, bit for bit; inputs quantized elsewhere; the
//! refusals.

use super::*;

/// Q, K and their descales byte for byte; V through its key-major layout (rows by
/// `v_row_head_dim`, columns by `v_key_column`), padding zero.
fn check_quantize_case<T: Element + DeviceRepr>(
    dev: &Device,
    stream: &Arc<CudaStream>,
    case: &Case,
    options: Fp8Options,
    x: &Inputs<T>,
) {
    let gpu = quantize_on_device(dev, stream, case, x, options);
    let [hq, hk, hv] = quantize_on_host(case, x, options);
    let [q, k] = gpu.q_k();
    let [qd, kd, vd] = gpu.descales();
    let (v, keys) = gpu.v_key_major();
    let q = stream.clone_dtoh(q).unwrap();
    let k = stream.clone_dtoh(k).unwrap();
    let v = stream.clone_dtoh(v).unwrap();
    let (qd, kd, vd) = (
        stream.clone_dtoh(qd).unwrap(),
        stream.clone_dtoh(kd).unwrap(),
        stream.clone_dtoh(vd).unwrap(),
    );
    stream.synchronize().unwrap();
    let what = format!("{:?} {options:?}", case.dtype(T::DTYPE));
    assert_eq!(qd, hq.scales(), "{what}: Q descales");
    assert_eq!(kd, hk.scales(), "{what}: K descales");
    assert_eq!(vd, hv.scales(), "{what}: V descales");
    assert!(bits(&q) == bits(hq.data()), "{what}: Q bytes");
    assert!(bits(&k) == bits(hk.data()), "{what}: K bytes");
    let (hkv, d, sk) = (case.heads_kv, case.head_dim, case.seqlen_k);
    let mut mismatches = 0;
    for b in 0..case.batch {
        for h in 0..hkv {
            for r in 0..d {
                let (row, c) = (
                    &v[((b * hkv + h) * d + r) * keys..][..keys],
                    v_row_head_dim(r),
                );
                for key in 0..keys {
                    let want = if key < sk {
                        hv.data()[((b * sk + key) * hkv + h) * d + c].to_bits()
                    } else {
                        0
                    };
                    mismatches += (row[v_key_column(key)].to_bits() != want) as usize;
                }
            }
        }
    }
    assert_eq!(mismatches, 0, "{what}: V key-major bytes");
}

#[test]
#[ignore = "needs an sm_90 GPU"]
fn quantize_matches_the_host_definition() {
    let (dev, stream) = device();
    let mut n = 0;
    for d in head_dims() {
        for (sq, sk) in [(1, 1), (128, 192), (300, 517), (1000, 77)] {
            for seed in [None, Some(5)] {
                if hadamard_at(d, seed) != seed {
                    continue; // d96, d192: without Hadamard only
                }
                let case = Case::new(sq, sk, d).batch(2).heads(4, 2);
                let options = Fp8Options {
                    hadamard_seed: seed,
                };
                check_quantize_case(&dev, &stream, &case, options, &inputs::<bf16>(&case, n));
                let x = inputs::<f16>(&case, n + 1000);
                check_quantize_case(&dev, &stream, &case, options, &x);
                n += 1;
            }
        }
    }
    println!("quantize: {n} cases × bf16/fp16 match the host bit for bit");
}

/// Special values through the quantize step, against the host definition bit for bit: a block
/// of zeros only (scale 1), a block of non-finite values only (scale 1, ±inf saturating to ±448,
/// NaN of either sign to 0x7F), and scattered through every tensor NaN of either sign, ±inf, −0
/// and ± the smallest subnormal; bf16 and fp16, with and without Hadamard.
#[test]
#[ignore = "needs an sm_90 GPU"]
fn quantize_of_special_values_matches_the_host_definition() {
    let (dev, stream) = device();
    let case = Case::new(300, 517, 128).batch(2).heads(4, 2);
    for seed in [None, Some(5)] {
        let options = Fp8Options {
            hadamard_seed: seed,
        };
        check_quantize_case(&dev, &stream, &case, options, &special::<bf16>(&case, 31));
        check_quantize_case(&dev, &stream, &case, options, &special::<f16>(&case, 32));
    }
}

/// [`inputs`] with the special values of `quantize_of_special_values_matches_the_host_definition`.
fn special<T: Element>(case: &Case, seed: u64) -> Inputs<T> {
    let mut x = inputs::<T>(case, seed);
    let (d, hq, hk) = (case.head_dim, case.heads_q, case.heads_kv);
    // The type's smallest subnormal: bf16's 2^-133, fp16's 2^-24.
    let tiny = [2f32.powi(-133), 2f32.powi(-24)]
        .into_iter()
        .find(|&t| T::from_f32(t).to_f32() == t)
        .unwrap();
    let scattered = [
        f32::NAN,
        -f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        -0.0,
        tiny,
        -tiny,
    ];
    for t in [&mut x.q, &mut x.k, &mut x.v] {
        for (n, i) in (0..t.len()).step_by(101).enumerate() {
            t[i] = T::from_f32(scattered[n % scattered.len()]);
        }
    }
    // Then, over what was scattered there: (batch 0, head 0)'s first query block zeros only,
    // and (batch 0, KV head 1)'s first key block non-finite values only.
    for r in 0..flashattn::cuda::fp8_query_block().min(case.seqlen_q) {
        x.q[r * hq * d..][..d].fill(T::from_f32(0.0));
    }
    let non_finite = [f32::NAN, -f32::NAN, f32::INFINITY, f32::NEG_INFINITY];
    let key_block = flashattn::cuda::fp8_key_block(d).unwrap();
    for r in 0..key_block.min(case.seqlen_k) {
        for (j, v) in x.k[(r * hk + 1) * d..][..d].iter_mut().enumerate() {
            *v = T::from_f32(non_finite[(r + j) % 4]);
        }
    }
    x
}

/// E4M3 tensors quantized on the host, handed over with their descales, give the same O as the
/// device's own quantize step (the same bytes reach the kernel).
#[test]
#[ignore = "needs an sm_90 GPU"]
fn pre_quantized_inputs_give_the_same_output() {
    let (dev, stream) = device();
    for d in head_dims() {
        let case = Case::new(300, 517, d).causal(true).heads(4, 2);
        let x = inputs::<bf16>(&case, 77);
        let options = Fp8Options::default();
        let own = quantize_on_device(&dev, &stream, &case, &x, options);
        let [hq, hk, hv] = quantize_on_host(&case, &x, options);
        let lq = Layout::contiguous(case.q_shape());
        let lk = Layout::contiguous(case.kv_shape());
        let up = |t: &Fp8Tensor| {
            (
                stream.clone_htod(t.data()).unwrap(),
                stream.clone_htod(t.scales()).unwrap(),
            )
        };
        let ((q, qs), (k, ks), (v, vs)) = (up(&hq), up(&hk), up(&hv));
        let given = dev
            .fp8_inputs_from_e4m3(
                &stream,
                &DeviceTensor::new(q.as_view(), lq),
                &DeviceTensor::new(k.as_view(), lk),
                &DeviceTensor::new(v.as_view(), lk),
                &qs.as_view(),
                &ks.as_view(),
                &vs.as_view(),
            )
            .unwrap();
        let cfg = case.cfg(Backend::Sm90);
        let run = |inputs: &Fp8Inputs| {
            let mut o = stream
                .clone_htod(&vec![bf16::NAN; lq.shape.iter().product()])
                .unwrap();
            let mut lse = stream.clone_htod(&vec![f32::NAN; 4 * 300]).unwrap();
            dev.forward_fp8_into(
                &stream,
                &cfg,
                Fp8ForwardInputs::new(inputs),
                &mut DeviceTensorMut::new(o.as_view_mut(), lq),
                &mut lse.as_view_mut(),
            )
            .unwrap();
            let o: Vec<bf16> = stream.clone_dtoh(&o).unwrap();
            stream.synchronize().unwrap();
            o.iter().map(|x| x.to_bits()).collect::<Vec<u16>>()
        };
        let (a, b) = (run(&own), run(&given));
        assert!(a == b, "d{d}: outputs differ");
        assert!(!a.contains(&bf16::NAN.to_bits()), "d{d}: unwritten output");
    }
}

#[test]
#[ignore = "needs an sm_90 GPU"]
fn fp8_refusals_are_typed_errors() {
    let (dev, stream) = device();
    let case = Case::new(64, 64, 128);
    let x = inputs::<bf16>(&case, 1);
    let fp8 = quantize_on_device(&dev, &stream, &case, &x, Fp8Options::default());
    let lq = Layout::contiguous([1, 64, 2, 128]);
    let mut o = stream.clone_htod(&vec![bf16::NAN; 64 * 2 * 128]).unwrap();
    let mut lse = stream.clone_htod(&vec![f32::NAN; 2 * 64]).unwrap();
    let mut forward = |cfg: &AttentionConfig, layout| {
        dev.forward_fp8_into(
            &stream,
            cfg,
            Fp8ForwardInputs::new(&fp8),
            &mut DeviceTensorMut::new(o.as_view_mut(), layout),
            &mut lse.as_view_mut(),
        )
        .unwrap_err()
    };
    let mut cfg = case.cfg(Backend::Sm90);
    cfg.softcap = Some(30.0);
    let e = forward(&cfg, lq);
    assert!(matches!(e, Error::Unsupported { .. }), "softcap: {e:?}");
    // O of the wrong shape.
    let e = forward(
        &case.cfg(Backend::Sm90),
        Layout::contiguous([1, 63, 2, 128]),
    );
    assert!(matches!(e, Error::ShapeMismatch { .. }), "shape: {e:?}");
    // The sm80 backend has no FP8 forward.
    let e = forward(&case.cfg(Backend::Sm80), lq);
    assert!(matches!(e, Error::UnsupportedDtype { .. }), "sm80: {e:?}");
    // Head dim 80: no FP8 key block. Head dims 96 and 192 (the quantize step is built at both
    // whatever the features): no Hadamard transform, refused before anything runs.
    for (d, seed) in [(80, None), (96, Some(1)), (192, Some(1))] {
        let odd = Case::new(64, 64, d);
        let x = inputs::<bf16>(&odd, 2);
        let l = Layout::contiguous([1, 64, 2, d]);
        let t = stream.clone_htod(&x.q).unwrap();
        let e = dev
            .quantize_fp8(
                &stream,
                &DeviceTensor::new(t.as_view(), l),
                &DeviceTensor::new(t.as_view(), l),
                &DeviceTensor::new(t.as_view(), l),
                Fp8Options {
                    hadamard_seed: seed,
                },
            )
            .unwrap_err();
        let refused = match seed {
            None => matches!(e, Error::UnsupportedHeadDim { head_dim: 80, .. }),
            Some(_) => matches!(e, Error::Unsupported { .. }) && e.to_string().contains("Hadamard"),
        };
        assert!(refused, "d{d}: {e:?}");
    }
    // Descales of the wrong length.
    let short = stream.clone_htod(&[1f32]).unwrap();
    let q8 = stream
        .clone_htod(&vec![F8E4M3::from_f32(1.0); 64 * 2 * 128])
        .unwrap();
    let t = DeviceTensor::new(q8.as_view(), lq);
    let e = dev
        .fp8_inputs_from_e4m3(
            &stream,
            &t,
            &t,
            &t,
            &short.as_view(),
            &short.as_view(),
            &short.as_view(),
        )
        .unwrap_err();
    assert!(matches!(e, Error::BufferTooSmall { .. }), "descales: {e:?}");
}
