"""Ollama's API: /api/chat and /api/generate (NDJSON streams by default), /api/tags, /api/show, /api/ps,
/api/version, /api/embed (and the older /api/embeddings).

For the many desktop apps and plugins that speak only Ollama's API. A request runs as a chat completion
(`openai_routes.chat_completion`), as the Responses and Messages APIs do: Ollama's messages (`images` refused, an
assistant's `tool_calls` with object arguments, `tool` results matched to their call by `tool_name`), `options`
(temperature, top_p, top_k, min_p, seed, num_predict, stop, repeat_penalty, presence and frequency penalties),
`format` ("json" or a JSON schema) and `think` become the chat's fields; the answer (or its chunks) comes back in
Ollama's shape, with its counts and durations (measured here, in nanoseconds). So chat reuse holds: a conversation
resent whole resumes its parked state when the tokens match exactly. docs/http-api.md lists what is read.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, params
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError

from wkvm import __version__
from wkvm.chat_template import json_or_none
from wkvm.server import generation as gen
from wkvm.server.context import ServerContext
from wkvm.server.embeddings_routes import embed
from wkvm.server.errors import APIError
from wkvm.server.handover import HANDOVER_HEADER
from wkvm.server.openai_routes import chat_completion, check_model, completion, passed_on_header
from wkvm.server.reasoning import thinking
from wkvm.server.schemas import (
    ChatRequest,
    CompletionRequest,
    EmbeddingRequest,
    OllamaChatRequest,
    OllamaEmbeddingsRequest,
    OllamaEmbedRequest,
    OllamaGenerateRequest,
    OllamaModelRequest,
)

# Ollama's options as the chat's fields (the others, num_ctx, num_thread, mirostat..., are ignored: logged once)
OPTIONS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
           "stop": "stop", "repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
           "frequency_penalty": "frequency_penalty"}  # fmt: skip
DONE_REASONS = {"stop": "stop", "tool_calls": "stop", "length": "length"}


def router(ctx: ServerContext, auth: params.Depends) -> APIRouter:
    r = APIRouter(dependencies=[auth])

    def details() -> dict[str, Any]:
        family = ctx.model.spec.family
        return {"parent_model": "", "format": "gguf" if str(ctx.config.model).endswith(".gguf") else "safetensors",
                "family": family, "families": [family], "parameter_size": "", "quantization_level": ctx.config.dtype}

    def entry() -> dict[str, Any]:
        return {"name": ctx.model_name, "model": ctx.model_name, "modified_at": gen.iso_time(ctx.model_created),
                "size": 0, "digest": ctx.model.fingerprint, "details": details()}  # fmt: skip

    @r.get("/api/version")
    def version() -> dict[str, str]:
        return {"version": __version__}

    @r.get("/api/tags")
    def tags() -> dict[str, Any]:
        ctx.require_ready()
        return {"models": [entry()]}

    @r.get("/api/ps")
    def ps() -> dict[str, Any]:
        ctx.require_ready()
        return {"models": [{**entry(), "expires_at": "0001-01-01T00:00:00Z", "size_vram": 0,
                            "context_length": ctx.model.context_limit or 0}]}  # fmt: skip

    @r.post("/api/show")
    def show(body: OllamaModelRequest) -> dict[str, Any]:
        ctx.require_ready()
        check_model(ctx, body.model)
        family = ctx.model.spec.family
        info = {"general.architecture": family, f"{family}.context_length": ctx.model.context_limit}
        templates = [ctx.template.source, ctx.template.tool_source]
        capabilities = ["completion"] + (["tools"] if ctx.template.tool_source or "tools" in (ctx.template.source or "")
                                         else [])  # fmt: skip
        if thinking(ctx.config.reasoning_parser, templates, "", False) is not None:  # its replies read for reasoning
            capabilities.append("thinking")
        return {"modelfile": "", "parameters": "", "template": ctx.template.source or "", "details": details(),
                "model_info": info, "capabilities": capabilities, "modified_at": gen.iso_time(ctx.model_created)}

    @r.post("/api/chat", response_model=None)
    async def chat(body: OllamaChatRequest, request: Request) -> dict[str, Any] | Response:
        ctx.require_ready()
        if not body.messages:  # Ollama loads the model and answers done: nothing to load here
            check_model(ctx, body.model)
            return {"model": body.model, "created_at": gen.iso_time(time.time()),
                    "message": {"role": "assistant", "content": ""}, "done": True, "done_reason": "load"}
        return await answer(ctx, request, body, chat_messages_of(body.messages), "message")

    @r.post("/api/generate", response_model=None)
    async def generate(body: OllamaGenerateRequest, request: Request) -> dict[str, Any] | Response:
        ctx.require_ready()
        for name in ("suffix", "context", "template"):  # what this route would get wrong: refused
            if getattr(body, name):
                raise APIError(400, f"{name} is not supported on /api/generate: send the prompt alone (the model's "
                               "chat template is applied, or none with raw: true)", name, "unsupported")  # fmt: skip
        check_images(body.images, "images")
        if not body.prompt:  # Ollama loads the model and answers done: nothing to load here
            check_model(ctx, body.model)
            return {"model": body.model, "created_at": gen.iso_time(time.time()), "response": "", "done": True,
                    "done_reason": "load"}  # fmt: skip
        if body.raw:  # the prompt as it is: a completion
            if body.system:
                raise APIError(400, "system is not read with raw: true (no template applies it): put it in the "
                               "prompt", "system", "unsupported")  # fmt: skip
            return await raw_answer(ctx, request, body)
        messages = ([{"role": "system", "content": body.system}] if body.system else []) + [
            {"role": "user", "content": body.prompt}]
        return await answer(ctx, request, body, messages, "response")

    @r.post("/api/embed")
    async def embed_route(body: OllamaEmbedRequest, request: Request) -> dict[str, Any]:
        t0 = time.perf_counter()
        if body.dimensions is not None or body.truncate is False:
            raise APIError(400, "dimensions and truncate: false are not supported (inputs are cut at the model's "
                           "length)", "dimensions" if body.dimensions is not None else "truncate", "unsupported")
        out = await embed(ctx, EmbeddingRequest.model_validate({"input": body.input, "model": body.model}), request)
        used = out["usage"]["prompt_tokens"]
        return {"model": out["model"], "embeddings": [d["embedding"] for d in out["data"]],
                "total_duration": nanos(time.perf_counter() - t0), "load_duration": 0, "prompt_eval_count": used}

    @r.post("/api/embeddings")
    async def embeddings_route(body: OllamaEmbeddingsRequest, request: Request) -> dict[str, Any]:
        """Ollama's older endpoint (one prompt, `embedding`), still used by older integrations."""
        out = await embed(ctx, EmbeddingRequest.model_validate({"input": body.prompt, "model": body.model}), request)
        return {"embedding": out["data"][0]["embedding"]}

    return r


