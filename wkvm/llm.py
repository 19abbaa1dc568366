"""The offline Python API: `LLM(model=path).generate(prompts, SamplingParams(...))`, batched by the engine."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, cast

from wkvm.config import EngineConfig, default_model
from wkvm.engine.engine import Engine
from wkvm.outputs import GenerationOutput
from wkvm.sampling_params import SamplingParams
from wkvm.tokenizer import Tokenizer
from wkvm.weights.loader import load_model, load_text_tools

Prompt = str | Sequence[int]


class LLM:
    def __init__(
        self,
        model: str | os.PathLike[str] | None = None,
        tokenizer: str | os.PathLike[str] | None = None,
        config: EngineConfig | None = None,
        weight_cache_layers: int = 0,
        read_ahead: bool = True,
        dtype: str = "float32",
        **config_kwargs: Any,
    ):
        """`model`: a path (a BlinkDL .pth, an HF/fla directory, a GGUF file, a weight pack), by default the embedded
        model. `weight_cache_layers` > 0 streams a weight pack's layers from disk through a cache of that many;
        `dtype` "bfloat16" stores the large matrices in bf16 (half the memory; arithmetic stays fp32)."""
        config = replace(config or EngineConfig(), **config_kwargs)
        model = default_model() if model is None else model
        self.model = load_model(model, device=config.device, dtype=dtype, weight_cache_layers=weight_cache_layers,
                                read_ahead=read_ahead)  # fmt: skip
        self.tokenizer: Tokenizer = load_text_tools(tokenizer or model, self.model.family)[0]
        self.engine = Engine(self.model, self.tokenizer, replace(config, max_queue=1 << 30))

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        ids = self.tokenizer.encode_prompt(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise ValueError("empty prompt: give at least one token")
        bad = [t for t in ids if not 0 <= t < self.model.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the model's vocabulary (0..{self.model.vocab_size - 1})")
        return ids

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerationOutput]:
        """Run every prompt through the engine's continuous batching; outputs in prompt order."""
        one = isinstance(prompts, str) or (prompts and isinstance(prompts[0], int))
        # checked just above: a str or token ids is one prompt, anything else a sequence of prompts
        batch = [cast(Prompt, prompts)] if one else cast(Sequence[Prompt], prompts)
        encoded = [self.encode_prompt(p) for p in batch]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(encoded)
        else:
            params = list(sampling_params)
            if len(params) != len(encoded):
                raise ValueError(f"{len(params)} sampling params for {len(encoded)} prompts")
        handles = [self.engine.submit(ids, p) for ids, p in zip(encoded, params, strict=True)]
        self.engine.run_until_done()
        return [h.output for h in handles]
