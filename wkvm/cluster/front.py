"""The front: the Serve ingress every request enters by. It checks the API key (before reading the body), reads
the body (bounded), asks the directory which replica the request belongs to, and forwards it there through the
engine deployment's handle, whose `AffinityRouter` honours that choice. It answers itself only what spans
replicas: `/health`, `/metrics` (its routing counters and every replica's metrics, labelled by slot),
`/v1/cluster`, the list `GET /v1/states` (merged over replicas) and `POST /v1/states/{handle}/migrate`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import random
import secrets
import time
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from wkvm.cluster.directory import SOFT_PREFIXES, base_ticket, pushed_ticket
from wkvm.cluster.forward import (
    DISK_FULL_REPLY,
    EXISTS_REPLY,
    MESSAGES,
    MISROUTED,
    MISROUTED_REPLY,
    QUOTA_REPLY,
    RESPONSES,
    SAVING_REPLY,
    STATES,
    TIMEOUT_REPLY,
    ForwardedRequest,
    Handover,
    Head,
    RouteKey,
    accepted,
    adopt_seconds,
    file_versions,
    json_body,
    response_key,
    route_key,
    state_key,
)
from wkvm.config import ServerConfig
from wkvm.server.asgi import ApiKeyGate, BodyLimit, KeyRing, add_cors, add_host_check, tenant_of
from wkvm.server.errors import APIError, error_body, error_response
from wkvm.server.handover import HANDOVER_HEADER, RESUME_HEADER, STREAM_HEADER
from wkvm.server.messages_routes import event
from wkvm.server.metrics import LATENCY_BUCKETS
from wkvm.server.responses_routes import RESPONSE_ID_HEADER, new_id
from wkvm.server.states_routes import state_page
from wkvm.state.statefile import parse_handle, valid_handle

REPLICA_HEADER = b"x-wkvm-replica"
OWNER_WAIT_SECONDS = 30.0  # a request only its state's owner can answer waits this long for it (a restart)
CALL_SECONDS = 10.0  # the front's own calls to one replica (listing, metrics, moving states)
RETRY_SECONDS = 0.5
log = logging.getLogger("wkvm.cluster")


class ClusterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.routed = Counter("wkvm_cluster_routed", "Requests by routing outcome: hit (its owner answered), "
                              "fallback (another replica did), new (first request of a state or session), any "
                              "(bound to nothing)", ["outcome"], registry=r)  # fmt: skip
        self.migrations = Counter("wkvm_cluster_migrations", "States moved between replicas", registry=r)
        self.moved_bytes = Counter("wkvm_cluster_migrated_bytes", "Bytes of state files moved", registry=r)
        self.migration_seconds = Histogram("wkvm_cluster_migration_seconds", "Time to move a state (export, adopt, "
                                           "drop)", buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.stream_moves = Counter("wkvm_cluster_stream_moves", "Running requests handed over to another replica "
                                    "(streams, and requests answered whole in a drain), by outcome (moved, failed)",
                                    ["outcome"], registry=r)  # fmt: skip
        self.stream_bytes = Counter("wkvm_cluster_stream_moved_bytes", "Bytes of handover tickets (state, tokens, "
                                    "sampler) moved with running streams", registry=r)  # fmt: skip
        self.stream_downtime = Histogram("wkvm_cluster_stream_move_downtime_seconds", "Gap a moved stream's client "
                                         "sees: last chunk from the source to first from the destination",
                                         buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip


class Inflight:
    """A request the front relays, counted against the replica serving it (`Front.load`) until it ends, once."""

    def __init__(self, load: dict[str, int]):
        self.load, self.slot, self.done = load, "", False

    def move(self, slot: str | None) -> None:
        """Count it against `slot` (None: none yet) instead of where it was counted."""
        if self.done or (slot or "") == self.slot:
            return
        if self.slot:
            self.load[self.slot] -= 1
        self.slot = slot or ""
        if self.slot:
            self.load[self.slot] = self.load.get(self.slot, 0) + 1

    def end(self) -> None:
        self.move(None)
        self.done = True


def moved_to(head: Head) -> str | None:
    """Where a request answered whole went, when its answer's head says it moved (`HANDOVER_HEADER`)."""
    value = dict(head.headers).get(HANDOVER_HEADER.encode())
    return value.decode() if value is not None else None


@dataclass
class RunningStream:
    tenant: str
    slot: str
    req: ForwardedRequest
    inflight: Inflight
    saves: str | None = None  # the name it saves its final state under (`save_state`): the name moves with it
    moves: int = 0  # handovers done so far
    downtime: float = 0.0  # of the last one: last chunk from the source to the first from the destination
    opened: tuple[str, Any] | None = None  # (ticket, the destination's call) opened for a move asked for
    moving: bool = False  # a move asked for is under way
    head: Head | None = None  # the head of the replica it went on from last
    changed: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)  # set when it moved or ended

    def take_opened(self, ticket: str | None = None) -> Any:
        """The destination's call opened for a move (under `ticket`, when given), no longer kept here; None if none."""
        if self.opened is None or ticket not in (None, self.opened[0]):
            return None
        call, self.opened = self.opened[1], None
        return call


