#!/usr/bin/env python3
"""The machine-code checks of METHOD.md for the built kernels, without a GPU: per kernel, its
registers and stack (cuobjdump -res-usage), and in its main loop the tensor-core instructions
(HGMMA / QGMMA on sm_90, HMMA on the sm80 family), the local-memory spills (LDL / STL), and how
many of its exponentials (MUFU.EX2) come before its last wait for every WGMMA in flight
(WARPGROUP.DEPBAR.LE gsb0, 0x0), i.e. run beside the P·V GEMM. ptxas has put that wait at the
top of its basic block: in the 16-bit sm90 forward with intra-warpgroup overlap and the FP8
d256 one it lands above the softmax (0 of N); a branch that moved it below cost 1-8% in the
16-bit ones (benchmarks/README.md, 2026-11-30). In the FP8 d64, d96 and d192 forwards the
V-descale division (its slow path a call) ends the softmax's block, so there all N come before;
the FP8 d128 one runs without intra-warpgroup overlap (no P·V in flight during its softmax).

    python3 scripts/sass_report.py [--match REGEX] [ARCHIVE]

ARCHIVE defaults to the newest target/release/build/flashattn-*/out/libflashattn_kernels.a.
cuobjdump: $CUOBJDUMP, else on PATH (PyPI: nvidia-cuda-cuobjdump, under nvidia/cu13/bin).

The main loops are taken as the innermost loops (conditional backward branches) whose bodies
hold tensor-core instructions.
Stdlib only.
"""

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys

MMA = re.compile(r"\b[HQ]GMMA\b|\bHMMA\b")


def cuobjdump():
    path = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump")
    if not path:
        sys.exit("cuobjdump not found: set CUOBJDUMP or put it on PATH")
    return path


def default_archive():
    found = glob.glob("target/release/build/flashattn-*/out/libflashattn_kernels.a")
    if not found:
        sys.exit("no libflashattn_kernels.a under target/release: build first, or name one")
    return max(found, key=os.path.getmtime)


def functions(sass):
    """{name: [(address, instruction)]} from cuobjdump -sass output."""
    funcs, name = {}, None
    for line in sass.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            name = m.group(1)
            funcs[name] = []
            continue
        m = re.search(r"/\*([0-9a-f]{4,6})\*/\s+(.*?);", line)
        if m and name:
            funcs[name].append((int(m.group(1), 16), m.group(2)))
    return funcs


def main_loops(ins):
    """The innermost loops (backward branches) whose bodies hold tensor-core instructions."""
    loops = []
    for a, i in ins:
        # A loop's back edge is conditional; the unconditional backward branches are the
        # out-of-line retry paths of barrier waits, which jump back into the body.
        m = re.search(r"^@!?U?P\d\s+BRA\b.*?(0x[0-9a-f]+)", i)
        if m and int(m.group(1), 16) < a:
            body = (int(m.group(1), 16), a)
            if any(body[0] <= b <= body[1] and MMA.search(j) for b, j in ins):
                loops.append(body)
    return [l for l in loops
            if not any(o != l and l[0] <= o[0] and o[1] <= l[1] for o in loops)]


def exp_before_wait(bodies):
    """'n/m' over the loop bodies: n of their m MUFU.EX2 precede their own loop's last full
    WGMMA wait ('-': no loop has both)."""
    before = total = 0
    for body in bodies:
        exps = [k for k, i in enumerate(body) if "MUFU.EX2" in i]
        waits = [k for k, i in enumerate(body)
                 if re.search(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x0", i)]
        if exps and waits:
            before += sum(1 for k in exps if k < waits[-1])
            total += len(exps)
    return f"{before}/{total}" if total else "-"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("archive", nargs="?")
    ap.add_argument("--match", default=r"sm90.*(bwd_kernel|fwd_kernel)",
                    help="regex on the mangled kernel name")
    args = ap.parse_args()
    archive = args.archive or default_archive()
    tool = cuobjdump()
    usage = subprocess.run([tool, "-res-usage", archive], capture_output=True, text=True).stdout
    res, name = {}, None
    for line in usage.splitlines():
        m = re.search(r"Function (\S+):", line)
        if m:
            name = m.group(1)
            continue
        m = re.search(r"REG:(\d+) STACK:(\d+)", line)
        if m and name:
            res[name] = (int(m.group(1)), int(m.group(2)))
    sass = subprocess.run([tool, "-sass", archive], capture_output=True, text=True).stdout
    print(f"{archive}")
    print(f"{'kernel':<72} {'regs':>4} {'stack':>5} {'loop MMA':>8} {'loop spills':>11} "
          f"{'EX2 before wait':>15}")
    for fn, ins in sorted(functions(sass).items()):
        if not re.search(args.match, fn):
            continue
        loops = main_loops(ins)
        bodies = [[i for a, i in ins if lo <= a <= hi] for lo, hi in loops]
        inside = [i for body in bodies for i in body]
        mma = sum(1 for i in inside if MMA.search(i))
        spills = sum(1 for i in inside if re.search(r"\b(LDL|STL)\b", i))
        regs, stack = res.get(fn, (0, 0))
        short = re.sub(r"^_ZN9flashattn", "", fn)[:72]
        print(f"{short:<72} {regs:>4} {stack:>5} {mma:>8} {spills:>11} "
              f"{exp_before_wait(bodies):>15}")


if __name__ == "__main__":
    main()
