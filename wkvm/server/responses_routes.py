"""OpenAI's Responses API: POST /v1/responses (blocking and SSE events), GET and DELETE /v1/responses/{id}.

A request runs as a chat completion (`openai_routes.chat_completion`): `instructions` is a leading system message,
then the conversation stored with `previous_response_id`, then `input`'s items as chat messages (function calls as
an assistant's `tool_calls`, their outputs as `tool` messages); Responses' flat function tools become chat tools and
`text.format` the response_format. The chat's answer (or its chunks) is re-shaped into output items (or the
Responses stream's events). A stored response keeps the conversation it ends (`ResponseStore`), so the next request
that names it re-renders the same messages: its prompt then starts with the tokens of this one's prompt and answer,
and the chat sessions resume the parked state only when those tokens match exactly (an answer never changes).
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request, params
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from wkvm.chat_template import json_or_none
from wkvm.server import generation as gen
from wkvm.server.context import ServerContext
from wkvm.server.errors import APIError
from wkvm.server.openai_routes import chat_completion, check_model, passed_on_header
from wkvm.server.schemas import ChatRequest, ResponsesRequest

log = logging.getLogger("wkvm.server")
ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")
LOGPROBS = "message.output_text.logprobs"
INCLUDABLE = (  # OpenAI's `include` values: the others name items this server never makes, so they add nothing
    LOGPROBS, "reasoning.encrypted_content", "file_search_call.results", "web_search_call.results",
    "web_search_call.action.sources", "message.input_image.image_url", "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
)  # fmt: skip
RESPONSE_ID_HEADER = "x-wkvm-response-id"  # the id a cluster front chose, so that it knows where the response is
RESPONSE_ID = re.compile(r"resp_[0-9a-f]{32}")
FINISHED = {"stop": "completed", "tool_calls": "completed", "length": "incomplete"}


class Running:
    """A stored (`store`) response while it runs: GET answers its shell (status in_progress), DELETE marks it so
    that it is not stored when it ends (it had been a 404 on both, then stored anyway; hunt, session 49)."""

    def __init__(self, shell: dict[str, Any]):
        self.shell, self.deleted, self.ended = shell, False, False

    @property
    def live(self) -> bool:
        """Running and not deleted: once ended (stored, or failed) the store answers for it."""
        return not self.deleted and not self.ended


def router(ctx: ServerContext, auth: params.Depends) -> APIRouter:
    r = APIRouter(dependencies=[auth])
    # (tenant, id) -> Running; weak: a stream that never started (its client gone first) leaves no entry behind
    running: weakref.WeakValueDictionary[tuple[str, str], Running] = weakref.WeakValueDictionary()

    @r.post("/v1/responses", response_model=None)
    async def create(body: ResponsesRequest, request: Request) -> dict[str, Any] | Response:
        ctx.require_ready()
        tenant = ctx.tenant(request)
        check_model(ctx, body.model)
        refuse_unsupported(body)
        history: list[dict[str, Any]] = []
        if body.previous_response_id:
            found = await run_in_threadpool(ctx.responses.get, tenant, body.previous_response_id)
            if found is None and (run := running.get((tenant, body.previous_response_id))) and run.live:
                raise APIError(400, f"previous_response_id: response {body.previous_response_id!r} is still in "
                               "progress: continue from it once it has completed", "previous_response_id",
                               "previous_response_in_progress")  # fmt: skip
            if found is None:  # a 400, as OpenAI answers it
                raise APIError(400, f"previous_response_id: no stored response {body.previous_response_id!r} (it "
                               "was made with store: false, deleted, or by another API key)", "previous_response_id",
                               "previous_response_not_found")  # fmt: skip
            history = found[1]
        conversation = history + input_messages(body.input)
        if not conversation:
            raise APIError(400, "input: give the text or items to answer", "input", "invalid_value")
        check_calls_answered(conversation)
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        # only a cluster front names the id (it strips a client's header); a single server's client had chosen its own
        # id, and written over its stored response
        given = request.headers.get(RESPONSE_ID_HEADER, "") if ctx.config.replicas else ""
        shell = response_shell(ctx, body, given if RESPONSE_ID.fullmatch(given) else new_id("resp"))
        key, run = (tenant, shell["id"]), Running(shell)
        if body.store:
            running[key] = run
        streams = False
        # where the stream is, for a move: its id and created_at, and the next event's number (EventStream keeps it)
        carry: dict[str, Any] = {"id": shell["id"], "created_at": shell["created_at"], "seq": 0}
        sent: list[dict[str, Any] | None] = [None]
        try:
            try:  # its logprobs so far would not travel (a stream sent them; the stored response needs them all)
                out = await chat_completion(ctx, chat_request(body, system + conversation), request,
                                            movable=not logprobs(body), carry=carry,
                                            started=lambda n, info, replay: sent.__setitem__(0, replay))  # fmt: skip
            except APIError as e:
                raise APIError(e.status, responses_text(e.message), responses_param(e.param), e.code,
                               e.headers) from None  # fmt: skip
            moved_here = carry["id"] != shell["id"] and RESPONSE_ID.fullmatch(str(carry["id"]))  # the source's id,
            if moved_here and isinstance(carry.get("created_at"), int):  # as a ticket's route says it (checked)
                running.pop(key, None)
                shell = {**shell, "id": carry["id"], "created_at": carry["created_at"]}
                key, run = (tenant, shell["id"]), Running(shell)
                if body.store:
                    running[key] = run
            if isinstance(out, StreamingResponse):
                events = stream_events(ctx, tenant, body, shell, conversation, out.body_iterator,  # type: ignore[arg-type]
                                       run, lambda: running.pop(key, None), sent[0], carry)  # fmt: skip
                streams = True
                return StreamingResponse(events, media_type="text/event-stream", headers=passed_on_header(out))
            if not isinstance(out, dict):  # answered whole by the server it moved to (the front takes it from there)
                return out
            (choice,) = out["choices"]
            lps = (choice.get("logprobs") or {}).get("content") if logprobs(body) else None
            items = output_items(choice["message"], lps, forced(body))
            resp = finished(shell, items, choice["finish_reason"], out["usage"], out.get("wkvm"))
            await store(ctx, tenant, body, resp, conversation + input_messages(items), run)
            return resp
        finally:
            if not streams:  # a stream ends its entry itself, once stored
                running.pop(key, None)

    @r.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str, request: Request) -> dict[str, Any]:
        ctx.require_ready()
        tenant = ctx.tenant(request)
        run = running.get((tenant, response_id))
        if run is not None and run.live:  # as OpenAI's: status in_progress until it ends
            return run.shell
        found = await run_in_threadpool(ctx.responses.get, tenant, response_id)
        if found is None:
            raise not_found(response_id)
        return found[0]

    @r.delete("/v1/responses/{response_id}")
    async def delete(response_id: str, request: Request) -> dict[str, Any]:
        ctx.require_ready()
        tenant = ctx.tenant(request)
        run = running.get((tenant, response_id))
        if run is not None and run.live:  # it runs on, and is not stored when it ends
            run.deleted = True
        elif not await run_in_threadpool(ctx.responses.delete, tenant, response_id):
            raise not_found(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    return r


async def store(ctx: ServerContext, tenant: str, body: ResponsesRequest, resp: dict[str, Any],
                messages: list[dict[str, Any]], run: Running) -> None:
    """Store a finished response (unless `store` is false, it failed, or it was deleted while it ran), then end its
    run: before its last event, so a client that reads that event and retrieves at once finds it stored. A DELETE
    answered while the put ran (the run still live) deletes it again (review, session 49)."""
    if body.store and resp["status"] != "failed" and not run.deleted:
        await run_in_threadpool(ctx.responses.put, tenant, resp, messages)
        if run.deleted:
            await run_in_threadpool(ctx.responses.delete, tenant, resp["id"])
    run.ended = True


def new_id(kind: str) -> str:
    """OpenAI's shape for Responses objects: resp_..., msg_..., fc_..."""
    return f"{kind}_{uuid.uuid4().hex}"


