//! FP8 (e4m3) quantization for the FP8 forward: one scale per block of rows of one head, and
//! incoherent processing — Q and K multiplied along head_dim by the same random-sign Hadamard
//! matrix, which leaves Q·Kᵀ unchanged and spreads a few large entries over the whole head dim
//! before they are rounded to 3 mantissa bits.
//!
//! This is the host definition of the quantize step: the GPU step (csrc/sm90/fp8_quantize.cu,
//! `Device::quantize_fp8`) agrees with it bit for bit (tests/gpu_fp8/inputs.rs), and the accuracy tests
//! build their FP8 baselines from it.
// The cuda module exists with its feature only: a link to it there.
#![cfg_attr(
    feature = "cuda",
    doc = "\n\nThe GPU step: [`Device::quantize_fp8`](crate::cuda::Device::quantize_fp8)."
)]

use float8::F8E4M3;

use crate::error::{Error, Operand, Result};
use crate::tensor::{check_len, host_numel, Element, TensorRef};

/// Largest finite e4m3 magnitude (the e4m3fn format has no infinities).
pub const E4M3_MAX: f32 = 448.0;

/// Which elements share one scale.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Granularity {
    /// One scale for the whole tensor.
    PerTensor,
    /// One scale per `rows` consecutive positions of one head of one batch entry (the FP8
    /// forward's tiles: 128 query rows, a key block of K and V).
    PerBlock { rows: usize },
}

/// The scale that maps a block's largest finite magnitude `amax` onto [`E4M3_MAX`]; 1 where that
/// is not a positive normal number (a block of zeros or of non-finite values only), so that
/// quantizing never divides by zero.
pub fn scale_for(amax: f32) -> f32 {
    let scale = amax / E4M3_MAX;
    if scale.is_normal() && scale > 0.0 {
        scale
    } else {
        1.0
    }
}

/// `x · (1 / scale)` rounded to the nearest e4m3 (ties to even): a multiplication by the block's
/// rounded reciprocal, as the GPU step does it (a division per element cost it more than its
/// memory traffic). Magnitudes past [`E4M3_MAX`], ±inf included, saturate to ±448 rather than
/// becoming NaN; NaN of either sign becomes the canonical e4m3 NaN 0x7F, as the GPU's conversion
/// (`cvt` with `.satfinite`) writes it.
pub fn quantize(x: f32, scale: f32) -> F8E4M3 {
    let y = x * (1.0 / scale);
    if y.is_nan() {
        return F8E4M3::NAN;
    }
    F8E4M3::from_f32(y.clamp(-E4M3_MAX, E4M3_MAX))
}

/// A (batch, seqlen, heads, head_dim) tensor in e4m3, contiguous, with its scales: element
/// `(b, s, h, d)` stands for `data · scale(b, s, h)`.
#[derive(Clone, Debug)]
pub struct Fp8Tensor {
    data: Vec<F8E4M3>,
    scales: Vec<f32>,
    shape: [usize; 4],
    granularity: Granularity,
}

impl Fp8Tensor {
    /// The e4m3 values, contiguous (batch, seqlen, heads, head_dim).
    pub fn data(&self) -> &[F8E4M3] {
        &self.data
    }
    /// (batch, heads, blocks) for [`Granularity::PerBlock`]; one value for `PerTensor`.
    pub fn scales(&self) -> &[f32] {
        &self.scales
    }
    pub fn shape(&self) -> [usize; 4] {
        self.shape
    }
    pub fn granularity(&self) -> Granularity {
        self.granularity
    }

    /// Quantizes `x` with one scale per `granularity` block, chosen by [`scale_for`] from the
    /// block's largest finite magnitude.
    pub fn quantize<T: Element>(
        x: TensorRef<'_, T>,
        granularity: Granularity,
        operand: Operand,
    ) -> Result<Self> {
        x.check(operand)?;
        let shape = x.layout.shape;
        let [batch, seqlen, heads, head_dim] = shape;
        let rows = match granularity {
            Granularity::PerTensor => seqlen,
            Granularity::PerBlock { rows } if rows > 0 => rows,
            Granularity::PerBlock { .. } => {
                return Err(Error::InvalidConfig(
                    "an FP8 scale block needs at least one row".into(),
                ))
            }
        };
        let blocks = seqlen.div_ceil(rows);
        let count = host_numel(operand, &x.layout)?;
        let value = |b, s, h, d| x.data[x.layout.offset(b, s, h, d)].to_f32();
        let block_amax = |b, h, blk: usize| {
            let mut amax = 0f32;
            for s in blk * rows..((blk + 1) * rows).min(seqlen) {
                for d in 0..head_dim {
                    let v = value(b, s, h, d).abs();
                    if v.is_finite() {
                        amax = amax.max(v);
                    }
                }
            }
            amax
        };
        let scales: Vec<f32> = match granularity {
            Granularity::PerTensor => {
                let mut amax = 0f32;
                for b in 0..batch {
                    for h in 0..heads {
                        amax = amax.max(block_amax(b, h, 0));
                    }
                }
                vec![scale_for(amax)]
            }
            Granularity::PerBlock { .. } => (0..batch * heads * blocks)
                .map(|i| {
                    let (bh, blk) = (i / blocks, i % blocks);
                    scale_for(block_amax(bh / heads, bh % heads, blk))
                })
                .collect(),
        };
        let mut data = Vec::new();
        data.try_reserve_exact(count)
            .map_err(|_| Error::OutOfMemory { bytes: count })?;
        let mut out = Fp8Tensor {
            data,
            scales,
            shape,
            granularity,
        };
        for b in 0..batch {
            for s in 0..seqlen {
                for h in 0..heads {
                    let scale = out.scale(b, s, h);
                    out.data
                        .extend((0..head_dim).map(|d| quantize(value(b, s, h, d), scale)));
                }
            }
        }
        Ok(out)
    }

