# PyTorch's CPU wheel index comes first (its +cpu builds outrank PyPI's CUDA build of the same
# version), PyPI and local wheel folders after it, so no machine pulls the multi-GB CUDA build that a
# bare `torch` requirement would; an unreachable index costs a few retries, then the fallback.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: setup run generate lint test test-all bench bench-peer clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q --retries 1 \
		--extra-index-url "$(TORCH_INDEX)" "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test,bench]"
	touch $@

setup: $(VENV)/.installed

run: setup
	$(VENV)/bin/hybridserve serve

generate: setup
	$(VENV)/bin/hybridserve generate --prompt "The joint prefix cache" --max-tokens 32

# Lint: ruff on the package, tests, benchmarks and scripts; mypy with pyproject.toml's [tool.mypy]
# (the package, strict on hybridserve.cache and hybridserve.engine).
# Both always run, so that one run reports every finding; either failing fails the target.
lint: setup
	@status=0; \
	echo "ruff check hybridserve tests benchmarks scripts"; \
	$(VENV)/bin/ruff check hybridserve tests benchmarks scripts || status=1; \
	echo "mypy"; \
	$(VENV)/bin/mypy || status=1; \
	exit $$status

test: setup
	$(PY) -m pytest -q

test-all: setup
	$(PY) -m pytest -q -m "slow or not slow"

bench: setup
	$(VENV)/bin/hybridserve bench all

# hybridserve vs native llama.cpp (llama-server, llama-bench) built from the llama-cpp-python sdist
# into bench-out/llama.cpp on the first run (a long compile); arguments: make bench-peer PEER_ARGS="...".
bench-peer: setup
	$(PY) -m pip install -q -e ".[peer]"
	PYTHON=$(PY) benchmarks/peer/build_llama_cpp.sh bench-out/llama.cpp
	$(PY) -m benchmarks.peer --llama-cpp-dir bench-out/llama.cpp $(PEER_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
