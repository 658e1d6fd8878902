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
    loop ahead of the GPU: the times are GPU times, not launch overhead.
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
import logging
import math
import os
import subprocess
import sys
import tempfile
import time
import warnings
from datetime import datetime, timezone

# The dense peer script's helpers (it sits beside this one, here and in the device bundle).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare_torch import (  # noqa: E402
    add_output_args,
    add_timing_args,
    finish_run_args,
    driver_version,
    fmt,
    int_list,
    percentile,
    short_error,
    summarize,
    write_json,
)

PEERS = {
    "torch-flash-varlen": "aten._flash_attention_forward/_flash_attention_backward with cu_seqlens "
                          "(FA2 varlen; the kernels of torch.nn.attention.varlen.varlen_attn)",
    "torch-flash-njt": "F.scaled_dot_product_attention on jagged NJT (B,H,j,D), sdpa_kernel(FLASH_ATTENTION)",
    "torch-cudnn-varlen": "aten._cudnn_attention_forward/_cudnn_attention_backward with cu_seqlens",
    "torch-cudnn-njt": "F.scaled_dot_product_attention on jagged NJT (B,H,j,D), sdpa_kernel(CUDNN_ATTENTION), "
                       "TORCH_CUDNN_SDPA_NESTED_TENSOR_ENABLED=1",
    "cudnn-varlen": "cuDNN frontend pygraph.sdpa/sdpa_backward, THD ragged offsets + padding mask",
    "torch-sdpa-loop": "one dense F.scaled_dot_product_attention call per sequence (default backend)",
}
# Safest first: a peer that takes the process down (without isolation) costs only the ones after it.
DEFAULT_PEERS = ["torch-flash-varlen", "torch-flash-njt", "torch-cudnn-varlen", "torch-cudnn-njt",
                 "cudnn-varlen"]
AUTOGRAD_BWD_NOTE = ("bwd = torch.autograd.grad(out, (q,k,v), dout, retain_graph=True) on a graph "
                     "built once by one forward (backward only, no forward)")


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


# ----------------------------------------------------------------------------- the mixes

class MixesError(Exception):
    pass


def attn_flops_fwd_varlen(lengths, heads, d, causal):
    f = sum(4.0 * s * s * heads * d for s in lengths)
    return f / 2 if causal else f


