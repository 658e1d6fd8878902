//! The one table of the CUDA kernels this crate can build. build.rs reads it (the same file,
//! through `#[path]`) to generate the instantiation units (grouped, or one per tile row with
//! `FLASHATTN_UNITS=tile-row`), the kernels' declarations and the C entry points' dispatch, and
//! the extended WGMMA atoms its tiles take; the Rust dispatcher reads it to know which head dims
//! and element types each family takes, which kernels this build holds, and which Cargo feature
//! a missing one needs. A new kernel is a new row here, not a new file or a new switch.
//!
//! Build budget: each kernel is built only when every Cargo feature it names is on (`sm90`,
//! `sm80`, `backward`, `fp8`, `hdim64`, `hdim128`, `hdim256`: the feature `kernels`, on by
//! default; and `hdim96`, `hdim192`, off by default), so that `--no-default-features --features
//! cuda,cuda-13000,sm90,hdim128` builds the Hopper d128 forwards alone (`cuda` needs one of the
//! CUDA version features beside it).

/// A kernel family: one algorithm, architecture and pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Family {
    /// FlashAttention-3-style forward, bf16/fp16 (csrc/sm90/fwd_launch.h).
    Sm90Fwd,
    /// The FP8 (e4m3) forward on the same pipeline (csrc/sm90/fwd_fp8_launch.h).
    Sm90Fp8Fwd,
    /// The 16-bit forward over an e4m3 KV cache, each row (staged or gathered) widened to Q's
    /// type in shared memory (csrc/sm90/fwd_launch.h, `run_fwd_fp8_cache`): the 16-bit forward's
    /// Masked tile.
    Sm90Fp8CacheFwd,
    /// FlashAttention-3-style backward (csrc/sm90/bwd_launch.h).
    Sm90Bwd,
    /// FlashAttention-2-style forward (csrc/sm80/fwd_launch.h).
    Sm80Fwd,
    /// FlashAttention-2-style backward (csrc/sm80/bwd_launch.h).
    Sm80Bwd,
    /// The FlashAttention-2-style forward over an e4m3 KV cache, each copied row widened to Q's
    /// type in shared memory (csrc/sm80/fwd_launch.h, `run_fwd_fp8_cache`): the forward's tiles.
    Sm80Fp8CacheFwd,
}

impl Family {
    pub const ALL: [Family; 7] = [
        Family::Sm90Fwd,
        Family::Sm90Fp8Fwd,
        Family::Sm90Fp8CacheFwd,
        Family::Sm90Bwd,
        Family::Sm80Fwd,
        Family::Sm80Bwd,
        Family::Sm80Fp8CacheFwd,
    ];

    /// Its name in kernel names and messages.
    pub fn name(self) -> &'static str {
        match self {
            Family::Sm90Fwd => "sm90 fwd",
            Family::Sm90Fp8Fwd => "sm90 fp8 fwd",
            Family::Sm90Fp8CacheFwd => "sm90 fwd over an e4m3 cache",
            Family::Sm90Bwd => "sm90 bwd",
            Family::Sm80Fwd => "sm80 fwd",
            Family::Sm80Bwd => "sm80 bwd",
            Family::Sm80Fp8CacheFwd => "sm80 fwd over an e4m3 cache",
        }
    }

    /// The Cargo features its kernels need besides their head dim's.
    pub fn features(self) -> &'static [&'static str] {
        match self {
            Family::Sm90Fwd => &["sm90"],
            Family::Sm90Fp8Fwd => &["sm90", "fp8"],
            Family::Sm90Fp8CacheFwd => &["sm90", "kvcache-fp8"],
            Family::Sm90Bwd => &["sm90", "backward"],
            Family::Sm80Fwd => &["sm80"],
            Family::Sm80Bwd => &["sm80", "backward"],
            Family::Sm80Fp8CacheFwd => &["sm80", "kvcache-fp8"],
        }
    }

    /// Its kernels read K and V from an e4m3 KV cache under 16-bit Q.
    pub fn reads_e4m3_cache(self) -> bool {
        matches!(self, Family::Sm90Fp8CacheFwd | Family::Sm80Fp8CacheFwd)
    }

    /// The family whose rows of the tile table its kernels take: its own, but the forwards over
    /// an e4m3 cache run the 16-bit forwards' tiles (their stages hold the widened rows).
    pub fn tile_family(self) -> Family {
        match self {
            Family::Sm90Fp8CacheFwd => Family::Sm90Fwd,
            Family::Sm80Fp8CacheFwd => Family::Sm80Fwd,
            f => f,
        }
    }
}

