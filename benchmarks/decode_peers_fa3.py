#!/usr/bin/env python3
"""FlashAttention-3's KV-cache decode (the flash_attn3_jax wheel's `flash_mha_with_kvcache`,
through JAX) on the shapes of examples/bench_kvcache.rs and benchmarks/decode_peers_torch.py:
one query per sequence over a full cache, GQA 8:1 (32 query heads, 4 KV heads), d128, bf16,
batch 1 to 128, cache 1k to 128k keys (batch x cache <= 4M keys), the cache dense and, with
`--pages P,...`, in pages of P rows scattered by a block table as `bench_kvcache --paged P`
scatters ours. Bytes of K and V read / time (GB/s) beside a copy of as many bytes (read and
written, counted once each) timed the same way, and their ratio.

The wheel's entry takes `num_splits` >= 1 and chooses none itself: each shape is timed at
1, 4, 16 and 64 splits (those no more than the cache's 128-key blocks) and the row keeps the
fastest, with every split's time beside it (`splits_ms`). Each paged call's O is checked
against the dense call's (`max_abs_diff`).

JAX dispatches asynchronously: as benchmarks/peers_fa3_fp8.py times FA3, a round is many
back-to-back calls ending in one `block_until_ready`, wall clock per call; the median over
rounds. Needs the wheel on the path (benchmarks/README.md says how to bring it).

    python3 benchmarks/decode_peers_fa3.py --pages 16,64 --out $OUT/decode_fa3.json
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_peers_torch import BATCHES, CACHES, D, HEADS_KV, HEADS_Q  # noqa: E402
from peers_common import (  # noqa: E402
    add_output_args, add_run_args, add_timing_args, finish_run_args, percentile, short_error,
    summarize, write_json,
)

SPLITS = (1, 4, 16, 64)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_output_args(p, "decode_fa3", "shape")
    add_timing_args(p, warmup=5, min_reps=20, target_ms=200.0)
    add_run_args(p, budget_s=120.0, budget_help="stop starting shapes after this many seconds")
    p.add_argument("--pages", default="",
                   help="comma list of page sizes: also time the cache in pages of each")
    p.add_argument("--shape", default="", help="B,C: batch B at cache C alone")
    p.add_argument("--round-ms", type=float, default=20.0,
                   help="about this much wall time of back-to-back calls per timed round")
    args = finish_run_args(p, p.parse_args(argv), "decode_fa3")
    pages = [int(x) for x in args.pages.split(",") if x.strip()]
    only = tuple(int(x) for x in args.shape.split(",")) if args.shape else None
    shapes = [(b, c) for b in BATCHES for c in CACHES
              if b * c <= 1 << 22 and (only is None or (b, c) == only)]
    if args.dry_run:
        for b, c in shapes:
            print(b, c, [s for s in SPLITS if s <= c // 128], ["dense"] + pages)
        return

    import jax
    import jax.numpy as jnp
    import flash_attn3_jax
    from flash_attn3_jax import flash_mha_with_kvcache
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    dev = gpus[args.device]

    def per_call_ms(fn, fargs):
        """Per-call ms of each timed round (rounds of back-to-back calls, wall clock)."""
        out = None
        for _ in range(max(1, args.warmup)):
            out = fn(*fargs)
        jax.block_until_ready(out)
        est = []
        for _ in range(3):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*fargs))
            est.append((time.perf_counter() - t0) * 1e3)
        est = sorted(est)[1]
        calls = max(1, int(round(args.round_ms / max(est, 1e-3))))
        rounds = max(args.min_reps,
                     min(args.max_reps, int(args.target_ms / max(est * calls, 1e-3))))
        time.sleep(args.cool_ms / 1e3)
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(calls):
                out = fn(*fargs)
            jax.block_until_ready(out)
            times.append((time.perf_counter() - t0) * 1e3 / calls)
        return times

    def attention(num_splits):
        # One query row at the end of its sequence: causal (bottom-right) sees every cached key.
        return jax.jit(lambda q, k, v, lens, table: flash_mha_with_kvcache(
            q, k, v, cache_seqlens=lens, page_table=table, is_causal=True,
            num_splits=num_splits))

    def dense_attention(num_splits):
        return jax.jit(lambda q, k, v, lens: flash_mha_with_kvcache(
            q, k, v, cache_seqlens=lens, is_causal=True, num_splits=num_splits))

    rows, t_start = [], time.monotonic()
    key = jax.random.PRNGKey(args.seed)
    for batch, cache in shapes:
        if time.monotonic() - t_start > args.budget_s:
            break
        with jax.default_device(dev):
            key, kq, kk, kv = jax.random.split(key, 4)
            q = jax.random.normal(kq, (batch, 1, HEADS_Q, D), dtype=jnp.bfloat16)
            k = jax.random.normal(kk, (batch, cache, HEADS_KV, D), dtype=jnp.bfloat16)
            v = jax.random.normal(kv, (batch, cache, HEADS_KV, D), dtype=jnp.bfloat16)
            lens = jnp.full((batch,), cache, dtype=jnp.int32)
            zero = jnp.zeros((), dtype=jnp.bfloat16)
        kv_bytes = 2 * k.size * 2
        copy = jax.jit(lambda k_, v_, z: (k_ + z, v_ + z))  # reads and writes K and V once
        copy_ms = percentile(sorted(per_call_ms(copy, (k, v, zero))), 50)
        copy_gbps = 2 * kv_bytes / (copy_ms * 1e-3) / 1e9
        dense_out = None
        for page in [None] + pages:
            row = dict(impl="fa3", kind="decode", dtype="bf16", d=D, batch=batch, seqlen_q=1,
                       seqlen_k=cache, heads=HEADS_Q, heads_kv=HEADS_KV, causal=True,
                       copy_gbps=round(copy_gbps, 1),
                       backend="flash_attn3_jax.flash_mha_with_kvcache (jax.jit)",
                       timing="wall clock, rounds of back-to-back calls")
            if page is not None:
                row["page_size"] = page
            try:
                if page is None:
                    fargs = (q, k, v, lens)
                    make = dense_attention
                else:
                    # Page i of sequence b at (b * per_seq + i) * stride mod pages, a stride prime
                    # to their count (bench_kvcache's scatter); the last page of each sequence
                    # partly used where the page size does not divide the cache.
                    per_seq = -(-cache // page)
                    n_pages = batch * per_seq
                    stride = next(s for s in range(8, 10 ** 6) if _gcd(s, n_pages) == 1)
                    table = [(i * stride) % n_pages for i in range(n_pages)]
                    held = per_seq * page
                    kp = jnp.pad(k, ((0, 0), (0, held - cache), (0, 0), (0, 0)))
                    vp = jnp.pad(v, ((0, 0), (0, held - cache), (0, 0), (0, 0)))
                    # Logical page j of the flattened (batch, per_seq) pages lives at table[j].
                    order = jnp.argsort(jnp.array(table, dtype=jnp.int32))
                    k_pages = kp.reshape(n_pages, page, HEADS_KV, D)[order]
                    v_pages = vp.reshape(n_pages, page, HEADS_KV, D)[order]
                    table = jnp.array(table, dtype=jnp.int32).reshape(batch, per_seq)
                    fargs = (q, k_pages, v_pages, lens, table)
                    make = attention
                splits_ms = {}
                out = None
                for s in SPLITS:
                    if s > max(1, cache // 128):
                        continue
                    fn = make(s)
                    try:
                        out = jax.block_until_ready(fn(*fargs))
                        stats = summarize(per_call_ms(fn, fargs), "")
                        splits_ms[s] = stats["ms"]
                    except Exception as e:  # noqa: BLE001 - a refused split is noted, others go on
                        splits_ms[s] = short_error(e)
                timed = {s: ms for s, ms in splits_ms.items() if isinstance(ms, float)}
                if not timed:
                    raise RuntimeError(f"every split refused: {splits_ms}")
                best = min(timed, key=timed.get)
                ms = timed[best]
                gbps = kv_bytes / (ms * 1e-3) / 1e9
                o = make(best)(*fargs)
                o = o[0] if isinstance(o, (tuple, list)) else o
                if page is None:
                    dense_out = o
                elif dense_out is not None:
                    row["max_abs_diff"] = float(jnp.max(jnp.abs(
                        o.astype(jnp.float32) - dense_out.astype(jnp.float32))))
                row.update(fwd_ms=ms, num_splits=best, splits_ms=splits_ms, gbps=round(gbps, 1),
                           of_copy=round(gbps / copy_gbps, 3))
                print(f"fa3 {'dense' if page is None else f'p{page}':<6} b{batch:<3} "
                      f"cache {cache:>6}: {ms:.4f} ms {gbps:>6.0f} GB/s, copy {copy_gbps:.0f} "
                      f"({gbps / copy_gbps:.2f}), splits {best}")
            except Exception as e:  # noqa: BLE001 - a refusal is a row, the run goes on
                row["error"] = short_error(e)
                print(f"fa3 {'dense' if page is None else f'p{page}'} b{batch} cache {cache}: "
                      f"{row['error']}")
            rows.append(row)
            write_json(args.out, dict(commit=args.commit, device=str(dev), rows=rows,
                                      fa3=f"flash_attn3_jax {flash_attn3_jax.__version__}, "
                                          f"jax {jax.__version__}"))
        del q, k, v


def _gcd(a, b):
    while b:
        a, b = b, a % b
    return a


if __name__ == "__main__":
    main()
