//! The sm90 forward under other schedules: the ablation's, one CTA per tile, narrow key blocks.

use flashattn::registry::TileRole;
use flashattn::unstable::{PingPong, Sm90Schedule};
use flashattn::{Backend, Error, Op};
use half::bf16;

use crate::common::device;
use crate::harness::Case;
use crate::run_case;

#[test]
#[ignore = "needs a Hopper GPU"]
fn sm90_fwd_ablation_schedules_agree() {
    // Every schedule computes the same function.
    for (pingpong, intra_wg_overlap) in [
        (PingPong::Off, true),
        (PingPong::On, false),
        (PingPong::Off, false),
    ] {
        let (dev, stream) = device();
        let case = Case::new(777, 1029, 128).causal(true).batch(2).heads(4, 2);
        let mut cfg = case.cfg(Backend::Sm90);
        cfg.sm90_schedule = Sm90Schedule {
            pingpong,
            intra_wg_overlap,
            ..Default::default()
        };
        if !intra_wg_overlap && !cfg!(feature = "ablation") {
            // Not compiled: refused before anything runs, naming the feature.
            match dev.plan(Op::Forward, &case.problem(), &cfg) {
                Err(Error::Unsupported { what, .. }) if what.contains("`ablation`") => continue,
                other => panic!("the ablation is not built, yet planned as {other:?}"),
            }
        }
        let (o, lse) = run_case::<bf16>(&dev, &stream, &case, cfg, 77);
        println!("schedule pingpong={pingpong:?} overlap={intra_wg_overlap}: O {o}; LSE {lse}");
        assert!(o.pass && lse.pass);
    }
}

#[test]
#[ignore = "needs a Hopper GPU"]
fn sm90_fwd_one_cta_per_tile_schedule() {
    // Masked problems on the one-CTA-per-tile grid (the default is the persistent schedule).
    let (dev, stream) = device();
    let cases = [
        Case::new(700, 700, 128).causal(true).batch(8).heads(16, 4),
        Case::new(300, 500, 64).causal(true).batch(4).heads(32, 8),
        Case::new(300, 100, 256)
            .batch(6)
            .heads(24, 24)
            .window(Some(0), Some(0)),
        Case::new(400, 400, 128)
            .batch(3)
            .heads(40, 40)
            .window(Some(90), Some(10)),
    ];
    for (n, case) in cases.iter().enumerate() {
        let mut cfg = case.cfg(Backend::Sm90);
        cfg.sm90_schedule.persistent_causal = false;
        let (o, lse) = run_case::<bf16>(&dev, &stream, case, cfg, 500 + n as u64);
        println!("one CTA per tile {case:?}: O {o}; LSE {lse}");
        assert!(o.pass && lse.pass);
    }
}

#[test]
#[ignore = "needs a Hopper GPU"]
fn sm90_fwd_narrow_key_blocks() {
    // Non-causal calls on the causal tile (128-key blocks at d64/d128), with more keys than the
    // planner takes it for by itself.
    let (dev, stream) = device();
    let mut cases = vec![];
    for d in [64, 128] {
        cases.push(Case::new(1500, 1500, d));
        cases.push(Case::new(113, 1500, d));
        cases.push(Case::new(300, 257, d).batch(4).heads(16, 2));
    }
    for (n, case) in cases.iter().enumerate() {
        let mut cfg = case.cfg(Backend::Sm90);
        cfg.sm90_schedule.narrow_key_blocks = true;
        let plan = dev.plan(Op::Forward, &case.problem(), &cfg).unwrap();
        assert_eq!(
            plan.tile().map(|t| t.role),
            Some(TileRole::Masked),
            "{}",
            plan.explain()
        );
        let (o, lse) = run_case::<bf16>(&dev, &stream, case, cfg, 900 + n as u64);
        println!("narrow key blocks {case:?}: O {o}; LSE {lse}");
        assert!(o.pass && lse.pass);
    }
}
