#!/usr/bin/env bash
# Wheels that let scripts/gpu_check.sh run on a GPU machine that cannot reach a package index
# but already has CUDA torch, numpy, tokenizers, safetensors, huggingface_hub and peft (the
# lent H200 image): Crucible's own pins that such an image lacks or holds at another version,
# for CPython 3.12 on x86-64. DeepSpeed ships only an sdist; it is built here into a pure-Python
# wheel (its CUDA ops are JIT-compiled on first use on the GPU machine).
#
#   bash scripts/gpu_wheels.sh [DIR]       # default .whl; then on the GPU machine:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   PYTHONPATH=/tmp/site PY=python3 GPU_CHECK_OUT=/tmp/gc bash scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
mkdir -p "$DIR"
PLAT=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform any)
FETCH=(python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp
       "${PLAT[@]}" -d "$DIR")
"${FETCH[@]}" pydantic  # with its dependencies: it pins pydantic-core exactly
"${FETCH[@]}" --no-deps hjson regex orjson "transformers>=5.24,<5.25"
if ! ls "$DIR"/deepspeed-0.19.8-*.whl >/dev/null 2>&1; then
    [ -x .venv/bin/pip ] || { echo "build .venv first (make lint)"; exit 1; }
    tmp=$(mktemp -d)
    python3 -m pip download -q --no-deps --no-binary=:all: -d "$tmp" deepspeed==0.19.8
    DS_BUILD_OPS=0 .venv/bin/pip wheel -q --no-deps --no-build-isolation -w "$DIR" "$tmp"/deepspeed-*
    rm -rf "$tmp"
fi
ls -la "$DIR"