def nanos(seconds: float) -> int:
    return int(seconds * 1e9)


def check_images(images: Any, where: str) -> None:
    if images:
        raise APIError(400, f"{where}: images are not supported (a text model): send text", where, "unsupported")


def chat_messages_of(messages: list[Any]) -> list[dict[str, Any]]:
    """Ollama's messages as the chat's: an assistant's tool_calls get ids (Ollama's have none) and a `tool` message
    answers the earliest unanswered call of its `tool_name` (or, without one, the earliest unanswered call)."""
    out: list[dict[str, Any]] = []
    open_calls: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("system", "user", "assistant", "tool"):
            raise APIError(400, f"{where}.role must be system, user, assistant or tool (got {role!r})", f"{where}.role",
                           "invalid_value")  # fmt: skip
        assert isinstance(m, dict)
        check_images(m.get("images"), f"{where}.images")
        content = "" if m.get("content") is None else m["content"]  # null, as a client's unset field
        if not isinstance(content, str):
            raise APIError(400, f"{where}.content must be a string", f"{where}.content", "invalid_value")
        if role == "tool":
            name = m.get("tool_name") or m.get("name")
            call = next((c for c in open_calls if name in (None, c["function"]["name"])), None)
            if call is None:
                raise APIError(400, f"{where}: a tool message answers no tool call before it"
                               f"{f' named {name!r}' if name else ''}", where, "invalid_value")  # fmt: skip
            open_calls.remove(call)
            out.append({"role": "tool", "tool_call_id": call["id"], "content": content})
            continue
        message: dict[str, Any] = {"role": role, "content": content}
        if role == "assistant" and m.get("tool_calls"):
            message["tool_calls"] = calls = assistant_calls(m["tool_calls"], f"{where}.tool_calls", len(out))
            open_calls += calls
        out.append(message)
    return out