def not_found(response_id: str) -> APIError:
    return APIError(404, f"no stored response {response_id!r}", "response_id", "response_not_found")


def refuse_unsupported(body: ResponsesRequest) -> None:
    """What a user would otherwise get silently wrong: a 400 naming the field."""
    if body.background:
        raise APIError(400, "background: responses run in the request (send stream: true to see them as they come)",
                       "background", "unsupported")  # fmt: skip
    if body.conversation is not None:
        raise APIError(400, "conversation: the Conversations API is not served here; continue a conversation with "
                       "previous_response_id", "conversation", "unsupported")  # fmt: skip
    if body.prompt is not None:  # answered without its template, the reply had ignored it
        raise APIError(400, "prompt: stored prompt templates are not served here; send the text as input or "
                       "instructions", "prompt", "unsupported")  # fmt: skip
    if body.max_tool_calls is not None:
        raise APIError(400, "max_tool_calls is not supported: leave it out (tool_choice 'none' makes no call)",
                       "max_tool_calls", "unsupported")  # fmt: skip
    for name in ("state", "save_state"):  # chat's and completions' fields had been ignored here: no state went on
        if getattr(body, name) is not None:
            raise APIError(400, f"{name}: named states are served on /v1/chat/completions and /v1/completions; a "
                           "response goes on from an earlier one with previous_response_id (its state is kept and "
                           "reused)", name, "unsupported")  # fmt: skip
    for i, value in enumerate(body.include or ()):
        if value not in INCLUDABLE:  # a misspelt value had been ignored: the logprobs asked for never came
            raise APIError(400, f"include[{i}]: {value!r} is not one of OpenAI's include values "
                           f"({', '.join(INCLUDABLE)})", f"include[{i}]", "invalid_value")  # fmt: skip
    if body.truncation == "auto":
        raise APIError(400, "truncation: 'auto' (dropping the oldest items to fit) is not supported; a conversation "
                       "too long for the model is refused with context_length_exceeded", "truncation",
                       "unsupported")  # fmt: skip


