"""POST /v1/embeddings (OpenAI shape), served by the `--embeddings` model next to the generative one."""

from __future__ import annotations

import asyncio
import base64
import threading
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, Request, params

from wkvm.embeddings import EmbeddingCancelled, EmbeddingInputError
from wkvm.engine.scheduler import QueueFull
from wkvm.server.context import ServerContext
from wkvm.server.errors import APIError
from wkvm.server.generation import check_text
from wkvm.server.schemas import EmbeddingRequest

if TYPE_CHECKING:
    import torch

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request


def router(ctx: ServerContext, auth: params.Depends) -> APIRouter:
    r = APIRouter(dependencies=[auth])

    def embedder_present() -> None:  # a dependency: it runs before the body is checked (a hunt's `{}` had got
        ctx.require_ready(generative=False)  # "input: Field required" from a server that has no embedding model)
        if ctx.embedder is None:
            raise no_embedder()

    @r.post("/v1/embeddings", dependencies=[Depends(embedder_present)])
    async def embeddings(body: EmbeddingRequest, request: Request) -> dict[str, Any]:
        return await embed(ctx, body, request)

    return r


def no_embedder() -> APIError:
    return APIError(404, "this server has no embedding model: start it with --embeddings DIR (e.g. "
                    "models/all-MiniLM-L6-v2 from `make minilm`)", "model", "model_not_found")  # fmt: skip


async def embed(ctx: ServerContext, body: EmbeddingRequest, request: Request) -> dict[str, Any]:
    """/v1/embeddings' answer (Ollama's /api/embed re-shapes it)."""
    ctx.require_ready(generative=False)
    if ctx.embedder is None:
        raise no_embedder()
    model = ctx.embedder
    if body.model not in (None, "", model.name):
        raise APIError(404, f"embedding model {body.model!r} not found; this server embeds with {model.name!r}",
                       "model", "model_not_found")  # fmt: skip
    if body.dimensions is not None and body.dimensions != model.dimensions:
        raise APIError(400, f"{model.name} gives {model.dimensions}-dimensional embeddings and cannot shorten "
                       "them (it was not trained for it): leave out `dimensions`", "dimensions",
                       "invalid_value")  # fmt: skip
    texts = inputs(body.input)
    if len(texts) > MAX_INPUTS:
        raise APIError(400, f"{len(texts)} inputs; at most {MAX_INPUTS} per request", "input", "invalid_value")
    for i, t in enumerate(texts):
        if isinstance(t, str):
            check_text(t, "input")  # a lone surrogate was a 500 in the tokenizer
            if not t:
                raise APIError(400, f"input {i} is an empty string (as OpenAI, nothing to embed)", "input",
                               "invalid_value")  # fmt: skip

    ids_given = [t for t in texts if not isinstance(t, str)]
    try:  # token ids are checked before they queue (their 400 had waited behind the queue; session 47)
        model.check(ids_given)
    except EmbeddingInputError as e:
        raise APIError(400, str(e), "input", "invalid_value") from None
    if model.waiting >= ctx.config.max_queue:  # the model's queue had no bound (the generative one's has)
        raise QueueFull(f"{model.waiting} embedding requests are waiting (--max-queue {ctx.config.max_queue}); "
                        "retry shortly")  # fmt: skip
    stop = threading.Event()

    def tokenized_and_embedded() -> tuple[list[list[int]], torch.Tensor]:
        # off the event loop: one long text took seconds to tokenize, and every other request waited
        ids = [model.token_ids(t) if isinstance(t, str) else t for t in texts]
        return ids, model.embed(ids, prompted=isinstance(texts[0], str), stop=stop)

    # on the model's own thread: waiting in the shared pool, a burst had held /health 8 s behind it
    work = asyncio.get_running_loop().run_in_executor(model.executor, tokenized_and_embedded)
    model.waiting += 1
    try:
        while not (await asyncio.wait({work}, timeout=0.2))[0]:
            if await request.is_disconnected():  # its work is dropped: abandoned requests had all been computed
                stop.set()  # a running one stops at its next batch, a queued one never starts
                work.cancel()
                raise APIError(499, "the client closed the connection before its embeddings were ready", None,
                               "client_closed_request")  # fmt: skip
        ids, vectors = work.result()
    except EmbeddingInputError as e:
        raise APIError(400, str(e), "input", "invalid_value") from None
    except EmbeddingCancelled:  # only once the client left
        raise APIError(499, "the client closed the connection", None, "client_closed_request") from None
    finally:
        model.waiting -= 1
    data = [{"object": "embedding", "index": i, "embedding": encode(v.tolist(), body.encoding_format)}
            for i, v in enumerate(vectors)]  # fmt: skip
    used = sum(len(x) for x in ids)
    ctx.metrics.prompt_tokens.inc(used)  # as vLLM counts a pooling model's prompts
    return {"object": "list", "data": data, "model": model.name,
            "usage": {"prompt_tokens": used, "total_tokens": used}}  # fmt: skip


def inputs(raw: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """OpenAI's input forms as a list of texts or token-id lists: a string, strings, one id list, id lists."""
    if isinstance(raw, str):
        return [raw]
    if not raw:
        raise APIError(400, "input is empty: give a string, a list of strings or token ids", "input", "invalid_value")
    if all(isinstance(x, int) for x in raw):
        return [list(raw)]  # type: ignore[arg-type]
    return list(raw)  # type: ignore[arg-type]


def encode(vector: list[float], fmt: str) -> list[float] | str:
    """`float`: the numbers; `base64`: little-endian float32 bytes, base64 (what the openai SDK decodes)."""
    if fmt == "float":
        return vector
    import numpy as np

    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
