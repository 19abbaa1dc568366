"""Engine configuration: one dataclass, validated on creation."""

from __future__ import annotations

from dataclasses import dataclass, field


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


@dataclass
class ServerConfig:
    model: str | None = None
    device: str = "cpu"  # "cuda" with a CUDA build of torch
    dtype: str = "float32"  # storage of the large matrices, embedding and head: float32 or bfloat16
    weight_cache_layers: int = 0  # > 0: stream a weight pack through an LRU cache of this many layers
    read_ahead: bool = True
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: list[str] = field(default_factory=list)
    served_model_name: str | None = None
    slots: int = 8
    max_queue: int = 256
    token_budget: int = 512
    prefill_chunk: int = 256
    request_timeout: float | None = None
    state_dir: str | None = None  # None: a fresh temporary directory (states do not outlive the process)
    state_device_bytes: int = 256 << 20
    state_host_bytes: int = 1 << 30
    state_disk_quota: int | None = None
    verify_state_loads: bool = False
    max_body_bytes: int = 256 << 20
    max_prompt_tokens: int = 1 << 17
    max_tokens_limit: int = 1 << 14  # the most tokens one request may ask to generate
    prefix_reuse: bool = True
    max_chat_sessions: int = 1024
    chat_session_ttl: float = 24 * 3600.0
    checkpoint_bytes: int = 1 << 30  # prefix-reuse checkpoints kept before LRU eviction
    shutdown_grace: float = 10.0  # seconds running requests get to finish after SIGTERM before they are ended

    def __post_init__(self) -> None:
        weight_dtype(self.dtype)  # raises a ValueError naming the choices
        if not self.shutdown_grace >= 0:
            raise ValueError("shutdown_grace must be >= 0 seconds")
        if not 0 < self.port < 65536:
            raise ValueError("port must be in 1..65535")
        for name in ("slots", "max_queue", "max_body_bytes", "max_prompt_tokens", "max_tokens_limit"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")

    def engine_config(self) -> EngineConfig:
        device = self.device
        return EngineConfig(
            n_slots=self.slots, max_queue=self.max_queue, token_budget=max(self.token_budget, self.slots),
            prefill_chunk=self.prefill_chunk, request_timeout=self.request_timeout, device=device,
        )  # fmt: skip


WEIGHT_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}


def weight_dtype(name: str):
    """'float32' / 'fp32' or 'bfloat16' / 'bf16' -> the torch dtype weights are stored in."""
    import torch

    if str(name).lower() not in WEIGHT_DTYPES:
        raise ValueError(f"dtype {name!r} is not supported; use float32 or bfloat16")
    return getattr(torch, WEIGHT_DTYPES[str(name).lower()])