/// The element type of a kernel's Q, K and V.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KernelDtype {
    Bf16,
    Fp16,
    E4m3,
}

impl KernelDtype {
    pub fn name(self) -> &'static str {
        match self {
            KernelDtype::Bf16 => "bf16",
            KernelDtype::Fp16 => "fp16",
            KernelDtype::E4m3 => "e4m3",
        }
    }
}

/// One kernel: a family instantiated for a head dim and an element type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Kernel {
    pub family: Family,
    /// Head dim of Q and K.
    pub head_dim: usize,
    /// Head dim of V and O (and dO, dV): the same, or another where a row says so.
    pub head_dim_v: usize,
    pub dtype: KernelDtype,
    /// Has a forward without intra-warpgroup overlap (the FlashAttention-3 paper's ablation,
    /// `unstable::Sm90Schedule::intra_wg_overlap` off), compiled with the `ablation` feature.
    pub ablation: bool,
}

pub(crate) const fn kernel(family: Family, head_dim: usize, dtype: KernelDtype) -> Kernel {
    kernel_v(family, head_dim, head_dim, dtype)
}

/// A kernel whose V and O have head dim `head_dim_v`.
pub(crate) const fn kernel_v(
    family: Family,
    head_dim: usize,
    head_dim_v: usize,
    dtype: KernelDtype,
) -> Kernel {
    Kernel {
        family,
        head_dim,
        head_dim_v,
        dtype,
        ablation: false,
    }
}

use Family::*;
use KernelDtype::*;

/// Every kernel, in the order build.rs compiles them.
pub const KERNELS: &[Kernel] = &[
    kernel(Sm90Fwd, 64, Bf16),
    Kernel {
        ablation: true,
        ..kernel(Sm90Fwd, 128, Bf16)
    },
    kernel(Sm90Fwd, 256, Bf16),
    kernel(Sm90Fwd, 64, Fp16),
    kernel(Sm90Fwd, 128, Fp16),
    kernel(Sm90Fwd, 256, Fp16),
    kernel(Sm90Fwd, 96, Bf16),
    kernel(Sm90Fwd, 96, Fp16),
    kernel(Sm90Fwd, 192, Bf16),
    kernel(Sm90Fwd, 192, Fp16),
    kernel_v(Sm90Fwd, 192, 128, Bf16),
    kernel_v(Sm90Fwd, 192, 128, Fp16),
    kernel(Sm90Fp8Fwd, 64, E4m3),
    kernel(Sm90Fp8Fwd, 128, E4m3),
    kernel(Sm90Fp8Fwd, 256, E4m3),
    kernel(Sm90Fp8Fwd, 96, E4m3),
    kernel(Sm90Fp8Fwd, 192, E4m3),
    kernel(Sm90Fp8CacheFwd, 64, Bf16),
    kernel(Sm90Fp8CacheFwd, 128, Bf16),
    kernel(Sm90Fp8CacheFwd, 256, Bf16),
    kernel(Sm90Fp8CacheFwd, 64, Fp16),
    kernel(Sm90Fp8CacheFwd, 128, Fp16),
    kernel(Sm90Fp8CacheFwd, 256, Fp16),
    kernel(Sm90Bwd, 64, Bf16),
    kernel(Sm90Bwd, 128, Bf16),
    kernel(Sm90Bwd, 256, Bf16),
    kernel(Sm90Bwd, 64, Fp16),
    kernel(Sm90Bwd, 128, Fp16),
    kernel(Sm90Bwd, 256, Fp16),
    kernel(Sm90Bwd, 192, Bf16),
    kernel(Sm90Bwd, 192, Fp16),
    kernel(Sm90Bwd, 96, Bf16),
    kernel(Sm90Bwd, 96, Fp16),
    kernel_v(Sm90Bwd, 192, 128, Bf16),
    kernel_v(Sm90Bwd, 192, 128, Fp16),
    kernel(Sm80Fwd, 64, Bf16),
    kernel(Sm80Fwd, 128, Bf16),
    kernel(Sm80Fwd, 256, Bf16),
    kernel(Sm80Fwd, 64, Fp16),
    kernel(Sm80Fwd, 128, Fp16),
    kernel(Sm80Fwd, 256, Fp16),
    kernel(Sm80Fwd, 96, Bf16),
    kernel(Sm80Fwd, 96, Fp16),
    kernel(Sm80Fwd, 192, Bf16),
    kernel(Sm80Fwd, 192, Fp16),
    kernel_v(Sm80Fwd, 192, 128, Bf16),
    kernel_v(Sm80Fwd, 192, 128, Fp16),
    kernel(Sm80Bwd, 64, Bf16),
    kernel(Sm80Bwd, 128, Bf16),
    kernel(Sm80Bwd, 256, Bf16),
    kernel(Sm80Bwd, 64, Fp16),
    kernel(Sm80Bwd, 128, Fp16),
    kernel(Sm80Bwd, 256, Fp16),
    kernel(Sm80Bwd, 96, Bf16),
    kernel(Sm80Bwd, 96, Fp16),
    kernel(Sm80Bwd, 192, Bf16),
    kernel(Sm80Bwd, 192, Fp16),
    kernel_v(Sm80Bwd, 192, 128, Bf16),
    kernel_v(Sm80Bwd, 192, 128, Fp16),
    kernel(Sm80Fp8CacheFwd, 64, Bf16),
    kernel(Sm80Fp8CacheFwd, 128, Bf16),
    kernel(Sm80Fp8CacheFwd, 256, Bf16),
    kernel(Sm80Fp8CacheFwd, 64, Fp16),
    kernel(Sm80Fp8CacheFwd, 128, Fp16),
    kernel(Sm80Fp8CacheFwd, 256, Fp16),
];

