#!/usr/bin/env python3
"""Decode peers of examples/bench_kvcache.rs: torch SDPA (its flash, cuDNN and memory-efficient
backends) on one query per sequence over a full dense cache, GQA 8:1 (32 query heads, 4 KV
heads, `enable_gqa`), d128, bf16, batch 1 to 128, cache 1k to 128k keys (the longest where
batch x cache <= 4M keys), as bench_kvcache times ours: bytes of K and V read / time (GB/s)
beside a device-to-device copy of as many bytes timed the same way, and their ratio. Timed as
compare_torch.py times its peers (compare_torch_bench.Bench: warm-up, a rest before each timed
loop, CUDA events, median). A backend that refuses a shape gets a row with an "error" string.

    python3 benchmarks/decode_peers_torch.py --out $OUT/decode_peers.json --commit $(git rev-parse --short HEAD)
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare_torch_bench import Bench  # noqa: E402
from peers_common import (  # noqa: E402
    add_output_args, add_run_args, add_timing_args, finish_run_args, short_error, summarize,
    write_json)

HEADS_Q, HEADS_KV, D = 32, 4, 128
BATCHES = (1, 8, 32, 128)
CACHES = (1024, 8192, 32768, 131072)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_output_args(p, "decode_peers", "results")
    add_timing_args(p, warmup=5, min_reps=20, target_ms=200.0)
    add_run_args(p, budget_s=120.0, budget_help="stop starting shapes after this many seconds")
    args = p.parse_args()
    finish_run_args(p, args, "decode_peers")
    if args.dry_run:
        for b in BATCHES:
            print(b, [c for c in CACHES if b * c <= 1 << 22])
        return
    import time
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    bench = Bench(torch, args)
    dev = bench.dev
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}
    rows, t_start = [], time.monotonic()
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    for batch in BATCHES:
        for cache in CACHES:
            if batch * cache > 1 << 22 or time.monotonic() - t_start > args.budget_s:
                continue
            q = torch.randn(batch, HEADS_Q, 1, D, device=dev, dtype=torch.bfloat16, generator=gen)
            k = torch.randn(batch, HEADS_KV, cache, D, device=dev, dtype=torch.bfloat16,
                            generator=gen)
            v = torch.randn_like(k)
            kv_bytes = 2 * k.numel() * k.element_size()
            dst = torch.empty(2 * k.numel(), device=dev, dtype=torch.bfloat16)

            def copy(_):
                dst[:k.numel()].copy_(k.view(-1))
                dst[k.numel():].copy_(v.view(-1))
            copy_ms = summarize(bench.measure(copy), "")["ms"]
            copy_gbps = 2 * kv_bytes / (copy_ms * 1e-3) / 1e9
            for name, backend in backends.items():
                # One query row sees every cached key under bench_kvcache's bottom-right causal
                # mask as without one; torch's is_causal aligns top-left (it would see key 0
                # alone), so the same attention here is no mask: causal=False.
                row = dict(impl=f"torch-sdpa-{name}", kind="decode", dtype="bf16", d=D,
                           batch=batch, seqlen_q=1, seqlen_k=cache, heads=HEADS_Q,
                           heads_kv=HEADS_KV, causal=False, copy_gbps=round(copy_gbps, 1))
                try:
                    with sdpa_kernel(backend):
                        def call(_):
                            torch.nn.functional.scaled_dot_product_attention(
                                q, k, v, enable_gqa=True)
                        stats = summarize(bench.measure(call), "fwd_")
                    gbps = kv_bytes / (stats["fwd_ms"] * 1e-3) / 1e9
                    row.update(stats, gbps=round(gbps, 1), of_copy=round(gbps / copy_gbps, 3))
                    print(f"{name:<9} b{batch:<3} cache {cache:>6}: {stats['fwd_ms']:.4f} ms "
                          f"{gbps:>6.0f} GB/s, copy {copy_gbps:.0f} ({gbps / copy_gbps:.2f})")
                except Exception as e:  # noqa: BLE001 - a refusal is a row, the run goes on
                    row["error"] = short_error(e)
                    print(f"{name:<9} b{batch:<3} cache {cache:>6}: {row['error']}")
                rows.append(row)
            del q, k, v, dst
            torch.cuda.empty_cache()
    write_json(args.out, dict(commit=args.commit, device=torch.cuda.get_device_name(dev),
                              rows=rows))


if __name__ == "__main__":
    main()
