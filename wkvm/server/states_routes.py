"""The Durable State API: /v1/states (create, list, get, delete, fork, generate, mutate, hibernate, pin,
export, import). Every route acts only on the caller's own states; another tenant's handle is a 404."""

from __future__ import annotations

import math
import time
from typing import Any

from fastapi import APIRouter, Depends, Request, params
from fastapi.responses import Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from wkvm.engine.engine import Event
from wkvm.server import generation as gen
from wkvm.server.context import ServerContext
from wkvm.server.errors import APIError
from wkvm.server.openai_routes import check_name, check_save_room, save_final, stream_chunks
from wkvm.server.schemas import CreateStateRequest, ForkRequest, HibernateRequest, MutateRequest, StateGenerateRequest
from wkvm.state.index import StateRecord
from wkvm.state.mutations import MutationError
from wkvm.state.sessions import Plan
from wkvm.state.statefile import StateFileError, parse_handle, valid_handle

IMPORT_BODY = {"requestBody": {"required": True, "content": {"application/octet-stream": {"schema": {
    "type": "string", "format": "binary"}}}}}  # fmt: skip


def bad_request(e: ValueError, param: str) -> APIError:
    return APIError(400, str(e), param, "invalid_value")


def router(ctx: ServerContext, auth: params.Depends) -> APIRouter:
    def generative_ready() -> None:  # after the key check: every state route needs the generative model
        ctx.require_ready()

    r = APIRouter(prefix="/v1/states", dependencies=[auth, Depends(generative_ready)])

    def who(request: Request) -> str:
        ctx.require_ready()
        return ctx.tenant(request)

    def info(rec: StateRecord) -> dict[str, Any]:
        return {"object": "state", **rec.info(ctx.model_name)}

    async def prompt_of(body: CreateStateRequest | StateGenerateRequest, param_text: str = "prompt",
                        required: bool = True) -> list[int]:  # fmt: skip
        """The body's prompt ids; a long text is tokenized off the event loop, as a completion's is (a 4 MB prompt
        here had held /health for 2 s)."""
        if body.prompt is not None and body.prompt_ids is not None:
            raise APIError(400, "give prompt or prompt_ids, not both", param_text, "invalid_value")
        if body.prompt_ids is not None:
            return gen.encode_prompt(ctx, body.prompt_ids, "prompt_ids") if body.prompt_ids or required else []
        if body.prompt or (body.prompt is not None and required):  # "" for a new state: empty_prompt, as completions
            # a new state's text starts a sequence (BOS where the tokenizer adds one); a suffix goes on
            return await gen.encode_prompt_off_loop(ctx, body.prompt, param_text, starts=required)
        if required:
            raise APIError(400, "give prompt (text) or prompt_ids (token ids)", param_text, "invalid_value")
        return []

    @r.post("")
    async def create(body: CreateStateRequest, request: Request) -> dict[str, Any]:
        tenant = who(request)
        check_name(body.name, "name")
        ids = await prompt_of(body)
        param = "prompt" if body.prompt is not None else "prompt_ids"
        limit = ctx.model.context_limit
        if limit is not None and len(ids) >= limit:  # as a completion refuses it: no room left to generate from it
            raise APIError(400, f"{param}: a state of {len(ids)} tokens leaves no room to generate within this "
                           f"model's context of {limit} tokens: use a shorter prompt", param, "context_length_exceeded")
        # before the prefill (lost work), after the context check: a quota's 413 ("delete states") can never help a
        # prompt the model cannot hold (hunt, session 46)
        check_save_room(ctx, tenant, len(ids), param, "use a shorter prompt")
        state = await ctx.client.prefill(ids[:-1]) if len(ids) > 1 else ctx.model.spec.zeros(1)
        ctx.metrics.prompt_tokens.inc(len(ids))  # prompt tokens received, as a completion's are counted
        try:
            return info(await run_in_threadpool(ctx.service.save_created, tenant, body.name, ids, state))
        except ValueError as e:
            raise bad_request(e, "name") from None

    @r.get("")
    def list_states(request: Request, limit: int | None = None, after: str | None = None) -> dict[str, Any]:
        return state_page([info(rec) for rec in ctx.store.list(who(request))], limit, after)

    @r.post("/import", openapi_extra=IMPORT_BODY)
    async def import_state(request: Request, name: str | None = None) -> dict[str, Any]:
        tenant = who(request)
        if name is not None:
            check_name(name, "name")
        data = await request.body()
        return info(await run_in_threadpool(ctx.store.import_bytes, tenant, data, name, ctx.model.context_limit,
                                            ctx.service.page_max))  # fmt: skip

    @r.get("/{handle}")
    def get(handle: str, request: Request) -> dict[str, Any]:
        return info(lookup(ctx, who(request), handle))

    @r.delete("/{handle}")
    def delete(handle: str, request: Request) -> dict[str, Any]:
        tenant = who(request)
        rec = lookup(ctx, tenant, handle)
        ctx.store.delete(tenant, rec.handle)
        return {"id": rec.handle, "object": "state", "deleted": True}

    @r.post("/{handle}/fork")
    def fork(handle: str, body: ForkRequest, request: Request) -> dict[str, Any]:
        tenant = who(request)
        try:
            return info(ctx.store.fork(tenant, lookup(ctx, tenant, handle).handle, body.name))
        except ValueError as e:
            raise bad_request(e, "name") from None

    @r.post("/{handle}/mutate")
    def mutate(handle: str, body: MutateRequest, request: Request) -> dict[str, Any]:
        tenant = who(request)
        try:
            return info(ctx.service.mutate(tenant, lookup(ctx, tenant, handle).handle, body.rule, body.params))
        except MutationError:
            raise
        except ValueError as e:  # e.g. a malformed handle in params.other
            raise bad_request(e, "params") from None

    @r.post("/{handle}/hibernate")
    def hibernate(handle: str, request: Request, body: HibernateRequest | None = None) -> dict[str, Any]:
        tenant = who(request)  # no body: the default tier
        return info(ctx.store.hibernate(tenant, lookup(ctx, tenant, handle).handle, (body or HibernateRequest()).tier))

    @r.post("/{handle}/pin")
    def pin(handle: str, request: Request) -> dict[str, Any]:
        tenant = who(request)
        return info(ctx.store.set_pinned(tenant, lookup(ctx, tenant, handle).handle, True))

    @r.post("/{handle}/unpin")
    def unpin(handle: str, request: Request) -> dict[str, Any]:
        tenant = who(request)
        return info(ctx.store.set_pinned(tenant, lookup(ctx, tenant, handle).handle, False))

    @r.get("/{handle}/export", response_class=Response)
    def export(handle: str, request: Request) -> Response:
        tenant = who(request)
        rec = lookup(ctx, tenant, handle)
        data = ctx.store.export_bytes(tenant, rec.handle)
        disposition = f'attachment; filename="{rec.name}@{rec.version}.wkvm-state"'
        return Response(data, media_type="application/octet-stream", headers={"Content-Disposition": disposition})

    @r.post("/{handle}/generate", response_model=None)
    async def generate(handle: str, body: StateGenerateRequest, request: Request) -> dict[str, Any] | StreamingResponse:
        tenant = who(request)
        for field, served in (("n", body.n in (None, 1)), ("best_of", body.best_of in (None, 1)),
                              ("echo", not body.echo), ("suffix", body.suffix is None)):  # fmt: skip
            if not served:  # answered as if never sent, a user had got one choice, no prompt, no suffix
                raise APIError(400, f"{field} is not served by /v1/states/{{handle}}/generate (one answer from the "
                               'state): send it to /v1/completions with "state": the handle', field,
                               "unsupported")  # fmt: skip
        suffix = await prompt_of(body, required=False)
        params = gen.sampling_params(ctx, body, body.max_tokens, body.logprobs)
        await gen.check_grammar(ctx, params)
        if body.save_as is not None:
            check_name(body.save_as, "save_as")

        def prepare() -> tuple[StateRecord, Plan]:  # the store's reads (and its lock) stay off the event loop
            rec = lookup(ctx, tenant, handle)
            if body.save_as is not None:
                check_save_room(ctx, tenant, rec.n_tokens + len(suffix) + params.max_tokens, "save_as")
            try:
                return rec, ctx.sessions.from_handle(tenant, rec.handle, suffix)
            except StateFileError as e:  # the state itself (its keys or values beyond the pages' range)
                raise bad_request(e, "handle") from None
            except ValueError as e:
                raise bad_request(e, "prompt") from None

        rec, plan = await run_in_threadpool(prepare)
        handles = await ctx.client.generate(plan.feed_ids, [params], plan.base_state, plan.base_ids,
                                            capture=body.save_as is not None)  # fmt: skip
        ctx.metrics.prompt_tokens.inc(len(suffix))
        h = handles[0]
        base = {"id": gen.new_id("cmpl"), "object": "text_completion", "created": int(time.time()),
                "model": ctx.model_name, "system_fingerprint": ctx.system_fingerprint}  # fmt: skip
        k = body.logprobs or 0

        def extras() -> dict[str, Any]:
            out: dict[str, Any] = {"wkvm": plan.info}
            if body.save_as:
                out.update(save_final(ctx, tenant, body.save_as, rec.handle, h, "save_as"))
            return out

        if body.stream:
            at = gen.TokenOffsets(0, gen.skipped(ctx, body))  # across the chunks (each chunk had started at 0)

            def chunk(i: int, ev: Event) -> dict[str, Any]:
                c = {"index": 0, "text": ev.text, "finish_reason": ev.finish_reason,
                     "logprobs": gen.completion_logprobs(ctx, ev.token_ids, ev.logprobs, k, at,
                                                         as_ids=body.return_tokens_as_token_ids)}  # fmt: skip
                gen.with_stop_reason(ctx, body, c, ev.stop_reason)
                if body.return_token_ids:
                    c["token_ids"] = ev.token_ids
                return {**base, "choices": [c]}

            lines = stream_chunks(ctx, request, body, handles, chunk, len(suffix), base, extras)
            return StreamingResponse(lines, media_type="text/event-stream")
        await gen.wait_all(ctx, request, handles)
        c = {"index": 0, "text": h.output.text, "finish_reason": h.output.finish_reason,
             "logprobs": gen.completion_logprobs(ctx, h.output.token_ids, h.output.logprobs, k,
                                                 skip=gen.skipped(ctx, body),
                                                 as_ids=body.return_tokens_as_token_ids)}  # fmt: skip
        gen.with_stop_reason(ctx, body, c, h.output.stop_reason)
        if body.return_token_ids:
            c["token_ids"] = h.output.token_ids
            c["prompt_token_ids"] = suffix
        extra = await run_in_threadpool(extras)
        out = {**base, "choices": [c], "usage": gen.usage(len(suffix), handles, extra=extra), **extra}
        if body.return_token_ids:  # at the top level too, as /v1/completions (hunt, session 46: per choice only)
            out["prompt_token_ids"] = suffix
        return out

    return r


