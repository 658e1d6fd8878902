//! What the GPU correctness tests share: the case description, the device, random inputs.
#![allow(dead_code)] // each test crate uses its own part

use std::sync::Arc;

use flashattn::cuda::{CudaStream, Device};
use flashattn::{AttentionConfig, Backend, Element, Layout};
use rand::rngs::StdRng;
use rand_distr::{Distribution, Normal};

#[derive(Clone, Copy, Debug)]
pub struct Case {
    pub batch: usize,
    pub seqlen_q: usize,
    pub seqlen_k: usize,
    pub heads_q: usize,
    pub heads_kv: usize,
    pub head_dim: usize,
    pub causal: bool,
    pub window: (Option<usize>, Option<usize>),
    pub softcap: Option<f32>,
    /// (b, h, s, d) storage with padded rows, so strides are not packed.
    pub strided: bool,
    /// Backward: fixed accumulation order.
    pub deterministic: bool,
}

impl Case {
    pub fn new(seqlen_q: usize, seqlen_k: usize, head_dim: usize, causal: bool) -> Case {
        Case {
            batch: 1,
            seqlen_q,
            seqlen_k,
            heads_q: 2,
            heads_kv: 2,
            head_dim,
            causal,
            window: (None, None),
            softcap: None,
            strided: false,
            deterministic: false,
        }
    }
    pub fn cfg(&self, backend: Backend) -> AttentionConfig {
        let mut cfg = AttentionConfig::new()
            .causal(self.causal)
            .window(self.window.0, self.window.1)
            .deterministic(self.deterministic)
            .backend(backend);
        cfg.softcap = self.softcap;
        cfg
    }
    /// Full reference when the score matrices are small enough for the CPU.
    pub fn checked_whole(&self) -> bool {
        self.batch * self.heads_q * self.seqlen_q * self.seqlen_k * self.head_dim <= 1 << 30
    }
    pub fn layout(&self, seqlen: usize, heads: usize) -> Layout {
        let d = self.head_dim;
        if self.strided {
            // 8 spare elements per row: strides stay 16-byte multiples.
            let row = d + 8;
            Layout::with_strides(
                [self.batch, seqlen, heads, d],
                [heads * seqlen * row, row, seqlen * row, 1],
            )
        } else {
            Layout::contiguous([self.batch, seqlen, heads, d])
        }
    }
}

pub fn device() -> (Device, Arc<CudaStream>) {
    let dev = Device::new(0).expect("a CUDA device (run these tests on the GPU machine)");
    let stream = dev.new_stream().unwrap();
    (dev, stream)
}

/// N(0, 1) values rounded to T.
pub fn random<T: Element>(n: usize, rng: &mut StdRng) -> Vec<T> {
    let normal = Normal::new(0f32, 1.0).unwrap();
    (0..n).map(|_| T::from_f32(normal.sample(rng))).collect()
}
