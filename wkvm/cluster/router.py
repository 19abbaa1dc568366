"""`AffinityRouter`: Ray Serve's request router for the engine replicas.

The front names the replica a request belongs to (`target`, a replica id from the directory) in the call's
keyword arguments. The router offers that replica first; Serve's own probing then sends the request there unless
its queue is full (`max_ongoing_requests`), in which case the next rank, every other replica, is probed and the
least loaded one that accepts answers. A `strict` request (a named state: only its owner holds it) that lands
elsewhere is answered "misrouted" by that replica, and the front retries. Without a target every replica is one
rank: the least loaded answers.

Serve takes the first of equally loaded replicas in the order given, so every rank is shuffled (as Serve's own
power-of-two router draws its pair at random): in a fixed order a burst of new requests, routed concurrently while
every replica looked idle, all went to the first replica (7 streams at once: all on r0, 3 of them queued there,
while r1 idled). A request bound to nothing comes with the front's own least busy replica as its target (it counts
what it relays), so a burst spreads evenly; Serve's probing still decides when that one is full.
"""

from __future__ import annotations

import random

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica


class AffinityRouter(FIFOMixin, RequestRouter):  # type: ignore[misc]  # ray's classes are untyped
    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        kwargs = pending_request.kwargs if pending_request is not None else {}
        target, strict = kwargs.get("target"), bool(kwargs.get("strict"))
        shuffled = random.sample(candidate_replicas, len(candidate_replicas))
        if not target:
            return [shuffled]
        owner = [r for r in shuffled if r.replica_id.unique_id == target]
        rest = [r for r in shuffled if r.replica_id.unique_id != target]
        # A strict request that lands elsewhere (its owner is full, or died and is not yet out of Serve's list) is
        # answered "misrouted" at once and the front asks again: waiting here for an owner that may be dead would
        # hold Serve's routing tasks (and their probes of the dead actor) from every other request.
        del strict
        return [owner, rest] if owner else [rest]
