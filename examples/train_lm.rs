//! Trains a small causal transformer language model with candle twice from the same seed on the
//! same batches: once with `flashattn::candle::flash_attn` as its attention, once with attention
//! written in candle ops (matmul, additive causal mask, softmax, matmul: what a candle-core model
//! writes without a fused kernel). Prints the loss of both as they go, then tokens/s and peak
//! memory of each; `--out` writes the curves and numbers as JSON.
//!
//! On a CUDA device (feature `candle-cuda`) the model computes in bf16 over f32 master weights;
//! on the CPU (feature `candle` alone) in f32, at the sizes given.
//!
//! Usage: train_lm [--seqlens 1024,4096,16384] [--tokens 16384] [--steps 300] [--layers 4]
//!                 [--width 512] [--heads 8] [--out results.json] [--commit SHA]
//!
//! The text is generated (a seeded stream of words made of syllables, in sentences), so the
//! example needs no file; a byte-level model learns its spelling and word statistics.

use std::collections::BTreeMap;
use std::io::Write;
use std::time::Instant;

use candle_core::{DType, Device, Result, Tensor, Var, D};
use flashattn::AttentionConfig;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Normal};

const VOCAB: usize = 256; // bytes
const SEED: u64 = 2026;

#[derive(Clone, Copy, PartialEq)]
enum Attention {
    Flash,
    Candle,
}

impl Attention {
    fn name(self) -> &'static str {
        match self {
            Attention::Flash => "flashattn",
            Attention::Candle => "candle ops",
        }
    }
}

struct Shape {
    layers: usize,
    width: usize,
    heads: usize,
}

/// The weights: f32 variables, cast to the compute dtype at each step.
struct Model {
    embed: Var,            // (VOCAB, width), also the output head
    layers: Vec<[Var; 4]>, // qkv (width, 3·width), out (width, width), up (width, 4·width), down
    shape: Shape,
}

impl Model {
    /// Weights N(0, 1/fan_in) from a seeded generator, on `dev`: both runs start equal.
    fn new(shape: Shape, dev: &Device) -> Result<Model> {
        let mut rng = StdRng::seed_from_u64(SEED);
        let mut var = |rows: usize, cols: usize, std: f32| -> Result<Var> {
            let normal = Normal::new(0f32, std).unwrap();
            let data: Vec<f32> = (0..rows * cols).map(|_| normal.sample(&mut rng)).collect();
            Var::from_tensor(&Tensor::from_vec(data, (rows, cols), dev)?)
        };
        let w = shape.width;
        let embed = var(VOCAB, w, 1.0 / (w as f32).sqrt())?;
        let depth = (2.0 * shape.layers as f32).sqrt();
        let layers = (0..shape.layers)
            .map(|_| {
                Ok([
                    var(w, 3 * w, 1.0 / (w as f32).sqrt())?,
                    var(w, w, 1.0 / (w as f32).sqrt() / depth)?,
                    var(w, 4 * w, 1.0 / (w as f32).sqrt())?,
                    var(4 * w, w, 1.0 / (4.0 * w as f32).sqrt() / depth)?,
                ])
            })
            .collect::<Result<_>>()?;
        Ok(Model {
            embed,
            layers,
            shape,
        })
    }

    fn vars(&self) -> Vec<&Var> {
        std::iter::once(&self.embed)
            .chain(self.layers.iter().flatten())
            .collect()
    }

