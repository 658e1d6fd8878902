#!/usr/bin/env python3
"""Tabulates scripts/device/ab.sh output: TFLOP/s per shape for every build and round, and each
build's median ratio to the first build's. Usage: ab_table.py ab.txt [--json OUT] [--date D]
[--device NAME] [--commit C]"""
import json
import re
import statistics
import sys

rows = {}  # (family, pass, d, s, causal) -> build -> [tflops per round]
builds = []
fwd = re.compile(r"^(\S+) (sm\d+) fwd d(\d+)\s+s(\d+)\s+causal=(\w+).*?([0-9.]+) TFLOP/s.*?(pass|FAIL)")
bwd = re.compile(r"^(\S+) (sm\d+) bwd d(\d+)\s+s(\d+)\s+causal=(\w+)\s+[0-9.]+ ms\s+([0-9.]+) TFLOP/s"
                 r"\s+deterministic\s+[0-9.]+ ms\s+([0-9.]+) TFLOP/s")
failures = 0
for line in open(sys.argv[1]):
    m = fwd.match(line)
    if m:
        b, fam, d, s, c, t, ok = m.groups()
        failures += ok == "FAIL"
        entries = [(("fwd",), float(t))]
    else:
        m = bwd.match(line)
        if not m:
            continue
        b, fam, d, s, c, t, tdet = m.groups()
        entries = [(("bwd",), float(t)), (("bwd-det",), float(tdet))]
    if b not in builds:
        builds.append(b)
    for (p,), t in entries:
        rows.setdefault((fam, p, int(d), int(s), c == "true"), {}).setdefault(b, []).append(t)

base = builds[0]
out = []
ratios = {b: [] for b in builds[1:]}
print(f"{'shape':34s} " + " ".join(f"{b:>17s}" for b in builds))
for key in sorted(rows):
    fam, p, d, s, c = key
    r = rows[key]
    cells = " ".join(f"{'/'.join(f'{x:.0f}' for x in r.get(b, [])):>17s}" for b in builds)
    print(f"{fam} {p:7s} d{d:<3d} s{s:<5d} {'causal' if c else '      '} {cells}")
    for b in builds[1:]:
        if r.get(b) and r.get(base):
            ratios[b].append(statistics.median(r[b]) / statistics.median(r[base]))
    out.append({"family": fam, "pass": p, "d": d, "seqlen": s, "causal": c,
                "tflops": {b: r.get(b, []) for b in builds}})
for b, rs in ratios.items():
    if rs:
        print(f"{b} / {base}: median {statistics.median(rs):.4f}, min {min(rs):.4f}, "
              f"max {max(rs):.4f} over {len(rs)} rows")
print(f"correctness failures: {failures}")
if "--json" in sys.argv:
    arg = lambda k: sys.argv[sys.argv.index(k) + 1] if k in sys.argv else None
    json.dump({"date": arg("--date"), "device": arg("--device"), "commit": arg("--commit"),
               "builds": builds, "rows": out,
               "ratio_to_first": {b: {"median": statistics.median(rs), "min": min(rs),
                                      "max": max(rs)} for b, rs in ratios.items() if rs}},
              open(arg("--json"), "w"), indent=1)
