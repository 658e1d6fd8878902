//! Generates, from the registry (src/registry.rs), the instantiation units of the kernels this
//! build's features select and kernels.h: their declarations and the C entry points' dispatch.

use crate::compile::Unit;
use crate::registry::{self, BwdWarpgroups, Family, Kernel, KernelDtype, Tile, TileRole};
use crate::wgmma_atoms::{wgmma_atom_header, wgmma_atoms};
use std::env;
use std::fs;
use std::path::Path;

/// The C++ element type and the name suffix of a kernel's dtype.
fn element(dtype: KernelDtype) -> (&'static str, &'static str, &'static str) {
    match dtype {
        KernelDtype::Bf16 => ("cutlass::bfloat16_t", "<cutlass/bfloat16.h>", "bf16"),
        KernelDtype::Fp16 => ("cutlass::half_t", "<cutlass/half.h>", "fp16"),
        KernelDtype::E4m3 => ("cutlass::float_e4m3_t", "<cutlass/float8.h>", "e4m3"),
    }
}

/// A kernel's head dims in C++ names: "192", or "192v128" where V's differs.
fn dims_name(k: &Kernel) -> String {
    if k.head_dim_v == k.head_dim {
        k.head_dim.to_string()
    } else {
        format!("{}v{}", k.head_dim, k.head_dim_v)
    }
}

/// A kernel's head dims as C++ template arguments: "192", or "192, 128" where V's differs.
fn dims_args(k: &Kernel) -> String {
    if k.head_dim_v == k.head_dim {
        k.head_dim.to_string()
    } else {
        format!("{}, {}", k.head_dim, k.head_dim_v)
    }
}

/// The C++ function a kernel's unit defines, and its parameters after the params.
fn entry(k: &Kernel) -> (String, &'static str) {
    let (_, _, dt) = element(k.dtype);
    let d = dims_name(k);
    match k.family {
        Family::Sm90Fwd => (
            format!("run_fwd_d{d}_{dt}"),
            "FwdOptions o, cudaStream_t stream",
        ),
        Family::Sm90Fp8Fwd => (
            format!("run_fwd_fp8_d{d}"),
            "FwdOptions o, cudaStream_t stream",
        ),
        Family::Sm90Fp8CacheFwd => (
            format!("run_fwd_fp8_cache_d{d}_{dt}"),
            "FwdOptions o, cudaStream_t stream",
        ),
        Family::Sm80Fp8CacheFwd => (
            format!("run_fwd_fp8_cache_d{d}_{dt}"),
            "cudaStream_t stream",
        ),
        Family::Sm90Bwd | Family::Sm80Fwd | Family::Sm80Bwd => {
            (format!("run_{}_d{d}_{dt}", pass(k)), "cudaStream_t stream")
        }
    }
}

fn pass(k: &Kernel) -> &'static str {
    match k.family {
        Family::Sm90Fwd
        | Family::Sm90Fp8Fwd
        | Family::Sm90Fp8CacheFwd
        | Family::Sm80Fwd
        | Family::Sm80Fp8CacheFwd => "fwd",
        Family::Sm90Bwd | Family::Sm80Bwd => "bwd",
    }
}

fn arch(k: &Kernel) -> &'static str {
    match k.family {
        Family::Sm80Fwd | Family::Sm80Bwd | Family::Sm80Fp8CacheFwd => "sm80",
        _ => "sm90",
    }
}

