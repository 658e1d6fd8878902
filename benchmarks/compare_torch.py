#!/usr/bin/env python3
"""Measure the peers of flashattn on one GPU: torch SDPA (FLASH and CUDNN backends) on the
headline shapes of docs/ARCHITECTURE.md, plus the ceilings (bf16 and FP8 GEMM, device copy bandwidth).

Writes the results JSON of docs/ARCHITECTURE.md and prints a compact table.

    python3 benchmarks/compare_torch.py --out $OUT/peers.json --commit $(git rev-parse --short HEAD)
    python3 benchmarks/compare_torch.py --quick
    python3 benchmarks/compare_torch.py --dims 128 --sustained 400   # cold and sustained rows
    python3 benchmarks/compare_torch.py --seqlens 2048,8192 --dims 128 --causal yes
    python3 benchmarks/compare_torch.py --dry-run        # list the shapes; needs no torch, no GPU

Needs python >= 3.9, torch with CUDA; stdlib + torch only (pynvml or nvidia-smi for the
sustained rows' clocks). torch is imported after the
arguments are parsed, so --help and --dry-run work anywhere.

Method (docs/ARCHITECTURE.md):
  * shapes: total tokens T (default 16384), batch = T / seqlen; hidden H (default 2048),
    heads = H / head_dim; seqlen_q = seqlen_k; heads_kv = heads; bf16; softmax scale 1/sqrt(d).
  * inputs: N(0,1) in the (batch, seqlen, heads, dim) layout, handed to SDPA as
    .transpose(1, 2) views (what a model with a fused QKV projection does); dO likewise.
  * FLOPs: forward 4*b*s_q*s_k*h*d (halved when causal); backward 2.5x forward.
  * timing: CUDA events around each call, after warm-up; median of >= --min-reps runs (more
    runs for small shapes, up to --max-reps, so each measurement takes about --target-ms).
    Before each timed loop the GPU is kept busy with torch.cuda._sleep so that the CPU can
    queue the whole loop ahead of the GPU (the times are then GPU times, not launch overhead),
    and at rest for at least --cool-ms, as ours are before theirs (peers_common.head_ms).
    Input sets are rotated only when one set fits in L2 (it never does at the headline shapes).
  * forward: the training forward (inputs require grad, autograd records; this forward also
    writes the log-sum-exp), as flash-attn's own benchmarks time it.
  * backward: ONLY the backward call, timed as
        torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    on a graph built once by one forward. This is the backward kernel(s) and whatever
    pre/post-processing the backend launches (dO.O row sums, dQ accumulator conversion,
    layout copies), and no forward. autograd.grad (not .backward()) returns fresh gradients,
    so no gradient-accumulation kernel into .grad is timed.
  * sustained (--sustained N): after a backend's cold timing of a shape, N back-to-back calls of
    its forward and of its backward (after --sustained-warmup), the mean per call over the last
    half between two CUDA events, with the SM clock and power sampled meanwhile (rows with
    sustained: true, reps, kind; peers_sustained.py, as peers_fa3_fp8.py and our benches).
  * a backend that fails on a shape gets a row with an "error" string (forward failure: no
    numbers; backward-only failure: forward numbers kept, error starts with "bwd:").
"""

import argparse
import os
import sys
import time
from datetime import datetime, timezone

# The helpers beside this script (here and in the device bundle).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare_torch_bench import BACKENDS, Bench, FatalCuda, attn_flops_fwd  # noqa: E402
from peers_sustained import GpuSampler  # noqa: E402
from peers_common import (  # noqa: E402
    add_output_args,
    add_run_args,
    add_timing_args,
    driver_version,
    finish_run_args,
    fmt,
    int_list,
    write_json,
)

DEFAULT_SEQLENS = [512, 1024, 2048, 4096, 8192, 16384]
DEFAULT_DIMS = [64, 128, 256]
QUICK_SEQLENS = [2048, 8192]
QUICK_DIMS = [64, 128]


# ----------------------------------------------------------------------------- arguments