def logprobs(body: ResponsesRequest) -> bool:
    return LOGPROBS in (body.include or ())


def forced(body: ResponsesRequest) -> bool:
    """The reply can only be a call (tool_choice required or named): it has no text. Cut by max_output_tokens, its
    unfinished call is not shown as the assistant's words."""
    return bool(body.tools) and (body.tool_choice == "required" or isinstance(body.tool_choice, dict))


def check_calls_answered(conversation: list[dict[str, Any]]) -> None:
    """As OpenAI checks a conversation: every function call has an output, and every output answers a call before
    it."""
    calls: set[str] = set()
    for m in conversation:
        for c in m.get("tool_calls") or []:
            if c["id"] in calls:  # its output would answer either call
                raise APIError(400, f"input: two function calls have the call_id {c['id']!r}; give each its own",
                               "input", "invalid_value")  # fmt: skip
            calls.add(c["id"])
        if m["role"] == "tool" and m["tool_call_id"] not in calls:
            raise APIError(400, f"input: no function_call with call_id {m['tool_call_id']!r} comes before its "
                           "function_call_output", "input", "invalid_value")  # fmt: skip
    answered = {m["tool_call_id"] for m in conversation if m["role"] == "tool"}
    if missing := sorted(calls - answered):
        raise APIError(400, f"input: no function_call_output for the function call {missing[0]!r}: send one (an "
                       "item with its call_id and output) before going on", "input", "invalid_value")  # fmt: skip


