"""compare_torch.py's measurements: the GEMM and copy ceilings, and torch SDPA on one shape."""

import math
import time
import warnings

from peers_common import head_ms, short_error, summarize
from peers_sustained import sustained_run

BACKENDS = {"flash": "torch-flash", "cudnn": "torch-cudnn"}


def attn_flops_fwd(batch, heads, sq, sk, d, causal, dv=None):
    """2·b·s_q·s_k·h·(d + d_v): Q·Kᵀ over d, P·V over V's head dim d_v (d unless given)."""
    f = 2.0 * batch * sq * sk * heads * (d + (d if dv is None else dv))
    return f / 2 if causal else f


class Bench:
    def __init__(self, torch, args, sampler=None):
        self.torch = torch
        self.args = args
        self.sampler = sampler  # with args.sustained: the clocks of the sustained rows
        self.dev = torch.device("cuda", args.device)
        props = torch.cuda.get_device_properties(self.dev)
        self.l2_bytes = int(getattr(props, "L2_cache_size", 0) or 50 * 2**20)
        # torch.cuda._sleep spins for a number of SM clock cycles; ~2 GHz on Hopper.
        self.sleep = getattr(torch.cuda, "_sleep", None)
        self.cycles_per_ms = 2.0e6
        self.host_ms_per_call = 0.5      # CPU time to enqueue one call; re-estimated per measurement

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
            # Head start for the CPU (enough to queue every call, so that no launch gap is
            # timed) and the rest before the loop, as ours take it.
            rest = head_ms(reps, self.host_ms_per_call, self.args.cool_ms)
            self.sleep(int(rest * self.cycles_per_ms))
        t0 = time.perf_counter()
        for i in range(reps):
            starts[i].record()
            fn(i % n_sets)
            ends[i].record()
        self.host_ms_per_call = max((time.perf_counter() - t0) * 1e3 / reps, 0.05)
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
        self.host_ms_per_call = 0.5
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

    def sustained_row(self, cold, kind, call, flops):
        """`cold`'s shape fields, then `kind`'s sustained time (`args.sustained` back-to-back
        calls of `call`, the mean of the last half) and the clocks meanwhile, as
        peers_fa3_fp8.py's sustained rows."""
        torch, a = self.torch, self.args
        keep = ("impl", "backend", "dtype", "d", "d_v", "seqlen_q", "seqlen_k", "batch", "heads",
                "heads_kv", "causal")
        row = {f: cold[f] for f in keep if f in cold}
        row.update(sustained=True, reps=a.sustained, kind=kind,
                   timing="CUDA events over the last half")
        try:
            ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            first, ms, clk = sustained_run(call, lambda _o: torch.cuda.synchronize(), a.sustained,
                                           a.sustained_warmup, self.sampler, ev)
            row[kind + "_ms"] = round(ms, 5)
            row[kind + "_ms_first_half"] = round(first, 5)
            row[kind + "_tflops"] = round(flops / (ms * 1e-3) / 1e12, 2)
            row.update(clk)
        except Exception as e:  # noqa: BLE001
            row["error"] = short_error(e)
            self.check_context()
        return row

    def attention_shape(self, shp, backends):
        """All requested backends on one shape; returns their rows."""
        torch = self.torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        which = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
        label = {"flash": "sdpa:FLASH_ATTENTION", "cudnn": "sdpa:CUDNN_ATTENTION"}
        b, s, h, d, causal = shp["batch"], shp["seqlen"], shp["heads"], shp["d"], shp["causal"]
        dv = shp.get("dv", d)  # V's (and O's, dO's) head dim
        fwd_flops = attn_flops_fwd(b, h, s, s, d, causal, dv)
        n_sets = self.n_sets(b * s * h * (2 * d + 3 * dv) * 2)  # q, k, v, dO, O in bf16

        def make():
            t = lambda w: torch.randn(b, s, h, w, device=self.dev, dtype=torch.bfloat16)
            q, k, v = (t(w).requires_grad_() for w in (d, d, dv))
            return q, k, v, t(dv)
        sets = [make() for _ in range(n_sets)]

        def fwd(i):
            q, k, v, _ = sets[i]
            return F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)

        rows, ref_out = [], None
        for name in backends:
            later = []  # what runs sustained after the cold timings: (kind, call, flops)
            row = dict(impl=BACKENDS[name], backend=label[name], dtype="bf16", d=d,
                       seqlen_q=s, seqlen_k=s, batch=b, heads=h, heads_kv=h, causal=causal,
                       n_input_sets=n_sets)
            if dv != d:
                row["d_v"] = dv
            with warnings.catch_warnings(record=True) as caught, sdpa_kernel([which[name]]):
                warnings.simplefilter("always")
                # forward
                try:
                    out0 = fwd(0)
                    t = self.measure(fwd, n_sets)
                    row.update(summarize(t, "fwd_"))
                    row["fwd_tflops"] = round(fwd_flops / (row["fwd_ms"] * 1e-3) / 1e12, 2)
                    later.append(("fwd", lambda: fwd(0), fwd_flops))
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
                        later.append(("bwd", lambda: bwd(0), 2.5 * fwd_flops))
                    except Exception as e:  # noqa: BLE001
                        row["error"] = "bwd: " + short_error(e, caught)
                        self.check_context()
                # The sustained runs after this backend's cold timings, so that their heat
                # changes none of them (as bench_table runs ours).
                sustained = [self.sustained_row(row, kind, call, flops)
                             for kind, call, flops in later if self.args.sustained]
                if not self.args.no_bwd:
                    del graphs
            rows.append(row)
            rows.extend(sustained)
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
