//! Which backend runs a call, and why. One table of what each backend supports; `Auto` takes
//! the first that accepts the call and [`Plan::explain`] says what the others refused.

use crate::config::{AttentionConfig, Backend};
use crate::error::{Error, Result};
use crate::registry::{self, Family, Kernel, KernelDtype, TileRole, TileRow};
use crate::tensor::{DType, Problem};

/// The operation being planned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Op {
    Forward,
    /// A backward that does not return the attention sinks' gradient.
    Backward,
    /// A backward that also returns the attention sinks' gradient (`dsinks`): with softcap it
    /// takes the sm80 kernels, which sum it (the sm90 softcap kernels do not).
    BackwardWithSinkGradient,
    /// A forward over an e4m3 KV cache, Q and O in 16 bits: on the GPU the Hopper or the Ampere
    /// forward, which widens the cache (`kvcache-fp8`); the CPU takes it too.
    ForwardOverFp8Cache,
}

impl Op {
    fn is_backward(self) -> bool {
        matches!(self, Op::Backward | Op::BackwardWithSinkGradient)
    }
}

/// What the dispatcher knows of a CUDA device (from the C ABI's device query).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    pub ordinal: i32,
    pub name: String,
    pub major: i32,
    pub minor: i32,
    pub sm_count: i32,
    pub max_smem_per_block_optin: usize,
    pub l2_bytes: usize,
}

impl DeviceInfo {
    pub fn compute_capability(&self) -> (i32, i32) {
        (self.major, self.minor)
    }
}

/// Where the operands live.
#[derive(Clone, Debug)]
pub enum Memory {
    Host,
    Device(DeviceInfo),
}

/// Which kernels of the registry ([`crate::registry`]) the dispatcher may take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BuiltKernels {
    /// The ones this build holds (its Cargo features).
    Current,
    /// Every kernel of the registry, as if built (to plan for another build).
    All,
    /// None (a build without the `cuda` feature, as seen from the planner).
    Nothing,
}

impl BuiltKernels {
    /// What this build of the crate contains.
    pub fn current() -> Self {
        BuiltKernels::Current
    }

    pub fn contains(self, kernel: &Kernel) -> bool {
        match self {
            BuiltKernels::Current => kernel.built(),
            BuiltKernels::All => true,
            BuiltKernels::Nothing => false,
        }
    }

    /// Whether `kernel`'s forward without intra-warpgroup overlap is there.
    pub fn has_ablation(self, kernel: &Kernel) -> bool {
        match self {
            BuiltKernels::Current => kernel.ablation_built(),
            BuiltKernels::All => kernel.ablation,
            BuiltKernels::Nothing => false,
        }
    }
}

/// The dispatcher's decision.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    pub backend: Backend,
    kernel: Option<&'static Kernel>,
    tile: Option<&'static TileRow>,
    reasons: Vec<String>,
}

impl Plan {
    /// Why this backend was chosen, and why each one tried before it was not; the kernel that
    /// runs, on a GPU backend.
    pub fn explain(&self) -> String {
        let mut text = self.reasons.join("; ");
        if let Some(k) = self.kernel {
            text.push_str(&format!("; kernel {}", k.name()));
        }
        if let Some(row) = self.tile {
            let (m, n) = row.tile.shape();
            let role = match row.role {
                TileRole::Base => "base",
                TileRole::Masked => "masked",
            };
            text.push_str(&format!(", tile {m}x{n} ({role})"));
        }
        text
    }

    /// The registry's kernel that runs the call (None on the CPU backend).
    pub fn kernel(&self) -> Option<&'static Kernel> {
        self.kernel
    }

    /// The row of the tile table the kernel runs with (None on the CPU backend).
    pub fn tile(&self) -> Option<&'static TileRow> {
        self.tile
    }
}

