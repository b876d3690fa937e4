"""hybridserve: a serving engine for hybrid (Gated DeltaNet + attention) LLMs with a joint prefix cache."""

from hybridserve.api import LLM
from hybridserve.sampling_params import RequestOutput, SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
