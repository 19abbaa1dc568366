"""What a finished (or streaming) generation returns."""

from __future__ import annotations

from dataclasses import dataclass, field


class ErrorCode:
    """Values of `error_code`: why a request finished with "error" or "abort"."""

    NON_FINITE = "non_finite"  # this request's numbers went out of range (its state or parameters): its own fault
    GRAMMAR_DEAD_END = "grammar_dead_end"  # its response_format / forced tool call allows no token of this vocabulary
    ENGINE_ERROR = "engine_error"  # an engine step failed unexpectedly, failing every request in flight
    SHUTDOWN = "shutdown"
    TIMEOUT = "timeout"
    CANCELLED = "cancelled"
    MIGRATED = "migrated"  # stopped at a token boundary to go on in another engine (Engine.suspend / resume)


@dataclass
class GenerationOutput:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    logprobs: list[dict[int, float]] | None = None
    # with SamplingParams.prompt_logprobs: one per prompt token, the first None (nothing precedes it)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    error: str | None = None
    error_code: str | None = None  # an ErrorCode value when finish_reason is "error" or "abort"

    @property
    def outputs(self) -> list[GenerationOutput]:
        """vLLM-style access: `out.outputs[0].text`."""
        return [self]
