#!/usr/bin/env python3
"""Where a kernel's warps wait, from Nsight Compute's per-instruction source counters: the
stall-reason totals of one report, or of two side by side (a build against its base), and the
instructions that collect the most samples, each with its leading reasons and execution count.

    ncu --section WarpStateStats --section SourceCounters -k regex:KERNEL -c 1 -o REPORT ...
    ncu -i REPORT.ncu-rep --page source --print-source sass --csv > REPORT.csv
    python3 scripts/ncu_source_stalls.py [--top N] [--range LO:HI] A.csv [B.csv]

(scripts/device/profile.sh --source writes such CSVs for the forward benchmarks.)

--range keeps the instructions whose index (their row in the CSV, from 0) lies in [LO, HI): a
region such as a producer's loop, found from a first look at the top instructions. A warp that
is never sampled waiting (say, a producer issuing all the time) shows that by its samples'
reasons, not by their count: samples follow the time a warp is resident. Stdlib only.
"""

import argparse
import csv
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def load(path):
    """The report's instructions: (index, source, samples, executed, {reason: samples})."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    # The first row names the kernel; the second is the header.
    header = next(i for i, r in enumerate(rows) if SAMPLES in r)
    names = rows[header]
    col = {n: i for i, n in enumerate(names)}
    reasons = [n for n in names if n.startswith("stall_") and "Not Issued" not in n]
    out = []
    for index, r in enumerate(rows[header + 1:]):
        if len(r) != len(names):
            continue

        def count(name, r=r):
            return int(r[col[name]] or 0)

        out.append((index, r[col["Source"]].strip(), count(SAMPLES), count(EXECUTED),
                    {n[len("stall_"):]: count(n) for n in reasons}))
    return out


def totals(instrs):
    samples, by_reason = 0, {}
    for _, _, n, _, reasons in instrs:
        samples += n
        for k, v in reasons.items():
            by_reason[k] = by_reason.get(k, 0) + v
    return samples, by_reason


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("reports", nargs="+", help="one or two CSVs (ncu --page source --csv)")
    p.add_argument("--top", type=int, default=20, help="instructions listed per report")
    p.add_argument("--range", default=None, help="LO:HI, instruction indices kept")
    args = p.parse_args(argv)
    if len(args.reports) > 2:
        p.error("one or two reports")
    lo, hi = 0, sys.maxsize
    if args.range:
        lo, hi = (int(x) for x in args.range.split(":"))
    reports = [[i for i in load(path) if lo <= i[0] < hi] for path in args.reports]

    sums = [totals(r) for r in reports]
    print("samples: " + " / ".join(f"{s} ({path})" for (s, _), path in zip(sums, args.reports)))
    reasons = sorted(set().union(*(t for _, t in sums)), key=lambda k: -sums[0][1].get(k, 0))
    for k in reasons:
        values = [t.get(k, 0) for _, t in sums]
        if not any(values):
            continue
        cells = "  ".join(f"{v:8d} {100 * v / max(s, 1):5.1f}%" for v, (s, _) in zip(values, sums))
        delta = f"  {values[1] - values[0]:+8d}" if len(values) == 2 else ""
        print(f"  {k:20s} {cells}{delta}")
    for path, instrs in zip(args.reports, reports):
        print(f"\ntop {args.top} instructions by samples, {path}:")
        for index, source, n, executed, by in sorted(instrs, key=lambda i: -i[2])[:args.top]:
            lead = ", ".join(f"{k} {v}" for k, v in sorted(by.items(), key=lambda kv: -kv[1])[:2] if v)
            print(f"  {n:7d}  @{index:<6d} {source[:60]:60s} executed {executed:>9d}  {lead}")


if __name__ == "__main__":
    main(sys.argv[1:])
