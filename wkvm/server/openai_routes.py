"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions (blocking and SSE)."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, cast

from fastapi import APIRouter, Request, params
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from wkvm.chat_template import ChatTemplateError, TemplateVariableError, template_messages
from wkvm.engine.engine import Event, RequestHandle
from wkvm.engine.request import Continuation
from wkvm.engine.scheduler import QueueFull
from wkvm.outputs import ErrorCode
from wkvm.sampling_params import SamplingParams
from wkvm.server import generation as gen
from wkvm.server.context import ServerContext
from wkvm.server.errors import APIError, error_body
from wkvm.server.handover import (
    HANDOVER_HEADER,
    RESUME_HEADER,
    STREAM_HEADER,
    HandoverError,
    LiveStream,
    Moved,
    Ticket,
    carried_logprobs,
    carried_prompt_logprobs,
    finished_output,
    marker,
)
from wkvm.server.handover import decode as decode_ticket
from wkvm.server.handover import encode as encode_ticket
from wkvm.server.reasoning import END, Thinking, parts, split, thinking
from wkvm.server.schemas import MAX_PROMPTS, ChatMessage, ChatRequest, CompletionRequest, SamplingFields
from wkvm.server.tools import (
    ToolMode,
    call_deltas,
    calls_ready,
    content_ready,
    cut_calls,
    final_delta,
    parse_reply,
    tool_mode,
    unenforceable_tool,
)
from wkvm.state.sessions import ChatMeta, Plan, reuse_scope
from wkvm.state.statefile import valid_name
from wkvm.state.store import QuotaExceeded, StateNotFound

log = logging.getLogger("wkvm.server")
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
GenBody = CompletionRequest | ChatRequest  # the bodies that can start from / save a state
Run = tuple[Plan, list[RequestHandle]]


def check_model(ctx: ServerContext, model: str | None) -> None:
    if model not in (None, "", ctx.model_name):
        raise APIError(404, f"model {model!r} not found; this server serves {ctx.model_name!r}", "model",
                       "model_not_found")  # fmt: skip


def save_final(ctx: ServerContext, tenant: str, name: str, parent: str | None, h: RequestHandle,
               param: str = "save_state") -> dict[str, Any]:  # fmt: skip
    """Save a finished generation's state: {"state": StateInfo}, or {"state_error": ...} when it cannot be
    saved (quota full, history too long, or no final state: a generation ended by shutdown or an error). The
    generation itself is never lost to a failed save. `param`: the request field that asked for the save."""
    result, out = h.run_result(), h.output
    if result.final_state is None:
        ended = out.finish_reason + (f", {out.error_code}" if out.error_code else "") if out.finish_reason else "early"
        why = f"{param}: the generation ended ({ended}) before its final state was captured; nothing was saved " \
              f"under {name!r}"  # fmt: skip
        return {"state_error": error_body(503, why, param, "state_unavailable")["error"]}
    limit = ctx.model.context_limit
    if limit is not None and len(result.history) >= limit:  # as creating or importing it would be refused
        why = (f"{param}: the generation filled the model's context ({limit} tokens), so its state leaves no room to "
               f"generate from; nothing was saved under {name!r}: ask for fewer max_tokens")
        return {"state_error": error_body(400, why, param, "context_length_exceeded")["error"]}
    try:
        rec = ctx.service.save_run(tenant, name, result, parent, {"completion_tokens": len(out.token_ids)})
    except (QuotaExceeded, ValueError) as e:
        status, code = (413, "state_quota_exceeded") if isinstance(e, QuotaExceeded) else (400, "invalid_state")
        return {"state_error": error_body(status, str(e), param, code)["error"]}
    return {"state": {"object": "state", **rec.info(ctx.model_name)}} if rec is not None else {}


def check_name(name: str, param: str) -> None:
    try:
        valid_name(name)
    except ValueError as e:
        raise APIError(400, str(e), param, "invalid_value") from None


def check_save_room(ctx: ServerContext, tenant: str, n_tokens: int, param: str,
                    advice: str = "lower max_tokens or start a new state") -> None:  # fmt: skip
    """Refuse before generating when a state of up to `n_tokens` tokens could not be saved: a clear 400 / 413
    up front instead of a generation whose state is then lost."""
    if n_tokens > ctx.store.max_tokens:
        # an attention state caches keys and values for all its history but the pending token (--max-state-tokens)
        flag = f" ({ctx.store.max_tokens - 1} cached, --max-state-tokens)" if ctx.model.spec.has_kv else ""
        raise APIError(400, f"{param}: the saved state would have a history of up to {n_tokens} tokens; a state's "
                       f"history is at most {ctx.store.max_tokens} tokens{flag}: {advice}", param,
                       "history_too_long")  # fmt: skip
    ctx.store.check_room(tenant, n_tokens)


def system_prefix(ctx: ServerContext, messages: list[dict[str, Any]], text: str, prompt_ids: list[int],
                  tools: list[dict[str, Any]] | None = None,
                  variables: dict[str, Any] | None = None) -> int:  # fmt: skip
    """How many leading tokens of the prompt are its leading system messages, when they render and tokenize to an
    exact prefix of it (0 otherwise): a boundary many conversations share, worth a checkpoint on first sight."""
    k = next((i for i, m in enumerate(messages) if m.get("role") not in ("system", "developer")), len(messages))
    if k == 0 or k == len(messages) or not ctx.config.prefix_reuse:  # no reuse: no checkpoint to place
        return 0
    try:
        head = ctx.template.render(messages[:k], add_generation_prompt=False, tools=tools, variables=variables)
    except ChatTemplateError:
        return 0
    ids = ctx.tokenizer.encode(head) if head and text.startswith(head) else []
    return len(ids) if ids and prompt_ids[: len(ids)] == ids else 0


def next_turn_prefix(ctx: ServerContext, messages: list[dict[str, Any]], text: str, prompt_ids: list[int],
                     tools: list[dict[str, Any]] | None = None,
                     variables: dict[str, Any] | None = None) -> int:  # fmt: skip
    """How many leading tokens of the prompt the conversation's next prompt keeps, where the template renders this
    turn's answer otherwise than its generation prompt began it (a thinking template opens `<think>` here and drops
    it from earlier turns): the conversation rendered with an answer and one more user message parts from this
    prompt's text there. 0 where it does not part (the prompt-end checkpoint serves) or the tokens do not spell the
    text's end."""
    if not ctx.config.prefix_reuse:
        return 0
    nxt = [*messages, {"role": "assistant", "content": "x"}, {"role": "user", "content": "x"}]
    try:
        rendered = ctx.template.render(nxt, add_generation_prompt=True, tools=tools, variables=variables)
    except ChatTemplateError:
        return 0
    common = common_prefix(text, rendered)
    if common >= len(text):
        return 0
    data, cut = text.encode(), len(text[:common].encode())
    end, k = len(data), len(prompt_ids)
    while k > 0 and end > cut:  # the prompt's last tokens, back to the first one whose text is all kept
        piece = ctx.tokenizer.token_bytes(prompt_ids[k - 1])
        if not piece or not data.endswith(piece, 0, end):
            return 0
        end, k = end - len(piece), k - 1
    return k


