#!/usr/bin/env python3
"""Whether torch SDPA's cuDNN backend computes right outputs and gradients at the head dims it is
timed at beside ours (compare_torch.py checks its output against FlashAttention-2's, where FA2
runs, and its gradients only for being finite): against an f32 attention on the same bf16
inputs, beside torch's MATH backend in bf16 as the scale of a bf16 kernel's error. Needs torch
with CUDA; prints one line per shape and backend, and writes them as JSON with --out.

    python3 benchmarks/cudnn_accuracy_probe.py [--out probe.json]
"""
import argparse
import json
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = [  # (batch, seqlen, heads, d, d_v, causal)
    (1, 512, 2, 192, 128, False), (1, 512, 2, 192, 128, True),
    (2, 1024, 4, 192, 128, False), (2, 1024, 4, 192, 128, True),
    (2, 2048, 4, 192, 128, True), (2, 1024, 4, 192, 192, True),
]
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "math-bf16": SDPBackend.MATH}


def reference(q, k, v, causal):
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(q.shape[-1])
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=s.device).tril(), -math.inf)
    return torch.einsum("bhqk,bhkd->bhqd", s.softmax(-1), v)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = []
    for b, s, h, d, dv, causal in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(s + d + dv)
        make = lambda w: torch.randn(b, h, s, w, device="cuda", generator=g).bfloat16()
        q, k, v, do = make(d), make(d), make(dv), make(dv)
        f32 = [x.float().requires_grad_() for x in (q, k, v)]
        ref_out = reference(*f32, causal)
        ref = [ref_out.detach()] + list(torch.autograd.grad(ref_out, f32, do.float()))
        for name, backend in BACKENDS.items():
            row = dict(impl=f"torch-{name}", batch=b, seqlen=s, heads=h, d=d, d_v=dv, causal=causal)
            try:
                ins = [x.clone().requires_grad_() for x in (q, k, v)]
                with sdpa_kernel([backend]):
                    out = F.scaled_dot_product_attention(*ins, is_causal=causal)
                    got = [out.detach()] + list(torch.autograd.grad(out, ins, do))
                for what, x, r in zip(("out", "dq", "dk", "dv"), got, ref):
                    x = x.float()
                    row[f"{what}_nonfinite"] = int((~torch.isfinite(x)).sum())
                    err = (x - r).abs().nan_to_num(0.0).max().item()
                    row[f"{what}_max_err"] = float(f"{err:.4g}")
                    row[f"{what}_ref_max"] = float(f"{r.abs().max().item():.4g}")
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
