"""The FastAPI application: one process, model loaded on a background thread, routes mounted."""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import generate_latest

from wkvm import __version__
from wkvm.config import ServerConfig
from wkvm.server import (
    embeddings_routes,
    messages_routes,
    ollama_routes,
    openai_routes,
    responses_routes,
    states_routes,
    tokenize_routes,
)
from wkvm.server.asgi import ApiKeyGate, BodyLimit, RequestMetrics, add_cors, add_host_check
from wkvm.server.context import ServerContext
from wkvm.server.errors import error_body, install_error_handlers

log = logging.getLogger("wkvm.server")


def server_error(path: str, status: int) -> None:
    log.error("server error: %s answered %d", path, status)


def preload_async_backend() -> None:
    """Import anyio's asyncio backend now, on the thread that builds the app, before the model's loader thread or any
    request thread exists. Since 4.15 anyio resolves the names of `anyio.abc` lazily on first use, and the backend's
    first import, made by the first request that needs it, failed once in a server of a fresh-clone test run
    (ModuleNotFoundError: anyio.abc._sockets, on a module that is there) while the loader thread was importing; an
    import made here is never first made on another thread."""
    importlib.import_module("anyio._backends._asyncio")


def create_app(config: ServerConfig, load_in_background: bool = True) -> FastAPI:
    preload_async_backend()
    ctx = ServerContext(config)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if load_in_background:
            ctx.loader = threading.Thread(target=ctx.load, name="wkvm-load", daemon=True)
            ctx.loader.start()
        else:
            ctx.load()
        yield
        ctx.shutdown()

    app = FastAPI(title="wkvm", version=__version__, lifespan=lifespan, openapi_url=None, docs_url=None,
                  redoc_url=None)  # fmt: skip
    app.state.ctx = ctx
    install_error_handlers(app)
    # the last added runs first: metrics see every response, the key is checked before the body is read
    app.add_middleware(BodyLimit, limit=config.max_body_bytes)
    app.add_middleware(ApiKeyGate, keys=ctx.keys)
    add_cors(app, config.allowed_origins)
    add_host_check(app, config.host, ctx.keys, config.allowed_hosts)  # runs first: before CORS and the key
    app.add_middleware(RequestMetrics, count=ctx.metrics.count_request, on_server_error=server_error)

    def authenticated(request: Request) -> str:
        return ctx.tenant(request)

    auth = Depends(authenticated)

    @app.get("/health", response_model=None)
    def health() -> dict[str, Any] | JSONResponse:
        if ctx.load_error:
            return JSONResponse(error_body(503, f"model failed to load: {ctx.load_error}", None, "model_load_failed"),
                                status_code=503)  # fmt: skip
        if not ctx.ready.is_set():  # as every route answers then (`require_ready`)
            return JSONResponse(error_body(503, "the model is still loading; retry shortly", None, "not_ready"),
                                status_code=503, headers={"Retry-After": "1"})  # fmt: skip
        if ctx.closing:  # a load balancer stops sending here while the running requests finish
            return JSONResponse(error_body(503, "the server is shutting down", None, "shutting_down"),
                                status_code=503, headers={"Retry-After": "1"})  # fmt: skip
        if ctx.generative and ctx.client.loop_failed():
            message = "the engine's step loop has stopped (a bug: see the server log); restart the server"
            return JSONResponse(error_body(503, message), status_code=503)
        return {"status": "ok", "model": ctx.model_name}

    # HEAD too: uptime monitors that probe with it had got a 405 (hunt, session 46); uvicorn sends no body for HEAD.
    # Out of the schema: one route with both methods gave OpenAPI two operations of one id (a warning)
    app.add_api_route("/health", health, methods=["HEAD"], response_model=None, include_in_schema=False)

    @app.get("/version", dependencies=[auth])
    def version() -> dict[str, Any]:
        """What is running (as vLLM's /version, plus the model's identity)."""
        import torch

        ctx.require_ready(generative=False)  # an embeddings-only server had answered 404
        if not ctx.generative:
            embedder = ctx.embedder
            return {"version": __version__, "torch": torch.__version__, "model": None,
                    "embeddings": embedder.name if embedder else None}  # fmt: skip
        return {"version": __version__, "torch": torch.__version__, "model": ctx.model_name,
                "family": ctx.model.spec.family, "fingerprint": ctx.model.fingerprint}  # fmt: skip

    @app.get("/metrics", dependencies=[auth], response_class=Response)
    def metrics() -> Response:
        if ctx.ready.is_set() and ctx.generative:
            body = ctx.metrics.render(ctx.client.stats(), ctx.store)
        else:  # loading, or embeddings only: the request counters (the engine's gauges have nothing to say)
            body = generate_latest(ctx.metrics.registry)
        return Response(body, media_type="text/plain; version=0.0.4")

    @app.get("/openapi.json", dependencies=[auth], include_in_schema=False)
    def openapi() -> dict[str, Any]:
        return app.openapi()

    app.include_router(openai_routes.router(ctx, auth))
    app.include_router(responses_routes.router(ctx, auth))
    app.include_router(messages_routes.router(ctx, auth))
    app.include_router(ollama_routes.router(ctx, auth))
    app.include_router(states_routes.router(ctx, auth))
    app.include_router(embeddings_routes.router(ctx, auth))
    app.include_router(tokenize_routes.router(ctx, auth))
    return app
