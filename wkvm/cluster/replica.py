"""`EngineReplica`: one Ray Serve replica, a whole single-process wkvm server (engine, state store, chat sessions,
routes) without its own HTTP listener: the front forwards requests to `http`.

Each replica takes a slot from the directory and keeps its durable states in `<state-dir>/<slot>`; a replacement
for a crashed replica takes the same slot and directory, so every acknowledged state is there again. A state moves
between replicas as its exported file (`export_name` -> `adopt` -> `drop_name`), keeping its handle and lineage.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import hashlib
import logging
import os
import sqlite3
import threading
import time
import warnings
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import ray
import torch
from ray import serve

from wkvm.cluster.directory import Directory, base_ticket, pushed_ticket, ready_ticket
from wkvm.cluster.forward import (
    ACCEPTED,
    DISK_FULL_REPLY,
    EXISTS_REPLY,
    MISROUTED,
    MISROUTED_REPLY,
    QUOTA_REPLY,
    SAVING_REPLY,
    TIMEOUT_REPLY,
    ForwardedRequest,
    Handover,
    Head,
    adopt_seconds,
    file_versions,
    response_key,
    run_asgi,
    saved_names,
    state_key,
)
from wkvm.config import ServerConfig
from wkvm.logs import wkvm_logger
from wkvm.server.app import create_app
from wkvm.server.asgi import tenant_of
from wkvm.server.context import ServerContext
from wkvm.server.handover import HandoverError, LiveStream, Moved, MoveFuture, parse_marker
from wkvm.server.handover import decode as decode_ticket
from wkvm.server.handover import encode as encode_ticket
from wkvm.state.index import StateRecord
from wkvm.state.quota import QuotaExceeded, StoreLimits, is_internal
from wkvm.state.sessions import ParkedCopy, SessionKey
from wkvm.state.store import DiskFull, StateDirInUse, StateNotFound, StateStore

log = logging.getLogger("wkvm.cluster")
DIRECTORY = "wkvm-directory"
SLOT_WAIT_SECONDS = 60.0  # a new replica waits this long for a slot of the first N to free up (rolling restarts)
NAMESPACE = "wkvm"  # the directory's (Serve runs replicas in its own namespace)
DIRECTORY_POLL_SECONDS = 2.0  # how soon a replica notices a restarted directory and joins it again
CALL_SECONDS = 10.0  # a stream to move reaches its next token boundary well within this
READY_SECONDS = 2.0  # a pre-copied move waits this long for its destination to hold the pre-copy, then stops anyway
DRAIN_POLL_SECONDS = 0.05
STATUS_SECONDS = 5.0  # a draining replica asks each other one how it computes (`_computing_alike`) this long
MOVED_AWAY_KEYS = 10_000  # names moved from a replica it remembers, to send late requests for them back (`moved_away`)
NAME_SECONDS = 10.0  # a stream that moved here waits this long at its end for its `save_state` name to follow it


class EngineReplica:
    def __init__(self, config: ServerConfig):
        wkvm_logger(config.log_level, config.log_format)  # Ray's worker shows only warnings of an unset logger
        self.replica_id: str = serve.get_replica_context().replica_id.unique_id
        # looked for among the collector's objects: before loading, which freezes everything alive out of its lists
        self._serve_replica = find_serve_replica()
        self.directory = ray.get_actor(DIRECTORY, namespace=NAMESPACE)
        me = ray.get_runtime_context().current_actor
        # the slot first (it names the state directory), then the keys of what that directory holds
        self.slot: str = ray.get(self.directory.claim.remote(self.replica_id, me, config.replicas, SLOT_WAIT_SECONDS))
        state_dir = str(Path(config.state_dir) / self.slot) if config.state_dir else None
        # replicas on one machine share its cores: torch's default of every core each would oversubscribe them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, config.replicas)))
        self.app = create_app(replace(config, state_dir=state_dir), load_in_background=False)
        self.ctx: ServerContext = self.app.state.ctx
        # loaded on a thread that then ends: a thread that ran torch on several threads keeps an OpenMP team, and
        # Ray's thread lives on beside the step loop (an idle team slows every decode step: engine/threads.py)
        loader = threading.Thread(target=self.ctx.load, name="wkvm-load")
        loader.start()
        loader.join()
        if self.ctx.load_error:
            raise RuntimeError(self.ctx.load_error)
        keys = self._named_keys()
        ray.get(self.directory.holds.remote(self.slot, keys))
        self._epoch: str = ray.get(self.directory.epoch.remote())
        log.info("replica %s holds slot %s (%d named states and stored responses)", self.replica_id, self.slot,
                 len(set(keys)))  # fmt: skip
        self.ctx.sessions.mirror = DirectoryMirror(self.directory, self.slot)
        self.ctx.holds_name = self._holds_name
        self._stopped = threading.Event()
        self._pushed: dict[str, int] = {}  # tickets pushed to the directory (`_push`) -> their bytes
        self._saving: Counter[tuple[str, str]] = Counter()  # (tenant, name) -> requests here that will save it
        self._moved_away: dict[str, None] = {}  # route keys of names moved from here (oldest first; `moved_away`)
        self._drain = threading.Thread(target=self._drain_when_stopping, name="wkvm-drain", daemon=True)
        self._drain.start()
        self._watch = threading.Thread(target=self._watch_directory, name="wkvm-directory-watch", daemon=True)
        self._watch.start()

    def check_health(self) -> None:
        """Serve's periodic probe: a replica whose engine loop has died would hang every request routed to it, so it
        fails the probe and Serve replaces it (its slot and named states go to the replacement)."""
        if self.ctx.generative and self.ctx.client.loop_failed():
            raise RuntimeError("the engine's step loop has stopped (a bug: see this replica's log)")

    def _watch_directory(self) -> None:
        """Every DIRECTORY_POLL_SECONDS, on its own thread (a blocking call on the replica's event loop, as in its
        health probe, held every request behind it: 1-token completions took 2x as long): a directory Ray restarted
        (empty) gets this replica's slot and named states again."""
        while not self._stopped.wait(DIRECTORY_POLL_SECONDS):
            try:
                if ray.get(self.directory.epoch.remote(), timeout=5.0) != self._epoch:
                    me = ray.get_runtime_context().current_actor
                    keys = self._named_keys()
                    self._epoch = ray.get(self.directory.rejoin.remote(self.slot, self.replica_id, me, keys),
                                          timeout=5.0)  # fmt: skip
                    log.warning("replica %s joined the restarted directory again (slot %s)", self.replica_id,
                                self.slot)  # fmt: skip
            except Exception as e:  # the directory is restarting: ask again
                log.info("replica %s: the directory did not answer (%s); asking again", self.slot, type(e).__name__)

    def _named_keys(self) -> list[str]:
        """The route keys this replica's slot directory answers for: its named states and its stored Responses API
        responses (a restarted directory relearns both; a response's reads had answered 404 from other replicas)."""
        states = [state_key(r.owner, r.name) for r in self.ctx.store.index.list() if not is_internal(r.owner)]
        return states + [response_key(owner, rid) for owner, rid in self.ctx.responses.ids()]

    def misrouted(self, route: dict[str, object]) -> bool:
        """A strict call meant for another replica (its owner was being replaced when it was routed)."""
        return bool(route.get("strict")) and route.get("target") != self.replica_id

    async def http(self, req: ForwardedRequest, handover: Handover | None = None,
                   **route: object) -> AsyncIterator[Head | bytes | Handover]:  # fmt: skip
        """Answer one forwarded request (`handover`: the stream it continues; without its data, the request starts at
        once and waits in its route for the ticket the source pushes to the directory). A stream this replica hands
        over ends with its `Handover` instead of the handover event. Every method's `route` keywords are the
        router's."""
        if self.misrouted(route) or (route.get("strict") and await self.moved_away(route.get("key"))):
            yield Head(MISROUTED, [], self.slot)
            return
        if route.get("strict"):  # the front stops waiting for the owner (`ACCEPTED`)
            yield Head(ACCEPTED, [], self.slot)
        if handover is not None:
            incoming: bytes | asyncio.Task[bytes] = handover.data
            if not incoming:
                incoming = asyncio.create_task(pushed_ticket(self.directory, handover.ticket, CALL_SECONDS))
            self.ctx.handovers.put_in(handover.ticket, incoming, asyncio.create_task(self._precopy_in(handover)))
        tenant = tenant_of(req.scope(), self.ctx.keys) or "anonymous"
        saving = [(tenant, name) for name in saved_names(req)]
        self._saving.update(saving)  # `export_name` refuses to move these names while this runs
        try:
            async for part in run_asgi(self.app, req, self.slot):
                mark = parse_marker(part) if isinstance(part, bytes) else None
                if mark is None:
                    yield part
                    continue
                ticket, to = mark
                if ticket in self._pushed:  # on its way to the destination's call since the request stopped (`_push`)
                    yield Handover(to, ticket, pushed=self._pushed.pop(ticket))
                elif (data := self.ctx.handovers.take_out(ticket)) is not None:
                    yield Handover(to, ticket, data)
        finally:
            self._saving -= Counter(saving)  # keeps positive counts only

    async def moved_away(self, key: object) -> bool:
        """Whether a strict request for `key` (a named state) came here after the name moved away: a front that looked
        the owner up just before a move recorded the new one sends it here after `drop_name` (a read had been a
        false 404, a save a version issued where the directory no longer points). It is answered "misrouted" and the
        front asks the directory again. A key that came back (the directory names this slot again), or that no replica
        owns now (deleted, a restarted directory: misrouted, the front had retried until its 503), is served."""
        if not isinstance(key, str) or key not in self._moved_away:
            return False
        slot, _ = await self.directory.lookup.remote(key)
        if slot is None or slot == self.slot:
            self._moved_away.pop(key, None)
            return False
        return True

    def _mark_moved(self, key: str) -> None:
        self._moved_away.pop(key, None)
        self._moved_away[key] = None
        while len(self._moved_away) > MOVED_AWAY_KEYS:  # the oldest go (a key is one name's: moves are rare)
            del self._moved_away[next(iter(self._moved_away))]

    async def move_stream(self, tenant: str, stream_id: str, to: str, ticket: str | None = None,
                          precopy: bool = False, **route: object) -> dict[str, Any] | str:  # fmt: skip
        """Hand a running stream over to replica `to` at its next token boundary; {"status", ...} says how it went.
        `ticket`: the id the front opened the destination's call under (the ticket is pushed to the directory, and a
        generating stream is pre-copied first with `precopy`: `_precopy_out`)."""
        if self.misrouted(route):
            return MISROUTED_REPLY
        handovers = self.ctx.handovers
        try:
            live = handovers.claim(tenant, stream_id, to, ticket)
        except KeyError:
            return {"status": 404, "message": f"no running stream {stream_id!r} on {self.slot}"}
        except HandoverError as e:
            return {"status": 409, "message": f"stream {stream_id!r} cannot move: {e}"}
        # a stream whose API numbers what it sent (the Responses stream: `Ticket.route`) carries its ticket at its end,
        # once that API has numbered every event before the move: pushed when the request stops, it had carried a
        # number from before the last events (the client saw one twice); so no pre-copy either
        routed = live.ticket.route is not None
        if ticket is not None and precopy and not routed:
            await self._precopy_out(live, ticket)
        try:
            push = self._push if ticket is not None and not routed else None
            fut = handovers.suspend(self.ctx.client, live, push=push)
            cs = await asyncio.wait_for(asyncio.wrap_future(fut), CALL_SECONDS)
        except (HandoverError, KeyError, TimeoutError):
            if live.base is not None and ticket is not None:  # nobody will need the pre-copy
                self.directory.take_ticket.remote(base_ticket(ticket), 0)
            return {"status": 409, "message": f"stream {stream_id!r} finished before it could move"}
        caught_up = None if live.base is None else len(cs[0].output_ids) - len(live.base.output_ids)
        return {"status": 200, "generated_tokens": sum(len(c.output_ids) for c in cs), "precopy_tokens": caught_up}

    async def _precopy_out(self, live: LiveStream, ticket: str) -> None:
        """Pre-copy a generating stream: its ticket at the next token boundary into the object store (the reference
        under `base_ticket`) while it goes on here; return once the destination holds it (it says so under
        `ready_ticket`) or after READY_SECONDS. The stop that follows then pushes only what changed since (`_push`),
        so the state's bytes are not on the client's wait. Only where the destination's catch-up on the tokens
        generated meanwhile gives the bits of stepping (`chunks_equal_steps`: RWKV-7 with its step kernel), so a move
        never changes a token; not while the stream still reads its prompt, and not for n > 1 (its choices move
        whole)."""
        if len(live.handles) != 1:
            return
        req = live.handles[0].request
        if req.is_prefilling or not self.ctx.model.chunks_equal_steps:
            return
        try:
            base = await asyncio.wait_for(asyncio.wrap_future(self.ctx.client.precopy(req.request_id)), CALL_SECONDS)
            m = self.ctx.model
            data = await asyncio.to_thread(encode_ticket, m.spec, m.fingerprint, base, live.ticket)
            self.directory.put_ticket.remote(base_ticket(ticket), [ray.put(data)])
        except (KeyError, ValueError, TimeoutError):  # it ended meanwhile: the stop says so
            return
        live.base, live.base_bytes = base, len(data)
        await self.directory.take_ticket.remote(ready_ticket(ticket), READY_SECONDS)

    async def _precopy_in(self, handover: Handover) -> Moved | None:
        """The decoded pre-copy a moved stream's ticket may go on from: carried with it (`handover.base`), or pushed
        by the source to the directory for an opened call, in which case the source hears that it is here and stops
        the stream. None when none came (the ticket then holds the state itself) or it does not read."""
        data = handover.base
        if not data and not handover.data:
            data = await pushed_ticket(self.directory, base_ticket(handover.ticket), CALL_SECONDS)
            if data:
                self.directory.put_ticket.remote(ready_ticket(handover.ticket), b"ready")
        if not data:
            return None
        m = self.ctx.model
        try:
            return decode_ticket(data, m.spec, m.fingerprint, m.vocab_size)
        except HandoverError as e:
            log.warning("a moved stream's pre-copy does not read: %s", e)
            return None

    def _push(self, live: LiveStream) -> None:
        """On the engine's thread, the moment a stream the front asked to move stops: its ticket to the directory,
        where the destination's call waits for it (only what changed since the pre-copy when there was one, as bytes;
        else the whole ticket into the object store and its reference). On any failure the stream's end carries the
        whole ticket instead (the front then hands it over that way)."""
        assert live.out_id is not None
        try:
            m = self.ctx.model
            data = encode_ticket(m.spec, m.fingerprint, *live.outgoing(), live.base)
            self.directory.put_ticket.remote(live.out_id, data if live.base is not None else [ray.put(data)])
        except Exception:
            log.exception("could not push the ticket of moving stream %s; it goes through the front", live.ticket.id)
            return
        self._pushed[live.out_id] = len(data) + live.base_bytes
        live.pushed = True

    def _drain_when_stopping(self) -> None:
        """When Serve starts stopping this replica (redeploy, scale-down), hand every running stream that can move
        over to the other replicas, so Serve's drain does not wait for them to finish here. A stream that saves under
        a name takes the name along once it stopped (`_hand_name_over`), as the front does for a move it is asked
        for."""
        serve_replica = self._serve_replica
        if serve_replica is None:
            log.warning("replica %s: cannot see when Serve stops it; its streams finish here instead of moving",
                        self.slot)  # fmt: skip
            return
        while not getattr(serve_replica, "_shutting_down", False):
            if self._stopped.wait(DRAIN_POLL_SECONDS):
                return
        if ray.get(self.directory.app_stopping.remote()):  # every replica is stopping: nowhere to move to
            log.info("replica %s is stopping with the application: its streams finish here (--shutdown-grace)",
                     self.slot)  # fmt: skip
            return
        replicas = ray.get(self.directory.replicas.remote())
        others = self._computing_alike({slot: rid for slot, rid in replicas.items() if slot != self.slot})
        log.info("replica %s is stopping: moving %d running streams to %s", self.slot,
                 sum(s.why_not is None and not s.done for s in self.ctx.handovers.live()), others)  # fmt: skip
        until = time.monotonic() + self.ctx.config.shutdown_grace  # then what still runs here is ended (`__del__`)
        with concurrent.futures.ThreadPoolExecutor(1, "wkvm-drain-names") as names:
            for s, to, fut in self.ctx.handovers.move_all(self.ctx.client, others, until, self._stopped,
                                                          DRAIN_POLL_SECONDS):  # fmt: skip
                if s.saves is not None:  # once stopped here (it never saves here then), its name follows it
                    names.submit(self._name_follows, fut, s.tenant, s.saves, to, replicas[to])

    def _computing_alike(self, others: dict[str, str]) -> list[str]:
        """Where this replica's streams move when it stops: the slots among `others` whose replicas compute as this
        one does (the same `system_fingerprint`: wkvm's code, dtypes, CPU kind, kernels' builds), where a moved stream
        goes on exactly as it would here; an int8 stream moved to another kind of CPU (a Ray cluster of mixed nodes)
        would go on with other roundings, ~0.06 nats a token apart (session 60). Where none does (an upgrade by
        rolling restart: the new replicas run other code) the streams move to the others that answer all the same,
        with a warning: going on otherwise beats being cut when the drain's grace runs out, as they were before."""
        mine, alike, answered = self.ctx.system_fingerprint, [], []
        # asked all at once: silent replicas cost the drain STATUS_SECONDS, not that times their count
        with concurrent.futures.ThreadPoolExecutor(max(1, len(others)), "wkvm-drain-status") as pool:
            asked = {slot: pool.submit(self._call, replica_id, "status", timeout=STATUS_SECONDS)
                     for slot, replica_id in others.items()}  # fmt: skip
        for slot, fut in asked.items():
            try:
                found = fut.result()
            except Exception as e:  # stopping too, or gone: it could not take the stream either
                log.info("replica %s: %s did not say how it computes (%s); no stream moves there", self.slot, slot,
                         type(e).__name__)  # fmt: skip
                continue
            theirs = found.get("system_fingerprint") if isinstance(found, dict) else None
            answered.append(slot)
            if theirs == mine:
                alike.append(slot)
            else:
                log.info("replica %s: %s computes otherwise (system_fingerprint %s, here %s)", self.slot, slot, theirs,
                         mine)  # fmt: skip
        if not alike and answered:
            log.warning("replica %s: no other replica computes as this one does; its streams move to %s all the same "
                        "and go on with their arithmetic", self.slot, answered)  # fmt: skip
        return alike or answered

    def _name_follows(self, fut: MoveFuture, tenant: str, name: str, slot: str, replica_id: str) -> None:
        with contextlib.suppress(Exception):  # it did not stop here (finished first): its name stays
            fut.result(CALL_SECONDS)
            self._hand_name_over(tenant, name, slot, replica_id)

    def _hand_name_over(self, tenant: str, name: str, slot: str, replica_id: str) -> None:
        """Every version of `name` (held here) to replica `replica_id` in `slot`, for a stream saving under it that
        moved there: adopted there, the directory updated, dropped here (as the front's `move_name`; this replica is
        stopping, so no new version appears here meanwhile)."""
        try:
            files = self._export(tenant, name)
            seconds = adopt_seconds(files)
            try:
                card = self._name_card(tenant, name)
                handles = self._call(replica_id, "adopt", tenant, files, card, time.time() + seconds,
                                     timeout=seconds + CALL_SECONDS, tenant_quota=False) if files else []  # fmt: skip
            except Exception:  # no answer: where it finished as this call gave up, its copies go (as the front's)
                with contextlib.suppress(Exception):
                    self._call(replica_id, "drop_name", tenant, name, file_versions(files), True)
                raise
            if handles == EXISTS_REPLY:
                raise ValueError(f"{name!r} is on {slot} already (another move took it there)")
            if handles in (QUOTA_REPLY, DISK_FULL_REPLY, TIMEOUT_REPLY):
                why = {QUOTA_REPLY: "does not fit its --state-disk-quota", DISK_FULL_REPLY: "its disk is full",
                       TIMEOUT_REPLY: "it did not take it in time"}[handles]  # fmt: skip
                raise ValueError(f"{name!r} did not move to {slot} ({why}): it stays here")
            ray.get(self.directory.record.remote(state_key(tenant, name), slot))
            self._drop(tenant, name, [int(h.rsplit("@", 1)[1]) for h in handles])
        except Exception:
            log.exception("replica %s: the name %r did not follow its stream to %s", self.slot, name, slot)

    def _call(self, replica_id: str, method: str, *args: Any, timeout: float = CALL_SECONDS, **kwargs: Any) -> Any:
        """Another replica's method, from a thread of this one (the front's `call`, synchronous); `kwargs` go by name
        (a replica of an earlier version takes unknown ones among its route keywords: rolling restarts run both)."""
        ctx = serve.get_replica_context()
        handle = serve.get_deployment_handle(ctx.deployment, app_name=ctx.app_name)
        deadline = time.monotonic() + timeout
        while True:
            result = getattr(handle, method).remote(*args, target=replica_id, strict=True, **kwargs).result(
                timeout_s=max(0.1, deadline - time.monotonic()))  # fmt: skip
            if result != MISROUTED_REPLY or time.monotonic() > deadline:
                return result
            time.sleep(0.1)

    def _holds_name(self, tenant: str, name: str) -> bool:
        """Whether this replica holds `name`, waiting up to NAME_SECONDS for it to arrive (a moved stream's)."""
        key, deadline = state_key(tenant, name), time.monotonic() + NAME_SECONDS
        while ray.get(self.directory.lookup.remote(key))[0] != self.slot:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    async def export_name(self, tenant: str, name: str, refuse_saving: bool = False,
                          **route: object) -> list[bytes] | str:  # fmt: skip
        """Every version of a named state as exported files, oldest first. `refuse_saving`: SAVING_REPLY instead
        while a request running here will save the name's next version (any that saves it: create, import, fork,
        save_as, mutate, save_state; `http` counts them)."""
        if self.misrouted(route):
            return MISROUTED_REPLY
        if refuse_saving and self._saving[(tenant, name)] > 0:
            return SAVING_REPLY
        return await asyncio.to_thread(self._export, tenant, name)

    def _export(self, tenant: str, name: str) -> list[bytes]:
        store = self.ctx.store
        return [store.export_bytes(tenant, r.handle) for r in store.versions(tenant, name)]

    def _name_card(self, tenant: str, name: str) -> tuple[int, list[int]]:
        """What a name's moved files do not carry: its last version ever issued, and its pinned versions."""
        store = self.ctx.store
        return store.index.next_version(tenant, name) - 1, [r.version for r in store.versions(tenant, name) if r.pinned]

    async def has_state(self, tenant: str, handle: str, **route: object) -> bool | str:
        """Whether this replica stores `handle` of `tenant` (a migrate that names a version checks it first)."""
        if self.misrouted(route):
            return MISROUTED_REPLY

        def find() -> bool:
            try:
                self.ctx.store.get(tenant, handle)
            except StateNotFound:
                return False
            return True

        return await asyncio.to_thread(find)

    async def name_card(self, tenant: str, name: str, **route: object) -> tuple[int, list[int]] | str:
        if self.misrouted(route):
            return MISROUTED_REPLY
        return await asyncio.to_thread(self._name_card, tenant, name)

    async def adopt(self, tenant: str, files: list[bytes], card: tuple[int, list[int]] | None = None,
                    deadline: float | None = None, tenant_quota: bool = True,
                    **route: object) -> list[str] | str:  # fmt: skip
        """Store moved states under their own handles (validated as an import); `card` (`name_card`): no version
        up to the name's last issued one is issued here again, and its pinned versions stay pinned. All or nothing:
        whatever stops it (the quota, a full disk, a bad file, the caller's `deadline` (time.time()) passed before it
        is done: TIMEOUT_REPLY, or the caller's cancel) drops what it took, and the name stays whole on its source (a
        full disk or a move past the front's wait had left partial copies, listed twice, that no delete reached and
        that won the name after a directory restart; hunt and review, session 48)."""
        if self.misrouted(route):
            return MISROUTED_REPLY
        store = self.ctx.store
        cancelled = threading.Event()
        if deadline is not None and deadline < 1e9:  # seconds from now, as a caller of an earlier version sends
            deadline = time.time() + deadline  # (a rolling restart runs both)

        def stop_if_late() -> None:
            if cancelled.is_set():
                raise TimeoutError("the caller gave up")
            if deadline is not None and time.time() > deadline:
                raise TimeoutError(f"adopting {len(files)} files took past the caller's deadline")

        def adopt_all() -> list[str]:
            handles: list[str] = []
            try:
                for f in files:
                    stop_if_late()
                    handles.append(store.adopt_bytes(tenant, f, tenant_quota).handle)
                if card is not None and handles:
                    name, top = handles[0].rsplit("@", 1)[0], max(int(h.rsplit("@", 1)[1]) for h in handles)
                    if card[0] > top:  # its newest versions were deleted (else adopting them recorded it)
                        store.index.reserve_versions(tenant, name, card[0])
                    for v in card[1]:
                        store.set_pinned(tenant, f"{name}@{v}", True)
                stop_if_late()  # done, but after the caller stopped waiting: it answered that nothing moved
            except BaseException:  # none kept: the name stays whole on its source
                self._unadopt(tenant, handles)
                raise
            return handles

        try:
            try:
                handles = await asyncio.to_thread(adopt_all)
            except asyncio.CancelledError:  # the caller's call was cancelled: its thread drops what it took
                cancelled.set()
                raise
            for name in {h.rsplit("@", 1)[0] for h in handles}:  # a name moved back here
                self._moved_away.pop(state_key(tenant, name), None)
            return handles
        except QuotaExceeded:
            return QUOTA_REPLY
        except DiskFull:
            return DISK_FULL_REPLY
        except TimeoutError:
            return TIMEOUT_REPLY
        except ValueError as e:
            if "exists already" in str(e):  # another move of the name got here first
                return EXISTS_REPLY
            raise

    def _unadopt(self, tenant: str, handles: list[str]) -> None:
        """Drop the states an adoption that failed took (a delete works on a full disk)."""
        for h in handles:
            try:
                self.ctx.store.delete(tenant, h)
            except StateNotFound:
                pass
            except Exception:
                log.exception("replica %s: %s, adopted by a move that failed, could not be dropped", self.slot, h)

    async def drop_name(self, tenant: str, name: str, versions: list[int], undo: bool = False,
                        **route: object) -> bool | str:  # fmt: skip
        """Delete a moved name here, unless a version other than `versions` appeared meanwhile or a save of it began
        here after the export (the directory still pointed here: its version would be issued where the name no longer
        lives); then keep all. `undo`: the copies a move adopted here, whose source kept the name: a request here that
        will save the name (the stream that moved with it) does not keep them."""
        if self.misrouted(route):
            return MISROUTED_REPLY
        if self._saving[(tenant, name)] > 0 and not undo:
            return False
        dropped = await asyncio.to_thread(self._drop, tenant, name, versions)
        if dropped:
            self._mark_moved(state_key(tenant, name))
        return dropped

    def _drop(self, tenant: str, name: str, versions: list[int]) -> bool:
        store = self.ctx.store
        if [r.version for r in store.versions(tenant, name)] != versions:
            return False
        for v in versions:
            with contextlib.suppress(StateNotFound):
                store.delete(tenant, f"{name}@{v}")
        return True

    async def absorb(self, slot: str, **route: object) -> int | str:
        """Take every named state of a slot no replica holds (left behind by a rolling restart that gave the new
        replicas other slots): each moves here with its handle, and the directory learns it. Returns how many."""
        if self.misrouted(route):
            return MISROUTED_REPLY
        cfg, m = self.ctx.config, self.ctx.model
        root = Path(cfg.state_dir or "").parent / slot  # this replica's own directory is <state-dir>/<its slot>
        if not cfg.state_dir or slot == self.slot or not (root / "index.sqlite").exists():
            return 0

        def move() -> list[str]:
            try:
                other = StateStore(root, m.spec, m.fingerprint, m.vocab_size, device=cfg.device,
                                   limits=StoreLimits.from_config(cfg))  # fmt: skip
            except StateDirInUse as e:  # its replica is still there (stopping): nothing is left behind yet
                log.info("replica %s: slot %s is not free to take: %s", self.slot, slot, e)
                return []
            try:
                recs = sorted((r for r in other.index.list() if not is_internal(r.owner)),
                              key=lambda r: (r.owner, r.name, r.version))  # fmt: skip
                taken: list[StateRecord] = []
                store = self.ctx.store
                try:
                    for r in recs:
                        taken.append(store.adopt_bytes(r.owner, other.export_bytes(r.owner, r.handle), False))
                    # with their pins and their names' last versions issued, as a migrate moves them (the merge had
                    # unpinned them, and issued a deleted version again; cluster hunt, session 49)
                    for r in recs:
                        if r.pinned:
                            store.keep_pin(r.owner, r.handle)
                    for owner, name, last in other.index.issued():
                        store.index.reserve_versions(owner, name, last)
                except BaseException:  # all or nothing: the slot's directory keeps them all for a later try
                    for t in taken:
                        self._unadopt(t.owner, [t.handle])
                    raise
                for r in recs:
                    other.delete(r.owner, r.handle)
                keys = [state_key(r.owner, r.name) for r in recs]
                answers = root / "responses.sqlite"  # the slot's stored Responses follow them (they had been left
                try:  # behind), while its directory's lock is still held here
                    taken_ids = self.ctx.responses.take(answers) if answers.exists() else []
                    keys += [response_key(o, i) for o, i in taken_ids]
                except sqlite3.Error as e:
                    log.warning("replica %s: the stored responses of slot %s stay in %s (%s)", self.slot, slot,
                                answers, e)  # fmt: skip
                return keys
            finally:
                other.close()

        keys = await asyncio.to_thread(move)
        await self.directory.holds.remote(self.slot, keys)
        log.info("replica %s took %d named states from unheld slot %s", self.slot, len(keys), slot)
        return len(keys)

    async def status(self, **route: object) -> dict[str, Any] | str:
        """This replica's slot and load (async, as every method Serve calls here: it warns about plain ones)."""
        if self.misrouted(route):
            return MISROUTED_REPLY
        s = self.ctx.client.stats()
        return {"slot": self.slot, "replica_id": self.replica_id, "pid": os.getpid(), "status": "ok",
                "system_fingerprint": self.ctx.system_fingerprint, "running": s.running, "waiting": s.waiting,
                "slots_free": s.slots_free}  # fmt: skip

    async def metrics(self, **route: object) -> bytes | str:
        if self.misrouted(route):
            return MISROUTED_REPLY
        return await asyncio.to_thread(self.ctx.metrics.render, self.ctx.client.stats(), self.ctx.store)

    def __del__(self) -> None:
        """Serve's graceful stop: running requests get `--shutdown-grace`, then parked states are written."""
        ctx: ServerContext | None = getattr(self, "ctx", None)
        if ctx is None:
            return
        stopped: threading.Event | None = getattr(self, "_stopped", None)
        if stopped is not None:
            stopped.set()
            self._drain.join(CALL_SECONDS)  # a drained stream's name may still be on its way to where it moved
        ctx.end_requests(ctx.config.shutdown_grace)
        ctx.shutdown()
        with contextlib.suppress(Exception):  # the directory went first (the whole application is stopping)
            self.directory.release.remote(self.replica_id)


