#!/usr/bin/env python3
"""Measure the packed variable-length ("varlen") attention peers of flashattn on one GPU,
forward and backward, bf16, on the packed batches our Rust varlen benchmark runs.

Reads the mixes file that benchmark writes (--mixes), times every peer on every
(mix, head_dim), writes a results JSON like compare_torch.py's and prints a compact table.

    python3 benchmarks/varlen_peers.py --mixes $OUT/mixes.json --out $OUT/varlen_peers.json \\
        --commit $(git rev-parse --short HEAD)
    python3 benchmarks/varlen_peers.py --mixes mixes.json --dry-run   # list the shapes; no torch, no GPU
    python3 benchmarks/varlen_peers.py --mixes mixes.json --peers torch-flash-varlen,cudnn-varlen --dims 128

Mixes file (written by our benchmark):
    {"mixes": [{"name": "all-2k", "lengths": [2048, ...]}, ...],
     "head_dims": [64, 128], "hidden": 2048, "causal": true}
heads = hidden / head_dim, heads_kv = heads; every sequence has equal query and key lengths.

Peers (--peers). Each runs in its own try/except and, unless --no-isolate, in its own child
process, so that a crash or a lost CUDA context costs only that peer's remaining rows:
  torch-flash-varlen  torch.ops.aten._flash_attention_forward / _flash_attention_backward with
                      cu_seqlens: PyTorch's FlashAttention-2 varlen kernels, the ones that
                      torch.nn.attention.varlen.varlen_attn calls. bwd: the backward op alone.
  torch-flash-njt     F.scaled_dot_product_attention on jagged nested tensors viewed as
                      (B, H, j, D), under sdpa_kernel(FLASH_ATTENTION).
  torch-cudnn-varlen  torch.ops.aten._cudnn_attention_forward / _cudnn_attention_backward with
                      cu_seqlens (PyTorch's cuDNN ragged path). bwd: the backward op alone.
  torch-cudnn-njt     as torch-flash-njt, under sdpa_kernel(CUDNN_ATTENTION); this script sets
                      TORCH_CUDNN_SDPA_NESTED_TENSOR_ENABLED=1, which torch asks for.
  cudnn-varlen        cuDNN SDPA through the cuDNN frontend Python package (import cudnn):
                      pygraph.sdpa / pygraph.sdpa_backward on packed THD tensors with ragged
                      offsets and a padding mask. bwd: the backward graph alone.
  torch-sdpa-loop     (not run unless named) one dense SDPA call per sequence: a naive baseline,
                      and the peer that runs on CPU for the --cpu self-test.

Needs python >= 3.9 and torch with CUDA (the cudnn frontend package for cudnn-varlen);
stdlib + torch otherwise. torch is imported after the arguments are parsed, so --help and
--dry-run work anywhere. --cpu runs everything on the CPU with wall-clock timing: a test of
this script, not a measurement (only torch-sdpa-loop can succeed there).

Method:
  * inputs: q, k, v, dO ~ N(0,1) bf16, packed as (total_tokens, heads, head_dim), seed --seed
    (the same inputs for every peer); softmax scale 1/sqrt(head_dim); cu_seqlens int32.
  * FLOPs: forward = sum over the sequences of 4*s*s*h*d, halved when causal; backward 2.5x.
  * timing as compare_torch.py: CUDA events around each call, after >= --warmup calls; median
    of >= --min-reps timed runs (up to --max-reps, about --target-ms per measurement). Before
    each timed loop the GPU is kept busy with torch.cuda._sleep so that the CPU queues the whole
    loop ahead of the GPU (the times are GPU times, not launch overhead), and at rest for at
    least --cool-ms, as ours are before theirs (peers_common.head_ms).
  * forward: the training forward (the LSE is written; autograd peers' inputs require grad).
  * backward: the explicit backward op or graph (aten and cudnn peers), or for the autograd
    peers (NJT, loop) torch.autograd.grad(out, (q, k, v), dout, retain_graph=True) on a graph
    built once by one forward: the backward alone, no forward in either case.
  * check: the peer's O on the first two sequences against F.scaled_dot_product_attention in
    float32 on the same rows -> max_abs_err; likewise dQ, dK, dV -> bwd_max_abs_err. Recorded,
    not asserted.
  * a peer that fails gets a row with an "error" string (forward failure: no numbers;
    backward-only failure: forward numbers kept, error starts with "bwd:").
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone

# The helpers beside this script (here and in the device bundle).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peers_common import (  # noqa: E402
    add_output_args,
    add_timing_args,
    driver_version,
    finish_run_args,
    fmt,
    int_list,
    short_error,
    write_json,
)
from varlen_peers_cudnn import cudnn_frontend_info  # noqa: E402
from varlen_peers_shapes import DEFAULT_PEERS, PEERS, MixesError, error_row, load_mixes  # noqa: E402
from varlen_peers_torch import FatalCuda, Runner  # noqa: E402


# ----------------------------------------------------------------------------- arguments

def name_list(text):
    vals = [x for x in text.replace(" ", "").split(",") if x]
    if not vals:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
    return vals


def peer_list(text):
    vals = name_list(text)
    bad = [x for x in vals if x not in PEERS]
    if bad:
        raise argparse.ArgumentTypeError(
            f"unknown peer(s) {', '.join(bad)}; peers are {', '.join(PEERS)}")
    return vals


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Time the packed varlen attention peers (torch FA2 varlen, torch cuDNN varlen, "
                    "NJT SDPA, cuDNN frontend) fwd and bwd on the mixes of our varlen benchmark; "
                    "write a results JSON like compare_torch.py's.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--mixes", metavar="PATH", required=True,
                   help="the mixes JSON written by our benchmark")
    add_output_args(p, "varlen_peers", "peer")
    p.add_argument("--peers", type=peer_list, default=list(DEFAULT_PEERS),
                   help="comma list of peers: " + ", ".join(PEERS))
    p.add_argument("--dims", type=int_list, default=None,
                   help="comma list of head dims (default: the mixes file's head_dims)")
    p.add_argument("--mix-names", type=name_list, default=None,
                   help="comma list of mix names to run (default: all)")
    p.add_argument("--no-bwd", action="store_true", help="time the forward only")
    add_timing_args(p, warmup=5, min_reps=20, target_ms=200.0)
    p.add_argument("--budget-s", type=float, default=400.0,
                   help="stop starting new shapes after this many seconds (wall clock, all peers); "
                        "shapes not run get a row with error 'skipped: ...'; a peer's child process "
                        "is killed 90 s after the budget")
    p.add_argument("--device", type=int, default=0, help="CUDA device index")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-isolate", action="store_true",
                   help="run all peers in this process (default: one child process per peer)")
    p.add_argument("--cpu", action="store_true",
                   help="self-test on the CPU with wall-clock timing; numbers mean nothing")
    p.add_argument("--dry-run", action="store_true",
                   help="print the shapes that would run and exit (no torch, no GPU needed)")
    # Internal: a child process runs one peer and writes its rows here.
    p.add_argument("--child-peer", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    if args.child_peer is not None and args.child_peer not in PEERS:
        p.error(f"unknown child peer {args.child_peer!r}")
    return finish_run_args(p, args, "varlen_peers", quiet=args.child_peer is not None)


# ----------------------------------------------------------------------------- output

def print_table(doc, file=None):
    p = lambda *a: print(*a, file=file or sys.stdout)  # noqa: E731
    p(f"\n{doc.get('device')}  torch {doc.get('torch')}  CUDA {doc.get('cuda')}  "
      f"cuDNN {doc.get('cudnn')}  cudnn-frontend {doc.get('cudnn_frontend')}  commit {doc.get('commit')}")
    hdr = (f"{'impl':<19} {'mix':<18} {'d':>4} {'b':>4} {'tokens':>6} {'max_s':>6}"
           f"{'fwd ms':>9} {'fwd TF':>7}{'bwd ms':>9} {'bwd TF':>7} {'err':>8} {'bwd err':>8}  error")
    p("\n" + hdr)
    p("-" * len(hdr))
    for r in doc["rows"]:
        err = r.get("max_abs_err")
        berr = r.get("bwd_max_abs_err")
        p(f"{r['impl']:<19} {r['mix'][:18]:<18} {r['d']:>4} {r['batch']:>4} {r['total_tokens']:>6} "
          f"{r['max_seqlen']:>6}{fmt(r.get('fwd_ms'), 3):>9} {fmt(r.get('fwd_tflops')):>7}"
          f"{fmt(r.get('bwd_ms'), 3):>9} {fmt(r.get('bwd_tflops')):>7} "
          f"{'-' if err is None else f'{err:.2g}':>8} {'-' if berr is None else f'{berr:.2g}':>8}  "
          f"{r.get('error', '')[:70]}")
    p("(TF = TFLOP/s; err = max |O - float32 SDPA| on the first two sequences; bwd err likewise "
      "for dQ, dK, dV)")


# ----------------------------------------------------------------------------- running

def import_torch(args):
    os.environ.setdefault("TORCH_CUDNN_SDPA_NESTED_TENSOR_ENABLED", "1")
    import torch
    if not args.cpu and (not torch.cuda.is_available() or torch.cuda.device_count() <= args.device):
        raise RuntimeError(f"no CUDA GPU available (torch.cuda.is_available() is "
                           f"{torch.cuda.is_available()}, device_count {torch.cuda.device_count()}); "
                           "use --cpu for a self-test")
    if not args.cpu:
        torch.cuda.set_device(args.device)
    return torch


def run_peer(torch, args, peer, shapes, t_start, rows_out, on_row=None):
    """Run one peer on every shape in this process; rows go to rows_out. Returns 0, or 3 when
    the CUDA context was lost (the remaining shapes get error rows)."""
    runner = Runner(torch, args)
    for n, shp in enumerate(shapes):
        if time.time() - t_start > args.budget_s:
            row = error_row(peer, shp, f"skipped: time budget of {args.budget_s:.0f} s spent")
        else:
            try:
                row = runner.run(peer, shp)
            except FatalCuda as e:
                rows_out.append(error_row(peer, shp, "CUDA context lost: " + str(e)))
                for rest in shapes[n + 1:]:
                    rows_out.append(error_row(peer, rest, "not run: CUDA context lost on an earlier shape"))
                if on_row:
                    on_row()
                print(f"varlen_peers: {peer}: CUDA context lost, stopping this peer: {e}", file=sys.stderr)
                return 3
        rows_out.append(row)
        if on_row:
            on_row()
        print(f"  {peer} {shp['mix']} d={shp['d']}: fwd {fmt(row.get('fwd_tflops'))} bwd "
              f"{fmt(row.get('bwd_tflops'))} TFLOP/s" + (f"  ({row['error'][:120]})" if "error" in row else ""),
              flush=True)
    return 0


def child_main(args, shapes, t_start):
    rows = []
    write = lambda: write_json(args.child_out, {"rows": rows})  # noqa: E731
    write()
    try:
        torch = import_torch(args)
    except Exception as e:  # noqa: BLE001
        rows.extend(error_row(args.child_peer, s, "cannot start: " + short_error(e)) for s in shapes)
        write()
        return 1
    rc = run_peer(torch, args, args.child_peer, shapes, t_start, rows, on_row=write)
    write()
    return rc


def run_isolated(args, argv, peer, shapes, t_start):
    """Run one peer in a child process; returns its rows (error rows for shapes it did not finish)."""
    remaining = args.budget_s - (time.time() - t_start)
    fd, child_out = tempfile.mkstemp(prefix=f"varlen_{peer}_", suffix=".json")
    os.close(fd)
    err_f = tempfile.TemporaryFile(mode="w+")
    cmd = [sys.executable, os.path.abspath(__file__)] + list(argv) + [
        "--child-peer", peer, "--child-out", child_out, "--budget-s", f"{max(remaining, 0.0):.1f}"]
    why = None
    try:
        proc = subprocess.run(cmd, stdout=None, stderr=err_f, timeout=max(remaining, 0.0) + 90)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        rc, why = None, "child process timed out and was killed"
    err_f.seek(0)
    err_text = err_f.read()
    err_f.close()
    if err_text.strip():
        sys.stderr.write(f"--- {peer} stderr ---\n{err_text[-4000:]}\n")
    rows = []
    try:
        with open(child_out) as f:
            rows = json.load(f).get("rows", [])
    except (OSError, ValueError):
        pass
    finally:
        try:
            os.remove(child_out)
        except OSError:
            pass
    done = {(r.get("mix"), r.get("d")) for r in rows}
    if why is None and rc not in (0, 1, 3):
        why = f"child process exited with code {rc}"
    tail = " ".join(err_text.split())[-300:]
    for shp in shapes:
        if (shp["mix"], shp["d"]) not in done:
            rows.append(error_row(peer, shp, f"{why or 'child process ended'} before this shape"
                                  + (f"; stderr tail: {tail}" if tail else "")))
    order = {(s["mix"], s["d"]): i for i, s in enumerate(shapes)}
    rows.sort(key=lambda r: order.get((r.get("mix"), r.get("d")), len(order)))
    return rows


def environment(args):
    """The header of the results JSON; never raises."""
    now = datetime.now(timezone.utc)
    doc = {"date": now.strftime("%Y-%m-%d"), "timestamp": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
           "device": None, "commit": args.commit, "torch": None, "cuda": None, "cudnn": None}
    try:
        torch = import_torch(args)
        doc["torch"] = torch.__version__
        doc["cuda"] = torch.version.cuda
        try:
            doc["cudnn"] = torch.backends.cudnn.version()
        except Exception:  # noqa: BLE001
            pass
        if args.cpu:
            doc["device"] = "CPU (--cpu self-test; numbers are not measurements)"
        else:
            drv = driver_version()
            cap = torch.cuda.get_device_capability(args.device)
            doc["device"] = torch.cuda.get_device_name(args.device) + (f" (driver {drv})" if drv else "")
            doc["compute_capability"] = f"{cap[0]}.{cap[1]}"
    except Exception as e:  # noqa: BLE001
        doc["environment_error"] = short_error(e)
    ver, err = cudnn_frontend_info()
    doc["cudnn_frontend"] = ver
    if err:
        doc["cudnn_frontend_error"] = err
    return doc


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    t_start = time.time()
    try:
        info, shapes = load_mixes(args.mixes, args.dims, args.mix_names)
    except MixesError as e:
        print(f"varlen_peers.py: {e}", file=sys.stderr)
        return 2

    if args.child_peer is not None:
        return child_main(args, shapes, t_start)

    if args.dry_run:
        for shp in shapes:
            print(f"mix={shp['mix']:<20} d={shp['d']:<4} heads={shp['heads']:<3} batch={shp['batch']:<4} "
                  f"tokens={shp['total_tokens']:<6} max_seqlen={shp['max_seqlen']:<6} "
                  f"causal={str(shp['causal']):<5} fwd {shp['flops_fwd'] / 1e9:9.1f} GFLOP")
        print(f"{len(shapes)} shapes x {len(args.peers)} peers ({', '.join(args.peers)}); "
              f"out: {args.out}")
        return 0

    doc = environment(args)
    doc.update(info)
    doc["peers"] = list(args.peers)
    doc["method"] = ("CUDA events, >= %d warm-up calls, median of >= %d runs; fwd = training forward; "
                     "bwd = backward op/graph alone, or autograd.grad on a prebuilt graph (see each "
                     "row's note); fwd FLOPs sum 4*s*s*h*d (/2 causal), bwd 2.5x fwd; inputs N(0,1) "
                     "bf16 packed (T,H,D); max_abs_err vs float32 SDPA on the first two sequences"
                     % (args.warmup, args.min_reps))
    doc["rows"] = []
    print(f"varlen_peers: {doc['device']}, torch {doc['torch']}, cuDNN {doc['cudnn']}, "
          f"cudnn-frontend {doc['cudnn_frontend']}; {len(shapes)} shapes x {args.peers}; "
          f"writing {args.out}", flush=True)
    write_json(args.out, doc)

    rc = 0
    try:
        if args.no_isolate:
            try:
                torch = import_torch(args)
            except Exception as e:  # noqa: BLE001
                print(f"varlen_peers.py: cannot start: {short_error(e)}", file=sys.stderr)
                for peer in args.peers:
                    doc["rows"].extend(error_row(peer, s, "cannot start: " + short_error(e)) for s in shapes)
                rc = 1
            else:
                for peer in args.peers:
                    r = run_peer(torch, args, peer, shapes, t_start, doc["rows"],
                                 on_row=lambda: write_json(args.out, doc))
                    if r == 3:
                        rc = 3
                        # The context is gone for every later peer too.
                        for later in args.peers[args.peers.index(peer) + 1:]:
                            doc["rows"].extend(error_row(later, s, "not run: CUDA context lost by an "
                                                         "earlier peer (run without --no-isolate)")
                                               for s in shapes)
                        break
        else:
            for peer in args.peers:
                print(f"[{peer}]", flush=True)
                doc["rows"].extend(run_isolated(args, argv, peer, shapes, t_start))
                write_json(args.out, doc)
    except KeyboardInterrupt:
        doc["fatal"] = "interrupted"
        rc = 130
    if any(r.get("error", "").startswith("skipped:") for r in doc["rows"]):
        print(f"warning: time budget of {args.budget_s:.0f} s spent; some shapes were skipped",
              file=sys.stderr)
        rc = rc or 2
    doc["elapsed_s"] = round(time.time() - t_start, 1)
    write_json(args.out, doc)
    print_table(doc)
    print(f"\nwrote {args.out} ({len(doc['rows'])} rows, {doc['elapsed_s']} s)")
    return rc


if __name__ == "__main__":
    sys.exit(main())
