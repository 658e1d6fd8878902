#!/usr/bin/env python3
"""Two more peers of flashattn on one GPU: FlashAttention-3 (`fa3`, bf16 forward and backward,
from the flash_attn3_jax wheel) and cuDNN's FP8 SDPA forward (`cudnn-fp8`, e4m3 Q/K/V, from
the nvidia-cudnn-frontend wheel), on the headline shapes, cold and sustained.

Writes the results JSON of docs/ARCHITECTURE.md (rows as compare_torch.py writes them) and
prints a compact table.

    python3 benchmarks/peers_fa3_fp8.py --out $OUT/peers_fa3_fp8.json --commit $(git rev-parse --short HEAD)
    python3 benchmarks/peers_fa3_fp8.py --quick --sustained 400
    python3 benchmarks/peers_fa3_fp8.py --peers cudnn-fp8 --fp8-dims 128 --seqlens 8192
    python3 benchmarks/peers_fa3_fp8.py --dry-run    # list the shapes; needs no GPU, torch or jax

Neither peer is installed on the GPU machine: both travel as wheels (benchmarks/README.md has the
install line). jax, torch and the peers are imported after the arguments are parsed, so --help
and --dry-run work anywhere; `fa3` needs jax (not torch), `cudnn-fp8` needs torch.

Method:
  * shapes: total tokens T (default 16384), batch = T / seqlen; hidden H (default 2048),
    heads = H / head_dim; seqlen_q = seqlen_k; heads_kv = heads; softmax scale 1/sqrt(d).
    Inputs N(0,1) in the (batch, seqlen, heads, dim) layout, one set (each of Q, K, V holds
    T·H elements, more than the L2 together at the default T and H).
  * FLOPs: forward 4·b·s²·h·d (halved when causal); backward 2.5× forward.
  * fa3: flash_mha(q, k, v, is_causal=...) under jax.jit. The backward is the vjp function
    built once by jax.vjp under jit (its residuals computed once), then only that function is timed,
    jitted, on a fixed cotangent dO: the backward kernels and whatever they launch, no forward.
    JAX has no CUDA events, so a timed round is `--round-ms` worth of back-to-back calls
    queued by async dispatch, then one jax.block_until_ready; per-call time = round / calls.
    The median over >= --min-reps rounds is reported (the one launch gap per round that the
    wall clock sees is amortised over the round's calls).
  * cudnn-fp8: cudnn.pygraph.sdpa_fp8 with per-tensor descales (Q, K, V quantized to e4m3 with
    scale amax/448; S scaled by 448 and descaled by 1/448, since softmax values are in [0, 1]),
    no stats (the inference forward) unless --fp8-stats. O in bf16 where the build accepts it,
    else e4m3 scaled by 448/amax(O) taken from a bf16 reference (row field `o_dtype`).
    Timed with CUDA events like compare_torch.py (its Bench.measure). `max_abs_diff_vs_bf16`
    compares O against torch SDPA in bf16 on the unquantized inputs.
  * cold rows (default): median of >= --min-reps timed runs after --warmup calls.
  * sustained rows (--sustained N): per shape and kind (fwd, bwd), N back-to-back calls after
    --sustained-warmup calls; the reported time is the mean per call over the last half (one
    synchronisation at the midpoint marks where that half starts). SM clock, power and
    temperature are sampled every --sample-ms over that half (pynvml if importable, else
    nvidia-smi in a background process). Rows carry sustained: true, reps, kind, sm_clock_mhz_median,
    power_w_median.
  * a peer that fails on a shape gets a row with an "error" string; the run goes on.
"""

import argparse
import math
import os
import subprocess
import sys
import time
from datetime import datetime, timezone

# The helpers beside this script.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare_torch_bench import attn_flops_fwd  # noqa: E402
from peers_sustained import GpuSampler, sustained_run  # noqa: E402
from peers_common import (  # noqa: E402
    add_output_args,
    add_run_args,
    add_timing_args,
    cudnn_frontend,
    driver_version,
    finish_run_args,
    fmt,
    int_list,
    short_error,
    summarize,
    write_json,
)

