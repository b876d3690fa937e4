#!/usr/bin/env bash
# Wheels the GPU machine lacks, downloaded here into .whl/ (git-ignored) for the device tool to carry
# (`carry: [".whl"]`); scripts/gpu_check.sh installs them there with --no-index. The machine's image
# has torch, triton, transformers, einops, numpy, safetensors, tokenizers, jinja2, xxhash, uvloop,
# httpx, pytest and pytest-timeout (/work/.library/device/KINDS.md); these are the rest of the
# runtime and test needs, for its Python 3.12.
set -eu
cd "$(dirname "$0")/.."
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d .whl \
    fla-core==0.6.0 fastapi starlette pydantic pydantic-core annotated-types typing-inspection \
    "uvicorn[standard]" httptools python-dotenv watchfiles websockets llguidance pyzmq msgspec openai \
    distro jiter sniffio
du -sh .whl
