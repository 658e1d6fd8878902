#!/usr/bin/env python3
"""Provision the pinned CUTLASS headers into cutlass/include (git-ignored).

The pin: the `nvidia-cutlass` wheel from PyPI, verified by sha256. Only the `cute/` and
`cutlass/` header trees are unpacked. Idempotent: a stamp file records the unpacked pin.
Usage: fetch.py [DEST_INCLUDE_DIR] [CACHE_DIR]
"""
import hashlib
import os
import subprocess
import sys
import zipfile

VERSION = "4.2.0.0"
SHA256 = "f9599ada45c7bcb6bf53f7d3f0a7d154183e53451c01bfa59eecd37dd4a693f6"
PREFIX = "cutlass_library/source/include/"

here = os.path.dirname(os.path.abspath(__file__))
dest = sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "include")
cache = sys.argv[2] if len(sys.argv) > 2 else os.path.expanduser("~/.cache/flashattn/cutlass-wheel")
stamp = os.path.join(dest, ".pin")

if os.path.exists(stamp) and open(stamp).read().strip() == SHA256:
    sys.exit(0)

wheel = os.path.join(cache, f"nvidia_cutlass-{VERSION}-py3-none-any.whl")
if not os.path.exists(wheel):
    print(f"flashattn: downloading nvidia-cutlass=={VERSION} headers", file=sys.stderr)
    subprocess.check_call([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                           "--only-binary=:all:", "-d", cache, f"nvidia-cutlass=={VERSION}"])
digest = hashlib.sha256(open(wheel, "rb").read()).hexdigest()
if digest != SHA256:
    sys.exit(f"flashattn: {wheel} has sha256 {digest}, pinned {SHA256}")

with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        if not name.startswith(PREFIX) or name.endswith("/"):
            continue
        rel = name[len(PREFIX):]
        if not (rel.startswith("cute/") or rel.startswith("cutlass/")):
            continue
        out = os.path.join(dest, rel)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with z.open(name) as src, open(out, "wb") as dst:
            dst.write(src.read())
with open(stamp, "w") as f:
    f.write(SHA256 + "\n")
