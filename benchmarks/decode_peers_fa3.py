#!/usr/bin/env python3
"""FlashAttention-3's KV-cache decode (the flash_attn3_jax wheel's `flash_mha_with_kvcache`,
through JAX) on the shapes of examples/bench_kvcache.rs and benchmarks/decode_peers_torch.py:
one query per sequence over a full cache, GQA 8:1 (32 query heads, 4 KV heads), d128, bf16,
batch 1 to 128, cache 1k to 128k keys (batch x cache <= 4M keys), the cache dense (`fa3` rows)
and, with `--pages P,...`, in pages of P rows scattered by a block table as
`bench_kvcache --paged P` scatters ours (`fa3-paged` rows). Bytes of K and V read / time (GB/s)
beside a copy of as many bytes (read and written, counted once each; here an XLA elementwise
pass over K and V, where the Rust and torch rows time a device-to-device memcpy) and their ratio.

With the cache lengths given, FA3 picks each sequence's number of splits itself, at most the
call's `num_splits`: each shape is timed with caps 1, 4, 16, 64 and 256, and the row keeps the
fastest (`num_splits_cap`), every cap's time beside it (`splits_ms`). Each paged call's O is
checked against the dense call's at the same cap (`max_abs_diff`: the sums' order differs, so
a bf16 ulp or so is expected).

Timing: JAX dispatch costs more than a short decode call takes, so one jitted run chains N
calls, each call's O the next call's Q (a dependence XLA keeps in order), N chosen so that a run
lasts about `--run-ms`; per-call time = run time / N, wall clock around each run ending in
`block_until_ready`, the median over runs (as many as `--target-ms` allows, `--min-reps` to
`--max-reps`). The copy is chained the same way. Needs the wheel on the path
(benchmarks/README.md says how to bring it).

    python3 benchmarks/decode_peers_fa3.py --pages 16,64 --out $OUT/decode_fa3.json
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_peers_torch import BATCHES, CACHES, D, HEADS_KV, HEADS_Q  # noqa: E402
from peers_common import (  # noqa: E402
    add_output_args, add_run_args, add_timing_args, finish_run_args, short_error, summarize,
    write_json,
)

SPLIT_CAPS = (1, 4, 16, 64, 256)


def base_row(batch, cache, page):
    row = dict(impl="fa3" if page is None else "fa3-paged", kind="decode", dtype="bf16", d=D,
               batch=batch, seqlen_q=1, seqlen_k=cache, heads=HEADS_Q, heads_kv=HEADS_KV,
               causal=True, backend="flash_attn3_jax.flash_mha_with_kvcache (jax.jit)",
               timing="wall clock, runs of chained calls", copy="xla elementwise pass")
    if page is not None:
        row["page_size"] = page
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_output_args(p, "decode_fa3", "shape")
    add_timing_args(p, warmup=5, min_reps=20, target_ms=200.0)
    add_run_args(p, budget_s=300.0, budget_help="stop starting shapes after this many seconds")
    p.add_argument("--pages", default="",
                   help="comma list of page sizes: also time the cache in pages of each")
    p.add_argument("--shape", default="", help="B,C: batch B at cache C alone")
    p.add_argument("--run-ms", type=float, default=2.0,
                   help="about this much GPU time of chained calls per timed run")
    args = finish_run_args(p, p.parse_args(argv), "decode_fa3")
    pages = [int(x) for x in args.pages.split(",") if x.strip()]
    only = tuple(int(x) for x in args.shape.split(",")) if args.shape else None
    shapes = [(b, c) for b in BATCHES for c in CACHES
              if b * c <= 1 << 22 and (only is None or (b, c) == only)]
    if args.dry_run:
        for b, c in shapes:
            print(b, c, SPLIT_CAPS, ["dense"] + pages)
        return

    rows = []
    doc = dict(commit=args.commit, rows=rows)
    try:
        import jax
        import jax.numpy as jnp
        import numpy as np
        import flash_attn3_jax
        from flash_attn3_jax import flash_mha_with_kvcache
        gpus = [d for d in jax.devices() if d.platform == "gpu"]
        if len(gpus) <= args.device:
            raise RuntimeError(f"jax sees no GPU {args.device} (devices: {jax.devices()})")
        dev = gpus[args.device]
        doc.update(device=dev.device_kind,
                   fa3=f"flash_attn3_jax {flash_attn3_jax.__version__}, jax {jax.__version__}")
    except Exception as e:  # noqa: BLE001 - every row then carries this error
        for b, c in shapes:
            for page in [None] + pages:
                rows.append(dict(base_row(b, c, page), error="import: " + short_error(e)))
        write_json(args.out, doc)
        print(f"fa3: {rows[0]['error'] if rows else e}")
        return

    def chained(step, n):
        """One jitted run of `n` calls of `step` (carry -> carry), each on the last's result."""
        return jax.jit(lambda carry, *rest: jax.lax.fori_loop(
            0, n, lambda _, c: step(c, *rest), carry))

    def per_call_ms(step, carry, rest):
        """Per-call ms of each timed run of chained calls (see the module docstring), and N."""
        def run_ms(fn):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(carry, *rest))
            return (time.perf_counter() - t0) * 1e3
        probe = chained(step, 16)
        jax.block_until_ready(probe(carry, *rest))  # compiles
        est = sorted(run_ms(probe) for _ in range(3))[1] / 16
        n = max(16, min(4096, int(round(args.run_ms / max(est, 1e-4)))))
        fn = chained(step, n)
        for _ in range(max(1, args.warmup)):
            out = fn(carry, *rest)
        jax.block_until_ready(out)
        runs = max(args.min_reps, min(args.max_reps, int(args.target_ms / max(est * n, 1e-3))))
        time.sleep(args.cool_ms / 1e3)
        return [run_ms(fn) / n for _ in range(runs)], n

    def attention_step(cap, paged):
        # One query row at the end of its sequence: causal (bottom-right) sees every cached key.
        # O has Q's shape and dtype: it is the next call's Q.
        if paged:
            return lambda q, k, v, lens, table: flash_mha_with_kvcache(
                q, k, v, cache_seqlens=lens, page_table=table, is_causal=True, num_splits=cap)
        return lambda q, k, v, lens: flash_mha_with_kvcache(
            q, k, v, cache_seqlens=lens, is_causal=True, num_splits=cap)

    t_start = time.monotonic()
    key = jax.random.PRNGKey(args.seed)
    for batch, cache in shapes:
        if time.monotonic() - t_start > args.budget_s:
            break
        with jax.default_device(dev):
            try:
                key, kq, kk, kv = jax.random.split(key, 4)
                q = jax.random.normal(kq, (batch, 1, HEADS_Q, D), dtype=jnp.bfloat16)
                k = jax.random.normal(kk, (batch, cache, HEADS_KV, D), dtype=jnp.bfloat16)
                v = jax.random.normal(kv, (batch, cache, HEADS_KV, D), dtype=jnp.bfloat16)
                lens = jnp.full((batch,), cache, dtype=jnp.int32)
                zero = jnp.zeros((), dtype=jnp.bfloat16)
                kv_bytes = 2 * k.size * 2
                # Reads and writes K and V once a call (z is a run-time zero: nothing folds).
                copy_times, _ = per_call_ms(lambda c, z: (c[0] + z, c[1] + z), (k, v), (zero,))
                copy_ms = summarize(copy_times, "")["ms"]
                copy_gbps = 2 * kv_bytes / (copy_ms * 1e-3) / 1e9
            except Exception as e:  # noqa: BLE001 - the shape's rows carry the error
                for page in [None] + pages:
                    rows.append(dict(base_row(batch, cache, page), error=short_error(e)))
                write_json(args.out, doc)
                continue
            dense_out = {}
            for page in [None] + pages:
                row = dict(base_row(batch, cache, page), copy_gbps=round(copy_gbps, 1))
                label = "dense" if page is None else f"p{page}"
                try:
                    if page is None:
                        rest = (k, v, lens)
                    else:
                        # Page i of sequence b at (b * per_seq + i) * stride mod pages, a stride
                        # prime to their count (bench_kvcache's scatter); each sequence's last
                        # page partly used where the page size does not divide the cache.
                        per_seq = -(-cache // page)
                        n_pages = batch * per_seq
                        stride = next(s for s in range(8, 10 ** 7) if _gcd(s, n_pages) == 1)
                        table = np.arange(n_pages, dtype=np.int64) * stride % n_pages
                        # The pool holds logical page j (sequence j // per_seq) at table[j].
                        order = jnp.asarray(np.argsort(table))
                        pad = ((0, 0), (0, per_seq * page - cache), (0, 0), (0, 0))
                        k_pool = jnp.pad(k, pad).reshape(n_pages, page, HEADS_KV, D)[order]
                        v_pool = jnp.pad(v, pad).reshape(n_pages, page, HEADS_KV, D)[order]
                        rest = (k_pool, v_pool, lens,
                                jnp.asarray(table.reshape(batch, per_seq), dtype=jnp.int32))
                    splits_ms, best = {}, None
                    for cap in SPLIT_CAPS:
                        step = attention_step(cap, page is not None)
                        try:
                            times, n = per_call_ms(step, q, rest)
                            stats = summarize(times, "fwd_")
                            splits_ms[cap] = stats["fwd_ms"]
                            if best is None or stats["fwd_ms"] < best[1]["fwd_ms"]:
                                best = (cap, stats, n)
                            out = jax.block_until_ready(jax.jit(step)(q, *rest))
                            if page is None:
                                dense_out[cap] = out
                            elif cap in dense_out:
                                diff = float(jnp.max(jnp.abs(out.astype(jnp.float32)
                                                             - dense_out[cap].astype(jnp.float32))))
                                row["max_abs_diff"] = max(row.get("max_abs_diff", 0.0), diff)
                        except Exception as e:  # noqa: BLE001 - a refused cap is noted
                            splits_ms[cap] = short_error(e)
                    if best is None:
                        raise RuntimeError(f"every cap refused: {splits_ms}")
                    cap, stats, n = best
                    gbps = kv_bytes / (stats["fwd_ms"] * 1e-3) / 1e9
                    row.update(stats, num_splits_cap=cap, splits_ms=splits_ms, chained_calls=n,
                               gbps=round(gbps, 1), of_copy=round(gbps / copy_gbps, 3))
                    print(f"fa3 {label:<6} b{batch:<3} cache {cache:>6}: {stats['fwd_ms']:.4f} ms "
                          f"{gbps:>6.0f} GB/s, copy {copy_gbps:.0f} ({gbps / copy_gbps:.2f}), "
                          f"cap {cap}")
                except Exception as e:  # noqa: BLE001 - a refusal is a row, the run goes on
                    row["error"] = short_error(e)
                    print(f"fa3 {label} b{batch} cache {cache}: {row['error']}")
                rows.append(row)
                rest = None
                write_json(args.out, doc)
            del q, k, v, dense_out


def _gcd(a, b):
    while b:
        a, b = b, a % b
    return a


if __name__ == "__main__":
    main()
