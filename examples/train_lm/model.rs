//! The model: a causal byte-level transformer with either attention, and its loss.

use candle_core::{DType, Device, Result, Tensor, Var, D};
use flashattn::AttentionConfig;
use rand::rngs::StdRng;
use rand::SeedableRng;
use rand_distr::{Distribution, Normal};

use crate::{SEED, VOCAB};

#[derive(Clone, Copy, PartialEq)]
pub enum Attention {
    Flash,
    Candle,
}

impl Attention {
    pub fn name(self) -> &'static str {
        match self {
            Attention::Flash => "flashattn",
            Attention::Candle => "candle ops",
        }
    }
}

pub struct Shape {
    pub layers: usize,
    pub width: usize,
    pub heads: usize,
}

/// The weights: f32 variables, cast to the compute dtype at each step.
pub struct Model {
    embed: Var,            // (VOCAB, width), also the output head
    layers: Vec<[Var; 4]>, // qkv (width, 3·width), out (width, width), up (width, 4·width), down
    shape: Shape,
}

impl Model {
    /// Weights N(0, 1/fan_in) from a seeded generator, on `dev`: both runs start equal.
    pub fn new(shape: Shape, dev: &Device) -> Result<Model> {
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

    pub fn vars(&self) -> Vec<&Var> {
        std::iter::once(&self.embed)
            .chain(self.layers.iter().flatten())
            .collect()
    }

    /// Logits `(batch·seqlen, VOCAB)` in f32 of `tokens` `(batch, seqlen)`.
    pub fn forward(&self, tokens: &Tensor, attention: Attention, mask: &Tensor) -> Result<Tensor> {
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

pub fn compute_dtype(dev: &Device) -> DType {
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
pub fn causal_mask(s: usize, dev: &Device) -> Result<Tensor> {
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
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let max = logits.max_keepdim(D::Minus1)?.detach();
    let shifted = logits.broadcast_sub(&max)?;
    let log_z = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
    let picked = shifted.gather(&targets.unsqueeze(1)?, 1)?;
    (log_z - picked)?.mean_all()
}
