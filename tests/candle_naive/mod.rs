//! Attention written with candle ops, as the reference of the candle op's tests (CPU and GPU):
//! every op here has candle's own gradient, so candle's autograd through it gives the reference
//! dQ, dK and dV.
#![allow(dead_code)] // each test crate uses its own part

use candle_core::{Device, Result, Tensor, D};
use flashattn::AttentionConfig;
use rand::rngs::StdRng;
use rand::SeedableRng;
use rand_distr::{Distribution, Normal};

/// N(0, 1) values (never all zeros) of `shape`, f32 on `device`, from a seeded generator.
pub fn randn(shape: &[usize], seed: u64, device: &Device) -> Tensor {
    let mut rng = StdRng::seed_from_u64(seed);
    let normal = Normal::new(0f32, 1.0).unwrap();
    let n = shape.iter().product();
    let data: Vec<f32> = (0..n).map(|_| normal.sample(&mut rng)).collect();
    Tensor::from_vec(data, shape, &Device::Cpu)
        .unwrap()
        .to_device(device)
        .unwrap()
}

/// `(b, s, h_kv, d)` as `(b, h_q, s, d)`: each KV head repeated for the query heads it serves.
fn heads_first(t: &Tensor, heads_q: usize) -> Result<Tensor> {
    let (b, s, h, d) = t.dims4()?;
    let t = t.transpose(1, 2)?.contiguous()?;
    if h == heads_q {
        return Ok(t);
    }
    t.unsqueeze(2)?
        .broadcast_as((b, h, heads_q / h, s, d))?
        .contiguous()?
        .reshape((b, heads_q, s, d))
}

/// Attention as a framework writes it, in `q`'s dtype: `softmax(softcap(Q·Kᵀ·scale) + mask)·V`
/// with the mask an additive `-inf` matrix from `cfg`'s key rule.
pub fn naive(q: &Tensor, k: &Tensor, v: &Tensor, cfg: &AttentionConfig) -> Result<Tensor> {
    let (_, s_q, h_q, d) = q.dims4()?;
    let s_k = k.dim(1)?;
    let (qh, kh, vh) = (
        heads_first(q, h_q)?,
        heads_first(k, h_q)?,
        heads_first(v, h_q)?,
    );
    let scale = cfg.scale_for(d) as f64;
    let mut s = (qh.matmul(&kh.t()?.contiguous()?)? * scale)?;
    if let Some(cap) = cfg.softcap {
        let cap = cap as f64;
        s = ((s / cap)?.tanh()? * cap)?;
    }
    let rule = cfg.key_rule(s_q, s_k);
    let mut mask = vec![f32::NEG_INFINITY; s_q * s_k];
    for i in 0..s_q {
        let (lo, hi) = rule.key_range(i);
        assert!(
            lo < hi,
            "row {i} sees no key: the naive softmax would be NaN"
        );
        mask[i * s_k + lo..i * s_k + hi].fill(0.0);
    }
    let mask = Tensor::from_vec(mask, (s_q, s_k), q.device())?.to_dtype(q.dtype())?;
    let s = s.broadcast_add(&mask)?;
    // The max only steadies the exponent; softmax does not depend on it.
    let max = s.max_keepdim(D::Minus1)?.detach();
    let e = s.broadcast_sub(&max)?.exp()?;
    let p = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
    p.matmul(&vh)?.transpose(1, 2)?.contiguous()
}

/// [`naive`] over a packed batch: Q `(total_q, h_q, d)`, K `(total_k, h_kv, d)` and V
/// `(total_k, h_kv, d_v)`, each sequence `b` on its own rows (`cu_q[b]..cu_q[b + 1]`,
/// `cu_k[b]..cu_k[b + 1]`), O `(total_q, h_q, d_v)`. Every sequence with queries must have keys.
pub fn naive_packed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cu_q: &[u32],
    cu_k: &[u32],
    cfg: &AttentionConfig,
) -> Result<Tensor> {
    let mut pieces = Vec::new();
    for b in 0..cu_q.len() - 1 {
        let rows = |t: &Tensor, cu: &[u32]| {
            t.narrow(0, cu[b] as usize, (cu[b + 1] - cu[b]) as usize)?
                .unsqueeze(0)
        };
        if cu_q[b + 1] > cu_q[b] {
            let (q, k, v) = (rows(q, cu_q)?, rows(k, cu_k)?, rows(v, cu_k)?);
            pieces.push(naive(&q, &k, &v, cfg)?.squeeze(0)?);
        }
    }
    Tensor::cat(&pieces, 0)
}