/// The registry's family that runs `op` on `backend` over `dtype`, and the kernel's element type.
fn family_of(backend: Backend, op: Op, dtype: DType) -> Option<(Family, KernelDtype)> {
    let kernel_dtype = match dtype {
        DType::BF16 => KernelDtype::Bf16,
        DType::F16 => KernelDtype::Fp16,
        DType::E4M3 => KernelDtype::E4m3,
        DType::F32 => return None,
    };
    if op == Op::ForwardOverFp8Cache {
        return match (backend, kernel_dtype) {
            (Backend::Sm90, KernelDtype::Bf16 | KernelDtype::Fp16) => {
                Some((Family::Sm90Fp8CacheFwd, kernel_dtype))
            }
            (Backend::Sm80, KernelDtype::Bf16 | KernelDtype::Fp16) => {
                Some((Family::Sm80Fp8CacheFwd, kernel_dtype))
            }
            _ => None,
        };
    }
    let family = match (backend, op.is_backward(), kernel_dtype) {
        (Backend::Sm90, false, KernelDtype::E4m3) => Family::Sm90Fp8Fwd,
        (_, _, KernelDtype::E4m3) => return None,
        (Backend::Sm90, false, _) => Family::Sm90Fwd,
        (Backend::Sm90, true, _) => Family::Sm90Bwd,
        (Backend::Sm80, false, _) => Family::Sm80Fwd,
        (Backend::Sm80, true, _) => Family::Sm80Bwd,
        _ => return None,
    };
    Some((family, kernel_dtype))
}

