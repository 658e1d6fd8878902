//! Finds or provisions what the build runs: Python, the CUDA compiler (pinned PyPI packages when
//! none is installed), libclang for bindgen; and generates the FFI bindings.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

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

pub(crate) fn python() -> String {
    env::var("PYTHON").unwrap_or_else(|_| "python3".into())
}

pub(crate) fn cache_dir() -> PathBuf {
    if let Ok(dir) = env::var("FLASHATTN_CACHE_DIR") {
        return PathBuf::from(dir);
    }
    let home = env::var("HOME").unwrap_or_else(|_| ".".into());
    PathBuf::from(home).join(".cache").join("flashattn")
}

pub(crate) fn run(cmd: &mut Command) {
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

pub(crate) fn find_or_provision_cuda(cache: &Path) -> PathBuf {
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

pub(crate) fn generate_bindings(header: &Path, out_dir: &Path, cache: &Path) {
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