/// A translation unit of kernels: their families' launchers instantiated for each kernel's
/// head dim and element type, with the tile structs of their tile rows.
fn unit_text(kernels: &[&Kernel]) -> String {
    let mut includes: Vec<String> = Vec::new();
    let mut tiles = String::new();
    let mut entries = String::new();
    for (i, k) in kernels.iter().enumerate() {
        let d = k.head_dim;
        let dims = dims_args(k);
        let (elem, elem_header, _) = element(k.dtype);
        let launcher = match k.family {
            Family::Sm90Fwd | Family::Sm90Fp8CacheFwd => "\"sm90/fwd_launch.h\"",
            Family::Sm90Fp8Fwd => "\"sm90/fwd_fp8_launch.h\"",
            Family::Sm90Bwd => "\"sm90/bwd_launch.h\"",
            Family::Sm80Fwd | Family::Sm80Fp8CacheFwd => "\"sm80/fwd_launch.h\"",
            Family::Sm80Bwd => "\"sm80/bwd_launch.h\"",
        };
        let atoms = wgmma_atoms(k)
            .into_iter()
            .map(|(_, _, file)| format!("\"{file}\""));
        // The forwards over an e4m3 cache name the cache's element type too.
        let cache_header = k
            .family
            .reads_e4m3_cache()
            .then(|| element(KernelDtype::E4m3).1.to_string());
        for header in [elem_header.to_string(), launcher.to_string()]
            .into_iter()
            .chain(cache_header)
            .chain(atoms)
        {
            if !includes.contains(&header) {
                includes.push(header);
            }
        }
        let first_of_row = !kernels[..i]
            .iter()
            .any(|o| o.family == k.family && o.head_dim == d && o.head_dim_v == k.head_dim_v);
        if first_of_row {
            tiles.push_str(&tile_structs(k));
        }
        let body = match k.family {
            Family::Sm90Fwd => {
                let ablation = if k.ablation_built() {
                    format!(
                        "  if (!o.intra_wg_overlap) {{\n    return run_fwd<FwdTraits<{elem}, {d}, \
                         FwdTile<{d}>, false>>(p, o.pingpong, stream);\n  }}\n"
                    )
                } else {
                    String::new()
                };
                format!("{ablation}  return run_fwd_tiled<{elem}, {dims}>(p, o, stream);")
            }
            Family::Sm90Fp8Fwd => format!("  return run_fwd_fp8<{d}>(p, o, stream);"),
            Family::Sm90Fp8CacheFwd => {
                format!("  return run_fwd_fp8_cache<{elem}, {d}>(p, o, stream);")
            }
            Family::Sm80Fp8CacheFwd => {
                format!("  return run_fwd_fp8_cache<{elem}, {d}>(p, stream);")
            }
            Family::Sm90Bwd | Family::Sm80Fwd | Family::Sm80Bwd => {
                format!("  return run_{}<{elem}, {dims}>(p, stream);", pass(k))
            }
        };
        let (name, rest) = entry(k);
        entries.push_str(&format!(
            "flashattn_result_t {name}(const flashattn_params_t& p, {rest}) {{\n{body}\n}}\n\n"
        ));
    }
    // The element types' headers, then the launchers.
    includes.sort_by_key(|h| h.starts_with('"'));
    let includes: String = includes.iter().map(|h| format!("#include {h}\n")).collect();
    let names: Vec<String> = kernels.iter().map(|k| k.name()).collect();
    let ns = arch(kernels[0]);
    format!(
        "// Generated by build.rs from src/registry.rs: {}.\n{includes}\n\
         namespace flashattn::{ns} {{\n\n{tiles}\n{entries}}}  // namespace flashattn::{ns}\n",
        names.join(", ")
    )
}

