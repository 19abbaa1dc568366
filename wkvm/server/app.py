"""The FastAPI application: one process, model loaded on a background thread, routes mounted."""

from __future__ import annotations

import threading
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from wkvm import __version__
from wkvm.config import ServerConfig
from wkvm.server import openai_routes, states_routes
from wkvm.server.context import ServerContext
from wkvm.server.errors import error_body, install_error_handlers


class BodyLimit:
    """Refuse request bodies over `limit` bytes with a 413, whether or not they declare a length.

    A body without a declared length is read here first (up to the limit) and then handed to the app.
    """

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            if declared.isdigit() and int(declared) > self.limit:
                return await self._refuse(scope, receive, send)
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":
                break
            size += len(msg.get("body", b""))
            if size > self.limit:
                return await self._refuse(scope, receive, send)
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body"):
                break
        body = b"".join(chunks)
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    async def _refuse(self, scope, receive, send):
        message = f"request body over {self.limit} bytes (--max-body-bytes)"
        resp = JSONResponse(error_body(413, message, "body", "body_too_large"), status_code=413)
        await resp(scope, receive, send)


def create_app(config: ServerConfig, load_in_background: bool = True) -> FastAPI:
    ctx = ServerContext(config)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        if load_in_background:
            threading.Thread(target=ctx.load, name="wkvm-load", daemon=True).start()
        else:
            ctx.load()
        yield
        ctx.shutdown()

    app = FastAPI(title="wkvm", version=__version__, lifespan=lifespan, openapi_url=None, docs_url=None,
                  redoc_url=None)  # fmt: skip
    app.state.ctx = ctx
    install_error_handlers(app)
    app.add_middleware(BodyLimit, limit=config.max_body_bytes)

    def authenticated(request: Request) -> str:
        return ctx.tenant(request)

    auth = Depends(authenticated)

    @app.middleware("http")
    async def count_requests(request: Request, call_next):
        response = await call_next(request)
        route = request.scope.get("route")
        path = getattr(route, "path", "unmatched")
        ctx.metrics.requests.labels(path, str(response.status_code)).inc()
        return response

    @app.get("/health")
    def health():
        if ctx.load_error:
            return JSONResponse(error_body(503, f"model failed to load: {ctx.load_error}"), status_code=503)
        if not ctx.ready.is_set():
            return JSONResponse(error_body(503, "the model is still loading"), status_code=503)
        return {"status": "ok", "model": ctx.model_name}

    @app.get("/metrics", dependencies=[auth], response_class=Response)
    def metrics() -> Response:
        body = ctx.metrics.render(ctx.engine, ctx.store) if ctx.ready.is_set() else b""
        return Response(body, media_type="text/plain; version=0.0.4")

    @app.get("/openapi.json", dependencies=[auth], include_in_schema=False)
    def openapi() -> dict:
        return app.openapi()

    app.include_router(openai_routes.router(ctx, auth))
    app.include_router(states_routes.router(ctx, auth))
    return app
