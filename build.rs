//! Builds the CUDA kernels when the `cuda` feature is on:
//! 1. find nvcc (CUDA_HOME, CUDA_PATH, or nvcc on PATH), else provision the pinned CUDA 13.0
//!    compiler from PyPI into a cache outside the repository;
//! 2. unpack the pinned CUTLASS headers (cutlass/fetch.py, sha256-verified);
//! 3. generate the instantiation units of the kernels of src/registry.rs that this build's
//!    features select (grouped, see generate_kernels), kernels.h (their declarations and the C
//!    entry points' dispatch) and a header per extended WGMMA shape their tiles take
//!    (wgmma_atom_header);
//! 4. compile those and every csrc/**/*.cu with nvcc (flags from the `cc` crate plus ours), two
//!    at a time, caching each object under a hash of its source, the headers it includes, the
//!    flags and the compiler;
//! 5. archive the objects, link cudart statically, and generate the FFI with bindgen.
//!
//! Knobs: FLASHATTN_CACHE_DIR (default ~/.cache/flashattn), FLASHATTN_NVCC_JOBS (default 2),
//! FLASHATTN_PTXAS_VERBOSE=1 (print ptxas resource reports), FLASHATTN_SM80_ARCH (machine code of
//! the FlashAttention-2 family for that arch alone, see sm80_gencode), FLASHATTN_UNITS=tile-row
//! (a unit per family and head dim, for tuning a tile), LIBCLANG_PATH.

