"""What compare_torch.py and varlen_peers.py share: arguments, statistics, errors, JSON output."""

import argparse
import json
import math
import os
import re
import subprocess
import sys


# ----------------------------------------------------------------------------- arguments

def cudnn_frontend(torch):
    """cuDNN's frontend bound to the libcudnn torch loads (loaded first, so that the frontend takes
    that same library): (the `cudnn` module, a handle, its version string)."""
    torch.backends.cudnn.version()
    import cudnn
    version = (f"cudnn-frontend {getattr(cudnn, '__version__', '?')}, "
               f"cuDNN backend {cudnn.backend_version()}")
    return cudnn, cudnn.create_handle(), version


def int_list(text):
    try:
        vals = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not vals or any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
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
    p.add_argument("--cool-ms", type=float, default=20.0,
                   help="the shortest rest (a one-thread spin on the stream) before each timed loop")


def add_run_args(p, budget_s, budget_help, device_help="CUDA device index"):
    """--budget-s, --device, --seed and --dry-run, as every peer script takes them."""
    p.add_argument("--budget-s", type=float, default=budget_s, help=budget_help)
    p.add_argument("--device", type=int, default=0, help=device_help)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dry-run", action="store_true",
                   help="print what would run and exit (no GPU, torch or jax needed)")


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


# ----------------------------------------------------------------------------- timing

def head_ms(calls, host_ms_per_call, cool_ms):
    """The spin (torch.cuda._sleep) ahead of a timed loop of `calls` calls: long enough for the
    host to queue them all (1.5 x their enqueue time), at least `cool_ms` of rest, at most a
    second. examples/common/mod.rs's `head_ms` is the same for our rows."""
    return min(1000.0, max(cool_ms, 1.5 * calls * host_ms_per_call))


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

