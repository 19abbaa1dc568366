"""What a finished (or streaming) generation returns."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GenerationOutput:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    logprobs: list[dict[int, float]] | None = None
    error: str | None = None

    @property
    def outputs(self) -> list[GenerationOutput]:
        """vLLM-style access: `out.outputs[0].text`."""
        return [self]