/// Does `backend` accept this call? The kernel it would run (None on the CPU), or the error a
/// forced call would get.
pub fn check_backend(
    backend: Backend,
    op: Op,
    problem: &Problem,
    cfg: &AttentionConfig,
    memory: &Memory,
    built: BuiltKernels,
) -> Result<Option<&'static Kernel>> {
    match backend {
        Backend::Auto => Err(Error::InvalidConfig(
            "Auto is not a concrete backend".into(),
        )),
        Backend::Cpu => {
            if let Memory::Device(_) = memory {
                return Err(Error::BackendUnavailable {
                    backend,
                    reason: "operands are in device memory".into(),
                });
            }
            match problem.dtype {
                DType::F32 | DType::F16 | DType::BF16 => problem.check_cpu_limits().map(|_| None),
                DType::E4M3 => Err(Error::UnsupportedDtype {
                    dtype: problem.dtype,
                    backend,
                }),
            }
        }
        Backend::Sm90 | Backend::Sm80 => {
            let info = match memory {
                Memory::Host => {
                    return Err(Error::BackendUnavailable {
                        backend,
                        reason: "operands are in host memory".into(),
                    })
                }
                Memory::Device(info) => info,
            };
            let arch_ok = match backend {
                // sm_90a machine code runs on compute capability 9.0 only.
                Backend::Sm90 => info.compute_capability() == (9, 0),
                _ => info.major >= 8,
            };
            if !arch_ok {
                return Err(Error::BackendUnavailable {
                    backend,
                    reason: format!(
                        "device {} has compute capability {}.{}",
                        info.name, info.major, info.minor
                    ),
                });
            }
            // E4M3: the sm90 FP8 forward (inputs from the quantize step, src/cuda/fp8/).
            let unsupported_dtype = Error::UnsupportedDtype {
                dtype: problem.dtype,
                backend,
            };
            let (family, dtype) =
                family_of(backend, op, problem.dtype).ok_or(unsupported_dtype.clone())?;
            if family == Family::Sm90Fp8Fwd && cfg.softcap.is_some() {
                return Err(Error::Unsupported {
                    what: "the FP8 forward with softcap (not built)".into(),
                    backend,
                });
            }
            if !registry::head_dims(family).contains(&problem.head_dim) {
                // A head dim that other families have (d96: the forwards, the sm80 backward):
                // say which.
                let others: Vec<&str> = Family::ALL
                    .into_iter()
                    .filter(|f| registry::head_dims(*f).contains(&problem.head_dim))
                    .map(Family::name)
                    .collect();
                if others.is_empty() {
                    return Err(Error::UnsupportedHeadDim {
                        head_dim: problem.head_dim,
                        backend,
                    });
                }
                return Err(Error::Unsupported {
                    what: format!(
                        "the {} at head_dim {} (not built yet; at this head dim: {})",
                        family.name(),
                        problem.head_dim,
                        others.join(", ")
                    ),
                    backend,
                });
            }
            let dims = (problem.head_dim, problem.head_dim_v);
            let kernel =
                match registry::find(family, dims.0, dims.1, dtype) {
                    Some(k) => k,
                    None if dims.0 == dims.1 => return Err(unsupported_dtype),
                    // V's head dim apart from Q's: the families that have the pair, if any.
                    None => {
                        let others: Vec<&str> = Family::ALL
                            .into_iter()
                            .filter(|f| {
                                registry::KERNELS
                                    .iter()
                                    .any(|k| k.family == *f && (k.head_dim, k.head_dim_v) == dims)
                            })
                            .map(Family::name)
                            .collect();
                        return Err(Error::Unsupported {
                            what: format!(
                            "the {} at head dims {}/{} of Q and V (not built yet; with these: {})",
                            family.name(),
                            dims.0,
                            dims.1,
                            if others.is_empty() { "none".to_string() } else { others.join(", ") }
                        ),
                            backend,
                        });
                    }
                };
            if !built.contains(kernel) {
                return Err(Error::Unsupported {
                    what: format!(
                        "{} (not in this build: it needs the Cargo features {} and a CUDA \
                         version feature)",
                        kernel.name(),
                        kernel.features().join(", ")
                    ),
                    backend,
                });
            }
            // The sm90 backward's softcap kernels have no deterministic mode and do not sum the
            // sinks' gradient; Auto then takes the sm80 ones.
            if family == Family::Sm90Bwd && cfg.softcap.is_some() && cfg.deterministic {
                return Err(Error::Unsupported {
                    what: "the deterministic backward with softcap (not built for sm90)".into(),
                    backend,
                });
            }
            if family == Family::Sm90Bwd
                && cfg.softcap.is_some()
                && op == Op::BackwardWithSinkGradient
            {
                return Err(Error::Unsupported {
                    what: "the sinks' gradient with softcap (not built for sm90)".into(),
                    backend,
                });
            }
            problem.check_gpu_limits()?;
            check_left_window(cfg, problem.seqlen_k)?;
            // The FlashAttention-2 kernels put heads and batch entries on grid y and z.
            if backend == Backend::Sm80 && problem.heads_q.max(problem.batch) > 65535 {
                return Err(Error::IndexOverflow {
                    operand: crate::error::Operand::Q,
                    detail: format!(
                        "batch {} and heads {} must be at most 65535 each on sm80",
                        problem.batch, problem.heads_q
                    ),
                });
            }
            let forward_sm90 = matches!(family, Family::Sm90Fwd | Family::Sm90Fp8Fwd);
            if forward_sm90 && !cfg.sm90_schedule.intra_wg_overlap && !built.has_ablation(kernel) {
                let why = if kernel.ablation {
                    "built with the Cargo feature `ablation` only"
                } else {
                    "the registry has it for the sm90 forward at d128 bf16 only (the FP8 d128 \
                     forward's tile runs without the overlap by itself)"
                };
                return Err(Error::Unsupported {
                    what: format!("{} without intra-warpgroup overlap ({why})", kernel.name()),
                    backend,
                });
            }
            Ok(Some(kernel))
        }
    }
}

/// The kernels add a left window to key positions in 32 bits; one at least `seqlen_k - 1` wide
/// leaves every row all its keys, and is unbounded. (Packed calls: `seqlen_k` is the tensors'
/// key rows, as the C side checks.)
pub(crate) fn check_left_window(cfg: &AttentionConfig, seqlen_k: usize) -> Result<()> {
    if let (Some(left), _) = cfg.mask.bounds() {
        let s_k = seqlen_k;
        if left < s_k - 1 && s_k + left > i32::MAX as usize - 512 {
            return Err(Error::IndexOverflow {
                operand: crate::error::Operand::K,
                detail: format!(
                    "seqlen_k {s_k} plus a left window of {left} passes the GPU kernels' \
                     32-bit key positions"
                ),
            });
        }
    }
    Ok(())
}

