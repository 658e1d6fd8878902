#!/usr/bin/env python3
"""Where the cold build's time goes: the nvcc wall time of each kernel unit, as build.rs logs
it beside each cached object (newest object per unit), with the sum and the 2-job estimate.

Usage: python3 scripts/compile_times.py [CACHE_DIR] [--json OUT]
"""
import json
import os
import re
import sys

args = [a for i, a in enumerate(sys.argv[1:], 1)
        if not a.startswith("--") and sys.argv[i - 1] != "--json"]
cache = args[0] if args else os.environ.get(
    "FLASHATTN_CACHE_DIR", os.path.expanduser("~/.cache/flashattn"))
obj_dir = os.path.join(cache, "obj")
newest = {}
for name in os.listdir(obj_dir):
    if not name.endswith(".log"):
        continue
    stem = name.rsplit("-", 1)[0]
    path = os.path.join(obj_dir, name)
    text = open(path).read()
    m = re.search(r"nvcc wall time ([0-9.]+) s \((\d+) jobs\)", text)
    if not m:
        continue
    mtime = os.path.getmtime(path)
    if stem not in newest or mtime > newest[stem][0]:
        newest[stem] = (mtime, float(m.group(1)), int(m.group(2)))
rows = sorted(((s, t, j) for s, (_, t, j) in newest.items()), key=lambda r: -r[1])
total = sum(t for _, t, _ in rows)
for stem, t, jobs in rows:
    print(f"{t:7.1f} s  {stem}  ({jobs} jobs at once)")
print(f"{total:7.1f} s  sum over {len(rows)} units; with 2 jobs at once about {total / 2:.0f} s")
if "--json" in sys.argv:
    out = sys.argv[sys.argv.index("--json") + 1]
    json.dump({"units": [{"unit": s, "seconds": t, "jobs": j} for s, t, j in rows],
               "sum_s": total}, open(out, "w"), indent=1)
