//! One training run: AdamW, the loop with its progress line, and the device's peak memory.

use std::io::Write;
use std::time::Instant;

use candle_core::{DType, Device, Result, Tensor, Var};
use rand::rngs::StdRng;
use rand::SeedableRng;

use crate::data::batch;
use crate::model::{causal_mask, compute_dtype, cross_entropy, Attention, Model, Shape};
use crate::SEED;

/// AdamW over the model's variables (decoupled weight decay, bias-corrected moments).
struct AdamW {
    moments: Vec<(Tensor, Tensor)>,
    step: i32,
}

impl AdamW {
    const BETAS: (f64, f64) = (0.9, 0.95);
    const EPS: f64 = 1e-8;
    const DECAY: f64 = 0.1;

    fn new(vars: &[&Var]) -> Result<AdamW> {
        let moments = vars
            .iter()
            .map(|v| Ok((v.zeros_like()?, v.zeros_like()?)))
            .collect::<Result<_>>()?;
        Ok(AdamW { moments, step: 0 })
    }

    fn update(
        &mut self,
        vars: &[&Var],
        grads: &candle_core::backprop::GradStore,
        lr: f64,
    ) -> Result<()> {
        self.step += 1;
        let (b1, b2) = Self::BETAS;
        let (c1, c2) = (1.0 - b1.powi(self.step), 1.0 - b2.powi(self.step));
        for (var, (m, v)) in vars.iter().zip(&mut self.moments) {
            let Some(g) = grads.get(var.as_tensor()) else {
                continue;
            };
            let g = g.to_dtype(DType::F32)?;
            *m = ((&*m * b1)? + (&g * (1.0 - b1))?)?;
            *v = ((&*v * b2)? + (g.sqr()? * (1.0 - b2))?)?;
            let step = ((&*m / c1)? / ((&*v / c2)?.sqrt()? + Self::EPS)?)?;
            let w = var.as_tensor();
            var.set(&((w * (1.0 - lr * Self::DECAY))? - (step * lr)?)?)?;
        }
        Ok(())
    }
}

/// The learning rate at `step`: linear warm-up, then constant.
fn learning_rate(step: usize) -> f64 {
    const PEAK: f64 = 1e-3;
    const WARMUP: usize = 30;
    PEAK * ((step + 1) as f64 / WARMUP as f64).min(1.0)
}

pub struct Run {
    pub losses: Vec<f32>,
    pub tokens_per_s: f64,
    pub peak_bytes: Option<u64>,
    pub error: Option<String>,
}

/// Trains one model for `steps` steps; tokens/s over the steps after the first 10.
pub fn train(
    attention: Attention,
    shape: Shape,
    text: &[u8],
    seqlen: usize,
    tokens: usize,
    steps: usize,
    dev: &Device,
) -> Run {
    let mut run = Run {
        losses: Vec::new(),
        tokens_per_s: 0.0,
        peak_bytes: None,
        error: None,
    };
    memory::reset_peak(dev);
    let result = (|| -> Result<()> {
        let model = Model::new(shape, dev)?;
        let vars = model.vars();
        let mut opt = AdamW::new(&vars)?;
        let mask = match attention {
            Attention::Candle => causal_mask(seqlen, dev)?,
            Attention::Flash => Tensor::zeros(1, compute_dtype(dev), dev)?,
        };
        let mut rng = StdRng::seed_from_u64(SEED + seqlen as u64);
        let warm = 10.min(steps / 2);
        let mut start = Instant::now();
        for step in 0..steps {
            if step == warm {
                dev.synchronize()?;
                start = Instant::now();
            }
            let (inputs, targets) = batch(text, tokens / seqlen, seqlen, &mut rng, dev)?;
            let loss = cross_entropy(&model.forward(&inputs, attention, &mask)?, &targets)?;
            let grads = loss.backward()?;
            opt.update(&vars, &grads, learning_rate(step))?;
            run.losses.push(loss.to_scalar::<f32>()?);
            progress(
                attention,
                seqlen,
                step + 1,
                steps,
                *run.losses.last().unwrap(),
            );
        }
        dev.synchronize()?;
        let timed = steps - warm;
        run.tokens_per_s = (timed * tokens) as f64 / start.elapsed().as_secs_f64();
        Ok(())
    })();
    eprintln!();
    run.peak_bytes = memory::peak(dev);
    if let Err(e) = result {
        run.error = Some(e.to_string().lines().next().unwrap_or("").to_string());
    }
    run
}

/// One line, rewritten in place: a bar, the step and the loss.
fn progress(attention: Attention, seqlen: usize, step: usize, steps: usize, loss: f32) {
    const WIDTH: usize = 30;
    let done = WIDTH * step / steps;
    eprint!(
        "\r{:>10} s{seqlen:<6} [{}{}] {step:>4}/{steps} loss {loss:.3}",
        attention.name(),
        "#".repeat(done),
        ".".repeat(WIDTH - done)
    );
    let _ = std::io::stderr().flush();
}

/// Peak device memory through the device's default memory pool, which candle's allocations
/// (cudarc's stream-ordered ones) come from.
mod memory {
    use candle_core::Device;

    #[cfg(feature = "candle-cuda")]
    fn attribute(dev: &Device, set: Option<u64>) -> Option<u64> {
        use cudarc::driver::sys;
        let Device::Cuda(cuda) = dev else {
            return None;
        };
        let stream = cuda.cuda_stream();
        let ctx = stream.context();
        ctx.bind_to_thread().ok()?;
        let attr = sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH;
        let mut pool = std::ptr::null_mut();
        let mut value = set.unwrap_or(0);
        // SAFETY: the context is current; `pool` and `value` outlive the calls, and the
        // attribute is a 64-bit integer.
        unsafe {
            sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device())
                .result()
                .ok()?;
            let value_ptr = &mut value as *mut u64 as *mut std::ffi::c_void;
            match set {
                Some(_) => sys::cuMemPoolSetAttribute(pool, attr, value_ptr)
                    .result()
                    .ok()?,
                None => sys::cuMemPoolGetAttribute(pool, attr, value_ptr)
                    .result()
                    .ok()?,
            }
        }
        Some(value)
    }
    #[cfg(not(feature = "candle-cuda"))]
    fn attribute(_: &Device, _: Option<u64>) -> Option<u64> {
        None
    }

    pub fn reset_peak(dev: &Device) {
        let _ = dev.synchronize();
        attribute(dev, Some(0));
    }
    pub fn peak(dev: &Device) -> Option<u64> {
        let _ = dev.synchronize();
        attribute(dev, None)
    }
}