def common_prefix(a: str, b: str) -> int:
    """How many leading characters `a` and `b` share: by halving, each test one comparison of slices in C
    (`os.path.commonprefix` walks a long conversation a character at a time in Python)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


async def start(ctx: ServerContext, tenant: str, prompt_ids: list[int], body: GenBody, params: list[SamplingParams],
                chat: ChatMeta | None) -> Run:  # fmt: skip
    if body.save_state is not None:
        check_name(body.save_state, "save_state")
    scope = reuse_scope(tenant, body.user, body.cache_salt)

    def plan_run() -> Plan:  # reads the store (SQLite, maybe a state file): off the event loop
        try:
            if params[0].prompt_logprobs is not None:  # scored from its first token: no reused prefix, no checkpoint
                plan = Plan(list(prompt_ids))
            else:
                plan = ctx.sessions.plan(tenant, prompt_ids, body.state, chat, scope=scope)
        except ValueError as e:
            raise APIError(400, str(e), "state", "invalid_state") from None
        except StateNotFound as e:
            raise APIError(404, str(e), "state", "state_not_found") from None
        if body.save_state is not None:
            n_tokens = len(plan.base_ids) + len(plan.feed_ids) + params[0].max_tokens
            try:
                check_save_room(ctx, tenant, n_tokens, "save_state")
            except (APIError, QuotaExceeded):  # the plan reserved the chat's session for this turn: give it back
                ctx.sessions.track(chat, scope, [])  # (it had stayed reserved for 30 s, every retry a 409)
                raise
        return plan

    plan = await run_in_threadpool(plan_run)
    # max_tokens 0 ends with the whole prompt fed and no token pending, which no history describes: its final state
    # is never kept (so no checkpoint is made of it; save_state with max_tokens 0 is refused up front)
    keep = params[0].max_tokens > 0 and (plan.capture or bool(body.save_state))
    # an attention-only state cut to any shorter history is exact, so the turn's final state serves every prefix a
    # prompt-end or branch checkpoint would (sessions cut it): taking those too had cost the engine a copy of the
    # context's keys and values (45-90 ms at 3.5k SmolLM2 tokens, every stream waiting), a hash and twice the memory
    whole = keep and plan.capture and ctx.model.spec.cuttable
    try:
        handles = await ctx.client.generate(plan.feed_ids, params, plan.base_state, plan.base_ids, capture=keep,
                                            capture_prompt=plan.capture and not whole,
                                            capture_at=None if whole else plan.capture_at)  # fmt: skip
    finally:
        ctx.sessions.track(chat, scope, locals().get("handles", []))
    ctx.metrics.prompt_tokens.inc(len(prompt_ids))
    return plan, handles


async def start_all(ctx: ServerContext, tenant: str, encoded: list[list[int]], body: GenBody,
                    params: list[SamplingParams], chat: ChatMeta | None = None) -> list[Run]:  # fmt: skip
    """Admit every prompt of a request or none: check the queue has room for all, and if one still fails to
    start, cancel the ones already started."""
    per_prompt = len(params) + (1 if len(params) > 1 else 0)  # n > 1 adds one shared prefill
    need = len(encoded) * per_prompt
    if need > 1 and need > ctx.config.max_queue:  # never admissible: a 429 would have the SDK retry it in vain
        many = len(encoded) > 1
        raise APIError(400, f"the request needs {need} places in the queue ({len(encoded)} prompt(s), n = {len(params)}"
                       f"{', plus a shared prefill each' if len(params) > 1 else ''}), more than the whole queue holds "
                       f"(--max-queue {ctx.config.max_queue}): send fewer prompts or a smaller n", "prompt" if many
                       else "n", "too_many_prompts" if many else "invalid_value")  # fmt: skip
    # places are reserved when the room is checked (on the event loop: nothing runs between the check and the
    # reservation) and given back as the request's prompts are queued: concurrent requests of many places each passed
    # the check, then filled the queue between their submissions, and each was refused part-way (3 x 128 prompts: all
    # three 429s). Every request sees the places others reserved, so a single one cannot take them either.
    if need > ctx.client.queue_room() - ctx.reserved_places:
        ctx.refuse_if_closing()  # no room because the engine stopped taking requests: not a full queue
        raise QueueFull(f"the request needs {need} place(s) in the queue and fewer are free; retry later"
                        + (" or send fewer prompts" if need > 1 else ""))  # fmt: skip
    ctx.reserved_places += need
    runs: list[Run] = []
    try:
        for ids in encoded:
            runs.append(await start(ctx, tenant, ids, body, params, chat))
            ctx.reserved_places -= per_prompt
            need -= per_prompt
    except BaseException:
        for _, handles in runs:
            for h in handles:
                h.cancel()
        raise
    finally:
        ctx.reserved_places -= need  # what was not queued (a failure part-way)
    return runs


async def taken_over(ctx: ServerContext, request: Request, tenant: str) -> Moved | None:
    """The stream this request continues (`X-WKVM-Resume`: moved here from another server), or None."""
    ticket = request.headers.get(RESUME_HEADER)
    if ticket is None:
        return None
    data, base = await ctx.handovers.take_in(ticket)
    try:
        m = ctx.model
        moved = decode_ticket(data, m.spec, m.fingerprint, m.vocab_size, base) if data else None
    except HandoverError as e:
        raise APIError(400, str(e), None, "invalid_handover") from None
    if moved is None or moved[1].tenant != tenant:
        raise APIError(400, f"{RESUME_HEADER}: no moved stream waits here under this ticket (it expired, was taken, "
                       "or is another tenant's)", None, "unknown_handover")  # fmt: skip
    return moved


async def resume_runs(ctx: ServerContext, tenant: str, encoded: list[list[int]], body: GenBody,
                      params: list[SamplingParams], chat: ChatMeta | None, moved: Moved) -> list[Run]:  # fmt: skip
    """Go on with a request moved here: the same request, its engine requests (one per choice that was still running)
    resumed where the source stopped them. A run per prompt, in order (a prompt whose choices all finished at the
    source has none left to run: its run has no handles); choice i is prompt i // n's choice i % n."""
    cs, t = moved
    n = len(params)
    every = [*t.choices, *(f["index"] for f in t.finished or [])]  # a whole answer needs all its choices
    prompts = len(t.prompts) if t.prompts is not None else 1
    finished_scoring = [(f["prompt_ids"], f["index"]) for f in t.finished or [] if "prompt_ids" in f]
    if (prompts != len(encoded) or t.choices != sorted(t.choices) or max(t.choices) >= len(encoded) * n
            or (not body.stream and sorted(every) != list(range(len(encoded) * n)))
            or any(ids != encoded[i // n] for ids, i in finished_scoring if i < len(encoded) * n)):  # fmt: skip
        raise APIError(400, "a request moves with the prompts and choices it had", None, "invalid_handover")
    runs: list[Run] = []
    handles: list[RequestHandle] = []
    try:
        for j, prompt_ids in enumerate(encoded):
            mine = [k for k, i in enumerate(t.choices) if i // n == j]
            info = t.info if t.prompts is None else t.prompts[j]
            if not mine:
                runs.append((Plan(list(prompt_ids), info=info), []))
                continue
            c = cs[mine[0]]
            if (c.base_ids + c.prompt_ids)[-len(prompt_ids) :] != prompt_ids:
                raise APIError(400, f"{RESUME_HEADER}: this is not the request that moved", None, "invalid_handover")
            plan = Plan(list(c.prompt_ids), None, list(c.base_ids), t.parent, info, t.capture, capture_at=c.capture_at)
            if t.finish:
                ctx.sessions.continued(tenant, reuse_scope(tenant, body.user, body.cache_salt), plan, chat)
            hs: list[RequestHandle] = []
            for k in mine:
                hs.append(await ctx.client.resume(cs[k], params[t.choices[k] % n]))
                handles.append(hs[-1])
            runs.append((plan, hs))
    except BaseException:
        for h in handles:
            h.cancel()
        raise
    for h, lps in zip(handles, t.logprobs or [], strict=False):  # a whole answer's logprobs from the source
        if h.output.logprobs is not None:
            h.output.logprobs[:0] = carried_logprobs(lps)
    for h, scored in zip(handles, t.prompt_logprobs or [], strict=False):  # and its prompt's, scored there
        h.output.prompt_logprobs = carried_prompt_logprobs(scored)
    ctx.sessions.track(chat, reuse_scope(tenant, body.user, body.cache_salt), handles)
    return runs


def live_stream(tenant: str, body: GenBody, runs: list[Run], rid: str, created: int,
                moved: Moved | None = None) -> LiveStream:  # fmt: skip
    """How this request could move to another server (or why it cannot); `moved`: it moved here, with these choices.
    A request of several prompts carries each prompt's info, and no checkpoints (a cache: a later request recomputes)
    and no parent (the state a run started from only names a saved state's origin, and such a request saves none)."""
    plan, several = runs[0][0], len(runs) > 1
    handles = [h for _, hs in runs for h in hs]
    choices, done = (moved[1].choices, moved[1].done_tokens) if moved else (list(range(len(handles))), 0)
    ticket = Ticket(rid, created, tenant, plan.info, None if several else plan.parent, plan.capture and not several,
                    plan.finish is not None and not several, choices, done,
                    finished=moved[1].finished if moved else None,
                    prompts=[p.info for p, _ in runs] if several else None)  # fmt: skip
    why = None
    if handles and handles[0].request.prefill_only:
        why = "it generates nothing (max_tokens 0): there is nothing to go on with elsewhere"
    return LiveStream(tenant, handles, ticket, why, reuse_scope(tenant, body.user, body.cache_salt),
                      saves=body.save_state, whole=not body.stream)


def finish(ctx: ServerContext, tenant: str, body: GenBody, plan: Plan, handles: list[RequestHandle],
           arrived: bool = False) -> dict[str, Any]:  # fmt: skip
    """A finished request's extras, after its checkpoints and its `save_state`. `arrived`: the stream moved here, and
    its name may still be on its way (`ServerContext.holds_name`)."""
    extra: dict[str, Any] = {"wkvm": plan.info}
    if plan.finish is not None:
        plan.finish(handles)
    if body.save_state:
        if arrived and ctx.holds_name is not None and not ctx.holds_name(tenant, body.save_state):
            why = (f"save_state: the name {body.save_state!r} did not follow this stream to the replica it moved to; "
                   "its final state was not saved (the generation is complete)")  # fmt: skip
            extra["state_error"] = error_body(503, why, "save_state", "state_unavailable")["error"]
        else:
            extra.update(save_final(ctx, tenant, body.save_state, plan.parent, handles[0]))
    return extra


def finish_runs(ctx: ServerContext, tenant: str, body: CompletionRequest, runs: list[Run],
                arrived: bool = False) -> dict[str, Any]:  # fmt: skip
    """Extras of a completion: one prompt's `wkvm` object, or for a list of prompts {"prompts": [one per prompt]}."""
    extras = [finish(ctx, tenant, body, plan, hs, arrived) for plan, hs in runs]
    return extras[0] if len(extras) == 1 else {"wkvm": {"prompts": [e["wkvm"] for e in extras]}}


def router(ctx: ServerContext, auth: params.Depends) -> APIRouter:
    r = APIRouter(dependencies=[auth])

    def model_card() -> dict[str, Any]:
        return card(ctx.model_name, ctx.model_created, root=ctx.config.model, family=ctx.model.spec.family,
                    max_model_len=ctx.model.context_limit)  # fmt: skip

    def embedding_card() -> list[dict[str, Any]]:
        e = ctx.embedder
        return [] if e is None else [card(e.name, int(ctx.started_at), root=ctx.config.embeddings, family="embedding",
                                          dimensions=e.dimensions, max_model_len=e.max_tokens)]  # fmt: skip

    @r.get("/v1/models")
    def models() -> dict[str, Any]:
        ctx.require_ready(generative=False)
        data = [*([model_card()] if ctx.generative else []), *embedding_card()]
        # Anthropic's list fields beside OpenAI's (its SDK and Claude Code read these)
        ends = {"first_id": data[0]["id"], "last_id": data[-1]["id"]} if data else {"first_id": None, "last_id": None}
        return {"object": "list", "data": data, "has_more": False, **ends}

    @r.get("/v1/models/{model_id:path}")
    def model(model_id: str) -> dict[str, Any]:
        ctx.require_ready(generative=False)
        cards = embedding_card()
        if cards and model_id == cards[0]["id"]:
            return cards[0]
        if not ctx.generative or not model_id:  # "" means the default only in a body; an embeddings-only server had
            raise APIError(404, f"model {model_id!r} not found", "model", "model_not_found")  # read its absent model
        check_model(ctx, model_id)
        return model_card()

    @r.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await completion(ctx, body, request)

    @r.post("/v1/chat/completions", response_model=None)
    async def chat(body: ChatRequest, request: Request) -> Response:
        out = await chat_completion(ctx, body, request)
        return out if isinstance(out, Response) else await run_in_threadpool(JSONResponse, out)  # off the loop

    return r


async def completion(ctx: ServerContext, body: CompletionRequest, request: Request) -> Response:
    """A completion: the answer (serialized off the event loop), or its SSE stream; either may move to another
    server (Ollama's raw /api/generate re-shapes this stream and passes its handover event on)."""
    ctx.require_ready()
    tenant = ctx.tenant(request)
    check_model(ctx, body.model)
    for field, bad in (("suffix", body.suffix), ("best_of", body.best_of not in (None, body.n))):
        if bad:
            raise APIError(400, f"{field} is not supported", field, "unsupported")
    check_echo(body)
    p = body.prompt
    batch = isinstance(p, list) and p and isinstance(p[0], (str, list))
    # strict schema: a list led by a str or a list is list[str] or list[list[int]]; else p is str or list[int]
    prompts = cast(list[str | list[int]], list(p) if batch else [p])
    if len(prompts) > MAX_PROMPTS:
        raise APIError(400, f"prompt: at most {MAX_PROMPTS} prompts in one request; send several requests",
                       "prompt", "too_many_prompts")
    if len(prompts) > 1 and (body.state or body.save_state):
        raise APIError(400, "state and save_state take a single prompt", "prompt", "invalid_value")
    if body.save_state and body.n > 1:
        raise APIError(400, "save_state needs n = 1", "save_state", "invalid_value")
    scored = body.logprobs if body.echo else None  # echo with logprobs: the prompt tokens' logprobs too
    sp = gen.sampling_params(ctx, body, body.max_tokens, body.logprobs, prompt_logprobs=scored)
    await gen.check_grammar(ctx, sp)
    params = gen.per_choice(sp, body.n)
    # a prompt after `state` continues it: no BOS (its history has one where the tokenizer adds it);
    # add_special_tokens false (vLLM's): none for a text that brings its own
    starts = not body.state and body.add_special_tokens
    encoded = [await gen.encode_prompt_off_loop(ctx, q, "prompt", body.truncate_prompt_tokens, starts)
               for q in prompts]  # fmt: skip
    moved = await taken_over(ctx, request, tenant)
    if moved is not None:
        runs = await resume_runs(ctx, tenant, encoded, body, params, None, moved)
        rid, created = moved[1].id, moved[1].created
    else:
        runs = await gen.unless_gone(request, start_all(ctx, tenant, encoded, body, params))
        rid, created = gen.new_id("cmpl"), int(time.time())
    handles = [h for _, hs in runs for h in hs]
    prompt_tokens = sum(len(ids) for ids in encoded)
    k, as_ids = body.logprobs or 0, body.return_tokens_as_token_ids

    def echo_head(j: int) -> str:
        # truncate_prompt_tokens: the kept tokens' text, which the prompt's logprobs and offsets cover (the whole
        # prompt's text had been echoed, its offsets jumping over the cut; hunt, session 46)
        return gen.echo_text(ctx, encoded[j] if body.truncate_prompt_tokens is not None else prompts[j])

    def choice(i: int, h: gen.Answer) -> dict[str, Any]:
        out, j = h.output, i // body.n
        head = echo_head(j) if body.echo else ""
        text, lps = out.text, gen.completion_logprobs(ctx, out.token_ids, out.logprobs, k, len(head),
                                                      gen.skipped(ctx, body), as_ids)  # fmt: skip
        if body.echo:
            text, lps = gen.echoed(ctx, head, encoded[j], out.prompt_logprobs, k, text, lps, as_ids)
        c = gen.with_stop_reason(ctx, body, {"index": i, "text": text, "finish_reason": out.finish_reason,
                                             "logprobs": lps}, out.stop_reason)  # fmt: skip
        if body.return_token_ids:
            c["token_ids"] = h.output.token_ids
            c["prompt_token_ids"] = encoded[i // body.n]
        return c

    base = {"id": rid, "object": "text_completion", "created": created, "model": ctx.model_name,
            "system_fingerprint": ctx.system_fingerprint}  # fmt: skip
    live = live_stream(tenant, body, runs, rid, created, moved)
    ctx.handovers.register(live)
    if body.stream:
        echoes = [(echo_head(j), ids) for j, ids in enumerate(encoded) if body.echo]
        return StreamingResponse(
            stream_completion(ctx, request, body, runs, handles, base, prompt_tokens, tenant, k, echoes, live,
                              moved[0] if moved else None),
            media_type="text/event-stream", headers=movable_header(live),
        )  # fmt: skip
    if await wait_or_move(ctx, request, live):
        return await handed_over(ctx, live)
    extra = await run_in_threadpool(finish_runs, ctx, tenant, body, runs, moved is not None)

    def answer() -> Response:  # built and serialized off the event loop: n = 16 with logprobs 20 and 8,192
        answers = answered(handles, moved)  # tokens each, 70 MB of JSON, had held /health 9.8 s (a review's run)
        out = {**base, "choices": [choice(i, h) for i, h in enumerate(answers)],
               "usage": gen.usage(prompt_tokens, answers, extra=extra), **extra}  # fmt: skip
        if body.return_token_ids:
            out["prompt_token_ids"] = encoded if batch else encoded[0]
        return JSONResponse(out)

    return await run_in_threadpool(answer)


async def chat_completion(ctx: ServerContext, body: ChatRequest, request: Request, movable: bool = True,
                          started: Callable[[int, dict[str, Any], dict[str, Any] | None], object] | None = None,
                          carry: dict[str, Any] | None = None,
                          ) -> dict[str, Any] | Response:  # fmt: skip
    """A chat completion: the answer, or its SSE stream. `movable`: a request that may move to another server (the
    Responses API, which re-shapes this stream, passes False: its numbered events cannot be handed over yet).
    `started`: told the prompt's token count, its reuse (the `wkvm` object) and, for a stream that moved here, the
    delta of everything it had sent (None otherwise) once the request has started (the Messages stream's first event
    carries the first two; the third puts its blocks where the source left them). `carry`: what the calling API
    needs to go on elsewhere (`Ticket.route`): a request that moves takes it along as the caller last left it, and
    one that moved here has it filled from the ticket."""
    ctx.require_ready()
    tenant = ctx.tenant(request)
    check_model(ctx, body.model)
    messages = chat_messages(body.messages, body.functions)
    shaped = body.response_format is not None and body.response_format.type != "text"
    mode = tool_mode(body.tools, body.tool_choice, body.parallel_tool_calls,
                     shaped or gen.structured_outputs(body) is not None)  # fmt: skip
    refuse_request_template(body.chat_template)
    variables = ctx.template_variables(body.chat_template_kwargs)
    # off the event loop: a template's loops run as long as it says (a model's template of nested range(100000) had
    # held /health and every other request; loading hunt, session 49)
    text = await run_in_threadpool(render_chat, ctx, messages, mode.tools if mode else None, body.add_generation_prompt,
                                   body.continue_final_message, variables)  # fmt: skip
    if body.save_state and body.n > 1:
        raise APIError(400, "save_state needs n = 1", "save_state", "invalid_value")
    max_tokens = body.max_completion_tokens or body.max_tokens
    if body.top_logprobs is not None and not body.logprobs:  # OpenAI's and vLLM's 400: it would be silently ignored
        raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs", "invalid_value")
    k = (body.top_logprobs or 0) if body.logprobs else None
    field = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"  # as the client wrote it
    sp = gen.sampling_params(ctx, body, max_tokens, k, gen.DEFAULT_CHAT_MAX_TOKENS, ctx.template.stop,
                             max_tokens_field=field)  # fmt: skip
    if mode is not None and mode.forced:  # the reply can only be a valid call: the grammar enforces it
        if body.response_format is not None or sp.structured_outputs is not None:
            which = "response_format" if body.response_format is not None else "structured_outputs"
            raise APIError(400, f"tool_choice required / named already fixes the reply's form: leave out {which}",
                           which, "invalid_value")  # fmt: skip
        try:
            sp = gen.with_response_format(sp, mode.response_format(), "tools")
        except APIError:
            unenforceable_tool(mode)  # which tool's schema, where one is the cause
            raise
    grammar = shaped or sp.structured_outputs is not None or (mode is not None and mode.forced)
    calls = mode is not None and mode.choice == "auto" and mode.calls_in_text  # a <tool_call> may end the reasoning
    think = thinking(ctx.config.reasoning_parser, [ctx.template.source, ctx.template.tool_source], text, grammar,
                     body.include_reasoning, calls)  # fmt: skip
    if think is not None and grammar:  # the template opened a think block: the grammar holds from its end
        sp = dataclasses.replace(sp, grammar_after=END)
    if think is not None and body.thinking_token_budget is None and ctx.config.reasoning_budget >= 0:
        sp = dataclasses.replace(sp, thinking_token_budget=ctx.config.reasoning_budget)  # the server's default
    if sp.thinking_token_budget is not None and ctx.config.reasoning_budget_message:
        sp = dataclasses.replace(sp, thinking_budget_message=ctx.config.reasoning_budget_message)
    await gen.check_grammar(ctx, sp, "tools" if mode is not None and mode.forced else None)
    params = gen.per_choice(sp, body.n)
    if body.state:  # the messages continue the conversation the state holds (a prefill too: it had been rendered
        tools = mode.tools if mode else None  # alone, a second system prompt mid-conversation; hunt, session 48)
        after: str | None = await run_in_threadpool(turn_after_state, ctx, tenant, body.state, messages, tools,
                                                    body.add_generation_prompt, variables,
                                                    body.continue_final_message)  # fmt: skip
        text = text if after is None else after
    prompt_ids = await gen.encode_prompt_off_loop(ctx, text, "messages", body.truncate_prompt_tokens,
                                                  starts=body.add_special_tokens and not body.state)  # fmt: skip
    system = await run_in_threadpool(system_prefix, ctx, messages, text, prompt_ids, mode.tools if mode else None,
                                     variables)  # a render too: off the loop (review, session 49)
    kept = 0  # an attention-only state serves any prefix of a turn's: no capture point to place
    if think is not None and body.add_generation_prompt and not (body.continue_final_message or body.state or
                                                                  ctx.model.spec.cuttable):  # fmt: skip
        kept = await run_in_threadpool(next_turn_prefix, ctx, messages, text, prompt_ids,
                                       mode.tools if mode else None, variables)  # fmt: skip
    chat = ChatMeta.from_headers(request.headers, messages, system, kept)
    moved = await taken_over(ctx, request, tenant)
    if moved is not None:
        ((plan, handles),) = await resume_runs(ctx, tenant, [prompt_ids], body, params, chat, moved)
        rid, created = moved[1].id, moved[1].created
    else:
        ((plan, handles),) = await gen.unless_gone(request, start_all(ctx, tenant, [prompt_ids], body, params, chat))
        rid, created = gen.new_id("chatcmpl"), int(time.time())
    if started is not None:  # what a moved stream sent is a function of its text (ChoiceDeltas)
        replay = ChoiceDeltas(mode, think).feed(moved[0][0].text, None)[0] if moved and body.stream else None
        started(len(prompt_ids), plan.info, replay)
    base = {"id": rid, "created": created, "model": ctx.model_name, "system_fingerprint": ctx.system_fingerprint}
    live = live_stream(tenant, body, [(plan, handles)], rid, created, moved)
    if carry is not None:
        carry.update((moved[1].route or {}) if moved else {})
        live.ticket.route = carry
    if not movable:
        live.why_not = "a Responses API request asking for logprobs cannot move to another server"
    ctx.handovers.register(live)
    if body.stream:
        return StreamingResponse(
            stream_chat(ctx, request, body, plan, handles, base, len(prompt_ids), tenant, k, mode, think, live,
                        moved[0] if moved else None),
            media_type="text/event-stream", headers=movable_header(live),
        )  # fmt: skip
    if await wait_or_move(ctx, request, live):
        return await handed_over(ctx, live)
    extra = await run_in_threadpool(finish, ctx, tenant, body, plan, handles, moved is not None)

    def answer() -> dict[str, Any]:  # off the event loop: a large n with logprobs is megabytes of JSON
        choices = []
        answers = answered(handles, moved)
        for i, h in enumerate(answers):
            message, finish_reason = reply(h.output.text, h.output.finish_reason, mode, think)
            c = {"index": i, "message": message, "finish_reason": finish_reason,
                 "logprobs": gen.chat_logprobs(ctx, h.output.token_ids, h.output.logprobs, k or 0,
                                               body.return_tokens_as_token_ids)}  # fmt: skip
            gen.with_stop_reason(ctx, body, c, h.output.stop_reason if finish_reason == "stop" else None)
            if body.return_token_ids:
                c["token_ids"] = h.output.token_ids
            choices.append(c)
        out = {**base, "object": "chat.completion", "choices": choices,
               "usage": gen.usage(len(prompt_ids), answers, extra=extra,
                                  reasoning_tokens=reasoning_tokens(ctx, body, answers, think)), **extra}  # fmt: skip
        if body.return_token_ids:
            out["prompt_token_ids"] = prompt_ids
        return out

    return await run_in_threadpool(answer)


def card(name: str, created: int, **more: Any) -> dict[str, Any]:
    """A model's entry in /v1/models: OpenAI's fields, Anthropic's (`type`, `display_name`, `created_at`), then
    wkvm's (`more`)."""
    return {"id": name, "object": "model", "created": created, "owned_by": "wkvm", "type": "model",
            "display_name": name, "created_at": gen.iso_time(created), **more}  # fmt: skip


def check_echo(body: CompletionRequest) -> None:
    """max_tokens 0 only scores a prompt, so it needs echo; a prompt scored with echo and logprobs is fed from its
    first token, so it cannot start from a state."""
    if body.max_tokens == 0 and not body.echo:
        raise APIError(400, "max_tokens 0 generates nothing: send echo: true to get the prompt back (with logprobs, "
                       "its tokens' logprobs), or max_tokens >= 1", "max_tokens", "invalid_value")  # fmt: skip
    if body.max_tokens == 0 and body.save_state:
        raise APIError(400, "save_state needs max_tokens >= 1: max_tokens 0 only scores the prompt", "save_state",
                       "invalid_value")  # fmt: skip
    if body.echo and body.logprobs is not None and body.state:
        raise APIError(400, "echo with logprobs scores the prompt from its first token, so it cannot start from a "
                       "state: leave out state (send the whole text as prompt), echo or logprobs", "state",
                       "invalid_value")  # fmt: skip


CONTINUE_MARK = "WKVM_CONTINUE_FINAL_MESSAGE_MARK "  # transformers' own is "CONTINUE_FINAL_MESSAGE_TAG "


def refuse_request_template(template: str | None) -> None:
    """vLLM's 400 for a request's own `chat_template` unless started with --trust-request-chat-template."""
    if template is not None:
        raise APIError(400, "chat_template: this server renders chats with the model's own template only (a request's "
                       "template would run its Jinja here); leave it out", "chat_template", "unsupported")  # fmt: skip


# an exchange rendered before a chat's messages when they continue a stored state (private-use characters: no
# template or message holds them)
STATE_TURN = ({"role": "user", "content": "\ue000wkvm-ask\ue001"},
              {"role": "assistant", "content": "\ue000wkvm-answer\ue001"})  # fmt: skip


def turn_after_state(ctx: ServerContext, tenant: str, handle: str, messages: list[dict[str, Any]],
                     tools: list[dict[str, Any]] | None, add_generation_prompt: bool,
                     variables: dict[str, Any] | None, continue_final_message: bool = False) -> str | None:  # fmt: skip
    """The prompt text of a chat whose `state` holds the conversation so far: the template's rendering of an exchange
    then `messages`, from just after that exchange's answer (its end-of-turn marks, less the state's pending last
    token where that is one of them, then the new turn), as the whole conversation rendered at once continues. The
    messages had been rendered alone: a second system prompt mid-conversation (SmolLM2's default one) and no line
    break after the answer's <|im_end|> (hunt, session 47). None where the template does not show the answer as it
    is, or the handle names no state here (the request's own lookup then answers the 404)."""
    try:
        rec = ctx.store.get(tenant, handle)
    except (StateNotFound, ValueError):
        return None
    answer = STATE_TURN[1]["content"]
    try:
        full = render_chat(ctx, [*STATE_TURN, *messages], tools, add_generation_prompt, continue_final_message,
                           variables)  # fmt: skip
    except APIError:
        return None
    at = full.find(answer)
    if at < 0:
        return None
    rest = full[at + len(answer) :]
    last = ctx.tokenizer.decode(rec.token_ids[-1:]) if rec.token_ids else ""
    return rest[len(last) :] if last and rest.startswith(last) else rest


def render_chat(ctx: ServerContext, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                variables: dict[str, Any] | None = None) -> str:  # fmt: skip
    """The chat's prompt text through the model's template. `continue_final_message` (vLLM's): the prompt ends with
    the last message's own text, open, so the model continues it (a prefilled reply) instead of starting a new one.
    `variables`: the request's chat_template_kwargs (vLLM's), more names for the template."""
    if continue_final_message and add_generation_prompt:
        raise APIError(400, "continue_final_message continues the last message: set add_generation_prompt to false",
                       "continue_final_message", "invalid_value")  # fmt: skip
    content = messages[-1].get("content") if continue_final_message else ""
    if not isinstance(content, str) or (continue_final_message and messages[-1].get("tool_calls")):
        # an assistant's tool calls (its content null or ""): the prompt would end before them, dropping them (review,
        # session 48); transformers refuses a message without content too
        raise APIError(400, "continue_final_message: the last message has no text to continue (it holds tool "
                       "calls, or no content)", "messages", "invalid_value")  # fmt: skip
    final: str = content
    if continue_final_message:  # a mark after the last text, cut there (as transformers' apply_chat_template): its
        # text's last match had been taken, inside the template's closing marks when they held it ('<' or 'd')
        # an empty one too: the turn opened, its prompt ends where the text would start (an empty prefill had been a
        # 400; transformers and vLLM render it so; hunt, session 48)
        messages = [*messages[:-1], {**messages[-1], "content": f"{final}{CONTINUE_MARK}"}]
    try:
        text = ctx.template.render(template_messages(messages), add_generation_prompt, tools=tools,
                                   variables=variables)  # fmt: skip
    except TemplateVariableError as e:
        raise APIError(400, f"chat_template_kwargs: {e}", "chat_template_kwargs", "invalid_value") from None
    except ChatTemplateError as e:
        raise APIError(400, str(e), "messages", "template_error") from None
    if not continue_final_message:
        return text
    at = text.rfind(CONTINUE_MARK.strip())
    if at < 0 or final.strip() not in text[:at]:
        raise APIError(400, "continue_final_message: the last message needs text that the chat template shows as it "
                       "is (it has none, or the template changes it)", "messages", "invalid_value")  # fmt: skip
    # a template that trims the message's end trimmed the mark's space too: then the text's end is trimmed alike
    return text[:at] if text.startswith(CONTINUE_MARK, at) else text[:at].rstrip()


def check_tool_call(call: dict[str, Any], where: str) -> None:
    """An assistant message's earlier tool call as OpenAI shapes it: type "function" (the default), a string id if any,
    and a function object with a name and its arguments (a JSON string, or an object); a 400 naming the field (a
    missing or non-object function had been a 500: the chat template reads it)."""
    if call.get("type", "function") != "function":
        kind = str(call.get("type"))[:40]
        raise APIError(400, f"{where}: only function tool calls are supported (got type {kind!r})", f"{where}.type",
                       "unsupported")  # fmt: skip
    if "id" in call and not isinstance(call["id"], str):
        raise APIError(400, f"{where}.id must be a string", f"{where}.id", "invalid_value")
    fn = call.get("function")
    if not isinstance(fn, dict):
        raise APIError(400, f"{where}: a tool call needs its function, an object with a name and arguments",
                       f"{where}.function", "invalid_value")  # fmt: skip
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise APIError(400, f"{where}.function.name must be the called function's name (a non-empty string)",
                       f"{where}.function.name", "invalid_value")  # fmt: skip
    arguments = fn.get("arguments")
    arguments = "{}" if arguments is None or arguments == "" else arguments  # none: {} as vLLM gives the template
    if not isinstance(arguments, str | dict):
        raise APIError(400, f"{where}.function.arguments must be a JSON string (or an object) of the call's arguments",
                       f"{where}.function.arguments", "invalid_value")  # fmt: skip
    if isinstance(arguments, str) and arguments.strip():  # not JSON: the template had shown the model `null`
        try:
            json.loads(arguments)
        except (ValueError, RecursionError):  # "[" * 100000: too deep for the parser, a 500 before (session 47)
            raise APIError(400, f"{where}.function.arguments is not JSON: send the call's arguments as the JSON text "
                           "the model wrote (e.g. '{\"city\": \"Paris\"}')", f"{where}.function.arguments",
                           "invalid_value") from None  # fmt: skip


def chat_messages(messages: list[ChatMessage], functions: list[Any] | None = None) -> list[dict[str, Any]]:
    if functions:
        raise APIError(400, "functions (the deprecated form) is not supported: use tools", "functions", "unsupported")
    out: list[dict[str, Any]] = []
    call_ids: set[str] = set()  # earlier assistant messages' tool call ids
    unnamed = False  # a call without an id was seen: tool messages cannot be matched, so they are not checked
    pending: dict[str, int] = {}  # the last calls' ids not answered yet -> the message that made them
    for i, m in enumerate(messages):
        if pending and m.role != "tool" and not unnamed:  # (a call without an id: tool messages cannot be matched)
            unanswered(pending)
        if m.role not in CHAT_ROLES:
            raise APIError(400, f"messages[{i}].role {m.role!r} is not supported; use one of {list(CHAT_ROLES)}",
                           f"messages[{i}].role", "invalid_value")  # fmt: skip
        if isinstance(m.content, list):
            if not m.content and m.role != "assistant":  # OpenAI refuses an empty array too
                raise APIError(400, f"messages[{i}]: a {m.role} message needs content (an empty list of parts has "
                               "none)", f"messages[{i}].content", "invalid_value")  # fmt: skip
            texts = []
            for j, part in enumerate(m.content):
                if part.type not in ("text", "refusal"):  # OpenAI's assistant refusal: its text, as vLLM reads it
                    why = f"messages[{i}].content[{j}]: only text parts are supported yet (got {part.type!r})"
                    raise APIError(400, why, f"messages[{i}].content[{j}].type", "unsupported")
                text = part.text if part.type == "text" else (part.model_extra or {}).get("refusal")
                if not isinstance(text, str):
                    raise APIError(400, f"messages[{i}].content[{j}]: a {part.type} part needs its {part.type}",
                                   f"messages[{i}].content[{j}].{part.type}", "invalid_value")  # fmt: skip
                texts.append(text)
            content = "\n".join(texts)  # as vLLM joins them
        elif m.content is None and m.role != "assistant":  # an assistant's may be only its tool_calls
            raise APIError(400, f"messages[{i}]: a {m.role} message needs content", f"messages[{i}].content",
                           "invalid_value")  # fmt: skip
        else:
            content = m.content or ""
        gen.check_text(content, f"messages[{i}].content")  # here, not in the rendered template: its offset is theirs
        msg: dict[str, Any] = {"role": m.role, "content": content}
        if m.tool_calls:
            if m.role != "assistant":
                raise APIError(400, f"messages[{i}]: only assistant messages carry tool_calls",
                               f"messages[{i}].tool_calls", "invalid_value")  # fmt: skip
            for j, call in enumerate(m.tool_calls):
                check_tool_call(call, f"messages[{i}].tool_calls[{j}]")
                if "id" in call:
                    call_ids.add(call["id"])
                    pending[call["id"]] = i
                else:
                    unnamed = True
            msg["tool_calls"] = m.tool_calls
        if m.role == "tool":
            if not m.tool_call_id:
                raise APIError(400, f"messages[{i}]: a tool message needs the tool_call_id of the call it answers",
                               f"messages[{i}].tool_call_id", "invalid_value")  # fmt: skip
            if m.tool_call_id not in call_ids and not unnamed:  # OpenAI's 400 too (and the Responses API's here)
                raise APIError(400, f"messages[{i}].tool_call_id {m.tool_call_id[:64]!r} answers no tool call of an "
                               "earlier assistant message", f"messages[{i}].tool_call_id", "invalid_value")  # fmt: skip
            msg["tool_call_id"] = m.tool_call_id
            pending.pop(m.tool_call_id, None)
        for field in ("name", "reasoning_content"):  # for templates that read them, as vLLM passes them on
            if (value := getattr(m, field)) is not None:
                gen.check_text(value, f"messages[{i}].{field}")
                msg[field] = value
        out.append(msg)
    if pending and not unnamed:
        unanswered(pending)
    return out


def unanswered(pending: dict[str, int]) -> None:
    """OpenAI's 400 for an assistant message whose tool_calls are not each answered by a tool message right after
    it (the Responses API here refused the same conversation; chat had taken it; tools hunt, session 47)."""
    call, i = next(iter(pending.items()))
    raise APIError(400, f"messages[{i}]: its tool call {call[:64]!r} is answered by no tool message after it: an "
                   "assistant message with tool_calls must be followed by a role 'tool' message for each tool_call_id",
                   f"messages[{i}].tool_calls", "invalid_value")  # fmt: skip


async def stream_completion(ctx: ServerContext, request: Request, body: CompletionRequest, runs: list[Run],
                            handles: list[RequestHandle], base: dict[str, Any], prompt_tokens: int, tenant: str,
                            k: int, echoes: list[tuple[str, list[int]]], live: LiveStream,
                            moved_from: list[Continuation] | None = None) -> AsyncIterator[str]:  # fmt: skip
    """Completion chunks; with `echo` (`echoes`: each prompt's text and ids) a choice's first chunk starts with its
    prompt, and with its prompt tokens' logprobs. `moved_from`: per handle, where a server this stream moved from
    left it (its text sent stands in for its tokens; the handles are then the choices `live.ticket.choices` names)."""
    sent = [c.text for c in moved_from] if moved_from is not None else None
    # per choice, its tokens' text offsets so far; None before its first chunk
    offsets: list[gen.TokenOffsets | None] = [None] * len(handles)
    index = live.ticket.choices
    skip = gen.skipped(ctx, body)
    for i, text in enumerate(sent or []):  # moved here mid-stream: the text sent stands in for its tokens
        offsets[i] = gen.TokenOffsets((len(echoes[index[i] // body.n][0]) if echoes else 0) + len(text), skip)

    def chunk(i: int, ev: Event) -> dict[str, Any]:
        first = offsets[i] is None
        head, ids = echoes[index[i] // body.n] if echoes and first else ("", [])
        at = offsets[i] = offsets[i] or gen.TokenOffsets(len(head), skip)
        as_ids = body.return_tokens_as_token_ids
        text, lps = ev.text, gen.completion_logprobs(ctx, ev.token_ids, ev.logprobs, k, at, as_ids=as_ids)
        if echoes and first:
            text, lps = gen.echoed(ctx, head, ids, ev.prompt_logprobs, k, text, lps, as_ids)
        c = gen.with_stop_reason(ctx, body, {"index": index[i], "text": text, "finish_reason": ev.finish_reason,
                                             "logprobs": lps}, ev.stop_reason)  # fmt: skip
        if body.return_token_ids:
            c["token_ids"] = ev.token_ids
        return {**base, "choices": [c]}

    async for line in stream_chunks(ctx, request, body, handles, chunk, prompt_tokens, base,
                                    lambda: finish_runs(ctx, tenant, body, runs, sent is not None), live,
                                    counted=generated(moved_from)):  # fmt: skip
        yield line


async def stream_chat(ctx: ServerContext, request: Request, body: ChatRequest, plan: Plan,
                      handles: list[RequestHandle], base: dict[str, Any], prompt_tokens: int, tenant: str,
                      k: int | None, mode: ToolMode | None, think: Thinking | None, live: LiveStream,
                      moved_from: list[Continuation] | None = None) -> AsyncIterator[str]:  # fmt: skip
    """Chat chunks. With tools that may be called, a choice's text streams as content only up to where a call could
    begin (`tools.content_ready`: with `auto`, words before a `<tool_call>`; nothing of a forced call), its calls as
    `delta.tool_calls` as they come (`tools.calls_ready`: a call's index, id and name once its name is complete, then
    its arguments piece by piece, as OpenAI streams them), and its last chunk the rest (held content, the calls'
    last arguments, a bare JSON call whole). A thinking model's reasoning (`think`: reasoning.py) streams as
    `delta.reasoning_content`, and all of that holds for the answer after it. `moved_from`: per handle, where a
    server this stream moved from left it (the text it sent or held back); the handles are then the choices
    `live.ticket.choices` names."""
    sent = [c.text for c in moved_from] if moved_from is not None else None
    base = {**base, "object": "chat.completion.chunk"}
    index = live.ticket.choices
    nulls: dict[str, Any] = {"usage": None} if body.stream_options and body.stream_options.include_usage else {}
    if continuous_usage(body):
        nulls = {"usage": usage_so_far(prompt_tokens, 0)}
    # a forced call's reply has no words: its role chunk says content null, as OpenAI's; any other says "" (the reply
    # may still turn out to be a call under `auto`, but OpenAI starts an answer in words with "")
    opening = None if mode is not None and mode.forced else ""
    for i in range(len(handles) if sent is None else 0):  # a moved stream's role chunks went out already
        delta = {"role": "assistant", "content": opening}
        yield gen.sse({**base, "choices": [{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}],
                       **nulls})  # fmt: skip
    choices = [ChoiceDeltas(mode, think, text) for text in ([""] * len(handles) if sent is None else sent)]

    def chunk(i: int, ev: Event) -> dict[str, Any] | None:
        d, finish_reason = choices[i].feed(ev.text, ev.finish_reason)
        lps = gen.chat_logprobs(ctx, ev.token_ids, ev.logprobs, k or 0, body.return_tokens_as_token_ids)
        if not d and finish_reason is None and lps is None and not body.return_token_ids:
            return None  # nothing to say yet (text held back): OpenAI sends no empty chunk mid-stream
        c = {"index": index[i], "delta": d, "finish_reason": finish_reason, "logprobs": lps}
        gen.with_stop_reason(ctx, body, c, ev.stop_reason if finish_reason == "stop" else None)
        if body.return_token_ids:
            c["token_ids"] = ev.token_ids
        return {**base, "choices": [c]}

    moved = sent is not None
    async for line in stream_chunks(ctx, request, body, handles, chunk, prompt_tokens, base,
                                    lambda: finish(ctx, tenant, body, plan, handles, moved), live,
                                    lambda: reasoning_tokens(ctx, body, handles, think),
                                    generated(moved_from)):  # fmt: skip
        yield line


def reasoning_tokens(ctx: ServerContext, body: ChatRequest, answers: Sequence[gen.Answer],
                     think: Thinking | None) -> int | None:  # fmt: skip
    """The generated tokens that are reasoning (those that begin before each reply's answer), where replies are read
    for it; None elsewhere."""
    if think is None:
        return None
    n, skip = 0, gen.skipped(ctx, body)
    for h in answers:
        start = split(h.output.text, think, True)[2]
        cut = len(h.output.text) + 1 if start is None else start
        n += sum(at < cut for at in gen.TokenOffsets(0, skip).of(ctx, h.output.token_ids))
    return n


class ChoiceDeltas:
    """One streamed chat choice's deltas, from its text as it comes (`feed`): content as far as it can go out
    (`ready_words`), tool calls piece by piece (`tools.calls_ready`), a thinking model's reasoning
    (`reasoning.split`) before them, and the rest at its end (`tools.final_delta`). Depends only on the text so far:
    `sent`, the text a server this stream moved from had (sent or held back), puts it where that server was."""

    def __init__(self, mode: ToolMode | None, think: Thinking | None, sent: str = ""):
        self.mode, self.think, self.text = mode, think, sent
        # nothing to hold back or read: each piece is content as it comes (the text is not kept: a long reply's
        # joining had cost the event loop a copy of it a token)
        self.free = think is None and (mode is None or mode.choice == "none" or not mode.calls_in_text)
        _, self.thought, words = self.read(False)  # the end of the reasoning sent; the answer so far
        self.released = ready_words(words, mode)  # the answer's characters sent as content
        self.memo: dict[int, Any] = {}  # calls_ready's reading of the answer so far
        self.opened = calls_ready(words, mode, self.memo) if mode is not None else []  # its calls and arguments sent

    def feed(self, piece: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The delta for the text's next `piece` (and the finish reason the choice ends with, when it ends)."""
        if self.free:
            return ({"content": piece} if piece else {}), finish_reason
        self.text += piece
        done, d = finish_reason is not None, dict[str, Any]()
        start, end, text = self.read(done)
        if end > max(start, self.thought) and self.think is not None and self.think.include:
            d["reasoning_content"] = self.text[max(start, self.thought) : end]
        self.thought = max(end, self.thought)
        if not done:
            ready = ready_words(text, self.mode)
            if ready > self.released:
                d["content"] = text[self.released : ready]
            self.released = max(ready, self.released)
            if self.mode is not None and (deltas := call_deltas(calls_ready(text, self.mode, self.memo), self.opened)):
                d["tool_calls"] = deltas
            return d, None
        if self.mode is None:
            return d | ({"content": text[self.released :]} if len(text) > self.released else {}), finish_reason
        content, calls, finish_reason = final_delta(text, self.released, finish_reason, self.mode)
        d |= {"content": content} if content else {}
        finished = [(call["function"]["name"], call["function"]["arguments"]) for call in calls]
        if deltas := call_deltas(finished, self.opened, [call["id"] for call in calls]):
            d["tool_calls"] = deltas
        return d, finish_reason

    def read(self, done: bool) -> tuple[int, int, str]:
        """Where the reasoning lies in the text so far (`reasoning.split`; 0, 0 without it) and the answer after it
        ("" while there is none yet)."""
        if self.think is None:
            return 0, 0, self.text
        start, end, at = split(self.text, self.think, done)
        return start, end, "" if at is None else self.text[at:]


def ready_words(text: str, mode: ToolMode | None) -> int:
    """How much of an unfinished answer can stream as content now (with tools: `tools.content_ready`)."""
    return len(text) if mode is None else content_ready(text, mode)


def reply(text: str, finish_reason: str | None, mode: ToolMode | None,
          think: Thinking | None = None) -> tuple[dict[str, Any], str | None]:  # fmt: skip
    """The assistant message (and finish reason) for a finished choice: tool calls when its text is one; a thinking
    model's reasoning as `reasoning_content` (vLLM's field), the answer after it read as a whole reply is."""
    if think is None:
        return words_or_calls(text, finish_reason, mode)
    reasoning, after = parts(text, think)
    message, finish_reason = words_or_calls(after or "", finish_reason, mode)
    if after is None:  # it ended while reasoning: no answer (as vLLM's content null)
        message["content"] = None
    return {**message, "reasoning_content": reasoning}, finish_reason


def words_or_calls(text: str, finish_reason: str | None, mode: ToolMode | None) -> tuple[dict[str, Any], str | None]:
    if mode is None or finish_reason != "stop":  # a forced call cut off: its unfinished JSON is no answer in words
        cut = cut_calls(text, finish_reason, mode) if mode is not None else []  # the calls it completed are
        message = {"role": "assistant", "content": None if mode is not None and mode.forced else text}
        return ({**message, "tool_calls": cut} if cut else message), finish_reason
    content, calls = parse_reply(text, mode)
    if not calls:  # a forced call a stop string cut off is no answer in words either (as the stream says)
        return {"role": "assistant", "content": None if mode.forced else text}, finish_reason
    return {"role": "assistant", "content": content, "tool_calls": calls}, mode.calls_finish


async def stream_chunks(ctx: ServerContext, request: Request, body: SamplingFields, handles: list[RequestHandle],
                        chunk: Callable[[int, Event], dict[str, Any] | None], prompt_tokens: int,
                        base: dict[str, Any],
                        on_done: Callable[[], dict[str, Any]], live: LiveStream | None = None,
                        reasoning: Callable[[], int | None] | None = None, counted: list[int] | None = None,
                        ) -> AsyncIterator[str]:  # fmt: skip
    """SSE lines: a chunk per event, sent as it comes; the very last choice chunk carries the `wkvm` (and `state`)
    extras.

    The stream always ends with `data: [DONE]`: after the final chunk, or after an `error` event when a
    generation failed (or, for a bug, when this code did) once the response had started. A stream moved to another
    server (`live`, handover.py) ends instead with the handover event, after every chunk produced here (of every
    choice: one that finished here before the others stopped sends its last chunk here). With vLLM's
    `continuous_usage_stats` every chunk's usage is its choice's so far (`counted`: each handle's tokens generated
    before this stream's events, on the server a moved stream came from)."""
    usage = body.stream_options is not None and body.stream_options.include_usage
    continuous = continuous_usage(body)
    so_far = list(counted or [0] * len(handles))
    try:
        held: dict[str, Any] | None = None  # the stream's last chunk, which waits for the extras
        extra: dict[str, Any] = {}
        left, moving = len(handles), 0
        async for i, ev in gen.merged(ctx, request, handles):
            left -= ev.finished
            if ev.error_code == ErrorCode.MIGRATED and live is not None:
                moving += 1
                continue
            if not ev.token_ids and not ev.finished and not ev.text:
                continue
            c = chunk(i, ev)
            if c is not None and ev.finish_reason == "error":  # the error event says it: OpenAI has no "error"
                c["choices"][0]["finish_reason"] = None  # finish reason, and vLLM sends only its error payload
                if not (ev.token_ids or ev.text):
                    c = None
            so_far[i] += len(ev.token_ids)
            if c is not None and usage:  # OpenAI: with include_usage, every chunk but the last has usage null
                c["usage"] = usage_so_far(prompt_tokens, so_far[i]) if continuous else None
            if left or moving:
                if c is not None:
                    yield gen.sse(c)  # at once: a chunk is never held back for the next token
            else:
                held = c
        if moving and live is not None:
            yield await run_in_threadpool(hand_over, ctx, live)
            return
        failed = next((h for h in handles if h.output.finish_reason == "error"), None)
        if held is not None:
            if failed is None:
                tokens, held = split_finish(held)
                if tokens is not None:  # the answer's last tokens go now; only the end waits for the saves
                    yield gen.sse(tokens)
                extra = await run_in_threadpool(on_done)  # saves states: disk I/O off the event loop
                held.update(extra)
            yield gen.sse(held)
        if failed is not None:
            try:
                gen.raise_if_failed(failed)
            except APIError as e:
                yield gen.sse(error_body(e.status, e.message, e.param, e.code))
        elif body.stream_options and body.stream_options.include_usage:
            done = live.ticket.done_tokens if live is not None else 0  # choices that finished where it moved from
            thought = reasoning() if reasoning is not None else None  # a thinking model's reasoning tokens
            yield gen.sse({**base, "choices": [], "usage": gen.usage(prompt_tokens, handles, done, extra, thought)})
    except Exception as e:  # the response has started: the client still gets an error event and [DONE]
        log.exception("stream failed after it started (a bug)")
        yield gen.sse(error_body(500, f"internal error: {type(e).__name__}", None, "internal_error"))
    finally:
        if live is not None:
            ctx.handovers.unregister(live.ticket.id)
    yield gen.sse("[DONE]")


def continuous_usage(body: SamplingFields) -> bool:
    """vLLM's `continuous_usage_stats` (with include_usage): every chunk carries its choice's usage so far."""
    o = body.stream_options
    return o is not None and o.include_usage and o.continuous_usage_stats


def usage_so_far(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}  # fmt: skip


def generated(moved_from: list[Continuation] | None) -> list[int] | None:
    """Each moved choice's tokens generated on the server it moved from (None: it did not move)."""
    return None if moved_from is None else [len(c.output_ids) for c in moved_from]


def split_finish(chunk: dict[str, Any]) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """A stream's last choice chunk as (its tokens, without the finish; None when it has none) and (the finish alone,
    as OpenAI ends a stream: an empty delta or text). The end then waits for the turn's checkpoints and parked session
    (hashing and copying a long context's keys and values: 0.4 s at 3.5k SmolLM2 tokens) without holding back the
    answer's last token."""
    c = chunk["choices"][0]
    if not (c.get("delta") or c.get("text") or c.get("logprobs") is not None or c.get("token_ids")):
        return None, chunk
    end: dict[str, Any] = {"index": c["index"]}
    if "delta" in c:
        end["delta"] = {}
    else:
        end["text"] = ""
    end.update(finish_reason=c["finish_reason"], logprobs=None)
    if "stop_reason" in c:
        end["stop_reason"] = c["stop_reason"]
    if "token_ids" in c:
        end["token_ids"] = []
    head = {k: v for k, v in c.items() if k != "stop_reason"}
    return {**chunk, "choices": [{**head, "finish_reason": None}]}, {**chunk, "choices": [end]}


def hand_over(ctx: ServerContext, live: LiveStream) -> str:
    """The handover event ending a stream whose requests the engine suspended: its ticket waits here."""
    (c, *more), ticket = live.outgoing()
    to = live.to
    assert to is not None  # suspended through Handovers.move, which names the destination
    ctx.sessions.moved(live.handles)
    if c.prompt_state is not None and live.ticket.finish:  # checkpointed here rather than shipped (`encode`)
        ctx.sessions.keep_prompt_end(live.scope, c.base_ids + c.prompt_ids, c.prompt_state)
    live.push_now()  # the move's push, where the engine's thread has not run it yet
    if live.pushed and live.out_id is not None:  # its ticket went out when it stopped
        return marker(live.out_id, to)
    data = encode_ticket(ctx.model.spec, ctx.model.fingerprint, [c, *more], ticket)
    return marker(ctx.handovers.put_out(data, live.out_id), to)


def answered(handles: list[RequestHandle], moved: Moved | None) -> list[gen.Answer]:
    """A request answered whole: every choice in index order, those that finished on the server it moved from
    (`Ticket.finished`) with the ones that ran here."""
    if moved is None:
        return list(handles)
    t = moved[1]
    by_index: dict[int, gen.Answer] = dict(zip(t.choices, handles, strict=True))
    by_index.update((f["index"], finished_output(f)) for f in t.finished or [])
    return [by_index[i] for i in sorted(by_index)]


async def wait_or_move(ctx: ServerContext, request: Request, live: LiveStream) -> bool:
    """Wait for a request answered whole; True when it stopped to move instead (a stopping cluster replica's drain
    moves it: `Handovers.move`), and its answer is then the destination's."""
    try:
        await gen.wait_all(ctx, request, live.handles)
    finally:
        ctx.handovers.unregister(live.ticket.id)
    return live.to is not None and any(h.continuation is not None for h in live.handles)


async def handed_over(ctx: ServerContext, live: LiveStream) -> Response:
    """What a request answered whole says when it moved: its handover event (the cluster front takes it out and asks
    the destination, whose answer the client gets; a client never sees this)."""
    return Response(await run_in_threadpool(hand_over, ctx, live), media_type="text/event-stream",
                    headers={HANDOVER_HEADER: live.to or ""})  # fmt: skip


def movable_header(live: LiveStream) -> dict[str, str]:
    return {STREAM_HEADER: live.ticket.id} if live.why_not is None else {}


def passed_on_header(out: Response) -> dict[str, str]:
    """The movable header of a chat or completion stream, for an API that re-shapes it (Messages, Responses, Ollama):
    its stream may move as that one may."""
    return {STREAM_HEADER: out.headers[STREAM_HEADER]} if STREAM_HEADER in out.headers else {}
