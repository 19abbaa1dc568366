"""Engine configuration: one dataclass, validated on creation."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineConfig:
    n_slots: int = 8  # state slots on the device: the most sequences running at once
    max_queue: int = 256  # waiting requests beyond which submit() refuses with QueueFull
    token_budget: int = 512  # tokens fed to the model per step, decode and prefill together
    prefill_chunk: int = 256  # most prompt tokens one request feeds per step
    request_timeout: float | None = None  # seconds from arrival; None = no limit
    device: str = "cpu"

    def __post_init__(self) -> None:
        for name in ("n_slots", "max_queue", "token_budget", "prefill_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.token_budget < self.n_slots:
            raise ValueError("token_budget must be at least n_slots, so every running sequence can decode each step")
        if self.request_timeout is not None and self.request_timeout <= 0:
            raise ValueError("request_timeout must be positive")