def lookup(ctx: ServerContext, tenant: str, handle: str) -> StateRecord:
    try:
        return ctx.store.get(tenant, valid_handle(handle))  # "a b" is an invalid name, not "not found" (session 47)
    except ValueError as e:
        raise bad_request(e, "handle") from None


MAX_PAGE = 10_000


def state_page(data: list[dict[str, Any]], limit: int | None, after: str | None) -> dict[str, Any]:
    """`GET /v1/states`: the states in handle order (name, then version), the ones after the handle `after`, at most
    `limit` of them (all without it), as OpenAI's list endpoints give them (`has_more`, `first_id`, `last_id`)."""
    if limit is not None and not 1 <= limit <= MAX_PAGE:
        raise APIError(400, f"limit must be an integer 1..{MAX_PAGE}", "limit", "invalid_value")
    data = sorted(data, key=lambda s: (s["name"], s["version"]))
    if after is not None:
        try:
            name, version = parse_handle(valid_handle(after))
        except ValueError as e:
            raise APIError(400, f"after: {e}", "after", "invalid_value") from None
        last = version if version is not None else math.inf  # a bare name is its latest version, as elsewhere
        data = [s for s in data if (s["name"], s["version"]) > (name, last)]
    page = data if limit is None else data[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["handle"] if page else None,
            "last_id": page[-1]["handle"] if page else None, "has_more": len(page) < len(data)}  # fmt: skip
