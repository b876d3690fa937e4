#!/usr/bin/env bash
# The CUDA checks in one run (bfloat16 on cuda:0), most wanted first: the `cuda`-marked tests (with
# the lower cache tiers on CUDA), the tier TTFT benchmark (host memory and disk against the
# device pools), a served request through the engine-core process and the TP=2 refusal on one GPU,
# then the GPU benchmarks (GDN on Triton kernels and on PyTorch ops). Figures go to docs/benchmarks.md.
# Usage: scripts/gpu_check.sh OUTDIR   (from the repository root, with the runtime and test packages)
# Missing packages travel as wheels in .whl/ (scripts/gpu_wheels.sh, run here; the device has no
# registry): installed below with --no-index. GPU_SHAPE=qwen3.5-0.8b (the default; "builtin" for the
# built-in model) benches a random checkpoint of that published shape, written first. The whole run
# stays inside GPU_BUDGET_S seconds (default 480): each step's timeout is cut to what is left, the
# most wanted figures first.
set -u
out=${1:-gpu-check}
mkdir -p "$out"
start=$SECONDS
budget=${GPU_BUDGET_S:-480}
left() { local l=$((budget - (SECONDS - start))); local t=$1; ((l < t)) && t=$l; ((t < 1)) && t=1; echo $t; }
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      >"$out/wheels.log" 2>&1 || echo "wheel install failed: $out/wheels.log"
  export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
hs=(python3 -m hybridserve.cli)  # an array, not a function: `timeout` and `&` need a command

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  python3 -c "import triton, fla; print('triton', triton.__version__, 'fla', fla.__version__)"
} >"$out/env.txt" 2>&1

shape=${GPU_SHAPE:-qwen3.5-0.8b}
model=()
if [[ $shape != builtin ]]; then
  timeout "$(left 90)" python3 scripts/shaped_checkpoint.py "$shape" /tmp/gpu-model >>"$out/env.txt" 2>&1 \
      && model=(--model /tmp/gpu-model)
fi
echo "model: ${model[*]:-built-in} ($((SECONDS - start)) s)" | tee -a "$out/env.txt"

# Order: what is most wanted first (each step's timeout is cut to what is left). A step that runs
# out of time is stopped with SIGINT (pytest still prints its summary) or SIGABRT (with
# PYTHONFAULTHANDLER, Python prints every thread's stack: where it was stuck).
export PYTHONFAULTHANDLER=1
TRITON_INTERPRET=0 timeout -s INT -k 10 "$(left 150)" python3 -m pytest -m "cuda or triton" -q -rA \
    -p no:cacheprovider --timeout 60 tests/engine/test_cuda.py tests/models/test_parity.py \
    tests/kernels/test_triton_gdn.py >"$out/cuda_tests.log" 2>&1
echo "cuda tests rc=$? ($((SECONDS - start)) s)" | tee -a "$out/env.txt"

{
  echo "== [triton] tier TTFT (4096-token prefix restored from device, pinned host, disk, after a restart)"
  HYBRIDSERVE_GDN_KERNELS=triton timeout -s ABRT -k 10 "$(left 100)" python3 -m benchmarks.tier_ttft \
      --device cuda "${model[@]}" --rounds 3 --json "$out/tier_ttft.json" --profile "$out/tier_profile.txt"
  echo "rc=$? ($((SECONDS - start)) s)"
} >"$out/tier.log" 2>&1

{
  echo "== serve (engine-core process, default memory plan, built-in model)"
  "${hs[@]}" serve --device cuda --port 8011 >"$out/serve.log" 2>&1 &
  server=$!
  for _ in $(seq "$(left 60)"); do curl -sf localhost:8011/health >/dev/null && break; sleep 1; done
  curl -s -m 20 localhost:8011/v1/completions -H 'content-type: application/json' \
       -d '{"model": "hybridserve-builtin", "prompt": "The joint prefix cache", "max_tokens": 8, "temperature": 0}'
  echo; curl -s -m 5 localhost:8011/health; echo
  kill -TERM $server  # background jobs of a script ignore SIGINT
  for _ in $(seq 15); do kill -0 $server 2>/dev/null || break; sleep 1; done
  kill -0 $server 2>/dev/null && { echo "serve did not stop in 15 s"; kill -KILL $server; }
  wait $server; echo "serve rc=$? ($((SECONDS - start)) s)"
  echo "== TP=2 on one GPU (must be refused before any process starts)"
  timeout "$(left 20)" "${hs[@]}" generate --device cuda -tp 2 --max-tokens 4; echo "rc=$?"
} >"$out/serve_check.log" 2>&1

{
  echo "== [triton] bench engine (4160-token cold prefill, batch-1 decode, batch 64 over 1, vs transformers)"
  HYBRIDSERVE_GDN_KERNELS=triton timeout -s ABRT -k 10 "$(left 120)" "${hs[@]}" bench engine --device cuda \
      "${model[@]}" --batch-size 64 --iterations 3 --json "$out/engine_triton.json"
  echo "rc=$? ($((SECONDS - start)) s)"
  echo "== [triton] bench ttft (cache off vs on)"
  HYBRIDSERVE_GDN_KERNELS=triton timeout -s ABRT -k 10 "$(left 70)" "${hs[@]}" bench ttft --device cuda \
      "${model[@]}" --cached-tokens 1024 4096 --iterations 5 --json "$out/ttft_triton.json"
  echo "rc=$? ($((SECONDS - start)) s)"
  echo "== [torch] bench engine (the GDN layers on PyTorch ops)"
  HYBRIDSERVE_GDN_KERNELS=torch timeout -s ABRT -k 10 "$(left 100)" "${hs[@]}" bench engine --device cuda \
      "${model[@]}" --batch-size 64 --iterations 3 --json "$out/engine_torch.json"
  echo "rc=$? ($((SECONDS - start)) s)"
} >"$out/bench.log" 2>&1
