"""State operations on top of the store: save a run, a created state or a checkpoint; resume from a handle; mutate.

Every save of a state goes through here. The engine work behind them (prefilling a prompt, generating from a
resumed state) is the server's, through its EngineClient; this layer never calls the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from wkvm.engine.handle import RunResult
from wkvm.models.spec import State
from wkvm.state.index import StateRecord
from wkvm.state.mutations import MutationError, apply_mutation
from wkvm.state.statefile import check_magnitude, resume_inputs, valid_handle, valid_name
from wkvm.state.store import StateNotFound, StateStore

FITS_KEPT = 65_536  # blobs remembered as fitting float16 pages (~100 bytes each)


@dataclass
class Resume:
    """How to continue from a stored state: feed `feed_ids` starting from `state`, which holds `base_ids`."""

    feed_ids: list[int]
    state: State
    base_ids: list[int] = field(default_factory=list)
    parent: str = ""  # the handle resumed from


class StateService:
    def __init__(self, store: StateStore, page_max: float | None = None):
        """`page_max`: the largest key or value the engine's pages hold (float16's 65,504; None: float32 pages)."""
        self.store, self.page_max = store, page_max
        self._fits: set[str] = set()  # blobs (immutable) whose keys and values the pages hold: checked once

    def check_pages(self, state: State, blob: str) -> None:
        """A state whose keys or values the pages cannot hold (a StateFileError, the request's 400): it would become
        inf there and the answer garbage, silently. An import checks its file so; a state stored another way (by a
        server with float32 pages, or `wkvm states import --state-dir`, which cannot know the pages) is checked
        here, when a request first takes it."""
        if self.page_max is not None and blob not in self._fits:
            check_magnitude(self.store.spec, state, self.page_max, paged_only=True,
                            why="this server keeps keys and values in float16 pages (--kv-dtype float32 holds it)")
            if len(self._fits) >= FITS_KEPT:  # bounded: a forgotten blob is only checked again
                self._fits.clear()
            self._fits.add(blob)

    def save_created(self, owner: str, name: str, prompt_ids: list[int], state: State) -> StateRecord:
        """The state after exactly `prompt_ids` (the last one pending: `state` holds all but it)."""
        valid_name(name)
        if not prompt_ids:
            raise ValueError("a state needs at least one prompt token")
        return self.store.put_user(owner, name, state, list(prompt_ids), op="create",
                                   op_params={"prompt_tokens": len(prompt_ids)})  # fmt: skip

    def resume(self, owner: str, handle: str, new_ids: list[int]) -> Resume:
        """Continue stored state `handle` with `new_ids`: its pending token comes first. A handle whose name no state
        can have is a ValueError (the request's 400), not "not found"."""
        rec, state = self.store.load(owner, valid_handle(handle))
        self.check_pages(state, rec.blob)
        feed, base = resume_inputs(self.store.token_ids(rec), new_ids)
        return Resume(feed, state, base, rec.handle)

    def save_run(
        self, owner: str, name: str, result: RunResult, parent: str | None = None,
        op_params: dict[str, Any] | None = None, op: str = "generate", durable: bool = True,
    ) -> StateRecord | None:  # fmt: skip
        """Store a finished run's final state under `name` (every save of a generation comes here); None when
        there is no final state, or for an internal owner whose state the store chose not to keep."""
        if result.final_state is None:
            return None
        return self.store.put(owner, name, result.final_state, result.history, parent=parent, op=op,
                              op_params=op_params or {}, durable=durable, frozen=True)  # fmt: skip

    def save_checkpoint(self, owner: str, name: str, state: State, history: list[int], kind: str,
                        compute: str) -> StateRecord | None:  # fmt: skip
        """A prefix-reuse checkpoint (an internal owner): write-back, best effort; None when the store has no room.
        `state` is a finished request's own copy, or one cut from it, which nothing changes afterwards. `compute`: how
        the server that made it computes (ChatSessions.compute), kept with it."""
        params = {"kind": kind, "compute": compute}
        return self.store.put(owner, name, state, history, op="checkpoint", op_params=params, durable=False,
                              frozen=True)  # fmt: skip

    def save_snapshot(self, owner: str, name: str, state: State, history: list[int], request_id: str) -> StateRecord:
        """A running request's state taken at a token boundary (EngineClient.snapshot)."""
        valid_name(name)
        return self.store.put_user(owner, name, state, history, op="snapshot", op_params={"request_id": request_id})

    def mutate(self, owner: str, handle: str, rule: str, params: dict[str, Any]) -> StateRecord:
        rec, state = self.store.load(owner, handle)
        recorded = {"rule": rule, **params}

        def other(h: str) -> State:  # recorded as the version used: a bare name later means a newer one
            used, other_state = self._other(owner, h)
            recorded["other"] = used.handle
            return other_state

        new = apply_mutation(rule, self.store.spec, state, params, other)
        return self.store.put_user(owner, rec.name, new, self.store.token_ids(rec), parent=rec.handle, op="mutate",
                                   op_params=recorded)  # fmt: skip

    def _other(self, owner: str, handle: str) -> tuple[StateRecord, State]:
        """A state a mutation's params name (interpolate's other): a 404 or an invalid handle's 400 names params.other,
        not the URL's handle."""
        try:
            valid_handle(handle)
        except ValueError as e:
            raise MutationError(str(e), "params.other") from None
        try:
            return self.store.load(owner, handle)
        except StateNotFound as e:
            e.param = "params.other"
            raise
