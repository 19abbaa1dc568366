"""Anthropic's Messages API: POST /v1/messages (blocking and SSE events) and POST /v1/messages/count_tokens.

As llama-server and vLLM serve it (so Claude Code and other Anthropic clients can talk to a local model), a request
runs as a chat completion (`openai_routes.chat_completion`): `system` is a leading system message, each message's
blocks become chat messages (text; `tool_use` blocks an assistant's `tool_calls`, their `tool_result` blocks `tool`
messages; earlier `thinking` blocks are dropped, as thinking templates drop earlier reasoning), `tools` the chat's
function tools, `thinking` the template's `enable_thinking`. A last assistant message is a prefill: the reply goes on
from its text. The chat's answer (or its chunks) is re-shaped into content blocks (or the Messages stream's events),
so chat reuse works here too: a conversation's next turn resumes its parked state when the tokens match exactly.
docs/http-api.md lists what is and is not read.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request, params
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError

from wkvm.chat_template import json_or_none
from wkvm.server import generation as gen
from wkvm.server.context import ServerContext
from wkvm.server.errors import APIError, error_body
from wkvm.server.openai_routes import chat_completion, chat_messages, check_model, passed_on_header, render_chat
from wkvm.server.responses_routes import new_id
from wkvm.server.schemas import ChatRequest, MessagesCountRequest, MessagesRequest
from wkvm.server.tools import tool_mode

STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens"}  # "stop": end_turn, stop_sequence or tool_use
# the chat's fields as a Messages request names them (in an error's param and message); a quoted value (a user's
# tool or property name) first, so that it is kept as it is
FIELDS = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences", "chat_template_kwargs": "thinking",
          "response_format": "output_config.format", ".function.parameters": ".input_schema", ".function.": "."}
CHAT_WORDS = re.compile(r"'[^']*'|\b(max_completion_tokens|chat_template_kwargs|response_format)\b|^stop\b|"
                        r"\bstop(?=[:\[.]|$)|(?<=\])\.function\.parameters\b|(?<=\])\.function\.")


def router(ctx: ServerContext, auth: params.Depends) -> APIRouter:
    r = APIRouter(dependencies=[auth])

    @r.post("/v1/messages", response_model=None)
    async def create(body: MessagesRequest, request: Request) -> dict[str, Any] | Response:
        ctx.require_ready()
        check_model(ctx, body.model)
        messages, prefill = conversation(body.system, body.messages)
        chat = chat_request(body, messages, prefill, ctx.config.max_tokens_limit)
        started: dict[str, Any] = {}
        try:
            out = await chat_completion(ctx, chat, request, started=lambda n, info, replay: started.update(
                tokens=n, info=info, replay=replay))  # fmt: skip
        except APIError as e:
            raise APIError(e.status, named(e.message) or e.message, named(e.param), e.code, e.headers) from None
        shell: dict[str, Any] = {"id": new_id("msg"), "type": "message", "role": "assistant", "model": body.model,
                                 "content": [], "stop_reason": None, "stop_sequence": None}  # fmt: skip
        if isinstance(out, StreamingResponse):
            prompt = started.get("tokens", 0), gen.cached_tokens({"wkvm": started.get("info") or {}})
            events = stream_events(shell, prompt, out.body_iterator, body.stop_sequences,  # type: ignore[arg-type]
                                   started.get("replay"))  # fmt: skip
            return StreamingResponse(events, media_type="text/event-stream", headers=passed_on_header(out))
        if not isinstance(out, dict):  # answered whole by the server it moved to (the front takes it from there)
            return out
        (choice,) = out["choices"]
        reason, sequence = stop_reason(choice["finish_reason"], choice.get("stop_reason"), body.stop_sequences,
                                       bool(choice["message"].get("tool_calls")))  # fmt: skip
        resp = {**shell, "content": blocks(choice["message"]), "stop_reason": reason, "stop_sequence": sequence,
                "usage": messages_usage(out["usage"])}  # fmt: skip
        if "wkvm" in out:
            resp["wkvm"] = out["wkvm"]
        return resp

    @r.post("/v1/messages/count_tokens")
    def count_tokens(body: MessagesCountRequest) -> dict[str, int]:
        """The prompt's tokens as /v1/messages would feed them (the template's rendering, with the tools)."""
        ctx.require_ready()
        check_model(ctx, body.model)
        messages, prefill = conversation(body.system, body.messages)
        tools, choice = chat_tools(body.tools), chat_tool_choice(body.tool_choice)
        mode = tool_mode(tools, choice, None)
        text = render_chat(ctx, chat_messages(chat_request_messages(messages)), mode.tools if mode else None,
                           not prefill, prefill, template_kwargs(body.thinking))  # fmt: skip
        return {"input_tokens": len(gen.encode_prompt(ctx, text, "messages", starts=False))}  # as the chat encodes

    return r


def named(text: str | None) -> str | None:
    """A chat completion's error message or param with its fields named as the Messages request names them."""
    if text is None:
        return None
    return CHAT_WORDS.sub(lambda m: FIELDS.get(m.group(0), m.group(0)), text)