class Front:
    """The ingress logic, independent of how Serve wraps it (`build_front` does)."""

    def __init__(self, config: ServerConfig, engine: Any, directory: Any):
        self.config, self.engine, self.directory = config, engine, directory
        self.keys = KeyRing(config.api_keys)
        self.metrics = ClusterMetrics()
        self.streams: dict[str, RunningStream] = {}  # streams that can move, by response id
        self.load: dict[str, int] = {}  # slot -> requests this front relays to it now (`Inflight`)
        self._known: tuple[float, dict[str, str]] = (0.0, {})
        self._moves: dict[str, tuple[asyncio.Lock, int]] = {}  # names moving now: their lock and its users
        self._move_tasks: set[asyncio.Task[NameMove | Response]] = set()  # moves running (`move_name`)

    def tenant(self, request: Request) -> str:
        return tenant_of(request.scope, self.keys) or "anonymous"  # ApiKeyGate refused a wrong key already

    async def replicas(self) -> dict[str, str]:
        """slot -> replica id, from the directory (remembered for a handover's next few hundred milliseconds)."""
        found = dict(await self.directory.replicas.remote())
        self._known = (time.monotonic(), found)
        return found

    async def recent_replicas(self) -> dict[str, str]:
        """`replicas()`, or what it said under a second ago (a handover should not wait on the directory; a replica
        gone since answers "misrouted" or not at all, and the next one is tried)."""
        at, found = self._known
        return found if time.monotonic() - at < 1.0 else await self.replicas()

    async def least_busy(self, inflight: Inflight) -> tuple[str | None, str | None]:
        """(slot, replica id) of the replica this front relays the fewest requests to (ties at random): where a request
        bound to nothing goes first. `inflight` is counted there at once, so a burst of new requests spreads evenly
        (Serve's own choice goes by queue lengths it probed a moment ago, which a burst outruns; counted only once its
        claim came back, a burst of new sessions had all seen the same loads and split at random: 4 of 5 on one
        replica, one waiting for a slot; session 59)."""
        try:
            replicas = await self.recent_replicas()
        except Exception:  # the directory is being restarted (RayActorError): Serve's router chooses meanwhile
            return None, None
        if not replicas:
            return None, None
        inflight.move(None)  # not counted against the replica it is choosing between
        low = min(self.load.get(s, 0) for s in replicas)
        slot = random.choice([s for s in replicas if self.load.get(s, 0) == low])
        inflight.move(slot)
        return slot, replicas[slot]

    async def forward(self, request: Request) -> Response:
        req = await forwarded(request)
        route = route_key(self.tenant(request), req)
        response_id = None  # a Responses API answer's id, chosen here so that later requests find its replica
        if req.method == "POST" and req.path.rstrip("/") == RESPONSES:
            response_id = new_id("resp")
            req = dataclasses.replace(req, headers=[*req.headers, (RESPONSE_ID_HEADER.encode(), response_id.encode())])
        if route.along and (refused := await self.bring_along(self.tenant(request), route)) is not None:
            return refused
        deadline = time.monotonic() + OWNER_WAIT_SECONDS
        inflight = Inflight(self.load)
        claimed = False
        named = route.key is not None and route.claims and not route.key.startswith(SOFT_PREFIXES)
        used: str | None = None  # counted by a name's tentative claim (`Directory.use`'s token): released on a 4xx
        try:
            while True:
                slot, target = (await self.directory.lookup.remote(route.key)) if route.key else (None, None)
                if route.key and slot is None and route.claims:  # a key's first request: the least busy replica owns it
                    toward, target = await self.least_busy(inflight)  # (unless another request claimed it meanwhile)
                    if toward is not None:
                        claimed = True  # counted as "new" (the claim gives it an owner before it is answered)
                        slot, target = await self.directory.claim_owner.remote(route.key, toward)
                if named and not used and slot is not None:
                    used = await self.directory.use.remote(route.key, slot)
                strict = route.strict and slot is not None
                # its owner's slot released (a rolling restart): wait for the replacement. The least busy replica
                # had answered instead: a read a false 404, a create a second X@1 there, which the name's owner (the
                # slot, once taken again) then hid
                if strict and target is None:
                    if time.monotonic() > deadline:
                        return self.owner_unavailable(route, slot, used, inflight)
                    await asyncio.sleep(RETRY_SECONDS)
                    continue
                toward = slot
                if target is None:  # bound to no replica yet: the least busy one first (the router falls back)
                    toward, target = await self.least_busy(inflight)
                inflight.move(toward)
                # the key: a name that moved away from `target` since the lookup is sent back (`moved_away`)
                gen = self.engine.options(stream=True).http.remote(req, target=target, strict=strict, key=route.key)
                try:
                    wait = max(0.1, deadline - time.monotonic()) if strict else None
                    head = await asyncio.wait_for(anext(gen), wait)
                    if accepted(head):  # its owner runs it: the answer comes when it comes
                        head = await anext(gen)
                except TimeoutError:
                    gen.cancel()
                    head = Head(MISROUTED, [], "")
                if not isinstance(head, Head):
                    raise TypeError(f"a replica answered {type(head).__name__} before its head")
                if head.status != MISROUTED:
                    break
                if time.monotonic() > deadline:  # its owner is being replaced: the replacement takes its slot
                    return self.owner_unavailable(route, slot, used, inflight)
                await asyncio.sleep(RETRY_SECONDS)
            inflight.move(head.replica)
        except BaseException:
            inflight.end()
            if used:  # it may have reached its replica and saved there: the claim stands (as for a 5xx below)
                self.directory.confirm.remote(route.key, slot)
            raise
        self.metrics.routed.labels(outcome(route.key, None if claimed else slot, head.replica)).inc()
        if route.key is not None and head.replica != slot and head.status < 400:
            await self.directory.record.remote(route.key, head.replica)
        elif used and 400 <= head.status < 500:  # refused, nothing saved (not awaited: an actor runs one caller's
            self.directory.release_claim.remote(route.key, slot, used)  # calls in order)
        elif named and not 400 <= head.status < 500:  # counted or not: a release between its lookup and its `use`
            self.directory.confirm.remote(route.key, head.replica)  # may have forgotten the name it saved (review)
        if response_id is not None and head.status < 400:  # not awaited: an actor runs one caller's calls in order
            self.directory.record.remote(response_key(self.tenant(request), response_id), head.replica)
        if moved_to(head) is not None:  # a request answered whole that its replica moved (it is stopping)
            try:
                head, gen = await self.answer_moved(req, route, head, gen, inflight)
            except BaseException:
                inflight.end()
                raise
            if gen is None:
                inflight.end()
                return error_response(503, "this request was moving to another replica and none could take it",
                                      None, "replica_unavailable")  # fmt: skip
        body = self.relay(req, route, head, gen, inflight)
        weakref.finalize(body, inflight.end)  # a body never started (its client left at once) ends it too
        return StreamingResponse(body, status_code=head.status, headers=response_headers(head))

    def owner_unavailable(self, route: RouteKey, slot: str | None, used: str | None, inflight: Inflight) -> Response:
        """The 503 for a request whose state's owner did not take it within OWNER_WAIT_SECONDS (it is restarting):
        nothing ran, so the name's tentative claim it counted is released (it had stayed counted, and the name's
        claim was never forgotten)."""
        inflight.end()
        if used:
            self.directory.release_claim.remote(route.key, slot, used)
        message = f"replica {slot}, which holds this state, is restarting; retry shortly"
        return error_response(503, message, None, "replica_unavailable")

    async def answer_moved(self, req: ForwardedRequest, route: RouteKey, head: Head, gen: Any,
                           inflight: Inflight) -> tuple[Head, Any]:  # fmt: skip
        """A request answered whole that its replica handed over when Serve stopped it: the head and body of the
        replica it went to (which may hand it over again), or (head, None) when none took it."""
        saves = json_body(req.body).get("save_state")
        s = RunningStream(self.tenant_of(req), head.replica, req, inflight, saves if isinstance(saves, str) else None)
        while moved_to(head) is not None:
            moved = await anext(gen, None)
            if not isinstance(moved, Handover):
                raise TypeError(f"a replica answered {type(moved).__name__} after a handover's head")
            gen = await self.hand_over(req, route, moved, s, whole=True)
            if gen is None:
                return head, None
            assert s.head is not None  # `taken` keeps the head of a whole answer
            head = s.head
        return head, gen

    async def bring_along(self, tenant: str, route: RouteKey) -> Response | None:
        """Move the other names a request writes or reads (`RouteKey.along`) to the replica that holds its state, so
        that a new version is issued where the name's others are (a name without one only changes owner); the error
        to answer when one cannot move now. Nothing to do while the state has no owner (the request fails there)."""
        assert route.key is not None
        slot, _ = await self.directory.lookup.remote(route.key)
        if slot is None:
            return None
        replicas = await self.replicas()
        for name in route.along:
            try:
                # refused while a request on the name's owner will save its next version (that version would be
                # issued where the name no longer lives: one handle for two states, the acknowledged one unreachable)
                moved = await self.move_name(tenant, name, slot, replicas, new_ok=True, refuse_saving=True)
            except TimeoutError:  # a replica did not answer (it is being replaced)
                moved = error_response(503, f"{name!r} could not join the state it goes with: a replica is restarting; "
                                       "retry shortly", None, "replica_unavailable")  # fmt: skip
            if isinstance(moved, Response):
                return moved
        return None

    async def relay(self, req: ForwardedRequest, route: RouteKey, head: Head, gen: Any,
                    inflight: Inflight) -> AsyncIterator[bytes]:  # fmt: skip
        """The body chunks after the head. A stream handed over goes on from its destination on this same response;
        the replica's generator is cancelled if the client goes away."""
        stream_id = dict(head.headers).get(STREAM_HEADER.encode(), b"").decode() or None
        saves = json_body(req.body).get("save_state") if stream_id is not None else None  # only a stream that can move
        s = RunningStream(self.tenant_of(req), head.replica, req, inflight, saves if isinstance(saves, str) else None)
        if stream_id is not None:
            self.streams[stream_id] = s
        source = relay(gen)
        try:
            while True:
                moved: Handover | None = None
                last = time.perf_counter()
                async for chunk in source:
                    if isinstance(chunk, Handover):
                        moved = chunk
                        break
                    yield chunk
                    last = time.perf_counter()
                # the asked move's call, when this is that move and its ticket was pushed (not carried)
                opened = s.take_opened(moved.ticket) if moved is not None and not moved.data else None
                if (other := s.take_opened()) is not None:
                    other.cancel()  # the stream ended or moved on its own, or its ticket could not be pushed
                if moved is None:
                    return
                gen = await self.hand_over(req, route, moved, s, opened)
                if gen is None:  # no replica could take it: the client gets an error event and [DONE]
                    yield self.move_failed(req.path)
                    return
                first = await anext(gen, b"")
                s.downtime = time.perf_counter() - last
                s.moves += 1
                s.changed.set()
                self.metrics.stream_downtime.observe(s.downtime)
                source = chained(first, gen)  # `first` may itself be a Handover (that replica is stopping too)
        except Exception:
            # its replica died mid-way (Ray's actor error) or a hand-over failed, after the head: an event stream ends
            # as one whose move failed (it had ended with no error event and no [DONE]); another body is cut off
            log.warning("a relayed response failed after its head", exc_info=True)
            if dict(head.headers).get(b"content-type", b"").startswith(b"text/event-stream"):
                yield self.failed_event("the replica serving this stream failed; retry the request", req.path)
                return
            raise
        finally:
            s.inflight.end()
            s.changed.set()
            if (call := s.take_opened()) is not None:
                call.cancel()
            if stream_id is not None:
                self.streams.pop(stream_id, None)

    async def hand_over(self, req: ForwardedRequest, route: RouteKey, moved: Handover, s: RunningStream,
                        opened: Any = None, whole: bool = False) -> Any:  # fmt: skip
        """Go on with a moved stream on its destination: `opened`, the destination's call opened when the move was
        asked for (it takes the ticket the source pushed to the directory), else a call made now with the ticket (and
        when that replica cannot take it, any other: the ticket goes on anywhere). Returns that replica's generator,
        past its head (a stream's; with `whole`, a request answered whole: then its head, which comes with the
        answer, is `s.head`), or None when none took it (counted as a failed move)."""
        if opened is not None:
            taken = await self.taken(opened, moved.to, moved, route, s)
            if taken is not None:
                return taken or self.count_failed()  # False: refused
            # the destination did not take it (it is being replaced): take the ticket (and its pre-copy) back and
            # offer them around
            moved = dataclasses.replace(moved, data=await pushed_ticket(self.directory, moved.ticket, 0),
                                        base=await pushed_ticket(self.directory, base_ticket(moved.ticket), 0))
            if not moved.data:  # the destination took it after all (and then failed), or its source died
                return self.count_failed()
        replicas = await self.recent_replicas()
        if moved.to not in replicas:
            # the source named a replica that started after the list was remembered (a rolling restart replaces the
            # slots one by one; session 58 saw the next stop come 0.13 s after the new replica): ask the directory,
            # since a saving stream may go nowhere else and had failed its move
            replicas = await self.replicas()
        # a stream saving under a name goes only where the name went (`move_stream`): its save issues the next version
        order = [moved.to] + [other for other in replicas if other != moved.to and s.saves is None]
        for slot in order:
            if slot not in replicas:
                continue
            taken = await self.taken(self.resumed(req, replicas[slot], moved), slot, moved, route, s, whole)
            if taken is not None:
                return taken or self.count_failed()
        return self.count_failed()

    def count_failed(self) -> Any:
        """None, counting a move no replica took."""
        self.metrics.stream_moves.labels("failed").inc()
        return None

    def move_failed(self, path: str) -> bytes:
        """What the client of a stream that could not move gets: an error event and [DONE]."""
        return self.failed_event("this stream was moving to another replica and none could take it", path)

    def failed_event(self, message: str, path: str) -> bytes:
        """A relayed stream's last event when it cannot go on: the chat's error and [DONE], or on Anthropic's Messages
        API its `error` event."""
        if path == MESSAGES:
            return event("error", error={"type": "api_error", "message": message}).encode()
        error = error_body(503, message, None, "replica_unavailable")
        return f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()

    def resumed(self, req: ForwardedRequest, replica_id: str, moved: Handover) -> Any:
        """The moved stream's request, sent to one replica with its ticket (`moved.data`, or without it: then the
        replica waits for the ticket at the directory)."""
        resumed = dataclasses.replace(req, headers=[*req.headers, (RESUME_HEADER.encode(), moved.ticket.encode())])
        return self.engine.options(stream=True).http.remote(resumed, target=replica_id, strict=True, handover=moved)

    async def taken(self, gen: Any, slot: str, moved: Handover, route: RouteKey, s: RunningStream,
                    whole: bool = False) -> Any:  # fmt: skip
        """`gen` past its head when the replica `slot` took the moved stream (`whole`: a request answered whole,
        whose head comes with its answer: kept in `s.head`); None when it did not answer or was not that replica (try
        another); False when it refused it (the ticket was read: it cannot be offered again)."""
        try:
            head = await asyncio.wait_for(anext(gen), CALL_SECONDS)  # ACCEPTED (a strict call's), or MISROUTED
            if accepted(head) and not whole:
                head = await asyncio.wait_for(anext(gen), CALL_SECONDS)
        except (TimeoutError, StopAsyncIteration):
            gen.cancel()
            return None
        if head.status == MISROUTED:
            return None
        if accepted(head):  # a request answered whole runs there now; its head comes with its answer, however long
            # that takes (until session 59 the whole wait had no limit, also for a destination that never took it, and
            # the move was counted and logged only once the answer came)
            log.info("a request answered whole moved from %s to %s", s.slot, slot)
            self.count_moved(slot, moved, route, s)
            s.head = await anext(gen)
            return gen
        if head.status != 200 and not whole:  # a whole answer's head comes with it: an error there is the answer
            detail = b"".join([c async for c in gen])
            log.error("replica %s refused a moved stream: %s %s", slot, head.status, detail[:300])
            return False
        s.head = head
        self.count_moved(slot, moved, route, s)
        return gen

    def count_moved(self, slot: str, moved: Handover, route: RouteKey, s: RunningStream) -> None:
        """A moved stream (or request answered whole) taken by the replica `slot`: counted, and relayed from there."""
        self.metrics.stream_moves.labels("moved").inc()
        self.metrics.stream_bytes.inc(len(moved.data) + len(moved.base) or moved.pushed)
        self.directory.moved_stream.remote()
        s.slot = slot
        s.inflight.move(slot)
        if route.key is not None and not route.strict:  # not awaited: the first token need not wait on it, and
            self.directory.record.remote(route.key, slot)  # an actor runs one caller's calls in order
        response_id = dict(s.req.headers).get(RESPONSE_ID_HEADER.encode())
        if response_id is not None:  # a Responses answer is stored where it ends: later requests find it there
            self.directory.record.remote(response_key(s.tenant, response_id.decode()), slot)

    async def destination(self, request: Request) -> tuple[str | Response, dict[str, str]]:
        """The replica a move's body names in "to", or the 400 for a body that is not a JSON object (it had been
        answered as naming no replica) or names none of them; and the replicas."""
        replicas = await self.replicas()
        try:
            body = json.loads(await request.body() or b"{}")
        except (ValueError, UnicodeDecodeError, RecursionError):  # nested too deep had been a 503
            return error_response(400, "the request body is not valid JSON", "body", "invalid_json"), replicas
        if not isinstance(body, dict):
            return error_response(400, 'the request body must be a JSON object: {"to": "<replica>"}', "body",
                                  "invalid_json"), replicas  # fmt: skip
        to = body.get("to")
        if not isinstance(to, str) or to not in replicas:
            return error_response(400, f"'to' must name a replica: one of {', '.join(replicas)}", "to",
                                  "unknown_replica"), replicas  # fmt: skip
        return to, replicas

    def tenant_of(self, req: ForwardedRequest) -> str:
        return tenant_of(req.scope(), self.keys) or "anonymous"

    async def move_stream(self, stream_id: str, request: Request) -> Response:
        """`POST /v1/streams/{id}/migrate {"to": slot}`: hand a running stream over to another replica at its next
        token boundary; its client's stream goes on from there on the same connection."""
        to, replicas = await self.destination(request)
        if isinstance(to, Response):
            return to
        # null: the default; anything but a boolean is a 400 before anything else (0 had read as false, and a move to
        # the stream's own replica had answered 200 whatever it was; hunt, session 46)
        precopy = json.loads(await request.body() or b"{}").get("precopy")
        precopy = False if precopy is None else precopy
        if not isinstance(precopy, bool):
            return error_response(400, "'precopy' must be true or false", "precopy", "invalid_type")
        tenant = self.tenant(request)
        s = self.streams.get(stream_id)
        if s is None or s.tenant != tenant or s.slot not in replicas:
            return error_response(404, f"no running stream {stream_id!r} that can move", None, "stream_not_found")
        if s.slot == to:
            return JSONResponse({"object": "stream.migration", "id": stream_id, "from": s.slot, "to": to})
        if s.moving:  # a second call would open a second destination and lose the stream between the two
            return error_response(409, f"stream {stream_id!r} is moving already; ask again once it has moved", None,
                                  "stream_cannot_move")  # fmt: skip
        s.moving = True
        try:
            return await self.moved_stream(s, stream_id, tenant, to, replicas, precopy)
        finally:
            s.moving = False

    async def moved_stream(self, s: RunningStream, stream_id: str, tenant: str, to: str, replicas: dict[str, str],
                           precopy: bool) -> Response:  # fmt: skip
        t0, source = time.perf_counter(), s.slot
        s.changed.clear()
        # the destination's call first: it is routed and waits for the ticket while the source reaches a token
        ticket = secrets.token_hex(16)  # boundary, and the source pushes the ticket to it through the directory
        s.opened = (ticket, self.resumed(s.req, replicas[to], Handover(to, ticket)))
        answer = await self.call(replicas[source], "move_stream", tenant, stream_id, to, ticket, precopy)
        if answer["status"] != 200:
            if (call := s.take_opened(ticket)) is not None:  # still there: the stream did not move
                call.cancel()
            code = "stream_not_found" if answer["status"] == 404 else "stream_cannot_move"
            return error_response(answer["status"], answer["message"], None, code)
        extra: dict[str, Any] = {}
        if s.saves is not None:  # it saves its final state as the name's next version, which only the name's owner
            # issues: the name follows it (after the stop, so that the source never saves once the name left; the
            # destination saves once the name is there: `ServerContext.holds_name`)
            try:
                name_moved = await self.move_name(tenant, s.saves, to, replicas, new_ok=True)
            except Exception as e:  # a replica did not answer (it is being replaced) or failed: the stream moved all
                # the same, so this answer is its 200 with a state_error (a 503 "retry" had said it had not)
                log.warning("stream %s: its name %r could not move: %r", stream_id, s.saves, e)
                name_moved = error_response(503, f"the name {s.saves!r} could not move: a replica is restarting or "
                                            f"failed ({type(e).__name__})", None, "replica_unavailable")  # fmt: skip
            if isinstance(name_moved, Response):  # the stream moved; its final state will not be saved
                why = bytes(name_moved.body)
                log.warning("stream %s moved, its name %r did not: %s", stream_id, s.saves, why[:300])
                extra["state_error"] = json.loads(why)["error"]
        if stream_id in self.streams:  # answer once the stream runs on its new replica (or ended)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(s.changed.wait(), max(0.0, t0 + CALL_SECONDS - time.perf_counter()))
        return JSONResponse({"object": "stream.migration", "id": stream_id, "from": source, "to": s.slot,
                             "generated_tokens": answer["generated_tokens"],
                             "precopy_tokens": answer.get("precopy_tokens"), "downtime_seconds": round(s.downtime, 6),
                             "seconds": round(time.perf_counter() - t0, 6), **extra})  # fmt: skip

    async def call(self, replica_id: str, method: str, *args: Any, timeout: float = CALL_SECONDS) -> Any:
        """Call a method of one replica (by id), again while the call lands elsewhere (it answers MISROUTED_REPLY);
        TimeoutError when that replica does not answer in `timeout` seconds (it died and is being replaced)."""
        deadline = time.monotonic() + timeout
        while True:
            call = getattr(self.engine, method).remote(*args, target=replica_id, strict=True)
            try:
                result = await asyncio.wait_for(call, max(0.1, deadline - time.monotonic()))
            except TimeoutError:
                call.cancel()
                raise
            if result != MISROUTED_REPLY:
                return result
            if time.monotonic() > deadline:
                raise TimeoutError(f"replica {replica_id} is being replaced")
            await asyncio.sleep(RETRY_SECONDS)

    async def list_states(self, request: Request) -> Response:
        """`GET /v1/states` from every replica, merged, then paged (`state_page`)."""
        req = dataclasses.replace(await forwarded(request), query_string=b"")  # each replica's whole list
        deadline = time.monotonic() + CALL_SECONDS
        while True:  # a replica's answer may land on another for a moment (it says so): ask again, as `call` does
            answers = await asyncio.gather(*(self.collect(req, rid) for rid in (await self.replicas()).values()))
            if all(status != MISROUTED for status, _ in answers) or time.monotonic() > deadline:
                break
            await asyncio.sleep(RETRY_SECONDS)
        for status, body in answers:
            if status == MISROUTED:
                return error_response(503, "a replica is restarting: the list is incomplete; retry shortly", None,
                                      "replica_unavailable")  # fmt: skip
            if status != 200:
                return Response(body, status_code=status, media_type="application/json")
        data = [s for _, body in answers for s in json.loads(body)["data"]]
        try:
            limit = int(request.query_params["limit"]) if "limit" in request.query_params else None
        except ValueError:
            return error_response(400, "limit must be an integer", "limit", "invalid_value")
        try:
            return JSONResponse(state_page(data, limit, request.query_params.get("after")))
        except APIError as e:
            return error_response(e.status, e.message, e.param, e.code)

    async def collect(self, req: ForwardedRequest, replica_id: str) -> tuple[int, bytes]:
        """One replica's whole answer to `req` (MISROUTED when it is being replaced or does not answer in time)."""
        gen = self.engine.options(stream=True).http.remote(req, target=replica_id, strict=True)
        try:
            return await asyncio.wait_for(collect(gen), CALL_SECONDS)
        except TimeoutError:
            gen.cancel()
            return MISROUTED, b""

    async def migrate(self, handle: str, request: Request) -> Response:
        """Move a named state (every version of its name) to another replica; its handles stay the same."""
        try:
            name, version = parse_handle(valid_handle(handle))  # a version that is no number: 400, as elsewhere
        except ValueError as e:
            return error_response(400, str(e), "handle", "invalid_value")
        to, replicas = await self.destination(request)
        if isinstance(to, Response):
            return to
        tenant = self.tenant(request)
        if version is not None:  # a version the name does not have is a 404 (it had moved the name and answered 200)
            _, source = await self.directory.lookup.remote(state_key(tenant, name))
            if source is not None and not await self.call(source, "has_state", tenant, handle):
                return error_response(404, f"no state {handle!r}", "handle", "state_not_found")
        t0 = time.perf_counter()
        moved = await self.move_name(tenant, name, to, replicas, refuse_saving=True)
        if isinstance(moved, Response):
            return moved
        return JSONResponse(migration(handle, moved.source, to, moved.nbytes, time.perf_counter() - t0, moved.handles)
                            | ({"steps_seconds": moved.steps} if moved.steps else {}))  # fmt: skip

    async def move_name(self, tenant: str, name: str, to: str, replicas: dict[str, str], new_ok: bool = False,
                        refuse_saving: bool = False) -> NameMove | Response:  # fmt: skip
        """Every version of `name` from its owner to replica `to` (the directory updated), or the error to answer.
        `new_ok`: a name with no version yet (a stream about to save its first) only changes owner. `refuse_saving`:
        a 409 while a request running on the owner will save the name's next version (it would be issued there,
        where the directory no longer points). A move, once begun, runs to its end even when the request that asked
        for it is cancelled (its client left, --request-timeout): cut between the adoption and the source's drop, the
        name had stayed on two replicas (review, session 48)."""
        key = state_key(tenant, name)

        async def move() -> NameMove | Response:
            async with self.moving(key):
                return await self._move_name(key, tenant, name, to, replicas, new_ok, refuse_saving)

        task = asyncio.ensure_future(move())
        self._move_tasks.add(task)  # held until done (the loop keeps only a weak reference)
        task.add_done_callback(self._move_tasks.discard)
        task.add_done_callback(move_ended)
        return await asyncio.shield(task)

    @contextlib.asynccontextmanager
    async def moving(self, key: str) -> AsyncIterator[None]:
        """One move of a name at a time (two at once had both exported from the owner; the second's undo pointed the
        name back at the owner the first had emptied: a 404 everywhere for a move answered 200)."""
        lock, users = self._moves.get(key, (asyncio.Lock(), 0))
        self._moves[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._moves[key]
            if users == 1:
                del self._moves[key]
            else:
                self._moves[key] = (lock, users - 1)

    async def _move_name(self, key: str, tenant: str, name: str, to: str, replicas: dict[str, str], new_ok: bool,
                         refuse_saving: bool) -> NameMove | Response:  # fmt: skip
        slot, source = await self.directory.lookup.remote(key)
        if slot is None and new_ok:
            await self.directory.record.remote(key, to)
            return NameMove(to, [], 0)
        if slot is None or source is None:
            if slot is None:
                return error_response(404, f"no state {name!r}", "handle", "state_not_found")
            return error_response(503, f"replica {slot}, which holds {name!r}, is restarting; retry shortly", None,
                                  "replica_unavailable")  # fmt: skip
        if slot == to:
            return NameMove(slot, [], 0)
        t0 = time.perf_counter()
        files, card = await asyncio.gather(self.call(source, "export_name", tenant, name, refuse_saving),
                                           self.call(source, "name_card", tenant, name))  # last version issued, pins
        if files == SAVING_REPLY:
            return error_response(409, f"a request running on {slot} will save {name!r}'s next version: retry once it "
                                  "ends, or move that stream (POST /v1/streams/{id}/migrate: its name goes with it)",
                                  None, "state_busy")  # fmt: skip
        assert isinstance(files, list)
        if not files and not new_ok:
            return error_response(404, f"no state {name!r}", "handle", "state_not_found")  # deleted meanwhile
        t1 = time.perf_counter()
        seconds = adopt_seconds(files)  # the destination gives up (and drops what it took) after these
        try:
            handles: list[str] | str = await self.call(replicas[to], "adopt", tenant, files, card,
                                                       time.time() + seconds,
                                                       timeout=seconds + CALL_SECONDS) if files else []  # fmt: skip
        except TimeoutError:  # it gave up and dropped them, or is being replaced: where it finished as this call
            with contextlib.suppress(Exception):  # gave up, its copies go (the name stays on its source)
                await self.call(replicas[to], "drop_name", tenant, name, file_versions(files), True)
            handles = TIMEOUT_REPLY
        if handles == EXISTS_REPLY:  # another move of this name got there first
            return error_response(409, f"{name!r} is moving to {to} already", None, "state_changed")
        if handles == QUOTA_REPLY:  # it kept none of them: the name stays where it is
            return error_response(413, f"{name!r} does not fit {to}'s state quota (its --state-disk-quota, or your "
                                  "--state-tenant-quota there); nothing moved: delete states there or move it "
                                  "elsewhere", None, "state_quota_exceeded")  # fmt: skip
        if handles == DISK_FULL_REPLY:
            return error_response(413, f"{to}'s state disk is full; nothing moved: free space there or move {name!r} "
                                  "elsewhere", None, "state_disk_full")  # fmt: skip
        if handles == TIMEOUT_REPLY:
            return error_response(503, f"{to} did not take {name!r} ({len(files)} versions, {sum(map(len, files))} "
                                  f"bytes) within {seconds:.0f} s; nothing moved: retry, or delete versions you no "
                                  "longer need first", None, "replica_unavailable")  # fmt: skip
        assert isinstance(handles, list)
        await self.directory.record.remote(key, to)
        t2 = time.perf_counter()
        versions = [int(h.rsplit("@", 1)[1]) for h in handles]
        if not await self.call(source, "drop_name", tenant, name, versions):
            # a new version appeared on the source meanwhile: it stays the owner (where the directory still says
            # `to`: another front's move may have moved it on), the copy goes
            await self.directory.record_if.remote(key, to, slot)
            # undo: the copies go even where a request will save the name there (a stream that moved with it: it
            # counts as saving, and its copies had stayed behind, listed twice and winning the name after a restart;
            # hunt, session 46); it saves nothing under a name that replica no longer holds
            if not await self.call(replicas[to], "drop_name", tenant, name, versions, True):
                log.warning("the copy of %r on %s could not be dropped after a move was undone", name, to)
            return error_response(409, f"{name!r} changed while it moved; nothing moved: retry", None,
                                  "state_changed")  # fmt: skip
        seconds = time.perf_counter() - t0
        nbytes = sum(len(f) for f in files)
        if files:
            self.metrics.migrations.inc()
            self.metrics.moved_bytes.inc(nbytes)
            self.metrics.migration_seconds.observe(seconds)
        return NameMove(slot, handles, nbytes, {"export": t1 - t0, "adopt": t2 - t1, "drop": time.perf_counter() - t2})

    async def cluster(self) -> dict[str, Any]:
        replicas = await self.replicas()
        owned = await self.directory.owned.remote()
        status = await asyncio.gather(*(self.call(rid, "status") for rid in replicas.values()), return_exceptions=True)
        out = [s if isinstance(s, dict) else {"slot": slot, "replica_id": rid, "status": "unavailable",
                                              "error": f"{type(s).__name__}: {s}"[:300]}
               for (slot, rid), s in zip(replicas.items(), status, strict=True)]  # fmt: skip
        return {"object": "cluster", "replicas": [{**s, "owned_keys": owned.get(s["slot"], 0),
                                                   "relaying": self.load.get(s["slot"], 0)} for s in out],
                "stream_moves": await self.directory.stream_moves_total.remote()}

    async def health(self) -> Response:
        replicas = await self.replicas()
        if not replicas:
            return JSONResponse(error_body(503, "no engine replica is ready yet"), status_code=503)
        return JSONResponse({"status": "ok", "model": self.config.served_name(), "replicas": sorted(replicas)})

    async def render_metrics(self) -> Response:
        replicas = await self.replicas()
        texts = await asyncio.gather(*(self.call(rid, "metrics") for rid in replicas.values()), return_exceptions=True)
        answered = {slot: t for slot, t in zip(replicas, texts, strict=True) if isinstance(t, bytes)}  # not restarting
        body = generate_latest(self.metrics.registry) + labelled(answered)
        return Response(body, media_type="text/plain; version=0.0.4")


def move_ended(task: asyncio.Task[Any]) -> None:
    """A move whose request was cancelled ends unwatched: its error is logged here (asyncio had said only "Task
    exception was never retrieved")."""
    if not task.cancelled() and (e := task.exception()) is not None:
        log.warning("a name's move failed after its request had gone: %r", e)


def outcome(key: str | None, owner: str | None, answered: str) -> str:
    """The routing counter's label: any (bound to nothing), new (no owner yet), hit (the owner answered), fallback."""
    if key is None:
        return "any"
    return "new" if owner is None else "hit" if answered == owner else "fallback"


@dataclass
class NameMove:
    """A name's versions moved (`Front.move_name`): from which slot, their handles, bytes and steps' seconds."""

    source: str
    handles: list[str]
    nbytes: int
    steps: dict[str, float] = dataclasses.field(default_factory=dict)


def migration(handle: str, source: str, to: str, nbytes: int, seconds: float, handles: list[str]) -> dict[str, Any]:
    return {"object": "state.migration", "handle": handle, "from": source, "to": to, "bytes": nbytes,
            "seconds": round(seconds, 6), "handles": handles}  # fmt: skip


async def forwarded(request: Request) -> ForwardedRequest:
    scope = request.scope
    client = scope.get("client")
    own = (RESUME_HEADER.encode(), RESPONSE_ID_HEADER.encode())
    headers = [(k, v) for k, v in scope["headers"] if k not in own]  # only the front sets them
    return ForwardedRequest(request.method, scope["path"], scope.get("query_string", b""), headers,
                            await request.body(), tuple(client) if client else None)  # fmt: skip


def response_headers(head: Head) -> dict[str, str]:
    headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in head.headers}
    headers[REPLICA_HEADER.decode()] = head.replica
    return headers


