"""DESIGN §4's rule on tiny problems, applied to the peers: how often the FlashAttention-family
backward of torch SDPA (FLASH = FlashAttention-2, and cuDNN) fails
max|out - ref| <= 2 max|baseline - ref| + 1e-5 for dQ, dK, dV (baseline as src/reference/baseline.rs),
how often with FlashAttention-3's atol added (the rule the tests apply to packed batches'
gradients: src/reference/rule.rs, compare_gradient), and, as a probe only, how often against the
worse of two baselines (autograd's, and one with D = rowsum(dO*O) from its rounded O). On the GPU
machine: `python3 rule_probe.py OUT.json` (results:
benchmarks/results/2026-12-02-h200-rule-probe-tiny-sequences.json and
2026-12-04-h200-s24-rule-probe-exact-inputs.json), or `python3 rule_probe.py OUT.json --cases CASES.json` for
given f16 inputs (each case: name, d, heads, seqlen_q/k, q/k/v/do as flat values in (seq, head,
dim) order, the f64 reference's ref_dq/ref_dk and our kernels' errors ours_dq/ours_dk)."""
import json, sys
import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend

torch.manual_seed(0)
dev = "cuda"

def rt(x, dt):  # round to dtype, back to f32
    return x.to(dt).to(torch.float32)

def baseline(q, k, v, do, dt, scale, of_output=False):
    # as src/reference/baseline.rs: S rounded, softmax f32 rounded, dP rounded, D from rounded
    # P and dP (of_output: from the rounded O, as the FlashAttention backwards form D), dS rounded,
    # G = dS*scale rounded, dQ/dK/dV accumulated in f32 then rounded
    q, k, v, do = [x.float() for x in (q, k, v, do)]
    s = rt(rt(q @ k.transpose(-1, -2), dt) * scale, dt)
    p = rt(torch.softmax(s, -1), dt)
    dp = rt(do @ v.transpose(-1, -2), dt)
    dd = (do * rt(p @ v, dt)).sum(-1, keepdim=True) if of_output else (p * dp).sum(-1, keepdim=True)
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

def exact_cases(path):
    # Given inputs (one head group, MHA), every peer backend, errors against the given f64
    # reference, allowances of autograd's baseline and of the worse of the two.
    rows = []
    for c in json.load(open(path)):
        d, h = c["d"], c["heads"]
        shape = lambda x, n: torch.tensor(x, dtype=torch.float64).view(n, h, d).permute(1, 0, 2)[None]
        q, k, v, do = [shape(c[n], c["seqlen_q" if n in ("q", "do") else "seqlen_k"]).to(dev, torch.float16)
                       for n in ("q", "k", "v", "do")]
        ref = {"dq": shape(c["ref_dq"], c["seqlen_q"]).to(dev), "dk": shape(c["ref_dk"], c["seqlen_k"]).to(dev)}
        scale = d ** -0.5
        base = dict(zip(("dq", "dk"), baseline(q, k, v, do, torch.float16, scale)[:2]))
        flash = dict(zip(("dq", "dk"), baseline(q, k, v, do, torch.float16, scale, of_output=True)[:2]))
        row = {"case": c["name"], "d": d, "seqlen_q": c["seqlen_q"], "seqlen_k": c["seqlen_k"], "dtype": "float16"}
        for g in ("dq", "dk"):
            e_base = (base[g].double() - ref[g]).abs().max().item()
            e_flash = (flash[g].double() - ref[g]).abs().max().item()
            row[g] = {"baseline_err": e_base, "baseline_of_output_err": e_flash,
                      "allowed": 2 * e_base + 1e-5, "allowed_worse_of_two": 2 * max(e_base, e_flash) + 1e-5,
                      "ours_err": c["ours_" + g]}
        for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                         ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
            try:
                got = dict(zip(("dq", "dk"), peer(q, k, v, do, be)[:2]))
            except RuntimeError as e:
                row[name] = str(e)[:200]
                continue
            for g in ("dq", "dk"):
                row[g][name + "_err"] = (got[g].double() - ref[g]).abs().max().item()
        print(json.dumps(row)); sys.stdout.flush()
        rows.append(row)
    return rows

if "--cases" in sys.argv:
    json.dump({"rows": exact_cases(sys.argv[sys.argv.index("--cases") + 1])}, open(sys.argv[1], "w"), indent=1)
    sys.exit(0)

out = {"rows": []}
for dt in (torch.float16, torch.bfloat16):
    for d in (64, 128):
        for sq, sk in ((1, 3), (1, 1), (5, 12), (37, 37)):
            scale = d ** -0.5
            stats = {}
            trials = 300
            for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                fails = fails_atol = fails_two = 0
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
                    flash = baseline(q, k, v, do, dt, scale, of_output=True)
                    bad = bad_atol = bad_two = False
                    for g, r, b, f in zip(got, ref, base, flash):
                        err = (g.double() - r).abs().max().item()
                        allowed = 2 * (b.double() - r).abs().max().item() + 1e-5
                        allowed_two = max(allowed, 2 * (f.double() - r).abs().max().item() + 1e-5)
                        bad_two |= err > allowed_two
                        r_dt = r.to(dt)
                        atol = 2 * ((r_dt + 0.3 - 0.3).double() - r_dt.double()).abs().max().item()
                        worst = max(worst, err / allowed)
                        bad |= err > allowed
                        bad_atol |= err > allowed + atol
                    fails += bad
                    fails_atol += bad_atol
                    fails_two += bad_two
                stats[name] = {"trials": ran, "fail_rule": fails, "fail_rule_plus_fa3_atol": fails_atol,
                               "fail_rule_worse_of_two_baselines": fails_two,
                               "worst_ratio": round(worst, 3)}
            row = {"dtype": str(dt).split(".")[-1], "d": d, "seqlen_q": sq, "seqlen_k": sk, **stats}
            print(json.dumps(row)); sys.stdout.flush()
            out["rows"].append(row)
json.dump(out, open(sys.argv[1], "w"), indent=1)