def text_blocks(content: Any, where: str) -> str:
    """`system`, or a tool result's content: a string or a list of text blocks."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of text blocks", where, "invalid_value")
    texts = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text":
            raise APIError(400, f"{where}[{j}]: only text blocks are supported here (got {kind!r})",
                           f"{where}[{j}].type", "unsupported")  # fmt: skip
        text = block.get("text")
        if not isinstance(text, str):
            raise APIError(400, f"{where}[{j}]: a text block needs its text (a string)", f"{where}[{j}].text",
                           "invalid_value")  # fmt: skip
        texts.append(text)
    return "\n".join(texts)


def conversation(system: Any, messages: list[Any]) -> tuple[list[dict[str, Any]], bool]:
    """The request as chat messages, and whether the last is an assistant's text for the reply to go on from (a
    prefill). A system message among them stays where it is. Consecutive messages of one role are one turn, as
    Anthropic reads them; every `tool_use` needs its `tool_result` in the user message right after it, and every
    result a call before it, as Anthropic checks."""
    out: list[dict[str, Any]] = [{"role": "system", "content": text_blocks(system, "system")}] if system else []
    pending: dict[str, str] = {}  # the calls of the assistant message before: id -> where
    answered: set[str] = set()
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant", "system"):
            raise APIError(400, f"{where}.role must be 'user', 'assistant' or 'system' (got {role!r})",
                           f"{where}.role", "invalid_value")  # fmt: skip
        if role == "system":  # a system message among the turns (Claude Code sends one): text only
            add_turn(out, "system", text_blocks(m.get("content"), f"{where}.content"))
            continue
        content = m.get("content")
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if not isinstance(content, list) or not content:
            raise APIError(400, f"{where}.content must be a string or a non-empty list of content blocks",
                           f"{where}.content", "invalid_value")  # fmt: skip
        if role == "user":
            results, texts = user_blocks(content, where, pending)
            answered |= {r["tool_call_id"] for r in results}
            if missing := [c for c in pending if c not in answered]:
                raise APIError(400, f"{where}: the tool_use {missing[0]!r} ({pending[missing[0]]}) has no "
                               "tool_result block: answer every tool_use in the user message right after it",
                               f"{where}.content", "invalid_value")  # fmt: skip
            pending = {}
            out += results
            if texts:
                add_turn(out, "user", "\n".join(texts))
        else:
            if pending:
                raise APIError(400, f"{where}: the tool_use {next(iter(pending))!r} before it has no tool_result: a "
                               "user message with one comes first", f"{where}", "invalid_value")  # fmt: skip
            text, calls = assistant_blocks(content, where)
            for j, c in enumerate(calls):
                if c["id"] in answered or c["id"] in pending:
                    raise APIError(400, f"{where}.content[{j}]: two tool_use blocks have the id {c['id']!r}; give "
                                   "each its own", f"{where}.content[{j}].id", "invalid_value")  # fmt: skip
                pending[c["id"]] = f"{where}.content[{j}]"
            add_turn(out, "assistant", text, calls)
    prefill = bool(out) and out[-1]["role"] == "assistant" and not pending and bool(out[-1]["content"])
    if out and out[-1]["role"] == "assistant" and not prefill:
        why = "its tool_use blocks need results first" if pending else "it has no text to go on from"
        raise APIError(400, f"messages: the last message is the assistant's and {why}; end with a user message",
                       "messages", "invalid_value")  # fmt: skip
    return out, prefill


def add_turn(out: list[dict[str, Any]], role: str, text: str, calls: list[dict[str, Any]] | None = None) -> None:
    """A message; a second one of the same role right after joins the first (Anthropic's rule for consecutive
    turns)."""
    last = out[-1] if out else None
    if last is not None and last["role"] == role:
        last["content"] = "\n\n".join(t for t in (last["content"], text) if t)
        if calls:
            last.setdefault("tool_calls", []).extend(calls)
        return
    out.append({"role": role, "content": text, **({"tool_calls": calls} if calls else {})})


def user_blocks(content: list[Any], where: str,
                pending: dict[str, str]) -> tuple[list[dict[str, Any]], list[str]]:  # fmt: skip
    """A user message's tool results (as chat `tool` messages) and texts."""
    results, texts = [], []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_result":
            call = block.get("tool_use_id")
            if not isinstance(call, str) or call not in pending:
                raise APIError(400, f"{at}: tool_use_id {call!r} answers no tool_use of the assistant message right "
                               "before", f"{at}.tool_use_id", "invalid_value")  # fmt: skip
            text = text_blocks(block.get("content", ""), f"{at}.content")
            if block.get("is_error") is True:  # as the model would see an error any other way
                text = f"Error: {text}"
            results.append({"role": "tool", "tool_call_id": call, "content": text})
        elif kind in ("image", "document", "search_result"):
            raise APIError(400, f"{at}: {kind} blocks are not supported (a text model): send text", f"{at}.type",
                           "unsupported")  # fmt: skip
        else:
            raise APIError(400, f"{at}: a user message's blocks are text or tool_result (got {kind!r}"
                           f"{', without its text' if kind == 'text' else ''})", f"{at}.type", "invalid_value")
    return results, texts


