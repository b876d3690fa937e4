#!/usr/bin/env bash
# The CUDA checks in one run (bfloat16 on cuda:0): the `cuda`-marked tests, a served request through
# the engine-core process, the TP plan check, then the GPU benchmarks. Figures go to docs/benchmarks.md.
# Usage: scripts/gpu_check.sh OUTDIR   (from the repository root, with the runtime and test packages)
# Missing packages travel as wheels in .whl/ (scripts/gpu_wheels.sh, run here; the device has no
# registry): installed below with --no-index. GPU_MODEL=dir benches that checkpoint instead of the
# built-in model (e.g. a random Qwen3.5-0.8B-shaped one); the GDN benchmarks run with the Triton path
# and with HYBRIDSERVE_GDN_KERNELS=torch side by side.
set -u
out=${1:-gpu-check}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      >"$out/wheels.log" 2>&1 || echo "wheel install failed: $out/wheels.log"
  export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
model=(${GPU_MODEL:+--model "$GPU_MODEL"})
hs=(python3 -m hybridserve.cli)  # an array, not a function: `timeout` and `&` need a command

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  python3 -c "import triton, fla; print('triton', triton.__version__, 'fla', fla.__version__)"
} >"$out/env.txt" 2>&1

TRITON_INTERPRET=0 timeout 200 python3 -m pytest -m "cuda or triton" -q -rA -p no:cacheprovider --timeout 120 \
    tests/engine/test_cuda.py tests/models/test_parity.py tests/kernels/test_triton_gdn.py >"$out/cuda_tests.log" 2>&1
echo "cuda tests rc=$?" | tee -a "$out/env.txt"

{
  echo "== serve (engine-core process, default memory plan)"
  "${hs[@]}" serve --device cuda --port 8011 >"$out/serve.log" 2>&1 &
  server=$!
  for _ in $(seq 60); do curl -sf localhost:8011/health >/dev/null && break; sleep 1; done
  curl -s localhost:8011/v1/completions -H 'content-type: application/json' \
       -d '{"model": "hybridserve-builtin", "prompt": "The joint prefix cache", "max_tokens": 8, "temperature": 0}'
  echo; curl -s localhost:8011/health; echo
  kill -TERM $server  # background jobs of a script ignore SIGINT
  for _ in $(seq 30); do kill -0 $server 2>/dev/null || break; sleep 1; done
  kill -0 $server 2>/dev/null && { echo "serve did not stop in 30 s"; kill -KILL $server; }
  wait $server; echo "serve rc=$?"
  echo "== TP=2 on one GPU (must be refused before any process starts)"
  timeout 30 "${hs[@]}" generate --device cuda -tp 2 --max-tokens 4; echo "rc=$?"
  for gdn in triton torch; do  # the GDN layers on Triton kernels, then on PyTorch ops
    export HYBRIDSERVE_GDN_KERNELS=$gdn
    echo "== [$gdn] bench engine (4160-token cold prefill, batch-1 decode, batch 64 over 1, vs transformers)"
    timeout 120 "${hs[@]}" bench engine --device cuda "${model[@]}" --batch-size 64 --json "$out/engine_$gdn.json"
    echo "== [$gdn] bench ttft";   timeout 60 "${hs[@]}" bench ttft --device cuda "${model[@]}" --json "$out/ttft_$gdn.json"
  done
  unset HYBRIDSERVE_GDN_KERNELS
  echo "== bench decode"; timeout 60 "${hs[@]}" bench decode --device cuda "${model[@]}" --variants bfloat16 --json "$out/decode.json"
} >"$out/bench.log" 2>&1