def chat_request(body: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatRequest:
    fmt = body.text.format if body.text is not None else None
    d: dict[str, Any] = {
        "messages": messages, "stream": body.stream, "stream_options": {"include_usage": True} if body.stream else None,
        "max_completion_tokens": body.max_output_tokens, "seed": body.seed, "user": body.user,
        "tools": chat_tools(body.tools), "tool_choice": chat_tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls, "logprobs": logprobs(body),
        "top_logprobs": body.top_logprobs if logprobs(body) else None, "ignore_eos": body.ignore_eos,
    }  # fmt: skip
    if body.temperature is not None:
        d["temperature"] = body.temperature
    if body.top_p is not None:
        d["top_p"] = body.top_p
    if fmt is not None and fmt.type == "json_object":
        d["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.definition is None:
            raise APIError(400, "text.format: a json_schema format needs its schema", "text.format.schema",
                           "invalid_value")  # fmt: skip
        spec = {"name": fmt.name, "schema": fmt.definition, "strict": fmt.strict, "description": fmt.description}
        d["response_format"] = {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}
    try:
        return ChatRequest.model_validate(d)
    except ValidationError as e:  # the items were checked one by one above: what is left is a value out of range
        err = e.errors()[0]
        raise APIError(400, f"input: {err['msg']}", "input", "invalid_value") from None


def responses_param(param: str | None) -> str | None:
    """A chat completion's field, as the Responses request names it."""
    if param is None:
        return None
    for chat, ours in (("messages", "input"), ("max_completion_tokens", "max_output_tokens"),
                       ("max_tokens", "max_output_tokens"), ("response_format", "text.format")):  # fmt: skip
        if param == chat or param.startswith(chat + "[") or param.startswith(chat + "."):
            return ours + param[len(chat) :] if chat != "messages" else "input"
    return param.replace(".function.", ".") if param.startswith("tools[") else param


# a quoted value (a user's tool or property name) first, so that it is kept as it is
CHAT_WORDS = re.compile(r"'[^']*'|\b(max_completion_tokens|max_tokens|response_format\.json_schema|response_format)\b"
                        r"|\btools\[\d+\]\.function\.")  # a Responses tool has no "function" level, as its param
RESPONSES_WORDS = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
                   "response_format.json_schema": "text.format", "response_format": "text.format"}  # fmt: skip


def responses_text(message: str) -> str:
    """A chat completion's error message with its fields named as the Responses request names them."""
    def word(m: re.Match[str]) -> str:
        said = m.group(0)
        return said.removesuffix("function.") if said.startswith("tools[") else RESPONSES_WORDS.get(said, said)

    return CHAT_WORDS.sub(word, message)


def text_of(content: Any, where: str) -> str:
    """A message's content as text: a string, or a list of text parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of content parts", where, "invalid_value")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in (*TEXT_PARTS, "refusal"):  # an output's refusal part is its text, as chat reads it
            why = f"{where}[{j}]: only text parts ({', '.join(TEXT_PARTS)}) are supported (got {kind!r})"
            raise APIError(400, why, f"{where}[{j}].type", "unsupported")
        key = "refusal" if kind == "refusal" else "text"
        if not isinstance(part.get(key), str):  # the part's kind is fine: its text is what is wrong
            raise APIError(400, f"{where}[{j}]: a {kind} part needs its {key} (a string)", f"{where}[{j}].{key}",
                           "invalid_value")  # fmt: skip
        texts.append(part[key])
    return "\n".join(texts)  # as the chat's text parts


def field(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise APIError(400, f"{where}.{key} must be a non-empty string", f"{where}.{key}", "invalid_value")
    return value


def input_messages(value: str | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """`input` (or output items, which are valid input) as chat messages. A function call joins the assistant
    message before it (a reply that spoke and then called), as the chat's `tool_calls`, and an assistant message
    right after calls joins them too (words after a call, an item of their own in a stream)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        kind = item.get("type") or ("message" if "role" in item else None)  # null, as a client's unset field
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise APIError(400, f"{where}.role {role!r} is not supported; use one of {list(ROLES)}",
                               f"{where}.role", "invalid_value")  # fmt: skip
            content = item.get("content")
            if role != "assistant" and (content is None or content == []):  # as the chat refuses it
                raise APIError(400, f"{where}: a {role} message needs content", f"{where}.content", "invalid_value")
            text = text_of(content, f"{where}.content")
            if role == "assistant" and out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["content"] += text  # words after its calls (a streamed reply's own item): the same turn
            else:
                out.append({"role": role, "content": text})
        elif kind == "function_call":
            arguments = item.get("arguments")
            if not isinstance(arguments, str):
                raise APIError(400, f"{where}.arguments must be a string (JSON text)", f"{where}.arguments",
                               "invalid_value")  # fmt: skip
            try:  # here, by its own name: the chat's check named messages[i].tool_calls[j] (tools hunt, session 47)
                json.loads(arguments) if arguments.strip() else None
            except (ValueError, RecursionError):  # "[" * 100000: too deep for the parser, a 500 before
                raise APIError(400, f"{where}.arguments is not JSON: send the call's arguments as the JSON text the "
                               "model wrote (e.g. '{\"city\": \"Paris\"}')", f"{where}.arguments",
                               "invalid_value") from None  # fmt: skip
            call = {"id": field(item, "call_id", where), "type": "function",
                    "function": {"name": field(item, "name", where), "arguments": arguments}}  # fmt: skip
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if item.get("output") is None:
                raise APIError(400, f"{where}.output: give the function's output (a string)", f"{where}.output",
                               "invalid_value")  # fmt: skip
            output = text_of(item.get("output"), f"{where}.output")
            out.append({"role": "tool", "tool_call_id": field(item, "call_id", where), "content": output})
        elif kind == "reasoning":
            continue  # another model's reasoning, sent back by a client: this model reads only the answers
        else:
            raise APIError(400, f"{where}.type {kind!r} is not supported; use message, function_call or "
                           "function_call_output", f"{where}.type", "unsupported")  # fmt: skip
    return out


def chat_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """Responses' function tools ({"type": "function", "name", "parameters", ...}) in the chat's shape."""
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind != "function":
            raise APIError(400, f"tools[{i}]: only function tools are supported (got {kind!r})", f"tools[{i}].type",
                           "unsupported")  # fmt: skip
        assert isinstance(t, dict)
        if isinstance(t.get("function"), dict):  # the chat's shape, as some clients send it
            out.append(t)
            continue
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str) or (isinstance(choice, dict) and isinstance(choice.get("function"),
                                                                                              dict)):
        return choice  # a string, or the chat's shape (tool_mode checks both)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(400, 'tool_choice must be "auto", "none", "required" or {"type": "function", "name": ...}',
                   "tool_choice", "invalid_value")  # fmt: skip


