//! Bad inputs: each a typed error.

use flashattn::{
    AttentionConfig, Backend, BackwardInputs, DType, Error, ForwardInputs, Layout, Operand,
    TensorMut, TensorRef,
};
use half::bf16;

fn ones(n: usize) -> Vec<f32> {
    vec![1.0; n]
}

fn fwd_err(
    cfg: &AttentionConfig,
    q: TensorRef<f32>,
    k: TensorRef<f32>,
    v: TensorRef<f32>,
) -> Error {
    flashattn::forward(cfg, ForwardInputs::new(q, k, v)).expect_err("bad input must be refused")
}

#[test]
fn mismatched_batch_is_a_shape_error() {
    let (a, b) = (ones(2 * 4 * 2 * 8), ones(4 * 2 * 8));
    let q = TensorRef::contiguous(&a, [2, 4, 2, 8]);
    let k = TensorRef::contiguous(&b, [1, 4, 2, 8]);
    let e = fwd_err(&AttentionConfig::new(), q, k, k);
    assert!(
        matches!(
            e,
            Error::ShapeMismatch {
                operand: Operand::K,
                expected: [2, 4, 2, 8],
                found: [1, 4, 2, 8]
            }
        ),
        "{e:?}"
    );
}

#[test]
fn v_shape_differing_from_k_is_a_shape_error() {
    let (a, b) = (ones(4 * 2 * 8), ones(5 * 2 * 8));
    let q = TensorRef::contiguous(&a, [1, 4, 2, 8]);
    let v = TensorRef::contiguous(&b, [1, 5, 2, 8]);
    let e = fwd_err(&AttentionConfig::new(), q, q, v);
    assert!(
        matches!(
            e,
            Error::ShapeMismatch {
                operand: Operand::V,
                ..
            }
        ),
        "{e:?}"
    );
}

#[test]
fn head_dim_mismatch_is_a_shape_error() {
    let (a, b) = (ones(4 * 2 * 8), ones(4 * 2 * 16));
    let q = TensorRef::contiguous(&a, [1, 4, 2, 8]);
    let k = TensorRef::contiguous(&b, [1, 4, 2, 16]);
    let e = fwd_err(&AttentionConfig::new(), q, k, k);
    assert!(
        matches!(
            e,
            Error::ShapeMismatch {
                operand: Operand::K,
                expected: [1, 4, 2, 8],
                ..
            }
        ),
        "{e:?}"
    );
}

#[test]
fn non_unit_head_dim_stride_is_refused() {
    let a = ones(2 * 4 * 2 * 8);
    let q = TensorRef::new(&a, Layout::with_strides([1, 4, 2, 8], [128, 32, 16, 2]));
    let k = TensorRef::contiguous(&a[..64], [1, 4, 2, 8]);
    let e = fwd_err(&AttentionConfig::new(), q, k, k);
    assert!(
        matches!(
            e,
            Error::NonUnitHeadDimStride {
                operand: Operand::Q,
                stride: 2
            }
        ),
        "{e:?}"
    );
}

#[test]
fn heads_not_a_multiple_are_refused() {
    let (a, b) = (ones(4 * 3 * 8), ones(4 * 2 * 8));
    let q = TensorRef::contiguous(&a, [1, 4, 3, 8]);
    let k = TensorRef::contiguous(&b, [1, 4, 2, 8]);
    let e = fwd_err(&AttentionConfig::new(), q, k, k);
    assert_eq!(
        e,
        Error::HeadsNotMultiple {
            heads_q: 3,
            heads_kv: 2
        }
    );
}

#[test]
fn zero_size_dimensions_are_refused() {
    let a = ones(64);
    let k = TensorRef::contiguous(&a, [1, 4, 2, 8]);
    for dim in 0..4 {
        let mut shape = [1, 4, 2, 8];
        shape[dim] = 0;
        let q = TensorRef::contiguous(&a, shape);
        let e = fwd_err(&AttentionConfig::new(), q, k, k);
        assert_eq!(
            e,
            Error::EmptyDimension {
                operand: Operand::Q,
                dim
            }
        );
    }
    let q = TensorRef::contiguous(&a, [1, 4, 2, 8]);
    let k0 = TensorRef::contiguous(&a, [1, 0, 2, 8]);
    let e = fwd_err(&AttentionConfig::new(), q, k0, k0);
    assert_eq!(
        e,
        Error::EmptyDimension {
            operand: Operand::K,
            dim: 1
        }
    );
}

