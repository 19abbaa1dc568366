"""Carry one HTTP request from the front to a replica and run it through the replica's wkvm app.

The front has read the request (headers and body); a replica gets it as a `ForwardedRequest`, runs the very ASGI
app a single-process server runs, and yields the response as it is produced: first its `Head` (status, headers,
which replica answered), then the body in the chunks the app wrote (one per SSE event for a stream). When the
caller stops reading (the client went away), the app sees `http.disconnect`, as under uvicorn, and ends the request.

Also here: which replica a request belongs to (`route_key`), read from its path, headers and JSON body.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

from starlette.types import ASGIApp, Message

from wkvm.state.statefile import metadata

STATES = "/v1/states"
RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"  # Anthropic's Messages API
OLLAMA_CHAT, OLLAMA_GENERATE = "/api/chat", "/api/generate"  # Ollama's API
GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions", RESPONSES, MESSAGES, OLLAMA_CHAT, OLLAMA_GENERATE)
MISROUTED = 0  # the status of a Head that says "not the replica you asked for": ask the directory again
# the status of the Head a strict call's replica yields first when it is the one asked for: the answer's own head
# follows, however long it takes (a request answered whole sends its head with the answer; the front's wait for a
# restarting owner had cut a long one at 30 s with a false "restarting" 503; session 59)
ACCEPTED = 1
MISROUTED_REPLY = "wkvm:misrouted"  # what a replica method returns for the same (an answer, not an error to log)
SAVING_REPLY = "wkvm:saving"  # export_name: a running request will save the name's next version here
EXISTS_REPLY = "wkvm:exists"  # adopt: a version of the name is here already (another move got here first)
QUOTA_REPLY = "wkvm:quota"  # adopt: the moved files do not fit this replica's --state-disk-quota (nothing was kept)
DISK_FULL_REPLY = "wkvm:disk_full"  # adopt: this replica's disk is full (nothing was kept)
TIMEOUT_REPLY = "wkvm:timeout"  # adopt: not done within the seconds it was given (nothing was kept)
ADOPT_BASE_SECONDS = 10.0  # what a move's adoption may take: this, plus per file and per byte (fsync'd writes)
ADOPT_FILE_SECONDS = 0.05
ADOPT_BYTES_PER_SECOND = 20e6


def adopt_seconds(files: list[bytes]) -> float:
    """How long a replica may take to adopt moved files before it gives up and drops what it took (a fixed 10 s had
    answered a big name's move 503 while the copy went on, leaving duplicates nobody could delete; hunt, session
    48)."""
    return ADOPT_BASE_SECONDS + ADOPT_FILE_SECONDS * len(files) + sum(map(len, files)) / ADOPT_BYTES_PER_SECOND


def file_versions(files: list[bytes]) -> list[int]:
    """The versions exported files carry (their metadata; files a replica exported itself)."""
    return [int(metadata(f)["version"]) for f in files]


@dataclass(frozen=True)
class ForwardedRequest:
    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    client: tuple[str, int] | None = None

    def scope(self) -> dict[str, Any]:
        return {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": self.method,
            "scheme": "http", "path": self.path, "raw_path": self.path.encode(), "root_path": "",
            "query_string": self.query_string, "headers": list(self.headers), "client": self.client,
            "server": ("127.0.0.1", 0),
        }  # fmt: skip


@dataclass(frozen=True)
class Head:
    status: int
    headers: list[tuple[bytes, bytes]]
    replica: str  # the slot that answered (r0, r1, ...)


def accepted(part: object) -> bool:
    """Whether `part`, a replica's first, says it took the strict call (`ACCEPTED`): its answer's head is next."""
    return isinstance(part, Head) and part.status == ACCEPTED


async def run_asgi(app: ASGIApp, req: ForwardedRequest, replica: str) -> AsyncIterator[Head | bytes]:
    """Run `req` through `app`; yield its Head, then its body chunks."""
    out: asyncio.Queue[Message | None] = asyncio.Queue()
    gone = asyncio.Event()
    body_sent = False

    async def receive() -> Message:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": req.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        await out.put(message)

    async def run() -> None:
        try:
            await app(req.scope(), receive, send)
        finally:
            out.put_nowait(None)

    task = asyncio.create_task(run())
    try:
        while (msg := await out.get()) is not None:
            if msg["type"] == "http.response.start":
                yield Head(msg["status"], list(msg.get("headers", [])), replica)
            elif msg["type"] == "http.response.body":
                if msg.get("body"):
                    yield bytes(msg["body"])
                if not msg.get("more_body"):
                    break
        if task.done() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]  # an app that failed before answering
    finally:
        gone.set()  # a caller that stopped early: the app sees the client leave (a finished app ignores it)


@dataclass(frozen=True)
class Handover:
    """A stream moving from one replica to another at a token boundary, with its ticket (server/handover.py).

    A move asked for through the front (`POST /v1/streams/{id}/migrate`) has its destination's call opened at once
    with this as its argument, `data` empty: the source pushes the ticket to the directory actor, the destination's
    call takes it from there, and the source's stream ends with this carrying only `pushed` (the bytes it pushed),
    so neither the ticket nor the routing of the destination's call waits on the front. A stream the source hands
    over on its own (it is stopping) carries its ticket in `data`: through Ray's object store as an item of the
    source's streaming call, then as an argument of the destination's call, both owned by their caller (the front),
    so it outlives the source replica. A pushed ticket is owned by its source (Ray 2.56 dropped `ray.put(_owner=)`):
    a source that dies between the push and the read ends that stream with an error event (docs/cluster.md)."""

    to: str  # the destination slot
    ticket: str
    data: bytes = b""
    pushed: int = 0  # bytes of a ticket pushed to the directory (then `data` is empty)
    base: bytes = b""  # the pre-copy a carried ticket goes on from (the front took both back from the directory)


@dataclass(frozen=True)
class RouteKey:
    """Which replica should answer: `key` names what the request is bound to (a named state, a chat session), or
    None for any replica. `strict`: only the owner can answer (it alone holds the state). `along`: other names the
    request writes or reads besides the key's (`save_state` next to `state`, a fork's or `save_as`'s new name, an
    interpolation's other state): they must live on the key's owner when the request runs there, since a name's
    versions are issued where it lives (the front moves them there first)."""

    key: str | None
    strict: bool = False
    along: tuple[str, ...] = ()
    claims: bool = True  # a first request may make an owner (it creates the name, or the key is a soft affinity);
    # a request that only reads a name nobody owns fails wherever it runs, and had left an owner per 404 behind


def _digest(*parts: str) -> str:
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:24]


def response_key(tenant: str, response_id: str) -> str:
    return "response:" + _digest(tenant, response_id)


def state_key(tenant: str, handle: str) -> str:
    """All versions of a name live on one replica: versions are issued there."""
    return "state:" + _digest(tenant, handle.split("@", 1)[0])


def route_key(tenant: str, req: ForwardedRequest) -> RouteKey:
    """A named state's owner for the Durable State API and for generation from or into a named state; the chat
    session's owner for Open WebUI's chat id (per user) or the OpenAI `user` field (Anthropic's `metadata.user_id`);
    a stored Responses API response's
    replica for a request that reads it or continues it (`previous_response_id`); else the replica that answered
    the same prompt start before (`prefix_text`: its checkpoints are there); any replica otherwise."""
    path = req.path.rstrip("/")
    if path == STATES + "/import":  # under `?name=`, else the name the file carries
        name = imported_name(req)
        return RouteKey(state_key(tenant, name), strict=True) if name else RouteKey(None)
    if path.startswith(STATES + "/"):
        parts = path.split("/")
        handle, action = parts[3], parts[4] if len(parts) > 4 else None
        body = json_body(req.body) if req.method == "POST" and action in (*ALONG_FIELDS, "mutate") else {}
        params = body.get("params") if action == "mutate" else None  # an interpolation reads `params.other`
        values = [params.get("other")] if isinstance(params, dict) else [body.get(ALONG_FIELDS.get(action or "", ""))]
        return RouteKey(state_key(tenant, handle), strict=True, along=names_along(handle, values), claims=False)
    if path.startswith(RESPONSES + "/"):  # a stored response is on the replica that answered it (the front records it)
        return RouteKey(response_key(tenant, path.split("/")[3]), strict=True, claims=False)
    body = json_body(req.body) if req.method == "POST" and (path == STATES or path in GENERATION_PATHS) else {}
    state, saves = body.get("state"), body.get("save_state")
    if isinstance(state, str) and state:
        return RouteKey(state_key(tenant, state), strict=True, along=names_along(state, [saves]), claims=False)
    for field in ("save_state", "name"):
        value = body.get(field)
        if isinstance(value, str) and value and (field != "name" or path == STATES):
            return RouteKey(state_key(tenant, value), strict=True)
    if path in GENERATION_PATHS:
        previous = body.get("previous_response_id") if path == RESPONSES else None
        if isinstance(previous, str) and previous:  # the conversation it continues is stored there, its state parked
            return RouteKey(response_key(tenant, previous), strict=True, claims=False)
        chat = dict(req.headers).get(b"x-openwebui-chat-id")
        if chat:
            return RouteKey("session:" + _digest(tenant, chat.decode("latin-1")))
        metadata = body.get("metadata") if path == MESSAGES else None  # Anthropic's user is metadata.user_id
        user = metadata.get("user_id") if isinstance(metadata, dict) else body.get("user")
        if isinstance(user, str) and user:
            return RouteKey("session:" + _digest(tenant, "user", user))
        prefix = prefix_text(path, body)
        if prefix is not None:
            return RouteKey("prefix:" + _digest(tenant, str(body.get("cache_salt") or ""), prefix))
    return RouteKey(None)


ALONG_FIELDS = {"fork": "name", "generate": "save_as"}  # /v1/states/{h}/<action>: the body field naming a new state


def saved_names(req: ForwardedRequest) -> tuple[str, ...]:
    """The names a request will save a new version of (create, import, fork, `save_as`, mutate, `save_state`): a
    replica running it refuses to let them move meanwhile (their version would be issued where they no longer
    live)."""
    if req.method != "POST":
        return ()
    path = req.path.rstrip("/")
    if path == STATES + "/import":
        values: list[Any] = [imported_name(req)]
    elif path == STATES or path in GENERATION_PATHS:
        body = json_body(req.body)
        values = [body.get("name" if path == STATES else "save_state")]
    elif path.startswith(STATES + "/") and len(parts := path.split("/")) == 5 and parts[4] in (*ALONG_FIELDS, "mutate"):
        values = [parts[3]] if parts[4] == "mutate" else [json_body(req.body).get(ALONG_FIELDS[parts[4]])]
    else:
        return ()
    return tuple(dict.fromkeys(v.split("@", 1)[0] for v in values if isinstance(v, str) and v))


def names_along(handle: str, values: list[Any]) -> tuple[str, ...]:
    """The names among `values` (handles or names) other than `handle`'s, once each."""
    own = handle.split("@", 1)[0]
    names = [v.split("@", 1)[0] for v in values if isinstance(v, str) and v]
    return tuple(dict.fromkeys(n for n in names if n and n != own))


def imported_name(req: ForwardedRequest) -> str | None:
    """The name an import stores under: `?name=`, else the name in the file's metadata (None when unreadable: the
    replica answers the 400)."""
    name = parse_qs(req.query_string.decode("latin-1")).get("name", [None])[-1]
    if name:
        return name
    try:
        value = metadata(req.body).get("name")
    except ValueError:
        return None
    return value if isinstance(value, str) and value else None


PREFIX_CHARS = 256  # a completion prompt's leading characters (or PREFIX_TOKENS token ids) that name its prefix
PREFIX_TOKENS = 64


def prefix_text(path: str, body: dict[str, Any]) -> str | None:
    """What a request's prompt starts with, for routing it where a checkpoint of that start may be: a chat's
    leading system messages (shared by many conversations) or else its first message (shared by every later turn of
    one conversation); a completion prompt's first PREFIX_CHARS characters. None when too short to be worth it."""
    if path == MESSAGES:  # its system prompt, else its first message
        system, given = body.get("system"), body.get("messages")
        lead = ["system", system] if system else given[0] if isinstance(given, list) and given else None
        return json.dumps(lead, sort_keys=True) if lead else None
    if path == OLLAMA_GENERATE and body.get("system"):  # its system prompt, else its prompt, below
        return json.dumps(["system", body["system"]])
    if path in ("/v1/chat/completions", OLLAMA_CHAT):
        given = body.get("messages")  # a replica answers a wrong type with its 400 (it had failed the front: 503)
        messages = [m for m in given if isinstance(m, dict)] if isinstance(given, list) else []
        lead = [m for m in messages[: next((i for i, m in enumerate(messages)
                                            if m.get("role") not in ("system", "developer")), len(messages))]]
        lead = lead or messages[:1]  # fmt: skip
        return json.dumps([[m.get("role"), m.get("content")] for m in lead], sort_keys=True) if lead else None
    prompt = body.get("prompt")
    if isinstance(prompt, str) and len(prompt) >= PREFIX_CHARS:
        return prompt[:PREFIX_CHARS]
    if isinstance(prompt, list) and len(prompt) >= PREFIX_TOKENS and all(isinstance(t, int) for t in prompt):
        return json.dumps(prompt[:PREFIX_TOKENS])
    return None


def json_body(body: bytes) -> dict[str, Any]:
    """A request body's JSON object ({} when it is not one)."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):  # nested too deep: the replica's parser says so (it had been a 503 here)
        return {}  # the replica answers the 400
    return value if isinstance(value, dict) else {}