PEERS = ("fa3", "cudnn-fp8")
DEFAULT_SEQLENS = [2048, 4096, 8192, 16384]
QUICK_SEQLENS = [2048, 8192]
DEFAULT_FA3_DIMS = [64, 128]
DEFAULT_FP8_DIMS = [64, 128, 256]
E4M3_MAX = 448.0
FA3_WHEEL = "flash_attn3_jax==0.2.3"
FP8_WHEEL = "nvidia-cudnn-frontend==1.32.0"


# ----------------------------------------------------------------------------- arguments

def peer_list(text):
    vals = [x for x in text.replace(" ", "").split(",") if x]
    bad = [x for x in vals if x not in PEERS]
    if not vals or bad:
        raise argparse.ArgumentTypeError(f"peers are a comma list of {', '.join(PEERS)}; got {text!r}")
    return vals


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Time FlashAttention-3 (flash_attn3_jax) and cuDNN FP8 SDPA (cudnn frontend) "
                    "on the headline shapes, cold and sustained; write the results JSON.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_output_args(p, "peers_fa3_fp8", "shape")
    p.add_argument("--peers", type=peer_list, default=list(PEERS), help="comma list: fa3, cudnn-fp8")
    p.add_argument("--quick", action="store_true",
                   help=f"seqlens {QUICK_SEQLENS} and fewer timed runs (--seqlens still overrides)")
    p.add_argument("--seqlens", type=int_list, default=None,
                   help=f"comma list of seqlens (default {','.join(map(str, DEFAULT_SEQLENS))})")
    p.add_argument("--fa3-dims", type=int_list, default=DEFAULT_FA3_DIMS,
                   help="head dims for fa3 (the wheel's kernels go to 128 in the FA3 paper's set)")
    p.add_argument("--fp8-dims", type=int_list, default=DEFAULT_FP8_DIMS, help="head dims for cudnn-fp8")
    p.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    p.add_argument("--tokens", type=int, default=16384, help="total tokens: batch = tokens / seqlen")
    p.add_argument("--hidden", type=int, default=2048, help="hidden size: heads = hidden / head_dim")
    p.add_argument("--no-bwd", action="store_true", help="fa3: time the forward only")
    p.add_argument("--fp8-stats", action="store_true",
                   help="cudnn-fp8: also write the softmax stats (the training forward)")
    add_timing_args(p, warmup=5, min_reps=20, target_ms=250.0)
    p.add_argument("--round-ms", type=float, default=10.0,
                   help="fa3: wall-clock length of one timed round of back-to-back calls")
    p.add_argument("--sustained", type=int, default=0, metavar="N",
                   help="also run N back-to-back calls per shape and kind, reporting the mean of "
                        "the last half with SM clock and power (0: off)")
    p.add_argument("--sustained-warmup", type=int, default=20, help="untimed calls before a sustained run")
    p.add_argument("--no-cold", action="store_true", help="with --sustained: skip the cold rows")
    p.add_argument("--sample-ms", type=int, default=100, help="clock/power sampling period")
    add_run_args(p, 300.0, "stop starting new measurements after this many seconds (wall clock); "
                           "skipped ones are listed under 'skipped' in the JSON",
                 device_help="GPU index (CUDA, JAX and NVML)")
    args = p.parse_args(argv)
    if args.quick:
        args.seqlens = args.seqlens or QUICK_SEQLENS
        args.target_ms = min(args.target_ms, 100.0)
    args.seqlens = args.seqlens or DEFAULT_SEQLENS
    if args.sustained < 0 or (args.sustained and args.sustained < 4):
        p.error("--sustained needs N >= 4 (0: off)")
    if args.no_cold and not args.sustained:
        p.error("--no-cold needs --sustained N")
    if args.round_ms <= 0 or args.sample_ms <= 0:
        p.error("--round-ms and --sample-ms must be positive")
    return finish_run_args(p, args, "peers_fa3_fp8")