def assistant_calls(calls: Any, where: str, turn: int) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise APIError(400, f"{where} must be a list", where, "invalid_value")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise APIError(400, f"{where}[{j}] needs function.name", f"{where}[{j}].function.name", "invalid_value")
        args = fn.get("arguments", {})
        text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        out.append({"id": f"call_{turn}_{j}", "type": "function", "function": {"name": fn["name"], "arguments": text}})
    return out


def sampling(body: OllamaChatRequest | OllamaGenerateRequest, limit: int) -> dict[str, Any]:
    """The chat's or completion's sampling fields of an Ollama request; `limit`, the server's --max-tokens-limit,
    bounds num_predict (Ollama takes any, and -1 for no limit) instead of the chat's 400."""
    options = body.options or {}
    d: dict[str, Any] = {"stream": body.stream, "model": body.model,
                         "stream_options": {"include_usage": True} if body.stream else None}  # fmt: skip
    for key, field in OPTIONS.items():
        if options.get(key) is not None:
            d[field] = options[key]
    predict = options.get("num_predict")
    if predict is not None and (not isinstance(predict, int) or isinstance(predict, bool)):
        raise APIError(400, "options.num_predict must be an integer (-1: as many as the server allows)",
                       "options.num_predict", "invalid_value")  # fmt: skip
    if predict:  # -1: no limit but the server's
        d["max_tokens"] = predict if 0 < predict <= limit else limit
    if body.format == "json":
        d["response_format"] = {"type": "json_object"}
    elif isinstance(body.format, dict):
        d["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": body.format}}
    elif body.format not in (None, ""):
        raise APIError(400, 'format must be "json" or a JSON schema object', "format", "invalid_value")
    return d


def chat_request(body: OllamaChatRequest | OllamaGenerateRequest, messages: list[dict[str, Any]],
                 limit: int) -> ChatRequest:  # fmt: skip
    """The chat completion an Ollama request runs."""
    d = {"messages": messages, **sampling(body, limit)}
    if body.think is not None:
        d["chat_template_kwargs"] = {"enable_thinking": bool(body.think)}
    if isinstance(body, OllamaChatRequest) and body.tools:
        d["tools"] = body.tools
    chat: ChatRequest = validated(ChatRequest, d, isinstance(body, OllamaGenerateRequest))
    return chat


def validated(model: type[ChatRequest] | type[CompletionRequest], d: dict[str, Any], generate: bool) -> Any:
    try:
        return model.model_validate(d)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        param = ollama_param(loc, generate) or loc
        raise APIError(400, f"{param}: {err['msg']}", param, "invalid_value") from None