def response_shell(ctx: ServerContext, body: ResponsesRequest, response_id: str) -> dict[str, Any]:
    """The response object before its output: what the request asked for, status in_progress."""
    given = body.text.format if body.text else None
    fmt = given.model_dump(by_alias=True, exclude_none=True) if given and given.type == "json_schema" else None
    fmt = fmt or {"type": given.type if given else "text"}
    return {
        "id": response_id, "object": "response", "created_at": int(time.time()), "completed_at": None,
        "status": "in_progress", "max_tool_calls": None, "top_logprobs": body.top_logprobs,
        "model": ctx.model_name, "output": [], "error": None, "incomplete_details": None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {}, "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id, "reasoning": {"effort": None, "summary": None},
        "store": body.store,  # the temperature and top_p it runs with: the model's generation_config fills a gap
        "temperature": ctx.sampling_defaults.get("temperature", 1.0) if body.temperature is None else body.temperature,
        "text": {"format": fmt}, "tool_choice": body.tool_choice or "auto",
        "tools": body.tools or [],
        "top_p": ctx.sampling_defaults.get("top_p", 1.0) if body.top_p is None else body.top_p,
        "truncation": body.truncation or "disabled", "usage": None, "user": body.user,
    }  # fmt: skip


def message_item(text: str, lps: list[dict[str, Any]] | None, status: str = "completed") -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": lps or []}
    return {"type": "message", "id": new_id("msg"), "status": status, "role": "assistant",
            "content": [part] if status == "completed" else []}  # fmt: skip


