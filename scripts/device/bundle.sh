#!/usr/bin/env bash
# Here (no GPU): build the release GPU test and example binaries and gather them, with
# run.sh and the peer benchmark, into .device/ (git-ignored) for `run` with carry [".device"].
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
rm -rf .device
mkdir -p .device/bin

# The H200 runs the sm80 family too: its machine code, so that no test run waits on the PTX JIT.
export FLASHATTN_SM80_ARCH=90
# With the toolchain self-test, which run.sh runs first (and under the sanitizers), and the head
# dims outside the default build (hdim96, hdim192), which the GPU tests then cover, and the ring
# over NCCL.
{
  cargo test --release --features selftest,hdim96,hdim192,kvcache-fp8,nccl --no-run --message-format=json
  cargo bench --features selftest,hdim96,hdim192,kvcache-fp8,nccl --no-run --message-format=json
  cargo build --release --features selftest,hdim96,hdim192,kvcache-fp8,nccl --examples --message-format=json
} 2>/dev/null | python3 scripts/device/executables.py | while read -r name path; do
  # Only what run.sh runs there: the CPU-only tests run in CI, the criterion bench by hand
  # (every binary carries all the kernels, and the carry is limited to 64 MiB).
  case "$name" in attention | cpu_backend | fp8 | flashattn | validation | c_abi | varlen | kvcache | combine | ring) continue ;; esac
  case "$path" in
    */deps/*) kind=test ;;
    *) kind=example ;;
  esac
  cp "$path" ".device/bin/$kind-$name"
done
cp scripts/device/run.sh scripts/device/nccl_env.sh scripts/device/profile.sh \
  scripts/device/torch_step.py benchmarks/compare_torch.py benchmarks/varlen_peers.py \
  benchmarks/peers_common.py benchmarks/compare_torch_bench.py benchmarks/varlen_peers_shapes.py \
  benchmarks/varlen_peers_torch.py benchmarks/varlen_peers_cudnn.py benchmarks/table.py \
  benchmarks/peers_sustained.py benchmarks/peers_fa3_fp8.py benchmarks/decode_peers_torch.py .device/
git rev-parse --short HEAD > .device/COMMIT
git diff --quiet HEAD -- src csrc tests benches examples build.rs || echo "+dirty" >> .device/COMMIT
ls -la .device/bin
# Every binary carries all the kernels: packed together they fit the 64 MiB carry (run.sh unpacks).
tar -C .device -cf - bin | xz -6 -T2 > .device/bin.tar.xz
rm -rf .device/bin
du -sh .device