    /// Logits `(batch·seqlen, VOCAB)` in f32 of `tokens` `(batch, seqlen)`.
    fn forward(&self, tokens: &Tensor, attention: Attention, mask: &Tensor) -> Result<Tensor> {
        let (b, s) = tokens.dims2()?;
        let Shape { width, heads, .. } = self.shape;
        let dtype = compute_dtype(tokens.device());
        let embed = self.embed.as_tensor().to_dtype(dtype)?;
        let mut x = embed.index_select(&tokens.flatten_all()?, 0)?; // (b·s, width)
        for [qkv, out, up, down] in &self.layers {
            let h = rms_norm(&x)?.matmul(&qkv.as_tensor().to_dtype(dtype)?)?;
            // Q, K and V as strided views of one (b, s, 3, heads, head_dim) tensor.
            let h = h.reshape((b, s, 3, heads, width / heads))?;
            let (q, k, v) = (
                h.get_on_dim(2, 0)?,
                h.get_on_dim(2, 1)?,
                h.get_on_dim(2, 2)?,
            );
            let o = match attention {
                Attention::Flash => {
                    flashattn::candle::flash_attn(&q, &k, &v, &AttentionConfig::new().causal(true))?
                }
                Attention::Candle => candle_attention(&q, &k, &v, mask)?,
            };
            x = (x + o
                .reshape((b * s, width))?
                .matmul(&out.as_tensor().to_dtype(dtype)?)?)?;
            let h = rms_norm(&x)?
                .matmul(&up.as_tensor().to_dtype(dtype)?)?
                .gelu()?;
            x = (x + h.matmul(&down.as_tensor().to_dtype(dtype)?)?)?;
        }
        rms_norm(&x)?.matmul(&embed.t()?)?.to_dtype(DType::F32)
    }
}

fn compute_dtype(dev: &Device) -> DType {
    if dev.is_cuda() {
        DType::BF16
    } else {
        DType::F32
    }
}

fn rms_norm(x: &Tensor) -> Result<Tensor> {
    let dtype = x.dtype();
    let x = x.to_dtype(DType::F32)?;
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    x.broadcast_div(&(ms + 1e-6)?.sqrt()?)?.to_dtype(dtype)
}

/// Attention as a candle-core model writes it: scores `(b, heads, s, s)`, the additive causal
/// mask, a numerically steadied softmax, then P·V.
fn candle_attention(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let d = q.dim(3)?;
    let (q, k, v) = (
        q.transpose(1, 2)?.contiguous()?,
        k.transpose(1, 2)?.contiguous()?,
        v.transpose(1, 2)?.contiguous()?,
    );
    let s = (q.matmul(&k.t()?)? * (1.0 / (d as f64).sqrt()))?.broadcast_add(mask)?;
    let max = s.max_keepdim(D::Minus1)?.detach();
    let e = s.broadcast_sub(&max)?.exp()?;
    let p = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
    p.matmul(&v)?.transpose(1, 2)
}