def ollama_param(param: str | None, generate: bool) -> str | None:
    """A chat completion's field as the Ollama request names it (generate's messages are its system and prompt)."""
    if param is None:
        return None
    names = {**{v: f"options.{k}" for k, v in OPTIONS.items()}, "response_format": "format",
             "max_tokens": "options.num_predict", "chat_template_kwargs": "think"}  # fmt: skip
    if generate and param.startswith("messages"):
        return "prompt"
    head = param.split(".", 1)[0].split("[", 1)[0]
    return names[head] + param[len(head):] if head in names else param


def renamed(e: APIError, generate: bool) -> APIError:
    """A chat completion's (or completion's) error with its field named as the Ollama request names it."""
    param = ollama_param(e.param, generate)
    said = e.message if param == e.param or e.param is None else e.message.replace(e.param, param or "", 1)
    return APIError(e.status, said, param, e.code, e.headers)


async def answer(ctx: ServerContext, request: Request, body: OllamaChatRequest | OllamaGenerateRequest,
                 messages: list[dict[str, Any]], key: str) -> dict[str, Any] | Response:  # fmt: skip
    """The chat completion of `messages`, in Ollama's shape: its text under `key` (chat: a message; generate: the
    response)."""
    t0 = time.perf_counter()
    replay: list[dict[str, Any] | None] = [None]
    try:
        out = await chat_completion(ctx, chat_request(body, messages, ctx.config.max_tokens_limit), request,
                                    started=lambda n, info, sent: replay.__setitem__(0, sent))  # fmt: skip
    except APIError as e:
        raise renamed(e, key == "response") from None
    if isinstance(out, StreamingResponse):
        lines = ndjson(body.model, key, t0, out.body_iterator, replay[0])  # type: ignore[arg-type]
        return StreamingResponse(lines, media_type="application/x-ndjson", headers=passed_on_header(out))
    if not isinstance(out, dict):  # answered whole by the server it moved to (the front takes it from there)
        return out
    (choice,) = out["choices"]
    m = choice["message"]
    done = piece_of(body.model, key, m.get("content") or "", m.get("reasoning_content") or "")
    if key == "message" and m.get("tool_calls"):
        done["message"]["tool_calls"] = ollama_calls(m["tool_calls"])
    return {**done, **ending(choice["finish_reason"], out["usage"], t0, None)}


async def raw_answer(ctx: ServerContext, request: Request,
                     body: OllamaGenerateRequest) -> dict[str, Any] | Response:  # fmt: skip
    """/api/generate with raw: true, the prompt completed as it is (`openai_routes.completion`), in Ollama's shape."""
    t0 = time.perf_counter()
    fields = {"prompt": body.prompt, **sampling(body, ctx.config.max_tokens_limit)}
    fields.setdefault("max_tokens", gen.DEFAULT_CHAT_MAX_TOKENS)  # as a chat's (a completion's own default is 16)
    creq = validated(CompletionRequest, fields, True)
    try:
        out = await completion(ctx, creq, request)
    except APIError as e:
        raise renamed(e, True) from None
    if isinstance(out, StreamingResponse):
        return StreamingResponse(ndjson(body.model, "response", t0, out.body_iterator),  # type: ignore[arg-type]
                                 media_type="application/x-ndjson", headers=passed_on_header(out))  # fmt: skip
    if HANDOVER_HEADER in out.headers:  # answered whole by the server it moved to
        return out
    whole = json.loads(bytes(out.body))
    (choice,) = whole["choices"]
    return {**piece_of(body.model, "response", choice["text"], ""),
            **ending(choice["finish_reason"], whole["usage"], t0, None)}  # fmt: skip