    /// The scale of position `s` of head `h` in batch entry `b`.
    pub fn scale(&self, b: usize, s: usize, h: usize) -> f32 {
        match self.granularity {
            Granularity::PerTensor => self.scales[0],
            Granularity::PerBlock { rows } => {
                let blocks = self.shape[1].div_ceil(rows);
                self.scales[(b * self.shape[2] + h) * blocks + s / rows]
            }
        }
    }

    /// The values the e4m3 data stands for, contiguous (batch, seqlen, heads, head_dim).
    pub fn dequantize(&self) -> Vec<f32> {
        let [_, seqlen, heads, head_dim] = self.shape;
        self.data
            .iter()
            .enumerate()
            .map(|(i, q)| {
                let row = i / head_dim;
                let (h, s, b) = (row % heads, (row / heads) % seqlen, row / (heads * seqlen));
                q.to_f32() * self.scale(b, s, h)
            })
            .collect()
    }
}

/// In-place orthonormal fast Walsh–Hadamard transform, `x ← H·x / √n`: its own inverse. The
/// length must be a power of two.
pub fn fwht(x: &mut [f32]) -> Result<()> {
    let n = x.len();
    if !n.is_power_of_two() {
        return Err(Error::InvalidConfig(format!(
            "the Hadamard transform takes a power-of-two length, not {n}"
        )));
    }
    let mut half = 1;
    while half < n {
        for block in x.chunks_exact_mut(2 * half) {
            let (lo, hi) = block.split_at_mut(half);
            for (a, b) in lo.iter_mut().zip(hi.iter_mut()) {
                (*a, *b) = (*a + *b, *a - *b);
            }
        }
        half *= 2;
    }
    let norm = 1.0 / (n as f32).sqrt();
    x.iter_mut().for_each(|v| *v *= norm);
    Ok(())
}

/// The random-sign Hadamard transform `x ← H·D·x / √n` of incoherent processing, `D` a diagonal
/// of ±1 drawn from a seed. Applied to every row of Q and of K with the same seed it leaves
/// Q·Kᵀ unchanged (`(HDq)·(HDk) = q·k`, H/√n orthonormal and symmetric, D² = I).
#[derive(Clone, Debug)]
pub struct RandomSignHadamard {
    signs: Vec<f32>,
}

impl RandomSignHadamard {
    /// Largest head dim a transform is built for.
    pub const MAX_HEAD_DIM: usize = 1 << 16;

    /// `head_dim` must be a power of two (so not 96 or 192, where the FP8 forward runs without
    /// the transform), at most [`RandomSignHadamard::MAX_HEAD_DIM`].
    pub fn new(head_dim: usize, seed: u64) -> Result<Self> {
        if !head_dim.is_power_of_two() || head_dim > Self::MAX_HEAD_DIM {
            return Err(Error::InvalidConfig(format!(
                "the Hadamard transform takes a power-of-two head dim up to {}, not {head_dim}",
                Self::MAX_HEAD_DIM
            )));
        }
        // splitmix64: a fixed, documented sign sequence per seed, no RNG dependency.
        let mut state = seed;
        let signs = (0..head_dim)
            .map(|_| {
                state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
                let mut z = state;
                z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                if (z ^ (z >> 31)) & 1 == 0 {
                    1.0
                } else {
                    -1.0
                }
            })
            .collect();
        Ok(RandomSignHadamard { signs })
    }

    pub fn head_dim(&self) -> usize {
        self.signs.len()
    }

    /// The ±1 diagonal D.
    pub fn signs(&self) -> &[f32] {
        &self.signs
    }

    fn check_row(&self, row: &[f32]) -> Result<()> {
        if row.len() != self.signs.len() {
            return Err(Error::InvalidConfig(format!(
                "a row of {} values given to the Hadamard transform of head dim {}",
                row.len(),
                self.signs.len()
            )));
        }
        Ok(())
    }

    /// `row ← H·D·row / √n`; the row must have [`RandomSignHadamard::head_dim`] elements.
    pub fn apply(&self, row: &mut [f32]) -> Result<()> {
        self.check_row(row)?;
        row.iter_mut().zip(&self.signs).for_each(|(v, s)| *v *= s);
        fwht(row)
    }

    /// The inverse, `row ← D·H·row / √n`.
    pub fn invert(&self, row: &mut [f32]) -> Result<()> {
        self.check_row(row)?;
        fwht(row)?;
        row.iter_mut().zip(&self.signs).for_each(|(v, s)| *v *= s);
        Ok(())
    }

    /// Every row of `x`, transformed, as a contiguous f32 (batch, seqlen, heads, head_dim).
    pub fn apply_tensor<T: Element>(
        &self,
        x: TensorRef<'_, T>,
        operand: Operand,
    ) -> Result<Vec<f32>> {
        check_len(operand, &x.layout, x.data.len())?;
        let [batch, seqlen, heads, head_dim] = x.layout.shape;
        if head_dim != self.head_dim() {
            return Err(Error::InvalidConfig(format!(
                "{operand:?} has head dim {head_dim}, the Hadamard transform {}",
                self.head_dim()
            )));
        }
        let count = host_numel(operand, &x.layout)?;
        let mut out = Vec::new();
        out.try_reserve_exact(count)
            .map_err(|_| Error::OutOfMemory {
                bytes: count.saturating_mul(4),
            })?;
        for b in 0..batch {
            for s in 0..seqlen {
                for h in 0..heads {
                    let start = out.len();
                    out.extend((0..head_dim).map(|d| x.data[x.layout.offset(b, s, h, d)].to_f32()));
                    self.apply(&mut out[start..])?;
                }
            }
        }
        Ok(out)
    }
}
