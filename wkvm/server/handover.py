"""Running streams that move to another server at a token boundary (live migration of a generation).

A single-choice SSE stream can be handed over: its engine request is suspended (`Engine.suspend`), the stream ends
with a handover event instead of `[DONE]`, and what the other server needs to go on waits here as a ticket: the
engine's `Continuation` (state, tokens, seeded generator, captured states, text sent) and the route's own part
(response id and created time, the plan's reuse info, whether the turn ends with checkpoints and a parked session).
Whoever carries the ticket (the cluster front, through Ray's object store) sends the same request to the other
server with `X-WKVM-Resume: <ticket>`; that server's stream starts with the source's next chunk.

Tickets travel only between a deployment's own servers, yet are read like an import: a safetensors file (never a
pickle) checked against this model's fingerprint and state spec, token ids against the vocabulary.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import secrets
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from wkvm.engine.client import EngineClient
from wkvm.engine.handle import RequestHandle
from wkvm.engine.request import Continuation
from wkvm.models.spec import State, StateSpec
from wkvm.state.statefile import metadata

FORMAT = "wkvm-handover-v1"
RESUME_HEADER = "x-wkvm-resume"
STREAM_HEADER = "x-wkvm-stream-id"  # on a stream that can move: the id to name in a move
EVENT = "wkvm-handover"
TICKET_SECONDS = 120.0  # a ticket nobody took by then is dropped
STATES = ("state", "prompt_state", "branch_state")


class HandoverError(ValueError):
    pass


@dataclass
class Ticket:
    """The route's part of a moved stream."""

    id: str  # the response id (chatcmpl-..., cmpl-...), kept by the destination
    created: int
    tenant: str
    info: dict[str, Any] = field(default_factory=dict)  # the plan's `wkvm` info (how much it reused)
    parent: str | None = None
    capture: bool = False
    finish: bool = False  # the turn ends with checkpoints (and a parked session): the destination does it


@dataclass
class LiveStream:
    tenant: str
    handle: RequestHandle
    ticket: Ticket
    why_not: str | None = None  # set when this stream cannot move
    scope: str = ""  # whose checkpoints it makes (openai_routes.reuse_scope)
    to: str | None = None  # where it is moving (once asked)
    out_id: str | None = None  # its ticket's id, when the mover named it (the cluster front waits for it by that id)
    pushed: bool = False  # its ticket went out the moment it stopped (Handovers.move's `push`)


