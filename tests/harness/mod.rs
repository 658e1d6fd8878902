//! What the CPU and GPU correctness tests share: the case they run (shape, dtype, mask, softcap,
//! storage, backward mode), its configs and layouts, random inputs and poisoned outputs on the
//! host. Free of CUDA, so that the CPU tests build without it; the device side is in
//! tests/common.
#![allow(dead_code)] // each test crate uses its own part

pub mod varlen;

use flashattn::{
    AttentionConfig, AttentionMask, Backend, DType, Element, Layout, Operand, Problem, TensorRef,
};
use rand::rngs::StdRng;
use rand_distr::{Distribution, Normal};

/// How a (b, s, h, d) tensor is laid out in memory.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Storage {
    /// (b, s, h, d), nothing between elements.
    Packed,
    /// Stored as (b, h, s, d), the flash-attn layout permuted, with `n` unused elements after
    /// each row.
    HeadMajor(usize),
    /// Packed heads, with `n` unused elements after each row and after each batch.
    Padded(usize),
}

impl Storage {
    /// The layout of a (b, s, h, d) tensor of `shape` stored this way.
    pub fn layout(self, shape: [usize; 4]) -> Layout {
        let [_, s, h, d] = shape;
        match self {
            Storage::Packed => Layout::contiguous(shape),
            Storage::HeadMajor(n) => {
                let row = d + n;
                Layout::with_strides(shape, [h * s * row, row, s * row, 1])
            }
            Storage::Padded(n) => {
                let row = h * d + n;
                Layout::with_strides(shape, [s * row + n, row, d, 1])
            }
        }
    }
}

/// One attention problem of the correctness tests: Q (b, s_q, h_q, d), K (b, s_k, h_kv, d), V
/// (b, s_k, h_kv, d_v), and the options of the call. Built from [`Case::new`] and the builders
/// after it.
#[derive(Clone, Copy, Debug)]
pub struct Case {
    pub batch: usize,
    pub seqlen_q: usize,
    pub seqlen_k: usize,
    pub heads_q: usize,
    pub heads_kv: usize,
    pub head_dim: usize,
    /// V's head dim, and so O's, dO's and dV's (`head_dim` unless [`Case::head_dim_v`] says).
    pub head_dim_v: usize,
    /// The inputs' element type (the GPU runners, generic over it, set theirs).
    pub dtype: DType,
    pub mask: AttentionMask,
    pub softcap: Option<f32>,
    /// How Q, K, V, O and the gradients are stored (all alike).
    pub storage: Storage,
    /// Backward: fixed accumulation order.
    pub deterministic: bool,
}

impl Case {
    /// One batch of two heads (Q and K/V alike) in bf16, V's head dim Q's, no mask, no softcap,
    /// packed storage.
    pub fn new(seqlen_q: usize, seqlen_k: usize, head_dim: usize) -> Case {
        Case {
            batch: 1,
            seqlen_q,
            seqlen_k,
            heads_q: 2,
            heads_kv: 2,
            head_dim,
            head_dim_v: head_dim,
            dtype: DType::BF16,
            mask: AttentionMask::Full,
            softcap: None,
            storage: Storage::Packed,
            deterministic: false,
        }
    }
    /// `batch` sequences of the lengths given to [`Case::new`].
    pub fn batch(mut self, batch: usize) -> Self {
        self.batch = batch;
        self
    }
    /// `q` query heads over `kv` key/value heads (GQA or MQA when fewer).
    pub fn heads(mut self, q: usize, kv: usize) -> Self {
        (self.heads_q, self.heads_kv) = (q, kv);
        self
    }
    /// V (and so O, dO and dV) of head dim `d_v`.
    pub fn head_dim_v(mut self, d_v: usize) -> Self {
        self.head_dim_v = d_v;
        self
    }
    /// Inputs and outputs in `dtype`.
    pub fn dtype(mut self, dtype: DType) -> Self {
        self.dtype = dtype;
        self
    }
    /// The causal mask, or none, as [`AttentionConfig::causal`].
    pub fn causal(mut self, causal: bool) -> Self {
        self.mask = if causal {
            AttentionMask::Causal
        } else {
            AttentionMask::Full
        };
        self
    }
    /// A band around the diagonal, as [`AttentionConfig::window`].
    pub fn window(mut self, left: Option<usize>, right: Option<usize>) -> Self {
        self.mask = AttentionMask::Window { left, right };
        self
    }
    /// `cap · tanh(s / cap)` on the scaled scores.
    pub fn softcap(mut self, cap: f32) -> Self {
        self.softcap = Some(cap);
        self
    }
    /// Every tensor of the call stored as `storage` says.
    pub fn storage(mut self, storage: Storage) -> Self {
        self.storage = storage;
        self
    }
    /// (b, h, s, d) storage with padded rows, so strides are not packed: 8 spare elements per
    /// row keep them 16-byte multiples.
    pub fn strided(self) -> Self {
        self.storage(Storage::HeadMajor(8))
    }
    /// Whether the backward keeps a fixed accumulation order, as
    /// [`AttentionConfig::deterministic`].
    pub fn deterministic(mut self, deterministic: bool) -> Self {
        self.deterministic = deterministic;
        self
    }