#[test]
fn buffer_too_small_is_refused() {
    let a = ones(4 * 2 * 8 - 1);
    let b = ones(4 * 2 * 8);
    let q = TensorRef::contiguous(&b, [1, 4, 2, 8]);
    let v = TensorRef::contiguous(&a, [1, 4, 2, 8]);
    let e = fwd_err(&AttentionConfig::new(), q, q, v);
    assert_eq!(
        e,
        Error::BufferTooSmall {
            operand: Operand::V,
            needed: 64,
            len: 63
        }
    );
}

#[test]
fn wrong_out_shape_and_short_lse_are_refused() {
    let a = ones(4 * 2 * 8);
    let q = TensorRef::contiguous(&a, [1, 4, 2, 8]);
    let cfg = AttentionConfig::new();
    let mut o = vec![0f32; 64];
    let mut lse = vec![0f32; 8];
    let e = flashattn::forward_into(
        &cfg,
        ForwardInputs::new(q, q, q),
        TensorMut::contiguous(&mut o, [1, 2, 4, 8]),
        &mut lse,
    )
    .unwrap_err();
    assert!(
        matches!(
            e,
            Error::ShapeMismatch {
                operand: Operand::Out,
                expected: [1, 4, 2, 8],
                found: [1, 2, 4, 8]
            }
        ),
        "{e:?}"
    );
    let e = flashattn::forward_into(
        &cfg,
        ForwardInputs::new(q, q, q),
        TensorMut::contiguous(&mut o, [1, 4, 2, 8]),
        &mut lse[..7],
    )
    .unwrap_err();
    assert_eq!(
        e,
        Error::BufferTooSmall {
            operand: Operand::Lse,
            needed: 8,
            len: 7
        }
    );
    // The backward checks its LSE and dO too.
    let e = flashattn::backward(
        &cfg,
        BackwardInputs {
            q,
            k: q,
            v: q,
            out: q,
            dout: q,
            lse: &lse[..7],
            sinks: None,
        },
    )
    .unwrap_err();
    assert!(
        matches!(
            e,
            Error::BufferTooSmall {
                operand: Operand::Lse,
                ..
            }
        ),
        "{e:?}"
    );
    let wrong = TensorRef::contiguous(&a, [1, 2, 4, 8]);
    let e = flashattn::backward(
        &cfg,
        BackwardInputs {
            q,
            k: q,
            v: q,
            out: q,
            dout: wrong,
            lse: &lse,
            sinks: None,
        },
    )
    .unwrap_err();
    assert!(
        matches!(
            e,
            Error::ShapeMismatch {
                operand: Operand::DOut,
                ..
            }
        ),
        "{e:?}"
    );
}

#[test]
fn e4m3_is_unsupported_on_cpu() {
    let a = vec![float8::F8E4M3::from_f32(1.0); 64];
    let q = TensorRef::contiguous(&a, [1, 4, 2, 8]);
    // Forced onto the CPU: the backend's own error.
    let cfg = AttentionConfig::new().backend(Backend::Cpu);
    let e = flashattn::forward(&cfg, ForwardInputs::new(q, q, q)).unwrap_err();
    assert_eq!(
        e,
        Error::UnsupportedDtype {
            dtype: DType::E4M3,
            backend: Backend::Cpu
        }
    );
    // Auto: no backend accepts the call, and the error says why the CPU refused.
    let e = flashattn::forward(&AttentionConfig::new(), ForwardInputs::new(q, q, q)).unwrap_err();
    assert!(
        matches!(&e, Error::Unsupported { what, backend: Backend::Auto } if what.contains("E4M3")),
        "{e:?}"
    );
}

#[test]
fn negative_scale_is_an_invalid_config() {
    let a = ones(64);
    let q = TensorRef::contiguous(&a, [1, 4, 2, 8]);
    let e = fwd_err(&AttentionConfig::new().softmax_scale(-0.5), q, q, q);
    assert!(matches!(e, Error::InvalidConfig(_)), "{e:?}");
}

#[test]
fn gpu_backend_on_host_data_is_unavailable() {
    let a = vec![bf16::from_f32(1.0); 4 * 2 * 64];
    let q = TensorRef::contiguous(&a, [1, 4, 2, 64]);
    for backend in [Backend::Sm90, Backend::Sm80] {
        let e = flashattn::forward(
            &AttentionConfig::new().backend(backend),
            ForwardInputs::new(q, q, q),
        )
        .unwrap_err();
        assert!(
            matches!(e, Error::BackendUnavailable { backend: b, .. } if b == backend),
            "{e:?}"
        );
    }
    // Forcing the CPU works and says so.
    let fwd = flashattn::forward(
        &AttentionConfig::new().backend(Backend::Cpu),
        ForwardInputs::new(q, q, q),
    )
    .unwrap();
    assert_eq!(fwd.plan.backend, Backend::Cpu);
}
