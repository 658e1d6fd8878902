//! The one table of the CUDA kernels this crate can build. build.rs reads it (the same file,
//! through `#[path]`) to generate a translation unit per kernel, their declarations and the C
//! entry points' dispatch; the Rust dispatcher reads it to know which head dims and element
//! types each family takes, which kernels this build holds, and which Cargo feature a missing
//! one needs. A new kernel is a new row here, not a new file or a new switch.
//!
//! Build budget: each kernel is built only when every Cargo feature it names is on (`sm90`,
//! `sm80`, `backward`, `fp8`, `hdim64`, `hdim128`, `hdim256`; all of them, the feature `kernels`,
//! by default), so that `--no-default-features --features cuda,cuda-13000,sm90,hdim128` builds the
//! Hopper d128 forwards alone (`cuda` needs one of the CUDA version features beside it).

/// A kernel family: one algorithm, architecture and pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Family {
    /// FlashAttention-3-style forward, bf16/fp16 (csrc/sm90/fwd_launch.h).
    Sm90Fwd,
    /// The FP8 (e4m3) forward on the same pipeline (csrc/sm90/fwd_fp8_launch.h).
    Sm90Fp8Fwd,
    /// FlashAttention-3-style backward (csrc/sm90/bwd_launch.h).
    Sm90Bwd,
    /// FlashAttention-2-style forward (csrc/sm80/fwd_launch.h).
    Sm80Fwd,
    /// FlashAttention-2-style backward (csrc/sm80/bwd_launch.h).
    Sm80Bwd,
}

impl Family {
    pub const ALL: [Family; 5] = [
        Family::Sm90Fwd,
        Family::Sm90Fp8Fwd,
        Family::Sm90Bwd,
        Family::Sm80Fwd,
        Family::Sm80Bwd,
    ];

    /// Its name in kernel names and messages.
    pub fn name(self) -> &'static str {
        match self {
            Family::Sm90Fwd => "sm90 fwd",
            Family::Sm90Fp8Fwd => "sm90 fp8 fwd",
            Family::Sm90Bwd => "sm90 bwd",
            Family::Sm80Fwd => "sm80 fwd",
            Family::Sm80Bwd => "sm80 bwd",
        }
    }

    /// The Cargo features its kernels need besides their head dim's.
    pub fn features(self) -> &'static [&'static str] {
        match self {
            Family::Sm90Fwd => &["sm90"],
            Family::Sm90Fp8Fwd => &["sm90", "fp8"],
            Family::Sm90Bwd => &["sm90", "backward"],
            Family::Sm80Fwd => &["sm80"],
            Family::Sm80Bwd => &["sm80", "backward"],
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
    /// Head dim of Q and K, and of V (equal in every kernel built so far).
    pub head_dim: usize,
    pub head_dim_v: usize,
    pub dtype: KernelDtype,
    /// Also holds the forward without intra-warpgroup overlap (the FlashAttention-3 paper's
    /// ablation, `Sm90Schedule::intra_wg_overlap` off).
    pub ablation: bool,
}

const fn kernel(family: Family, head_dim: usize, dtype: KernelDtype) -> Kernel {
    Kernel {
        family,
        head_dim,
        head_dim_v: head_dim,
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
    kernel(Sm90Fp8Fwd, 64, E4m3),
    kernel(Sm90Fp8Fwd, 128, E4m3),
    kernel(Sm90Fp8Fwd, 256, E4m3),
    kernel(Sm90Bwd, 64, Bf16),
    kernel(Sm90Bwd, 128, Bf16),
    kernel(Sm90Bwd, 256, Bf16),
    kernel(Sm90Bwd, 64, Fp16),
    kernel(Sm90Bwd, 128, Fp16),
    kernel(Sm90Bwd, 256, Fp16),
    kernel(Sm80Fwd, 64, Bf16),
    kernel(Sm80Fwd, 128, Bf16),
    kernel(Sm80Fwd, 256, Bf16),
    kernel(Sm80Fwd, 64, Fp16),
    kernel(Sm80Fwd, 128, Fp16),
    kernel(Sm80Fwd, 256, Fp16),
    kernel(Sm80Bwd, 64, Bf16),
    kernel(Sm80Bwd, 128, Bf16),
    kernel(Sm80Bwd, 256, Bf16),
    kernel(Sm80Bwd, 64, Fp16),
    kernel(Sm80Bwd, 128, Fp16),
    kernel(Sm80Bwd, 256, Fp16),
];

/// The Cargo feature of each head dim.
pub const HEAD_DIM_FEATURES: &[(usize, &str)] =
    &[(64, "hdim64"), (128, "hdim128"), (256, "hdim256")];

/// Whether Cargo feature `name` is on in this compilation (the crate's, or build.rs's: Cargo
/// passes a package's features to both).
fn feature_on(name: &str) -> bool {
    match name {
        "cuda" => cfg!(feature = "cuda"),
        "sm90" => cfg!(feature = "sm90"),
        "sm80" => cfg!(feature = "sm80"),
        "backward" => cfg!(feature = "backward"),
        "fp8" => cfg!(feature = "fp8"),
        "hdim64" => cfg!(feature = "hdim64"),
        "hdim128" => cfg!(feature = "hdim128"),
        "hdim256" => cfg!(feature = "hdim256"),
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
}

/// The kernel of `family` for `head_dim` and `dtype`, built or not.
pub fn find(family: Family, head_dim: usize, dtype: KernelDtype) -> Option<&'static Kernel> {
    KERNELS
        .iter()
        .find(|k| k.family == family && k.head_dim == head_dim && k.dtype == dtype)
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

#[cfg(test)]
mod tests {
    use super::*;

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
            assert_eq!(find(k.family, k.head_dim, k.dtype), Some(k));
        }
        assert_eq!(head_dims(Family::Sm90Fwd), vec![64, 128, 256]);
    }

    #[test]
    fn every_feature_a_kernel_names_is_known() {
        for k in KERNELS {
            for f in k.features() {
                let _ = feature_on(f); // unreachable!() on a name with no arm
            }
        }
    }
}