def load_mixes(path, dims=None, mix_names=None):
    """Read and check the mixes file; returns (info, shapes) in measuring order (mix, then d)."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise MixesError(f"cannot read mixes file {path}: {e}")
    if not isinstance(doc, dict) or not isinstance(doc.get("mixes"), list) or not doc["mixes"]:
        raise MixesError(f"{path}: expected an object with a non-empty 'mixes' list")
    hidden = doc.get("hidden", 2048)
    causal = doc.get("causal", True)
    file_dims = doc.get("head_dims", [64, 128])
    if not isinstance(hidden, int) or isinstance(hidden, bool) or hidden <= 0:
        raise MixesError(f"{path}: 'hidden' must be a positive integer, got {hidden!r}")
    if not isinstance(causal, bool):
        raise MixesError(f"{path}: 'causal' must be true or false, got {causal!r}")
    if (not isinstance(file_dims, list) or not file_dims
            or any(not isinstance(x, int) or isinstance(x, bool) or x <= 0 for x in file_dims)):
        raise MixesError(f"{path}: 'head_dims' must be a list of positive integers, got {file_dims!r}")
    mixes = []
    for i, m in enumerate(doc["mixes"]):
        if not isinstance(m, dict):
            raise MixesError(f"{path}: mixes[{i}] is not an object")
        name, lengths = m.get("name"), m.get("lengths")
        if not isinstance(name, str) or not name:
            raise MixesError(f"{path}: mixes[{i}] has no name")
        if (not isinstance(lengths, list) or not lengths
                or any(not isinstance(x, int) or isinstance(x, bool) or x <= 0 for x in lengths)):
            raise MixesError(f"{path}: mix {name!r}: 'lengths' must be a non-empty list of positive integers")
        mixes.append((name, lengths))
    names = [n for n, _ in mixes]
    if len(set(names)) != len(names):
        raise MixesError(f"{path}: mix names repeat: {names}")
    if mix_names:
        unknown = [n for n in mix_names if n not in names]
        if unknown:
            raise MixesError(f"--mix-names {', '.join(unknown)} not in {path} (has {', '.join(names)})")
        mixes = [m for m in mixes if m[0] in mix_names]
    shapes = []
    for name, lengths in mixes:
        for d in (dims or file_dims):
            if hidden % d:
                print(f"note: skipping d={d}: hidden {hidden} is not a multiple of it", file=sys.stderr)
                continue
            heads = hidden // d
            shapes.append(dict(
                mix=name, d=d, heads=heads, heads_kv=heads, batch=len(lengths),
                total_tokens=sum(lengths), max_seqlen=max(lengths), causal=causal,
                lengths=list(lengths),
                flops_fwd=attn_flops_fwd_varlen(lengths, heads, d, causal)))
    info = dict(mixes_file=os.path.abspath(path), hidden=hidden, causal=causal,
                head_dims=dims or file_dims,
                mixes=[dict(name=n, batch=len(l), total_tokens=sum(l), max_seqlen=max(l),
                            min_seqlen=min(l)) for n, l in mixes])
    return info, shapes


def base_row(impl, shp):
    return dict(impl=impl, varlen=True, mix=shp["mix"], d=shp["d"], heads=shp["heads"],
                heads_kv=shp["heads_kv"], batch=shp["batch"], total_tokens=shp["total_tokens"],
                max_seqlen=shp["max_seqlen"], causal=shp["causal"], dtype="bf16",
                fwd_ms=None, fwd_tflops=None, bwd_ms=None, bwd_tflops=None,
                max_abs_err=None, bwd_max_abs_err=None, note=PEERS[impl],
                flops_fwd=shp["flops_fwd"])


def error_row(impl, shp, error):
    row = base_row(impl, shp)
    row["error"] = error
    return row


# ----------------------------------------------------------------------------- statistics

def tflops(flops, ms):
    return round(flops / (ms * 1e-3) / 1e12, 2) if ms and ms > 0 else None


def max_finite(errs):
    """max of errs rounded, or NaN if any is NaN/inf (Python's max() would skip a NaN)."""
    if any(not math.isfinite(e) for e in errs):
        return float("nan")
    return round(max(errs), 6) if errs else None


def record_error(row, key, value, what):
    """Store a check result; a non-finite one is stored as null with a note (JSON has no NaN)."""
    if value is not None and not math.isfinite(value):
        add_note(row, f"non-finite values in {what} (first two sequences)")
        value = None
    row[key] = value


def add_note(row, text):
    row["note"] = (row.get("note") + "; " if row.get("note") else "") + text


# ----------------------------------------------------------------------------- environment

def cudnn_frontend_info(timeout_s=120):
    """(version, None) of the cuDNN frontend Python package, or (None, why it does not import).
    Asked in a child process, so that a crashing import cannot end this run."""
    code = ("import cudnn\nv = getattr(cudnn, '__version__', '?')\ntry:\n"
            "    v += ' (backend %s)' % cudnn.backend_version()\nexcept Exception:\n    pass\nprint(v)\n")
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=timeout_s)
    except (OSError, subprocess.SubprocessError) as e:
        return None, short_error(e)
    if r.returncode == 0 and r.stdout.strip():
        return r.stdout.strip().splitlines()[-1], None
    return None, " ".join((r.stderr or "").split())[-300:] or f"exit code {r.returncode}"


# ----------------------------------------------------------------------------- the benchmark

class FatalCuda(Exception):
    pass


