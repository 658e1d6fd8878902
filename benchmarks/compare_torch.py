#!/usr/bin/env python3
"""Measure the peers of flashattn on one GPU: torch SDPA (FLASH and CUDNN backends) on the
headline shapes of docs/ARCHITECTURE.md, plus the ceilings (bf16 and FP8 GEMM, device copy bandwidth).

Writes the results JSON of docs/ARCHITECTURE.md and prints a compact table.

    python3 benchmarks/compare_torch.py --out $OUT/peers.json --commit $(git rev-parse --short HEAD)
    python3 benchmarks/compare_torch.py --quick
    python3 benchmarks/compare_torch.py --seqlens 2048,8192 --dims 128 --causal yes
    python3 benchmarks/compare_torch.py --dry-run        # list the shapes; needs no torch, no GPU

Needs python >= 3.9, torch with CUDA; stdlib + torch only. torch is imported after the
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
    queue the whole loop ahead of the GPU: the times are then GPU times, not launch overhead.
    Input sets are rotated only when one set fits in L2 (it never does at the headline shapes).
  * forward: the training forward (inputs require grad, autograd records; this forward also
    writes the log-sum-exp), as flash-attn's own benchmarks time it.
  * backward: ONLY the backward call, timed as
        torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    on a graph built once by one forward. This is the backward kernel(s) and whatever
    pre/post-processing the backend launches (dO.O row sums, dQ accumulator conversion,
    layout copies), and no forward. autograd.grad (not .backward()) returns fresh gradients,
    so no gradient-accumulation kernel into .grad is timed.
  * a backend that fails on a shape gets a row with an "error" string (forward failure: no
    numbers; backward-only failure: forward numbers kept, error starts with "bwd:").
"""

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
import warnings
from datetime import datetime, timezone

DEFAULT_SEQLENS = [512, 1024, 2048, 4096, 8192, 16384]
DEFAULT_DIMS = [64, 128, 256]
QUICK_SEQLENS = [2048, 8192]
QUICK_DIMS = [64, 128]
BACKENDS = {"flash": "torch-flash", "cudnn": "torch-cudnn"}


# ----------------------------------------------------------------------------- arguments

def int_list(text):
    try:
        vals = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not vals or any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def backend_list(text):
    vals = [x for x in text.replace(" ", "").split(",") if x]
    bad = [x for x in vals if x not in BACKENDS]
    if not vals or bad:
        raise argparse.ArgumentTypeError(
            f"backends are a comma list of {', '.join(BACKENDS)}; got {text!r}")
    return vals


def add_output_args(p, name, per):
    """--out and --commit, as every peer script takes them."""
    p.add_argument("--out", metavar="PATH", default=None,
                   help=f"results JSON path (default: $OUT/{name}.json if $OUT is set, "
                        f"else ./{name}.json); rewritten after every {per}")
    p.add_argument("--commit", default=None,
                   help="commit recorded in the JSON (default: env FLASHATTN_COMMIT, else 'unknown')")


def add_timing_args(p, warmup, min_reps, target_ms):
    """How each measurement is timed, with this script's defaults."""
    p.add_argument("--warmup", type=int, default=warmup, help="untimed calls before timing")
    p.add_argument("--min-reps", type=int, default=min_reps, help="fewest timed runs per measurement")
    p.add_argument("--max-reps", type=int, default=100, help="most timed runs per measurement")
    p.add_argument("--target-ms", type=float, default=target_ms,
                   help="aim for about this much GPU time per measurement (between min and max reps)")


