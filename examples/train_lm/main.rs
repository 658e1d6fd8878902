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

mod data;
mod model;
mod training;

use std::collections::BTreeMap;

use candle_core::{Device, Result};

use data::corpus;
use model::{compute_dtype, Attention, Shape};
use training::{train, Run};

const VOCAB: usize = 256; // bytes
const SEED: u64 = 2026;

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
