#!/usr/bin/env bash
# Build native llama.cpp (`llama-server`, `llama-bench`, `llama-batched-bench`) from the llama.cpp source vendored in the
# llama-cpp-python sdist, so the peer benchmark runs what llama.cpp users run, from the same source
# llama-cpp-python builds. Skips the build when every binary already exists.
#
#   benchmarks/peer/build_llama_cpp.sh [OUT_DIR]      (default: bench-out/llama.cpp)
#
# Environment: LLAMA_CPP_PYTHON_VERSION (sdist version, default: newest), JOBS (default: nproc),
# PYTHON (default: python3), CMAKE_EXTRA (extra cmake arguments).
set -euo pipefail

out_dir="$(realpath -m "${1:-bench-out/llama.cpp}")"
python="${PYTHON:-python3}"
jobs="${JOBS:-$(nproc)}"
spec="llama-cpp-python${LLAMA_CPP_PYTHON_VERSION:+==$LLAMA_CPP_PYTHON_VERSION}"

targets=(llama-server llama-bench llama-batched-bench)
missing=()
for target in "${targets[@]}"; do [[ -x "$out_dir/bin/$target" ]] || missing+=("$target"); done
if [[ ${#missing[@]} -eq 0 ]]; then
    echo "already built: ${targets[*]} in $out_dir/bin"
    exit 0
fi
command -v cmake >/dev/null || { echo "cmake is missing (apt-get install -y cmake)" >&2; exit 1; }

mkdir -p "$out_dir/src"
if ! compgen -G "$out_dir/src/llama_cpp_python-*.tar.gz" >/dev/null; then
    "$python" -m pip download --no-deps --no-binary :all: --dest "$out_dir/src" "$spec"
fi
sdist="$(ls "$out_dir"/src/llama_cpp_python-*.tar.gz | sort -V | tail -n 1)"
src="${sdist%.tar.gz}"
[[ -d "$src" ]] || tar -xzf "$sdist" -C "$out_dir/src"
echo "${sdist##*/}" > "$out_dir/SOURCE"

cmake -S "$src/vendor/llama.cpp" -B "$out_dir/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON ${CMAKE_EXTRA:-}
cmake --build "$out_dir/build" --config Release -j "$jobs" --target "${missing[@]}"
mkdir -p "$out_dir/bin"
for target in "${missing[@]}"; do cp "$out_dir/build/bin/$target" "$out_dir/bin/"; done
echo "built: ${missing[*]} in $out_dir/bin"