/// Key lengths up to which the sm90 forward takes its narrow (masked) tile whatever the mask:
/// measured faster up to 1k keys, equal at 2k and slower beyond (docs/PERFORMANCE.md).
const NARROW_KEY_BLOCKS_UP_TO: usize = 1024;

/// Which of its tiles `kernel` runs the call with. The sm90 forward takes the `Masked` row (narrow
/// key blocks, where it has one) when a right bound on the keys makes diagonal blocks frequent
/// (causal; a right window that leaves some row short of the last key), for short keys, or when
/// the schedule asks for it; its ablation (no intra-warpgroup overlap) and every other family
/// run the `Base` row. The sm90 forward over an e4m3 cache always takes the `Masked` row (its
/// narrower key blocks leave room for the staging slots; `Base` where it has none).
fn tile_role(kernel: &Kernel, problem: &Problem, cfg: &AttentionConfig) -> TileRole {
    if kernel.family == Family::Sm90Fp8CacheFwd {
        return TileRole::Masked;
    }
    // Causal goes to the kernels as their causal flag, which keeps the right bound even where
    // it hides no key (one query row).
    let right_bound = cfg.mask.is_causal()
        || cfg
            .key_rule(problem.seqlen_q, problem.seqlen_k)
            .bounds_some_row_on_the_right();
    let masked = kernel.family == Family::Sm90Fwd
        && cfg.sm90_schedule.intra_wg_overlap
        && (right_bound
            || cfg.sm90_schedule.narrow_key_blocks
            || problem.seqlen_k <= NARROW_KEY_BLOCKS_UP_TO);
    if masked {
        TileRole::Masked
    } else {
        TileRole::Base
    }
}

/// Chooses the backend for a call. A forced backend is checked and either accepted or
/// refused with its error; `Auto` tries Sm90, Sm80 (device memory) or Cpu (host memory).
pub fn plan(
    op: Op,
    problem: &Problem,
    cfg: &AttentionConfig,
    memory: &Memory,
    built: BuiltKernels,
) -> Result<Plan> {
    cfg.validate()?;
    problem.validate()?;
    // A size no backend for this memory takes is the caller's error, not a backend's refusal.
    match memory {
        Memory::Host => problem.check_cpu_limits()?,
        Memory::Device(_) => problem.check_gpu_limits()?,
    }
    let candidates: &[Backend] = match (cfg.backend, memory) {
        (Backend::Auto, Memory::Host) => &[Backend::Cpu],
        (Backend::Auto, Memory::Device(_)) => &[Backend::Sm90, Backend::Sm80],
        (forced, _) => std::slice::from_ref(match forced {
            Backend::Sm90 => &Backend::Sm90,
            Backend::Sm80 => &Backend::Sm80,
            _ => &Backend::Cpu,
        }),
    };
    let mut reasons = Vec::new();
    let mut last_err = None;
    for &backend in candidates {
        match check_backend(backend, op, problem, cfg, memory, built) {
            Ok(kernel) => {
                let why = match (cfg.backend, memory) {
                    (Backend::Auto, Memory::Host) => "cpu: operands are in host memory".to_string(),
                    (Backend::Auto, Memory::Device(info)) => format!(
                        "{}: supports {:?} d{} {:?} on {} (sm_{}{})",
                        backend.name(),
                        op,
                        problem.head_dim,
                        problem.dtype,
                        info.name,
                        info.major,
                        info.minor
                    ),
                    _ => format!("{}: forced by the caller", backend.name()),
                };
                reasons.push(why);
                let tile = kernel.and_then(|k| registry::tile_row(k, tile_role(k, problem, cfg)));
                return Ok(Plan {
                    backend,
                    kernel,
                    tile,
                    reasons,
                });
            }
            Err(e) => {
                reasons.push(format!("{}: {e}", backend.name()));
                last_err = Some(e);
            }
        }
    }
    match (cfg.backend, last_err) {
        (Backend::Auto, Some(_)) => Err(Error::Unsupported {
            what: format!("this call ({})", reasons.join("; ")),
            backend: Backend::Auto,
        }),
        (_, Some(e)) => Err(e),
        (_, None) => unreachable!("candidate list is never empty"),
    }
}
