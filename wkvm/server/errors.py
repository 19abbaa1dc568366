"""OpenAI-shaped errors: every failure is `{"error": {"message", "type", "param", "code"}}` with a 4xx status, and
`"type": "error"` beside it, which makes the same body Anthropic's shape too (its clients read `error.type` and
`error.message`; the types below are the names both APIs use)."""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from wkvm.engine.client import PrefillFailed
from wkvm.engine.engine import ContextTooLong, EngineClosed
from wkvm.engine.scheduler import QueueFull
from wkvm.outputs import ErrorCode
from wkvm.sampling_params import InvalidParam
from wkvm.state.mutations import MutationError
from wkvm.state.sessions import SessionBusy
from wkvm.state.statefile import StateFileError
from wkvm.state.store import DiskFull, PinNoRoom, QuotaExceeded, StateNotFound, StatePinned

log = logging.getLogger("wkvm.server")
TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
         405: "invalid_request_error", 409: "conflict_error", 413: "request_too_large", 429: "rate_limit_error",
         499: "client_closed_request", 503: "service_unavailable"}  # fmt: skip


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    kind = TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")  # api_error: OpenAI's 5xx
    return {"type": "error", "error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:  # fmt: skip
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


# pydantic's union branches (a constrained type's is `constrained-str`, ...)
UNION_TAG = re.compile(r"(str|int|float|bool|bytes|none|constrained-[a-z]+|[a-z][a-z0-9_-]*\[.*\])")


def _param(loc: tuple[Any, ...]) -> str:
    """The field an error is about, as a client names it: `messages[0].content`, not `body.messages.0.content.str`."""
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    parts = [p for p in parts if not UNION_TAG.fullmatch(p)]
    out = ""
    for p in parts:
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    return out or "body"


# how the union branches a message names read to a client; others are named as pydantic tags them
FORMS = {"str": "a string", "int": "an integer", "float": "a number", "bool": "a boolean", "none": "null",
         "list[str]": "a list of strings", "list[int]": "a list of integers (token ids)",
         "list[list[int]]": "a list of lists of integers", "list[ContentPart]": "a list of content parts"}  # fmt: skip


def _union_error(errors: Sequence[Any]) -> tuple[str, str] | None:
    """(param, message) for a value that failed every branch of a union but matched some branch's container (a list
    with one wrong element): the wrong part of the branch it came closest to, and the forms the field takes.
    None when the first error is not inside a union, or no branch got past the value's own type."""
    loc = tuple(errors[0].get("loc", ()))
    at = next((i for i, p in enumerate(loc) if isinstance(p, str) and UNION_TAG.fullmatch(p)), None)
    if at is None:
        return None
    branches: dict[str, list[dict[str, Any]]] = {}
    for err in errors:
        where = tuple(err.get("loc", ()))
        if where[:at] == loc[:at] and len(where) > at and isinstance(where[at], str):
            branches.setdefault(where[at], []).append(err)
    inner = [errs for errs in branches.values() if all(len(tuple(e.get("loc", ()))) > at + 1 for e in errs)]
    if not inner:
        return None
    # the branch with the fewest wrong parts, then the one whose wrong part lies deepest (it got furthest)
    best = min(inner, key=lambda errs: (len(errs), -max(len(tuple(e.get("loc", ()))) for e in errs)))[0]
    forms = [FORMS.get(tag, tag) for tag in branches]
    takes = ", ".join(forms[:-1]) + f" or {forms[-1]}" if len(forms) > 1 else forms[0]
    param = _param(tuple(best.get("loc", ())))
    return param, f"{param}: {best.get('msg', 'invalid value')} ({_param(loc[:at])} takes {takes})"


def prompt_field(path: str) -> str:
    """The request field whose tokens a route feeds: `messages` (chat, Anthropic's Messages), `input` (Responses),
    else `prompt`."""
    path = path.rstrip("/")
    if path.endswith(("/chat/completions", "/v1/messages")):
        return "messages"
    return "input" if path.endswith("/responses") else "prompt"


def prefill_failed(e: PrefillFailed) -> JSONResponse:
    """A shared prefill (n > 1, state creation) that ended without a state: non-finite numbers come from the
    request's own input (400); an engine failure is the server's (500); past --request-timeout, 408 (a state too
    long to create in that time; a completion's n choices end with "abort" instead, as one does); cancelled, 503."""
    if e.error_code == ErrorCode.NON_FINITE:
        return error_response(400, str(e), None, e.error_code)
    if e.error_code == ErrorCode.TIMEOUT:
        return error_response(408, f"{e}: the prompt's prefill ran past this server's --request-timeout and nothing "
                              "was kept; use a shorter prompt", None, e.error_code)  # fmt: skip
    if e.error_code == ErrorCode.ENGINE_ERROR:
        return error_response(500, str(e), None, e.error_code)
    if e.error_code == ErrorCode.SHUTDOWN:  # the same answer as a request that arrives during shutdown
        return shutting_down(str(e))
    return error_response(503, str(e), None, e.error_code or "aborted")


def shutting_down(message: str) -> JSONResponse:
    """503 `shutting_down`, with Retry-After: an announced outage (a restart, or another replica, serves a retry), not
    a server error."""
    return error_response(503, message, None, "shutting_down", {"Retry-After": "1"})


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return error_response(e.status, e.message, e.param, e.code, e.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {"loc": ("body",), "msg": "invalid request"}
        param = _param(tuple(first.get("loc", ())))
        # a union's value fails each branch, with one error each: say them all ("a valid string" alone misleads)
        same = [str(err.get("msg")) for err in e.errors() if _param(tuple(err.get("loc", ()))) == param]
        msg = "; or ".join(dict.fromkeys(same)) or first.get("msg", "invalid value")
        if first.get("type") == "json_invalid":
            return error_response(400, "the request body is not valid JSON", "body", "invalid_json")
        kind = request.headers.get("content-type", "")
        if tuple(first.get("loc", ())) == ("body",) and "json" not in kind.lower():
            # FastAPI reads JSON only under a JSON content type; parsing any other (curl -d sends a form's) would let
            # any web page post here without the browser's CORS preflight
            return error_response(400, f"send the body as JSON with Content-Type: application/json (got "
                                  f"{kind or 'none'!r})", "body", "invalid_content_type")  # fmt: skip
        if (union := _union_error(e.errors())) is not None:  # a list with one wrong element: say which
            return error_response(400, union[1], union[0], "invalid_value")
        return error_response(400, f"{param}: {msg}", param, "invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        status = e.status_code if 400 <= e.status_code < 500 else 400
        if e.detail == "There was an error parsing the body":  # FastAPI's, for bytes json.loads cannot read
            return error_response(400, "the request body is not valid JSON (bad UTF-8, nested too deep, or a number "
                                  "with too many digits)", "body", "invalid_json")  # fmt: skip
        message = "no such route" if e.status_code == 404 else str(e.detail)
        return error_response(status, message, headers=dict(e.headers or {}))  # a 405's Allow

    handlers = {
        InvalidParam: lambda e: error_response(400, str(e), e.param, "invalid_value"),
        StateNotFound: lambda e: error_response(404, str(e), e.param, "state_not_found"),
        StatePinned: lambda e: error_response(409, str(e), "handle", "state_pinned"),
        PinNoRoom: lambda e: error_response(409, str(e), "handle", "pinned_tiers_full"),
        StateFileError: lambda e: error_response(400, str(e), "body", "invalid_state"),
        MutationError: lambda e: error_response(400, str(e), e.param, "invalid_mutation"),
        QuotaExceeded: lambda e: error_response(413, str(e), None, "state_quota_exceeded"),
        DiskFull: lambda e: error_response(413, str(e), None, "state_disk_full"),  # as the quota's: delete states
        # Retry-After as OpenAI's 429s carry it (the openai SDK waits that long before its retry; without it, its own
        # backoff), and as this server's 503s do
        QueueFull: lambda e: error_response(429, str(e), None, "queue_full", headers={"Retry-After": "1"}),
        EngineClosed: lambda e: shutting_down(str(e)),
        SessionBusy: lambda e: error_response(409, str(e), None, "session_busy"),
        PrefillFailed: prefill_failed,
        # the client left while sending its body (a state import cut off): nobody reads the answer, and it is no
        # server error (nginx's 499, "client closed request"); it was a 500 with two tracebacks in the log
        ClientDisconnect: lambda e: error_response(499, "the client closed the connection before sending the whole "
                                                   "request body", "body", "client_closed_request"),
    }
    for exc, make in handlers.items():
        app.add_exception_handler(exc, lambda _r, e, make=make: make(e))

    @app.exception_handler(ContextTooLong)
    async def context_too_long(request: Request, e: ContextTooLong) -> JSONResponse:
        # OpenAI's code, and the field that holds the tokens (its chat API names `messages`)
        return error_response(400, str(e), prompt_field(request.url.path), "context_length_exceeded")
