#!/usr/bin/env bash
# Wheels the GPU machine lacks, downloaded here into .whl/ (git-ignored) for the device tool to carry
# (`carry: [".whl"]`); scripts/gpu_check.sh installs them there with --no-index. The machine's image
# has torch, triton, transformers, einops, numpy, safetensors, tokenizers, jinja2, xxhash, uvloop,
# httpx, pytest and pytest-timeout (/work/.library/device/KINDS.md); these are the rest of the
# runtime and test needs, for its Python 3.12, at the versions the local .venv has (`make setup`).
set -eu
cd "$(dirname "$0")/.."
names=(fla-core fastapi annotated-doc starlette pydantic pydantic-core annotated-types typing-inspection
       uvicorn httptools python-dotenv watchfiles websockets llguidance pyzmq msgspec openai distro jiter
       sniffio httpx httpcore h11 anyio opentelemetry-api httpx2 httpcore2 truststore typing-extensions)
# The versions the local venv tested (a newer fastapi or openai pulls packages the device lacks).
pins=()
for name in "${names[@]}"; do
  version=$(.venv/bin/python -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p')
  pins+=("$name${version:+==$version}")
done
rm -rf .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_39_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d .whl "${pins[@]}"
du -sh .whl
