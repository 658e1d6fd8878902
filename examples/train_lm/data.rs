//! The training text and its batches.

use candle_core::{Device, Result, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::SEED;

/// Seeded text: sentences of words built from syllables, some words far more frequent.
pub fn corpus(bytes: usize) -> Vec<u8> {
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
pub fn batch(
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
