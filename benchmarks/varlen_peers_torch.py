"""The varlen peers' runner: CUDA-event timing, the float32 check, the torch peers, one row each."""

import logging
import time
import warnings

from peers_common import head_ms, short_error, summarize
from varlen_peers_cudnn import peer_cudnn_frontend
from varlen_peers_shapes import (
    Impl,
    Inputs,
    add_note,
    base_row,
    max_finite,
    record_error,
    tflops,
)

AUTOGRAD_BWD_NOTE = ("bwd = torch.autograd.grad(out, (q,k,v), dout, retain_graph=True) on a graph "
                     "built once by one forward (backward only, no forward)")


class FatalCuda(Exception):
    pass


class LogCapture(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(" ".join(record.getMessage().split()))


class Runner:
    def __init__(self, torch, args):
        self.torch = torch
        self.args = args
        self.cpu = args.cpu
        self.dev = torch.device("cpu") if args.cpu else torch.device("cuda", args.device)
        self.sleep = None if args.cpu else getattr(torch.cuda, "_sleep", None)
        self.cycles_per_ms = 2.0e6       # torch.cuda._sleep spins SM clock cycles; ~2 GHz on Hopper
        self.host_ms_per_call = 0.5      # CPU time to enqueue one call; re-estimated per measurement
        self.cudnn_handle = None         # the cuDNN frontend's, made by its first call

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
            rest = head_ms(reps, self.host_ms_per_call, self.args.cool_ms)
            self.sleep(int(rest * self.cycles_per_ms))
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
            "cudnn-varlen": lambda i: peer_cudnn_frontend(self, i),
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