/// The tile structs of a kernel's tile row, from the tile table: the family's tile struct
/// specialized for its head dims (the sm90 forward's also for masked calls).
fn tile_structs(k: &Kernel) -> String {
    let d = k.head_dim;
    let dims = dims_args(k);
    let tile = |role| {
        *registry::tile(k, role)
            .unwrap_or_else(|| panic!("{}: no tile in the tile table", k.name()))
    };
    let ints = |v: &[(&str, usize)]| {
        let list: Vec<String> = v.iter().map(|(n, x)| format!("{n} = {x}")).collect();
        format!("  static constexpr int {};\n", list.join(", "))
    };
    let bools = |v: &[(&str, bool)]| {
        let list: Vec<String> = v.iter().map(|(n, x)| format!("{n} = {x}")).collect();
        format!("  static constexpr bool {};\n", list.join(", "))
    };
    let spec = |name: &str, t: Tile| {
        let members = match t {
            Tile::Sm90Fwd {
                block_n,
                stages,
                q_stages,
                unmasked_loop,
                tail_split,
                ieee_descale_ratio,
                intra_wg_overlap,
            } => {
                ints(&[
                    ("kBlockN", block_n),
                    ("kStages", stages),
                    ("kQStages", q_stages),
                ]) + &bools(&[
                    ("kUnmaskedLoop", unmasked_loop),
                    ("kTailSplit", tail_split),
                    ("kIeeeDescaleRatio", ieee_descale_ratio),
                    ("kIntraWGOverlap", intra_wg_overlap),
                ])
            }
            Tile::Sm90Bwd {
                block_m,
                block_n,
                stages,
                stages_do,
                warpgroups,
            } => {
                ints(&[
                    ("kBlockM", block_m),
                    ("kBlockN", block_n),
                    ("kStages", stages),
                    ("kStagesdO", stages_do),
                ]) + &bools(&[
                    ("kSplitHeadDim", warpgroups == BwdWarpgroups::SplitHeadDim),
                    ("kKeysAsN", warpgroups == BwdWarpgroups::KeysAsN),
                ])
            }
            Tile::Sm80Fwd {
                block_m,
                block_n,
                warps,
                stages,
                q_in_regs,
            } => {
                ints(&[
                    ("kBlockM", block_m),
                    ("kBlockN", block_n),
                    ("kWarps", warps),
                    ("kStages", stages),
                ]) + &bools(&[("kQInRegs", q_in_regs)])
            }
            Tile::Sm80Bwd {
                block_m,
                block_n,
                warps,
                atom_m_sdp,
                atom_n_dkv,
                atom_m_dq,
            } => ints(&[
                ("kBlockM", block_m),
                ("kBlockN", block_n),
                ("kWarps", warps),
                ("kAtomMSdP", atom_m_sdp),
                ("kAtomNdKV", atom_n_dkv),
                ("kAtomMdQ", atom_m_dq),
            ]),
        };
        format!("template <> struct {name}<{dims}> {{\n{members}}};\n")
    };
    match k.family {
        // The forward over an e4m3 cache takes the 16-bit forward's tiles (Family::tile_family),
        // in units of its own: on sm90 the Masked one, whose narrower key blocks leave room for
        // its staging slots.
        Family::Sm90Fwd | Family::Sm90Fp8CacheFwd => {
            spec("FwdTile", tile(TileRole::Base)) + &spec("FwdTileMasked", tile(TileRole::Masked))
        }
        Family::Sm80Fp8CacheFwd => spec("FwdTile", tile(TileRole::Base)),
        Family::Sm90Fp8Fwd => {
            let t = tile(TileRole::Base);
            spec("Fp8FwdTile", t)
                + &format!(
                    "static_assert(Fp8FwdTile<{d}>::kBlockN == fp8_key_block({d}), \
                     \"the key block is the block one descale covers\");\n"
                )
        }
        Family::Sm90Bwd | Family::Sm80Bwd => spec("BwdTile", tile(TileRole::Base)),
        Family::Sm80Fwd => spec("FwdTile", tile(TileRole::Base)),
    }
}

