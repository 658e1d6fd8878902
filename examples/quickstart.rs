//! Attention on the best backend this machine has: prints the backend and why, the error against
//! the f64 reference (the correctness rule of docs/ARCHITECTURE.md) and the speed. Without a GPU it
//! runs the CPU backend and says so.

use std::time::Instant;

use flashattn::reference::{self, compare};
use flashattn::{AttentionConfig, ForwardInputs, Layout, Problem, TensorRef};
use half::bf16;
use rand::rngs::StdRng;
use rand::SeedableRng;
use rand_distr::{Distribution, Normal};

fn random(n: usize, seed: u64) -> Vec<bf16> {
    let mut rng = StdRng::seed_from_u64(seed);
    let normal = Normal::new(0f32, 1.0).unwrap();
    (0..n)
        .map(|_| bf16::from_f32(normal.sample(&mut rng)))
        .collect()
}

fn main() {
    let cfg = AttentionConfig::new().causal(true);
    #[cfg(feature = "cuda")]
    match gpu::run(&cfg) {
        Ok(()) => return,
        Err(e) => println!("no GPU run ({e}); running the CPU backend"),
    }
    #[cfg(not(feature = "cuda"))]
    println!("built without the `cuda` feature; running the CPU backend");
    cpu(&cfg);
}

fn cpu(cfg: &AttentionConfig) {
    let shape = [1, 1024, 8, 64];
    let n: usize = shape.iter().product();
    let (q, k, v) = (random(n, 1), random(n, 2), random(n, 3));
    fn t(x: &[bf16], shape: [usize; 4]) -> TensorRef<'_, bf16> {
        TensorRef::new(x, Layout::contiguous(shape))
    }
    let start = Instant::now();
    let fwd = flashattn::forward(
        cfg,
        ForwardInputs::new(t(&q, shape), t(&k, shape), t(&v, shape)),
    )
    .expect("forward");
    let secs = start.elapsed().as_secs_f64();
    let want = reference::reference_forward(cfg, t(&q, shape), t(&k, shape), t(&v, shape));
    let base = reference::baseline_forward(cfg, t(&q, shape), t(&k, shape), t(&v, shape));
    let got: Vec<f32> = fwd.out.iter().map(|x| x.to_f32()).collect();
    let cmp = compare(&got, &want.out, &base.out);
    let problem = Problem::from_layouts(
        &Layout::contiguous(shape),
        &Layout::contiguous(shape),
        &Layout::contiguous(shape),
        flashattn::DType::BF16,
    )
    .unwrap();
    println!("backend: {:?} ({})", fwd.plan.backend, fwd.plan.explain());
    println!("shape (b, s, h, d) = {shape:?} bf16, causal; vs f64 reference: {cmp}");
    println!(
        "time {:.1} ms, {:.1} GFLOP/s",
        secs * 1e3,
        problem.forward_flops(true) / secs / 1e9
    );
    assert!(cmp.pass, "CPU backend outside the error rule");
}

#[cfg(feature = "cuda")]
mod gpu {
    use super::*;
    use cudarc::driver::sys::CUevent_flags;
    use flashattn::cuda::{Device, DeviceForwardInputs, DeviceTensor, DeviceTensorMut};
    use flashattn::{Backend, Op};

    pub fn run(cfg: &AttentionConfig) -> flashattn::Result<()> {
        let dev = Device::new(0)?;
        let shape = [4, 4096, 16, 128];
        let layout = Layout::contiguous(shape);
        let problem = Problem::from_layouts(&layout, &layout, &layout, flashattn::DType::BF16)?;
        let plan = dev.plan(Op::Forward, &problem, cfg)?;
        let n: usize = shape.iter().product();
        let (q, k, v) = (random(n, 1), random(n, 2), random(n, 3));
        let stream = dev.new_stream()?;
        let up = |x: &Vec<bf16>| stream.clone_htod(x).expect("upload");
        let (qd, kd, vd) = (up(&q), up(&k), up(&v));
        let mut od = up(&vec![bf16::NAN; n]);
        let mut lse = stream
            .clone_htod(&vec![f32::NAN; problem.lse_len()?])
            .expect("upload");
        let mut launch = || {
            dev.forward_into(
                &stream,
                cfg,
                DeviceForwardInputs::new(
                    &DeviceTensor::new(qd.as_view(), layout),
                    &DeviceTensor::new(kd.as_view(), layout),
                    &DeviceTensor::new(vd.as_view(), layout),
                ),
                &mut DeviceTensorMut::new(od.as_view_mut(), layout),
                &mut lse.as_view_mut(),
            )
        };
        launch()?;
        let start = stream
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .unwrap();
        for _ in 0..10 {
            launch()?;
        }
        let end = stream
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .unwrap();
        let ms = start.elapsed_ms(&end).unwrap() as f64 / 10.0;
        let out: Vec<bf16> = stream.clone_dtoh(&od).unwrap();
        stream.synchronize().unwrap();

        let t = |x| TensorRef::new(x, layout);
        let cpu = cfg.clone().backend(Backend::Cpu);
        let (mut got, mut want, mut base) = (vec![], vec![], vec![]);
        for (b, h, i) in [(0, 0, 0), (1, 5, 1000), (3, 15, 4095)] {
            let (w, _) = reference::reference_row(&cpu, t(&q), t(&k), t(&v), b, h, i);
            let (bo, _) = reference::baseline_row(&cpu, t(&q), t(&k), t(&v), b, h, i);
            let off = layout.offset(b, i, h, 0);
            got.extend(out[off..off + 128].iter().map(|x| x.to_f32()));
            want.extend(w);
            base.extend(bo);
        }
        let cmp = compare(&got, &want, &base);
        println!(
            "backend: {:?} ({}) on {}",
            plan.backend,
            plan.explain(),
            dev.info().name
        );
        println!(
            "shape (b, s, h, d) = {shape:?} bf16, causal; sampled rows vs f64 reference: {cmp}"
        );
        println!(
            "time {:.3} ms, {:.1} TFLOP/s",
            ms,
            problem.forward_flops(true) / (ms * 1e-3) / 1e12
        );
        assert!(cmp.pass, "GPU result outside the error rule");
        Ok(())
    }
}