def call_item(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    fn = call["function"]
    return {"type": "function_call", "id": new_id("fc"), "call_id": call["id"], "name": fn["name"],
            "arguments": fn["arguments"] if status == "completed" else "", "status": status}  # fmt: skip


def reasoning_item(text: str, status: str = "completed") -> dict[str, Any]:
    """A thinking model's reasoning (the chat's `reasoning_content`) as OpenAI's `reasoning` item (its text as
    `content`, as vLLM's Responses API gives it; no summary)."""
    content = [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []
    return {"type": "reasoning", "id": new_id("rs"), "summary": [], "content": content, "status": status}


def output_items(message: dict[str, Any], lps: list[dict[str, Any]] | None, only_calls: bool) -> list[Any]:
    """A chat answer's message as output items: its reasoning (a thinking model's), its text (when it has some, or
    calls nothing and did not reason; never for a reply that can only be a call), then its calls. The
    text's logprobs are the reply's when it calls nothing (with calls they are the calls' tokens too, which a message
    cannot carry)."""
    calls = message.get("tool_calls") or []
    text = "" if only_calls else message.get("content") or ""
    thought = message.get("reasoning_content")
    items = [reasoning_item(thought)] if thought is not None else []
    if text or not (calls or only_calls or thought is not None):  # an empty answer after reasoning: no message
        items.append(message_item(text, None if calls or thought is not None else lps))
    return items + [call_item(c) for c in calls]


def finished(shell: dict[str, Any], items: list[Any], finish_reason: str | None, usage: dict[str, Any],
             extra: dict[str, Any] | None) -> dict[str, Any]:  # fmt: skip
    status = FINISHED.get(finish_reason or "", "failed")
    if status != "completed" and items and items[-1]["type"] in ("message", "reasoning"):  # the item cut off is, as
        # OpenAI marks it
        items = [*items[:-1], {**items[-1], "status": "incomplete"}]
    resp = {**shell, "status": status, "output": items, "usage": responses_usage(usage)}
    if status == "completed":
        resp["completed_at"] = int(time.time())
    if status == "incomplete":
        resp["incomplete_details"] = {"reason": "max_output_tokens"}
    if status == "failed":
        why = {"abort": "the request was ended before it finished (it timed out, was cancelled, or the server is "
                        "stopping)"}.get(finish_reason or "", f"the generation ended: {finish_reason}")  # fmt: skip
        resp["error"] = {"code": "server_error", "message": why}
    if extra is not None:
        resp["wkvm"] = extra
    return resp


def responses_usage(usage: dict[str, Any]) -> dict[str, Any]:
    """The chat's usage in Responses' names; cached_tokens: the prompt tokens a parked state saved recomputing."""
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": (usage.get("completion_tokens_details") or {}).get(
                "reasoning_tokens", 0)},
            "total_tokens": usage["total_tokens"]}  # fmt: skip


