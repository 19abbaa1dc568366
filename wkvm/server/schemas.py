"""Request bodies of the HTTP API (OpenAI-compatible fields plus wkvm's extensions)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Seed = Field(default=None, ge=-(2**63), le=2**64 - 1)


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(Body):
    include_usage: bool = False


class SamplingFields(Body):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=-1, ge=-1)
    min_p: float = Field(default=0.0, ge=0, le=1)
    seed: int | None = Seed
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    repetition_penalty: float = Field(default=1.0, gt=0, le=10)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    return_token_ids: bool = False


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    n: int = Field(default=1, ge=1, le=16)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1, le=16)
    state: str | None = None  # start from this state handle; the prompt is the continuation
    save_state: str | None = None  # save the final state under this name


class ContentPart(Body):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(Body):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    n: int = Field(default=1, ge=1, le=16)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None
    state: str | None = None
    save_state: str | None = None


class CreateStateRequest(Body):
    name: str
    prompt: str | None = None
    prompt_ids: list[int] | None = None


class ForkRequest(Body):
    name: str


class StateGenerateRequest(SamplingFields):
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    logprobs: int | None = Field(default=None, ge=0, le=20)
    save_as: str | None = None


class MutateRequest(Body):
    rule: str
    params: dict[str, Any] = Field(default_factory=dict)


class HibernateRequest(Body):
    tier: Literal["host", "disk"] = "disk"
