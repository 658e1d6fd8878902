//! Compiles the translation units with nvcc, two at a time, each object cached under a hash of
//! everything that goes into it (source, the csrc headers it includes, flags, compiler).

use sha2::{Digest, Sha256};
use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};

const BASE_FLAGS: &[&str] = &[
    "-std=c++17",
    "--expt-relaxed-constexpr",
    "-O3",
    "-DNDEBUG",
    "-Xcompiler=-fPIC",
];
const SM90_GENCODE: &[&str] = &["-gencode=arch=compute_90a,code=sm_90a"];

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

/// One translation unit: its source, and its name under csrc/ or the generated directory
/// (which also says its architecture).
pub(crate) struct Unit {
    pub(crate) src: PathBuf,
    pub(crate) rel: String,
}

pub(crate) fn walk(dir: &Path, sources: &mut Vec<PathBuf>, headers: &mut Vec<PathBuf>) {
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
pub(crate) struct IncludeDirs {
    pub(crate) csrc: PathBuf,
    pub(crate) gen: PathBuf,
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
pub(crate) fn compile_all(
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

    // An experiment may build serialized kernels on purpose, to time them.
    let allow_serialized = env::var_os("FLASHATTN_ALLOW_SERIALIZED_WGMMA").is_some();
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
                    let text = fs::read_to_string(&log).unwrap_or_default();
                    if serializes_wgmma(&text) && !allow_serialized {
                        failures.lock().unwrap().push(refusal(&src, &text));
                    } else if verbose {
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
                if !out.status.success() {
                    let _ = fs::remove_file(&tmp);
                    failures
                        .lock()
                        .unwrap()
                        .push(format!("{}:\n{cmd:?}\n{text}", src.display()));
                } else if serializes_wgmma(&text) && !allow_serialized {
                    let _ = fs::remove_file(&tmp);
                    failures.lock().unwrap().push(refusal(&src, &text));
                } else {
                    fs::rename(&tmp, &obj).unwrap();
                    if verbose {
                        print_log(&log);
                    }
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    let failures = failures.lock().unwrap();
    if !failures.is_empty() {
        panic!("flashattn: kernel build failed\n{}", failures.join("\n\n"));
    }
    objects
}

/// Whether ptxas serialized a kernel's WGMMAs (its remarks C7512, C7514, C7515 and C7520 among
/// others say so in these words: a GEMM under a branch of its own, accumulators touched between
/// issue and wait, too few registers), which leaves a Hopper kernel far below its speed: such an
/// object is refused, whether just built or found in the cache (unless
/// FLASHATTN_ALLOW_SERIALIZED_WGMMA is set).
fn serializes_wgmma(nvcc_output: &str) -> bool {
    nvcc_output.contains("wgmma.mma_async instructions are serialized")
}

fn refusal(src: &Path, nvcc_output: &str) -> String {
    let remarks: Vec<&str> = nvcc_output
        .lines()
        .filter(|l| serializes_wgmma(l))
        .collect();
    format!(
        "{}: ptxas serialized WGMMAs (set FLASHATTN_ALLOW_SERIALIZED_WGMMA to build it anyway)\n{}",
        src.display(),
        remarks.join("\n")
    )
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