def finish_run_args(p, args, name, quiet=False):
    """Checks the timing arguments and fills --commit and --out from the environment."""
    if args.min_reps < 1 or args.max_reps < args.min_reps:
        p.error("need 1 <= --min-reps <= --max-reps")
    if args.min_reps < 20 and not quiet:
        print(f"note: --min-reps {args.min_reps} is below the 20 runs docs/ARCHITECTURE.md asks for",
              file=sys.stderr)
    if args.commit is None:
        args.commit = os.environ.get("FLASHATTN_COMMIT") or "unknown"
    if args.out is None:
        out_dir = os.environ.get("OUT")
        args.out = os.path.join(out_dir, f"{name}.json") if out_dir else f"{name}.json"
    return args


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
    p.add_argument("--no-bwd", action="store_true", help="time the forward only")
    p.add_argument("--no-ceilings", action="store_true", help="skip the GEMM and copy ceilings")
    p.add_argument("--no-attention", action="store_true", help="measure the ceilings only")
    p.add_argument("--gemm-size", type=int, default=8192, help="M = N = K of the ceiling GEMMs")
    p.add_argument("--copy-mib", type=int, default=1024, help="bytes copied by the copy ceiling, MiB")
    add_timing_args(p, warmup=3, min_reps=30, target_ms=250.0)
    p.add_argument("--budget-s", type=float, default=230.0,
                   help="stop starting new attention shapes after this many seconds (wall clock); "
                        "skipped shapes are listed under 'skipped' in the JSON")
    p.add_argument("--device", type=int, default=0, help="CUDA device index")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dry-run", action="store_true",
                   help="print the shapes that would run and exit (no torch, no GPU needed)")
    args = p.parse_args(argv)
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
                out.append(dict(d=d, seqlen=s, batch=batch, heads=heads, causal=causal))
    return out


def attn_flops_fwd(batch, heads, sq, sk, d, causal):
    f = 4.0 * batch * sq * sk * heads * d
    return f / 2 if causal else f


# ----------------------------------------------------------------------------- statistics

def percentile(sorted_xs, p):
    if not sorted_xs:
        return float("nan")
    pos = (len(sorted_xs) - 1) * p / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def summarize(times_ms, prefix):
    xs = sorted(times_ms)
    r = lambda x: round(x, 5)
    return {
        f"{prefix}ms": r(percentile(xs, 50)),
        f"{prefix}ms_min": r(xs[0]),
        f"{prefix}ms_p10": r(percentile(xs, 10)),
        f"{prefix}ms_p90": r(percentile(xs, 90)),
        f"{prefix}ms_max": r(xs[-1]),
        f"{prefix}reps": len(xs),
    }


def short_error(exc, caught_warnings=()):
    msg = f"{type(exc).__name__}: {exc}".strip()
    msg = " ".join(msg.split())
    extra = []
    for w in caught_warnings:
        t = " ".join(str(w.message).split())
        if t and t not in extra:
            extra.append(t)
    if extra:
        msg += " | " + " | ".join(extra[:4])
    return msg[:600]


# ----------------------------------------------------------------------------- environment

def driver_version():
    try:
        with open("/proc/driver/nvidia/version") as f:
            m = re.search(r"Kernel Module\s+(?:for\s+\S+\s+)?([0-9][0-9.]+)", f.read())
            if m:
                return m.group(1)
    except OSError:
        pass
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=15)
        if r.returncode == 0 and r.stdout.strip():
            return r.stdout.strip().splitlines()[0].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return None


# ----------------------------------------------------------------------------- the benchmark

