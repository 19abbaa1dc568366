"""SamplingParams: what a request asks of the sampler (names follow vLLM and the OpenAI API)."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_STOP_STRINGS = 4
MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k logprobs per generated token (the chosen token is always included)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        checks = [
            (self.max_tokens >= 1, "max_tokens", "must be at least 1"),
            (self.temperature >= 0, "temperature", "must be >= 0"),
            (0 < self.top_p <= 1, "top_p", "must be in (0, 1]"),
            (self.top_k >= 0, "top_k", "must be >= 0 (0 or -1 disables it)"),
            (0 <= self.min_p <= 1, "min_p", "must be in [0, 1]"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]"),
            (self.repetition_penalty > 0, "repetition_penalty", "must be > 0"),
            (len(self.stop) <= MAX_STOP_STRINGS, "stop", f"at most {MAX_STOP_STRINGS} stop strings"),
            (all(self.stop), "stop", "stop strings must be non-empty"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs", f"must be 0..{MAX_LOGPROBS}"),
        ]
        for ok, name, why in checks:
            if not ok:
                raise InvalidParam(name, f"{name} {why}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def uses_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


class InvalidParam(ValueError):
    """A request parameter out of range; `param` names the field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param