/// The Cargo feature of each head dim.
pub const HEAD_DIM_FEATURES: &[(usize, &str)] = &[
    (64, "hdim64"),
    (96, "hdim96"),
    (128, "hdim128"),
    (192, "hdim192"),
    (256, "hdim256"),
];

/// A kernel's tile: the work of one CTA step and the code-shape switches tuned with it. Each
/// is chosen by its shared-memory and register budget and then measured (docs/PERFORMANCE.md).
/// build.rs writes each row into the unit holding its kernels as the family's tile struct, so
/// that retuning one head dim recompiles that unit alone (with `FLASHATTN_UNITS=tile-row`, a unit
/// holding that head dim's kernels only).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Tile {
    /// The sm90 forward, 16-bit and FP8: 128 query rows (two consumer warpgroups of 64), keys
    /// per block, the K/V pipeline's depth, Q buffers (two let the next tile's first Q·Kᵀ go
    /// out beside this tile's last P·V); a second copy of the key-block loop for blocks that
    /// need no mask; the last partial wave split by key blocks; FP8: the V-descale ratio by
    /// IEEE division (where ptxas then lets the softmax run beside P·V); the next block's Q·Kᵀ
    /// issued beside this block's P·V (intra-warpgroup overlap; off, each block's GEMMs wait on
    /// its softmax, so that the next block's S need not be live beside this block's P and O:
    /// the FP8 d128 256-key block fits the registers only so).
    Sm90Fwd {
        block_n: usize,
        stages: usize,
        q_stages: usize,
        unmasked_loop: bool,
        tail_split: bool,
        ieee_descale_ratio: bool,
        intra_wg_overlap: bool,
    },
    /// The sm90 backward: query rows per block, keys per CTA, the Q/dS and dO buffers, and how
    /// the two consumer warpgroups share a CTA's work.
    Sm90Bwd {
        block_m: usize,
        block_n: usize,
        stages: usize,
        stages_do: usize,
        warpgroups: BwdWarpgroups,
    },
    /// The sm80 forward: query rows and keys per block, warps, K/V buffers, Q kept in
    /// registers.
    Sm80Fwd {
        block_m: usize,
        block_n: usize,
        warps: usize,
        stages: usize,
        q_in_regs: bool,
    },
    /// The sm80 backward: query rows and keys per block, warps, and how the warps tile the
    /// S/dP, dK/dV and dQ products along M.
    Sm80Bwd {
        block_m: usize,
        block_n: usize,
        warps: usize,
        atom_m_sdp: usize,
        atom_n_dkv: usize,
        atom_m_dq: usize,
    },
}