class EventStream:
    """The Responses stream's events, numbered, built from the chat stream's chunks. Its items' ids (and a call's
    call_id) follow from the response's id and the item's place, and `carry` holds the next event's number, so that
    a stream moved to another server goes on with the ids and numbers it would have had here."""

    def __init__(self, shell: dict[str, Any], only_calls: bool = False, carry: dict[str, Any] | None = None):
        self.shell, self.seq, self.items = shell, 0, list[dict[str, Any]]()
        self.carry = carry if carry is not None else {}
        self.text, self.lps = "", list[dict[str, Any]]()
        self.message: dict[str, Any] | None = None  # the open message item
        self.call_open: dict[str, Any] | None = None  # the open function_call item, its arguments so far
        self.thought: dict[str, Any] | None = None  # the open reasoning item
        self.thought_text = ""
        self.only_calls, self.reasoned = only_calls, False
        self.pending: list[dict[str, Any]] = []  # logprobs of tokens whose text is held back (or that are a call's)

    def event(self, kind: str, **fields: Any) -> str:
        line = f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': self.seq, **fields})}\n\n"
        self.seq += 1
        self.carry["seq"] = self.seq
        return line

    def item_id(self, kind: str) -> str:
        """The id of the item that opens now (`kind`: msg, rs, fc, or call for a call's call_id): the response's id
        and the item's place."""
        return f"{kind}_{self.shell['id'].removeprefix('resp_')}_{len(self.items)}"

    def delta(self, delta: dict[str, Any], lps: list[dict[str, Any]]) -> list[str]:
        """The events of one chat delta (its tokens' logprobs `lps`, where asked for): reasoning, an open call's
        last arguments, words, then new calls."""
        out: list[str] = []
        self.pending += lps
        if thought := delta.get("reasoning_content"):
            self.reasoned, self.pending = True, []  # a message after reasoning has no logprobs (as blocking:
            out += self.reasoning_delta(thought)  # they would be the reasoning's tokens' too)
        pieces = delta.get("tool_calls") or []
        for piece in (p for p in pieces if "id" not in p):  # an open call's last arguments come before the words
            out += self.call_piece(piece)  # after it, which the last chunk may carry too
        if content := "" if self.only_calls else delta.get("content"):
            out += self.text_delta(content, [] if self.reasoned else self.pending)
            self.pending = []
        if pieces:
            self.pending = []
        for piece in (p for p in pieces if "id" in p):
            out += self.close_message() + self.call_piece(piece)
        return out

    def reasoning_delta(self, delta: str) -> list[str]:
        """A thinking model's reasoning as it comes: its item opens with the first piece (it comes before the
        answer's items)."""
        out = []
        if self.thought is None:
            self.thought = {**reasoning_item("", "in_progress"), "id": self.item_id("rs")}
            out.append(self.event("response.output_item.added", output_index=len(self.items), item=self.thought))
        self.thought_text += delta
        out.append(self.event("response.reasoning_text.delta", item_id=self.thought["id"],
                              output_index=len(self.items), content_index=0, delta=delta))  # fmt: skip
        return out

    def close_reasoning(self, status: str = "completed") -> list[str]:
        if self.thought is None:
            return []
        item, index = {**reasoning_item(self.thought_text, status), "id": self.thought["id"]}, len(self.items)
        self.items.append(item)
        self.thought = None
        return [self.event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                           text=self.thought_text),
                self.event("response.output_item.done", output_index=index, item=item)]  # fmt: skip

    def text_delta(self, delta: str, lps: list[dict[str, Any]] | None) -> list[str]:
        out = self.close_reasoning() + self.close_call()
        if self.message is None:
            self.message = {**message_item("", None, "in_progress"), "id": self.item_id("msg")}
            out.append(self.event("response.output_item.added", output_index=len(self.items), item=self.message))
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out.append(self.event("response.content_part.added", item_id=self.message["id"],
                                  output_index=len(self.items), content_index=0, part=part))  # fmt: skip
        self.text += delta
        self.lps += lps or []
        if delta or lps:
            out.append(self.event("response.output_text.delta", item_id=self.message["id"],
                                  output_index=len(self.items), content_index=0, delta=delta, logprobs=lps or []))
        return out

    def close_message(self, status: str = "completed") -> list[str]:
        """The open message's done events (`status` incomplete: the answer's last message, cut off)."""
        if self.message is None:
            return []
        done = {**message_item(self.text, self.lps), "id": self.message["id"], "status": status}
        part, where = done["content"][0], {"item_id": done["id"], "output_index": len(self.items), "content_index": 0}
        out = [self.event("response.output_text.done", **where, text=self.text, logprobs=self.lps),
               self.event("response.content_part.done", **where, part=part),
               self.event("response.output_item.done", output_index=len(self.items), item=done)]  # fmt: skip
        self.items.append(done)
        self.message, self.text, self.lps = None, "", []  # words after a call are a message of their own
        return out

    def call_piece(self, piece: dict[str, Any]) -> list[str]:
        """A chat stream's `delta.tool_calls` entry: a new call (it has an id) opens its function_call item, and
        every entry's arguments are that call's `function_call_arguments.delta`, as OpenAI streams a call."""
        out = self.close_reasoning()
        if "id" in piece:
            out += self.close_call()
            call = call_item({**piece, "id": self.item_id("call")}, "in_progress")
            self.call_open = {**call, "id": self.item_id("fc")}
            out.append(self.event("response.output_item.added", output_index=len(self.items), item=self.call_open))
        args = (piece.get("function") or {}).get("arguments") or ""
        if args and self.call_open is not None:
            self.call_open["arguments"] += args
            out.append(self.event("response.function_call_arguments.delta", item_id=self.call_open["id"],
                                  output_index=len(self.items), delta=args))  # fmt: skip
        return out

    def close_call(self) -> list[str]:
        """The open call's done events: completed, or incomplete when its arguments are not a whole JSON object
        (the stream was cut inside them)."""
        if self.call_open is None:
            return []
        whole = isinstance(json_or_none(self.call_open["arguments"]), dict)
        item, index = {**self.call_open, "status": "completed" if whole else "incomplete"}, len(self.items)
        self.items.append(item)
        self.call_open = None
        return [self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                           name=item["name"], arguments=item["arguments"]),
                self.event("response.output_item.done", output_index=index, item=item)]  # fmt: skip