class Bench:
    def __init__(self, torch, args):
        self.torch = torch
        self.args = args
        self.dev = torch.device("cuda", args.device)
        props = torch.cuda.get_device_properties(self.dev)
        self.l2_bytes = int(getattr(props, "L2_cache_size", 0) or 50 * 2**20)
        # torch.cuda._sleep spins for a number of SM clock cycles; ~2 GHz on Hopper.
        self.sleep = getattr(torch.cuda, "_sleep", None)
        self.cycles_per_ms = 2.0e6

    # n_sets copies of the inputs are rotated only when one set would stay in L2.
    def n_sets(self, bytes_per_set):
        if bytes_per_set >= 2 * self.l2_bytes:
            return 1
        return min(4, 1 + math.ceil(2 * self.l2_bytes / max(bytes_per_set, 1)))

    def _timed_loop(self, fn, n_sets, reps):
        torch = self.torch
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        torch.cuda.synchronize()
        if self.sleep is not None:
            # Head start for the CPU: enough to queue `reps` calls of up to ~0.5 ms of CPU each
            # (SDPA dispatch ~0.1 ms, autograd.grad a little more), so no launch gap is timed.
            self.sleep(int(min(200.0, 0.5 * reps) * self.cycles_per_ms))
        for i in range(reps):
            starts[i].record()
            fn(i % n_sets)
            ends[i].record()
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in zip(starts, ends)]

    def measure(self, fn, n_sets=1, warmup=None, min_reps=None, target_ms=None):
        """Warm up, estimate the time of one call, then time enough calls; returns ms list."""
        a = self.args
        warmup = a.warmup if warmup is None else warmup
        min_reps = a.min_reps if min_reps is None else min_reps
        target_ms = a.target_ms if target_ms is None else target_ms
        for i in range(max(1, warmup)):
            fn(i % n_sets)
        self.torch.cuda.synchronize()
        est = sorted(self._timed_loop(fn, n_sets, 3))[1]
        reps = int(target_ms / max(est, 1e-3))
        reps = max(min_reps, min(a.max_reps, reps))
        return self._timed_loop(fn, n_sets, reps)

    # ------------------------------------------------------------------ ceilings

    def gemm_bf16(self):
        torch, n = self.torch, self.args.gemm_size
        row = dict(impl="cublas-gemm", backend="torch.mm", dtype="bf16", m=n, n=n, k=n)
        try:
            a = torch.randn(n, n, device=self.dev, dtype=torch.bfloat16)
            b = torch.randn(n, n, device=self.dev, dtype=torch.bfloat16)
            c = torch.empty(n, n, device=self.dev, dtype=torch.bfloat16)
            # Long warm-up: this is the first work of the run and brings the clocks up.
            t = self.measure(lambda i: torch.mm(a, b, out=c), warmup=20)
            row.update(summarize(t, ""))
            row["tflops"] = round(2.0 * n ** 3 / (row["ms"] * 1e-3) / 1e12, 2)
            if not bool(torch.isfinite(c).all()):
                row["error"] = "non-finite output"
        except Exception as e:  # noqa: BLE001 -- a failing ceiling is recorded, not fatal
            row["error"] = short_error(e)
        return row

    def gemm_fp8(self, fast_accum):
        torch, n = self.torch, self.args.gemm_size
        row = dict(impl="cublas-gemm", backend="torch._scaled_mm", dtype="e4m3", m=n, n=n, k=n,
                   out_dtype="bf16", scaling="tensorwise", fast_accum=fast_accum)
        try:
            if not hasattr(torch, "float8_e4m3fn") or not hasattr(torch, "_scaled_mm"):
                raise RuntimeError("this torch has no float8_e4m3fn / _scaled_mm")
            if torch.cuda.get_device_capability(self.dev) < (8, 9):
                raise RuntimeError("FP8 GEMM needs compute capability >= 8.9")
            a = torch.randn(n, n, device=self.dev).to(torch.float8_e4m3fn)           # row-major
            b = torch.randn(n, n, device=self.dev).to(torch.float8_e4m3fn).t()       # col-major
            one = torch.ones((), device=self.dev, dtype=torch.float32)

            def fn(i):
                return torch._scaled_mm(a, b, scale_a=one, scale_b=one,
                                        out_dtype=torch.bfloat16, use_fast_accum=fast_accum)
            out = fn(0)
            t = self.measure(fn)
            row.update(summarize(t, ""))
            row["tflops"] = round(2.0 * n ** 3 / (row["ms"] * 1e-3) / 1e12, 2)
            if not bool(torch.isfinite(out).all()):
                row["error"] = "non-finite output"
        except Exception as e:  # noqa: BLE001
            row["error"] = short_error(e)
        return row

    def copy(self):
        torch = self.torch
        nbytes = self.args.copy_mib * 2**20
        row = dict(impl="copy", backend="torch copy_ (device to device)", dtype="f32",
                   bytes=nbytes, bytes_moved=2 * nbytes)
        try:
            src = torch.randn(nbytes // 4, device=self.dev, dtype=torch.float32)
            dst = torch.empty_like(src)
            t = self.measure(lambda i: dst.copy_(src), warmup=5)
            row.update(summarize(t, ""))
            # Bandwidth counts the bytes read plus the bytes written.
            row["gbps"] = round(2.0 * nbytes / (row["ms"] * 1e-3) / 1e9, 1)
        except Exception as e:  # noqa: BLE001
            row["error"] = short_error(e)
        return row

    # ------------------------------------------------------------------ attention

    def attention_shape(self, shp, backends):
        """All requested backends on one shape; returns their rows."""
        torch = self.torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        which = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
        label = {"flash": "sdpa:FLASH_ATTENTION", "cudnn": "sdpa:CUDNN_ATTENTION"}
        b, s, h, d, causal = shp["batch"], shp["seqlen"], shp["heads"], shp["d"], shp["causal"]
        fwd_flops = attn_flops_fwd(b, h, s, s, d, causal)
        elem = b * s * h * d
        n_sets = self.n_sets(5 * elem * 2)  # q, k, v, dO, O in bf16

        def make():
            t = lambda: torch.randn(b, s, h, d, device=self.dev, dtype=torch.bfloat16)
            q, k, v = (t().requires_grad_() for _ in range(3))
            return q, k, v, t()
        sets = [make() for _ in range(n_sets)]

        def fwd(i):
            q, k, v, _ = sets[i]
            return F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)

        rows, ref_out = [], None
        for name in backends:
            row = dict(impl=BACKENDS[name], backend=label[name], dtype="bf16", d=d,
                       seqlen_q=s, seqlen_k=s, batch=b, heads=h, heads_kv=h, causal=causal,
                       n_input_sets=n_sets)
            with warnings.catch_warnings(record=True) as caught, sdpa_kernel([which[name]]):
                warnings.simplefilter("always")
                # forward
                try:
                    out0 = fwd(0)
                    t = self.measure(fwd, n_sets)
                    row.update(summarize(t, "fwd_"))
                    row["fwd_tflops"] = round(fwd_flops / (row["fwd_ms"] * 1e-3) / 1e12, 2)
                    if not bool(torch.isfinite(out0).all()):
                        row["nonfinite_out"] = True
                    out_ref = out0.detach()
                    if name == "flash":
                        ref_out = out_ref
                    elif ref_out is not None:
                        row["max_abs_diff_vs_flash"] = round(
                            float((out_ref.float() - ref_out.float()).abs().max()), 5)
                    del out0, out_ref
                except Exception as e:  # noqa: BLE001
                    row["error"] = short_error(e, caught)
                    self.check_context()
                    rows.append(row)
                    continue
                # backward: graphs built once, then only autograd.grad is timed (see the top).
                if not self.args.no_bwd:
                    graphs = []
                    try:
                        for i in range(n_sets):
                            q, k, v, do = sets[i]
                            graphs.append((fwd(i), (q, k, v), do.transpose(1, 2)))

                        def bwd(i):
                            out, inputs, dout = graphs[i]
                            return torch.autograd.grad(out, inputs, dout, retain_graph=True)
                        grads = bwd(0)
                        if not all(bool(torch.isfinite(g).all()) for g in grads):
                            row["nonfinite_grad"] = True
                        del grads
                        t = self.measure(bwd, n_sets)
                        row.update(summarize(t, "bwd_"))
                        row["bwd_tflops"] = round(2.5 * fwd_flops / (row["bwd_ms"] * 1e-3) / 1e12, 2)
                    except Exception as e:  # noqa: BLE001
                        row["error"] = "bwd: " + short_error(e, caught)
                        self.check_context()
                    del graphs
            rows.append(row)
        del sets, ref_out
        return rows

    def check_context(self):
        """After an error, make sure the CUDA context still works; a sticky error is fatal."""
        try:
            self.torch.cuda.synchronize()
            self.torch.ones(1, device=self.dev).add_(1).item()
        except Exception as e:  # noqa: BLE001
            raise FatalCuda(short_error(e)) from e


class FatalCuda(Exception):
    pass


# ----------------------------------------------------------------------------- output

def write_json(path, doc):
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def fmt(x, nd=1):
    return "-" if x is None else f"{x:.{nd}f}"


def spread_pct(row, prefix):
    med = row.get(prefix + "ms")
    if not med:
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
                               shp["causal"])
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
                   "fwd FLOPs 4*b*s*s*h*d (/2 causal), bwd 2.5x fwd; inputs N(0,1) "
                   "(b,s,h,d) transposed to SDPA's (b,h,s,d)" % args.min_reps),
        "rows": [],
    }
    print(f"compare_torch: {doc['device']}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"cuDNN {cudnn}; {len(todo)} shapes x {args.backends}; writing {args.out}", flush=True)
    bench = Bench(torch, args)
    if bench.sleep is None:
        print("note: torch.cuda._sleep is missing; small shapes may include launch gaps",
              file=sys.stderr)

    rc = 0
    try:
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
    doc["elapsed_s"] = round(time.time() - t_start, 1)
    write_json(args.out, doc)
    print_table(doc)
    print(f"\nwrote {args.out} ({len(doc['rows'])} rows, {doc['elapsed_s']} s)")
    return rc


if __name__ == "__main__":
    sys.exit(main())
