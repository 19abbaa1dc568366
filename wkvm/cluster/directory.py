"""The directory: which replica slot holds what. One Ray actor per application (`wkvm-directory`).

Replicas take stable slot names (r0, r1, ...) when they start: a replacement for a dead replica takes the dead one's
slot, and with it its state directory (`<state-dir>/<slot>`), so every acknowledged state comes back. A slot's
holder reports the named states it holds; the front records the owner of each chat session and named state a
replica answered for, and asks here where a request should go.

Across machines the same holds as long as `--state-dir` is a path every node mounts (or a slot always lands on the
node that has its directory): the directory knows slots, not disks.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("wkvm.cluster")
PARKED_BYTES = 512 << 20  # mirrored chat sessions kept (least recently used go first): ~220 0.1B RWKV-7 states
TICKET_SECONDS = 120.0  # a moving stream's ticket nobody took by then is dropped
SOFT_KEYS = 100_000  # chat-session and prompt-start owners kept (least recently used go first): only affinity,
SOFT_PREFIXES = ("session:", "prefix:")  # a forgotten one is routed anew (its checkpoints are then not reused)


@dataclass
class Slot:
    name: str
    replica_id: str
    actor: Any  # the replica's Ray actor handle (pinged to tell a dead holder from a live one)


@dataclass
class Directory:
    slots: dict[str, Slot] = field(default_factory=dict)
    owners: dict[str, str] = field(default_factory=dict)  # route key -> slot name
    soft: OrderedDict[str, None] = field(default_factory=OrderedDict)  # owners' soft keys, least recently used first
    # names a first request claimed that no answer confirmed yet -> requests routed by that claim and not yet answered
    tentative: dict[str, int] = field(default_factory=dict)
    stream_moves: int = 0  # running streams handed over, over the application's life (fronts restart too)
    parked: OrderedDict[str, tuple[str, Any, int]] = field(default_factory=OrderedDict)  # key -> slot, copy, bytes
    parked_bytes: int = 0
    tickets: dict[str, tuple[float, asyncio.Future[Any]]] = field(default_factory=dict)  # moving streams' tickets
    stopping: bool = False  # the whole application is stopping: no replica to move streams to
    # this incarnation: Ray restarts a dead directory empty, and each replica, seeing a new one, joins it again
    incarnation: str = field(default_factory=lambda: uuid.uuid4().hex)
    claiming: asyncio.Lock = field(default_factory=asyncio.Lock)  # `claim`'s choice and take, together

    async def claim(self, replica_id: str, actor: Any, slots: int = 0, wait: float = 0.0) -> str:
        """A starting replica's slot: the first one free or held by a dead replica. A replica that would get a slot
        past the first `slots` waits up to `wait` seconds for one of those to free up (in a rolling restart the new
        replica may start while the one it replaces is still draining: its slot, with its states and checkpoints,
        should pass on rather than be left behind)."""
        for s in self.slots.values():
            if s.replica_id == replica_id:
                return s.name
        deadline = time.monotonic() + wait
        while True:
            # one claim at a time from choosing to taking: `alive` awaits, and two replacements starting together
            # (both holders dead) had both chosen r0; the loser failed on r0's state dir lock and, retried, chose r0
            # again while r1 stayed empty
            async with self.claiming:
                name = await self._first_free()
                if int(name[1:]) < slots or time.monotonic() >= deadline:
                    self.slots[name] = Slot(name, replica_id, actor)
                    return name
            await asyncio.sleep(0.5)

    async def _first_free(self) -> str:
        n = 0
        while True:
            held = self.slots.get(f"r{n}")
            if held is None or not await alive(held.actor):
                return f"r{n}"
            n += 1

    def epoch(self) -> str:
        return self.incarnation

    def rejoin(self, slot: str, replica_id: str, actor: Any, keys: list[str]) -> str:
        """A running replica telling a restarted directory (which lost every map) its slot and named states."""
        self.slots[slot] = Slot(slot, replica_id, actor)
        self.holds(slot, keys)
        return self.incarnation

    def holds(self, slot: str, keys: list[str]) -> None:
        """The named states a slot's directory holds (reported by its replica once it has opened them)."""
        for k in keys:
            self.owners[k] = slot
            self.tentative.pop(k, None)  # a replica holds it: settled (a refusal must not forget it; review, 48)

    def release(self, replica_id: str) -> None:
        """A replica stopping cleanly: its slot is free (its states stay on disk for the next holder)."""
        for name, s in list(self.slots.items()):
            if s.replica_id == replica_id:
                del self.slots[name]

    async def prune(self) -> None:
        """Forget holders Ray reports dead (killed before they could release their slots)."""
        for name, s in list(self.slots.items()):
            if not await alive(s.actor):
                del self.slots[name]

    def lookup(self, key: str) -> tuple[str | None, str | None]:
        """(slot, replica id) owning `key`; (None, None) when nobody does."""
        slot = self.owners.get(key)
        if slot is not None and key in self.soft:
            self.soft.move_to_end(key)
        held = self.slots.get(slot) if slot else None
        return (slot, held.replica_id if held else None)

    def record(self, key: str, slot: str) -> None:
        self.owners[key] = slot
        self.tentative.pop(key, None)
        self._bound(key)

    def record_if(self, key: str, expect: str, slot: str) -> bool:
        """`record` where the owner is still `expect` (an undone move: a later move may have moved the key on)."""
        if self.owners.get(key) != expect:
            return False
        self.record(key, slot)
        return True

    def _bound(self, key: str) -> None:
        """Every chat id, `user` and prompt start a client sends had kept an owner for the application's life."""
        if not key.startswith(SOFT_PREFIXES):
            return
        self.soft[key] = None
        self.soft.move_to_end(key)
        while len(self.soft) > SOFT_KEYS:
            old, _ = self.soft.popitem(last=False)
            self.owners.pop(old, None)

    def claim_owner(self, key: str, slot: str) -> tuple[str | None, str | None]:
        """`key`'s owner, made `slot` when it has none: concurrent first requests of a key (two creating one new
        name) all go where the first went, so its versions are issued in one place (each got `name@1` on another
        replica before, and one of them could not be reached)."""
        if key not in self.owners:
            self.owners[key] = slot
            self._bound(key)
            if not key.startswith(SOFT_PREFIXES):
                self.tentative[key] = 0
        return self.lookup(key)

    def use(self, key: str, slot: str) -> str | None:
        """A request that may save `key` goes to `slot`: counted where that is a tentative claim (then the front
        `confirm`s or `release_claim`s it once answered, with the token returned: this directory's incarnation);
        None where the name's owner is settled."""
        if key not in self.tentative or self.owners.get(key) != slot:
            return None
        self.tentative[key] += 1
        return self.incarnation

    def confirm(self, key: str, slot: str) -> None:
        """A request `use` counted was answered without a 4xx on `slot` (saved, or a 5xx that may have): the claim
        stands."""
        self.tentative.pop(key, None)
        if key not in self.owners:
            self.record(key, slot)

    def release_claim(self, key: str, slot: str, token: str | None = None) -> None:
        """A request `use` counted was refused (a 4xx: nothing saved). When none routed by the claim is left and none
        confirmed it, the name is forgotten: every failed create of a new name had kept its owner for the
        application's life (a name refused by a full replica went back there ever after, and unique names grew the
        directory without bound: cluster hunt, session 48); the count keeps a claim another request is still saving
        under (review, session 48). A count an earlier incarnation of the directory made (`token`) is not this one's:
        ignored."""
        if key not in self.tentative or token != self.incarnation:
            return
        if self.owners.get(key) != slot:  # it moved meanwhile: whoever holds it now settles it
            self.tentative.pop(key)
            return
        self.tentative[key] -= 1
        if self.tentative[key] <= 0:
            self.forget(key)

    def stop_app(self) -> None:
        self.stopping = True

    def app_stopping(self) -> bool:
        return self.stopping

    def forget(self, key: str) -> None:
        self.owners.pop(key, None)
        self.soft.pop(key, None)
        self.tentative.pop(key, None)

    def park_session(self, key: str, slot: str, copy: Any, nbytes: int) -> None:
        """A replica's parked chat session (`sessions.ParkedCopy`), for any replica its next turn lands on."""
        self.forget_session(key)
        self.parked[key] = (slot, copy, nbytes)
        self.parked_bytes += nbytes
        while self.parked_bytes > PARKED_BYTES and self.parked:
            _, (_, _, n) = self.parked.popitem(last=False)
            self.parked_bytes -= n

    def parked_session(self, key: str) -> Any:
        entry = self.parked.get(key)
        if entry is None:
            return None
        self.parked.move_to_end(key)
        return entry[1]

    def forget_session(self, key: str, slot: str | None = None) -> None:
        """Drop a mirrored session (only the copy `slot` published, when given: a stale one elsewhere must not)."""
        entry = self.parked.get(key)
        if entry is not None and slot in (None, entry[0]):
            del self.parked[key]
            self.parked_bytes -= entry[2]

    async def put_ticket(self, ticket: str, data: Any) -> None:
        """A moving stream's ticket, pushed by its source for the destination's call the front opened when the move
        was asked for (`take_ticket`): the ticket goes replica to replica, off the front's path. `data`: a
        one-element list holding the ticket's object-store reference (a list, so that Ray passes the reference on
        rather than the bytes), or a small ticket's bytes (a pre-copied move's stop, its destination's "ready")."""
        now = time.monotonic()
        for k in [k for k, (t, _) in self.tickets.items() if now - t > TICKET_SECONDS]:
            del self.tickets[k]
        fut = self._ticket(ticket)
        if not fut.done():
            fut.set_result(data)

    async def take_ticket(self, ticket: str, wait: float) -> Any:
        """The ticket `put_ticket` brings, waiting up to `wait` seconds for it; None when it did not come (or was
        taken: a ticket is read once)."""
        fut = self._ticket(ticket)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), wait)
        except TimeoutError:
            return None
        finally:
            self.tickets.pop(ticket, None)  # taken, or given up on (a put after that expires unread)

    def _ticket(self, ticket: str) -> asyncio.Future[Any]:
        if ticket not in self.tickets:
            self.tickets[ticket] = (time.monotonic(), asyncio.get_running_loop().create_future())
        return self.tickets[ticket][1]

    def moved_stream(self) -> None:
        self.stream_moves += 1

    def stream_moves_total(self) -> int:
        return self.stream_moves

    def replicas(self) -> dict[str, str]:
        """slot -> replica id, by slot name."""
        return {name: self.slots[name].replica_id for name in sorted(self.slots)}

    def owned(self) -> dict[str, int]:
        """Route keys per slot (for /v1/cluster)."""
        out: dict[str, int] = {}
        for slot in self.owners.values():
            out[slot] = out.get(slot, 0) + 1
        return out


