"""Running streams that move to another server at a token boundary (live migration of a generation).

A stream can be handed over: its engine requests (one per choice still running; n > 1 has n, and a request of
several prompts n a prompt) are suspended (`Engine.suspend`), the stream ends with a handover event instead of
`[DONE]`, and what the other server needs to go on waits here as a ticket: each suspended choice's `Continuation`
(state, tokens, seeded generator, captured states, text sent) and the route's own part (response id and created time,
the plan's reuse info, whether the turn ends with checkpoints and a parked session, which choice each continuation
is, the tokens of the choices that finished before the move).
Whoever carries the ticket (the cluster front, through Ray's object store) sends the same request to the other
server with `X-WKVM-Resume: <ticket>`; that server's stream starts with the source's next chunk.

A move can be pre-copied (`Engine.precopy`): the source ships the ticket of a token boundary while the stream goes on
there, and once the destination holds it, stops the stream and ships only what changed since (the tokens generated
meanwhile, the generator, the text sent: `encode`'s `base`). The destination feeds those tokens in one chunk from the
pre-copied state (`decode`'s `base`), so the state's bytes are not on the path of the client's wait.

Tickets travel only between a deployment's own servers, yet are read like an import: a safetensors file (never a
pickle) checked against this model's fingerprint and state spec, token ids against the vocabulary.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import inspect
import json
import logging
import secrets
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, cast

import torch
from safetensors.torch import save as st_save

from wkvm.engine.client import EngineClient
from wkvm.engine.engine import settle
from wkvm.engine.handle import RequestHandle
from wkvm.engine.request import Continuation
from wkvm.models.spec import State, StateSpec
from wkvm.outputs import GenerationOutput
from wkvm.sampling_params import MAX_WORD_CHARS
from wkvm.state.statefile import load_tensors, metadata

log = logging.getLogger("wkvm.handover")
FORMAT = "wkvm-handover-v1"
RESUME_HEADER = "x-wkvm-resume"
STREAM_HEADER = "x-wkvm-stream-id"  # on a stream that can move: the id to name in a move
HANDOVER_HEADER = "x-wkvm-handover"  # on the answer of a request answered whole that moved: its destination
EVENT = "wkvm-handover"
MARKER_HEAD = f"event: {EVENT}\n"  # how a moved stream's last event begins (the APIs that re-shape a stream pass it on)
TICKET_SECONDS = 120.0  # a ticket nobody took by then is dropped
STATES = ("state", "prompt_state", "branch_state")
PRECOPY = "precopy"  # metadata of a ticket that goes on from a pre-copy: its token counts (`encode`'s `base`)


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
    choices: list[int] = field(default_factory=lambda: [0])  # the choice index of each handle / continuation
    done_tokens: int = 0  # completion tokens of the choices that finished before a move (for `usage`)
    # a request answered whole that asked for logprobs: each moved choice's so far, a token's as [[id, logprob], ...]
    # (its answer carries them all; a stream sent them already)
    logprobs: list[list[list[list[float]]]] | None = None
    # a request answered whole: its choices that finished before a move, whole (`Finished.wire`), for its answer
    finished: list[dict[str, Any]] | None = None
    # a request of several prompts: each prompt's `wkvm` info, in order (`choices` then count across the prompts,
    # n to a prompt; such a request has no session, state or checkpoints to carry)
    prompts: list[dict[str, Any]] | None = None
    # a request answered whole that scores its prompt (echo with logprobs): each moved choice's prompt logprobs, a
    # token's as in `logprobs`, the first token's None (a stream sent them with its first chunk)
    prompt_logprobs: list[list[list[list[float]] | None]] | None = None
    # what an API that re-shapes the chat stream needs to go on (the Responses stream's id, created_at and next event
    # number), kept up to date by that API while it streams: names to short strings or integers (`_route`)
    route: dict[str, Any] | None = None

    def wire(self) -> dict[str, Any]:
        """As the ticket's metadata holds it: a single-choice ticket leaves out the fields it does not use, so it reads
        the same as before they existed (a rolling upgrade's old and new replicas move such streams both ways)."""
        d = asdict(self)
        if d["choices"] == [0] and not d["done_tokens"]:
            del d["choices"], d["done_tokens"]
        for optional in ("logprobs", "finished", "prompts", "prompt_logprobs", "route"):
            if d[optional] is None:
                del d[optional]
        return d


@dataclass
class Finished:
    """A choice of a request answered whole that finished before the request moved: its output, for the answer the
    destination gives."""

    index: int
    output: GenerationOutput

    def wire(self) -> dict[str, Any]:
        out = self.output
        lps = None if out.logprobs is None else wire_logprobs(out.logprobs)
        d = {"index": self.index, "token_ids": out.token_ids, "text": out.text, "finish_reason": out.finish_reason,
             "logprobs": lps}  # fmt: skip
        if out.prompt_logprobs is not None:  # with the prompt they score (checked against the request's)
            d["prompt_ids"], d["prompt_logprobs"] = out.prompt_token_ids, wire_prompt_logprobs(out.prompt_logprobs)
        if out.stop_reason is not None:  # only then: a ticket without it reads as before it existed
            d["stop_reason"] = out.stop_reason
        return d


def wire_logprobs(logprobs: list[dict[int, float]]) -> list[list[list[float]]]:
    """A choice's logprobs as a ticket holds them: a token's as [[id, logprob], ...] (`carried_logprobs` reads it)."""
    return [[[i, lp] for i, lp in token.items()] for token in logprobs]


def wire_prompt_logprobs(logprobs: list[dict[int, float] | None]) -> list[list[list[float]] | None]:
    """A choice's prompt logprobs as a ticket holds them: `wire_logprobs`' form after the first token's None."""
    return [None, *wire_logprobs(cast(list[dict[int, float]], logprobs[1:]))]


@dataclass
class LiveStream:
    tenant: str
    handles: list[RequestHandle]  # one per choice of `ticket.choices`, in that order
    ticket: Ticket
    why_not: str | None = None  # set when this stream cannot move
    scope: str = ""  # whose checkpoints it makes (sessions.reuse_scope)
    to: str | None = None  # where it is moving (once asked)
    out_id: str | None = None  # its ticket's id, when the mover named it (the cluster front waits for it by that id)
    pushed: bool = False  # its ticket went out the moment it stopped (Handovers.move's `push`)
    base: Continuation | None = None  # a pre-copy the destination holds: its ticket then carries only what changed
    base_bytes: int = 0  # that pre-copy's ticket size
    saves: str | None = None  # the name its final state is saved under: whoever moves the stream moves the name after
    # it (the cluster front, a stopping replica's drain): a name's versions are issued where it lives
    whole: bool = False  # a request answered whole (not streamed): its ticket carries its logprobs and finished choices
    pending_push: Callable[[LiveStream], None] | None = None  # `Handovers.suspend`'s push until it runs (`push_now`)
    push_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def done(self) -> bool:
        return all(h.done.is_set() for h in self.handles)

    def push_now(self) -> None:
        """Run the move's push once: on the engine's thread as the choices stop, or at the stream's end when that
        comes first. The push is a callback on the choices' futures, and one attached after the engine had settled
        them all runs later, on the mover's thread: the stream's end had then found `pushed` False and sent the
        ticket itself as well (a test_migration failure under load, session 55)."""
        with self.push_lock:
            push, self.pending_push = self.pending_push, None
        if push is not None:
            push(self)

    def outgoing(self) -> tuple[list[Continuation], Ticket]:
        """Once its requests stopped (`Handovers.suspend`): the continuations of the choices that moved and the
        ticket naming them; the others finished here, and their tokens count in `done_tokens`. The turn's
        checkpoints and parked session follow choice 0 (as without a move): if it finished here, nobody makes them
        (a cache: the next turn recomputes, exactly)."""
        moved = [(i, h.continuation) for i, h in zip(self.ticket.choices, self.handles, strict=True)
                 if h.continuation is not None]  # fmt: skip
        done = sum(len(h.output.token_ids) for h in self.handles if h.continuation is None)
        t = dataclasses.replace(self.ticket, choices=[i for i, _ in moved], done_tokens=self.ticket.done_tokens + done,
                                finish=self.ticket.finish and bool(moved) and moved[0][0] == 0)  # fmt: skip
        if self.whole:  # its answer needs every token's logprobs and the choices that finished here
            pairs = list(zip(self.ticket.choices, self.handles, strict=True))
            if all(h.output.logprobs is not None for h in self.handles):
                t.logprobs = [wire_logprobs(h.output.logprobs or []) for _, h in pairs if h.continuation is not None]
            if all(h.output.prompt_logprobs is not None for h in self.handles):
                t.prompt_logprobs = [wire_prompt_logprobs(h.output.prompt_logprobs or []) for _, h in pairs
                                     if h.continuation is not None]  # fmt: skip
            t.finished = [*(self.ticket.finished or []),
                          *(Finished(i, h.output).wire() for i, h in pairs if h.continuation is None)]  # fmt: skip
        return [c for _, c in moved], t


MoveFuture = concurrent.futures.Future[list[Continuation]]  # a move's: the continuations of the choices that stopped


class Handovers:
    """Streams that could move, and tickets on their way out or in."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[str, LiveStream] = {}
        self._out: dict[str, tuple[float, bytes]] = {}
        self._in: dict[str, tuple[float, bytes | Awaitable[bytes], Awaitable[Moved | None] | None]] = {}

    def register(self, stream: LiveStream) -> None:
        """A stream about to start (its response may never run, if the client left first: those are pruned)."""
        with self._lock:
            for k in [k for k, s in self._live.items() if s.done and s.to is None]:
                del self._live[k]
            self._live[stream.ticket.id] = stream

    def unregister(self, stream_id: str) -> None:
        with self._lock:
            self._live.pop(stream_id, None)

    def live(self) -> list[LiveStream]:
        with self._lock:
            return list(self._live.values())

    def move(self, client: EngineClient, tenant: str, stream_id: str, to: str, ticket: str | None = None,
             push: Callable[[LiveStream], None] | None = None,
             ) -> MoveFuture:  # fmt: skip
        """Suspend a stream of `tenant` at its next token boundary; its stream then ends with a ticket for `to` (under
        the id `ticket` when given). `push(stream)`, when given, runs on the engine's thread the moment its requests
        stop (before the engine's next model run; at the stream's end if that comes first: `LiveStream.push_now`)
        and sends the ticket on itself; it sets `stream.pushed`, and the stream's end then names the ticket without
        carrying it. The future yields the moved choices' continuations.
        KeyError: no such stream (of this tenant); HandoverError: it cannot move."""
        return self.suspend(client, self.claim(tenant, stream_id, to, ticket), push)

    def move_all(self, client: EngineClient, targets: list[str], until: float, stop: threading.Event,
                 poll: float = 0.05) -> Iterator[tuple[LiveStream, str, MoveFuture]]:  # fmt: skip
        """Move every stream that can move, to `targets` in turn (a stopping server's drain), yielding each move as
        it starts: the stream, its destination and `move`'s future. Every `poll` seconds until `until`
        (time.monotonic()) or until `stop` is set it looks again: a stream that could not move yet (a request scoring
        its prompt moves only once its first token is out) is tried again, and one that arrived meanwhile (a stream
        moved here before its sender knew this server was stopping) moves on; one that finishes first is left alone."""
        n = 0
        while targets:
            for s in self.live():
                if s.why_not is not None or s.to is not None or s.done:
                    continue
                to = targets[n % len(targets)]
                try:
                    fut = self.move(client, s.tenant, s.ticket.id, to)
                except (KeyError, HandoverError):  # finished meanwhile, or not yet: the next pass tells which
                    continue
                n += 1
                yield s, to, fut
            if time.monotonic() >= until or stop.wait(poll):
                return

    def claim(self, tenant: str, stream_id: str, to: str, ticket: str | None = None) -> LiveStream:
        """Mark a stream of `tenant` as moving to `to` (no other move takes it meanwhile); `suspend` stops it.
        KeyError: no such stream (of this tenant); HandoverError: it cannot move, or is moving already."""
        with self._lock:
            s = self._live.get(stream_id)
            if s is None or s.tenant != tenant:
                raise KeyError(stream_id)
            if s.why_not is not None:
                raise HandoverError(s.why_not)
            if s.to is not None:
                raise HandoverError(f"this stream is already moving to {s.to}")
            s.to, s.out_id = to, ticket
        return s

    def suspend(self, client: EngineClient, s: LiveStream,
                push: Callable[[LiveStream], None] | None = None,
                ) -> MoveFuture:  # fmt: skip
        """Stop a claimed stream's running choices at their next token boundary (`move`); HandoverError (the claim let
        go): it cannot (none is running)."""
        futs, why = [], None
        s.pending_push = push  # before any choice can stop: the stream's end runs it if the callback below is late
        for h in s.handles:
            if h.done.is_set():
                continue
            try:
                futs.append(client.suspend(h.request_id))
            except (KeyError, ValueError) as e:  # finished meanwhile, or cannot move at all
                why = why or e
        if not futs:
            with self._lock:
                s.to = s.out_id = None
            s.pending_push = None
            raise HandoverError(f"this stream cannot move now: {why or 'it finished'}")
        fut = gathered(futs)
        if push is not None:
            fut.add_done_callback(lambda f: None if f.cancelled() or f.exception() else s.push_now())
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

    def put_in(self, ticket: str, data: bytes | Awaitable[bytes],
               base: Awaitable[Moved | None] | None = None) -> None:  # fmt: skip
        """A ticket arriving here: its bytes, or what will bring them (the request it belongs to can start meanwhile;
        `take_in` waits for them); `base`: what brings the decoded pre-copy a ticket of `encode(base=...)` goes on
        from (awaited only for such a ticket, else cancelled)."""
        with self._lock:
            _expire(self._in)
            self._in[ticket] = (time.monotonic(), data, base)

    async def take_in(self, ticket: str) -> tuple[bytes | None, Moved | None]:
        """The ticket's bytes (None: no such ticket) and, when it goes on from a pre-copy, that pre-copy (None if it
        did not come)."""
        with self._lock:
            entry = self._in.pop(ticket, None)
        if entry is None:
            return None, None
        _, data, base = entry
        if not isinstance(data, bytes):
            data = await data
        if base is None:
            return data, None
        if data and precopied(data):
            try:
                return data, await base
            except Exception:  # it did not arrive in a readable form: `decode` then refuses the ticket (a 400)
                log.warning("the pre-copy of moved stream %s did not arrive", ticket, exc_info=True)
                return data, None
        if isinstance(base, asyncio.Future):
            base.cancel()
        elif inspect.iscoroutine(base):
            base.close()
        return data, None


Moved = tuple[list[Continuation], Ticket]  # a moved stream's continuations, one per choice of the ticket's `choices`


def gathered(futs: list[concurrent.futures.Future[Continuation]]) -> MoveFuture:
    """One future for a stream's choices stopping: the continuations of those that stopped (a choice that finished
    first has none), resolved with the last of them (on the engine's thread: the suspends of one call stop in one
    step); an error only when none stopped. Cancelling it cancels them (a choice not stopped yet goes on)."""
    out: MoveFuture = concurrent.futures.Future()
    lock, left = threading.Lock(), [len(futs)]

    def one_done(_: concurrent.futures.Future[Continuation]) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        ok = [f for f in futs if not f.cancelled() and f.exception() is None]
        errors = [f.exception() for f in futs if not f.cancelled() and f.exception() is not None]
        if ok:
            settle(out, [f.result() for f in ok])
        else:
            settle(out, error=errors[0] if errors else KeyError("no choice of this stream stopped"))

    for f in futs:
        f.add_done_callback(one_done)
    out.add_done_callback(lambda o: [f.cancel() for f in futs] if o.cancelled() else None)
    return out


def _expire(tickets: dict[str, Any]) -> None:
    now = time.monotonic()
    for k in [k for k, entry in tickets.items() if now - entry[0] > TICKET_SECONDS]:
        del tickets[k]


def marker(ticket: str, to: str) -> str:
    """The SSE event a moved stream ends with (the front takes it out; a client never sees it)."""
    return f"event: {EVENT}\ndata: {json.dumps({'ticket': ticket, 'to': to})}\n\n"


def parse_marker(chunk: bytes) -> tuple[str, str] | None:
    """(ticket, destination) when `chunk` is a handover event."""
    head = MARKER_HEAD.encode()
    if not chunk.startswith(head):
        return None
    data = json.loads(chunk[len(head) :].removeprefix(b"data: "))
    return str(data["ticket"]), str(data["to"])


def encode(spec: StateSpec, fingerprint: str, cs: Continuation | list[Continuation], ticket: Ticket,
           base: Continuation | None = None) -> bytes:  # fmt: skip
    """The ticket of a stopped request (or of a stream's stopped choices, `ticket.choices` naming each): all of it
    but the prompt-end state its turn captured for a checkpoint, which the source stores itself (half the bytes, a
    shorter handover). With `base` (one choice only), a pre-copy of the same request the destination holds already
    (`Engine.precopy`): no state, only the tokens, generator and text, and a branch-point state captured since; the
    destination feeds the tokens generated since `base` from `base`'s state. The first continuation's fields are
    unprefixed (a single-choice ticket reads as before n > 1 could move); choice k > 0's are under `more{k}.` and in
    the `more` metadata."""
    cs = [cs] if isinstance(cs, Continuation) else cs
    if len(cs) != len(ticket.choices) or not cs or (base is not None and len(cs) != 1):
        raise ValueError("a ticket names one choice per continuation (and a pre-copy goes with one choice)")
    tensors: dict[str, torch.Tensor] = {}
    tokens = [_pack(c, base, tensors, "" if k == 0 else f"more{k}.") for k, c in enumerate(cs)]
    md = {"format": FORMAT, "fingerprint": fingerprint, "spec_hash": spec.spec_hash,
          "continuation": json.dumps(tokens[0]), "ticket": json.dumps(ticket.wire())}  # fmt: skip
    if len(tokens) > 1:
        md["more"] = json.dumps(tokens[1:])
    if base is not None:
        md[PRECOPY] = json.dumps({"num_computed_tokens": base.num_computed_tokens, "outputs": len(base.output_ids)})
    return st_save(tensors, metadata=md)


def _pack(c: Continuation, base: Continuation | None, tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, Any]:
    """One continuation's tensors into `tensors` (names under `prefix`); its tokens and flags, returned."""
    if c.prompt_state is not None:
        c = dataclasses.replace(c, prompt_state=None, capture_prompt_state=False)
    kinds: tuple[str, ...] = STATES
    if base is not None:
        kinds = () if c.branch_state is None or c.branch_state is base.branch_state else ("branch_state",)
    for kind in kinds:
        state: State | None = getattr(c, kind)
        for name, v in (state or {}).items():
            tensors[f"{prefix}{kind}.{name}"] = v[0].detach().to("cpu").contiguous()
    if c.generator is not None:
        tensors[f"{prefix}generator"] = c.generator
    return {"prompt_ids": c.prompt_ids, "base_ids": c.base_ids, "output_ids": c.output_ids,
            "num_computed_tokens": c.num_computed_tokens, "text": c.text, "capture_state": c.capture_state,
            "capture_prompt_state": c.capture_prompt_state, "capture_at": c.capture_at}  # fmt: skip


def precopied(data: bytes) -> bool:
    """Whether a ticket goes on from a pre-copy (`encode`'s `base`); an unreadable one is not (`decode` says why)."""
    try:
        return PRECOPY in metadata(data)
    except ValueError:
        return False


def decode(data: bytes, spec: StateSpec, fingerprint: str, vocab_size: int,
           base: Moved | None = None) -> Moved:  # fmt: skip
    """A ticket's contents, checked against this model; HandoverError names what is wrong. `base`: the decoded
    pre-copy a ticket of `encode(base=...)` goes on from."""
    try:
        tensors, md = load_tensors(data), metadata(data)
    except ValueError as e:  # StateFileError is a ValueError
        raise HandoverError(f"unreadable handover ticket: {e}") from None
    if md.get("format") != FORMAT:
        raise HandoverError(f"handover format {md.get('format')!r}, expected {FORMAT!r}")
    if md.get("fingerprint") != fingerprint or md.get("spec_hash") != spec.spec_hash:
        raise HandoverError("the stream was moved from a server running another model")
    try:
        t = Ticket(**json.loads(md["ticket"]))
        toks = [json.loads(md["continuation"]), *json.loads(md.get("more", "[]"))]
        t.choices, t.done_tokens = [int(i) for i in t.choices], int(t.done_tokens)
        if len(toks) != len(t.choices) or len(set(t.choices)) != len(t.choices) or min(t.choices) < 0 or (
            t.done_tokens < 0
        ):
            raise HandoverError("handover ticket: its choices do not match its continuations")
        pre = md.get(PRECOPY)
        if pre is not None and len(toks) != 1:
            raise HandoverError("handover ticket: a pre-copy goes with one choice")
        if t.logprobs is not None:
            t.logprobs = _logprobs(t.logprobs, [tok["output_ids"] for tok in toks], vocab_size)
        if t.prompt_logprobs is not None:
            t.prompt_logprobs = _prompt_logprobs(t.prompt_logprobs, [tok["prompt_ids"] for tok in toks], vocab_size)
        if t.prompts is not None and not (isinstance(t.prompts, list) and len(t.prompts) > 1
                                          and all(isinstance(p, dict) for p in t.prompts)
                                          and t.parent is None and not t.finish):  # fmt: skip
            raise HandoverError("handover ticket: its prompts do not read")
        if t.route is not None:
            t.route = _route(t.route)
        if t.finished is not None:
            t.finished = [_finished(f, vocab_size) for f in t.finished]
            indices = [f["index"] for f in t.finished] + t.choices
            if len(set(indices)) != len(indices):
                raise HandoverError("handover ticket: a choice both finished and moved")
        cs = [_unpack(spec, tensors, tok, "" if k == 0 else f"more{k}.", pre is None) for k, tok in enumerate(toks)]
        if pre is not None:
            cs = [on_base(cs[0], t, json.loads(pre), base)]
    except HandoverError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise HandoverError(f"bad handover ticket: {e}") from None
    for c in cs:
        every = c.prompt_ids + c.base_ids + c.output_ids
        if not c.prompt_ids or any(not 0 <= i < vocab_size for i in every):
            raise HandoverError("handover ticket: token ids outside the vocabulary")
        n_kv = len(c.base_ids) + c.num_computed_tokens
        if not 0 <= c.num_computed_tokens < len(c.prompt_ids) + len(c.output_ids) or (
            spec.has_kv and spec.kv_length(c.state) != n_kv
        ):
            raise HandoverError("handover ticket: inconsistent token counts")
        if t.prompts is None and (c.prompt_ids, c.base_ids) != (cs[0].prompt_ids, cs[0].base_ids):
            raise HandoverError("handover ticket: its choices continue different prompts")
    return cs, t


def _route(value: Any) -> dict[str, Any]:
    """A ticket's `route`, checked: at most 8 names of up to 40 characters, each to a string of up to 128 characters
    or an integer in 0..2^53 (what it means is the re-shaping API's to check)."""

    def ok(k: Any, v: Any) -> bool:
        if not isinstance(k, str) or len(k) > 40:
            return False
        if isinstance(v, str):
            return len(v) <= 128
        return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 2**53

    if not isinstance(value, dict) or len(value) > 8 or not all(ok(k, v) for k, v in value.items()):
        raise HandoverError("handover ticket: its route does not read")
    return value


MAX_TOP_LOGPROBS = 64  # entries a token's logprobs may hold in a ticket (the API allows at most 20, plus the chosen)


def _logprobs(value: Any, ids: list[list[int]], vocab_size: int) -> list[list[list[list[float]]]]:
    """A ticket's `logprobs`, checked value by value: one list per choice, one entry per token of `ids` (the choice's
    outputs), each a list of [token id in the vocabulary, a logprob <= 0 (or -inf)] that includes that token (the
    answer reads its logprob)."""

    def pair_ok(p: Any) -> bool:
        return (isinstance(p, list) and len(p) == 2 and type(p[0]) is int and 0 <= p[0] < vocab_size
                and type(p[1]) in (int, float) and p[1] <= 0)  # fmt: skip  # NaN compares false

    def token_ok(t: Any, i: Any) -> bool:
        return (isinstance(t, list) and 0 < len(t) <= MAX_TOP_LOGPROBS and all(pair_ok(p) for p in t)
                and any(p[0] == i for p in t))  # fmt: skip

    if not (isinstance(value, list) and len(value) == len(ids) and all(
            isinstance(c, list) and isinstance(tokens, list) and len(c) == len(tokens)
            and all(token_ok(t, i) for t, i in zip(c, tokens, strict=True))
            for c, tokens in zip(value, ids, strict=False))):  # fmt: skip
        raise HandoverError("handover ticket: its logprobs do not match its tokens")
    return [[[[p[0], float(p[1])] for p in t] for t in c] for c in value]


def _prompt_logprobs(value: Any, ids: list[list[int]], vocab_size: int) -> list[list[list[list[float]] | None]]:
    """A ticket's `prompt_logprobs`, checked value by value: one list per choice, one entry per token of its prompt
    `ids`, the first None and each other as `_logprobs` checks a token's."""
    if not (isinstance(value, list) and len(value) == len(ids) and all(
            isinstance(c, list) and c and c[0] is None for c in value)):  # fmt: skip
        raise HandoverError("handover ticket: its prompt logprobs do not match its prompts")
    try:
        rest = _logprobs([c[1:] for c in value], [i[1:] for i in ids], vocab_size)
    except HandoverError:
        raise HandoverError("handover ticket: its prompt logprobs do not match its prompts") from None
    return [[None, *c] for c in rest]


def _finished(f: Any, vocab_size: int) -> dict[str, Any]:
    """A finished choice of a ticket (`Finished.wire`), checked value by value."""

    def ids_ok(ids: Any) -> bool:
        return isinstance(ids, list) and all(type(i) is int and 0 <= i < vocab_size for i in ids)

    keys = {"index", "token_ids", "text", "finish_reason", "logprobs"}
    reason = f.get("stop_reason") if isinstance(f, dict) else None  # optional: a token id or a stop string
    reason_ok = reason is None or (type(reason) is int and 0 <= reason < vocab_size) or (
        isinstance(reason, str) and 0 < len(reason) <= MAX_WORD_CHARS)  # fmt: skip
    ok = isinstance(f, dict) and set(f) - {"stop_reason"} in (keys, keys | {"prompt_ids", "prompt_logprobs"})
    ok = ok and type(f["index"]) is int and reason_ok
    ok = ok and f["index"] >= 0 and ids_ok(f["token_ids"]) and ids_ok(f.get("prompt_ids", []))
    if not (ok and isinstance(f["text"], str) and f["finish_reason"] in ("stop", "length")):
        raise HandoverError("handover ticket: a finished choice does not read")
    out = {**f, "logprobs": None if f["logprobs"] is None else _logprobs([f["logprobs"]], [f["token_ids"]],
                                                                          vocab_size)[0]}  # fmt: skip
    if "prompt_ids" in f:  # the prompt it scored (the destination checks it is the request's)
        out["prompt_logprobs"] = _prompt_logprobs([f["prompt_logprobs"]], [f["prompt_ids"]], vocab_size)[0]
    return out


def finished_output(f: dict[str, Any]) -> Finished:
    """A checked finished choice (`_finished`) as the destination's answer uses it."""
    lps = None if f["logprobs"] is None else carried_logprobs(f["logprobs"])
    out = GenerationOutput([], list(f["token_ids"]), f["text"], f["finish_reason"], lps)
    out.stop_reason = f.get("stop_reason")
    if "prompt_logprobs" in f:
        out.prompt_logprobs = carried_prompt_logprobs(f["prompt_logprobs"])
    return Finished(f["index"], out)


def carried_logprobs(choice: list[list[list[float]]]) -> list[dict[int, float]]:
    """One choice's logprobs from a ticket (`wire_logprobs`'), as a handle's output holds them."""
    return [{int(i): float(lp) for i, lp in token} for token in choice]


def carried_prompt_logprobs(choice: list[list[list[float]] | None]) -> list[dict[int, float] | None]:
    """One choice's prompt logprobs from a ticket (`wire_prompt_logprobs`'), as a handle's output holds them."""
    return [None, *carried_logprobs(cast(list[list[list[float]]], choice[1:]))]


def _unpack(spec: StateSpec, tensors: dict[str, torch.Tensor], tok: dict[str, Any], prefix: str,
            whole: bool) -> Continuation:  # fmt: skip
    """One continuation of a ticket (`_pack`'s); `whole`: it must hold its state (no pre-copy to go on from)."""
    ids = {k: [int(i) for i in tok[k]] for k in ("prompt_ids", "base_ids", "output_ids")}
    states = {kind: _state(spec, tensors, prefix + kind) for kind in STATES}
    if states["state"] is None and whole:
        raise HandoverError("the ticket holds no state")
    at = tok["capture_at"]
    return Continuation(ids["prompt_ids"], ids["base_ids"], ids["output_ids"], int(tok["num_computed_tokens"]),
                        states["state"] or {}, tensors.get(prefix + "generator"), str(tok["text"]),
                        bool(tok["capture_state"]), bool(tok["capture_prompt_state"]), states["prompt_state"],
                        None if at is None else int(at), states["branch_state"])  # fmt: skip


def on_base(c: Continuation, t: Ticket, pre: dict[str, Any], base: Moved | None) -> Continuation:
    """A ticket of `encode(base=...)` made whole with its pre-copy's state: the tokens generated after the pre-copy
    are pending (fed in one chunk), the rest (tokens, generator, text) is the ticket's own."""
    if base is None:
        raise HandoverError("handover ticket: the state it goes on from (its pre-copy) did not arrive")
    (b, *_), bt = base
    n = int(pre["outputs"])
    if (bt != t or b.prompt_ids != c.prompt_ids or b.base_ids != c.base_ids or len(b.output_ids) != n
            or c.output_ids[:n] != b.output_ids or int(pre["num_computed_tokens"]) != b.num_computed_tokens
            or c.num_computed_tokens < b.num_computed_tokens):  # fmt: skip
        raise HandoverError("handover ticket: it does not continue the pre-copy that came with it")
    return dataclasses.replace(c, state=b.state, num_computed_tokens=b.num_computed_tokens,
                               branch_state=c.branch_state if c.branch_state is not None else b.branch_state)


def _state(spec: StateSpec, tensors: dict[str, torch.Tensor], kind: str) -> State | None:
    """The state under `kind` (`[prefix]state`, `...prompt_state`, ...), checked against `spec`."""
    found = {k[len(kind) + 1 :]: v.unsqueeze(0) for k, v in tensors.items() if k.startswith(kind + ".")}
    if not found:
        return None
    try:
        spec.check(found)
    except ValueError as e:
        raise HandoverError(f"handover ticket, {kind}: {e}") from None
    return found
