#!/usr/bin/env python3
"""Tabulates interleaved A/B runs whose lines are prefixed by the build's name: bench_table's
(scripts/device/ab.sh: fwd, bwd and deterministic bwd) and bench_fp8's (FP8 and its bf16
column). TFLOP/s per shape for every build and round, and each build's median ratio to the first
build's per kind. Usage: ab_table.py RUNS.txt [--json OUT] [--date D] [--device NAME] [--commit C]"""
import json
import re
import statistics
import sys

TABLE_FWD = re.compile(r"^(\S+) (sm\d+) fwd d(\d+)\s+s(\d+)\s+causal=(\w+).*?([0-9.]+) TFLOP/s"
                       r".*?(pass|FAIL)")
TABLE_BWD = re.compile(r"^(\S+) (sm\d+) bwd d(\d+)\s+s(\d+)\s+causal=(\w+)\s+[0-9.]+ ms\s+"
                       r"([0-9.]+) TFLOP/s\s+deterministic\s+[0-9.]+ ms\s+([0-9.]+) TFLOP/s")
FP8 = re.compile(r"^(\S+) fp8 fwd\S* d(\d+)\s+s(\d+)\s+causal=(\w+)\s+[0-9.]+ ms\s+([0-9.]+) "
                 r"TFLOP/s \| bf16\s+[0-9.]+ ms\s+([0-9.]+) TFLOP/s.*non-finite outputs (\d+)")


def parse(line):
    """(build, [(kind, d, seqlen, causal, tflops)], failed) of one line, or None."""
    if m := TABLE_FWD.match(line):
        b, fam, d, s, c, t, ok = m.groups()
        return b, [(f"{fam} fwd", d, s, c, t)], ok == "FAIL"
    if m := TABLE_BWD.match(line):
        b, fam, d, s, c, t, tdet = m.groups()
        return b, [(f"{fam} bwd", d, s, c, t), (f"{fam} bwd-det", d, s, c, tdet)], False
    if m := FP8.match(line):
        b, d, s, c, fp8, bf16, nonfinite = m.groups()
        return b, [("fp8 fwd", d, s, c, fp8), ("bf16 fwd (bench_fp8)", d, s, c, bf16)], \
            nonfinite != "0"
    return None


rows, builds, failures = {}, [], 0
for line in open(sys.argv[1]):
    parsed = parse(line)
    if not parsed:
        continue
    b, entries, failed = parsed
    failures += failed
    if b not in builds:
        builds.append(b)
    for kind, d, s, c, t in entries:
        key = (kind, int(d), int(s), c == "true")
        rows.setdefault(key, {}).setdefault(b, []).append(float(t))

base = builds[0]
ratios = {}  # (build, kind) -> ratios of medians
print(f"{'shape':40s} " + " ".join(f"{b:>17s}" for b in builds))
for key in sorted(rows):
    kind, d, s, c = key
    r = rows[key]
    cells = " ".join(f"{'/'.join(f'{x:.0f}' for x in r.get(b, [])):>17s}" for b in builds)
    print(f"{kind:22s} d{d:<3d} s{s:<5d} {'causal' if c else '      '} {cells}")
    for b in builds[1:]:
        if r.get(b) and r.get(base):
            ratios.setdefault((b, kind), []).append(
                statistics.median(r[b]) / statistics.median(r[base]))
summary = {}
for (b, kind), rs in sorted(ratios.items()):
    summary[f"{b}/{base} {kind}"] = {"median": statistics.median(rs), "min": min(rs),
                                     "max": max(rs), "rows": len(rs)}
    print(f"{b} / {base} {kind}: median {statistics.median(rs):.4f}, min {min(rs):.4f}, "
          f"max {max(rs):.4f} over {len(rs)} rows")
print(f"correctness failures or non-finite outputs: {failures}")
if "--json" in sys.argv:
    arg = lambda k: sys.argv[sys.argv.index(k) + 1] if k in sys.argv else None
    json.dump({"date": arg("--date"), "device": arg("--device"), "commit": arg("--commit"),
               "builds": builds,
               "rows": [{"kind": k, "d": d, "seqlen": s, "causal": c, "tflops": v}
                        for (k, d, s, c), v in sorted(rows.items())],
               "ratio_to_first": summary, "failures": failures},
              open(arg("--json"), "w"), indent=1)