def shapes(args, dims):
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    out = []
    for d in dims:
        if args.hidden % d:
            print(f"note: skipping d={d}: hidden {args.hidden} is not a multiple of it", file=sys.stderr)
            continue
        for s in args.seqlens:
            for causal in causals:
                out.append(dict(d=d, seqlen=s, batch=max(1, args.tokens // s),
                                heads=args.hidden // d, causal=causal))
    return out


def plan(args):
    """(peer, shape) in the order they run; each shape is set up once, then measured cold and,
    with --sustained, sustained right after."""
    return [(peer, s) for peer in args.peers
            for s in shapes(args, args.fa3_dims if peer == "fa3" else args.fp8_dims)]


def modes(args):
    return ([] if args.no_cold else [False]) + ([True] if args.sustained else [])


def fwd_flops(shp):
    b, s, h, d = shp["batch"], shp["seqlen"], shp["heads"], shp["d"]
    return attn_flops_fwd(b, h, s, s, d, shp["causal"])


def base_row(impl, shp, dtype, sustained, args):
    row = dict(impl=impl, dtype=dtype, d=shp["d"], seqlen_q=shp["seqlen"], seqlen_k=shp["seqlen"],
               batch=shp["batch"], heads=shp["heads"], heads_kv=shp["heads"], causal=shp["causal"])
    if sustained:
        row.update(sustained=True, reps=args.sustained)
    return row


def tflops(flops, ms):
    return round(flops / (ms * 1e-3) / 1e12, 2)


# ----------------------------------------------------------------------------- fa3 (JAX)

class Fa3Peer:
    impl = "fa3"

    def __init__(self, args, sampler):
        self.args, self.sampler = args, sampler
        self.error = None
        try:
            import jax
            import jax.numpy as jnp
            from flash_attn3_jax import flash_mha
            gpus = [d for d in jax.devices() if d.platform == "gpu"]
            if len(gpus) <= args.device:
                raise RuntimeError(f"jax sees no GPU {args.device} (devices: {jax.devices()})")
            self.jax, self.jnp, self.flash_mha, self.dev = jax, jnp, flash_mha, gpus[args.device]
            import flash_attn3_jax
            self.version = (f"flash_attn3_jax {getattr(flash_attn3_jax, '__version__', '?')}, "
                            f"jax {jax.__version__}")
            self.key = jax.random.PRNGKey(args.seed)
        except Exception as e:  # noqa: BLE001 -- every fa3 row then carries this error
            self.error = "import: " + short_error(e)
            self.version = None

    def _inputs(self, shp):
        jax, jnp = self.jax, self.jnp
        b, s, h, d = shp["batch"], shp["seqlen"], shp["heads"], shp["d"]
        self.key, *ks = jax.random.split(self.key, 5)
        with jax.default_device(self.dev):
            return [jax.random.normal(k, (b, s, h, d), dtype=jnp.bfloat16) for k in ks]

    def _rounds(self, fn, args_):
        """Per-call ms of each timed round (see the module docstring)."""
        jax, a = self.jax, self.args
        for _ in range(max(1, a.warmup)):
            out = fn(*args_)
        jax.block_until_ready(out)
        est = []
        for _ in range(3):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args_))
            est.append((time.perf_counter() - t0) * 1e3)
        est = sorted(est)[1]
        calls = max(1, int(round(a.round_ms / max(est, 1e-3))))
        rounds = max(a.min_reps, min(a.max_reps, int(a.target_ms / max(est * calls, 1e-3))))
        times = []
        time.sleep(a.cool_ms / 1e3)  # the rest the other rows take (peers_common.head_ms)
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(calls):
                out = fn(*args_)
            jax.block_until_ready(out)
            times.append((time.perf_counter() - t0) * 1e3 / calls)
        return times, calls

    def run(self, shp):
        a = self.args
        row = base_row(self.impl, shp, "bf16", False, a)
        row["backend"] = "flash_attn3_jax.flash_mha (jax.jit)"
        row["timing"] = "wall clock, rounds of back-to-back calls"
        if self.error:
            row["error"] = self.error
            return [row]
        jax = self.jax
        causal, flops = shp["causal"], fwd_flops(shp)
        try:
            q, k, v, do = self._inputs(shp)

            def attn(q_, k_, v_):
                return self.flash_mha(q_, k_, v_, is_causal=causal)
            fwd = jax.jit(attn)
            out = jax.block_until_ready(fwd(q, k, v))
            if not bool(self.jnp.isfinite(out).all()):
                row["nonfinite_out"] = True
            del out
            bwd = bwd_args = None
            if not a.no_bwd:
                # The residuals (q, k, v, out, lse) are computed once here; the jitted function
                # below runs only the backward on them. The vjp function is a pytree whose leaves
                # are those residuals, so it goes in and out of jit as an argument.
                try:
                    _, vjp_fn = jax.jit(lambda q_, k_, v_: jax.vjp(attn, q_, k_, v_))(q, k, v)
                except Exception:  # noqa: BLE001 -- a JAX whose vjp function cannot leave jit
                    _, vjp_fn = jax.vjp(attn, q, k, v)
                bwd = jax.jit(lambda f, g: f(g))
                bwd_args = (vjp_fn, do)
                grads = jax.block_until_ready(bwd(*bwd_args))
                if not all(bool(self.jnp.isfinite(g).all()) for g in grads):
                    row["nonfinite_grad"] = True
                del grads
        except Exception as e:  # noqa: BLE001
            row["error"] = short_error(e)
            return [row]

        kinds = [("fwd_", fwd, (q, k, v), flops)]
        if bwd is not None:
            kinds.append(("bwd_", bwd, bwd_args, 2.5 * flops))
        rows = []
        if not a.no_cold:
            for prefix, fn, fargs, fl in kinds:
                try:
                    times, calls = self._rounds(fn, fargs)
                    row.update(summarize(times, prefix))
                    row[prefix + "calls_per_round"] = calls
                    row[prefix + "tflops"] = tflops(fl, row[prefix + "ms"])
                except Exception as e:  # noqa: BLE001
                    row["error"] = prefix.rstrip("_") + ": " + short_error(e)
                    break
            rows.append(row)
        if not a.sustained:
            return rows
        for prefix, fn, fargs, fl in kinds:
            r = base_row(self.impl, shp, "bf16", True, a)
            r.update(backend=row["backend"], timing="wall clock over the last half", kind=prefix.rstrip("_"))
            try:
                first, ms, clk = sustained_run(lambda fn=fn, fargs=fargs: fn(*fargs), jax.block_until_ready,
                                               a.sustained, a.sustained_warmup, self.sampler)
                r[prefix + "ms"] = round(ms, 5)
                r[prefix + "ms_first_half"] = round(first, 5)
                r[prefix + "tflops"] = tflops(fl, ms)
                r.update(clk)
            except Exception as e:  # noqa: BLE001
                r["error"] = short_error(e)
            rows.append(r)
        return rows


# ----------------------------------------------------------------------------- cudnn-fp8 (torch)

class CudnnFp8Peer:
    impl = "cudnn-fp8"

    def __init__(self, args, sampler):
        self.args, self.sampler = args, sampler
        self.error = None
        self.version = None
        self.o_bf16_refused = None
        try:
            import torch
            if not torch.cuda.is_available() or torch.cuda.device_count() <= args.device:
                raise RuntimeError("torch sees no CUDA GPU %d" % args.device)
            torch.cuda.set_device(args.device)
            from compare_torch_bench import Bench
            self.torch = torch
            self.cudnn, self.handle, self.version = cudnn_frontend(torch)
            self.bench = Bench(torch, args)
            self.dev = self.bench.dev
            torch.manual_seed(args.seed)
        except Exception as e:  # noqa: BLE001
            self.error = "import: " + short_error(e)

    def _quantize(self, x):
        """e4m3 copy of x with one scale for the whole tensor: (x8, descale) with x ≈ x8·descale."""
        torch = self.torch
        amax = float(x.abs().amax().float())
        descale = amax / E4M3_MAX if amax > 0 else 1.0
        x8 = (x.float() * (1.0 / descale)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        return x8, descale

    def _graph(self, shp, o_dtype, amax_s_out):
        """Build the sdpa_fp8 graph; returns (graph, tensors by name)."""
        cudnn = self.cudnn
        b, s, h, d = shp["batch"], shp["seqlen"], shp["heads"], shp["d"]
        e4m3, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
        # (b, h, s, d) dims over (b, s, h, d) memory: the layout of the bf16 peers' inputs.
        dim, stride = [b, h, s, d], [s * h * d, d, h * d, 1]
        g = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=f32, compute_data_type=f32,
                          handle=self.handle)
        t = {n: g.tensor(name=n, dim=dim, stride=stride, data_type=e4m3) for n in ("q", "k", "v")}
        for n in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o"):
            t[n] = g.tensor(name=n, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=f32)
        kw = dict(attn_scale=1.0 / math.sqrt(d), generate_stats=bool(self.args.fp8_stats), name="sdpa_fp8")
        if shp["causal"]:
            kw["use_causal_mask"] = True
        o, stats, amax_s, amax_o = g.sdpa_fp8(
            q=t["q"], k=t["k"], v=t["v"], descale_q=t["descale_q"], descale_k=t["descale_k"],
            descale_v=t["descale_v"], descale_s=t["descale_s"], scale_s=t["scale_s"],
            scale_o=t["scale_o"], **kw)
        o.set_output(True).set_dim(dim).set_stride(stride).set_data_type(
            cudnn.data_type.BFLOAT16 if o_dtype == "bf16" else e4m3)
        # amax(O) is what a delayed-scaling recipe reads back, so it stays an output; amax(S) is
        # deprecated (scale_s is fixed by the [0, 1] range of P) and kept virtual unless asked.
        amax_o.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(f32)
        amax_s.set_output(bool(amax_s_out)).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(f32)
        t.update(o=o, amax_o=amax_o, amax_s=amax_s)
        if self.args.fp8_stats:
            stats.set_output(True).set_dim([b, h, s, 1]).set_stride([h * s, s, 1, 1]).set_data_type(f32)
            t["stats"] = stats
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        return g, t

    def _engine(self, g):
        try:
            e = g.selected_engine
            return "cuDNN backend" if e is None else str(getattr(e, "name", e))
        except Exception:  # noqa: BLE001 -- older frontends have no python engines
            return None

    def run(self, shp):
        a = self.args
        row = base_row(self.impl, shp, "e4m3", False, a)
        row["backend"] = "cudnn.pygraph.sdpa_fp8 (per-tensor scales)"
        row["timing"] = "CUDA events"
        row["stats"] = bool(a.fp8_stats)
        if self.error:
            row["error"] = self.error
            return [row]
        torch = self.torch
        import torch.nn.functional as F
        b, s, h, d = shp["batch"], shp["seqlen"], shp["heads"], shp["d"]
        flops = fwd_flops(shp)
        try:
            self.cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream(self.dev).cuda_stream)
            xs = [torch.randn(b, s, h, d, device=self.dev, dtype=torch.bfloat16) for _ in range(3)]
            (q8, dq), (k8, dk), (v8, dv) = (self._quantize(x) for x in xs)
            ref = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in xs),
                                                 is_causal=shp["causal"]).transpose(1, 2)
            amax_ref = float(ref.abs().amax().float())
            del xs
            built, fails = None, []
            variants = [("bf16", False), ("e4m3", False), ("e4m3", True)]
            if self.o_bf16_refused:
                variants = variants[1:]
            for o_dtype, amax_s_out in variants:
                try:
                    built = (o_dtype, amax_s_out) + self._graph(shp, o_dtype, amax_s_out)
                    break
                except Exception as e:  # noqa: BLE001 -- a refused variant: try the next one
                    what = f"O {o_dtype}" + (", amax_s out" if amax_s_out else "")
                    fails.append(f"[{what}] {short_error(e)[:240]}")
                    self.bench.check_context()
            if built is None:
                raise RuntimeError("no sdpa_fp8 graph built: " + " || ".join(fails))
            o_dtype, amax_s_out, g, t = built
            if o_dtype != "bf16":
                # Asked once: later shapes go straight to e4m3 O and repeat the first refusal.
                if self.o_bf16_refused is None:
                    self.o_bf16_refused = fails[0][:300] if fails else "refused"
                row["o_bf16_refused"] = self.o_bf16_refused
            row["o_dtype"] = o_dtype
            if amax_s_out:
                row["amax_s_output"] = True
            eng = self._engine(g)
            if eng:
                row["engine"] = eng
            scale_o = 1.0 if o_dtype == "bf16" or amax_ref <= 0 else E4M3_MAX / amax_ref
            def scalar(x):
                return torch.full((1, 1, 1, 1), x, device=self.dev, dtype=torch.float32)
            o_buf = torch.empty(b, s, h, d, device=self.dev,
                                dtype=torch.bfloat16 if o_dtype == "bf16" else torch.float8_e4m3fn)
            pack = {t["q"]: q8, t["k"]: k8, t["v"]: v8, t["o"]: o_buf,
                    t["descale_q"]: scalar(dq), t["descale_k"]: scalar(dk), t["descale_v"]: scalar(dv),
                    t["descale_s"]: scalar(1.0 / E4M3_MAX), t["scale_s"]: scalar(E4M3_MAX),
                    t["scale_o"]: scalar(scale_o), t["amax_o"]: scalar(0.0)}
            if amax_s_out:
                pack[t["amax_s"]] = scalar(0.0)
            if "stats" in t:
                pack[t["stats"]] = torch.empty(b, h, s, 1, device=self.dev, dtype=torch.float32)
            ws = torch.empty(max(1, g.get_workspace_size()), device=self.dev, dtype=torch.uint8)

            def call(_input_set=0):  # Bench.measure passes an input set's index; one set here
                g.execute(pack, ws, handle=self.handle)
                return o_buf
            call()
            torch.cuda.synchronize()
            got = o_buf.float() * (1.0 / scale_o)
            if not bool(torch.isfinite(got).all()):
                row["nonfinite_out"] = True
            row["max_abs_diff_vs_bf16"] = round(float((got - ref.float()).abs().max()), 5)
            row["ref_amax"] = round(amax_ref, 5)
            del got, ref
        except Exception as e:  # noqa: BLE001
            row["error"] = short_error(e)
            self.bench.check_context()
            return [row]

        rows = []
        if not a.no_cold:
            try:
                times = self.bench.measure(call)
                row.update(summarize(times, "fwd_"))
                row["fwd_tflops"] = tflops(flops, row["fwd_ms"])
            except Exception as e:  # noqa: BLE001
                row["error"] = short_error(e)
                self.bench.check_context()
            rows.append(row)
        if a.sustained:
            keep = ("backend", "stats", "o_dtype", "o_bf16_refused", "amax_s_output", "engine")
            r = base_row(self.impl, shp, "e4m3", True, a)
            r.update({f: row[f] for f in keep if f in row}, timing="CUDA events over the last half",
                     kind="fwd")
            try:
                ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                first, ms, clk = sustained_run(call, lambda _o: torch.cuda.synchronize(), a.sustained,
                                               a.sustained_warmup, self.sampler, ev)
                r["fwd_ms"] = round(ms, 5)
                r["fwd_ms_first_half"] = round(first, 5)
                r["fwd_tflops"] = tflops(flops, ms)
                r.update(clk)
            except Exception as e:  # noqa: BLE001
                r["error"] = short_error(e)
                self.bench.check_context()
            rows.append(r)
        return rows


