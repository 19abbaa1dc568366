"""Request bodies of the HTTP API (OpenAI-compatible fields plus wkvm's extensions).

Types are strict where OpenAI's schema has types: `max_tokens: "5"`, `true` or `2.0` is a 400, not a 5.
Numbers must be finite (JSON's non-standard NaN/Infinity literals are refused). Ranges: docs/http-api.md.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from wkvm.sampling_params import (
    MAX_LOGPROBS,
    MAX_TOP_K,
    MIN_P_RANGE,
    PENALTY_RANGE,
    REPETITION_PENALTY_RANGE,
    TEMPERATURE_RANGE,
    TOP_P_RANGE,
)
from wkvm.server.errors import APIError

Seed = Field(default=None, ge=-(2**63), le=2**64 - 1)
MAX_PROMPTS = 128  # prompts in one /v1/completions list (each is a request in the queue)
# messages in one chat (and a Responses request's input items): 1.2M one-letter messages had held the event loop 7 s
# (validated, tidied and rendered) before their 413
MAX_MESSAGES = 10_000
MAX_STOP_TOKEN_IDS = 64
MAX_TEXT_FIELD = 256  # user, cache_salt


log = logging.getLogger("wkvm.server")
MAX_NOTED = 256  # distinct sets of ignored fields logged (a client inventing names cannot grow the set further)
_noted: set[tuple[str, ...]] = set()


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class NotedBody(Body):
    """A body whose fields this server does not read are logged once per kind and set of names (vLLM's way): the
    top level and its option objects (stream_options, response_format, structured_outputs), whose unknown keys
    (`continuous_usage_stats`, `whitespace_pattern`) had been dropped without a word."""

    @model_validator(mode="before")
    @classmethod
    def note_ignored(cls, data: Any) -> Any:
        if isinstance(data, dict):
            known = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
            # a name with a line break or other control character is logged as its repr: a forged log line otherwise
            ignored = tuple(sorted((str(k) if str(k).isprintable() else repr(str(k)))[:40]
                                   for k in data if k not in known)[:10])  # fmt: skip
            if ignored and (cls.__name__, *ignored) not in _noted and len(_noted) < MAX_NOTED:
                _noted.add((cls.__name__, *ignored))
                log.warning("%s: fields this server does not read, ignored: %s", cls.__name__, ", ".join(ignored))
        return data

    @model_validator(mode="before")
    @classmethod
    def null_is_default(cls, data: Any) -> Any:
        """`null` for a field with a default means that default, as OpenAI's schema (`number | null`) and vLLM
        read it: clients that serialise unset fields as null send `"temperature": null`, `"stream": null`; in the
        option objects too (`stream_options.include_usage: null` had been a 400; hunt, session 46)."""
        if isinstance(data, dict) and None in data.values():
            fields = cls.model_fields
            return {k: v for k, v in data.items()
                    if v is not None or k not in fields or fields[k].is_required() or fields[k].default is None}
        return data


class RequestBody(NotedBody):
    """A request's top level: fields this server does not read are ignored (OpenAI's SDK and clients send new ones),
    and logged once per kind of request and set of names, as vLLM does, so a user learns what had no effect."""


class StreamOptions(NotedBody):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries its choice's usage so far


class JsonSchemaFormat(NotedBody):
    name: str = Field(default="response", max_length=64)
    description: str | None = None
    # the JSON schema itself; `schema` would shadow a BaseModel attribute, so the field reads it under an alias
    definition: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # accepted; the schema is always enforced (docs/http-api.md)


class ResponseFormat(NotedBody):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    definition: dict[str, Any] | None = Field(default=None, alias="schema")  # llama.cpp's json_object + schema

    def as_dict(self) -> dict[str, Any]:
        """The OpenAI shape SamplingParams takes (it checks that json_schema comes with its type). llama.cpp's server
        also reads `{"type": "json_object", "schema": {...}}` as that schema: so does this one."""
        if self.type == "json_object" and self.definition is not None:
            return {"type": "json_schema", "json_schema": {"name": "response", "schema": self.definition}}
        if self.definition is not None:
            raise APIError(400, f"response_format.schema goes with type json_object (llama.cpp's form); with type "
                           f"{self.type!r} use OpenAI's json_schema: {{\"schema\": ...}}", "response_format.schema",
                           "invalid_value")  # fmt: skip
        return self.model_dump(by_alias=True, exclude_none=True)


class StructuredOutputs(NotedBody):
    """vLLM's `structured_outputs`: exactly one kind (SamplingParams checks that)."""

    json_schema: dict[str, Any] | str | None = Field(default=None, alias="json")  # `json` would shadow BaseModel's
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark (vLLM's guidance backend) or GBNF (llama.cpp's, vLLM's xgrammar backend)
    json_object: bool | None = None  # true: any JSON object (response_format json_object)

    def as_dict(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True)


class SamplingFields(RequestBody):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    # ranges from SamplingParams (one source); a temperature in (0, 0.01) runs as 0.01, as in vLLM
    temperature: float = Field(default=1.0, ge=TEMPERATURE_RANGE[0], le=TEMPERATURE_RANGE[1])
    top_p: float = Field(default=1.0, gt=TOP_P_RANGE[0], le=TOP_P_RANGE[1])
    top_k: int = Field(default=-1, ge=-1, le=MAX_TOP_K)
    min_p: float = Field(default=0.0, ge=MIN_P_RANGE[0], le=MIN_P_RANGE[1])
    seed: int | None = Seed
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    presence_penalty: float = Field(default=0.0, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])
    frequency_penalty: float = Field(default=0.0, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])
    repetition_penalty: float = Field(default=1.0, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1])
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=MAX_TEXT_FIELD)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_TEXT_FIELD)  # as in vLLM
    return_token_ids: bool = False
    response_format: ResponseFormat | None = None
    logit_bias: dict[str, float] | None = None  # OpenAI's: token id (as a JSON key) -> bias in [-100, 100]
    min_tokens: int = Field(default=0, ge=0)  # vLLM's
    structured_outputs: StructuredOutputs | None = None  # vLLM's
    # vLLM's names before 0.12, still sent by many clients: each is one kind of structured_outputs
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_json_object: bool | None = None
    grammar: str | None = None  # llama-server's: a GBNF (or Lark) grammar, structured_outputs' grammar kind
    include_stop_str_in_output: bool = False  # vLLM's
    # vLLM's; at most 2^18 ids (a vocabulary as large as Gemma 3's): 2^20 had taken ~1 s of the event loop to check
    allowed_token_ids: list[int] | None = Field(default=None, min_length=1, max_length=1 << 18)
    bad_words: list[Annotated[str, Field(max_length=MAX_TEXT_FIELD)]] | None = None  # vLLM's
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)  # vLLM's: keep the prompt's last N tokens
    skip_special_tokens: bool = True  # vLLM's: the text leaves out special tokens the model emits
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs name tokens `token_id:N`
    # vLLM's: not built over HTTP (its entries carry each token's rank, which the engine does not compute); a 400,
    # not silence (it had been ignored with a log line): completions' echo with logprobs scores the prompt
    prompt_logprobs: int | None = None
    # vLLM's: at most this many tokens of reasoning, then `</think>` is forced (engine/thinking.py); -1: no budget
    # (llama.cpp's word for it, here also overriding the server's --reasoning-budget)
    thinking_token_budget: int | None = Field(default=None, ge=-1)


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=0)  # 0 (with echo): score the prompt, generate nothing
    n: int = Field(default=1, ge=1, le=16)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1, le=16)
    state: str | None = Field(default=None, min_length=1)  # start from this state handle; the prompt continues it
    save_state: str | None = None  # save the final state under this name
    add_special_tokens: bool = True  # vLLM's: false leaves out the BOS the tokenizer adds (a pre-rendered chat has one)


