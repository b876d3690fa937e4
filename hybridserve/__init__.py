"""hybridserve: a serving engine for hybrid (Gated DeltaNet + attention) LLMs with a joint prefix cache.

Importing it has no side effect: nothing loads torch until `LLM` is used, and process settings are
applied when an engine starts (`engine.threads.apply_process_settings`).
"""

from hybridserve.sampling_params import CompletionOutput, RequestOutput, SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "StructuredOutputsParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """`LLM` loads on first use, so processes that only need the model (tensor-parallel
    workers) do not import the engine, its grammar library and the tokenizer stack."""
    if name == "LLM":
        from hybridserve.api import LLM

        return LLM
    raise AttributeError(f"module 'hybridserve' has no attribute {name!r}")