    /// The call's options on `backend`.
    pub fn cfg(&self, backend: Backend) -> AttentionConfig {
        let mut cfg = AttentionConfig::new()
            .mask(self.mask)
            .deterministic(self.deterministic)
            .backend(backend);
        cfg.softcap = self.softcap;
        cfg
    }
    /// The sizes and dtype the planner sees.
    pub fn problem(&self) -> Problem {
        Problem {
            batch: self.batch,
            seqlen_q: self.seqlen_q,
            seqlen_k: self.seqlen_k,
            heads_q: self.heads_q,
            heads_kv: self.heads_kv,
            head_dim: self.head_dim,
            head_dim_v: self.head_dim_v,
            dtype: self.dtype,
            packed: false,
        }
    }
    /// Full reference when the score matrices are small enough for the CPU.
    pub fn checked_whole(&self) -> bool {
        let d = self.head_dim.max(self.head_dim_v);
        self.batch * self.heads_q * self.seqlen_q * self.seqlen_k * d <= 1 << 30
    }
    /// Q's (b, s_q, h_q, d), also dQ's (and O's and dO's where V's head dim is Q's).
    pub fn q_shape(&self) -> [usize; 4] {
        [self.batch, self.seqlen_q, self.heads_q, self.head_dim]
    }
    /// K's (b, s_k, h_kv, d), also dK's (and V's and dV's where V's head dim is K's).
    pub fn kv_shape(&self) -> [usize; 4] {
        [self.batch, self.seqlen_k, self.heads_kv, self.head_dim]
    }
    /// V's (b, s_k, h_kv, d_v), also dV's.
    pub fn v_shape(&self) -> [usize; 4] {
        [self.batch, self.seqlen_k, self.heads_kv, self.head_dim_v]
    }
    /// O's (b, s_q, h_q, d_v), also dO's.
    pub fn o_shape(&self) -> [usize; 4] {
        [self.batch, self.seqlen_q, self.heads_q, self.head_dim_v]
    }
    /// The layouts of Q's and K's shapes in the case's storage.
    pub fn layouts(&self) -> (Layout, Layout) {
        (
            self.storage.layout(self.q_shape()),
            self.storage.layout(self.kv_shape()),
        )
    }
    /// The layouts of V's and O's shapes in the case's storage.
    pub fn v_layouts(&self) -> (Layout, Layout) {
        (
            self.storage.layout(self.v_shape()),
            self.storage.layout(self.o_shape()),
        )
    }
    /// The case in one line: dtype, sizes, then whatever is not the default.
    pub fn name(&self) -> String {
        let mut s = format!(
            "{:?} b{} sq{} sk{} h{}:{} d{}",
            self.dtype,
            self.batch,
            self.seqlen_q,
            self.seqlen_k,
            self.heads_q,
            self.heads_kv,
            self.head_dim
        );
        if self.head_dim_v != self.head_dim {
            s += &format!(" dv{}", self.head_dim_v);
        }
        match self.mask {
            AttentionMask::Full => {}
            AttentionMask::Causal => s += " causal",
            mask => s += &format!(" window{:?}", mask.bounds()),
        }
        if let Some(c) = self.softcap {
            s += &format!(" softcap{c}");
        }
        if self.storage != Storage::Packed {
            s += &format!(" {:?}", self.storage);
        }
        if self.deterministic {
            s += " deterministic";
        }
        s
    }
    /// Q, K, V and dO in the case's layouts, drawn in that order by [`random_in`] (NaN in every
    /// slot a layout skips).
    pub fn random_operands<T: Element>(&self, rng: &mut StdRng) -> Operands<T> {
        let ((lq, lk), (lv, lo)) = (self.layouts(), self.v_layouts());
        let layouts = [lq, lk, lv, lo];
        Operands {
            bufs: layouts.map(|l| random_in(&l, rng)),
            layouts,
        }
    }
    /// N(0, 1) Q, K and V, drawn in that order, over their layouts' spans (padding included).
    pub fn random_qkv<T: Element>(&self, rng: &mut StdRng) -> [Vec<T>; 3] {
        let ((lq, lk), (lv, _)) = (self.layouts(), self.v_layouts());
        [
            random(span(&lq), rng),
            random(span(&lk), rng),
            random(span(&lv), rng),
        ]
    }
}