/// How the sm90 backward's two consumer warpgroups share a CTA's keys (csrc/sm90/bwd_*.h).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BwdWarpgroups {
    /// Each its half of the keys, as the GEMMs' M, over the whole head dim (bwd_kernel.h).
    SplitKeys,
    /// All the keys as M, each its half of the head dim (bwd_kernel_split_d.h).
    SplitHeadDim,
    /// Each its half of the keys as the GEMMs' N, the head dims as dKᵀ's and dVᵀ's M
    /// (bwd_kernel_keys_n.h): more keys per CTA than the keys as M leave registers for.
    KeysAsN,
}

/// Which calls a tile serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TileRole {
    /// Every call its family's kernel takes, unless a `Masked` tile exists and applies.
    Base,
    /// sm90 forward: calls with a right bound on the keys (causal, windows), whose diagonal
    /// blocks waste less work when narrower, and calls asking for narrow key blocks.
    Masked,
}

/// One row of the tile table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TileRow {
    pub family: Family,
    pub head_dim: usize,
    pub head_dim_v: usize,
    pub role: TileRole,
    pub tile: Tile,
}

/// The 16-bit forward: the FP8 tile's fields, with no IEEE descale ratio (it has no descales).
const fn sm90_fwd(block_n: usize, q_stages: usize, unmasked_loop: bool) -> Tile {
    sm90_fp8_fwd(block_n, q_stages, unmasked_loop, false)
}

/// Two K/V stages and the tail split, in both forwards.
const fn sm90_fp8_fwd(block_n: usize, q_stages: usize, unmasked_loop: bool, ieee: bool) -> Tile {
    Tile::Sm90Fwd {
        block_n,
        stages: 2,
        q_stages,
        unmasked_loop,
        tail_split: true,
        ieee_descale_ratio: ieee,
        intra_wg_overlap: true,
    }
}

/// The FP8 forward without intra-warpgroup overlap (the serial loop has no copy for unmasked
/// blocks).
const fn sm90_fp8_fwd_serial(block_n: usize, q_stages: usize, ieee: bool) -> Tile {
    Tile::Sm90Fwd {
        block_n,
        stages: 2,
        q_stages,
        unmasked_loop: false,
        tail_split: true,
        ieee_descale_ratio: ieee,
        intra_wg_overlap: false,
    }
}

/// Two Q/dS buffers; `stages_do` dO buffers.
const fn sm90_bwd(
    block_m: usize,
    block_n: usize,
    stages_do: usize,
    warpgroups: BwdWarpgroups,
) -> Tile {
    Tile::Sm90Bwd {
        block_m,
        block_n,
        stages: 2,
        stages_do,
        warpgroups,
    }
}

/// Four warps (16 query rows per warp and MMA atom).
const fn sm80_fwd(block_m: usize, block_n: usize, stages: usize, q_in_regs: bool) -> Tile {
    Tile::Sm80Fwd {
        block_m,
        block_n,
        warps: 4,
        stages,
        q_in_regs,
    }
}

/// Eight warps; `atoms`: warps along M of S/dP, along N of dK/dV, along M of dQ.
const fn sm80_bwd(block_m: usize, block_n: usize, atoms: [usize; 3]) -> Tile {
    Tile::Sm80Bwd {
        block_m,
        block_n,
        warps: 8,
        atom_m_sdp: atoms[0],
        atom_n_dkv: atoms[1],
        atom_m_dq: atoms[2],
    }
}

const fn row(family: Family, head_dim: usize, role: TileRole, tile: Tile) -> TileRow {
    row_v(family, head_dim, head_dim, role, tile)
}

/// A row of kernels whose V and O have head dim `head_dim_v`.
const fn row_v(
    family: Family,
    head_dim: usize,
    head_dim_v: usize,
    role: TileRole,
    tile: Tile,
) -> TileRow {
    TileRow {
        family,
        head_dim,
        head_dim_v,
        role,
        tile,
    }
}

use BwdWarpgroups::*;
use TileRole::*;

