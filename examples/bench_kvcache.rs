//! Decoding over a dense KV cache on the device (`Device::kvcache_forward_into`): one query per
//! sequence, GQA 8:1 (32 query heads, 4 KV heads), d128, bf16, every sequence's cache full
//! (but with `--ragged`);
//! batch 1 to 128, cache 1k to 128k keys (the longest where batch × cache ≤ 4M keys). Decode is
//! bound by reading the cache, so each row gives
//! the bytes of K and V read over the time (GB/s) beside a device-to-device copy of as many bytes
//! timed the same way (the copy ceiling of that size: read and written, counted once each), and
//! their ratio. Timed as bench_table (`common::Protocol`: its flags). `--paged P` holds the same
//! cache in pages of P rows, each sequence's pages scattered over the cache by its block table
//! (P need not divide the cache: each sequence's last page is then partly used).
//! `--splits N` asks for N key splits (`DeviceKvCacheInputs::num_splits`; default 0, the
//! launcher's choice), `--sm80` runs the Ampere forward (`Backend::Sm80`: no packing, no
//! splits; paged, pages of any size), `--no-pack` runs each query head's row in a tile of its own
//! (`PackGqa::Off`; by default a KV head's 8 query heads share one), `--narrow` asks the Hopper
//! forward for its narrower key blocks (`Sm90Schedule::narrow_key_blocks`). `--shape B,C` times batch B
//! at cache C alone (for profilers). `--step` times whole steps (`Device::kvcache_step_into`):
//! each appends one key and value per sequence, the last of its cache, with rotary embedding of
//! the key and the query over the whole head, then attends to the full cache. `--e4m3` holds the
//! cache in e4m3 with descales (the Hopper or, with `--sm80`, the Ampere forward widens its rows
//! to the queries' type in shared memory; built with the `kvcache-fp8` feature): half the bytes,
//! against the copy ceiling of those. `--f16` takes queries, O and a 16-bit cache in fp16
//! instead of bf16 (an e4m3 cache's widening to fp16 is one conversion a pair, to bf16 more).
//! `--ragged` fills each sequence's cache part way: sequence b holds C − 1 − (53·b mod 127) keys,
//! so that its last key block ends inside a tile (the rows past the count are read and
//! discarded); GB/s then counts the keys held, and the copy ceiling copies as many bytes.
//!
//! `cargo run --release --example bench_kvcache -- [--paged P] [--splits N] [--sm80] [--no-pack]
//! [--narrow] [--shape B,C] [--step] [--e4m3] [--f16] [--ragged] --out kvcache.json`

mod common;

use std::sync::Arc;

use cudarc::driver::DeviceRepr;
use flashattn::cuda::{
    CudaStream, Device, DeviceCacheDescales, DeviceKvCacheInputs, DeviceKvCacheStep, DeviceRotary,
    DeviceTensor, DeviceTensorMut,
};
use flashattn::unstable::{PackGqa, Sm90Schedule};
use flashattn::DType;
use flashattn::{AttentionConfig, Backend, Element};
use float8::F8E4M3;
use half::{bf16, f16};

const HEADS_Q: usize = 32;
const HEADS_KV: usize = 4;
const D: usize = 128;
const PROTOCOL: common::Protocol = common::Protocol {
    warmup: 5,
    min_reps: 20,
    max_reps: 100,
    target_ms: 200.0,
    cool_ms: 20.0,
};

/// What every row of a run shares.
struct Bench {
    dev: Device,
    stream: Arc<CudaStream>,
    protocol: common::Protocol,
    cfg: AttentionConfig,
    pack_gqa: PackGqa,
    page_size: Option<usize>,
    num_splits: usize,
    step: bool,
    ragged: bool,
}

fn main() {
    let args = common::Args::parse();
    let dev = common::device("bench_kvcache");
    let stream = dev.new_stream().unwrap();
    let protocol = common::Protocol::from_args(&args, PROTOCOL);
    let pack_gqa = if args.flag("--no-pack") {
        PackGqa::Off
    } else {
        PackGqa::Auto
    };
    let cfg = AttentionConfig::new()
        .causal(true)
        .sm90_schedule(Sm90Schedule {
            pack_gqa,
            narrow_key_blocks: args.flag("--narrow"),
            ..Sm90Schedule::default()
        });
    // The Ampere forward packs no query heads (its rows say so).
    let (cfg, pack_gqa) = if args.flag("--sm80") {
        (cfg.backend(Backend::Sm80), PackGqa::Off)
    } else {
        (cfg, pack_gqa)
    };
    let shape: Option<(usize, usize)> = args.value("--shape").map(|v| {
        let (b, c) = v.split_once(',').expect("--shape B,C");
        (
            b.parse().expect("--shape B,C"),
            c.parse().expect("--shape B,C"),
        )
    });
    let bench = Bench {
        dev,
        stream,
        protocol,
        cfg,
        pack_gqa,
        page_size: args.value("--paged").map(|p| p.parse().expect("--paged P")),
        num_splits: args
            .value("--splits")
            .map_or(0, |n| n.parse().expect("--splits N")),
        step: args.flag("--step"),
        ragged: args.flag("--ragged"),
    };
    let e4m3 = args.flag("--e4m3");
    let f16_queries = args.flag("--f16");
    // The JSON is written again after every row, so that a run cut short keeps what it measured.
    let write = |rows: &[String]| {
        if let Some(path) = args.value("--out") {
            let extra = format!(", \"timing\": {{{}}}", bench.protocol.json_fields());
            common::store_results(
                &path,
                &common::describe(bench.dev.info()),
                &args.commit(),
                &extra,
                rows,
            );
        }
    };
    let mut rows = vec![];
    for batch in [1usize, 8, 32, 128] {
        for cache in [1024usize, 8192, 32768, 131072] {
            if batch * cache > 1 << 22 || shape.is_some_and(|s| s != (batch, cache)) {
                continue;
            }
            rows.push(match (e4m3, f16_queries) {
                (true, false) => bench.row::<bf16, F8E4M3>(batch, cache),
                (true, true) => bench.row::<f16, F8E4M3>(batch, cache),
                (false, false) => bench.row::<bf16, bf16>(batch, cache),
                (false, true) => bench.row::<f16, f16>(batch, cache),
            });
            write(&rows);
        }
    }
    if let Some(path) = args.value("--out").filter(|_| !rows.is_empty()) {
        println!("wrote {path}");
    }
}