/// `0` on and below the diagonal, `-inf` above, `(s, s)` in the compute dtype.
fn causal_mask(s: usize, dev: &Device) -> Result<Tensor> {
    let mask: Vec<f32> = (0..s * s)
        .map(|i| {
            if i % s > i / s {
                f32::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    Tensor::from_vec(mask, (s, s), dev)?.to_dtype(compute_dtype(dev))
}

/// Mean cross-entropy of `logits` `(n, VOCAB)` against `targets` `(n,)`.
fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let max = logits.max_keepdim(D::Minus1)?.detach();
    let shifted = logits.broadcast_sub(&max)?;
    let log_z = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
    let picked = shifted.gather(&targets.unsqueeze(1)?, 1)?;
    (log_z - picked)?.mean_all()
}

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

/// Seeded text: sentences of words built from syllables, some words far more frequent.
fn corpus(bytes: usize) -> Vec<u8> {
    const ONSETS: [&str; 12] = ["b", "d", "f", "g", "k", "l", "m", "n", "r", "s", "t", "v"];
    const VOWELS: [&str; 5] = ["a", "e", "i", "o", "u"];
    let mut rng = StdRng::seed_from_u64(SEED ^ 0x5eed);
    let words: Vec<String> = (0..400)
        .map(|_| {
            (0..rng.random_range(1..4))
                .map(|_| {
                    format!(
                        "{}{}",
                        ONSETS[rng.random_range(0..ONSETS.len())],
                        VOWELS[rng.random_range(0..VOWELS.len())]
                    )
                })
                .collect()
        })
        .collect();
    let mut text = Vec::with_capacity(bytes + 64);
    while text.len() < bytes {
        let n = rng.random_range(4..12);
        for i in 0..n {
            // Zipf-like: small indices far more often.
            let u: f64 = rng.random();
            let w = &words[((words.len() as f64).powf(u) as usize - 1).min(words.len() - 1)];
            let mut w = w.clone();
            if i == 0 {
                w[..1].make_ascii_uppercase();
            }
            text.extend_from_slice(w.as_bytes());
            text.push(if i + 1 == n { b'.' } else { b' ' });
        }
        text.push(b' ');
    }
    text.truncate(bytes);
    text
}

/// `batch` windows of `seqlen + 1` bytes at seeded offsets: inputs and next-byte targets.
fn batch(
    text: &[u8],
    batch: usize,
    seqlen: usize,
    rng: &mut StdRng,
    dev: &Device,
) -> Result<(Tensor, Tensor)> {
    let mut inputs = Vec::with_capacity(batch * seqlen);
    let mut targets = Vec::with_capacity(batch * seqlen);
    for _ in 0..batch {
        let start = rng.random_range(0..text.len() - seqlen - 1);
        let w = &text[start..start + seqlen + 1];
        inputs.extend(w[..seqlen].iter().map(|&b| b as u32));
        targets.extend(w[1..].iter().map(|&b| b as u32));
    }
    Ok((
        Tensor::from_vec(inputs, (batch, seqlen), dev)?,
        Tensor::from_vec(targets, batch * seqlen, dev)?,
    ))
}

/// The learning rate at `step`: linear warm-up, then constant.
fn learning_rate(step: usize) -> f64 {
    const PEAK: f64 = 1e-3;
    const WARMUP: usize = 30;
    PEAK * ((step + 1) as f64 / WARMUP as f64).min(1.0)
}

struct Run {
    losses: Vec<f32>,
    tokens_per_s: f64,
    peak_bytes: Option<u64>,
    error: Option<String>,
}

/// Trains one model for `steps` steps; tokens/s over the steps after the first 10.
fn train(
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

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    let i = args.iter().position(|a| a == name)?;
    args.get(i + 1).cloned()
}

fn num(name: &str, default: usize) -> usize {
    arg(name).map_or(default, |v| {
        v.parse().unwrap_or_else(|_| {
            eprintln!("{name} takes a positive number");
            std::process::exit(2)
        })
    })
}

fn main() -> Result<()> {
    #[cfg(feature = "candle-cuda")]
    let dev = Device::new_cuda(0)?;
    #[cfg(not(feature = "candle-cuda"))]
    let dev = Device::Cpu;
    let seqlens: Vec<usize> = arg("--seqlens")
        .unwrap_or_else(|| "1024,4096,16384".into())
        .split(',')
        .map(|s| s.parse().expect("--seqlens takes numbers"))
        .collect();
    let (tokens, steps) = (num("--tokens", 16384), num("--steps", 300));
    let (layers, width, heads) = (num("--layers", 4), num("--width", 512), num("--heads", 8));
    const TEXT_BYTES: usize = 4 << 20;
    let bad_seqlen = |s: usize| s == 0 || tokens % s != 0 || s >= TEXT_BYTES;
    if tokens == 0
        || seqlens.iter().any(|&s| bad_seqlen(s))
        || heads == 0
        || width % heads != 0
        || steps < 2
    {
        eprintln!(
            "each seqlen must divide --tokens and be under {TEXT_BYTES}, --heads divide --width, \
             --steps be 2 or more"
        );
        std::process::exit(2);
    }
    let text = corpus(TEXT_BYTES);
    println!(
        "{} layers, width {width}, {heads} heads of {}, {tokens} tokens a step, {steps} steps, {:?} in {:?}",
        layers,
        width / heads,
        dev.location(),
        compute_dtype(&dev)
    );
    let mut rows = Vec::new();
    for &seqlen in &seqlens {
        let mut runs = BTreeMap::new();
        for attention in [Attention::Flash, Attention::Candle] {
            let shape = Shape {
                layers,
                width,
                heads,
            };
            runs.insert(
                attention.name(),
                train(attention, shape, &text, seqlen, tokens, steps, &dev),
            );
        }
        let (ours, theirs) = (&runs["flashattn"], &runs["candle ops"]);
        for (name, r) in &runs {
            match &r.error {
                Some(e) => println!("s{seqlen:<6} {name:>10}: failed after {} steps: {e}", r.losses.len()),
                None => println!(
                    "s{seqlen:<6} {name:>10}: loss {:.4} -> {:.4} (mean of the last 20 {:.4}), {:.0} tokens/s, peak memory {}",
                    r.losses[0],
                    r.losses.last().unwrap(),
                    tail_mean(&r.losses),
                    r.tokens_per_s,
                    r.peak_bytes.map_or("n/a".into(), |b| format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)),
                ),
            }
        }
        let compared = ours.losses.len().min(theirs.losses.len());
        // NaN when either run diverged (f32::max would skip it).
        let max_gap = (0..compared)
            .map(|i| (ours.losses[i] - theirs.losses[i]).abs())
            .fold(0f32, |m, x| {
                if x.is_nan() || m.is_nan() {
                    f32::NAN
                } else {
                    m.max(x)
                }
            });
        if compared > 0 {
            println!("s{seqlen:<6} largest loss difference over {compared} steps: {max_gap:.4}");
        }
        rows.push(row(seqlen, &runs, max_gap));
        // Written after each sequence length, so that a run cut short keeps what it measured.
        if let Some(path) = arg("--out") {
            let commit = json_string(&arg("--commit").unwrap_or_default());
            let json = format!(
            "{{\n\"example\": \"train_lm\", \"commit\": {commit}, \"layers\": {layers}, \"width\": {width}, \"heads\": {heads}, \"tokens_per_step\": {tokens}, \"steps\": {steps}, \"dtype\": \"{:?}\",\n\"rows\": [\n{}\n]\n}}\n",
            compute_dtype(&dev),
            rows.join(",\n")
        );
            std::fs::write(&path, json).expect("write --out");
        }
    }
    Ok(())
}

/// A JSON string literal of `s`.
fn json_string(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// A JSON number with 4 decimals, or null where `x` is not finite (a diverged run).
fn json_number(x: f32) -> String {
    if x.is_finite() {
        format!("{x:.4}")
    } else {
        "null".into()
    }
}

fn tail_mean(losses: &[f32]) -> f32 {
    let tail = &losses[losses.len().saturating_sub(20)..];
    tail.iter().sum::<f32>() / tail.len() as f32
}

fn row(seqlen: usize, runs: &BTreeMap<&str, Run>, max_gap: f32) -> String {
    let one = |r: &Run| {
        let every10: Vec<String> = r
            .losses
            .iter()
            .step_by(10)
            .map(|&l| json_number(l))
            .collect();
        format!(
            "{{\"tokens_per_s\": {:.0}, \"peak_bytes\": {}, \"final_loss_mean20\": {}, \"error\": {}, \"loss_every_10_steps\": [{}]}}",
            r.tokens_per_s,
            r.peak_bytes.map_or("null".into(), |b| b.to_string()),
            if r.losses.is_empty() { "null".into() } else { json_number(tail_mean(&r.losses)) },
            r.error.as_ref().map_or("null".into(), |e| json_string(e)),
            every10.join(", ")
        )
    };
    format!(
        "  {{\"seqlen\": {seqlen}, \"max_loss_gap\": {}, \"flashattn\": {}, \"candle_ops\": {}}}",
        json_number(max_gap),
        one(&runs["flashattn"]),
        one(&runs["candle ops"])
    )
}
