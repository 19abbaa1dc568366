"""`AffinityRouter`: Ray Serve's request router for the engine replicas.

The front names the replica a request belongs to (`target`, a replica id from the directory) in the call's
keyword arguments. The router offers that replica first; Serve's own probing then sends the request there unless
its queue is full (`max_ongoing_requests`), in which case the next rank, every other replica, is probed and the
least loaded one that accepts answers. A `strict` request (a named state: only its owner holds it) that lands
elsewhere is answered "misrouted" by that replica, and the front retries. Without a target every replica is one
rank: the least loaded answers.
"""

from __future__ import annotations

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica


class AffinityRouter(FIFOMixin, RequestRouter):  # type: ignore[misc]  # ray's classes are untyped
    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        kwargs = pending_request.kwargs if pending_request is not None else {}
        target, strict = kwargs.get("target"), bool(kwargs.get("strict"))
        if not target:
            return [candidate_replicas]
        owner = [r for r in candidate_replicas if r.replica_id.unique_id == target]
        rest = [r for r in candidate_replicas if r.replica_id.unique_id != target]
        # A strict request that lands elsewhere (its owner is full, or died and is not yet out of Serve's list) is
        # answered "misrouted" at once and the front asks again: waiting here for an owner that may be dead would
        # hold Serve's routing tasks (and their probes of the dead actor) from every other request.
        del strict
        return [owner, rest] if owner else [rest]
