//! Builds the CUDA kernels when the `cuda` feature is on:
//! 1. find nvcc (CUDA_HOME, CUDA_PATH, or nvcc on PATH), else provision the pinned CUDA 13.0
//!    compiler from PyPI into a cache outside the repository (build/provision.rs);
//! 2. unpack the pinned CUTLASS headers (cutlass/fetch.py, sha256-verified);
//! 3. generate the instantiation units of the kernels of src/registry.rs that this build's
//!    features select, kernels.h (their declarations and the C entry points' dispatch)
//!    (build/units.rs) and a header per extended WGMMA shape their tiles take
//!    (build/wgmma_atoms.rs);
//! 4. compile those and every csrc/**/*.cu with nvcc (flags from the `cc` crate plus ours), two
//!    at a time, caching each object under a hash of its source, the headers it includes, the
//!    flags and the compiler (build/compile.rs);
//! 5. archive the objects, link cudart statically, and generate the FFI with bindgen.
//!
//! Knobs: FLASHATTN_CACHE_DIR (default ~/.cache/flashattn), FLASHATTN_NVCC_JOBS (default 2),
//! FLASHATTN_PTXAS_VERBOSE=1 (print ptxas resource reports), FLASHATTN_SM80_ARCH (machine code of
//! the FlashAttention-2 family for that arch alone, see compile::sm80_gencode),
//! FLASHATTN_UNITS=tile-row (a unit per family and head dim, for tuning a tile), LIBCLANG_PATH.

// The kernel registry, shared with the crate: build.rs generates the instantiation units and
// the C dispatch from it.
#[allow(dead_code)]
#[path = "src/registry.rs"]
mod registry;

#[cfg(feature = "cuda")]
#[path = "build/compile.rs"]
mod compile;
#[cfg(feature = "cuda")]
#[path = "build/provision.rs"]
mod provision;
#[cfg(feature = "cuda")]
#[path = "build/units.rs"]
mod units;
#[cfg(feature = "cuda")]
#[path = "build/wgmma_atoms.rs"]
mod wgmma_atoms;

#[cfg(feature = "cuda")]
use compile::{compile_all, walk, IncludeDirs, Unit};
#[cfg(feature = "cuda")]
use provision::{cache_dir, find_or_provision_cuda, generate_bindings, python, run};
#[cfg(feature = "cuda")]
use std::{env, fs, path::PathBuf, process::Command};

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=build");
    println!("cargo:rerun-if-changed=src/registry.rs");
    #[cfg(feature = "cuda")]
    build_kernels();
}

#[cfg(feature = "cuda")]
fn build_kernels() {
    for var in [
        "CUDA_HOME",
        "CUDA_PATH",
        "FLASHATTN_ALLOW_SERIALIZED_WGMMA",
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
    let mut units = units::generate_kernels(&gen);
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
