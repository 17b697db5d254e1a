#!/usr/bin/env bash
# The GPU check: on a machine with an NVIDIA GPU, run aligner's CubeCL kernel tests on CUDA and
# on wgpu, then time training and generation on the 16M model and a random ~1B Llama.
#
# The GPU machine need not reach a registry or have a Rust toolchain: build the bundle here,
#   tools/gpu_check.sh bundle DIR      # stripped, xz-compressed release binaries and this script
# copy DIR over, and run it there:
#   DIR/gpu_check.sh run               # or: tools/gpu_check.sh run, in a built clone
#
# Run time needs the driver's libcuda.so, and libdevice.10.bc under $CUDA_PATH/nvvm/libdevice
# (PyPI's nvidia-cuda-nvcc-cu12 ships it: CUDA_PATH=.../site-packages/nvidia/cuda_nvcc).
# PEAK_TFLOPS (dense bf16 peak of the GPU; 990 for an H200) turns tokens/s into MFU.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"

bundle() {
  local out="$1" repo target
  repo="$(cd "$here/.." && pwd)"
  target="${CARGO_TARGET_DIR:-$repo/target}"
  mkdir -p "$out/bin"
  # Two configurations: the kernel tests are built per backend.
  "$repo/tools/cuda_sdk.sh"
  for backend in cuda wgpu; do
    CUDARC_CUDA_VERSION="${CUDARC_CUDA_VERSION:-12080}" cargo build --release -p aligner-cli --features "$backend" \
      --manifest-path "$repo/Cargo.toml"
    cp "$target/release/aligner" "$out/bin/aligner-$backend"
    local test_exe
    test_exe=$(CUDARC_CUDA_VERSION="${CUDARC_CUDA_VERSION:-12080}" cargo test --release -p aligner-parallel \
      --features "$backend" --test cube --no-run --message-format=json --manifest-path "$repo/Cargo.toml" 2>/dev/null |
      python3 -c 'import json,sys; print([json.loads(l)["executable"] for l in sys.stdin if "\"executable\":\"" in l][-1])')
    cp "$test_exe" "$out/bin/cube-tests-$backend"
  done
  # NCCL for the gradients (needs OpenMPI's libmpi at run time, so a binary of its own).
  CUDARC_CUDA_VERSION="${CUDARC_CUDA_VERSION:-12080}" cargo build --release -p aligner-cli --features nccl \
    --manifest-path "$repo/Cargo.toml"
  cp "$target/release/aligner" "$out/bin/aligner-nccl"
  strip "$out"/bin/* || true
  # LLVM is linked in statically (~150 MB stripped); xz brings each binary to ~35 MB.
  xz -T0 -6 -f "$out"/bin/*
  # The shipped model is embedded in the binary; the benchmark's other models are random.
  cp "$0" "$out/gpu_check.sh"
  du -sh "$out"/bin/*
  echo "copy $out to the GPU machine and run: $out/gpu_check.sh run"
}

run() {
  local bin="$here/bin"
  [ -d "$bin" ] || bin="$(cd "$here/.." && pwd)/target/release"
  for packed in "$bin"/*.xz; do
    if [ -e "$packed" ] && [ ! -e "${packed%.xz}" ]; then
      xz -dk "$packed"
      chmod +x "${packed%.xz}"
    fi
  done
  export CUBECL_AUTOTUNE_LEVEL="${CUBECL_AUTOTUNE_LEVEL:-balanced}"
  local peak="${PEAK_TFLOPS:-990}"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
  for backend in cuda wgpu; do
    local device=$backend
    [ "$backend" = cuda ] && device=cuda:0
    echo "== kernel tests on $backend"
    if [ -x "$bin/cube-tests-$backend" ]; then
      ALIGNER_TEST_DEVICE="$device" "$bin/cube-tests-$backend" --test-threads 1 || echo "kernel tests on $backend FAILED"
    fi
    local aligner="$bin/aligner-$backend"
    [ -x "$aligner" ] || aligner="$bin/aligner"
    echo "== bench train on $backend (16M, f32)"
    "$aligner" --device "$device" bench --only random-16M train --batch 16 --seq 256 --steps 5 --peak-tflops "$peak" || true
    echo "== bench generate on $backend (16M)"
    "$aligner" --device "$device" bench --only random-16M generate --prompts 64 --new-tokens 128 --batch-sizes 64 || true
  done
  if command -v mpirun >/dev/null && [ -x "$bin/aligner-nccl" ]; then
    # One rank per GPU: on a one-GPU machine NCCL has one rank, which still runs its init, the
    # device copies and every collective of a training step.
    local gpus
    gpus=$(nvidia-smi -L | wc -l)
    echo "== bench train over NCCL ($gpus rank(s), 16M, ZeRO-2)"
    ALIGNER_COMM=nccl mpirun --allow-run-as-root -np "$gpus" -x ALIGNER_COMM "$bin/aligner-nccl" --device cuda \
      bench --only random-16M train --batch $((16 * gpus)) --seq 256 --steps 5 --sharding gradients || true
  fi
  echo "== bench train on cuda (random ~1B Llama, bf16 with f32 master weights)"
  "$bin/aligner-cuda" --device cuda:0 bench --only random-1B --dtype bf16 train --batch 8 --seq 1024 --steps 3 --peak-tflops "$peak" || true
  echo "== the same with Burn's attention instead of aligner's flash-attention kernels"
  "$bin/aligner-cuda" --device cuda:0 bench --only random-1B --dtype bf16 --attention burn train --batch 8 --seq 1024 --steps 3 --peak-tflops "$peak" || true
  echo "== bench generate on cuda (random ~1B Llama, bf16)"
  "$bin/aligner-cuda" --device cuda:0 bench --only random-1B --dtype bf16 generate --prompts 64 --new-tokens 128 --batch-sizes 64 || true
}

case "${1:-run}" in
  bundle) bundle "${2:?usage: gpu_check.sh bundle DIR}" ;;
  run) run ;;
  *) echo "usage: gpu_check.sh bundle DIR | run" >&2; exit 2 ;;
esac
