#!/usr/bin/env python3
"""Here: the sm80 rows of bench_table JSONs side by side (fwd / bwd TFLOP/s), each with its ratio
to torch FLASH from a peers JSON, and the geometric mean of the ratios per file.
Usage: compare_sm80.py PEERS.json RUN.json [RUN.json ...] [--min-s 2048]"""
import argparse
import json

ap = argparse.ArgumentParser()
ap.add_argument("peers")
ap.add_argument("runs", nargs="+")
ap.add_argument("--min-s", type=int, default=2048, help="shortest seqlen shown")
args = ap.parse_args()

peers = {}
for r in json.load(open(args.peers))["rows"]:
    if r.get("impl") == "torch-flash" and "fwd_tflops" in r and not r.get("sustained"):
        peers[(r["d"], r["seqlen_q"], r["causal"])] = (r["fwd_tflops"], r.get("bwd_tflops"))
runs = [(path.split("/")[-1].removesuffix(".json")[-14:], {(r["d"], r["seqlen_q"], r["causal"]): r
         for r in json.load(open(path))["rows"]
         if r.get("backend") == "sm80" and not r.get("sustained")})
        for path in args.runs]
print(f"{'shape':16s} {'torch f/b':>11s} " + " ".join(f"{n:>23s}" for n, _ in runs))
geo = [[1.0, 1.0, 0] for _ in runs]
for key in sorted(peers):
    d, s, c = key
    if s < args.min_s:
        continue
    pf, pb = peers[key]
    cells = []
    for i, (_, rows) in enumerate(runs):
        r = rows.get(key)
        if not r:
            cells.append(" " * 23)
            continue
        f, b = r["fwd_tflops"], r.get("bwd_tflops") or 0
        cells.append(f"{f:5.0f} {f/pf:4.2f} {b:5.0f} {b/pb:4.2f}  ")
        geo[i][0] *= f / pf
        geo[i][1] *= b / pb
        geo[i][2] += 1
    print(f"d{d:<3d} s{s:<5d} {'c' if c else ' ':1s}    {pf:4.0f}/{pb:4.0f} " + " ".join(cells))
print("geomean ratio fwd/bwd: " + "  ".join(
    f"{n}: {g[0] ** (1 / g[2]):.3f}/{g[1] ** (1 / g[2]):.3f}" for (n, _), g in zip(runs, geo) if g[2]))
