"""hybridserve: a serving engine for hybrid (Gated DeltaNet + attention) LLMs with a joint prefix cache."""

from hybridserve.api import LLM
from hybridserve.sampling_params import CompletionOutput, RequestOutput, SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "StructuredOutputsParams"]
__version__ = "0.1.0"
