#!/usr/bin/env bash
# Sets up the LLVM 23 that `--features cuda` builds against, without the network access the
# build would otherwise need.
#
# burn/cuda → cubecl-cuda → cubecl-llvm (LLVM's NVPTX back end compiles the kernels) → the
# build dependency tracel-llvm-bundler 23.1.0-4, whose build script downloads an LLVM 23
# bundle from GitHub unless `${XDG_DATA_HOME:-~/.local/share}/tracel/tracel-llvm-23.1.0-4/
# .tracel-llvm-installed` exists; then it only runs that folder's `bin/llvm-config`.
#
# PyPI ships the same thing as wheels: `mlc-llvm-static` (a relocatable static LLVM 23.1.1
# with `llvm-config`) and `mlc-llvm-static-extra-targets` (the NVPTX back end among others).
# This script downloads both once into a cache outside the clone, unpacks them into one
# prefix, links the bundler's folder to it and writes the sentinel. Running it again is free.
# Debian's llvm-22 does not work: LLVM 23 renumbered C enums that pliron-llvm relies on.
#
#   tools/cuda_sdk.sh            # then: cargo build --release -p aligner-cli --features cuda
#   ALIGNER_LLVM_CACHE=/some/dir tools/cuda_sdk.sh
set -euo pipefail

version="23.1.1.post0"
bundle="tracel-llvm-23.1.0-4"
cache="${ALIGNER_LLVM_CACHE:-$HOME/.cache/aligner/llvm-$version}"
data="${XDG_DATA_HOME:-$HOME/.local/share}/tracel"
target="$data/$bundle"
prefix="$cache/unpacked/mlc_llvm_static/static"

if [ -e "$target/.tracel-llvm-installed" ] && [ -x "$target/bin/llvm-config" ]; then
  echo "LLVM for the cuda build is ready: $target -> $(readlink -f "$target")"
  exit 0
fi

if [ ! -x "$prefix/bin/llvm-config" ]; then
  mkdir -p "$cache/wheels"
  python3 -m pip --version >/dev/null 2>&1 || { echo "tools/cuda_sdk.sh needs python3 with pip" >&2; exit 1; }
  python3 -m pip download --quiet --no-deps --only-binary=:all: \
    --platform manylinux_2_28_x86_64 --python-version 3.11 \
    -d "$cache/wheels" \
    "mlc-llvm-static==$version" "mlc-llvm-static-extra-targets==$version"
  rm -rf "$cache/unpacked.partial"
  mkdir -p "$cache/unpacked.partial"
  for wheel in "$cache"/wheels/*.whl; do
    python3 -m zipfile -e "$wheel" "$cache/unpacked.partial"
  done
  chmod +x "$cache/unpacked.partial/mlc_llvm_static/static/bin/"* 2>/dev/null || true
  rm -rf "$cache/unpacked"
  mv "$cache/unpacked.partial" "$cache/unpacked"
fi

"$prefix/bin/llvm-config" --version | grep -q '^23\.' || { echo "$prefix/bin/llvm-config is not LLVM 23" >&2; exit 1; }
"$prefix/bin/llvm-config" --targets-built | grep -qw NVPTX || { echo "$prefix has no NVPTX back end" >&2; exit 1; }

mkdir -p "$data"
rm -rf "$target"
ln -s "$prefix" "$target"
touch "$target/.tracel-llvm-installed"
echo "LLVM $("$prefix/bin/llvm-config" --version) with NVPTX for the cuda build: $target -> $prefix"
