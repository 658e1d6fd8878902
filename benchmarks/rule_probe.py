"""DESIGN §4's rule on tiny problems, applied to the peers: how often the FlashAttention-family
backward of torch SDPA (FLASH = FlashAttention-2, and cuDNN) fails
max|out - ref| <= 2 max|baseline - ref| + 1e-5 for dQ, dK, dV (baseline as src/reference/baseline.rs),
and how often with FlashAttention-3's atol added. On the GPU machine:
`python3 rule_probe.py OUT.json` (results: benchmarks/results/2026-12-02-h200-rule-probe-tiny-sequences.json)."""
import json, sys
import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend

torch.manual_seed(0)
dev = "cuda"

def rt(x, dt):  # round to dtype, back to f32
    return x.to(dt).to(torch.float32)

def baseline(q, k, v, do, dt, scale):
    # as src/reference/baseline.rs: S rounded, softmax f32 rounded, dP rounded, D from rounded
    # P and dP, dS rounded, G = dS*scale rounded, dQ/dK/dV accumulated in f32 then rounded
    q, k, v, do = [x.float() for x in (q, k, v, do)]
    s = rt(q @ k.transpose(-1, -2) * scale, dt)
    p = rt(torch.softmax(s, -1), dt)
    dp = rt(do @ v.transpose(-1, -2), dt)
    dd = (p * dp).sum(-1, keepdim=True)
    g = rt(rt(p * (dp - dd), dt) * scale, dt)
    return [rt(x, dt) for x in (g @ k, g.transpose(-1, -2) @ q, p.transpose(-1, -2) @ do)]

def reference(q, k, v, do, scale):
    q, k, v = [x.double().requires_grad_() for x in (q, k, v)]
    o = torch.softmax(q @ k.transpose(-1, -2) * scale, -1) @ v
    o.backward(do.double())
    return [x.grad for x in (q, k, v)]

def peer(q, k, v, do, backend):
    q, k, v = [x.clone().requires_grad_() for x in (q, k, v)]
    with sdpa_kernel([backend]):
        o = F.scaled_dot_product_attention(q, k, v)
    o.backward(do)
    return [x.grad.float() for x in (q, k, v)]

out = {"rows": []}
for dt in (torch.float16, torch.bfloat16):
    for d in (64, 128):
        for sq, sk in ((1, 3), (1, 1), (5, 12), (37, 37)):
            scale = d ** -0.5
            stats = {}
            trials = 300
            for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                fails = fails_atol = 0
                worst = 0.0
                ran = 0
                for t in range(trials):
                    q = torch.randn(1, 2, sq, d, device=dev).to(dt)
                    k = torch.randn(1, 2, sk, d, device=dev).to(dt)
                    v = torch.randn(1, 2, sk, d, device=dev).to(dt)
                    do = torch.randn(1, 2, sq, d, device=dev).to(dt)
                    try:
                        got = peer(q, k, v, do, be)
                    except RuntimeError:
                        break
                    ran += 1
                    ref = reference(q, k, v, do, scale)
                    base = baseline(q, k, v, do, dt, scale)
                    bad = bad_atol = False
                    for g, r, b in zip(got, ref, base):
                        err = (g.double() - r).abs().max().item()
                        allowed = 2 * (b.double() - r).abs().max().item() + 1e-5
                        r_dt = r.to(dt)
                        atol = 2 * ((r_dt + 0.3 - 0.3).double() - r_dt.double()).abs().max().item()
                        worst = max(worst, err / allowed)
                        bad |= err > allowed
                        bad_atol |= err > allowed + atol
                    fails += bad
                    fails_atol += bad_atol
                stats[name] = {"trials": ran, "fail_rule": fails, "fail_rule_plus_fa3_atol": fails_atol,
                               "worst_ratio": round(worst, 3)}
            row = {"dtype": str(dt).split(".")[-1], "d": d, "seqlen_q": sq, "seqlen_k": sk, **stats}
            print(json.dumps(row)); sys.stdout.flush()
            out["rows"].append(row)
json.dump(out, open(sys.argv[1], "w"), indent=1)