def backend_list(text):
    vals = [x for x in text.replace(" ", "").split(",") if x]
    bad = [x for x in vals if x not in BACKENDS]
    if not vals or bad:
        raise argparse.ArgumentTypeError(
            f"backends are a comma list of {', '.join(BACKENDS)}; got {text!r}")
    return vals


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Time torch SDPA (FLASH, CUDNN backends) and GEMM/copy ceilings on the "
                    "headline shapes of docs/ARCHITECTURE.md; write the results JSON of docs/ARCHITECTURE.md.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_output_args(p, "compare_torch", "shape")
    p.add_argument("--quick", action="store_true",
                   help=f"small subset: seqlens {QUICK_SEQLENS}, dims {QUICK_DIMS}, fewer runs "
                        "(--seqlens/--dims still override)")
    p.add_argument("--seqlens", type=int_list, default=None,
                   help=f"comma list of seqlens (default {','.join(map(str, DEFAULT_SEQLENS))})")
    p.add_argument("--dims", type=int_list, default=None,
                   help=f"comma list of head dims (default {','.join(map(str, DEFAULT_DIMS))})")
    p.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    p.add_argument("--backends", type=backend_list, default=list(BACKENDS),
                   help="comma list of SDPA backends to time: flash, cudnn")
    p.add_argument("--tokens", type=int, default=16384, help="total tokens: batch = tokens / seqlen")
    p.add_argument("--hidden", type=int, default=2048, help="hidden size: heads = hidden / head_dim")
    p.add_argument("--head-dim-v", type=int, default=None,
                   help="V's (and O's) head dim where it differs from Q's and K's (--dims)")
    p.add_argument("--no-bwd", action="store_true", help="time the forward only")
    p.add_argument("--no-ceilings", action="store_true", help="skip the GEMM and copy ceilings")
    p.add_argument("--no-attention", action="store_true", help="measure the ceilings only")
    p.add_argument("--gemm-size", type=int, default=8192, help="M = N = K of the ceiling GEMMs")
    p.add_argument("--copy-mib", type=int, default=1024, help="bytes copied by the copy ceiling, MiB")
    add_timing_args(p, warmup=3, min_reps=30, target_ms=250.0)
    p.add_argument("--sustained", type=int, default=0, metavar="N",
                   help="also run N back-to-back calls per shape, backend and kind after its cold "
                        "timing, reporting the mean of the last half with SM clock and power (0: off)")
    p.add_argument("--sustained-warmup", type=int, default=20, help="untimed calls before a sustained run")
    p.add_argument("--sample-ms", type=int, default=100, help="clock/power sampling period")
    add_run_args(p, 230.0, "stop starting new attention shapes after this many seconds (wall "
                           "clock); skipped shapes are listed under 'skipped' in the JSON")
    args = p.parse_args(argv)
    if args.sustained < 0 or (args.sustained and args.sustained < 4):
        p.error("--sustained needs N >= 4 (0: off)")
    if args.quick:
        args.seqlens = args.seqlens or QUICK_SEQLENS
        args.dims = args.dims or QUICK_DIMS
        args.target_ms = min(args.target_ms, 100.0)
        args.min_reps = min(args.min_reps, 20)
    args.seqlens = args.seqlens or DEFAULT_SEQLENS
    args.dims = args.dims or DEFAULT_DIMS
    return finish_run_args(p, args, "compare_torch")


