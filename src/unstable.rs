//! Research apparatus, not a stable interface: the switches of the Hopper forward's schedule that
//! reproduce the FlashAttention-3 paper's ablations and that the benchmarks turn to measure one
//! choice against another. The defaults are what the library runs; what a switch does, and
//! whether it exists, may change between any two releases. The forward without intra-warpgroup
//! overlap is compiled only with the `ablation` Cargo feature, the TMA + WGMMA self-test (which
//! checks the toolchain on a Hopper GPU) only with the `selftest` feature.

#[cfg(feature = "selftest")]
pub use crate::cuda::selftest::{selftest_tma_wgmma, SelfTestReport};

/// Scheduling switches of the Hopper forward kernel. Turning `pingpong` or `intra_wg_overlap`
/// off reproduces the FlashAttention-3 paper's ablation (ping-pong between consumer warpgroups;
/// overlap of the next block's Q·Kᵀ with the current softmax inside a warpgroup); `pingpong`'s
/// default ([`PingPong::Auto`]) takes turns in the 16-bit forwards only.
/// `persistent_causal` runs causal/windowed calls on the persistent schedule (the default: one
/// CTA per SM, each taking pairs of a head's heaviest and lightest query blocks); off, one CTA
/// per pair.
/// `narrow_key_blocks` uses the causal tile (128-key blocks at d64/d96/d128) for every call; it is
/// also taken by itself when seqlen_k ≤ 1024, where it was measured faster.
/// `split_tail` (forward with no window, or with one query block per head under any mask):
/// whether the tiles of the last partial wave (or of a call with fewer tiles than SMs) are
/// split by key blocks over the SMs and the pieces merged
/// (split-KV; csrc/sm90/fwd_tail.h). A split call takes a workspace of up to 35 MB (d256, 132
/// SMs) in stream order and gives it back at its end, to a memory pool of this library's that
/// keeps up to 128 MiB per device across synchronizations (csrc/common/workspace_pool.h); a
/// KV-cache call's key splits take theirs alike, of up to 1 GiB (`num_splits` on
/// `DeviceKvCacheInputs`).
/// `pack_gqa` (KV-cache calls with GQA): whether a tile's rows are (query row, query head)
/// pairs of one KV head's group rather than one query head's rows ([`PackGqa`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Sm90Schedule {
    pub pingpong: PingPong,
    pub intra_wg_overlap: bool,
    pub persistent_causal: bool,
    pub narrow_key_blocks: bool,
    pub split_tail: TailSplit,
    pub pack_gqa: PackGqa,
}

/// See [`Sm90Schedule`]'s `pack_gqa`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum PackGqa {
    /// Where packing fills the 128-row tiles better (as FlashAttention-3 decides): a query
    /// length whose tiles are less than 90% as full as the packed rows' (decode steps, short
    /// chunks).
    #[default]
    Auto,
    /// Whenever the query heads outnumber the KV heads.
    On,
    Off,
}

impl PackGqa {
    /// Whether a KV-cache call of `seqlen_q` query rows and `group` query heads per KV head
    /// packs them.
    pub fn packs(self, seqlen_q: usize, group: usize) -> bool {
        let fill = |rows: usize| rows as f64 / rows.div_ceil(128).max(1) as f64 / 128.0;
        group > 1
            && match self {
                PackGqa::Auto => fill(seqlen_q) < 0.9 * fill(seqlen_q.saturating_mul(group)),
                PackGqa::On => true,
                PackGqa::Off => false,
            }
    }
}

/// See [`Sm90Schedule`]'s `pingpong`: whether the two consumer warpgroups take turns issuing
/// their GEMMs, so that one's softmax runs beside the other's GEMMs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum PingPong {
    /// On in the bf16/fp16 forwards, off in the FP8 forward, where the turns measured slower
    /// (docs/PERFORMANCE.md; in the 16-bit forwards they pay).
    #[default]
    Auto,
    On,
    Off,
}

impl PingPong {
    /// Whether the warpgroups take turns in a forward whose Q, K and V are `dtype`.
    pub fn takes_turns(self, dtype: crate::DType) -> bool {
        match self {
            PingPong::Auto => dtype != crate::DType::E4M3,
            PingPong::On => true,
            PingPong::Off => false,
        }
    }
}

/// See [`Sm90Schedule`]'s `split_tail`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum TailSplit {
    /// Where it is predicted to pay (long keys over fewer tiles than SMs, mostly).
    #[default]
    Auto,
    /// Every tile runs whole.
    Off,
    /// Wherever it can (for tests and measurements): not with a mask over several query blocks,
    /// with `intra_wg_overlap` off (the 16-bit ablation; the FP8 d128 tile's own serial loop
    /// splits), with one key block, or when the workspace cannot be allocated.
    Always,
}

impl Default for Sm90Schedule {
    fn default() -> Self {
        Sm90Schedule {
            pingpong: PingPong::Auto,
            intra_wg_overlap: true,
            persistent_causal: true,
            narrow_key_blocks: false,
            split_tail: TailSplit::Auto,
            pack_gqa: PackGqa::Auto,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pingpong_auto_takes_turns_in_the_16_bit_forwards_only() {
        use crate::DType;
        assert!(PingPong::Auto.takes_turns(DType::BF16));
        assert!(PingPong::Auto.takes_turns(DType::F16));
        assert!(!PingPong::Auto.takes_turns(DType::E4M3));
        assert!(PingPong::On.takes_turns(DType::E4M3));
        assert!(!PingPong::Off.takes_turns(DType::BF16));
    }

    #[test]
    fn pack_gqa_auto_packs_short_queries_of_groups() {
        // A decode step fills 1 of 128 rows alone, 8 packed.
        assert!(PackGqa::Auto.packs(1, 8));
        assert!(PackGqa::Auto.packs(4, 4));
        // Whole tiles either way: no packing.
        assert!(!PackGqa::Auto.packs(1024, 8));
        // 120 of 128 rows (94%) against 960 of 1024 (94%): no gain.
        assert!(!PackGqa::Auto.packs(120, 8));
        // No group to pack, or packing turned off.
        assert!(!PackGqa::On.packs(1, 1));
        assert!(!PackGqa::Off.packs(1, 8));
        assert!(PackGqa::On.packs(1024, 2));
    }
}
