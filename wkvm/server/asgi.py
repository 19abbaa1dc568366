"""ASGI layers that run before any route: CORS, API-key check, body limit, request metrics.

They are plain ASGI (not `@app.middleware("http")`): Starlette's BaseHTTPMiddleware wraps `receive`, and a
route behind it could not see its client disconnect, so an abandoned request kept its slot until the end.
The key is checked on the raw header bytes before a single body byte is read.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import logging
import socket
import time
import uuid
from collections.abc import Callable
from typing import cast

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from wkvm.config import cors_origins
from wkvm.server.errors import error_body

log = logging.getLogger("wkvm.server")
ARRIVED = "wkvm.arrived"  # the scope key of a request's arrival time (time.monotonic)
OPEN_PATHS = ("/health",)  # reachable without a key (load balancers' health checks)
LOCAL_ORIGINS = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:[0-9]+)?"  # pages a browser loaded from this machine


class Cors(CORSMiddleware):
    """Starlette's CORS layer, with a refused preflight answered as every other error is: OpenAI-shaped JSON; and
    a write from a page it does not allow refused before it runs. A browser sends a cross-origin POST without a
    preflight when it looks like a form's (a text/plain or absent body: a state import, a pin, a hibernate), and
    Starlette's layer only keeps the page from reading the answer; on a server without a key the write had happened.
    Requests without an Origin header (curl, the SDKs) are not affected."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("method") not in ("GET", "HEAD", "OPTIONS"):
            origin = header(scope, b"origin")
            if origin is not None and not self.is_allowed_origin(origin.decode("latin-1")):
                shown = origin.decode("latin-1")[:200]
                message = (f"a request from the web page {shown!r}, which may not call this API: start the server "
                           "with --allowed-origins naming that origin (or '*') to let its scripts call it")  # fmt: skip
                return await send_error(scope, receive, send, 403, message, None, "cors_refused")
        await super().__call__(scope, receive, send)

    def preflight_response(self, request_headers: Headers) -> Response:
        r = super().preflight_response(request_headers)
        if r.status_code != 400:
            return r
        what = bytes(r.body).decode()  # "Disallowed CORS origin, headers"
        origin = request_headers.get("origin", "")[:200]
        message = (f"{what} for the page {origin!r}: start the server with --allowed-origins naming that origin "
                   "(or '*') to let its scripts call this API")  # fmt: skip
        headers = {k: v for k, v in r.headers.items() if k not in ("content-length", "content-type")}
        return JSONResponse(error_body(400, message, None, "cors_refused"), status_code=400, headers=headers)


def add_cors(app: FastAPI, allowed_origins: str | None) -> None:
    """Let scripts of the allowed web pages call the API from a browser: preflights answered before the key check
    (browsers send no key with them), and every answer, a 401 included, readable by such a page. By default only
    pages served from this machine (as Ollama; vLLM and llama.cpp's server allow any page, which lets every site a
    user visits call a server on their laptop); `--allowed-origins '*'` allows any. Added after the key gate, so it
    runs before it."""
    origins = cors_origins(allowed_origins)  # as a browser's Origin header spells them
    app.add_middleware(Cors, allow_origins=origins, allow_origin_regex=None if origins else LOCAL_ORIGINS,
                       allow_methods=["*"], allow_headers=["*"], expose_headers=["*"])  # fmt: skip


LOCAL_SUFFIXES = (".localhost", ".local", ".internal")  # names no public DNS serves (host.docker.internal: Docker's)


def is_loopback(host: str) -> bool:
    """Whether `--host` is a loopback address or name (only this machine can connect)."""
    name = host.strip("[]").lower()
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def host_name(value: bytes) -> str:
    """A Host header's name without its port: 'localhost:8000' -> 'localhost', '[::1]:8000' -> '::1'."""
    text = value.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[1 : text.find("]")] if "]" in text else text
    return text.rsplit(":", 1)[0].rstrip(".") if text.count(":") == 1 else text.rstrip(".")


def local_name(name: str, this_machine: str) -> bool:
    """A Host name a rebinding page cannot have, as Ollama's check takes them: an IP address (the page's own would be
    its server's, not this one), localhost, a name under .localhost / .local / .internal, or `this_machine`'s name."""
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        pass
    return name in ("", "localhost", this_machine) or name.endswith(LOCAL_SUFFIXES)