/// The sm80 forward's tile at Q's head dim 192 (either V head dim): eight warps, 128 query rows
/// with O at 96 (or 64) floats per thread.
const SM80_FWD_D192: Tile = Tile::Sm80Fwd {
    block_m: 128,
    block_n: 64,
    warps: 8,
    stages: 1,
    q_in_regs: false,
};

/// Every tile. Shared memory (≤ 227 KiB on sm90, ≤ 163 KiB on A100) and registers bound each:
/// the sm90 forward holds Q q_stages·128·d, K 2·stages·block_n·d and V 2·stages·block_n·d_v elements (d128 with 160
/// keys: 224 KiB, and O d/2, S block_n/2, P block_n/4 registers per consumer thread within
/// setmaxnreg's 240); d192 and d256 take one Q buffer, as two would leave no room for K/V blocks
/// worth the name (d192 with 128 keys would need 240 KiB, so 112). FP8 elements take half the bytes, so its key blocks are wider; its key block is
/// also the block of K and V rows one descale covers (the quantize step's `fp8_key_block`, which
/// the generated unit checks against it).
pub const TILES: &[TileRow] = &[
    row(Sm90Fwd, 64, Base, sm90_fwd(192, 2, true)),
    row(Sm90Fwd, 64, Masked, sm90_fwd(128, 2, false)),
    row(Sm90Fwd, 128, Base, sm90_fwd(160, 2, true)),
    row(Sm90Fwd, 128, Masked, sm90_fwd(128, 2, true)),
    row(Sm90Fwd, 256, Base, sm90_fwd(80, 1, true)),
    row(Sm90Fwd, 96, Base, sm90_fwd(192, 2, true)),
    row(Sm90Fwd, 96, Masked, sm90_fwd(128, 2, true)),
    row(Sm90Fwd, 192, Base, sm90_fwd(112, 1, true)),
    // DeepSeek's (192, 128): V's narrower rows leave room for 128 keys (Q 48 KiB, K 96, V 64).
    row_v(Sm90Fwd, 192, 128, Base, sm90_fwd(128, 1, true)),
    row(Sm90Fp8Fwd, 64, Base, sm90_fp8_fwd(192, 2, false, true)),
    // d128: 256 keys (S 128 and O 64 floats a thread), which leave no room for the next block's S
    // beside P and O: without intra-warpgroup overlap, and faster so than 224 keys with it
    // (docs/PERFORMANCE.md).
    row(Sm90Fp8Fwd, 128, Base, sm90_fp8_fwd_serial(256, 2, true)),
    row(Sm90Fp8Fwd, 256, Base, sm90_fp8_fwd(128, 1, true, false)),
    // d96: d64's key block (S 96 and O 48 floats a thread); d192: 128 keys (S 64 and O 96, under
    // d128's 192) with two Q buffers (Q 48 KiB, K and V 96).
    row(Sm90Fp8Fwd, 96, Base, sm90_fp8_fwd(192, 2, false, true)),
    row(Sm90Fp8Fwd, 192, Base, sm90_fp8_fwd(128, 2, false, true)),
    row(Sm90Bwd, 64, Base, sm90_bwd(128, 128, 2, SplitKeys)),
    row(Sm90Bwd, 128, Base, sm90_bwd(64, 128, 2, SplitKeys)),
    row(Sm90Bwd, 256, Base, sm90_bwd(64, 64, 1, SplitHeadDim)),
    row(Sm90Bwd, 192, Base, sm90_bwd(64, 64, 2, SplitHeadDim)),
    row(Sm90Bwd, 96, Base, sm90_bwd(64, 128, 2, SplitKeys)),
    // (192, 128): 96 keys per CTA, where 64 bring each query block's Q, dO and dQ through L2
    // for too little work (docs/PERFORMANCE.md); V's and dO's narrower rows leave the room.
    row_v(Sm90Bwd, 192, 128, Base, sm90_bwd(64, 96, 2, KeysAsN)),
    row(Sm80Fwd, 64, Base, sm80_fwd(128, 64, 2, true)),
    row(Sm80Fwd, 128, Base, sm80_fwd(128, 64, 2, false)),
    row(Sm80Fwd, 256, Base, sm80_fwd(64, 64, 1, false)),
    row(Sm80Fwd, 96, Base, sm80_fwd(128, 64, 2, false)),
    row(Sm80Fwd, 192, Base, SM80_FWD_D192),
    // (192, 128): Q 48 KiB, K 24, V 16 per stage.
    row_v(Sm80Fwd, 192, 128, Base, SM80_FWD_D192),
    row(Sm80Bwd, 64, Base, sm80_bwd(128, 128, [4, 4, 4])),
    row(Sm80Bwd, 128, Base, sm80_bwd(64, 128, [2, 4, 2])),
    row(Sm80Bwd, 256, Base, sm80_bwd(64, 64, [4, 2, 2])),
    row(Sm80Bwd, 96, Base, sm80_bwd(64, 128, [2, 4, 4])),
    row(Sm80Bwd, 192, Base, sm80_bwd(64, 64, [4, 2, 2])),
    // (192, 128): d192's tile; K 24 KiB, V 16, P and dS 8 each, per Q/dO buffer 40.5: two
    // buffers in 137 KiB (A100's 163 take them).
    row_v(Sm80Bwd, 192, 128, Base, sm80_bwd(64, 64, [4, 2, 2])),
];

