#!/usr/bin/env python3
"""Decode peers of examples/bench_kvcache.rs: torch SDPA (its flash, cuDNN and memory-efficient
backends) on one query per sequence over a full dense cache, GQA 8:1 (32 query heads, 4 KV
heads, `enable_gqa`), d128, bf16, batch 1 to 128, cache 1k to 128k keys (the longest where
batch x cache <= 4M keys), as bench_kvcache times ours: bytes of K and V read / time (GB/s)
beside a device-to-device copy of as many bytes timed the same way, and their ratio. Timed as
compare_torch.py times its peers (compare_torch_bench.Bench: warm-up, a rest before each timed
loop, CUDA events, median). A backend that refuses a shape gets a row with an "error" string.

`--pages P,...` also times cuDNN's SDPA over the same cache held in pages of P rows (the cuDNN
frontend's paged attention: K and V containers of (pages, KV heads, P, d) in the layout of
bench_kvcache's caches, (pages, P, KV heads, d) in memory, each sequence's pages scattered by a
block table as `bench_kvcache --paged P` scatters ours): rows `cudnn-paged` with `page_size`.
It needs the nvidia-cudnn-frontend wheel (benchmarks/README.md says how to bring it).

    python3 benchmarks/decode_peers_torch.py --out $OUT/decode_peers.json --commit $(git rev-parse --short HEAD)
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare_torch_bench import Bench  # noqa: E402
from peers_common import (  # noqa: E402
    add_output_args, add_run_args, add_timing_args, cudnn_frontend, finish_run_args, short_error,
    summarize, write_json)
from varlen_peers_cudnn import fe_doc  # noqa: E402

HEADS_Q, HEADS_KV, D = 32, 4, 128
BATCHES = (1, 8, 32, 128)
CACHES = (1024, 8192, 32768, 131072)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_output_args(p, "decode_peers", "results")
    add_timing_args(p, warmup=5, min_reps=20, target_ms=200.0)
    add_run_args(p, budget_s=120.0, budget_help="stop starting shapes after this many seconds")
    p.add_argument("--pages", default="",
                   help="comma list of page sizes: also time cuDNN's paged SDPA over them")
    p.add_argument("--shape", default="",
                   help="B,C: batch B at cache C alone")
    args = p.parse_args()
    finish_run_args(p, args, "decode_peers")
    pages = [int(x) for x in args.pages.split(",") if x.strip()]
    only = tuple(int(x) for x in args.shape.split(",")) if args.shape else None
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
    paged = PagedCudnn(torch, dev, args.seed) if pages else None
    for batch in BATCHES:
        for cache in CACHES:
            if batch * cache > 1 << 22 or time.monotonic() - t_start > args.budget_s:
                continue
            if only is not None and (batch, cache) != only:
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
            for page in pages:
                row = dict(impl="cudnn-paged", kind="decode", dtype="bf16", d=D, batch=batch,
                           seqlen_q=1, seqlen_k=cache, heads=HEADS_Q, heads_kv=HEADS_KV,
                           causal=False, page_size=page, copy_gbps=round(copy_gbps, 1))
                try:
                    call = paged.call(q, k, v, page)
                    stats = summarize(bench.measure(call), "fwd_")
                    gbps = kv_bytes / (stats["fwd_ms"] * 1e-3) / 1e9
                    row.update(stats, gbps=round(gbps, 1), of_copy=round(gbps / copy_gbps, 3),
                               max_abs_diff=paged.checked)
                    print(f"cudnn p{page:<4} b{batch:<3} cache {cache:>6}: "
                          f"{stats['fwd_ms']:.4f} ms {gbps:>6.0f} GB/s, copy {copy_gbps:.0f} "
                          f"({gbps / copy_gbps:.2f}), |O - dense| {paged.checked:.3g}")
                except Exception as e:  # noqa: BLE001 - a refusal is a row, the run goes on
                    row["error"] = short_error(e)
                    print(f"cudnn p{page:<4} b{batch:<3} cache {cache:>6}: {row['error']}")
                rows.append(row)
                paged.release()
            del q, k, v, dst
            torch.cuda.empty_cache()
    doc = dict(commit=args.commit, device=torch.cuda.get_device_name(dev), rows=rows)
    if paged is not None:
        doc["cudnn_paged"] = paged.version
    write_json(args.out, doc)


class PagedCudnn:
    """cuDNN frontend SDPA over K and V in pages: `call(q, k, v, page)` builds the containers,
    block table and graph for dense (batch, KV heads, cache, d) K and V, checks one call's O
    against torch's dense SDPA (`checked`: the largest |difference|), and returns the timed
    call."""

    def __init__(self, torch, dev, seed):
        self.torch, self.dev = torch, dev
        self.cudnn, self.handle, self.version = cudnn_frontend(torch)
        self.gen = torch.Generator(device=dev).manual_seed(seed + 1)
        self.held = None
        self.checked = None

    def call(self, q, k, v, page):
        torch, cudnn = self.torch, self.cudnn
        batch, heads_q, _, d = q.shape
        heads_kv, cache = k.shape[1], k.shape[2]
        if cache % page:
            raise ValueError(f"a cache of {cache} keys is no whole number of pages of {page}")
        per_seq = cache // page
        num_pages = batch * per_seq
        # Sequence b's page j at perm[b * per_seq + j]; in memory (pages, rows, KV heads, d).
        perm = torch.randperm(num_pages, device=self.dev, generator=self.gen).to(torch.int32)

        def container(x):
            rows = x.view(batch, heads_kv, per_seq, page, d).permute(0, 2, 3, 1, 4)
            c = torch.empty(num_pages, page, heads_kv, d, device=self.dev, dtype=x.dtype)
            c[perm.long()] = rows.reshape(num_pages, page, heads_kv, d)
            return c

        kc, vc = container(k), container(v)
        table = perm.view(batch, 1, per_seq, 1).contiguous()
        seq_q = torch.ones(batch, 1, 1, 1, device=self.dev, dtype=torch.int32)
        seq_kv = torch.full((batch, 1, 1, 1), cache, device=self.dev, dtype=torch.int32)
        out = torch.empty_like(q)
        bf16, f32 = cudnn.data_type.BFLOAT16, cudnn.data_type.FLOAT
        cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream(self.dev).cuda_stream)
        g = cudnn.pygraph(io_data_type=bf16, intermediate_data_type=f32, compute_data_type=f32,
                          handle=self.handle)
        cont = dict(dim=[num_pages, heads_kv, page, d],
                    stride=[page * heads_kv * d, d, heads_kv * d, 1], data_type=bf16)
        t_q = g.tensor_like(q)
        t_k, t_v = g.tensor(name="k", **cont), g.tensor(name="v", **cont)
        t_tk, t_tv = g.tensor_like(table), g.tensor_like(table)
        t_sq, t_skv = g.tensor_like(seq_q), g.tensor_like(seq_kv)
        kw = dict(name="sdpa", q=t_q, k=t_k, v=t_v, attn_scale=d ** -0.5, use_padding_mask=True,
                  seq_len_q=t_sq, seq_len_kv=t_skv, paged_attention_k_table=t_tk,
                  paged_attention_v_table=t_tv, paged_attention_max_seq_len_kv=cache)
        if "generate_stats" in fe_doc(cudnn, "sdpa"):
            kw["generate_stats"] = False
        else:
            kw["is_inference"] = True
        o, _ = g.sdpa(**kw)
        o.set_output(True).set_dim(list(out.shape)).set_stride(list(out.stride()))
        g.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        ws = torch.empty(max(1, g.get_workspace_size()), device=self.dev, dtype=torch.uint8)
        pack = {t_q: q, t_k: kc, t_v: vc, t_tk: table, t_tv: table, t_sq: seq_q,
                t_skv: seq_kv, o: out}
        self.held = (g, pack, ws, kc, vc)
        g.execute(pack, ws, handle=self.handle)
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        self.checked = float((out.float() - ref.float()).abs().max())

        def run(_):
            g.execute(pack, ws, handle=self.handle)
        return run

    def release(self):
        self.held = None
        self.torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