class HostCheck:
    """403 for a request whose Host header names no host this server answers to. A server bound to loopback without
    an API key is meant for this machine's users; a web page whose own name its DNS re-points to 127.0.0.1 (DNS
    rebinding) reaches it as a same-origin page, which no Origin check sees, and could read every state (hunt 15;
    Ollama's CVE-2024-28224, fixed the same way). Local names (`local_name`) are always answered; `allowed` adds
    others."""

    def __init__(self, app: ASGIApp, allowed: list[str]):
        self.app, self.allowed = app, allowed
        self.this_machine = socket.gethostname().lower()  # once, not a system call per request

    def allows(self, value: bytes | None) -> bool:
        if value is None:  # HTTP/1.0 without Host: no browser sends that
            return True
        name = host_name(value)
        return name in self.allowed or local_name(name, self.this_machine)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.allows(header(scope, b"host")):
            return await self.app(scope, receive, send)
        shown = (header(scope, b"host") or b"").decode("latin-1")[:200]
        message = (f"the Host header {shown!r} names no host this server answers to: it listens on loopback without "
                   "an API key, so it answers local names only (IP addresses, localhost, *.local, *.internal, this "
                   "machine's name: a web page that re-points its own name to this machine could otherwise read "
                   "every state); start it with --allowed-hosts naming that host (or '*'), or with --api-key")
        return await send_error(scope, receive, send, 403, message, None, "host_refused")


def add_host_check(app: FastAPI, host: str, keys: KeyRing, allowed_hosts: str | None) -> None:
    """Check the Host header: with --allowed-hosts (unless '*'), against local names (`local_name`) and those; without
    it, on a server bound to loopback without an API key, against local names. Other servers answer any Host (as vLLM
    and llama.cpp's do)."""
    names = [host_name(h.encode("latin-1")) for h in (allowed_hosts or "").split(",") if h.strip()]  # as Host reads
    if "*" in names or (not names and (keys or not is_loopback(host))):
        return
    app.add_middleware(HostCheck, allowed=names)


def header(scope: Scope, name: bytes) -> bytes | None:
    for k, v in scope.get("headers") or []:
        if k == name:
            return cast(bytes, v)  # the ASGI spec makes header values byte strings
    return None


def presented_key(scope: Scope) -> bytes | None:
    """The key a client sent: `Authorization: Bearer KEY` or `X-Api-Key: KEY` (raw bytes, any encoding)."""
    auth = header(scope, b"authorization") or b""
    if auth[:7].lower() == b"bearer ":
        key = auth[7:].strip()
        if key:
            return key
    return header(scope, b"x-api-key")


class KeyRing:
    """The configured API keys, kept as sha256 digests computed once."""

    def __init__(self, keys: list[str]):
        self.digests = [hashlib.sha256(k.encode()).digest() for k in keys]

    def __bool__(self) -> bool:
        return bool(self.digests)

    def matches(self, key: bytes | None) -> bool:
        """Compare against every key in constant time (no early exit on the first match or on length)."""
        if key is None:
            return False
        digest = hashlib.sha256(key).digest()
        matched = False
        for d in self.digests:
            matched |= hmac.compare_digest(digest, d)
        return matched


def key_owner(key: bytes) -> str:
    return "key-" + hashlib.sha256(key).hexdigest()[:16]


def tenant_of(scope: Scope, keys: KeyRing) -> str | None:
    """The tenant that owns a request's states: the API key's hash (or "anonymous" without keys) and, when Open
    WebUI forwards one, its user id. None for a missing or wrong key."""
    key = presented_key(scope)
    if keys:
        if key is None or not keys.matches(key):
            return None
        owner = key_owner(key)
    else:
        owner = "anonymous"
    user = header(scope, b"x-openwebui-user-id")
    return f"{owner}/user-{hashlib.sha256(user).hexdigest()[:16]}" if user else owner


async def send_error(scope: Scope, receive: Receive, send: Send, status: int, message: str, param: str | None,
                     code: str) -> None:  # fmt: skip
    await JSONResponse(error_body(status, message, param, code), status_code=status)(scope, receive, send)