class ContentPart(Body):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(Body):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant message that called tools
    tool_call_id: str | None = None  # a tool message: the call it answers
    reasoning_content: str | None = None  # an assistant's earlier reasoning (vLLM's field; templates such as Qwen3's)


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    n: int = Field(default=1, ge=1, le=16)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    add_generation_prompt: bool = True  # vLLM's: false with continue_final_message prefills the reply
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: more variables for the template (enable_thinking)
    add_special_tokens: bool = False  # vLLM's: true adds the tokenizer's BOS before the template's text
    include_reasoning: bool = True  # vLLM's: false leaves a thinking model's reasoning out (reasoning.py)
    chat_template: str | None = None  # vLLM's per-request template: refused (a 400), as vLLM without its trust flag
    state: str | None = Field(default=None, min_length=1)
    save_state: str | None = None


class MessagesCountRequest(RequestBody):
    """Anthropic's /v1/messages/count_tokens: a Messages request's prompt (messages_routes.py reads the blocks one by
    one, naming the wrong one)."""

    model: str
    messages: list[Any] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: str | list[Any] | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # its `format` (a JSON schema) is read; `effort` is not
    output_format: dict[str, Any] | None = None  # the same format, as the structured outputs beta named it


class MessagesRequest(MessagesCountRequest):
    """Anthropic's Messages API (POST /v1/messages). Its ranges: temperature 0-1, top_p (0, 1] (the sampling
    fields older clients send; Anthropic's newer SDKs no longer offer them)."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    metadata: dict[str, Any] | None = None
    seed: int | None = None  # wkvm's (as the chat's): the same request samples the same reply
    ignore_eos: bool = False  # vLLM's and llama-server's (a benchmark's fixed-length replies)


class OllamaModelRequest(RequestBody):
    """Ollama's /api/show."""

    model: str = Field(min_length=1)


class OllamaOptions(RequestBody):
    """Ollama's body fields every generation route shares (ollama_routes.py reads `options` key by key)."""

    model: str = Field(min_length=1)
    format: str | dict[str, Any] | None = None  # "json", or a JSON schema
    options: dict[str, Any] | None = None
    stream: bool = True  # Ollama streams unless told not to
    think: bool | str | None = None  # a thinking template's enable_thinking ("low" / "medium" / "high": on)
    keep_alive: str | int | float | None = None  # read and ignored: the model stays loaded