# ----------------------------------------------------------------------------- output

def print_table(doc, file=None):
    def p(*a):
        print(*a, file=file or sys.stdout)
    p(f"\n{doc['device']}  commit {doc['commit']}  fa3: {doc.get('fa3')}  cudnn-fp8: {doc.get('cudnn_fp8')}")
    hdr = (f"{'d':>4} {'seqlen':>6} {'b':>3} {'h':>3} {'causal':>6} {'impl':<10}{'mode':<10}"
           f"{'fwd ms':>9} {'fwd TF':>7}{'bwd ms':>9} {'bwd TF':>7} {'MHz':>6} {'W':>6}  note")
    p("\n" + hdr)
    p("-" * len(hdr))
    for r in doc["rows"]:
        mode = f"sust {r.get('kind', '')}" if r.get("sustained") else "cold"
        note = r.get("error", "")[:70]
        if r.get("o_dtype") and r["o_dtype"] != "bf16":
            note = (note + " " if note else "") + f"O {r['o_dtype']}"
        if "max_abs_diff_vs_bf16" in r:
            note = (note + " " if note else "") + f"|Δ bf16| {r['max_abs_diff_vs_bf16']:.3g}"
        p(f"{r['d']:>4} {r['seqlen_q']:>6} {r['batch']:>3} {r['heads']:>3} "
          f"{'yes' if r['causal'] else 'no':>6} {r['impl']:<10}{mode:<10}"
          f"{fmt(r.get('fwd_ms'), 3):>9} {fmt(r.get('fwd_tflops')):>7}"
          f"{fmt(r.get('bwd_ms'), 3):>9} {fmt(r.get('bwd_tflops')):>7}"
          f" {fmt(r.get('sm_clock_mhz_median'), 0):>6} {fmt(r.get('power_w_median'), 0):>6}  {note}")


