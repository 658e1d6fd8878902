# Sourced by the device scripts (GPU machine, no Rust): NCCL for the `nccl` tests. cudarc loads
# libnccl.so, which NVIDIA's nvidia-nccl wheel (beside PyTorch there) ships as libnccl.so.2:
# a link under that name, alone in a directory put on LD_LIBRARY_PATH. With fewer than two GPUs
# the tests that need two (named `two_devices`) are skipped: `$SKIP_TWO_DEVICES` goes after a
# test binary's arguments.
nccl_so=$(python3 -c 'import glob, os, site
for p in site.getsitepackages() + [site.getusersitepackages()]:
    for f in sorted(glob.glob(os.path.join(p, "nvidia", "**", "libnccl.so.2"), recursive=True)):
        print(f)' 2>/dev/null | head -1)
if [ -n "$nccl_so" ]; then
  nccl_link=$(mktemp -d)
  ln -sf "$nccl_so" "$nccl_link/libnccl.so"
  export LD_LIBRARY_PATH="$nccl_link${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
# The devices the tests see: CUDA_VISIBLE_DEVICES's, where it is set.
if [ -n "${CUDA_VISIBLE_DEVICES+x}" ]; then
  gpus=$(tr ',' '\n' <<< "$CUDA_VISIBLE_DEVICES" | grep -c .)
else
  gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | wc -l)
fi
SKIP_TWO_DEVICES=""
[ "$gpus" -ge 2 ] || SKIP_TWO_DEVICES="--skip two_devices"