class DirectoryMirror:
    """Parked chat sessions mirrored in the directory, by value (they outlive the replica that parked them): a turn
    routed elsewhere (its owner full or restarted) takes its session over instead of recomputing it."""

    def __init__(self, directory: Any, slot: str):
        self.directory, self.slot = directory, slot

    def publish(self, key: SessionKey, copy: ParkedCopy) -> None:
        self.directory.park_session.remote(mirror_key(key), self.slot, copy, len(copy.data))

    def fetch(self, key: SessionKey) -> ParkedCopy | None:
        try:
            copy = ray.get(self.directory.parked_session.remote(mirror_key(key)), timeout=CALL_SECONDS)
        except Exception:  # the directory is restarting: the turn restarts, exactly
            log.warning("could not ask the directory for a parked session", exc_info=True)
            return None
        return copy if isinstance(copy, ParkedCopy) else None

    def forget(self, key: SessionKey) -> None:
        self.directory.forget_session.remote(mirror_key(key), self.slot)


def mirror_key(key: SessionKey) -> str:
    return "sess:" + hashlib.sha256("\x00".join(key).encode()).hexdigest()[:24]


def find_serve_replica() -> Any:
    """Serve's own replica object in this actor (Ray 2.58 internals: it sets `_shutting_down` when a stop begins,
    before it waits for running requests); None when this Ray version has none."""
    from ray.serve._private.replica import Replica

    with warnings.catch_warnings():  # isinstance over every object wakes deprecated module attributes (torch's)
        warnings.simplefilter("ignore")
        return next((o for o in gc.get_objects() if isinstance(o, Replica)), None)


def directory_actor() -> Any:
    """The directory as a named Ray actor (async methods: pings never block lookups)."""
    # restarted when it dies (empty: the replicas join it again, `check_health`); a call made meanwhile waits for it
    return ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)(Directory).options(
        name=DIRECTORY, namespace=NAMESPACE, get_if_exists=True).remote()  # fmt: skip
