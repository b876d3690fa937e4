"""Every `HYBRIDSERVE_*` environment variable the package reads, declared once in
`ENVIRONMENT_VARIABLES` and read by the typed accessors below when called, never at import (so a
variable set later or by a test's monkeypatch counts). A switch ("bool") is on unless set to `0`,
`false`, `no` or `off` (any case); an empty value means the default.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

_OFF_VALUES = frozenset({"0", "false", "no", "off"})


@dataclass(frozen=True)
class EnvVar:
    """One environment variable the package reads: its name, value type, default and meaning."""

    name: str
    type: str
    default: str
    meaning: str


NATIVE_KERNELS = EnvVar(
    "HYBRIDSERVE_NATIVE_KERNELS", "bool", "1",
    "use the C kernels (compiled on first use); 0 keeps every op on the eager PyTorch path")
AMX = EnvVar(
    "HYBRIDSERVE_AMX", "bool", "1",
    "run bfloat16 and int8 linears of a few rows on AMX tiles where the CPU has them; 0 keeps the GEMV")
ONE_CALL_STEP = EnvVar(
    "HYBRIDSERVE_ONE_CALL_STEP", "bool", "1",
    "run decode and short prefill steps as one call into the C step; 0 runs the model module by module")
HUGE_PAGES = EnvVar(
    "HYBRIDSERVE_HUGE_PAGES", "bool", "1",
    "move large CPU weights into transparent huge pages; 0 keeps them where torch allocated them")
SHM_ALLREDUCE = EnvVar(
    "HYBRIDSERVE_SHM_ALLREDUCE", "bool", "1",
    "all-reduce same-host CPU tensor-parallel ranks through /dev/shm; 0 on any rank keeps gloo")
API_KEY = EnvVar(
    "HYBRIDSERVE_API_KEY", "str", "",
    "API key `hybridserve serve` requires when no --api-key or --api-key-file is given; empty: none")
BLOCK_HASH_SEED = EnvVar(
    "HYBRIDSERVE_BLOCK_HASH_SEED", "str", "",
    "seed (decimal or 0x-hex, 64-bit) keying the xxh3_128 block hash, for hashes stable across processes; "
    "empty: the --disk-cache-dir seed file, else a random seed per engine start")

GDN_KERNELS = EnvVar(
    "HYBRIDSERVE_GDN_KERNELS", "str", "",
    "torch keeps the GDN layers on the PyTorch path on CUDA too; empty: the Triton kernels where they can run")
GRAMMAR_COMPILE_TIMEOUT_S = EnvVar(
    "HYBRIDSERVE_GRAMMAR_COMPILE_TIMEOUT_S", "str", "10",
    "seconds a structured-output request waits for its grammar to compile (off the step loop); "
    "past it the request is refused as an invalid grammar is (400)")

SERVER_DEV_MODE = EnvVar(
    "HYBRIDSERVE_SERVER_DEV_MODE", "bool", "0",
    "serve the operator endpoints (`POST /reset_prefix_cache`), as vLLM's VLLM_SERVER_DEV_MODE does; "
    "off: they answer 404 (any client could empty the cache for everyone)")

ENVIRONMENT_VARIABLES: tuple[EnvVar, ...] = (NATIVE_KERNELS, AMX, ONE_CALL_STEP, HUGE_PAGES, SHM_ALLREDUCE, API_KEY,
                                             BLOCK_HASH_SEED, GDN_KERNELS, GRAMMAR_COMPILE_TIMEOUT_S,
                                             SERVER_DEV_MODE)


def read_flag(variable: EnvVar) -> bool:
    """The on/off value of a "bool" variable now: its default when unset or empty, else off only
    for 0, false, no or off."""
    if variable.type != "bool":
        raise TypeError(f"{variable.name} is a {variable.type} variable, not a bool")
    value = os.environ.get(variable.name, "").strip().lower() or variable.default
    return value not in _OFF_VALUES


def read_str(variable: EnvVar) -> str:
    """The value of a "str" variable now (its default when unset)."""
    if variable.type != "str":
        raise TypeError(f"{variable.name} is a {variable.type} variable, not a str")
    return os.environ.get(variable.name, variable.default)


def _switch(variable: EnvVar) -> Callable[[], bool]:
    """The accessor of a "bool" variable: whether it is on now."""

    def read() -> bool:
        return read_flag(variable)

    read.__name__ = read.__qualname__ = variable.name.removeprefix("HYBRIDSERVE_").lower()
    read.__doc__ = f"{variable.name}: {variable.meaning}"
    return read


native_kernels = _switch(NATIVE_KERNELS)
amx = _switch(AMX)
one_call_step = _switch(ONE_CALL_STEP)
huge_pages = _switch(HUGE_PAGES)
shm_allreduce = _switch(SHM_ALLREDUCE)
server_dev_mode = _switch(SERVER_DEV_MODE)


def api_key() -> str | None:
    """HYBRIDSERVE_API_KEY: the server's fallback API key, or None when unset or empty."""
    return read_str(API_KEY) or None


def grammar_compile_timeout_s() -> float:
    """HYBRIDSERVE_GRAMMAR_COMPILE_TIMEOUT_S: the grammar compile timeout in seconds (ValueError
    unless a positive number)."""
    text = read_str(GRAMMAR_COMPILE_TIMEOUT_S).strip() or GRAMMAR_COMPILE_TIMEOUT_S.default
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{GRAMMAR_COMPILE_TIMEOUT_S.name} must be a positive number of seconds, got {text!r}")
    return value
