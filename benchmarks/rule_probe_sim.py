"""Which term of a FlashAttention backward breaks DESIGN §4's rule on 1x3 problems (f16, CPU,
   numpy): the same backward with D = rowsum(dO * O) from the rounded O, and with D = sum P * dP.
   `python3 rule_probe_sim.py` (results: benchmarks/README.md, 2026-12-02)."""
import numpy as np
rng = np.random.default_rng(0)
h = lambda x: x.astype(np.float16).astype(np.float32)
def run(sq, sk, d, trials=2000, d_from_o=True):
    fails = 0
    for _ in range(trials):
        q, k, v, do = [h(rng.standard_normal(s).astype(np.float32)) for s in [(sq, d), (sk, d), (sk, d), (sq, d)]]
        sc = d ** -0.5
        # f64 reference
        Q, K, V, DO = [x.astype(np.float64) for x in (q, k, v, do)]
        S = Q @ K.T * sc; P = np.exp(S - S.max(1, keepdims=True)); P /= P.sum(1, keepdims=True)
        O = P @ V; dP = DO @ V.T; D = (P * dP).sum(1, keepdims=True); dS = P * (dP - D)
        ref = [dS @ K * sc, dS.T @ Q * sc, P.T @ DO]
        # baseline (src/reference/baseline.rs)
        s = h(q @ k.T * sc); p = np.exp(s - s.max(1, keepdims=True)); p = h(p / p.sum(1, keepdims=True))
        dp = h(do @ v.T); dd = (p * dp).sum(1, keepdims=True); g = h(h(p * (dp - dd)) * sc)
        base = [h(g @ k), h(g.T @ q), h(p.T @ do)]
        # FlashAttention-style: P and dP in f32, D from the rounded O (or exact, to isolate it)
        s32 = q @ k.T * sc; p32 = np.exp(s32 - s32.max(1, keepdims=True)); p32 /= p32.sum(1, keepdims=True)
        o16 = h(p32 @ v)
        dp32 = do @ v.T
        d32 = (do * o16).sum(1, keepdims=True) if d_from_o else (p32 * dp32).sum(1, keepdims=True)
        ds = h(p32 * (dp32 - d32))
        fa = [h(ds @ k * sc), h(ds.T @ q * sc), h(h(p32).T @ do)]
        for f, r, b in zip(fa, ref, base):
            if np.abs(f - r).max() > 2 * np.abs(b - r).max() + 1e-5:
                fails += 1
                break
    return fails
for d in (64, 128):
    print(d, "1x3 D from rounded O:", run(1, 3, d), "/2000;  D from P*dP:", run(1, 3, d, d_from_o=False), "/2000;  37x37 D from O:", run(37, 37, d, 300), "/300")