def base_ticket(ticket: str) -> str:
    """Where a pre-copied move's source pushes the pre-copy (`Engine.precopy`) of the ticket it pushes later."""
    return ticket + ".base"


def ready_ticket(ticket: str) -> str:
    """Where the destination says it holds the pre-copy (the source then stops the stream)."""
    return ticket + ".ready"


async def pushed_ticket(directory: Any, ticket: str, wait: float) -> bytes:
    """A moving stream's ticket its source pushed (`put_ticket`: a reference into the object store, which the source
    owns, or a small ticket's bytes), waiting up to `wait` seconds; empty when none came, it was taken already, or
    the source died before it was read (the object went with its owner)."""
    import ray

    try:
        refs = await directory.take_ticket.remote(ticket, wait)
    except ray.exceptions.TaskCancelledError:  # the front cancelled the call waiting for it (the move did not
        raise asyncio.CancelledError() from None  # happen): end as cancelled, not as a server error with a traceback
    if isinstance(refs, bytes):
        return refs
    try:
        data = bytes(await refs[0]) if refs else b""
    except Exception as e:  # ray.exceptions.OwnerDiedError and the like
        log.warning("a moving stream's ticket could not be read: %s: %s", type(e).__name__, e)
        return b""
    return data


async def alive(actor: Any) -> bool:
    """Whether Ray's actor table calls the holder anything but DEAD (one restarting comes back as itself, with its
    replica id, and claims its own slot again). A ping cannot tell: an actor still in its constructor answers late."""
    import ray

    def state() -> str:
        info = ray._private.state.actors(actor_id=actor._actor_id.hex())
        return str(info.get("State", "DEAD")) if info else "DEAD"

    return await asyncio.to_thread(state) != "DEAD"
