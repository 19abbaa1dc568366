"""What a finished (or streaming) generation returns."""

from __future__ import annotations

from dataclasses import dataclass, field


class ErrorCode:
    """Values of `error_code`: why a request finished with "error" or "abort"."""

    NON_FINITE = "non_finite"  # this request's numbers went out of range (its state or parameters): its own fault
    GRAMMAR_DEAD_END = "grammar_dead_end"  # its response_format / forced tool call allows no token of this vocabulary
    NO_TOKEN_LEFT = "no_token_left"  # its token masks (allowed_token_ids, bad_words, min_tokens, grammar) leave none
    ENGINE_ERROR = "engine_error"  # an engine step failed unexpectedly, failing every request in flight
    SHUTDOWN = "shutdown"
    TIMEOUT = "timeout"
    CANCELLED = "cancelled"
    MIGRATED = "migrated"  # stopped at a token boundary to go on in another engine (Engine.suspend / resume)
    OWN_FAULTS = (NON_FINITE, GRAMMAR_DEAD_END, NO_TOKEN_LEFT)  # the request's own input: a 400 over HTTP


@dataclass
class GenerationOutput:
    """One prompt's generation: vLLM's RequestOutput and its one CompletionOutput in one object (`outputs` is
    `[self]`). Logprobs are plain floats (vLLM's are `Logprob` objects: read `.logprob` there)."""

    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    logprobs: list[dict[int, float]] | None = None
    # with SamplingParams.prompt_logprobs: one per prompt token, the first None (nothing precedes it)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    error: str | None = None
    error_code: str | None = None  # an ErrorCode value when finish_reason is "error" or "abort"
    prompt: str | None = None  # the prompt's text as given (None for token ids), as vLLM's RequestOutput.prompt
    request_id: str | None = None
    index: int = 0  # vLLM's CompletionOutput.index
    # vLLM's: the stop_token_ids token or stop string that ended a "stop" (None for an end-of-sequence token, a
    # completed response_format, or another finish)
    stop_reason: int | str | None = None

    @property
    def outputs(self) -> list[GenerationOutput]:
        """vLLM-style access: `out.outputs[0].text`."""
        return [self]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def cumulative_logprob(self) -> float | None:
        """The sum of the generated tokens' logprobs when `SamplingParams.logprobs` asked for them, else None (vLLM)."""
        if self.logprobs is None:
            return None
        return float(sum(lp[t] for lp, t in zip(self.logprobs, self.token_ids, strict=False) if t in lp))