impl Bench {
    /// Batch `batch` decoding, queries and O in `Q`, over caches of `cache` keys held in `C`
    /// (`Q`, or e4m3 with
    /// descales): timed, printed, and its JSON row.
    fn row<Q: Element + DeviceRepr, C: Element + DeviceRepr>(
        &self,
        batch: usize,
        cache: usize,
    ) -> String {
        let Bench {
            dev,
            stream,
            protocol,
            cfg,
            pack_gqa,
            page_size,
            num_splits,
            step,
            ragged,
        } = self;
        let (page_size, num_splits, step) = (*page_size, *num_splits, *step);
        // Each sequence's keys after the call (a step appends one).
        let held = |b: usize| {
            if *ragged {
                cache - 1 - (53 * b) % 127
            } else {
                cache
            }
        };
        let kv_elems = batch * cache * HEADS_KV * D;
        let read_elems = (0..batch).map(held).sum::<usize>() * HEADS_KV * D;
        // Paged, each sequence's last page partly used where P does not divide the cache: the
        // buffers hold whole pages (the bytes read and copied stay the keys held).
        let held_elems =
            page_size.map_or(kv_elems, |p| batch * cache.div_ceil(p) * p * HEADS_KV * D);
        // Finite, not zero: a few distinct values (e4m3 holds them too, to within its rounding).
        fn fill<E: Element>(n: usize, seed: usize) -> Vec<E> {
            (0..n)
                .map(|i| E::from_f32((((i * 7 + seed) % 23) as f32 - 11.0) / 11.0))
                .collect()
        }
        let q = stream
            .clone_htod(&fill::<Q>(batch * HEADS_Q * D, 1))
            .unwrap();
        let mut k = stream.clone_htod(&fill::<C>(held_elems, 2)).unwrap();
        let mut v = stream.clone_htod(&fill::<C>(held_elems, 3)).unwrap();
        // An e4m3 cache's descales, one per (sequence, KV head).
        let e4m3 = C::DTYPE == flashattn::DType::E4M3;
        let descales = stream.clone_htod(&vec![0.5f32; batch * HEADS_KV]).unwrap();
        let descales = descales.as_view();
        let descales = e4m3.then_some(DeviceCacheDescales {
            k: &descales,
            v: &descales,
        });
        // A step appends each sequence's last key: its cache holds one fewer before.
        let lens: Vec<i32> = (0..batch)
            .map(|b| (held(b) - usize::from(step)) as i32)
            .collect();
        let lens = stream.clone_htod(&lens).unwrap();
        let new_kv = stream
            .clone_htod(&fill::<Q>(batch * HEADS_KV * D, 4))
            .unwrap();
        let half = D / 2;
        let angle =
            |i: usize| (i / half) as f32 * 10000f32.powf(-((i % half) as f32) / half as f32);
        let cos: Vec<f32> = (0..cache * half).map(|i| angle(i).cos()).collect();
        let sin: Vec<f32> = (0..cache * half).map(|i| angle(i).sin()).collect();
        let (cos, sin) = (
            stream.clone_htod(&cos).unwrap(),
            stream.clone_htod(&sin).unwrap(),
        );
        let (cos, sin) = (cos.as_view(), sin.as_view());
        let mut out = stream
            .clone_htod(&fill::<Q>(batch * HEADS_Q * D, 5))
            .unwrap();
        let mut lse = stream.alloc_zeros::<f32>(batch * HEADS_Q).unwrap();
        // Paged: page i of sequence b at (b·pages + i)·stride mod the pages, a stride prime
        // to their count, so that no two neighbours in a sequence are neighbours in memory.
        let (cache_shape, table) = match page_size {
            None => ([batch, cache, HEADS_KV, D], None),
            Some(p) => {
                let pages = batch * cache.div_ceil(p);
                let stride = (2..).find(|s| gcd(*s, pages) == 1 && *s > 7).unwrap();
                let table: Vec<i32> = (0..pages).map(|i| (i * stride % pages) as i32).collect();
                (
                    [pages, p, HEADS_KV, D],
                    Some(stream.clone_htod(&table).unwrap()),
                )
            }
        };
        let qt = DeviceTensor::contiguous(&q, [batch, 1, HEADS_Q, D]);
        let new_t = DeviceTensor::contiguous(&new_kv, [batch, 1, HEADS_KV, D]);
        let mut plan = None;
        let (ms, reps) = protocol.median_ms(stream, || {
            let mut o = DeviceTensorMut::contiguous(&mut out, [batch, 1, HEADS_Q, D]);
            let table = table.as_ref().map(|t| t.as_view());
            plan = Some(if step {
                let (mut kt, mut vt) = (
                    DeviceTensorMut::contiguous(&mut k, cache_shape),
                    DeviceTensorMut::contiguous(&mut v, cache_shape),
                );
                let step = DeviceKvCacheStep {
                    q: &qt,
                    k_cache: &mut kt,
                    v_cache: &mut vt,
                    block_table: table,
                    cache_batch_idx: None,
                    cache_seqlens: lens.as_view(),
                    new: Some((&new_t, &new_t)),
                    rotary: Some(DeviceRotary {
                        cos: &cos,
                        sin: &sin,
                        dim: D,
                        interleaved: false,
                    }),
                    sinks: None,
                    num_splits,
                    descales,
                };
                dev.kvcache_step_into(stream, cfg, step, &mut o, &mut lse.as_view_mut())
                    .expect("KV-cache step")
            } else {
                let (kt, vt) = (
                    DeviceTensor::contiguous(&k, cache_shape),
                    DeviceTensor::contiguous(&v, cache_shape),
                );
                let inputs = DeviceKvCacheInputs {
                    q: &qt,
                    k_cache: &kt,
                    v_cache: &vt,
                    block_table: table,
                    cache_batch_idx: None,
                    cache_seqlens: lens.as_view(),
                    sinks: None,
                    num_splits,
                    descales,
                };
                dev.kvcache_forward_into(stream, cfg, inputs, &mut o, &mut lse.as_view_mut())
                    .expect("KV-cache forward")
            });
        });
        // The copy ceiling at this size: the keys' and values' bytes read, copied once.
        // SAFETY: only the copies write it, and nothing reads it.
        let mut dst = unsafe { stream.alloc::<C>(2 * read_elems) }.unwrap();
        let (copy_ms, _) = protocol.median_ms(stream, || {
            stream
                .memcpy_dtod(&k.slice(..read_elems), &mut dst.slice_mut(..read_elems))
                .unwrap();
            stream
                .memcpy_dtod(&v.slice(..read_elems), &mut dst.slice_mut(read_elems..))
                .unwrap();
        });
        let bytes = (2 * read_elems * std::mem::size_of::<C>()) as f64;
        let gbps = bytes / (ms * 1e-3) / 1e9;
        let copy_gbps = 2.0 * bytes / (copy_ms * 1e-3) / 1e9;
        let plan = plan.unwrap();
        println!(
            "{}{}{}{}{} b{batch:<3} cache {cache:>5}: {ms:.4} ms {gbps:>6.0} GB/s, copy {copy_gbps:.0} GB/s ({:.2}) ({})",
            if step { "step" } else { "decode" },
            if e4m3 { " e4m3" } else { "" },
            if Q::DTYPE == DType::F16 { " f16" } else { "" },
            page_size.map_or(String::new(), |p| format!(" pages of {p}")),
            if *ragged { " ragged" } else { "" },
            gbps / copy_gbps,
            plan.explain()
        );
        format!(
            "  {{\"impl\": \"flashattn-{}\", \"kind\": \"decode\", \"dtype\": \"{}\", \
             \"cache_dtype\": \"{}\", \"d\": {D}, \"batch\": {batch}, \"seqlen_q\": 1, \
             \"seqlen_k\": {cache}, \"heads\": {HEADS_Q}, \"heads_kv\": {HEADS_KV}, \"causal\": true, \
             \"fwd_ms\": {ms:.5}, \"fwd_reps\": {reps}, \"gbps\": {gbps:.1}, \"copy_gbps\": {copy_gbps:.1}, \
             \"of_copy\": {:.3}, \"pack_gqa\": \"{pack_gqa:?}\", \"num_splits\": {num_splits}, \
             \"narrow_key_blocks\": {}, \"step\": {step}, \"ragged\": {ragged}{}}}",
            plan.backend.name(),
            dtype_name(Q::DTYPE),
            if e4m3 { "e4m3" } else { dtype_name(Q::DTYPE) },
            gbps / copy_gbps,
            cfg.sm90_schedule.narrow_key_blocks,
            page_size.map_or(String::new(), |p| format!(", \"page_size\": {p}"))
        )
    }
}

/// As results files name the element types.
fn dtype_name(dtype: DType) -> &'static str {
    match dtype {
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        DType::F32 => "f32",
        DType::E4M3 => "e4m3",
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}
