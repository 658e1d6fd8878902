#!/usr/bin/env python3
"""Whether two builds hold the same machine code: every kernel function's SASS (cuobjdump -sass)
in the objects of build A against build B, by mangled name, whatever the units they came from.
Anonymous-namespace names and column padding are normalised. Prints the functions that differ or that only one side
has, and exits 1 if any differ.

Usage: sass_diff.py --cuobjdump PATH --a OBJ [OBJ ...] --b OBJ [OBJ ...]
"""
import argparse
import re
import subprocess
import sys

ap = argparse.ArgumentParser()
ap.add_argument("--cuobjdump", default="cuobjdump")
ap.add_argument("--a", nargs="+", required=True)
ap.add_argument("--b", nargs="+", required=True)
args = ap.parse_args()


def functions(objects):
    out = {}
    for obj in objects:
        text = subprocess.run([args.cuobjdump, "-sass", obj], capture_output=True, text=True,
                              check=True).stdout
        name, body = None, []
        for line in text.splitlines():
            m = re.match(r"\s*Function : (\S+)", line)
            if m:
                if name:
                    out.setdefault(name, "\n".join(body))
                name, body = re.sub(r"_GLOBAL__N__[0-9a-f_]+", "<anon>", m.group(1)), []
            elif name and line.strip().startswith("/*"):
                line = re.sub(r"_GLOBAL__N__[0-9a-f_]+", "<anon>", line.strip())
                body.append(" ".join(line.split()))  # column padding follows the longest line
        if name:
            out.setdefault(name, "\n".join(body))
    return out


a, b = functions(args.a), functions(args.b)
only_a = sorted(set(a) - set(b))
only_b = sorted(set(b) - set(a))
differ = sorted(n for n in set(a) & set(b) if a[n] != b[n])
for n in only_a:
    print(f"only in A: {n}")
for n in only_b:
    print(f"only in B: {n}")
for n in differ:
    print(f"differs:   {n}")
print(f"{len(set(a) & set(b))} functions in both, {len(differ)} differ, "
      f"{len(only_a)} only in A, {len(only_b)} only in B")
sys.exit(1 if differ or only_a or only_b else 0)