def assistant_blocks(content: list[Any], where: str) -> tuple[str, list[dict[str, Any]]]:
    """An assistant message's text and its calls (chat `tool_calls`); thinking blocks are dropped."""
    texts, calls = [], []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use":
            name, call_id, args = block.get("name"), block.get("id"), block.get("input")
            if not isinstance(name, str) or not name or not isinstance(call_id, str) or not call_id:
                raise APIError(400, f"{at}: a tool_use block needs its id and name (strings)", at, "invalid_value")
            if not isinstance(args, dict):
                raise APIError(400, f"{at}.input must be an object (the tool's arguments)", f"{at}.input",
                               "invalid_value")  # fmt: skip
            calls.append({"id": call_id, "type": "function",
                          "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}})
        elif kind in ("thinking", "redacted_thinking"):
            continue
        else:
            raise APIError(400, f"{at}: an assistant message's blocks are text, tool_use or thinking (got {kind!r})",
                           f"{at}.type", "invalid_value")  # fmt: skip
    return "".join(texts), calls


def chat_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """Anthropic's client tools ({name, description, input_schema}) as the chat's function tools. Anthropic's own
    tools (web search, code execution, computer use, ...) run on Anthropic's servers or are defined by it: refused."""
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        kind = t.get("type") if isinstance(t, dict) else "?"
        if kind not in (None, "custom"):
            raise APIError(400, f"tools[{i}]: only client tools (name, description, input_schema) are supported, not "
                           f"{kind!r}", f"tools[{i}].type", "unsupported")  # fmt: skip
        assert isinstance(t, dict)
        if not isinstance(t.get("input_schema"), dict):
            raise APIError(400, f"tools[{i}].input_schema must be a JSON schema object", f"tools[{i}].input_schema",
                           "invalid_value")  # fmt: skip
        fn = {"name": t.get("name"), "parameters": t["input_schema"]}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: dict[str, Any] | None) -> Any:
    if choice is None:
        return None
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(400, 'tool_choice must be {"type": "auto"}, {"type": "any"}, {"type": "none"} or {"type": "tool", '
                   '"name": ...}', "tool_choice", "invalid_value")  # fmt: skip


def template_kwargs(thinking: dict[str, Any] | None) -> dict[str, Any] | None:
    """`thinking` as the chat template's `enable_thinking` (Qwen3's and other thinking templates read it); its
    budget_tokens is the chat's thinking_token_budget (`thinking_budget`)."""
    if thinking is None:
        return None
    kind = thinking.get("type")
    if kind not in ("enabled", "disabled", "adaptive", "between_tools"):
        raise APIError(400, 'thinking must be {"type": "enabled", "budget_tokens": N}, {"type": "adaptive"} or '
                       '{"type": "disabled"}', "thinking", "invalid_value")  # fmt: skip
    return {"enable_thinking": kind != "disabled"}


def thinking_budget(thinking: dict[str, Any] | None) -> int | None:
    """`thinking.budget_tokens` of an enabled thinking: at most that many tokens of reasoning, then `</think>` is
    forced (the chat's thinking_token_budget; Anthropic asks for 1,024 or more, any count >= 0 is taken here)."""
    if thinking is None or thinking.get("type") != "enabled" or thinking.get("budget_tokens") is None:
        return None
    budget = thinking["budget_tokens"]
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
        raise APIError(400, "thinking.budget_tokens must be an integer >= 0 (the most tokens of reasoning)",
                       "thinking.budget_tokens", "invalid_value")  # fmt: skip
    return budget


def response_format(body: MessagesCountRequest) -> dict[str, Any] | None:
    """`output_config.format` (or the beta's `output_format`): a JSON schema the reply follows, as the chat's
    response_format enforces it."""
    fmt = (body.output_config or {}).get("format") or body.output_format
    if fmt is None:
        return None
    where = "output_config.format" if (body.output_config or {}).get("format") else "output_format"
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise APIError(400, f'{where} must be {{"type": "json_schema", "schema": {{...}}}}', where, "invalid_value")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def chat_request_messages(messages: list[dict[str, Any]]) -> list[Any]:
    """The chat messages as chat_messages reads them (its pydantic form)."""
    return ChatRequest.model_validate({"messages": messages}).messages


def chat_request(body: MessagesRequest, messages: list[dict[str, Any]], prefill: bool, limit: int) -> ChatRequest:
    """The chat completion a Messages request runs. Its max_tokens is required, so clients send their model's
    ceiling (Claude Code 32,000 or more): past this server's --max-tokens-limit it is that limit, not a 400 (as
    llama-server takes any; a reply that reaches it ends with stop_reason max_tokens)."""
    tools = chat_tools(body.tools)
    choice = chat_tool_choice(body.tool_choice)
    d: dict[str, Any] = {
        "messages": messages, "stream": body.stream, "stream_options": {"include_usage": True} if body.stream else None,
        "max_completion_tokens": min(body.max_tokens, limit), "stop": body.stop_sequences, "tools": tools,
        "tool_choice": choice, "add_generation_prompt": not prefill, "continue_final_message": prefill,
        "chat_template_kwargs": template_kwargs(body.thinking), "response_format": response_format(body),
        "thinking_token_budget": thinking_budget(body.thinking),
    }  # fmt: skip
    if body.tool_choice is not None and body.tool_choice.get("disable_parallel_tool_use") is True:
        d["parallel_tool_calls"] = False
    if isinstance(body.metadata, dict) and isinstance(body.metadata.get("user_id"), str):
        d["user"] = body.metadata["user_id"]
    for key in ("temperature", "top_p", "top_k", "seed", "ignore_eos"):
        if getattr(body, key) is not None:
            d[key] = getattr(body, key)
    try:
        return ChatRequest.model_validate(d)
    except ValidationError as e:  # the blocks were checked one by one above: what is left is a value out of range
        err = e.errors()[0]
        param = named(".".join(str(p) for p in err["loc"])) or "messages"
        raise APIError(400, f"{param}: {err['msg']}", param, "invalid_value") from None


def blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat answer's message as content blocks: its reasoning (a thinking model's), its text, then its calls."""
    out: list[dict[str, Any]] = []
    if message.get("reasoning_content") is not None:
        out.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        out.append({"type": "text", "text": message["content"]})
    for c in message.get("tool_calls") or []:
        args = json_or_none(c["function"]["arguments"])
        out.append({"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                    "input": args if isinstance(args, dict) else {}})  # fmt: skip
    return out


def stop_reason(finish_reason: str | None, matched: Any, stop_sequences: list[str] | None,
                called: bool) -> tuple[str, str | None]:  # fmt: skip
    """Anthropic's stop_reason and stop_sequence for a chat choice's finish_reason and vLLM's stop_reason (the stop
    string that ended it, if one of the request's did). A reply that calls a tool ends with tool_use, as Anthropic's
    (OpenAI's finish_reason is "stop" for a call tool_choice named)."""
    if finish_reason == "stop" and isinstance(matched, str) and matched in (stop_sequences or ()):
        return "stop_sequence", matched
    if finish_reason in ("stop", "tool_calls", "length"):
        return STOP_REASONS.get(finish_reason, "tool_use" if called else "end_turn"), None
    raise APIError(408, "the request was ended before it finished (it ran past this server's --request-timeout, or "
                   "was cancelled)", None, "timeout")  # fmt: skip


def messages_usage(usage: dict[str, Any]) -> dict[str, Any]:
    """The chat's usage in Anthropic's names (`anthropic_usage`)."""
    return anthropic_usage(usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"],
                           usage["completion_tokens"])  # fmt: skip


def anthropic_usage(prompt: int, cached: int, output: int) -> dict[str, Any]:
    """input_tokens are the prompt's tokens computed, cache_read_input_tokens those a parked state saved computing
    (Anthropic counts them apart; their sum is the prompt)."""
    return {"input_tokens": prompt - cached, "output_tokens": output, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached}  # fmt: skip


def event(kind: str, **fields: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n"


class BlockStream:
    """The Messages stream's content block events, built from the chat stream's deltas: one block open at a time
    (thinking, text, or a tool_use whose input comes as partial JSON), numbered in order."""

    def __init__(self) -> None:
        self.index, self.open, self.called = -1, "", False

    def start(self, kind: str, block: dict[str, Any]) -> list[str]:
        out = self.stop()
        self.index, self.open = self.index + 1, kind
        return [*out, event("content_block_start", index=self.index, content_block=block)]

    def stop(self) -> list[str]:
        if not self.open:
            return []
        self.open = ""
        return [event("content_block_stop", index=self.index)]

    def delta(self, kind: str, delta: dict[str, Any]) -> list[str]:
        out = self.start(kind, BLOCK_STARTS[kind]()) if self.open != kind else []
        return [*out, event("content_block_delta", index=self.index, delta=delta)]


BLOCK_STARTS: dict[str, Callable[[], dict[str, Any]]] = {
    "thinking": lambda: {"type": "thinking", "thinking": "", "signature": ""},
    "text": lambda: {"type": "text", "text": ""},
}


def block_events(s: BlockStream, delta: dict[str, Any]) -> list[str]:
    """The content block events of one chat delta: reasoning as thinking, words as text, each call a tool_use block
    whose input comes as partial JSON."""
    out = []
    if thought := delta.get("reasoning_content"):
        out += s.delta("thinking", {"type": "thinking_delta", "thinking": thought})
    if text := delta.get("content"):
        out += s.delta("text", {"type": "text_delta", "text": text})
    for piece in delta.get("tool_calls") or []:
        fn = piece.get("function") or {}
        if "id" in piece:
            block = {"type": "tool_use", "id": piece["id"], "name": fn.get("name"), "input": {}}
            s.called = True
            out += s.start(f"tool {piece['id']}", block)
        if fn.get("arguments"):
            out.append(event("content_block_delta", index=s.index,
                             delta={"type": "input_json_delta", "partial_json": fn["arguments"]}))  # fmt: skip
    return out


async def stream_events(shell: dict[str, Any], prompt: tuple[int, int], chunks: AsyncIterator[str],
                        stop_sequences: list[str] | None,
                        replay: dict[str, Any] | None = None) -> AsyncIterator[str]:  # fmt: skip
    """Anthropic's stream: message_start (with the prompt's tokens), each content block's start, deltas and stop as
    the chat's chunks come, then message_delta (stop_reason, usage) and message_stop. A failure after the start is
    an `error` event, as Anthropic's. A stream that moves to another server ends with the chat's handover event (the
    front takes it out and relays the destination's events); there `replay`, the chat delta of everything the
    stream had sent before it moved, puts the blocks where the source left them, and the stream goes on without a
    second message_start."""
    s = BlockStream()
    if replay is None:
        yield event("message_start", message={**shell, "usage": anthropic_usage(*prompt, 0)})
    else:
        block_events(s, replay)  # the source sent these: only the blocks' numbering and the open one matter here
    finish_reason, matched, usage, error = None, None, None, None
    try:
        async for obj in gen.sse_objects(chunks):
            if isinstance(obj, str):  # the stream goes on on another server: its handover event
                yield obj
                return
            if "error" in obj:
                error = obj["error"]
                break
            usage = obj.get("usage") or usage
            for c in obj.get("choices", []):
                for ev in block_events(s, c.get("delta") or {}):
                    yield ev
                if c.get("finish_reason"):
                    finish_reason, matched = c["finish_reason"], c.get("stop_reason")
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]  # a client gone: the chat stream ends its request
    for ev in s.stop():
        yield ev
    if error is None and usage is None:
        error = {"type": "api_error", "message": "the stream ended without its usage (a bug)"}
    ended: tuple[str, str | None] | None = None
    if error is None:
        try:
            ended = stop_reason(finish_reason, matched, stop_sequences, s.called)
        except APIError as e:
            error = error_body(e.status, e.message, e.param, e.code)["error"]
    if error is not None or ended is None or usage is None:
        error = error or {}
        yield event("error", error={"type": error.get("type") or "api_error", "message": error.get("message")})
        return
    yield event("message_delta", delta={"stop_reason": ended[0], "stop_sequence": ended[1]},
                usage=messages_usage(usage))  # fmt: skip
    yield event("message_stop")

