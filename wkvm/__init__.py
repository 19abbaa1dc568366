"""wkvm: a state-native inference engine for recurrent language models."""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

# Large CPU tensors (weights, oneDNN's packed copies, state arenas, KV pools) on transparent huge pages: torch's CPU
# allocator aligns allocations of 2 MiB and more to 2 MiB and madvises them MADV_HUGEPAGE when this is set, read at
# its first allocation (so it is set here, before wkvm allocates anything). A decode step streams every weight
# once; on 4 KiB pages that is a TLB miss every 4 KiB (bench/huge_pages.py: fp32 decode B=1 1.09-1.22x on 2 MiB).
# THP_MEM_ALLOC_ENABLE=0 keeps 4 KiB pages; a kernel with THP "never" ignores it.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

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
