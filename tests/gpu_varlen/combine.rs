//! The device merge of partial results (`Device::combine_into`) against the host's
//! (`flashattn::combine::combine_into`): random parts in both LSE layouts, one part strided (NaN
//! between its rows), rows a part saw no key of (+inf; one with NaN in that part's O, which both
//! merges carry into the row), rows no part saw, a NaN row; the outputs poisoned with a finite
//! value before the launch (the output LSE longer than the rows: its tail stays poisoned). Bad
//! parts are typed errors.

use cudarc::driver::CudaSlice;
use flashattn::combine::{self, LseLayout};
use flashattn::cuda::{DeviceTensor, DeviceTensorMut};
use flashattn::{Error, Layout, TensorMut, TensorRef};
use half::bf16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::common::device;
use super::harness::random;

const SHAPE: [usize; 4] = [3, 19, 4, 72];

/// `parts` random parts of SHAPE (part 1 strided: its rows 2·head dim apart, NaN between), their
/// LSE with row 5 +inf in part 0 (row 6 too, over NaN in its O), row 7 +inf in every part and
/// row 9 NaN in the last.
fn parts(n: usize, seed: u64) -> Vec<(Vec<bf16>, Layout, Vec<f32>)> {
    let mut rng = StdRng::seed_from_u64(seed);
    let [b, s, h, d] = SHAPE;
    let rows = b * s * h;
    (0..n)
        .map(|k| {
            let layout = if k == 1 {
                Layout::with_strides(SHAPE, [s * h * 2 * d, h * 2 * d, 2 * d, 1])
            } else {
                Layout::contiguous(SHAPE)
            };
            let mut o: Vec<bf16> = random(b * s * h * 2 * d, &mut rng);
            if k == 1 {
                for row in o.chunks_exact_mut(2 * d) {
                    row[d..].fill(bf16::NAN);
                }
            }
            let mut lse: Vec<f32> = (0..rows).map(|_| rng.random_range(-3.0..9.0)).collect();
            if k == 0 {
                (lse[5], lse[6]) = (f32::INFINITY, f32::INFINITY);
                // Row 6 of the dense LSE layout is (b 0, head 0, query 6): O's row (0, 6, 0).
                o[6 * h * d..][..d].fill(bf16::NAN);
            }
            lse[7] = f32::INFINITY;
            if k == n - 1 {
                lse[9] = f32::NAN;
            }
            (o, layout, lse)
        })
        .collect()
}

/// Each part's O and LSE on the device.
fn upload(
    stream: &std::sync::Arc<flashattn::cuda::CudaStream>,
    parts: &[(Vec<bf16>, Layout, Vec<f32>)],
) -> Vec<(CudaSlice<bf16>, CudaSlice<f32>)> {
    parts
        .iter()
        .map(|(o, _, lse)| {
            (
                stream.clone_htod(o).unwrap(),
                stream.clone_htod(lse).unwrap(),
            )
        })
        .collect()
}