class Handovers:
    """Streams that could move, and tickets on their way out or in."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[str, LiveStream] = {}
        self._out: dict[str, tuple[float, bytes]] = {}
        self._in: dict[str, tuple[float, bytes | Awaitable[bytes]]] = {}

    def register(self, stream: LiveStream) -> None:
        """A stream about to start (its response may never run, if the client left first: those are pruned)."""
        with self._lock:
            for k in [k for k, s in self._live.items() if s.handle.done.is_set() and s.to is None]:
                del self._live[k]
            self._live[stream.ticket.id] = stream

    def unregister(self, stream_id: str) -> None:
        with self._lock:
            self._live.pop(stream_id, None)

    def live(self) -> list[LiveStream]:
        with self._lock:
            return list(self._live.values())

    def move(self, client: EngineClient, tenant: str, stream_id: str, to: str, ticket: str | None = None,
             push: Callable[[LiveStream, Continuation], None] | None = None,
             ) -> concurrent.futures.Future[Continuation]:  # fmt: skip
        """Suspend a stream of `tenant` at its next token boundary; its stream then ends with a ticket for `to` (under
        the id `ticket` when given). `push(stream, continuation)`, when given, runs on the engine's thread the moment
        the request stops (before the engine's next model run) and sends the ticket on itself; it sets
        `stream.pushed`, and the stream's end then names the ticket without carrying it. KeyError: no such stream (of
        this tenant); HandoverError: it cannot move."""
        with self._lock:
            s = self._live.get(stream_id)
            if s is None or s.tenant != tenant:
                raise KeyError(stream_id)
            if s.why_not is not None:
                raise HandoverError(s.why_not)
            if s.to is not None:
                raise HandoverError(f"this stream is already moving to {s.to}")
            s.to, s.out_id = to, ticket
        try:
            fut = client.suspend(s.handle.request_id)
        except (KeyError, ValueError) as e:
            with self._lock:
                s.to = s.out_id = None
            raise HandoverError(f"this stream cannot move now: {e}") from None
        if push is not None:
            fut.add_done_callback(lambda f: None if f.exception() else push(s, f.result()))
        return fut

    def put_out(self, data: bytes, ticket: str | None = None) -> str:
        ticket = ticket or secrets.token_hex(16)
        with self._lock:
            _expire(self._out)
            self._out[ticket] = (time.monotonic(), data)
        return ticket

    def take_out(self, ticket: str) -> bytes | None:
        with self._lock:
            entry = self._out.pop(ticket, None)
        return entry[1] if entry else None

    def put_in(self, ticket: str, data: bytes | Awaitable[bytes]) -> None:
        """A ticket arriving here: its bytes, or what will bring them (the request it belongs to can start meanwhile;
        `take_in` waits for them)."""
        with self._lock:
            _expire(self._in)
            self._in[ticket] = (time.monotonic(), data)

    async def take_in(self, ticket: str) -> bytes | None:
        with self._lock:
            entry = self._in.pop(ticket, None)
        data = entry[1] if entry else None
        return data if data is None or isinstance(data, bytes) else await data


def _expire(tickets: dict[str, tuple[float, Any]]) -> None:
    now = time.monotonic()
    for k in [k for k, (t, _) in tickets.items() if now - t > TICKET_SECONDS]:
        del tickets[k]


def marker(ticket: str, to: str) -> str:
    """The SSE event a moved stream ends with (the front takes it out; a client never sees it)."""
    return f"event: {EVENT}\ndata: {json.dumps({'ticket': ticket, 'to': to})}\n\n"


def parse_marker(chunk: bytes) -> tuple[str, str] | None:
    """(ticket, destination) when `chunk` is a handover event."""
    head = f"event: {EVENT}\n".encode()
    if not chunk.startswith(head):
        return None
    data = json.loads(chunk[len(head) :].removeprefix(b"data: "))
    return str(data["ticket"]), str(data["to"])


def encode(spec: StateSpec, fingerprint: str, c: Continuation, ticket: Ticket) -> bytes:
    """The ticket of a stopped request: all of it but the prompt-end state its turn captured for a checkpoint, which
    the source stores itself (half the bytes, a shorter handover)."""
    if c.prompt_state is not None:
        c = dataclasses.replace(c, prompt_state=None, capture_prompt_state=False)
    tensors: dict[str, torch.Tensor] = {}
    for kind in STATES:
        state: State | None = getattr(c, kind)
        for name, v in (state or {}).items():
            tensors[f"{kind}.{name}"] = v[0].detach().to("cpu").contiguous()
    if c.generator is not None:
        tensors["generator"] = c.generator
    tokens = {"prompt_ids": c.prompt_ids, "base_ids": c.base_ids, "output_ids": c.output_ids,
              "num_computed_tokens": c.num_computed_tokens, "text": c.text, "capture_state": c.capture_state,
              "capture_prompt_state": c.capture_prompt_state, "capture_at": c.capture_at}  # fmt: skip
    md = {"format": FORMAT, "fingerprint": fingerprint, "spec_hash": spec.spec_hash,
          "continuation": json.dumps(tokens), "ticket": json.dumps(asdict(ticket))}  # fmt: skip
    return st_save(tensors, metadata=md)


def decode(data: bytes, spec: StateSpec, fingerprint: str, vocab_size: int) -> tuple[Continuation, Ticket]:
    """A ticket's contents, checked against this model; HandoverError names what is wrong."""
    try:
        tensors, md = st_load(data), metadata(data)
    except (SafetensorError, ValueError, RuntimeError) as e:  # StateFileError is a ValueError
        raise HandoverError(f"unreadable handover ticket: {e}") from None
    if md.get("format") != FORMAT:
        raise HandoverError(f"handover format {md.get('format')!r}, expected {FORMAT!r}")
    if md.get("fingerprint") != fingerprint or md.get("spec_hash") != spec.spec_hash:
        raise HandoverError("the stream was moved from a server running another model")
    try:
        tok, t = json.loads(md["continuation"]), Ticket(**json.loads(md["ticket"]))
        ids = {k: [int(i) for i in tok[k]] for k in ("prompt_ids", "base_ids", "output_ids")}
        states = {kind: _state(spec, tensors, kind) for kind in STATES}
        main = states["state"]
        if main is None:
            raise HandoverError("the ticket holds no state")
        at = tok["capture_at"]
        c = Continuation(ids["prompt_ids"], ids["base_ids"], ids["output_ids"], int(tok["num_computed_tokens"]),
                         main, tensors.get("generator"), str(tok["text"]), bool(tok["capture_state"]),
                         bool(tok["capture_prompt_state"]), states["prompt_state"], None if at is None else int(at),
                         states["branch_state"])  # fmt: skip
    except (KeyError, TypeError, ValueError) as e:
        raise HandoverError(f"bad handover ticket: {e}") from None
    every = c.prompt_ids + c.base_ids + c.output_ids
    if not c.prompt_ids or any(not 0 <= i < vocab_size for i in every):
        raise HandoverError("handover ticket: token ids outside the vocabulary")
    n_kv = len(c.base_ids) + c.num_computed_tokens
    if not 0 <= c.num_computed_tokens < len(c.prompt_ids) + len(c.output_ids) or (
        spec.has_kv and spec.kv_length(c.state) != n_kv
    ):
        raise HandoverError("handover ticket: inconsistent token counts")
    return c, t


def _state(spec: StateSpec, tensors: dict[str, torch.Tensor], kind: str) -> State | None:
    found = {k.split(".", 1)[1]: v.unsqueeze(0) for k, v in tensors.items() if k.startswith(kind + ".")}
    if not found:
        return None
    try:
        spec.check(found)
    except ValueError as e:
        raise HandoverError(f"handover ticket, {kind}: {e}") from None
    return found
