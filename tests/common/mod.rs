//! What the GPU correctness tests share: the case description, the device, random inputs.
#![allow(dead_code)] // each test crate uses its own part

use std::sync::Arc;

use cudarc::driver::{CudaSlice, DeviceRepr};
use flashattn::cuda::{CudaStream, Device, DeviceTensor, DeviceTensorMut};
use flashattn::{AttentionConfig, AttentionMask, Backend, DType, Element, Layout, Problem};
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
    /// With `window`, the case's mask (see [`Case::mask`]).
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
    /// `causal` closes the window's right side at the diagonal; a window of `(None, None)` is
    /// none.
    pub fn mask(&self) -> AttentionMask {
        match (self.causal, self.window) {
            (false, (None, None)) => AttentionMask::Full,
            (true, (None, _)) => AttentionMask::Causal,
            (true, (left, _)) => AttentionMask::Window {
                left,
                right: Some(0),
            },
            (false, (left, right)) => AttentionMask::Window { left, right },
        }
    }
    pub fn cfg(&self, backend: Backend) -> AttentionConfig {
        let mut cfg = AttentionConfig::new()
            .mask(self.mask())
            .deterministic(self.deterministic)
            .backend(backend);
        cfg.softcap = self.softcap;
        cfg
    }
    /// The problem the case poses in `dtype`.
    pub fn problem(&self, dtype: DType) -> Problem {
        Problem {
            batch: self.batch,
            seqlen_q: self.seqlen_q,
            seqlen_k: self.seqlen_k,
            heads_q: self.heads_q,
            heads_kv: self.heads_kv,
            head_dim: self.head_dim,
            dtype,
        }
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
    /// Q's layout and K's (V's is the same).
    pub fn layouts(&self) -> (Layout, Layout) {
        (
            self.layout(self.seqlen_q, self.heads_q),
            self.layout(self.seqlen_k, self.heads_kv),
        )
    }
    /// N(0, 1) Q, K and V, drawn in that order, over their layouts' spans (padding included).
    pub fn random_qkv<T: Element>(&self, rng: &mut StdRng) -> [Vec<T>; 3] {
        let (lq, lk) = self.layouts();
        [
            random(span(&lq), rng),
            random(span(&lk), rng),
            random(span(&lk), rng),
        ]
    }
}

/// The elements a layout's storage spans.
pub fn span(layout: &Layout) -> usize {
    layout.span(flashattn::Operand::Q).unwrap()
}

pub fn device() -> (Device, Arc<CudaStream>) {
    let dev = Device::new(0).expect("a CUDA device (run these tests on the GPU machine)");
    let stream = dev.new_stream().unwrap();
    (dev, stream)
}

/// O (`len` elements) and the LSE of `case` on the device, poisoned with NaN so that an element
/// the kernel leaves unwritten shows.
pub fn poisoned_outputs<T: Element + DeviceRepr>(
    stream: &Arc<CudaStream>,
    case: &Case,
    len: usize,
) -> (CudaSlice<T>, CudaSlice<f32>) {
    let lse_len = case.batch * case.heads_q * case.seqlen_q;
    (
        stream
            .clone_htod(&vec![T::from_f32(f32::NAN); len])
            .unwrap(),
        stream.clone_htod(&vec![f32::NAN; lse_len]).unwrap(),
    )
}

/// NaN again into O and the LSE, in place.
pub fn poison<T: Element + DeviceRepr>(
    stream: &Arc<CudaStream>,
    (o, lse): &mut (CudaSlice<T>, CudaSlice<f32>),
) {
    stream
        .memcpy_htod(&vec![T::from_f32(f32::NAN); o.len()], o)
        .unwrap();
    stream.memcpy_htod(&vec![f32::NAN; lse.len()], lse).unwrap();
}

/// `dev.forward_into` of `case` (its layouts) over Q, K and V on the device, into `out` (O, LSE).
pub fn forward_into<T: Element + DeviceRepr>(
    dev: &Device,
    stream: &Arc<CudaStream>,
    case: &Case,
    cfg: &AttentionConfig,
    [q, k, v]: [&CudaSlice<T>; 3],
    (o, lse): &mut (CudaSlice<T>, CudaSlice<f32>),
) -> flashattn::Result<flashattn::Plan> {
    let (lq, lk) = case.layouts();
    dev.forward_into(
        stream,
        cfg,
        &DeviceTensor::new(q.as_view(), lq),
        &DeviceTensor::new(k.as_view(), lk),
        &DeviceTensor::new(v.as_view(), lk),
        &mut DeviceTensorMut::new(o.as_view_mut(), lq),
        &mut lse.as_view_mut(),
    )
}

/// O and the LSE back on the host, after everything queued on `stream` before.
pub fn download<T: Element + DeviceRepr>(
    stream: &Arc<CudaStream>,
    (o, lse): &(CudaSlice<T>, CudaSlice<f32>),
) -> (Vec<T>, Vec<f32>) {
    let o: Vec<T> = stream.clone_dtoh(o).unwrap();
    let lse: Vec<f32> = stream.clone_dtoh(lse).unwrap();
    stream.synchronize().unwrap();
    (o, lse)
}

/// N(0, 1) values rounded to T.
pub fn random<T: Element>(n: usize, rng: &mut StdRng) -> Vec<T> {
    let normal = Normal::new(0f32, 1.0).unwrap();
    (0..n).map(|_| T::from_f32(normal.sample(rng))).collect()
}

/// O and the LSE of a call whose head 0 has a NaN key that all its rows see, outputs poisoned
/// with NaN before it: head 0's rows NaN throughout, every other row written and free of NaN.
pub fn assert_nan_in_head_0<T: Element>(case: &Case, o: &[T], lse: &[f32], label: &str) {
    for (row, values) in o.chunks(case.head_dim).enumerate() {
        let (head, i) = (row % case.heads_q, row / case.heads_q);
        let nan = values.iter().filter(|x| x.to_f32().is_nan()).count();
        let want = if head == 0 { case.head_dim } else { 0 };
        assert_eq!(nan, want, "{label}: row {i} head {head}");
        let lse = lse[head * case.seqlen_q + i];
        assert_eq!(
            lse.is_nan(),
            head == 0,
            "{label}: row {i} head {head}: LSE {lse}"
        );
    }
}
