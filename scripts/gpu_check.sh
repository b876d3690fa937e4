#!/usr/bin/env bash
# The CUDA checks in one run (bfloat16 on cuda:0): the `cuda`-marked tests, a served request through
# the engine-core process, the TP plan check, then the GPU benchmarks. Figures go to docs/benchmarks.md.
# Usage: scripts/gpu_check.sh OUTDIR   (from the repository root, with the runtime and test packages)
set -u
out=${1:-gpu-check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
hs=(python3 -m hybridserve.cli)  # an array, not a function: `timeout` and `&` need a command

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} >"$out/env.txt" 2>&1

timeout 150 python3 -m pytest -m cuda -q -rA -p no:cacheprovider --timeout 120 \
    tests/engine/test_cuda.py tests/models/test_parity.py >"$out/cuda_tests.log" 2>&1
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
  echo "== bench ttft";   timeout 90 "${hs[@]}" bench ttft --device cuda --json "$out/ttft.json"
  echo "== bench decode"; timeout 90 "${hs[@]}" bench decode --device cuda --variants bfloat16 float32 int8 --json "$out/decode.json"
  echo "== bench engine"; timeout 150 "${hs[@]}" bench engine --device cuda --json "$out/engine.json"
} >"$out/bench.log" 2>&1
