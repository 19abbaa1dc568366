"""wkvm: a state-native inference engine for recurrent language models."""

from wkvm.llm import LLM
from wkvm.outputs import GenerationOutput
from wkvm.sampling_params import SamplingParams

__all__ = ["LLM", "GenerationOutput", "SamplingParams"]
__version__ = "0.1.0"
