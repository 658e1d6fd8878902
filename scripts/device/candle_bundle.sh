#!/usr/bin/env bash
# Here (no GPU): build the candle op's GPU test and the training example with candle-core's CUDA
# backend (features candle-cuda, cuda-version-from-build-system) and pack them with candle.sh
# into .device/ for `run` with carry [".device"].
#
# candle-core's CUDA backend links the CUDA driver, cuBLAS, cuRAND and NVRTC. A machine with no
# CUDA install can link against PyPI's copies and a driver stub:
#   CUDA_ROOT=DIR   a folder whose lib64 holds libcuda.so (the real one or a stub with soname
#                   libcuda.so.1), libcublas.so, libcublasLt.so, libcurand.so and libnvrtc.so
# and candle-kernels compiles its kernels for CUDA_COMPUTE_CAP (90 for the H200).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
features=kernels,candle-cuda,cuda-version-from-build-system
out=.device/candle
rm -rf "$out" .device/candle.tar.xz
mkdir -p "$out"
{
  cargo test --release --no-run --no-default-features --features "$features" --test gpu_candle \
    --message-format=json
  cargo build --release --no-default-features --features "$features" --example train_lm \
    --message-format=json
} 2>/dev/null | python3 scripts/device/executables.py | while read -r name path; do
  case "$path" in
    */deps/*) kind=test ;;
    *) kind=example ;;
  esac
  cp "$path" "$out/$kind-$name"
done
git rev-parse --short HEAD > "$out/COMMIT"
git diff --quiet HEAD -- src csrc tests benches examples build.rs || echo "+dirty" >> "$out/COMMIT"
ls -la "$out"
tar -C .device -cf - candle | xz -6 -T2 > .device/candle.tar.xz
rm -rf "$out"
cp scripts/device/candle.sh .device/
du -sh .device/candle.tar.xz
