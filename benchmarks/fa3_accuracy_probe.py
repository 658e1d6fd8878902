#!/usr/bin/env python3
"""Which of FlashAttention-3's (the flash_attn3_jax wheel's) outputs and gradients are non-finite
or wrong, against an f32 attention in JAX, on a few shapes (benchmarks/peers_fa3_fp8.py flags
`nonfinite_grad` on FA3's non-causal d128 backward). Needs jax with CUDA and the wheel; prints one
line per shape.

    python3 benchmarks/fa3_accuracy_probe.py
"""
import math

import jax
import jax.numpy as jnp
from flash_attn3_jax import flash_mha

f32 = jnp.float32


def ref(q, k, v, causal):
    d = q.shape[-1]
    s = jnp.einsum('bqhd,bkhd->bhqk', q.astype(f32), k.astype(f32)) / math.sqrt(d)
    if causal:
        n = s.shape[-1]
        s = jnp.where(jnp.tril(jnp.ones((n, n), bool)), s, -jnp.inf)
    return jnp.einsum('bhqk,bkhd->bqhd', jax.nn.softmax(s, -1), v.astype(f32))


for (b, s, h, d, causal) in [(1, 512, 2, 128, False), (1, 512, 2, 128, True), (1, 512, 2, 64, False),
                             (2, 1024, 4, 128, False), (8, 2048, 16, 128, False)]:
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v, do = (jax.random.normal(x, (b, s, h, d), f32).astype(jnp.bfloat16) for x in ks)
    out, vjp = jax.vjp(lambda q_, k_, v_: flash_mha(q_, k_, v_, is_causal=causal), q, k, v)
    grads = vjp(do)
    rout, rvjp = jax.vjp(lambda q_, k_, v_: ref(q_, k_, v_, causal),
                         q.astype(f32), k.astype(f32), v.astype(f32))
    rgrads = rvjp(do.astype(f32))
    line = [f"b{b} s{s} h{h} d{d} causal={causal}"]
    for name, x, r in [("out", out, rout)] + list(zip(("dq", "dk", "dv"), grads, rgrads)):
        x = x.astype(f32)
        bad = int((~jnp.isfinite(x)).sum())
        err = float(jnp.nanmax(jnp.where(jnp.isfinite(x), jnp.abs(x - r), 0.0)))
        line.append(f"{name}: nonfinite {bad}/{x.size} maxerr {err:.3g} (ref max {float(jnp.abs(r).max()):.3g})")
    print(" | ".join(line), flush=True)