/// kernels.h: the built kernels' declarations and, for each C entry point, the dispatch on
/// element type and head dim (FLASHATTN_UNSUPPORTED for a kernel not in the registry or not
/// built).
fn kernels_header(built: &[&Kernel]) -> String {
    let mut h = String::from(
        "// Generated by build.rs from src/registry.rs: the kernels this build holds and the C \
         entry points'\n// dispatch to them.\n#pragma once\n\n#include <cuda_runtime.h>\n\n\
         #include \"flash_api.h\"\n#include \"sm90/fwd_tile.h\"\n\n",
    );
    for ns in ["sm90", "sm80"] {
        h.push_str(&format!("namespace flashattn::{ns} {{\n"));
        for k in built.iter().filter(|k| arch(k) == ns) {
            let (name, rest) = entry(k);
            h.push_str(&format!(
                "flashattn_result_t {name}(const flashattn_params_t& p, {rest});\n"
            ));
        }
        h.push_str(&format!("}}  // namespace flashattn::{ns}\n\n"));
    }
    h.push_str("namespace flashattn::kernels {\n\n");
    // Every head dim of the registry, built or not: others are refused as unsupported.
    let mut dims: Vec<usize> = registry::KERNELS.iter().map(|k| k.head_dim).collect();
    dims.sort();
    dims.dedup();
    let tests: Vec<String> = dims.iter().map(|d| format!("d == {d}")).collect();
    h.push_str(&format!(
        "inline bool head_dim_known(int d) {{ return {}; }}\n\n",
        tests.join(" || ")
    ));
    let mut families = Vec::new();
    if cfg!(feature = "selftest") {
        families.push("FLASHATTN_KERNEL_SM90_SELFTEST".to_string());
    }
    for f in Family::ALL {
        if built.iter().any(|k| k.family == f) {
            families.push(
                match f {
                    Family::Sm90Fwd => "FLASHATTN_KERNEL_SM90_FWD",
                    Family::Sm90Fp8Fwd => "FLASHATTN_KERNEL_SM90_FP8_FWD",
                    Family::Sm90Fp8CacheFwd => "FLASHATTN_KERNEL_SM90_FP8_CACHE_FWD",
                    Family::Sm90Bwd => "FLASHATTN_KERNEL_SM90_BWD",
                    Family::Sm80Fwd => "FLASHATTN_KERNEL_SM80_FWD",
                    Family::Sm80Bwd => "FLASHATTN_KERNEL_SM80_BWD",
                    Family::Sm80Fp8CacheFwd => "FLASHATTN_KERNEL_SM80_FP8_CACHE_FWD",
                }
                .to_string(),
            );
        }
    }
    h.push_str(&format!(
        "inline uint32_t built_families() {{\n  return {};\n}}\n\n",
        if families.is_empty() {
            "0".to_string()
        } else {
            families.join(" | ")
        }
    ));
    for (f, func, rest, args) in [
        (
            Family::Sm90Fwd,
            "sm90_fwd",
            "sm90::FwdOptions o, cudaStream_t s",
            "p, o, s",
        ),
        (
            Family::Sm90Fp8Fwd,
            "sm90_fp8_fwd",
            "sm90::FwdOptions o, cudaStream_t s",
            "p, o, s",
        ),
        (
            Family::Sm90Fp8CacheFwd,
            "sm90_fwd_fp8_cache",
            "sm90::FwdOptions o, cudaStream_t s",
            "p, o, s",
        ),
        (Family::Sm90Bwd, "sm90_bwd", "cudaStream_t s", "p, s"),
        (Family::Sm80Fwd, "sm80_fwd", "cudaStream_t s", "p, s"),
        (Family::Sm80Bwd, "sm80_bwd", "cudaStream_t s", "p, s"),
        (
            Family::Sm80Fp8CacheFwd,
            "sm80_fwd_fp8_cache",
            "cudaStream_t s",
            "p, s",
        ),
    ] {
        h.push_str(&format!(
            "inline flashattn_result_t {func}(const flashattn_params_t& p, {rest}) {{\n"
        ));
        let sm90_fwd = matches!(f, Family::Sm90Fwd | Family::Sm90Fp8Fwd);
        if sm90_fwd && built.iter().any(|k| k.family == f) {
            h.push_str(
                "  // Without intra-warpgroup overlap: the kernels built with the ablation.\n\
                 \x20 const bool ablation = !o.intra_wg_overlap;\n",
            );
        }
        for k in built.iter().filter(|k| k.family == f) {
            let dtype = match k.dtype {
                KernelDtype::Bf16 => "FLASHATTN_BF16",
                KernelDtype::Fp16 => "FLASHATTN_F16",
                KernelDtype::E4m3 => "FLASHATTN_E4M3",
            };
            let ablation = if sm90_fwd && !k.ablation_built() {
                " && !ablation"
            } else {
                ""
            };
            let (name, _) = entry(k);
            h.push_str(&format!(
                "  if (p.dtype == {dtype} && p.head_dim == {} && p.head_dim_v == {}{ablation}) \
                 return {}::{name}({args});\n",
                k.head_dim,
                k.head_dim_v,
                arch(k)
            ));
        }
        h.push_str("  return {FLASHATTN_UNSUPPORTED, 0};\n}\n\n");
    }
    h.push_str("}  // namespace flashattn::kernels\n");
    h
}

