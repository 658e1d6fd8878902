#!/usr/bin/env bash
# Here: build bench_table from the work tree as it is (sm90 machine code for the sm80 family) and
# keep it as .variants/NAME/bench_table, so that several builds can be timed in one device call
# (scripts/device/ab.sh).
# Usage: bash scripts/device/variant.sh NAME
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
export FLASHATTN_SM80_ARCH=90
path=$(cargo build --release --example bench_table --message-format=json 2>/dev/null |
  python3 scripts/device/executables.py | awk '$1 == "bench_table" {print $2}')
mkdir -p ".variants/$1"
cp "$path" ".variants/$1/bench_table"
git diff --stat HEAD -- csrc > ".variants/$1/DIFF"
echo ".variants/$1/bench_table"
