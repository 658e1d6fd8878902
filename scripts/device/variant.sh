#!/usr/bin/env bash
# Here: build bench_table (or EXAMPLE) from the work tree as it is (sm90 machine code for the
# sm80 family) and keep it as .variants/NAME/<example>, so that several builds can be timed in one
# device call (scripts/device/ab.sh).
# Usage: [EXAMPLE=bench_fp8] bash scripts/device/variant.sh NAME
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
export FLASHATTN_SM80_ARCH=90
example=${EXAMPLE:-bench_table}
path=$(cargo build --release --example "$example" --message-format=json 2>/dev/null |
  python3 scripts/device/executables.py | awk -v e="$example" '$1 == e {print $2}')
mkdir -p ".variants/$1"
cp "$path" ".variants/$1/$example"
git diff --stat HEAD -- csrc > ".variants/$1/DIFF"
echo ".variants/$1/$example"