/// Writes the units of the kernels this build's features select, and kernels.h, under `gen`
/// (files rewritten only when their text changes); returns the units with their names.
pub(crate) fn generate_kernels(gen: &Path) -> Vec<Unit> {
    // What the generator can build: a row asking for more is a registry error.
    for k in registry::KERNELS {
        assert!(
            k.head_dim_v == k.head_dim || k.family != Family::Sm90Fp8Fwd,
            "{}: d_v != d is built by the 16-bit kernels alone",
            k.name()
        );
        assert!(
            !k.ablation || k.family == Family::Sm90Fwd,
            "{}: only the 16-bit sm90 forward holds the ablation",
            k.name()
        );
        assert_eq!(
            k.family == Family::Sm90Fp8Fwd,
            k.dtype == KernelDtype::E4m3,
            "{}: e4m3 is the FP8 forward's element type and only its",
            k.name()
        );
    }
    let built: Vec<&Kernel> = registry::KERNELS.iter().filter(|k| k.built()).collect();
    let write = |path: &Path, text: &str| {
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        if fs::read_to_string(path).ok().as_deref() != Some(text) {
            fs::write(path, text).unwrap();
        }
    };
    write(&gen.join("kernels.h"), &kernels_header(&built));
    for k in &built {
        for (dtype, n, file) in wgmma_atoms(k) {
            write(&gen.join(file), &wgmma_atom_header(dtype, n));
        }
    }
    // Kernels that share most of their compile-time machinery share a unit (a fresh build's
    // time is mostly per unit): those of one architecture and pass, the sm90 forwards split
    // in two by whether their tiles take an extended WGMMA shape, which halves the longest
    // unit for the two parallel jobs; FLASHATTN_UNITS=tile-row gives each family and head
    // dim its own unit instead, so that retuning one tile rebuilds only its kernels.
    let per_tile_row = match env::var("FLASHATTN_UNITS").as_deref() {
        Ok("tile-row") => true,
        Ok("") | Ok("grouped") | Err(_) => false,
        Ok(other) => panic!("FLASHATTN_UNITS={other}: expected grouped or tile-row"),
    };
    let unit_name = |k: &Kernel| {
        let extended = registry::extended_wgmma(k);
        // Its own unit: its tile structs are the 16-bit forward's, which a shared unit would
        // define twice.
        if k.family.reads_e4m3_cache() {
            return if per_tile_row {
                format!("{}/fwd_fp8_cache_d{}.cu", arch(k), dims_name(k))
            } else {
                format!("{}/fwd_fp8_cache.cu", arch(k))
            };
        }
        if per_tile_row {
            let fp8 = if k.family == Family::Sm90Fp8Fwd {
                "_fp8"
            } else {
                ""
            };
            format!("{}/{}{fp8}_d{}.cu", arch(k), pass(k), dims_name(k))
        } else if extended {
            format!("{}/{}_extended_wgmma.cu", arch(k), pass(k))
        } else {
            format!("{}/{}.cu", arch(k), pass(k))
        }
    };
    let mut groups: Vec<(String, Vec<&Kernel>)> = Vec::new();
    for k in &built {
        let name = unit_name(k);
        match groups.iter_mut().find(|(n, _)| *n == name) {
            Some((_, group)) => group.push(k),
            None => groups.push((name, vec![k])),
        }
    }
    let units: Vec<Unit> = groups
        .into_iter()
        .map(|(rel, group)| {
            let path = gen.join(&rel);
            write(&path, &unit_text(&group));
            Unit { src: path, rel }
        })
        .collect();
    // Units of kernels an earlier build with other features held.
    for arch_dir in ["sm90", "sm80"] {
        for entry in fs::read_dir(gen.join(arch_dir))
            .into_iter()
            .flatten()
            .flatten()
        {
            if !units.iter().any(|u| u.src == entry.path()) {
                let _ = fs::remove_file(entry.path());
            }
        }
    }
    units
}