def device_name(index):
    try:
        r = subprocess.run(["nvidia-smi", "-i", str(index), "--query-gpu=name", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=15)
        if r.returncode == 0 and r.stdout.strip():
            return r.stdout.strip().splitlines()[0].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown GPU"


# ----------------------------------------------------------------------------- main

def main(argv=None):
    args = parse_args(argv)
    todo = plan(args)
    mode_text = " + ".join(("sustained x%d" % args.sustained) if m else "cold" for m in modes(args))
    if args.dry_run:
        for peer, shp in todo:
            kinds = "fwd" if peer == "cudnn-fp8" or args.no_bwd else "fwd+bwd"
            print(f"{peer:<10} d={shp['d']:<4} seqlen={shp['seqlen']:<6} batch={shp['batch']:<3} "
                  f"heads={shp['heads']:<3} causal={str(shp['causal']):<5} {kinds:<8} {mode_text}  "
                  f"fwd {fwd_flops(shp) / 1e9:9.1f} GFLOP")
        print(f"{len(todo)} shapes; peers {','.join(args.peers)}; {mode_text}; out: {args.out}")
        return 0

    # JAX takes most of the GPU's memory up front by default; torch shares this process.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    t_start = time.time()
    drv = driver_version()
    now = datetime.now(timezone.utc)
    doc = {
        "date": now.strftime("%Y-%m-%d"),
        "timestamp": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "device": device_name(args.device) + (f" (driver {drv})" if drv else ""),
        "commit": args.commit,
        "wheels": [FA3_WHEEL, FP8_WHEEL],
        "method": ("fwd FLOPs 4*b*s*s*h*d (/2 causal), bwd 2.5x fwd; inputs N(0,1) (b,s,h,d); "
                   "fa3: jax.jit(flash_mha), bwd = jitted vjp function of residuals computed once, "
                   "wall clock over rounds of back-to-back calls ending in block_until_ready, median "
                   "per-call over >= %d rounds; cudnn-fp8: sdpa_fp8 per-tensor scales, CUDA events, "
                   "median of >= %d runs; sustained: mean per call over the last half of N calls, "
                   "clocks sampled over that half" % (args.min_reps, args.min_reps)),
        "rows": [],
    }
    sampler = GpuSampler(args.device, args.sample_ms)
    if args.sustained:
        sampler.start()
        if sampler.source is None:
            print("note: neither pynvml nor nvidia-smi answered; sustained rows carry no clocks",
                  file=sys.stderr)
    peers = {}
    print(f"peers_fa3_fp8: {doc['device']}; {len(todo)} shapes, {mode_text}; writing {args.out}", flush=True)
    rc = 0
    skipped = []
    try:
        for n, (peer, shp) in enumerate(todo):
            if time.time() - t_start > args.budget_s:
                skipped.append(dict(shp, peer=peer))
                continue
            if peer not in peers:
                obj = Fa3Peer(args, sampler) if peer == "fa3" else CudnnFp8Peer(args, sampler)
                peers[peer] = obj
                doc["fa3" if peer == "fa3" else "cudnn_fp8"] = obj.version or obj.error
                if peer == "cudnn-fp8" and obj.error is None:
                    try:
                        doc["torch"] = obj.torch.__version__
                        doc["cuda"] = obj.torch.version.cuda
                    except Exception:  # noqa: BLE001
                        pass
                if obj.error:
                    print(f"  {peer}: {obj.error}", file=sys.stderr, flush=True)
            rows = peers[peer].run(shp)
            doc["rows"].extend(rows)
            write_json(args.out, doc)
            print(f"  [{n + 1}/{len(todo)}] {peer} d={shp['d']} s={shp['seqlen']} causal={shp['causal']}: "
                  + "  ".join(("sustained " + r.get("kind", "") if r.get("sustained") else "cold")
                              + f" {fmt(r.get('fwd_tflops'))}/{fmt(r.get('bwd_tflops'))}"
                              + (f" @{fmt(r.get('sm_clock_mhz_median'), 0)} MHz"
                                 if r.get("sustained") else "")
                              + (" (error)" if "error" in r else "") for r in rows), flush=True)
        if skipped:
            doc["skipped"] = skipped
            print(f"warning: time budget of {args.budget_s:.0f} s spent; {len(skipped)} shapes "
                  "skipped (listed under 'skipped')", file=sys.stderr)
            rc = 2
    except Exception as e:  # noqa: BLE001 -- e.g. a lost CUDA context: keep what was measured
        doc["fatal"] = short_error(e)
        print(f"peers_fa3_fp8.py: stopping: {doc['fatal']}", file=sys.stderr)
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
