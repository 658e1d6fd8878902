//! The registry's own checks: every kernel named once with known features, every kernel a tile
//! and every tile a kernel, extended WGMMA shapes only where a tile takes one.

use crate::registry::*;

#[test]
fn every_kernel_is_named_once_and_has_its_features() {
    for (i, k) in KERNELS.iter().enumerate() {
        assert!(
            HEAD_DIM_FEATURES.iter().any(|(d, _)| *d == k.head_dim),
            "{}: no head-dim feature",
            k.name()
        );
        assert!(
            KERNELS[..i].iter().all(|o| o.name() != k.name()),
            "{} twice",
            k.name()
        );
        assert_eq!(find(k.family, k.head_dim, k.head_dim_v, k.dtype), Some(k));
    }
    assert_eq!(head_dims(Family::Sm90Fwd), vec![64, 128, 256, 96, 192]);
    assert_eq!(head_dims(Family::Sm90Fp8Fwd), vec![64, 128, 256, 96, 192]);
}

/// A forward tile without intra-warpgroup overlap runs the serial loop, which has no copy for
/// unmasked blocks: the table asks for none.
#[test]
fn serial_forward_tiles_ask_for_no_unmasked_copy() {
    for r in TILES {
        if let Tile::Sm90Fwd {
            intra_wg_overlap: false,
            unmasked_loop,
            ..
        } = r.tile
        {
            assert!(!unmasked_loop, "{r:?}");
        }
    }
}

/// The FP8 forward's key block is the block of keys one K/V descale covers, and the quantize
/// step orders V's keys in groups of 32 (csrc/sm90/fp8_layout.h): whole groups only.
#[test]
fn fp8_key_blocks_are_whole_32_key_groups() {
    for r in TILES.iter().filter(|r| r.family == Family::Sm90Fp8Fwd) {
        let (_, block_n) = r.tile.shape();
        assert_eq!(block_n % 32, 0, "{r:?}");
    }
}

#[test]
fn every_kernel_has_its_tile_and_every_tile_a_kernel() {
    for k in KERNELS {
        let t = tile(k, TileRole::Base).unwrap_or_else(|| panic!("{}: no tile", k.name()));
        let family_of_tile = match t {
            Tile::Sm90Fwd { .. } => {
                [Family::Sm90Fwd, Family::Sm90Fp8Fwd].contains(&k.family.tile_family())
            }
            Tile::Sm90Bwd { .. } => k.family == Family::Sm90Bwd,
            Tile::Sm80Fwd { .. } => k.family.tile_family() == Family::Sm80Fwd,
            Tile::Sm80Bwd { .. } => k.family == Family::Sm80Bwd,
        };
        assert!(family_of_tile, "{}: a tile of another family", k.name());
    }
    for (i, r) in TILES.iter().enumerate() {
        assert!(
            KERNELS.iter().any(|k| k.family == r.family
                && k.head_dim == r.head_dim
                && k.head_dim_v == r.head_dim_v),
            "a tile of no kernel: {r:?}"
        );
        assert!(
            TILES[..i]
                .iter()
                .all(|o| (o.family, o.head_dim, o.head_dim_v, o.role)
                    != (r.family, r.head_dim, r.head_dim_v, r.role)),
            "two tiles for one role: {r:?}"
        );
    }
    let d256 = kernel(Family::Sm90Fwd, 256, KernelDtype::Bf16);
    assert_eq!(tile(&d256, TileRole::Masked), tile(&d256, TileRole::Base));
    for r in TILES {
        match (r.role, r.tile) {
            // The launcher takes a masked tile only where its key block differs
            // (csrc/sm90/fwd_launch.h), so any other difference would go unused.
            (TileRole::Masked, t) => {
                let k = kernel_v(r.family, r.head_dim, r.head_dim_v, KernelDtype::Bf16);
                let base = tile(&k, TileRole::Base).unwrap();
                assert_ne!(
                    t.shape(),
                    base.shape(),
                    "a masked tile with the base's blocks: {r:?}"
                );
            }
            // The backward that splits the keys keeps dO in Q's stages.
            (
                _,
                Tile::Sm90Bwd {
                    stages,
                    stages_do,
                    warpgroups: BwdWarpgroups::SplitKeys,
                    ..
                },
            ) => assert_eq!(stages, stages_do, "{r:?}"),
            _ => {}
        }
    }
}