/// The tile `k`'s family runs at its head dims for `role`: the `Masked` row if there is one,
/// else the `Base` row.
pub fn tile(k: &Kernel, role: TileRole) -> Option<&'static Tile> {
    tile_row(k, role).map(|r| &r.tile)
}

/// [`tile`]'s row, whose `role` says which row it is.
pub fn tile_row(k: &Kernel, role: TileRole) -> Option<&'static TileRow> {
    let find = |role: TileRole| {
        TILES.iter().find(|r| {
            r.family == k.family.tile_family()
                && r.head_dim == k.head_dim
                && r.head_dim_v == k.head_dim_v
                && r.role == role
        })
    };
    find(role).or_else(|| find(Base))
}

/// The N sizes of CUTLASS's default WGMMA atoms. Any other (key blocks of 80, 112, 160, the
/// backward's 48 keys a warpgroup) is an
/// extended shape: CUTLASS has them all in one header that costs a unit most of its compile
/// time, so build.rs generates the few atoms the tiles take instead (build/wgmma_atoms.rs).
const DEFAULT_WGMMA_N: [usize; 8] = [8, 16, 32, 64, 96, 128, 192, 256];

/// The extended WGMMA N sizes (outside CUTLASS's default set) that the kernels of `k`'s family
/// at its head dims take, sorted. The GEMMs' N: the forward's key block (S) and V's head dim (O); the
/// backward's query block (Sᵀ, dPᵀ) and head dim (dK, dV), whole or (SplitHeadDim) split
/// between the two consumer warpgroups, and its dQ slab's columns (sm90_bwd_dq_cols); with the
/// keys as N, half the keys (S, dP, dKᵀ, dVᵀ) and half the head dim (dQ). (The
/// kernels' traits assert that every atom covers its N, so a size this misses fails to build
/// rather than running narrower GEMMs.)
pub fn extended_wgmma_n(k: &Kernel) -> Vec<usize> {
    let head_dim = k.head_dim;
    let mut sizes: Vec<usize> = TILES
        .iter()
        .filter(|r| {
            r.family == k.family.tile_family()
                && r.head_dim == head_dim
                && r.head_dim_v == k.head_dim_v
        })
        .flat_map(|r| match r.tile {
            Tile::Sm90Fwd { block_n, .. } => vec![block_n, r.head_dim_v],
            Tile::Sm90Bwd {
                block_m,
                warpgroups: BwdWarpgroups::SplitHeadDim,
                ..
            } => vec![block_m / 2, head_dim / 2, r.head_dim_v / 2],
            Tile::Sm90Bwd {
                block_n,
                warpgroups: BwdWarpgroups::KeysAsN,
                ..
            } => vec![block_n / 2, head_dim / 2],
            Tile::Sm90Bwd { block_m, .. } => {
                vec![block_m, head_dim, sm90_bwd_dq_cols(head_dim, block_m)]
            }
            Tile::Sm80Fwd { .. } | Tile::Sm80Bwd { .. } => vec![],
        })
        .filter(|n| !DEFAULT_WGMMA_N.contains(n))
        .collect();
    sizes.sort_unstable();
    sizes.dedup();
    sizes
}

