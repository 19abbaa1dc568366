"""wkvm: a state-native inference engine for recurrent language models."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from wkvm.llm import LLM
    from wkvm.outputs import GenerationOutput
    from wkvm.sampling_params import SamplingParams

__all__ = ["LLM", "GenerationOutput", "SamplingParams"]
__version__ = "0.1.0"

_EXPORTS = {"LLM": "wkvm.llm", "GenerationOutput": "wkvm.outputs", "SamplingParams": "wkvm.sampling_params"}


def __getattr__(name: str) -> Any:
    # imported on first use: `wkvm --version` and `wkvm states --url` must not pay for importing torch
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'wkvm' has no attribute {name!r}")
