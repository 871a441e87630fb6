#!/usr/bin/env bash
# Downloads what a GPU machine without network access needs beside the package's wheel to run the whole test suite
# and the notebook: the test extra's transformers and the notebook's nbclient, nbformat and ipykernel, with their
# dependencies, as wheels for CPython 3.12 on x86_64 Linux, into DIR (default .whl/extra). Packages the GPU image
# already provides (numpy, pyyaml, regex, safetensors, hf_xet, psutil, tzdata; jax, pytest and matplotlib are not
# asked for) are left out, so that .whl/ stays within what a run carries. Then:
#   carry .whl; EXTRA_WHEELS=.whl/extra bash bench/gpu_session.sh ...   (or bash bench/gpu_verify.sh)
# Usage: bash bench/gpu_wheels.sh [DIR]
set -euo pipefail
dir=${1:-.whl/extra}
PY=${PYTHON:-python3}
mkdir -p "$dir"
"$PY" -m pip download -q --dest "$dir" --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any \
  "transformers==5.25.0" "nbclient>=0.10" "nbformat>=5.10" "ipykernel>=6.29"
for have in numpy pyyaml PyYAML regex safetensors hf_xet psutil tzdata; do
  rm -f "$dir/$have"-*.whl
done
du -sh "$dir"
