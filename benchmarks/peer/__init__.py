"""hybridserve against native llama.cpp (`llama-server`, `llama-bench`, `llama-batched-bench`) on
the same weights: `python -m benchmarks.peer`, after `benchmarks/peer/build_llama_cpp.sh`."""