/// `family`'s kernel at head dim `d` (V's too), as a registry row would name it.
fn extended_wgmma(family: Family, d: usize) -> bool {
    crate::registry::extended_wgmma(&kernel(family, d, KernelDtype::Bf16))
}
fn extended_wgmma_n(family: Family, d: usize) -> Vec<usize> {
    crate::registry::extended_wgmma_n(&kernel(family, d, KernelDtype::Bf16))
}

#[test]
fn extended_wgmma_shapes_only_where_a_tile_takes_one() {
    // 160 and 80 keys (d128, d256): outside CUTLASS's default N sizes.
    assert!(extended_wgmma(Family::Sm90Fwd, 128));
    assert!(extended_wgmma(Family::Sm90Fwd, 256));
    // 192/128 keys, 256 (FP8 d128), 128 keys (FP8 d96, d192 too), 64/128-row backward tiles:
    // default sizes.
    assert!(!extended_wgmma(Family::Sm90Fp8Fwd, 128));
    assert!(!extended_wgmma(Family::Sm90Fwd, 64));
    assert!(!extended_wgmma(Family::Sm90Fp8Fwd, 64));
    assert!(!extended_wgmma(Family::Sm90Fp8Fwd, 256));
    assert!(!extended_wgmma(Family::Sm90Fp8Fwd, 96));
    assert!(!extended_wgmma(Family::Sm90Fp8Fwd, 192));
    for d in [64, 128, 256] {
        assert!(!extended_wgmma(Family::Sm90Bwd, d));
        assert!(!extended_wgmma(Family::Sm90Bwd, d * 3 / 2)); // d96, d192, d384 (no tile)
        assert!(!extended_wgmma(Family::Sm80Fwd, d));
        assert!(!extended_wgmma(Family::Sm80Bwd, d));
    }
    assert_eq!(extended_wgmma_n(Family::Sm90Fwd, 128), vec![160]);
    assert_eq!(extended_wgmma_n(Family::Sm90Fwd, 256), vec![80]);
    assert_eq!(extended_wgmma_n(Family::Sm90Fwd, 192), vec![112]);
    assert!(!extended_wgmma(Family::Sm90Fwd, 96));
    // (192, 128): the forward's 128 keys and O of 128 columns, both default sizes; the
    // backward's 48 keys per warpgroup (its dQ's 96 columns are a default size).
    let mla = |family| kernel_v(family, 192, 128, KernelDtype::Bf16);
    assert!(!crate::registry::extended_wgmma(&mla(Family::Sm90Fwd)));
    assert_eq!(
        crate::registry::extended_wgmma_n(&mla(Family::Sm90Bwd)),
        vec![48]
    );
}

/// build.rs generates an extended atom only for an SS GEMM over keys (the forward's key block,
/// or the backward's keys as N), a multiple of 8 up to 256: every extended size of every kernel
/// is one, so that a row that needs another fails here rather than in nvcc.
#[test]
fn extended_wgmma_sizes_are_key_blocks() {
    for k in KERNELS {
        for n in crate::registry::extended_wgmma_n(k) {
            let keys_as_n = matches!(
                tile(k, TileRole::Base),
                Some(Tile::Sm90Bwd {
                    warpgroups: BwdWarpgroups::KeysAsN,
                    ..
                })
            );
            assert!(
                matches!(k.family.tile_family(), Family::Sm90Fwd | Family::Sm90Fp8Fwd) || keys_as_n
            );
            assert!(
                n != k.head_dim && n != k.head_dim_v && n % 8 == 0 && n <= 256,
                "{}: N {n}",
                k.name()
            );
            let key_block = TILES.iter().any(|r| {
                r.family == k.family.tile_family()
                    && r.head_dim == k.head_dim
                    && r.head_dim_v == k.head_dim_v
                    && match r.tile {
                        Tile::Sm90Fwd { block_n, .. } => block_n == n,
                        Tile::Sm90Bwd { block_n, .. } => keys_as_n && block_n / 2 == n,
                        _ => false,
                    }
            });
            assert!(key_block, "{}: N {n} is no key block", k.name());
        }
    }
}

#[test]
fn every_feature_a_kernel_names_is_known() {
    for k in KERNELS {
        for f in k.features() {
            let _ = feature_on(f); // unreachable!() on a name with no arm
        }
    }
}