def shapes(args):
    """The attention shapes, in the order they are measured."""
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    out = []
    for d in args.dims:
        heads = args.hidden // d
        if heads < 1 or args.hidden % d:
            print(f"note: skipping d={d}: hidden {args.hidden} is not a multiple of it",
                  file=sys.stderr)
            continue
        for s in args.seqlens:
            batch = max(1, args.tokens // s)
            for causal in causals:
                shp = dict(d=d, seqlen=s, batch=batch, heads=heads, causal=causal)
                if args.head_dim_v is not None:
                    shp["dv"] = args.head_dim_v
                out.append(shp)
    return out


# ----------------------------------------------------------------------------- output

def spread_pct(row, prefix):
    med = row.get(prefix + "ms")
    if not med or prefix + "ms_p90" not in row:  # a sustained row has one mean
        return None
    return 100.0 * (row[prefix + "ms_p90"] - row[prefix + "ms_p10"]) / med


def print_table(doc, file=None):
    p = lambda *a: print(*a, file=file or sys.stdout)
    p(f"\n{doc['device']}  torch {doc.get('torch')}  CUDA {doc.get('cuda')}  "
      f"cuDNN {doc.get('cudnn')}  commit {doc['commit']}")
    for r in doc["rows"]:
        if r["impl"] in ("cublas-gemm", "copy"):
            what = r["impl"] + " " + r["dtype"] + (" fast_accum" if r.get("fast_accum") else "")
            if "error" in r and "ms" not in r:
                p(f"  {what:<28} error: {r['error'][:100]}")
            elif r["impl"] == "copy":
                p(f"  {what:<28} {r['gbps']:8.1f} GB/s   ({r['ms']:.3f} ms, {r['bytes'] >> 20} MiB)")
            else:
                p(f"  {what:<28} {r['tflops']:8.1f} TFLOP/s ({r['ms']:.3f} ms, {r['m']}^3)")
    hdr = (f"{'d':>4} {'seqlen':>6} {'b':>3} {'h':>3} {'causal':>6} {'impl':<12}"
           f"{'fwd ms':>9} {'fwd TF':>7} {'±%':>5}{'bwd ms':>9} {'bwd TF':>7} {'±%':>5}  note")
    p("\n" + hdr)
    p("-" * len(hdr))
    for r in doc["rows"]:
        if "seqlen_q" not in r:
            continue
        sf, sb = spread_pct(r, "fwd_"), spread_pct(r, "bwd_")
        note = r.get("error", "")[:60]
        if r.get("sustained"):
            note = (f"sustained x{r['reps']}, SM {r.get('sm_clock_mhz_median', '-')} MHz, "
                    f"{r.get('power_w_median', '-')} W " + note)
        if "max_abs_diff_vs_flash" in r:
            note = (note + " " if note else "") + f"|Δ flash| {r['max_abs_diff_vs_flash']:.3g}"
        p(f"{r['d']:>4} {r['seqlen_q']:>6} {r['batch']:>3} {r['heads']:>3} "
          f"{'yes' if r['causal'] else 'no':>6} {r['impl'].replace('torch-', ''):<12}"
          f"{fmt(r.get('fwd_ms'), 3):>9} {fmt(r.get('fwd_tflops')):>7} {fmt(sf):>5}"
          f"{fmt(r.get('bwd_ms'), 3):>9} {fmt(r.get('bwd_tflops')):>7} {fmt(sb):>5}  {note}")
    p("(±% = (p90 - p10) / median of the timed runs)")


# ----------------------------------------------------------------------------- main

def main(argv=None):
    args = parse_args(argv)
    todo = [] if args.no_attention else shapes(args)
    if args.dry_run:
        for shp in todo:
            f = attn_flops_fwd(shp["batch"], shp["heads"], shp["seqlen"], shp["seqlen"], shp["d"],
                               shp["causal"], shp.get("dv"))
            print(f"d={shp['d']:<4} seqlen={shp['seqlen']:<6} batch={shp['batch']:<3} "
                  f"heads={shp['heads']:<3} causal={str(shp['causal']):<5} "
                  f"fwd {f / 1e9:9.1f} GFLOP  backends {','.join(args.backends)}")
        print(f"{len(todo)} shapes x {len(args.backends)} backends; ceilings: "
              f"{'no' if args.no_ceilings else 'yes'}; out: {args.out}")
        return 0

    t_start = time.time()
    try:
        import torch
    except ImportError as e:
        print(f"compare_torch.py: cannot import torch ({e}); this script runs on the GPU machine",
              file=sys.stderr)
        return 1
    if not torch.cuda.is_available() or torch.cuda.device_count() <= args.device:
        print("compare_torch.py: no CUDA GPU available (torch.cuda.is_available() is "
              f"{torch.cuda.is_available()}, device_count {torch.cuda.device_count()}); "
              "nothing measured", file=sys.stderr)
        return 1
    torch.cuda.set_device(args.device)
    torch.manual_seed(args.seed)

    name = torch.cuda.get_device_name(args.device)
    drv = driver_version()
    cap = torch.cuda.get_device_capability(args.device)
    try:
        cudnn = torch.backends.cudnn.version()
    except Exception:  # noqa: BLE001
        cudnn = None
    now = datetime.now(timezone.utc)
    doc = {
        "date": now.strftime("%Y-%m-%d"),
        "timestamp": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "device": name + (f" (driver {drv})" if drv else ""),
        "commit": args.commit,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": cudnn,
        "compute_capability": f"{cap[0]}.{cap[1]}",
        "method": ("CUDA events, warm-up, median of >= %d runs; fwd = training forward; "
                   "bwd = torch.autograd.grad(out, (q,k,v), dout, retain_graph=True) only; "
                   "fwd FLOPs 2*b*s*s*h*(d+d_v) (/2 causal), bwd 2.5x fwd; inputs N(0,1) "
                   "(b,s,h,d) transposed to SDPA's (b,h,s,d)" % args.min_reps),
        "rows": [],
    }
    print(f"compare_torch: {doc['device']}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"cuDNN {cudnn}; {len(todo)} shapes x {args.backends}; writing {args.out}", flush=True)
    sampler = GpuSampler(args.device, args.sample_ms)
    bench = Bench(torch, args, sampler)
    if bench.sleep is None:
        print("note: torch.cuda._sleep is missing; small shapes may include launch gaps",
              file=sys.stderr)

    rc = 0
    try:
        if args.sustained:
            sampler.start()
            if sampler.source is None:
                print("note: neither pynvml nor nvidia-smi: the sustained rows carry no clocks",
                      file=sys.stderr)
        if not args.no_ceilings:
            for fn in (bench.gemm_bf16, lambda: bench.gemm_fp8(True), lambda: bench.gemm_fp8(False),
                       bench.copy):
                row = fn()
                doc["rows"].append(row)
                val = row.get("tflops", row.get("gbps"))
                print(f"  {row['impl']} {row['dtype']}: {val if val is not None else row.get('error')}",
                      flush=True)
                bench.check_context()
                torch.cuda.empty_cache()
            write_json(args.out, doc)
        skipped = []
        for n, shp in enumerate(todo):
            if time.time() - t_start > args.budget_s:
                skipped.append(shp)
                continue
            rows = bench.attention_shape(shp, args.backends)
            doc["rows"].extend(rows)
            write_json(args.out, doc)
            print(f"  [{n + 1}/{len(todo)}] d={shp['d']} s={shp['seqlen']} causal={shp['causal']}: "
                  + "  ".join(f"{r['impl']} {fmt(r.get('fwd_tflops'))}/{fmt(r.get('bwd_tflops'))}"
                              + (" (error)" if "error" in r else "") for r in rows), flush=True)
        if skipped:
            doc["skipped"] = skipped
            print(f"warning: time budget of {args.budget_s:.0f} s spent; {len(skipped)} shapes "
                  "skipped (listed under 'skipped')", file=sys.stderr)
            rc = 2
    except FatalCuda as e:
        doc["fatal"] = str(e)
        print(f"compare_torch.py: CUDA context lost, stopping: {e}", file=sys.stderr)
        rc = 3
    except KeyboardInterrupt:
        doc["fatal"] = "interrupted"
        rc = 130
    finally:
        sampler.stop()
    doc["elapsed_s"] = round(time.time() - t_start, 1)
    write_json(args.out, doc)
    print_table(doc)
    print(f"\nwrote {args.out} ({len(doc['rows'])} rows, {doc['elapsed_s']} s)")
    return rc


if __name__ == "__main__":
    sys.exit(main())