class ApiKeyGate:
    """401 for every route but /health when keys are configured, decided on headers alone."""

    def __init__(self, app: ASGIApp, keys: KeyRing):
        self.app, self.keys = app, keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys or scope.get("path") in OPEN_PATHS:
            return await self.app(scope, receive, send)
        if not self.keys.matches(presented_key(scope)):
            message = "missing or invalid API key: send 'Authorization: Bearer KEY' or 'X-Api-Key: KEY'"
            return await send_error(scope, receive, send, 401, message, None, "invalid_api_key")
        return await self.app(scope, receive, send)


class BodyLimit:
    """Refuse request bodies over `limit` bytes with a 413, whether or not they declare a length.

    A body without a declared length is read here first (up to the limit) and then handed to the app.
    """

    def __init__(self, app: ASGIApp, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = header(scope, b"content-length")
        if declared is not None and header(scope, b"transfer-encoding") is not None:
            # RFC 9112 6.3: an error. uvicorn's h11 parser (a plain `pip install`: no httptools) framed such a body as
            # chunked and still passed the small declared length on, so a body of any size went past the limit
            message = "a request may not declare both Content-Length and Transfer-Encoding"
            return await send_error(scope, receive, send, 400, message, "body", "invalid_request")
        if declared is not None:
            if declared.isdigit() and int(declared) > self.limit:
                return await self._refuse(scope, receive, send)
            return await self.app(scope, receive, send)
        chunks: list[bytes] = []
        size = 0
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

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = f"request body over {self.limit} bytes (--max-body-bytes)"
        await send_error(scope, receive, send, 413, message, "body", "body_too_large")


class RequestMetrics:
    """Counts responses by route and status; `on_server_error(path, status)` hears of every other 5xx (a bug or an
    outage: the test suite asserts it never happens unexpectedly). An exception no route handled is logged here,
    once, with its traceback and an error id its 500 answer names (Starlette's handler for `Exception` re-raised it
    after answering, so uvicorn logged it again: three records, none tying the client's 500 to its traceback)."""

    def __init__(self, app: ASGIApp, count: Callable[[str, int], None], on_server_error: Callable[[str, int], None]):
        self.app, self.count, self.on_server_error = app, count, on_server_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope[ARRIVED] = time.monotonic()  # time to first token counts from here, as vLLM's does from arrival
        status, announced, logged = 500, False, False  # announced: a 503 with Retry-After (loading), no fault
        started = ended = events = False

        async def send_status(message: Message) -> None:
            nonlocal status, announced, started, ended, events
            if message["type"] == "http.response.start":
                status, started = message["status"], True
                headers = [(k.lower(), v) for k, v in message.get("headers", [])]
                announced = status == 503 and any(k == b"retry-after" for k, _ in headers)
                events = any(k == b"content-type" and v.startswith((b"text/event-stream", b"application/x-ndjson"))
                             for k, v in headers)  # fmt: skip
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                ended = True
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        except Exception as e:
            ref, logged = uuid.uuid4().hex[:12], True
            log.exception("server error: %s %s raised %s (error id %s)", scope.get("method"), scope.get("path"),
                          type(e).__name__, ref)  # fmt: skip
            message = f"internal error: {type(e).__name__} (a bug; error id {ref} in the server's log)"
            if started and not ended and events:  # an event stream cut off by a bug: its last event says so, as
                error = {"type": "error", "error": {"message": message, "type": "server_error", "param": None,
                                                    "code": "internal_error"}}  # fmt: skip
                body = f"data: {json.dumps(error)}\n\n".encode()  # vLLM's do (the openai SDK raises on it)
                path = str(scope.get("path", ""))
                if path.startswith("/api/"):  # Ollama's NDJSON stream: an error line, as Ollama's
                    body = json.dumps({"error": message}).encode() + b"\n"
                elif path.startswith("/v1/messages"):  # Anthropic's SDK raises on a named `error` event
                    body = b"event: error\n" + body
                elif not path.startswith("/v1/responses"):  # Responses and Messages streams send no [DONE]
                    body += b"data: [DONE]\n\n"  # every other stream ends so, an error event or not
                await send({"type": "http.response.body", "body": body, "more_body": False})
            elif not started:
                await send_error(scope, receive, send, 500, message, None, "internal_error")
            # any other body cut off stays unended: uvicorn closes the connection, so the client sees it incomplete
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            self.count(route, status)
            if status >= 500 and not (announced or logged) and scope.get("path") not in OPEN_PATHS:
                self.on_server_error(scope.get("path", ""), status)  # /health's 503 is its answer
