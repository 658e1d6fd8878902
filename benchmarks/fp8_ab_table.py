#!/usr/bin/env python3
"""Tabulates interleaved bench_fp8 runs (lines prefixed by the build's name): FP8 and bf16
TFLOP/s per shape for every build and round, and each build's median ratio to the first's.
Usage: fp8_ab_table.py fp8_ab.txt [--json OUT] [--date D] [--device NAME] [--commit C]"""
import json
import re
import statistics
import sys

pat = re.compile(r"^(\S+) fp8 fwd\S* d(\d+)\s+s(\d+)\s+causal=(\w+)\s+[0-9.]+ ms\s+([0-9.]+) TFLOP/s"
                 r" \| bf16\s+[0-9.]+ ms\s+([0-9.]+) TFLOP/s.*non-finite outputs (\d+)")
rows, builds, bad = {}, [], 0
for line in open(sys.argv[1]):
    m = pat.match(line)
    if not m:
        continue
    b, d, s, c, fp8, bf16, nonfinite = m.groups()
    bad += int(nonfinite) != 0
    if b not in builds:
        builds.append(b)
    for kind, t in (("fp8", fp8), ("bf16", bf16)):
        rows.setdefault((kind, int(d), int(s), c == "true"), {}).setdefault(b, []).append(float(t))
base = builds[0]
ratios = {b: {"fp8": [], "bf16": []} for b in builds[1:]}
print(f"{'shape':28s} " + " ".join(f"{b:>17s}" for b in builds))
for key in sorted(rows):
    kind, d, s, c = key
    r = rows[key]
    cells = " ".join(f"{'/'.join(f'{x:.0f}' for x in r.get(b, [])):>17s}" for b in builds)
    print(f"{kind:4s} d{d:<3d} s{s:<5d} {'causal' if c else '      '}   {cells}")
    for b in builds[1:]:
        if r.get(b) and r.get(base):
            ratios[b][kind].append(statistics.median(r[b]) / statistics.median(r[base]))
summary = {}
for b, kinds in ratios.items():
    for kind, rs in kinds.items():
        if rs:
            summary[f"{b}/{base} {kind}"] = {"median": statistics.median(rs), "min": min(rs),
                                             "max": max(rs)}
            print(f"{b} / {base} {kind}: median {statistics.median(rs):.4f}, "
                  f"min {min(rs):.4f}, max {max(rs):.4f} over {len(rs)} shapes")
print(f"runs with non-finite outputs: {bad}")
if "--json" in sys.argv:
    arg = lambda k: sys.argv[sys.argv.index(k) + 1] if k in sys.argv else None
    json.dump({"date": arg("--date"), "device": arg("--device"), "commit": arg("--commit"),
               "builds": builds,
               "rows": [{"kind": k, "d": d, "seqlen": s, "causal": c, "tflops": v}
                        for (k, d, s, c), v in sorted(rows.items())],
               "ratio_to_first": summary}, open(arg("--json"), "w"), indent=1)