class LogCapture(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(" ".join(record.getMessage().split()))


class Inputs:
    """Packed inputs of one shape: (T, H, D) views of buffers with spare rows at the end."""

    def __init__(self, torch, dev, shp, seed):
        self.shp = shp
        self.lengths = shp["lengths"]
        self.batch = len(self.lengths)
        self.T = shp["total_tokens"]
        self.H = shp["heads"]
        self.D = shp["d"]
        self.max_s = shp["max_seqlen"]
        self.causal = shp["causal"]
        self.scale = 1.0 / math.sqrt(self.D)
        self.cu_list = [0]
        for s in self.lengths:
            self.cu_list.append(self.cu_list[-1] + s)
        # Spare rows: the cuDNN frontend may bound the ragged token axis by the buffer extent or
        # by max_total_seq_len rounded up to 64; the torch peers see only the first T rows.
        self.T_alloc = (self.T + 63) // 64 * 64 + 64
        torch.manual_seed(seed)
        mk = lambda: torch.randn(self.T_alloc, self.H, self.D, device=dev, dtype=torch.bfloat16)
        self.q_buf, self.k_buf, self.v_buf, self.do_buf = mk(), mk(), mk(), mk()
        self.q, self.k, self.v, self.do = (x[:self.T] for x in
                                           (self.q_buf, self.k_buf, self.v_buf, self.do_buf))
        self.cu = torch.tensor(self.cu_list, dtype=torch.int32, device=dev)


class Impl:
    """A peer set up on one shape: fwd() and bwd() are what is timed."""

    def __init__(self, fwd, out, bwd=None, note=""):
        self.fwd = fwd          # callable, one forward
        self.out = out          # (T, H, D) forward output of the first call (for the check)
        self.bwd = bwd          # callable returning (dq, dk, dv) packed (T, H, D), or None
        self.note = note
        self.late_notes = []    # notes the backward adds once it has run


class Runner:
    def __init__(self, torch, args):
        self.torch = torch
        self.args = args
        self.cpu = args.cpu
        self.dev = torch.device("cpu") if args.cpu else torch.device("cuda", args.device)
        self.sleep = None if args.cpu else getattr(torch.cuda, "_sleep", None)
        self.cycles_per_ms = 2.0e6       # torch.cuda._sleep spins SM clock cycles; ~2 GHz on Hopper
        self.host_ms_per_call = 0.5      # CPU time to enqueue one call; re-estimated per measurement
        self._cudnn_handle = None

    # ------------------------------------------------------------------ timing

    def sync(self):
        if not self.cpu:
            self.torch.cuda.synchronize()

    def _timed_loop(self, fn, reps):
        torch = self.torch
        if self.cpu:
            out = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                out.append((time.perf_counter() - t0) * 1e3)
            return out
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        torch.cuda.synchronize()
        if self.sleep is not None:
            # Head start for the CPU: enough to queue all `reps` calls, so that no launch gap is timed.
            head_ms = min(1000.0, max(20.0, 1.5 * reps * self.host_ms_per_call))
            self.sleep(int(head_ms * self.cycles_per_ms))
        t0 = time.perf_counter()
        for i in range(reps):
            starts[i].record()
            fn()
            ends[i].record()
        host_ms = (time.perf_counter() - t0) * 1e3 / reps
        torch.cuda.synchronize()
        self.host_ms_per_call = max(host_ms, 0.05)
        return [s.elapsed_time(e) for s, e in zip(starts, ends)]

    def measure(self, fn):
        """Warm up, estimate the time of one call, then time enough calls; returns ms list."""
        a = self.args
        for _ in range(max(1, a.warmup)):
            fn()
        self.sync()
        self.host_ms_per_call = 0.5
        est = sorted(self._timed_loop(fn, 3))[1]
        reps = int(a.target_ms / max(est, 1e-3))
        reps = max(a.min_reps, min(a.max_reps, reps))
        return self._timed_loop(fn, reps)

    def check_context(self):
        """After an error, make sure the CUDA context still works; a sticky error is fatal."""
        if self.cpu:
            return
        try:
            self.torch.cuda.synchronize()
            self.torch.ones(1, device=self.dev).add_(1).item()
        except Exception as e:  # noqa: BLE001
            raise FatalCuda(short_error(e)) from e

    def free(self):
        if not self.cpu:
            try:
                self.torch.cuda.synchronize()
                self.torch.cuda.empty_cache()
            except Exception:  # noqa: BLE001
                pass

    # ------------------------------------------------------------------ reference check

    def reference(self, inp, with_grad):
        """float32 SDPA on the first two sequences: list of (start, end, O, (dQ, dK, dV) or None),
        tensors (s, H, D)."""
        torch = self.torch
        F = torch.nn.functional
        res = []
        for i in range(min(2, inp.batch)):
            a, b = inp.cu_list[i], inp.cu_list[i + 1]
            s = b - a
            bhsd = lambda x: x[a:b].float().permute(1, 0, 2).unsqueeze(0)  # noqa: E731
            q, k, v, do = bhsd(inp.q), bhsd(inp.k), bhsd(inp.v), bhsd(inp.do)
            # Head chunks bound the memory should SDPA fall back to its math backend (s*s scores).
            chunk = max(1, min(inp.H, (1 << 30) // (s * s * 4)))
            outs, grads = [], []
            for h0 in range(0, inp.H, chunk):
                hs = slice(h0, h0 + chunk)
                qc, kc, vc = (x[:, hs].contiguous().requires_grad_(with_grad) for x in (q, k, v))
                with torch.set_grad_enabled(with_grad):
                    o = F.scaled_dot_product_attention(qc, kc, vc, is_causal=inp.causal,
                                                       scale=inp.scale)
                    if with_grad:
                        grads.append(torch.autograd.grad(o, (qc, kc, vc), do[:, hs].contiguous()))
                outs.append(o.detach())
            shd = lambda x: x[0].permute(1, 0, 2)  # noqa: E731  (1, H, s, D) -> (s, H, D)
            out = shd(torch.cat(outs, 1))
            g = None
            if with_grad:
                g = tuple(shd(torch.cat([gr[j] for gr in grads], 1)) for j in range(3))
            res.append((a, b, out, g))
        return res

    def fwd_error(self, inp, out):
        """max |O - reference| on the first two sequences; NaN when O has non-finite values there."""
        errs = [float((out[a:b].float() - ref).abs().max())
                for a, b, ref, _ in self.reference(inp, False)]
        return max_finite(errs)

    def bwd_error(self, inp, grads):
        errs = [float((g[a:b].float() - ref).abs().max())
                for a, b, _, refs in self.reference(inp, True) for g, ref in zip(grads, refs)]
        return max_finite(errs)

    # ------------------------------------------------------------------ the peers

    def setup(self, impl, inp):
        return {
            "torch-flash-varlen": self.peer_flash_varlen,
            "torch-cudnn-varlen": self.peer_cudnn_varlen,
            "torch-flash-njt": lambda i: self.peer_njt(i, "FLASH_ATTENTION"),
            "torch-cudnn-njt": lambda i: self.peer_njt(i, "CUDNN_ATTENTION"),
            "cudnn-varlen": self.peer_cudnn_frontend,
            "torch-sdpa-loop": self.peer_sdpa_loop,
        }[impl](inp)

    def peer_flash_varlen(self, inp):
        aten = self.torch.ops.aten
        q, k, v, cu, m = inp.q, inp.k, inp.v, inp.cu, inp.max_s

        def fwd():
            # -> (output, softmax_logsumexp, rng_state, unused, debug_attn_mask)
            return aten._flash_attention_forward(q, k, v, cu, cu, m, m, 0.0, inp.causal, False,
                                                 scale=inp.scale)
        out, lse, rng_state, unused, _ = fwd()

        def bwd():
            return aten._flash_attention_backward(inp.do, q, k, v, out, lse, cu, cu, m, m, 0.0,
                                                  inp.causal, rng_state, unused, scale=inp.scale)
        note = "bwd = aten._flash_attention_backward alone (the forward's LSE)"
        try:
            note += "; " + self.varlen_attn_diff(inp, out)
        except Exception as e:  # noqa: BLE001
            note += "; varlen_attn cross-check failed: " + short_error(e)[:200]
        return Impl(fwd, out, bwd, note)

    def varlen_attn_diff(self, inp, out):
        """Confirm torch.nn.attention.varlen.varlen_attn gives the same O as the aten op timed."""
        import inspect
        from torch.nn.attention.varlen import varlen_attn
        params = inspect.signature(varlen_attn).parameters
        kw = {}
        if "window_size" in params:         # torch 2.11: causal <=> window_size=(-1, 0)
            kw["window_size"] = (-1, 0) if inp.causal else (-1, -1)
        elif "is_causal" in params:
            kw["is_causal"] = inp.causal
        if "scale" in params:
            kw["scale"] = inp.scale
        o = varlen_attn(inp.q, inp.k, inp.v, inp.cu, inp.cu, inp.max_s, inp.max_s, **kw)
        diff = float((o.float() - out.float()).abs().max())
        return f"varlen_attn({', '.join(f'{k}={v}' for k, v in kw.items())}) vs timed op: max |diff| {diff:.3g}"

    def peer_cudnn_varlen(self, inp):
        aten = self.torch.ops.aten
        q, k, v, cu, m = inp.q, inp.k, inp.v, inp.cu, inp.max_s

        def fwd():
            # -> (output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, philox_seed,
            #     philox_offset, debug_attn_mask)
            return aten._cudnn_attention_forward(q, k, v, None, cu, cu, m, m, True, 0.0,
                                                 inp.causal, False, scale=inp.scale)
        res = fwd()
        out, lse, seed, offset = res[0], res[1], res[6], res[7]

        def bwd():
            return aten._cudnn_attention_backward(inp.do, q, k, v, out, lse, seed, offset, None,
                                                  cu, cu, m, m, 0.0, inp.causal, scale=inp.scale)
        return Impl(fwd, out, bwd, "bwd = aten._cudnn_attention_backward alone (the forward's LSE)")

    def peer_njt(self, inp, backend):
        torch = self.torch
        F = torch.nn.functional
        from torch.nn.attention import SDPBackend, sdpa_kernel
        which = getattr(SDPBackend, backend)
        offsets = inp.cu.to(torch.int64)
        leaves = [x.detach().requires_grad_() for x in (inp.q, inp.k, inp.v)]
        min_s = min(inp.lengths)

        def fwd():
            # max_seqlen/min_seqlen given so that SDPA never syncs on .item() to find them.
            q, k, v = (torch.nested.nested_tensor_from_jagged(
                x, offsets, min_seqlen=min_s, max_seqlen=inp.max_s).transpose(1, 2) for x in leaves)
            with sdpa_kernel([which]):
                o = F.scaled_dot_product_attention(q, k, v, is_causal=inp.causal, scale=inp.scale)
            return o.transpose(1, 2).values()       # (T, H, D)
        # Why SDPA turned a backend down is logged (not warned) on the nested path: keep it.
        capture = LogCapture()
        logger = logging.getLogger("torch.nested._internal.sdpa")
        logger.addHandler(capture)
        try:
            out = fwd()
        except Exception as e:
            if capture.messages:
                e.args = (f"{e} | log: " + " | ".join(dict.fromkeys(capture.messages)),)
            raise
        finally:
            logger.removeHandler(capture)

        def bwd():
            return torch.autograd.grad(out, leaves, inp.do, retain_graph=True)
        return Impl(fwd, out.detach(), bwd, AUTOGRAD_BWD_NOTE)

    def peer_sdpa_loop(self, inp):
        torch = self.torch
        F = torch.nn.functional
        leaves = [x.detach().requires_grad_() for x in (inp.q, inp.k, inp.v)]
        spans = list(zip(inp.cu_list[:-1], inp.cu_list[1:]))

        def fwd():
            outs = []
            for a, b in spans:
                q, k, v = (x[a:b].transpose(0, 1).unsqueeze(0) for x in leaves)
                o = F.scaled_dot_product_attention(q, k, v, is_causal=inp.causal, scale=inp.scale)
                outs.append(o[0].transpose(0, 1))
            return torch.cat(outs, 0)
        out = fwd()

        def bwd():
            return torch.autograd.grad(out, leaves, inp.do, retain_graph=True)
        return Impl(fwd, out.detach(), bwd, AUTOGRAD_BWD_NOTE)

    # ---------------------------------------------------------------- cuDNN frontend

    def peer_cudnn_frontend(self, inp):
        torch = self.torch
        import cudnn
        if self._cudnn_handle is None:
            self._cudnn_handle = cudnn.create_handle()
        handle = self._cudnn_handle
        cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(self.dev).cuda_stream)
        B, H, S, D, T = inp.batch, inp.H, inp.max_s, inp.D, inp.T
        bf16, f32 = cudnn.data_type.BFLOAT16, cudnn.data_type.FLOAT
        # Packed THD tensors declared as (B, H, S_max, D) with BSHD strides; the ragged offsets
        # (in elements, one per sequence start, B + 1 of them) place each sequence.
        dim, stride = [B, H, S, D], [S * H * D, D, H * D, 1]
        backend = cudnn.backend_version()
        off_dtype = torch.int64 if backend >= 90600 else torch.int32
        seq_len = torch.tensor(inp.lengths, dtype=torch.int32, device=self.dev).view(B, 1, 1, 1)
        ragged = (inp.cu.to(torch.int64) * (H * D)).to(off_dtype).view(B + 1, 1, 1, 1)
        o_buf = torch.empty_like(inp.q_buf)
        stats = torch.empty(B, H, S, 1, dtype=torch.float32, device=self.dev)
        T64 = (T + 63) // 64 * 64
        fwd_doc, bwd_doc = fe_doc(cudnn, "sdpa"), fe_doc(cudnn, "sdpa_backward")
        modern_mask = "diagonal_band_right_bound" in fwd_doc or not fwd_doc

        def causal_kw(style):
            if not inp.causal:
                return {}
            if style == "band":   # the preferred form: TOP_LEFT diagonal, right bound 0
                return dict(diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT,
                            diagonal_band_right_bound=0)
            return dict(use_causal_mask=True)   # the deprecated form, for old frontends

        def tensors(g, names):
            ts = {n: g.tensor(name=n, dim=dim, stride=stride, data_type=bf16) for n in names}
            offs = {n: g.tensor_like(ragged, name=f"ragged_{n}") for n in ("q", "k", "v", "o")}
            sq, skv = g.tensor_like(seq_len, name="seq_len_q"), g.tensor_like(seq_len, name="seq_len_kv")
            return ts, offs, sq, skv

        def build(g):
            g.validate()
            g.build_operation_graph()
            g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
            g.check_support()
            g.build_plans()
            return torch.empty(max(1, g.get_workspace_size()), device=self.dev, dtype=torch.uint8)

        def engine(g):
            # frontend >= 1.3x: a python engine serves the plan, or None for the cuDNN backend
            if not hasattr(type(g), "selected_engine"):
                return ""
            try:
                e = g.selected_engine
                return f"engine {getattr(e, 'name', e) if e is not None else 'cuDNN backend'}"
            except Exception as ex:  # noqa: BLE001
                return f"engine unknown ({short_error(ex)[:80]})"

        # ---- forward: try the modern spelling first, then older ones; note which one ran
        attempts = []
        for style in (["band", "flag"] if modern_mask else ["flag"]):
            for total in ([True, False] if "max_total_seq_len_q" in fwd_doc else [False]):
                attempts.append((style, total))
        fails, fwd_graph = [], None
        for style, total in attempts:
            try:
                g = cudnn.pygraph(io_data_type=bf16, intermediate_data_type=f32,
                                  compute_data_type=f32, handle=handle)
                ts, offs, sq, skv = tensors(g, ("q", "k", "v"))
                for n in ("q", "k", "v"):
                    ts[n].set_ragged_offset(offs[n])
                kw = dict(name="sdpa", q=ts["q"], k=ts["k"], v=ts["v"], attn_scale=inp.scale,
                          use_padding_mask=True, seq_len_q=sq, seq_len_kv=skv)
                if "generate_stats" in fwd_doc or not fwd_doc:
                    kw["generate_stats"] = True
                else:
                    kw["is_inference"] = False
                if total:
                    kw.update(max_total_seq_len_q=T, max_total_seq_len_kv=T)
                kw.update(causal_kw(style))
                o, st = g.sdpa(**kw)
                o.set_output(True).set_dim(dim).set_stride(stride)
                o.set_ragged_offset(offs["o"])
                st.set_output(True).set_data_type(f32)
                ws = build(g)
                pack = {ts["q"]: inp.q_buf, ts["k"]: inp.k_buf, ts["v"]: inp.v_buf, o: o_buf,
                        st: stats, sq: seq_len, skv: seq_len}
                pack.update({offs[n]: ragged for n in offs})
                g.execute(pack, ws, handle=handle)
                torch.cuda.synchronize()
                fwd_graph = (g, pack, ws)
                break
            except Exception as e:  # noqa: BLE001
                fails.append(f"[mask={style}, max_total={total}] {short_error(e)[:300]}")
                self.check_context()
        if fwd_graph is None:
            raise RuntimeError("cudnn frontend forward: " + " || ".join(fails))
        fg, fpack, fws = fwd_graph
        note = (f"cudnn frontend {getattr(cudnn, '__version__', '?')}, backend {backend}; "
                f"causal mask as {'diagonal band (TOP_LEFT, right bound 0)' if style == 'band' else 'use_causal_mask'}"
                f"{', fwd max_total_seq_len=T' if total else ''}; offsets {str(off_dtype)[6:]}")
        if engine(fg):
            note += f"; fwd {engine(fg)}"
        if fails:
            note += "; earlier fwd attempts failed: " + " || ".join(fails)

        def fwd():
            fg.execute(fpack, fws, handle=handle)

        # ---- backward graph, built lazily (only when the backward is measured)
        def make_bwd():
            dq, dk, dv = (torch.empty_like(inp.q_buf) for _ in range(3))
            g = cudnn.pygraph(io_data_type=bf16, intermediate_data_type=f32,
                              compute_data_type=f32, handle=handle)
            ts, offs, sq, skv = tensors(g, ("q", "k", "v", "o", "dO"))
            for n, off in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "o"), ("dO", "o")):
                ts[n].set_ragged_offset(offs[off])
            st = g.tensor_like(stats, name="stats")
            kw = dict(name="sdpa_backward", q=ts["q"], k=ts["k"], v=ts["v"], o=ts["o"],
                      dO=ts["dO"], stats=st, attn_scale=inp.scale, use_padding_mask=True,
                      seq_len_q=sq, seq_len_kv=skv)
            if "max_total_seq_len_q" in bwd_doc or not bwd_doc:
                kw.update(max_total_seq_len_q=T64, max_total_seq_len_kv=T64)
            kw.update(causal_kw(style))
            gq, gk, gv = g.sdpa_backward(**kw)
            for t, off in ((gq, "q"), (gk, "k"), (gv, "v")):
                t.set_output(True).set_dim(dim).set_stride(stride)
                t.set_ragged_offset(offs[off])
            ws = build(g)
            if engine(g):
                impl.late_notes.append(f"bwd {engine(g)}")
            pack = {ts["q"]: inp.q_buf, ts["k"]: inp.k_buf, ts["v"]: inp.v_buf, ts["o"]: o_buf,
                    ts["dO"]: inp.do_buf, st: stats, gq: dq, gk: dk, gv: dv, sq: seq_len,
                    skv: seq_len}
            pack.update({offs[n]: ragged for n in offs})

            def bwd():
                g.execute(pack, ws, handle=handle)
                return dq[:T], dk[:T], dv[:T]
            return bwd

        state = {}

        def bwd():
            if "fn" not in state:
                state["fn"] = make_bwd()
            return state["fn"]()
        impl = Impl(fwd, o_buf[:T], bwd, note)
        return impl

    # ------------------------------------------------------------------ one row

    def run(self, impl_name, shp):
        row = base_row(impl_name, shp)
        inp = impl = None
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    inp = Inputs(self.torch, self.dev, shp, self.args.seed)
                    impl = self.setup(impl_name, inp)
                    add_note(row, impl.note)
                    t = self.measure(impl.fwd)
                    row.update(summarize(t, "fwd_"))
                    row["fwd_tflops"] = tflops(shp["flops_fwd"], row["fwd_ms"])
                except Exception as e:  # noqa: BLE001 -- a failing peer is recorded, not fatal
                    row["error"] = short_error(e, caught)
                    self.check_context()
                    return row
            try:
                record_error(row, "max_abs_err", self.fwd_error(inp, impl.out), "O")
            except Exception as e:  # noqa: BLE001
                add_note(row, "fwd check failed: " + short_error(e)[:200])
                self.check_context()
            if self.args.no_bwd or impl.bwd is None:
                return row
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    grads = impl.bwd()
                    self.sync()
                    try:
                        record_error(row, "bwd_max_abs_err", self.bwd_error(inp, grads), "dQ/dK/dV")
                    except Exception as e:  # noqa: BLE001
                        add_note(row, "bwd check failed: " + short_error(e)[:200])
                        self.check_context()
                    del grads
                    t = self.measure(impl.bwd)
                    row.update(summarize(t, "bwd_"))
                    row["bwd_tflops"] = tflops(2.5 * shp["flops_fwd"], row["bwd_ms"])
                except Exception as e:  # noqa: BLE001
                    row["error"] = "bwd: " + short_error(e, caught)
                    self.check_context()
            for n in impl.late_notes:
                add_note(row, n)
            return row
        finally:
            del impl, inp
            self.free()


# ----------------------------------------------------------------------------- cuDNN frontend helpers

def fe_doc(cudnn, op):
    """The docstrings of the frontend's `op` (pybind signature in classic and 1.3x packages);
    used to pick the keyword spelling this version understands. '' when none is found."""
    owners = [cudnn.pygraph]
    for mod in ("_pybind_module", "_compiled_module"):
        m = getattr(cudnn, mod, None)
        for cls in ("backend_graph", "pygraph"):
            c = getattr(m, cls, None) if m is not None else None
            if c is not None:
                owners.append(c)
    docs = []
    for o in owners:
        d = getattr(getattr(o, op, None), "__doc__", None) or ""
        if d and "generic kwarg capture" not in d:
            docs.append(d)
    return "\n".join(docs)


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