async def stream_events(ctx: ServerContext, tenant: str, body: ResponsesRequest, shell: dict[str, Any],
                        conversation: list[dict[str, Any]], chunks: AsyncIterator[str], run: Running,
                        done: Callable[[], object], replay: dict[str, Any] | None = None,
                        carry: dict[str, Any] | None = None) -> AsyncIterator[str]:  # fmt: skip
    """`events`, and `done` once they have ended (stored or not): a retrieve then reads the stored response."""
    try:
        async for ev in events(ctx, tenant, body, shell, conversation, chunks, run, replay, carry):
            yield ev
    finally:
        done()


async def events(ctx: ServerContext, tenant: str, body: ResponsesRequest, shell: dict[str, Any],
                 conversation: list[dict[str, Any]], chunks: AsyncIterator[str], run: Running,
                 replay: dict[str, Any] | None = None, carry: dict[str, Any] | None = None,
                 ) -> AsyncIterator[str]:  # fmt: skip
    """The Responses stream: created, in_progress, each output item's events as the chat's chunks come, then
    completed / incomplete / failed with the whole response (stored first, so a client that reads `completed` can
    continue from it at once). A failure after the start is an `error` event, then `response.failed`. A stream that
    moves to another server ends with the chat's handover event (nothing stored here); there `replay`, the chat
    delta of everything the source sent, rebuilds its items (their ids follow from the response's), and the events
    go on from the number the source reached (`carry`), without a second created / in_progress."""
    s = EventStream(shell, forced(body), carry)
    if replay is None:
        yield s.event("response.created", response=shell)
        yield s.event("response.in_progress", response=shell)
    else:
        seq = s.carry.get("seq")
        seq = seq if isinstance(seq, int) else 0  # the ticket's route names only short texts and integers
        s.delta(replay, [])  # the source sent these events: only the items they opened matter here
        s.seq = s.carry["seq"] = seq
    finish_reason, usage, extra, error = None, None, None, None
    try:
        async for obj in gen.sse_objects(chunks):
            if isinstance(obj, str):  # the stream goes on on another server: its handover event
                yield obj
                return
            if "error" in obj:
                error = obj["error"]
                break
            usage = obj.get("usage") or usage
            extra = obj.get("wkvm", extra)
            for c in obj.get("choices", []):
                lps = ((c.get("logprobs") or {}).get("content") or []) if logprobs(body) else []
                for ev in s.delta(c.get("delta") or {}, lps):
                    yield ev
                finish_reason = c.get("finish_reason") or finish_reason
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]  # a client gone: the chat stream ends its request
    whole = error is None and usage is not None and FINISHED.get(finish_reason or "") == "completed"
    for ev in s.close_reasoning("completed" if whole else "incomplete") + s.close_call():  # cut off while reasoning
        yield ev
    if error is None and not s.items and s.message is None and not s.only_calls:
        for ev in s.text_delta("", s.pending):  # an empty answer is still one (empty) message
            yield ev
    elif s.message is not None and not s.reasoned:
        s.lps += s.pending  # tokens that added no text (the end of a character that never came)
    for ev in s.close_message("completed" if whole else "incomplete"):
        yield ev
    if error is not None or usage is None:
        run.ended = True
        error = error or {"code": "server_error", "message": "the stream ended without its usage (a bug)"}
        yield s.event("error", code=error.get("code"), message=error.get("message"), param=error.get("param"))
        failed = {**shell, "status": "failed", "output": s.items,
                  "error": {"code": error.get("code") or "server_error", "message": error.get("message")}}  # fmt: skip
        yield s.event("response.failed", response=failed)
        return
    resp = finished(shell, s.items, finish_reason, usage, extra)
    await store(ctx, tenant, body, resp, conversation + input_messages(s.items), run)
    kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(resp["status"],
                                                                                      "response.failed")
    if kind == "response.failed":  # ended before it finished (a timeout): an `error` event first, as for any failure
        yield s.event("error", code=resp["error"]["code"], message=resp["error"]["message"], param=None)
    yield s.event(kind, response=resp)