/// A case's Q, K, V and dO: buffers and the layouts they are read by.
pub struct Operands<T> {
    pub bufs: [Vec<T>; 4],
    pub layouts: [Layout; 4],
}

impl<T: Element> Operands<T> {
    /// Q, K, V and dO as tensors.
    pub fn tensors(&self) -> [TensorRef<'_, T>; 4] {
        let [q, k, v, dout] = &self.bufs;
        let [lq, lk, lv, lo] = self.layouts;
        [
            TensorRef::new(q, lq),
            TensorRef::new(k, lk),
            TensorRef::new(v, lv),
            TensorRef::new(dout, lo),
        ]
    }
}

/// The elements a layout's storage spans.
pub fn span(layout: &Layout) -> usize {
    layout.span(Operand::Q).unwrap()
}

/// N(0, 1) values rounded to T.
pub fn random<T: Element>(n: usize, rng: &mut StdRng) -> Vec<T> {
    let normal = Normal::new(0f32, 1.0).unwrap();
    (0..n).map(|_| T::from_f32(normal.sample(rng))).collect()
}

/// A buffer laid out by `layout`, holding N(0, 1) values rounded to T, drawn in (b, s, h, d)
/// order, and NaN in every slot the layout does not address (so reading one shows up as NaN in
/// the output).
pub fn random_in<T: Element>(layout: &Layout, rng: &mut StdRng) -> Vec<T> {
    let mut buf = poisoned(layout);
    let [nb, ns, nh, nd] = layout.shape;
    let mut values = random(nb * ns * nh * nd, rng).into_iter();
    for b in 0..nb {
        for s in 0..ns {
            for h in 0..nh {
                let off = layout.offset(b, s, h, 0);
                buf[off..off + nd].fill_with(|| values.next().unwrap());
            }
        }
    }
    buf
}

/// What a forward and its backward produced: O in its layout (Q's with V's head dim), dQ in Q's,
/// dK in K's and dV in V's, the LSE
/// (packed: `(heads_q, total_q)`), and the sinks' gradient where the calls had sinks.
pub struct Outputs<T> {
    pub out: Vec<T>,
    pub lse: Vec<f32>,
    pub dq: Vec<T>,
    pub dk: Vec<T>,
    pub dv: Vec<T>,
    pub dsinks: Option<Vec<f32>>,
}

/// NaN over the span of `layout`: an output whose unwritten elements show.
pub fn poisoned<T: Element>(layout: &Layout) -> Vec<T> {
    vec![T::from_f32(f32::NAN); span(layout)]
}

/// NaN count of a buffer laid out by `layout`, and the count of slots the layout does not
/// address (which must stay poisoned: the two agree when every addressed element was written).
pub fn untouched_nan<T: Element>(buf: &[T], layout: &Layout) -> (usize, usize) {
    let [nb, ns, nh, nd] = layout.shape;
    let nan = buf.iter().filter(|x| x.to_f32().is_nan()).count();
    (nan, buf.len() - nb * ns * nh * nd)
}