#[test]
#[ignore = "needs a GPU"]
fn device_combine_matches_the_host_merge() {
    let (dev, stream) = device();
    let [b, s, h, d] = SHAPE;
    let rows = b * s * h;
    for (n, layout) in [
        (1, LseLayout::Dense),
        (3, LseLayout::Packed),
        (64, LseLayout::Dense),
    ] {
        let parts = parts(n, n as u64);
        let host_parts: Vec<_> = parts
            .iter()
            .map(|(o, l, lse)| (TensorRef::new(o, *l), &lse[..]))
            .collect();
        let mut want = vec![bf16::ZERO; rows * d];
        let mut want_lse = vec![0f32; rows];
        combine::combine_into(
            &host_parts,
            layout,
            TensorMut::contiguous(&mut want, SHAPE),
            &mut want_lse,
        )
        .unwrap();

        let uploaded = upload(&stream, &parts);
        let device_parts: Vec<_> = uploaded
            .iter()
            .zip(&parts)
            .map(|((o, lse), (_, l, _))| (DeviceTensor::new(o.as_view(), *l), lse.as_view()))
            .collect();
        let poison = 12345.0;
        let mut out = stream
            .clone_htod(&vec![bf16::from_f32(poison); rows * d])
            .unwrap();
        let mut lse = stream.clone_htod(&vec![poison; rows + 3]).unwrap();
        dev.combine_into(
            &stream,
            &device_parts,
            layout,
            &mut DeviceTensorMut::contiguous(&mut out, SHAPE),
            &mut lse.as_view_mut(),
        )
        .unwrap();
        let got = stream.clone_dtoh(&out).unwrap();
        let got_lse = stream.clone_dtoh(&lse).unwrap();
        // The LSE's rows in the dense layout's order (b, h, i) or the packed one's (h, b, i); O's
        // rows are (b, i, h).
        for bb in 0..b {
            for hh in 0..h {
                for i in 0..s {
                    let at = match layout {
                        LseLayout::Dense => (bb * h + hh) * s + i,
                        LseLayout::Packed => (hh * b + bb) * s + i,
                    };
                    let (g, w) = (got_lse[at], want_lse[at]);
                    let same = (g.is_nan() && w.is_nan())
                        || g == w
                        || (g - w).abs() <= 1e-5 * w.abs().max(1.0);
                    assert!(same, "{n} parts, LSE row {at}: {g} vs {w}");
                    let row = ((bb * s + i) * h + hh) * d;
                    for j in row..row + d {
                        let (g, w) = (got[j].to_f32(), want[j].to_f32());
                        // f32 against f64 arithmetic, both rounded to bf16: one step of bf16
                        // apart, and the f32 sum's rounding over up to 64 weighted values of
                        // magnitude below 8 (64 · 2^-24 · 8 < 1e-4) where the row cancels.
                        let close =
                            (g.is_nan() && w.is_nan()) || (g - w).abs() <= w.abs() / 128.0 + 1e-4;
                        assert!(close, "{n} parts, O element {j}: {g} vs {w}");
                    }
                }
            }
        }
        assert_eq!(
            &got_lse[rows..],
            &[poison; 3],
            "{n} parts: the LSE past its rows"
        );
        assert!(got_lse.iter().any(|x| x.is_nan()), "{n} parts: the NaN row");
    }

    // Bad parts: none, too many, of another shape, an LSE of another length.
    let parts = parts(2, 9);
    let uploaded = upload(&stream, &parts);
    let view = |k: usize, layout: Layout| {
        (
            DeviceTensor::new(uploaded[k].0.as_view(), layout),
            uploaded[k].1.as_view(),
        )
    };
    let mut out = stream.alloc_zeros::<bf16>(rows * d).unwrap();
    let mut lse = stream.alloc_zeros::<f32>(rows).unwrap();
    let mut run = |p: &[(DeviceTensor<bf16>, cudarc::driver::CudaView<f32>)]| {
        dev.combine_into(
            &stream,
            p,
            LseLayout::Dense,
            &mut DeviceTensorMut::contiguous(&mut out, SHAPE),
            &mut lse.as_view_mut(),
        )
        .unwrap_err()
    };
    let e = run(&[]);
    assert!(matches!(e, Error::InvalidConfig(_)), "{e:?}");
    let many: Vec<_> = (0..65)
        .map(|_| view(0, Layout::contiguous(SHAPE)))
        .collect();
    let e = run(&many);
    assert!(matches!(e, Error::InvalidConfig(_)), "{e:?}");
    let e = run(&[
        view(0, Layout::contiguous(SHAPE)),
        view(1, Layout::contiguous([b, s, h, d / 2])),
    ]);
    assert!(matches!(e, Error::ShapeMismatch { .. }), "{e:?}");
    let short = (
        DeviceTensor::new(uploaded[1].0.as_view(), Layout::contiguous(SHAPE)),
        uploaded[1].1.slice(1..),
    );
    let e = run(&[view(0, Layout::contiguous(SHAPE)), short]);
    assert!(matches!(e, Error::BufferTooSmall { .. }), "{e:?}");
}