class OllamaChatRequest(OllamaOptions):
    messages: list[Any] = Field(default_factory=list, max_length=MAX_MESSAGES)
    tools: list[Any] | None = None


class OllamaGenerateRequest(OllamaOptions):
    prompt: str = ""
    system: str | None = None
    images: list[Any] | None = None
    # Ollama's, refused: a raw prompt, fill-in-the-middle, a per-request template, the old token context
    raw: bool = False
    suffix: str | None = None
    template: str | None = None
    context: list[int] | None = None


class OllamaEmbeddingsRequest(RequestBody):
    """Ollama's older /api/embeddings: one prompt."""

    model: str | None = None
    prompt: str
    options: dict[str, Any] | None = None
    keep_alive: str | int | float | None = None


class OllamaEmbedRequest(RequestBody):
    model: str | None = None
    input: str | list[str]
    truncate: bool = True
    dimensions: int | None = None
    options: dict[str, Any] | None = None
    keep_alive: str | int | float | None = None


class TokenizeRequest(RequestBody):
    """vLLM's /tokenize: a completion prompt, or chat messages (with the tools they offer) as the template renders
    them."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=MAX_MESSAGES)
    tools: list[Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # refused, as on chat
    add_special_tokens: bool | None = None  # vLLM's: the default is the route's (prompt: true, messages: false)
    return_token_strs: bool = False


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[int]


class CreateStateRequest(RequestBody):
    name: str
    prompt: str | None = None
    prompt_ids: list[int] | None = None


class ForkRequest(RequestBody):
    name: str


class StateGenerateRequest(SamplingFields):
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    save_as: str | None = None
    # completions' fields this route does not serve: read only to refuse them (they had been ignored)
    n: int | None = None
    best_of: int | None = None
    echo: bool | None = None
    suffix: str | None = None


# an integer as a state file's op_params may hold it (statefile: a larger one was stored and its export then did not
# import; review, session 47)
ParamValue = (Annotated[str, Field(max_length=MAX_TEXT_FIELD)] | Annotated[int, Field(ge=-(2**63), le=2**64 - 1)]
              | float | bool | None)  # fmt: skip


class MutateRequest(RequestBody):
    rule: str = Field(max_length=64)
    # scalars only: the params are recorded in the new state's provenance (op_params)
    params: dict[Annotated[str, Field(max_length=64)], ParamValue] = Field(default_factory=dict, max_length=16)


class HibernateRequest(RequestBody):
    tier: Literal["host", "disk"] = "disk"


class EmbeddingRequest(RequestBody):
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = Field(default=None, max_length=MAX_TEXT_FIELD)  # as the other routes (hunt 12)


class ScoreRequest(RequestBody):
    """POST /score, /v1/score (vLLM's Score API): texts paired one to many or one to one."""

    text_1: str | list[str]
    text_2: str | list[str]
    model: str | None = None
    user: str | None = Field(default=None, max_length=MAX_TEXT_FIELD)


class RerankRequest(RequestBody):
    """POST /rerank, /v1/rerank, /v2/rerank (vLLM's, as Jina's and Cohere's): documents ranked against a query."""

    query: str
    documents: list[str]
    model: str | None = None
    top_n: int = Field(default=0, ge=0)  # 0: all of them
    return_documents: bool = True
    user: str | None = Field(default=None, max_length=MAX_TEXT_FIELD)


class TextFormat(Body):
    """The Responses API's `text.format`: plain text, any JSON object, or JSON matching `schema`."""

    type: Literal["text", "json_object", "json_schema"]
    name: str = Field(default="response", max_length=64)
    description: str | None = None
    definition: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(Body):
    format: TextFormat | None = None


class ResponsesRequest(RequestBody):
    """POST /v1/responses (OpenAI's Responses API; docs/http-api.md). `input`'s items are checked one by one by the
    route, which names the item and field that is wrong."""

    model: str | None = None
    input: str | Annotated[list[dict[str, Any]], Field(max_length=MAX_MESSAGES)] | None = None
    instructions: str | None = None
    previous_response_id: str | None = Field(default=None, min_length=1, max_length=128)
    store: bool = True
    stream: bool = False
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=TEMPERATURE_RANGE[0], le=TEMPERATURE_RANGE[1])
    top_p: float | None = Field(default=None, gt=TOP_P_RANGE[0], le=TOP_P_RANGE[1])
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    seed: int | None = Seed  # not OpenAI's; as in /v1/chat/completions
    ignore_eos: bool = False  # not OpenAI's; vLLM's, as in /v1/chat/completions (benchmarks, long test replies)
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    user: str | None = Field(default=None, max_length=MAX_TEXT_FIELD)
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = Field(
        default=None, max_length=16)
    include: list[str] | None = None
    truncation: Literal["disabled", "auto"] | None = None
    background: bool | None = None
    reasoning: dict[str, Any] | None = None  # accepted: this model does not reason apart from its answer
    conversation: Any = None
    prompt: Any = None  # a stored prompt template: refused (not served here)
    max_tool_calls: int | None = None  # refused: a forced call is always made
    state: Any = None  # wkvm's named states (chat and completions): refused here, as previous_response_id continues
    save_state: Any = None
