//! GPU tests: run on the device machine with `--include-ignored`. They are `#[ignore]`d so that
//! a machine without a GPU never counts them as passed; run there, each one fails (never skips)
//! when the GPU is missing.
#![cfg(feature = "cuda")]

use flashattn::cuda::{Device, DeviceForwardInputs, DeviceTensor, DeviceTensorMut};
use flashattn::{AttentionConfig, Backend, Error, Op, Problem};

fn device() -> Device {
    Device::new(0).expect("a CUDA device (run these tests on the GPU machine)")
}

#[test]
#[ignore = "needs a GPU"]
fn device_query_reports_hopper() {
    let dev = device();
    let info = dev.info();
    println!(
        "device: {} sm_{}{} {} SMs, {} KiB smem/block opt-in, {} MiB L2",
        info.name,
        info.major,
        info.minor,
        info.sm_count,
        info.max_smem_per_block_optin / 1024,
        info.l2_bytes >> 20
    );
    assert!(info.major >= 8, "unexpected compute capability");
    assert!(info.sm_count > 0);
    assert!(info.max_smem_per_block_optin >= 96 * 1024);
}

#[cfg(feature = "selftest")]
#[test]
#[ignore = "needs a Hopper GPU"]
fn selftest_tma_wgmma_matches_cpu() {
    let dev = device();
    let stream = dev.new_stream().unwrap();
    let report = flashattn::unstable::selftest_tma_wgmma(&dev, &stream).expect("self-test launch");
    println!("selftest: {report:?}");
    assert_eq!(report.unwritten, 0, "kernel left poisoned outputs");
    assert!(
        report.max_abs_ref > 1.0,
        "inputs too small to mean anything"
    );
    assert!(
        report.passed(),
        "TMA+WGMMA result differs from the CPU: {report:?}"
    );
}

#[test]
#[ignore = "needs a GPU"]
fn dispatcher_explains_its_choice_on_the_device() {
    let dev = device();
    let problem = Problem {
        batch: 2,
        seqlen_q: 128,
        seqlen_k: 128,
        heads_q: 8,
        heads_kv: 8,
        head_dim: 128,
        head_dim_v: 128,
        dtype: flashattn::DType::BF16,
        packed: false,
    };
    let cfg = AttentionConfig::new();
    let explained = match dev.plan(Op::Forward, &problem, &cfg) {
        Ok(plan) => plan.explain(),
        Err(e) => e.to_string(),
    };
    println!("dispatch on {}: {explained}", dev.info().name);
    assert!(
        explained.contains("sm90"),
        "sm90 was not considered: {explained}"
    );
    if dev.info().compute_capability() == (9, 0) {
        // Forced sm90 is refused only for a missing kernel, never for the architecture.
        let forced = dev.plan(Op::Forward, &problem, &cfg.clone().backend(Backend::Sm90));
        if let Err(e) = &forced {
            assert!(matches!(e, Error::Unsupported { .. }), "{e}");
        }
    }
    // The CPU backend cannot take device operands.
    let cpu = dev.plan(Op::Forward, &problem, &cfg.backend(Backend::Cpu));
    assert!(
        matches!(cpu, Err(Error::BackendUnavailable { .. })),
        "{cpu:?}"
    );
}

#[test]
#[ignore = "needs a GPU"]
fn device_forward_writes_every_output_on_the_callers_stream() {
    // Outputs poisoned with NaN; after the call (ordered on our non-default stream, no hidden
    // synchronization) every element of O and LSE must be written and finite.
    let dev = device();
    let stream = dev.new_stream().unwrap();
    let shape = [1, 64, 2, 64];
    let n: usize = shape.iter().product();
    let host: Vec<half::bf16> = (0..n)
        .map(|i| half::bf16::from_f32((i as f32 * 0.1).sin()))
        .collect();
    let q = stream.clone_htod(&host).unwrap();
    let mut o = stream.clone_htod(&vec![half::bf16::NAN; n]).unwrap();
    let mut lse = stream.clone_htod(&vec![f32::NAN; 2 * 64]).unwrap();
    let t = DeviceTensor::contiguous(&q, shape);
    let plan = dev
        .forward_into(
            &stream,
            &AttentionConfig::new(),
            DeviceForwardInputs::new(&t, &t, &t),
            &mut DeviceTensorMut::contiguous(&mut o, shape),
            &mut lse.as_view_mut(),
        )
        .expect("device forward");
    println!(
        "device forward ran on {:?}: {}",
        plan.backend,
        plan.explain()
    );
    let out = stream.clone_dtoh(&o).unwrap();
    let lse = stream.clone_dtoh(&lse).unwrap();
    stream.synchronize().unwrap();
    assert!(out.iter().all(|x| x.is_finite()), "O left unwritten or NaN");
    assert!(
        lse.iter().all(|x| x.is_finite()),
        "LSE left unwritten or NaN"
    );
}

#[test]
#[ignore = "needs a GPU"]
fn misaligned_device_pointer_is_an_error() {
    let dev = device();
    let stream = dev.new_stream().unwrap();
    let shape = [1, 16, 1, 64];
    let n: usize = shape.iter().product();
    let buf = stream.clone_htod(&vec![half::bf16::ONE; n + 1]).unwrap();
    let mut o = stream.clone_htod(&vec![half::bf16::ZERO; n]).unwrap();
    let mut lse = stream.clone_htod(&vec![0f32; 16]).unwrap();
    // One element in: 2 bytes off the 16-byte alignment the kernels need.
    let shifted = DeviceTensor::new(buf.slice(1..), flashattn::Layout::contiguous(shape));
    let aligned = DeviceTensor::contiguous(&buf, shape);
    let cfg = AttentionConfig::new().backend(Backend::Sm90);
    let r = dev.forward_into(
        &stream,
        &cfg,
        DeviceForwardInputs::new(&shifted, &aligned, &aligned),
        &mut DeviceTensorMut::contiguous(&mut o, shape),
        &mut lse.as_view_mut(),
    );
    assert!(
        matches!(
            r,
            Err(Error::Misaligned {
                operand: flashattn::Operand::Q,
                ..
            })
        ),
        "{r:?}"
    );
}