def ollama_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat's calls as Ollama's: arguments as an object, no id."""
    out = []
    for c in calls:
        args = json_or_none(c["function"]["arguments"])
        out.append({"function": {"name": c["function"]["name"], "arguments": args if isinstance(args, dict) else {}}})
    return out


def ending(finish_reason: str | None, usage: dict[str, Any], t0: float, first: float | None) -> dict[str, Any]:
    """A finished answer's fields: done, its reason, the token counts and the durations (nanoseconds): the prompt's
    until the first token (whole, blocking: unknown, so 0), the generated tokens' after it."""
    total = time.perf_counter() - t0
    prompt = (first - t0) if first is not None else 0.0
    reason = DONE_REASONS.get(finish_reason or "")
    if reason is None:
        raise APIError(408, "the request was ended before it finished (it ran past this server's --request-timeout, "
                       "or was cancelled)", None, "timeout")  # fmt: skip
    return {"done": True, "done_reason": reason, "total_duration": nanos(total), "load_duration": 0,
            "prompt_eval_count": usage["prompt_tokens"], "prompt_eval_duration": nanos(prompt),
            "eval_count": usage["completion_tokens"], "eval_duration": nanos(total - prompt)}  # fmt: skip


def add_calls(calls: dict[int, dict[str, Any]], delta: dict[str, Any]) -> None:
    """A chat delta's tool-call pieces into the calls so far (Ollama sends them whole at the end)."""
    for piece in delta.get("tool_calls") or []:
        call = calls.setdefault(piece["index"], {"function": {"name": "", "arguments": ""}})
        fn = piece.get("function") or {}
        call["function"]["name"] += fn.get("name") or ""
        call["function"]["arguments"] += fn.get("arguments") or ""


async def ndjson(model: str, key: str, t0: float, chunks: AsyncIterator[str],
                 replay: dict[str, Any] | None = None) -> AsyncIterator[str]:  # fmt: skip
    """Ollama's stream: one JSON object a line per piece of text (or reasoning, as `thinking`), the calls whole in
    one object when the reply ends, then the `done` object; a failure is an `{"error": ...}` line, as Ollama's. A
    stream that moves to another server ends with the chat's handover event (the front takes it out); there
    `replay`, the chat delta of everything the source sent, brings the calls begun there."""
    calls: dict[int, dict[str, Any]] = {}
    add_calls(calls, replay or {})
    finish_reason, usage, first = None, None, None
    try:
        async for obj in gen.sse_objects(chunks):
            if isinstance(obj, str):  # the stream goes on on another server: its handover event
                yield obj
                return
            if "error" in obj:
                yield json.dumps({"error": obj["error"].get("message")}) + "\n"
                return
            usage = obj.get("usage") or usage
            for c in obj.get("choices", []):
                delta = c.get("delta") or {}  # a chat's chunk; a completion's has its text
                text, thought = delta.get("content") or c.get("text") or "", delta.get("reasoning_content") or ""
                add_calls(calls, delta)
                if text or thought:
                    first = first or time.perf_counter()
                    yield json.dumps(piece_of(model, key, text, thought)) + "\n"
                finish_reason = c.get("finish_reason") or finish_reason
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]  # a client gone: the chat stream ends its request
    if usage is None:
        yield json.dumps({"error": "the stream ended without its usage (a bug)"}) + "\n"
        return
    if calls and key == "message":
        last = piece_of(model, key, "", "")
        last["message"]["tool_calls"] = ollama_calls([calls[i] for i in sorted(calls)])
        yield json.dumps(last) + "\n"
    try:
        end = ending(finish_reason, usage, t0, first)
    except APIError as e:
        yield json.dumps({"error": e.message}) + "\n"
        return
    yield json.dumps({**piece_of(model, key, "", ""), **end}) + "\n"


def piece_of(model: str, key: str, text: str, thought: str) -> dict[str, Any]:
    """One object of an answer: its text under `key` (chat: a message; generate: the response), its reasoning as
    `thinking` when there is some; `done` false (`ending` makes the last one done)."""
    out: dict[str, Any] = {"model": model, "created_at": gen.iso_time(time.time())}
    if key == "message":
        out["message"] = {"role": "assistant", "content": text, **({"thinking": thought} if thought else {})}
    else:
        out["response"] = text
        if thought:
            out["thinking"] = thought
    out["done"] = False
    return out
