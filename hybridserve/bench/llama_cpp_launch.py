"""llama.cpp (llama-cpp-python) for `bench peer`, optionally without its extra buffer types.

llama.cpp moves some weights into "extra" buffer types when it loads a model: on an x86 CPU with
AMX the quantized matrices go to its AMX buffer, and on others to repacked (interleaved) layouts.
On the AVX-512/AMX host of BENCHMARKS.md, llama-cpp-python 0.3.36 crashes (signal 11) in the first
evaluation of a q8_0 file with them and runs it without them. `llama_model_params.use_extra_bufts`
switches them off, but neither `Llama(...)` nor `llama_cpp.server` takes it, so this module
replaces llama-cpp-python's default model parameters. It imports nothing of hybridserve's, so
llama.cpp's server process stays as light as when run directly:

    python -m hybridserve.bench.llama_cpp_launch --no-extra-bufts [llama_cpp.server arguments]
"""

from __future__ import annotations

import sys

NO_EXTRA_BUFTS = "--no-extra-bufts"


def disable_extra_buffer_types() -> None:
    """Make every model this process loads with llama-cpp-python keep its weights in plain CPU
    buffers (`use_extra_bufts = False`); a clear error when the build has no such parameter."""
    import llama_cpp.llama_cpp as lib

    if not any(name == "use_extra_bufts" for name, _ in lib.llama_model_params._fields_):
        raise RuntimeError("this llama-cpp-python build has no llama_model_params.use_extra_bufts; "
                           "upgrade it to run without llama.cpp's extra buffer types")
    default_params = lib.llama_model_default_params

    def plain_buffer_params() -> "lib.llama_model_params":
        params = default_params()
        params.use_extra_bufts = False
        return params

    lib.llama_model_default_params = plain_buffer_params


def server_argv(extra_bufts: bool) -> list[str]:
    """The command line prefix that starts llama-cpp-python's OpenAI server."""
    if extra_bufts:
        return [sys.executable, "-m", "llama_cpp.server"]
    return [sys.executable, "-m", __name__, NO_EXTRA_BUFTS]


def main(argv: list[str]) -> None:
    """Run `llama_cpp.server` with `argv`, without extra buffer types if NO_EXTRA_BUFTS leads it."""
    if argv[:1] == [NO_EXTRA_BUFTS]:
        disable_extra_buffer_types()
        argv = argv[1:]
    from llama_cpp.server.__main__ import main as server_main

    sys.argv = ["llama_cpp.server", *argv]
    server_main()


if __name__ == "__main__":
    main(sys.argv[1:])
