#!/usr/bin/env bash
# Regenerates sys/bindings/cuda_13000.rs, the committed fallback bindings, from the CUDA 13.0
# headers (PyPI: nvidia-cuda-runtime==13.0.96), with the same build script that generates them at
# build time. Needs libclang (apt: libclang-dev) and python3 (no pip: .ci/fetch-cuda-headers fetches
# the wheel). CI checks that the result is unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 .ci/fetch-cuda-headers "$tmp/h" nvidia-cuda-runtime==13.0.96
CUDA_PATH="$tmp/h/nvidia/cu13" CUDRV_SYS_WRITE_BINDINGS="$PWD/sys/bindings/cuda_13000.rs" \
  CARGO_TARGET_DIR="$tmp/target" cargo build -p cudrv-sys
echo "wrote sys/bindings/cuda_13000.rs"
