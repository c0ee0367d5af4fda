#!/usr/bin/env bash
# Wheels tools/gpu_check.sh needs on the GPU machine (Python 3.12, no package index there), downloaded
# here into .whl/ (ignored by git; the device tool's `carry`). Pinned as in requirements-latest.txt,
# requirements-cpu.txt and requirements-kernels.txt. mamba-ssm is not carried: it needs a CUDA build for
# that machine's torch, so its backend is measured only where it imports.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=${PIP:-python3 -m pip}
platform=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
          --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
rm -rf .whl && mkdir -p .whl/common .whl/mcore-0.19.2 .whl/mcore-0.16.1
$PIP download -q "${platform[@]}" -d .whl/common fla-core==0.6.0
$PIP download -q "${platform[@]}" -d .whl/mcore-0.19.2 megatron-core==0.19.2
$PIP download -q "${platform[@]}" -d .whl/mcore-0.16.1 megatron-core==0.16.1
du -sh .whl/*