/// The columns of one dQ slab in the sm90 backward that splits the keys (its traits' kDqCols):
/// all of the head dim with 128-query blocks (the warpgroups split the rows), half of it where
/// that is a whole number of 64-column swizzle atoms, else 32 (d96: 48 would start inside one).
const fn sm90_bwd_dq_cols(head_dim: usize, block_m: usize) -> usize {
    if block_m == 128 {
        head_dim
    } else if head_dim % 128 == 0 {
        head_dim / 2
    } else {
        32
    }
}

/// Whether `k` takes an extended WGMMA shape.
pub fn extended_wgmma(k: &Kernel) -> bool {
    !extended_wgmma_n(k).is_empty()
}

impl Tile {
    /// Query rows and keys per block, for messages ("128x160").
    pub fn shape(&self) -> (usize, usize) {
        match *self {
            Tile::Sm90Fwd { block_n, .. } => (128, block_n),
            Tile::Sm90Bwd {
                block_m, block_n, ..
            }
            | Tile::Sm80Fwd {
                block_m, block_n, ..
            }
            | Tile::Sm80Bwd {
                block_m, block_n, ..
            } => (block_m, block_n),
        }
    }
}

/// Whether Cargo feature `name` is on in this compilation (the crate's, or build.rs's: Cargo
/// passes a package's features to both).
pub(crate) fn feature_on(name: &str) -> bool {
    match name {
        "cuda" => cfg!(feature = "cuda"),
        "sm90" => cfg!(feature = "sm90"),
        "sm80" => cfg!(feature = "sm80"),
        "backward" => cfg!(feature = "backward"),
        "fp8" => cfg!(feature = "fp8"),
        "hdim64" => cfg!(feature = "hdim64"),
        "hdim128" => cfg!(feature = "hdim128"),
        "hdim256" => cfg!(feature = "hdim256"),
        "hdim96" => cfg!(feature = "hdim96"),
        "hdim192" => cfg!(feature = "hdim192"),
        "kvcache-fp8" => cfg!(feature = "kvcache-fp8"),
        "ablation" => cfg!(feature = "ablation"),
        _ => unreachable!("feature {name} is not one of the registry's"),
    }
}

impl Kernel {
    /// Its name: family, head dims, element type ("sm90 fwd d128 bf16").
    pub fn name(&self) -> String {
        let dims = if self.head_dim_v == self.head_dim {
            format!("d{}", self.head_dim)
        } else {
            format!("d{}/{}", self.head_dim, self.head_dim_v)
        };
        format!("{} {dims} {}", self.family.name(), self.dtype.name())
    }

    /// The Cargo features it needs: `cuda`, its family's, its head dim's.
    pub fn features(&self) -> Vec<&'static str> {
        let hdim = HEAD_DIM_FEATURES
            .iter()
            .find(|(d, _)| *d == self.head_dim)
            .map_or("(no feature builds this head dim)", |(_, f)| f);
        let mut all = vec!["cuda"];
        all.extend_from_slice(self.family.features());
        all.push(hdim);
        all
    }

    /// Whether this build holds it.
    pub fn built(&self) -> bool {
        self.features().iter().all(|f| feature_on(f))
    }

    /// Whether this build holds its forward without intra-warpgroup overlap: a kernel of the
    /// registry that has one, built with the `ablation` feature.
    pub fn ablation_built(&self) -> bool {
        self.ablation && feature_on("ablation")
    }
}

/// The kernel of `family` for head dims `head_dim` (Q, K) and `head_dim_v` (V, O) and `dtype`,
/// built or not.
pub fn find(
    family: Family,
    head_dim: usize,
    head_dim_v: usize,
    dtype: KernelDtype,
) -> Option<&'static Kernel> {
    KERNELS.iter().find(|k| {
        k.family == family
            && k.head_dim == head_dim
            && k.head_dim_v == head_dim_v
            && k.dtype == dtype
    })
}

/// The head dims any kernel of `family` takes, in the table's order.
pub fn head_dims(family: Family) -> Vec<usize> {
    let mut dims: Vec<usize> = Vec::new();
    for k in KERNELS.iter().filter(|k| k.family == family) {
        if !dims.contains(&k.head_dim) {
            dims.push(k.head_dim);
        }
    }
    dims
}
