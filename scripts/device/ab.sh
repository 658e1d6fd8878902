#!/usr/bin/env bash
# There (GPU machine): time several builds kept by variant.sh in one device call, interleaved over
# two rounds so that drift hits every build alike. Forward and backward lines go to $OUT/ab.txt,
# each prefixed with the build's name.
# Usage (run with carry [".variants"]): [QUICK=1] [ONLY=sm80|sm90] bash scripts/device/ab.sh NAME...
set -uo pipefail
OUT=$(cd "${OUT:-.}" && pwd)
cd "$(dirname "$0")/../../.variants" || exit 1
for round in 1 2; do
  for v in "$@"; do
    echo "== $v round $round"
    ./"$v"/bench_table --"${ONLY:-sm80}" ${QUICK:+--quick} 2>&1 |
      grep -E "fwd|bwd|FAIL" | sed "s/^/$v /"
  done
done | tee "$OUT/ab.txt"