// The kernel registry, shared with the crate: build.rs generates the instantiation units and
// the C dispatch from it.
#[allow(dead_code)]
#[path = "src/registry.rs"]
mod registry;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=src/registry.rs");
    #[cfg(feature = "cuda")]
    cuda::build();
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::registry::{self, Family, Kernel, KernelDtype, Tile, TileRole};
    use sha2::{Digest, Sha256};
    use std::env;
    use std::fs;
    use std::path::{Path, PathBuf};
    use std::process::Command;
    use std::sync::{Arc, Mutex};

    /// The CUDA 13.0 compiler packages verified to install together and to build sm_90a code
    /// that runs on the H200's driver. nvvm is pinned: pip otherwise takes 13.5.
    const CUDA_PACKAGES: &[&str] = &[
        "nvidia-cuda-nvcc==13.0.88",
        "nvidia-cuda-runtime==13.0.96",
        "nvidia-cuda-cccl==13.0.85",
        "nvidia-cuda-crt==13.0.88",
        "nvidia-nvvm==13.0.88",
    ];
    const LIBCLANG_PACKAGE: &str = "libclang==18.1.1";

    const BASE_FLAGS: &[&str] = &[
        "-std=c++17",
        "--expt-relaxed-constexpr",
        "-O3",
        "-DNDEBUG",
        "-Xcompiler=-fPIC",
    ];
    const SM90_GENCODE: &[&str] = &["-gencode=arch=compute_90a,code=sm_90a"];
    /// One translation unit: its source, and its name under csrc/ or the generated directory
    /// (which also says its architecture).
    struct Unit {
        src: PathBuf,
        rel: String,
    }
    // The FlashAttention-2 family: sm_80 machine code for Ampere/Ada and compute_80 PTX, which
    // the driver compiles for any later GPU (Hopper included) at first use and caches.
    // FLASHATTN_SM80_ARCH=90 (or another arch) builds machine code for that arch alone instead:
    // the device bundle uses it so that test runs on the H200 spend no time in the JIT.
    fn sm80_gencode() -> Vec<String> {
        match env::var("FLASHATTN_SM80_ARCH") {
            Ok(arch) if !arch.is_empty() => {
                vec![format!("-gencode=arch=compute_{arch},code=sm_{arch}")]
            }
            _ => vec!["-gencode=arch=compute_80,code=[sm_80,compute_80]".to_string()],
        }
    }

    pub fn build() {
        for var in [
            "CUDA_HOME",
            "CUDA_PATH",
            "FLASHATTN_CACHE_DIR",
            "FLASHATTN_NVCC_JOBS",
            "FLASHATTN_PTXAS_VERBOSE",
            "FLASHATTN_SM80_ARCH",
            "FLASHATTN_UNITS",
            "LIBCLANG_PATH",
        ] {
            println!("cargo:rerun-if-env-changed={var}");
        }
        let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
        let out_dir = PathBuf::from(env::var("OUT_DIR").unwrap());
        let cache = cache_dir();
        fs::create_dir_all(&cache).expect("create the flashattn cache directory");

        let cuda_root = find_or_provision_cuda(&cache);
        let nvcc = cuda_root.join("bin").join("nvcc");
        let cutlass_include = manifest.join("cutlass").join("include");
        run(Command::new(python())
            .arg(manifest.join("cutlass").join("fetch.py"))
            .arg(&cutlass_include)
            .arg(cache.join("cutlass-wheel")));
        println!("cargo:rerun-if-changed=cutlass/fetch.py");

        let csrc = manifest.join("csrc");
        println!("cargo:rerun-if-changed=csrc");
        let mut sources = Vec::new();
        let mut headers = Vec::new();
        walk(&csrc, &mut sources, &mut headers);
        // The toolchain self-test (research apparatus) only with its feature.
        if !cfg!(feature = "selftest") {
            sources.retain(|s| !s.ends_with("sm90/selftest_tma_wgmma.cu"));
        }
        sources.sort();
        // The hand-written units: the C entry points, the FP8 quantize step, the self-test.
        let hand_written = sources.iter().map(|src| Unit {
            src: src.clone(),
            rel: src
                .strip_prefix(&csrc)
                .unwrap()
                .to_string_lossy()
                .replace('\\', "/"),
        });
        let gen = out_dir.join("kernels");
        // The generated units first, in the order of their first kernel in the registry (the sm90
        // forwards, the longest to compile, lead), then the hand-written ones.
        let mut units = generate_kernels(&gen);
        headers.push(gen.join("kernels.h"));
        // The extended WGMMA atoms' headers (wgmma_atom_header), this build's and earlier ones'.
        for entry in fs::read_dir(&gen).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with("wgmma_") && name.ends_with(".h") {
                headers.push(entry.path());
            }
        }
        headers.sort();
        units.extend(hand_written);

        let dirs = IncludeDirs {
            csrc: csrc.clone(),
            gen,
        };
        let objects = compile_all(&nvcc, &dirs, &cutlass_include, &units, &headers, &cache);

        let mut archive = cc::Build::new();
        archive.cargo_warnings(false);
        for obj in &objects {
            archive.object(obj);
        }
        archive.compile("flashattn_kernels");

        let lib_dir = ["lib64", "lib"]
            .iter()
            .map(|d| cuda_root.join(d))
            .find(|d| d.join("libcudart_static.a").exists())
            .unwrap_or_else(|| panic!("no libcudart_static.a under {}", cuda_root.display()));
        println!("cargo:rustc-link-search=native={}", lib_dir.display());
        println!("cargo:rustc-link-lib=static=cudart_static");
        for lib in ["stdc++", "dl", "rt", "pthread"] {
            println!("cargo:rustc-link-lib=dylib={lib}");
        }

        generate_bindings(&csrc.join("flash_api.h"), &out_dir, &cache);
        // For the tests that compile csrc's host-side headers with the system's C++ compiler.
        println!(
            "cargo:rustc-env=FLASHATTN_CUDA_INCLUDE={}",
            cuda_root.join("include").display()
        );
    }

    fn python() -> String {
        env::var("PYTHON").unwrap_or_else(|_| "python3".into())
    }

    fn cache_dir() -> PathBuf {
        if let Ok(dir) = env::var("FLASHATTN_CACHE_DIR") {
            return PathBuf::from(dir);
        }
        let home = env::var("HOME").unwrap_or_else(|_| ".".into());
        PathBuf::from(home).join(".cache").join("flashattn")
    }

    fn run(cmd: &mut Command) {
        let status = cmd
            .status()
            .unwrap_or_else(|e| panic!("flashattn: cannot run {cmd:?}: {e}"));
        assert!(status.success(), "flashattn: {cmd:?} failed with {status}");
    }

    /// Installs pinned PyPI packages into `target`, saying why in one cargo warning.
    fn pip_install(target: &Path, packages: &[&str], why: &str) {
        println!(
            "cargo:warning=flashattn: {why}; installing {} from PyPI into {}",
            packages.join(" "),
            target.display()
        );
        run(Command::new(python())
            .args([
                "-m",
                "pip",
                "install",
                "-q",
                "--disable-pip-version-check",
                "--target",
            ])
            .arg(target)
            .args(packages));
    }

    fn find_or_provision_cuda(cache: &Path) -> PathBuf {
        for var in ["CUDA_HOME", "CUDA_PATH"] {
            if let Ok(root) = env::var(var) {
                let root = PathBuf::from(root);
                if root.join("bin").join("nvcc").exists() {
                    return root;
                }
            }
        }
        if let Some(path) = env::var_os("PATH") {
            for dir in env::split_paths(&path) {
                if dir.join("nvcc").exists() {
                    return dir
                        .parent()
                        .expect("nvcc has a parent directory")
                        .to_path_buf();
                }
            }
        }
        let target = cache.join("cuda-13.0.88");
        let root = target.join("nvidia").join("cu13");
        let stamp = target.join(".complete");
        if !stamp.exists() {
            pip_install(
                &target,
                CUDA_PACKAGES,
                "no nvcc found (CUDA_HOME, CUDA_PATH, PATH)",
            );
            fs::write(&stamp, CUDA_PACKAGES.join("\n")).unwrap();
        }
        root
    }

    /// The C++ element type and the name suffix of a kernel's dtype.
    fn element(dtype: KernelDtype) -> (&'static str, &'static str, &'static str) {
        match dtype {
            KernelDtype::Bf16 => ("cutlass::bfloat16_t", "<cutlass/bfloat16.h>", "bf16"),
            KernelDtype::Fp16 => ("cutlass::half_t", "<cutlass/half.h>", "fp16"),
            KernelDtype::E4m3 => ("cutlass::float_e4m3_t", "<cutlass/float8.h>", "e4m3"),
        }
    }

    /// The C++ function a kernel's unit defines, and its parameters after the params.
    fn entry(k: &Kernel) -> (String, &'static str) {
        let (_, _, dt) = element(k.dtype);
        let d = k.head_dim;
        match k.family {
            Family::Sm90Fwd => (
                format!("run_fwd_d{d}_{dt}"),
                "FwdOptions o, cudaStream_t stream",
            ),
            Family::Sm90Fp8Fwd => (
                format!("run_fwd_fp8_d{d}"),
                "FwdOptions o, cudaStream_t stream",
            ),
            Family::Sm90Bwd | Family::Sm80Fwd | Family::Sm80Bwd => {
                (format!("run_{}_d{d}_{dt}", pass(k)), "cudaStream_t stream")
            }
        }
    }

    fn pass(k: &Kernel) -> &'static str {
        match k.family {
            Family::Sm90Fwd | Family::Sm90Fp8Fwd | Family::Sm80Fwd => "fwd",
            Family::Sm90Bwd | Family::Sm80Bwd => "bwd",
        }
    }

    fn arch(k: &Kernel) -> &'static str {
        match k.family {
            Family::Sm80Fwd | Family::Sm80Bwd => "sm80",
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
            let (elem, elem_header, _) = element(k.dtype);
            let launcher = match k.family {
                Family::Sm90Fwd => "\"sm90/fwd_launch.h\"",
                Family::Sm90Fp8Fwd => "\"sm90/fwd_fp8_launch.h\"",
                Family::Sm90Bwd => "\"sm90/bwd_launch.h\"",
                Family::Sm80Fwd => "\"sm80/fwd_launch.h\"",
                Family::Sm80Bwd => "\"sm80/bwd_launch.h\"",
            };
            let atoms = wgmma_atoms(k)
                .into_iter()
                .map(|(_, _, file)| format!("\"{file}\""));
            for header in [elem_header.to_string(), launcher.to_string()]
                .into_iter()
                .chain(atoms)
            {
                if !includes.contains(&header) {
                    includes.push(header);
                }
            }
            let first_of_row = !kernels[..i]
                .iter()
                .any(|o| o.family == k.family && o.head_dim == d);
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
                    format!("{ablation}  return run_fwd_tiled<{elem}, {d}>(p, o, stream);")
                }
                Family::Sm90Fp8Fwd => format!("  return run_fwd_fp8<{d}>(p, o, stream);"),
                Family::Sm90Bwd | Family::Sm80Fwd | Family::Sm80Bwd => {
                    format!("  return run_{}<{elem}, {d}>(p, stream);", pass(k))
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
    /// specialized for its head dim (the sm90 forward's also for masked calls).
    fn tile_structs(k: &Kernel) -> String {
        let d = k.head_dim;
        let tile = |role| {
            *registry::tile(k.family, d, role)
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
                } => {
                    ints(&[
                        ("kBlockN", block_n),
                        ("kStages", stages),
                        ("kQStages", q_stages),
                    ]) + &bools(&[
                        ("kUnmaskedLoop", unmasked_loop),
                        ("kTailSplit", tail_split),
                        ("kIeeeDescaleRatio", ieee_descale_ratio),
                    ])
                }
                Tile::Sm90Bwd {
                    block_m,
                    block_n,
                    stages,
                    stages_do,
                    split_head_dim,
                } => {
                    ints(&[
                        ("kBlockM", block_m),
                        ("kBlockN", block_n),
                        ("kStages", stages),
                        ("kStagesdO", stages_do),
                    ]) + &bools(&[("kSplitHeadDim", split_head_dim)])
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
            format!("template <> struct {name}<{d}> {{\n{members}}};\n")
        };
        match k.family {
            Family::Sm90Fwd => {
                spec("FwdTile", tile(TileRole::Base))
                    + &spec("FwdTileMasked", tile(TileRole::Masked))
            }
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
                        Family::Sm90Bwd => "FLASHATTN_KERNEL_SM90_BWD",
                        Family::Sm80Fwd => "FLASHATTN_KERNEL_SM80_FWD",
                        Family::Sm80Bwd => "FLASHATTN_KERNEL_SM80_BWD",
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
            (Family::Sm90Bwd, "sm90_bwd", "cudaStream_t s", "p, s"),
            (Family::Sm80Fwd, "sm80_fwd", "cudaStream_t s", "p, s"),
            (Family::Sm80Bwd, "sm80_bwd", "cudaStream_t s", "p, s"),
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
                    "  if (p.dtype == {dtype} && p.head_dim == {}{ablation}) return {}::{name}({args});\n",
                    k.head_dim,
                    arch(k)
                ));
            }
            h.push_str("  return {FLASHATTN_UNSUPPORTED, 0};\n}\n\n");
        }
        h.push_str("}  // namespace flashattn::kernels\n");
        h
    }

    /// The extended WGMMA shapes (registry::extended_wgmma_n) kernel `k` takes, as (element
    /// type, N) pairs, each with the generated header that holds its atom. Only the forward's
    /// S = Q·Kᵀ takes one (its key block).
    fn wgmma_atoms(k: &Kernel) -> Vec<(KernelDtype, usize, String)> {
        registry::extended_wgmma_n(k.family, k.head_dim)
            .into_iter()
            .map(|n| {
                assert!(
                    matches!(k.family, Family::Sm90Fwd | Family::Sm90Fp8Fwd)
                        && n != k.head_dim
                        && n % 8 == 0
                        && n <= 256,
                    "{}: an extended WGMMA N of {n} outside the forward's key block (a multiple \
                     of 8 up to 256) is not generated",
                    k.name()
                );
                (k.dtype, n, format!("wgmma_{}_n{n}.h", k.dtype.name()))
            })
            .collect()
    }

    /// The header of one extended WGMMA atom: an SS atom (both operands K-major, f32
    /// accumulators) of N keys for `dtype`, its ExtendedSsAtom entry (csrc/sm90/wgmma.h, whose
    /// ss_atom picks it before CUTLASS's selector) and its MMA_Traits. In place of CUTLASS's
    /// header of every extended shape, whose parsing cost each unit that included it; one header
    /// per shape, included by the units whose kernels take it, so that a tile retune rebuilds only
    /// its own units.
    fn wgmma_atom_header(dtype: KernelDtype, n: usize) -> String {
        let mut h = String::from(
            "// Generated by build.rs (wgmma_atom_header) from src/registry.rs. Do not edit.\n\
             #pragma once\n\n#include <cute/atom/mma_traits_sm90_gmma.hpp>\n\n\
             #include \"sm90/wgmma.h\"\n\nnamespace flashattn::sm90 {\n",
        );
        let mut traits = String::new();
        let (cute_type, ptx, k) = match dtype {
            KernelDtype::Bf16 => ("cute::bfloat16_t", "bf16", 16),
            KernelDtype::Fp16 => ("cute::half_t", "f16", 16),
            KernelDtype::E4m3 => ("cute::float_e4m3_t", "e4m3", 32),
        };
        let name = format!("Wgmma64x{n}x{k}F32{}Ss", ptx.to_uppercase());
        let regs = n / 2;
        let params: Vec<String> = (0..regs).map(|i| format!("float& d{i}")).collect();
        let outs: Vec<String> = (0..regs).map(|i| format!("\"+f\"(d{i})")).collect();
        let regs_list: Vec<String> = (0..regs).map(|i| format!("%{i}")).collect();
        // 16-bit inputs take the operands' majors as immediates; e4m3 is K-major only.
        let (tail, imms) = if dtype == KernelDtype::E4m3 {
            (
                format!("p, %{}, %{}", regs + 3, regs + 4),
                "\"n\"(int32_t(cute::GMMA::ScaleIn::One)), \
                 \"n\"(int32_t(cute::GMMA::ScaleIn::One))"
                    .to_string(),
            )
        } else {
            (
                format!(
                    "p, %{}, %{}, %{}, %{}",
                    regs + 3,
                    regs + 4,
                    regs + 5,
                    regs + 6
                ),
                "\"n\"(int32_t(cute::GMMA::ScaleIn::One)), \
                 \"n\"(int32_t(cute::GMMA::ScaleIn::One)), \
                 \"n\"(int32_t(cute::GMMA::Major::K)), \"n\"(int32_t(cute::GMMA::Major::K))"
                    .to_string(),
            )
        };
        h.push_str(&format!(
            "\nstruct {name} {{\n\
             \x20 using DRegisters = void;\n\
             \x20 using ARegisters = uint64_t[1];\n\
             \x20 using BRegisters = uint64_t[1];\n\
             \x20 using CRegisters = float[{regs}];\n\
             \x20 CUTE_HOST_DEVICE static void fma(uint64_t const& desc_a, uint64_t const& desc_b, {},\n\
             \x20                                  cute::GMMA::ScaleOut const scale_D = cute::GMMA::ScaleOut::One) {{\n\
             #if defined(CUTE_ARCH_MMA_SM90A_ENABLED)\n\
             \x20   asm volatile(\n\
             \x20       \"{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{}, 0;\\n\"\n\
             \x20       \"wgmma.mma_async.sync.aligned.m64n{n}k{k}.f32.{ptx}.{ptx} {{{}}}, %{}, %{}, {tail};\\n}}\\n\"\n\
             \x20       : {}\n\
             \x20       : \"l\"(desc_a), \"l\"(desc_b), \"r\"(int32_t(scale_D)), {imms});\n\
             #else\n\
             \x20   CUTE_INVALID_CONTROL_PATH(\"{name} needs sm_90a\");\n\
             #endif\n\
             \x20 }}\n}};\n\
             template <>\nstruct ExtendedSsAtom<{cute_type}, {n}> {{\n  using type = {name};\n}};\n",
            params.join(", "),
            regs + 2,
            regs_list.join(", "),
            regs,
            regs + 1,
            outs.join(", "),
        ));
        traits.push_str(&format!(
            "\ntemplate <>\nstruct MMA_Traits<flashattn::sm90::{name}> {{\n\
             \x20 using ValTypeD = float;\n\
             \x20 using ValTypeA = {cute_type};\n\
             \x20 using ValTypeB = {cute_type};\n\
             \x20 using ValTypeC = float;\n\
             \x20 using FrgTypeA = GMMA::smem_desc<GMMA::Major::K>;\n\
             \x20 using FrgTypeB = GMMA::smem_desc<GMMA::Major::K>;\n\
             \x20 using Shape_MNK = Shape<_64, Int<{n}>, Int<{k}>>;\n\
             \x20 using ThrID = Layout<_128>;\n\
             \x20 using ALayout = GMMA::ABLayout<64, {k}>;\n\
             \x20 using BLayout = GMMA::ABLayout<{n}, {k}>;\n\
             \x20 using CLayout = GMMA::CLayout_64xN<{n}>;\n\
             \x20 GMMA::ScaleOut accumulate_ = GMMA::ScaleOut::One;\n}};\n"
        ));
        h.push_str("\n}  // namespace flashattn::sm90\n\nnamespace cute {\n");
        h.push_str(&traits);
        h.push_str("}  // namespace cute\n");
        h
    }

    /// Writes the units of the kernels this build's features select, and kernels.h, under `gen`
    /// (files rewritten only when their text changes); returns the units with their names.
    fn generate_kernels(gen: &Path) -> Vec<Unit> {
        // What the generator can build: a row asking for more is a registry error.
        for k in registry::KERNELS {
            assert_eq!(
                k.head_dim_v,
                k.head_dim,
                "{}: d_v != d is not built yet",
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
            let extended = registry::extended_wgmma(k.family, k.head_dim);
            if per_tile_row {
                let fp8 = if k.family == Family::Sm90Fp8Fwd {
                    "_fp8"
                } else {
                    ""
                };
                format!("{}/{}{fp8}_d{}.cu", arch(k), pass(k), k.head_dim)
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

    fn walk(dir: &Path, sources: &mut Vec<PathBuf>, headers: &mut Vec<PathBuf>) {
        for entry in fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, sources, headers);
            } else {
                match path.extension().and_then(|e| e.to_str()) {
                    Some("cu") => sources.push(path),
                    Some("h" | "hpp" | "cuh") => headers.push(path),
                    _ => {}
                }
            }
        }
    }

    /// The nvcc command for one translation unit. The `cc` crate names the host C++ compiler
    /// (CXX, or the platform default) so nvcc uses the one cargo would; the flags are ours, so no
    /// -G or relocatable device code sneaks in whatever the cargo profile.
    fn nvcc_command(
        nvcc: &Path,
        cutlass_include: &Path,
        dirs: &IncludeDirs,
        gencode: &[String],
    ) -> Command {
        let host = cc::Build::new()
            .cpp(true)
            .cargo_metadata(false)
            .cargo_warnings(false)
            .get_compiler();
        let mut cmd = Command::new(nvcc);
        cmd.arg("-ccbin")
            .arg(host.path())
            .args(BASE_FLAGS)
            .args(gencode)
            .arg("-I")
            .arg(cutlass_include)
            .arg("-I")
            .arg(&dirs.csrc)
            .arg("-I")
            .arg(&dirs.gen);
        cmd
    }

    /// Where quoted includes are found: csrc/, and the generated units' directory (kernels.h).
    struct IncludeDirs {
        csrc: PathBuf,
        gen: PathBuf,
    }

    /// The csrc and generated headers `src` reaches through quoted `#include`s (resolved against
    /// the including file's directory, then csrc/ and the generated directory), sorted; system
    /// and CUTLASS headers (angle brackets) are covered by the compiler id and the CUTLASS pin.
    fn included_headers(src: &Path, dirs: &IncludeDirs, headers: &[PathBuf]) -> Vec<PathBuf> {
        let mut seen: Vec<PathBuf> = Vec::new();
        let mut stack = vec![src.to_path_buf()];
        while let Some(file) = stack.pop() {
            let text = fs::read_to_string(&file).unwrap_or_default();
            let dir = file.parent().unwrap_or(Path::new("."));
            for line in text.lines() {
                let Some(rest) = line.trim_start().strip_prefix("#include") else {
                    continue;
                };
                let Some(name) = rest
                    .trim()
                    .strip_prefix('"')
                    .and_then(|r| r.split('"').next())
                else {
                    continue;
                };
                let Some(path) = [dir, dirs.csrc.as_path(), dirs.gen.as_path()]
                    .iter()
                    .find_map(|d| d.join(name).canonicalize().ok())
                else {
                    continue;
                };
                if headers
                    .iter()
                    .any(|h| h.canonicalize().ok().as_ref() == Some(&path))
                    && !seen.contains(&path)
                {
                    seen.push(path.clone());
                    stack.push(path);
                }
            }
        }
        seen.sort();
        seen
    }

    /// Compiles `units`, each object cached under a hash of everything that goes into it.
    fn compile_all(
        nvcc: &Path,
        dirs: &IncludeDirs,
        cutlass_include: &Path,
        units: &[Unit],
        headers: &[PathBuf],
        cache: &Path,
    ) -> Vec<PathBuf> {
        let obj_dir = cache.join("obj");
        fs::create_dir_all(&obj_dir).unwrap();
        let verbose = env::var("FLASHATTN_PTXAS_VERBOSE").is_ok_and(|v| v == "1");
        let compiler_id = String::from_utf8_lossy(
            &Command::new(nvcc)
                .arg("--version")
                .output()
                .expect("nvcc --version")
                .stdout,
        )
        .into_owned();
        let repo = dirs.csrc.parent().unwrap();
        let csrc_canonical = dirs.csrc.canonicalize().unwrap();
        let gen_canonical = dirs.gen.canonicalize().unwrap();
        let mut shared = Sha256::new();
        shared.update(compiler_id.as_bytes());
        shared.update(fs::read(cutlass_include.join(".pin")).unwrap_or_default());

        // One job per translation unit: (source, command without its file arguments, object, log).
        let mut jobs = Vec::new();
        for Unit { src, rel } in units {
            let gencode: Vec<String> = if rel.starts_with("sm90") {
                SM90_GENCODE.iter().map(|s| s.to_string()).collect()
            } else {
                sm80_gencode()
            };
            let mut cmd = nvcc_command(nvcc, cutlass_include, dirs, &gencode);
            if verbose {
                cmd.arg("-Xptxas=-v");
            }
            // The key holds no absolute path (the compiler is keyed by its version, the CUTLASS
            // headers by their pin), so a fresh clone elsewhere reuses the cached objects.
            let mut hasher = shared.clone();
            for arg in cmd.get_args() {
                let arg = arg
                    .to_string_lossy()
                    .replace(&*dirs.gen.to_string_lossy(), "<gen>");
                hasher.update(relative_to(&arg, repo).as_bytes());
                hasher.update([0]);
            }
            hasher.update(rel.as_bytes());
            hasher.update(fs::read(src).unwrap());
            // Only the headers this unit includes: a header change rebuilds its users only.
            for h in included_headers(src, dirs, headers) {
                let name = h
                    .strip_prefix(&csrc_canonical)
                    .or_else(|_| h.strip_prefix(&gen_canonical))
                    .unwrap_or(&h);
                hasher.update(name.to_string_lossy().as_bytes());
                hasher.update(fs::read(&h).unwrap());
            }
            let hash: String = hasher
                .finalize()
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect();
            let stem = rel.replace('/', "_");
            let obj = obj_dir.join(format!("{stem}-{}.o", &hash[..16]));
            let log = obj.with_extension("log");
            jobs.push((src.clone(), cmd, obj, log));
        }

        let jobs_n: usize = env::var("FLASHATTN_NVCC_JOBS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(2)
            .max(1);
        let objects: Vec<PathBuf> = jobs.iter().map(|j| j.2.clone()).collect();
        jobs.reverse(); // taken from the back
        let queue = Arc::new(Mutex::new(jobs));
        let failures = Arc::new(Mutex::new(Vec::new()));
        let workers: Vec<_> = (0..jobs_n)
            .map(|_| {
                let queue = Arc::clone(&queue);
                let failures = Arc::clone(&failures);
                std::thread::spawn(move || loop {
                    let Some((src, mut cmd, obj, log)) = queue.lock().unwrap().pop() else {
                        return;
                    };
                    if obj.exists() {
                        if verbose {
                            print_log(&log);
                        }
                        continue;
                    }
                    // Write beside the cache entry and rename, so an interrupted build leaves
                    // no truncated object under the final name.
                    let tmp = obj.with_extension(format!("tmp{}", std::process::id()));
                    cmd.arg("-c").arg(&src).arg("-o").arg(&tmp);
                    let started = std::time::Instant::now();
                    let out = cmd.output().expect("run nvcc");
                    let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
                    text.push_str(&String::from_utf8_lossy(&out.stderr));
                    // Read back by scripts/compile_times.py: where the cold build's time goes.
                    text.push_str(&format!(
                        "flashattn: nvcc wall time {:.1} s ({jobs_n} jobs)\n",
                        started.elapsed().as_secs_f64()
                    ));
                    fs::write(&log, &text).unwrap();
                    if out.status.success() {
                        fs::rename(&tmp, &obj).unwrap();
                        if verbose {
                            print_log(&log);
                        }
                    } else {
                        failures
                            .lock()
                            .unwrap()
                            .push(format!("{}:\n{cmd:?}\n{text}", src.display()));
                    }
                })
            })
            .collect();
        for w in workers {
            w.join().unwrap();
        }
        let failures = failures.lock().unwrap();
        if !failures.is_empty() {
            panic!("flashattn: nvcc failed\n{}", failures.join("\n\n"));
        }
        objects
    }

    /// `arg` with the repository's path replaced by a placeholder.
    fn relative_to(arg: &str, repo: &Path) -> String {
        arg.replace(&*repo.to_string_lossy(), "<repo>")
    }

    fn print_log(log: &Path) {
        for line in fs::read_to_string(log).unwrap_or_default().lines() {
            println!("cargo:warning={line}");
        }
    }

    /// bindgen needs libclang: use LIBCLANG_PATH or a system one, else the pinned PyPI wheel.
    fn ensure_libclang(cache: &Path) {
        if env::var_os("LIBCLANG_PATH").is_some() {
            return;
        }
        let system = [
            "/usr/lib/llvm-18/lib",
            "/usr/lib/llvm-16/lib",
            "/usr/lib/llvm-14/lib",
        ]
        .iter()
        .any(|d| {
            Path::new(d).join("libclang.so").exists() || Path::new(d).join("libclang.so.1").exists()
        });
        if system {
            return;
        }
        let target = cache.join("libclang-18.1.1");
        let dir = target.join("clang").join("native");
        if !dir.join("libclang.so").exists() {
            pip_install(&target, &[LIBCLANG_PACKAGE], "no libclang found");
        }
        env::set_var("LIBCLANG_PATH", &dir);
    }

    fn generate_bindings(header: &Path, out_dir: &Path, cache: &Path) {
        ensure_libclang(cache);
        bindgen::Builder::default()
            .header(header.to_string_lossy())
            .allowlist_function("flashattn_.*")
            .allowlist_type("flashattn_.*")
            .allowlist_var("FLASHATTN_.*")
            .prepend_enum_name(false)
            .derive_default(true)
            .layout_tests(false)
            .generate()
            .expect("bindgen on csrc/flash_api.h")
            .write_to_file(out_dir.join("bindings.rs"))
            .expect("write bindings.rs");
    }
}