async def relay(gen: Any) -> AsyncIterator[Any]:
    """The body chunks after the head (and a `Handover`, when the stream moves); the replica's generator is cancelled
    if the client goes away."""
    done = False
    try:
        async for chunk in gen:
            yield chunk
        done = True
    finally:
        if not done:
            gen.cancel()


async def chained(first: Any, gen: Any) -> AsyncIterator[Any]:
    """`first`, then the rest of `relay(gen)`."""
    yield first
    async for item in relay(gen):
        yield item


async def collect(gen: Any) -> tuple[int, bytes]:
    head = await anext(gen)
    head = await anext(gen) if accepted(head) else head
    return head.status, b"".join([c async for c in gen])


def labelled(texts: dict[str, bytes]) -> bytes:
    """Replicas' Prometheus texts as one, each sample labelled with its replica's slot."""
    families: dict[str, tuple[str, str, list[str]]] = {}
    for slot, text in texts.items():
        for fam in text_string_to_metric_families(text.decode()):
            _, _, lines = families.setdefault(fam.name, (fam.type, fam.documentation, []))
            for s in fam.samples:
                labels = {**s.labels, "replica": slot}
                inner = ",".join(f'{k}="{escape(v)}"' for k, v in labels.items())
                lines.append(f"{s.name}{{{inner}}} {s.value!r}")
    out = []
    for name, (kind, doc, lines) in families.items():
        name = name + "_total" if kind == "counter" else name  # as one server writes it (parsers then read counters)
        out += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}", *lines]
    return ("\n".join(out) + "\n").encode() if out else b""


def escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


async def replica_failed(request: Request, exc: Exception) -> Response:
    """A replica died, failed or did not answer mid-call: an outage, reported as one (Serve restarts replicas)."""
    log.error("request to %s failed in a replica: %s: %s", request.url.path, type(exc).__name__, exc)
    return error_response(503, f"the replica serving this request failed ({type(exc).__name__}); retry",
                          None, "replica_unavailable")  # fmt: skip


def build_front_app(front: Front) -> FastAPI:
    """The ingress app: the same ASGI gate and body limit as a single server, then the front's routes."""
    app = FastAPI(title="wkvm", openapi_url=None, docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimit, limit=front.config.max_body_bytes)
    app.add_middleware(ApiKeyGate, keys=front.keys)
    add_cors(app, front.config.allowed_origins)
    add_host_check(app, front.config.host, front.keys, front.config.allowed_hosts)
    methods = ["GET", "POST", "PUT", "PATCH", "DELETE"]
    app.add_exception_handler(Exception, replica_failed)
    app.add_api_route("/health", front.health, methods=["GET"])
    app.add_api_route("/metrics", front.render_metrics, methods=["GET"])
    app.add_api_route("/v1/cluster", front.cluster, methods=["GET"])
    app.add_api_route(STATES, front.list_states, methods=["GET"])
    app.add_api_route(STATES + "/{handle}/migrate", front.migrate, methods=["POST"])
    app.add_api_route("/v1/streams/{stream_id}/migrate", front.move_stream, methods=["POST"])
    app.add_api_route("/{path:path}", front.forward, methods=methods)
    return app
