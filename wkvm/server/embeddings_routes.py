"""POST /v1/embeddings (OpenAI shape), and vLLM's Score and Rerank APIs on it (cosine similarity, as vLLM scores
with an embedding model), served by the `--embeddings` model next to the generative one."""

from __future__ import annotations

import asyncio
import base64
import threading
import time
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, Request, params

from wkvm.embeddings import EmbeddingCancelled, EmbeddingInputError, EmbeddingModel
from wkvm.engine.scheduler import QueueFull
from wkvm.server.context import ServerContext
from wkvm.server.errors import APIError
from wkvm.server.generation import check_text, new_id
from wkvm.server.schemas import EmbeddingRequest, RerankRequest, ScoreRequest

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

    @r.post("/score", dependencies=[Depends(embedder_present)])
    @r.post("/v1/score", dependencies=[Depends(embedder_present)])
    async def score(body: ScoreRequest, request: Request) -> dict[str, Any]:
        return await pair_scores(ctx, body, request)

    @r.post("/rerank", dependencies=[Depends(embedder_present)])
    @r.post("/v1/rerank", dependencies=[Depends(embedder_present)])
    @r.post("/v2/rerank", dependencies=[Depends(embedder_present)])
    async def rerank(body: RerankRequest, request: Request) -> dict[str, Any]:
        return await ranked(ctx, body, request)

    return r


async def pair_scores(ctx: ServerContext, body: ScoreRequest, request: Request) -> dict[str, Any]:
    """vLLM's Score API on an embedding model: each pair's cosine similarity. text_1 one text against each of
    text_2, or the two lists pair by pair."""
    model = embedding_model(ctx, body.model)
    first = [body.text_1] if isinstance(body.text_1, str) else body.text_1
    second = [body.text_2] if isinstance(body.text_2, str) else body.text_2
    if not first or not second:
        raise APIError(400, f"{'text_1' if not first else 'text_2'} is empty: give a text or a list of texts",
                       "text_1" if not first else "text_2", "invalid_value")  # fmt: skip
    if len(first) != 1 and len(first) != len(second):
        raise APIError(400, f"text_1 has {len(first)} texts and text_2 {len(second)}: give text_1 one text (scored "
                       "against each of text_2) or as many as text_2 (scored pair by pair)", "text_1",
                       "invalid_value")  # fmt: skip
    a, used_a = await vectors_of(ctx, list(first), request, "text_1")
    b, used_b = await vectors_of(ctx, list(second), request, "text_2")
    used = used_a + used_b  # the tokens embedded (text_1's once, however many pairs it is in)
    scores = cosine(a, b)
    return {"id": new_id("score"), "object": "list", "created": int(time.time()), "model": model.name,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": used, "total_tokens": used, "completion_tokens": 0}}  # fmt: skip


async def ranked(ctx: ServerContext, body: RerankRequest, request: Request) -> dict[str, Any]:
    """vLLM's Rerank API (Jina's and Cohere's shape) on an embedding model: the documents by their cosine
    similarity to the query, highest first, the top `top_n` (0: all)."""
    model = embedding_model(ctx, body.model)
    if not body.documents:
        raise APIError(400, "documents is empty: give the texts to rank", "documents", "invalid_value")
    q, used_q = await vectors_of(ctx, [body.query], request, "query")
    d, used_d = await vectors_of(ctx, list(body.documents), request, "documents")
    scores = cosine(q, d)
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[: body.top_n or None]
    results: list[dict[str, Any]] = []
    for i in order:
        results.append({"index": i, "relevance_score": scores[i]})
        if body.return_documents:
            results[-1]["document"] = {"text": body.documents[i]}
    return {"id": new_id("rerank"), "model": model.name, "usage": {"total_tokens": used_q + used_d},
            "results": results}  # fmt: skip


def cosine(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    """Row i of a against row i of b (a single row of a against every row of b): their cosine similarity."""
    import torch.nn.functional as F

    return [float(x) for x in F.cosine_similarity(a.float(), b.float(), dim=-1)]


def no_embedder() -> APIError:
    return APIError(404, "this server has no embedding model: start it with --embeddings DIR (e.g. "
                    "models/all-MiniLM-L6-v2 from `make minilm`)", "model", "model_not_found")  # fmt: skip


async def embed(ctx: ServerContext, body: EmbeddingRequest, request: Request) -> dict[str, Any]:
    """/v1/embeddings' answer (Ollama's /api/embed re-shapes it)."""
    model = embedding_model(ctx, body.model)
    if body.dimensions is not None and body.dimensions != model.dimensions:
        raise APIError(400, f"{model.name} gives {model.dimensions}-dimensional embeddings and cannot shorten "
                       "them (it was not trained for it): leave out `dimensions`", "dimensions",
                       "invalid_value")  # fmt: skip
    vectors, used = await vectors_of(ctx, inputs(body.input), request)
    data = [{"object": "embedding", "index": i, "embedding": encode(v.tolist(), body.encoding_format)}
            for i, v in enumerate(vectors)]  # fmt: skip
    return {"object": "list", "data": data, "model": model.name,
            "usage": {"prompt_tokens": used, "total_tokens": used}}  # fmt: skip


def embedding_model(ctx: ServerContext, name: str | None) -> EmbeddingModel:
    """The server's embedding model, where a request may use it (`name`: the request's `model`, if any)."""
    ctx.require_ready(generative=False)
    if ctx.embedder is None:
        raise no_embedder()
    model = ctx.embedder
    if name not in (None, "", model.name):
        raise APIError(404, f"embedding model {name!r} not found; this server embeds with {model.name!r}", "model",
                       "model_not_found")  # fmt: skip
    return model


async def vectors_of(ctx: ServerContext, texts: list[str | list[int]], request: Request,
                     field: str = "input") -> tuple[torch.Tensor, int]:  # fmt: skip
    """The embedding model's vectors for `texts` (strings or token ids; `field` names where they came from) and the
    tokens they took, computed on the model's own thread; a client that leaves stops them."""
    model = embedding_model(ctx, None)
    if len(texts) > MAX_INPUTS:
        raise APIError(400, f"{len(texts)} inputs; at most {MAX_INPUTS} per request", field, "invalid_value")
    for i, t in enumerate(texts):
        if isinstance(t, str):
            check_text(t, field)  # a lone surrogate was a 500 in the tokenizer
            if not t:
                raise APIError(400, f"{field} {i} is an empty string (as OpenAI, nothing to embed)", field,
                               "invalid_value")  # fmt: skip

    ids_given = [t for t in texts if not isinstance(t, str)]
    try:  # token ids are checked before they queue (their 400 had waited behind the queue; session 47)
        model.check(ids_given)
    except EmbeddingInputError as e:
        raise APIError(400, str(e), field, "invalid_value") from None
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
        raise APIError(400, str(e), field, "invalid_value") from None
    except EmbeddingCancelled:  # only once the client left
        raise APIError(499, "the client closed the connection", None, "client_closed_request") from None
    finally:
        model.waiting -= 1
    used = sum(len(x) for x in ids)
    ctx.metrics.prompt_tokens.inc(used)  # as vLLM counts a pooling model's prompts
    return vectors, used


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
