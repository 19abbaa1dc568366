"""State operations that need the engine: create from a prompt, generate from a handle, snapshot, mutate."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from wkvm.engine.engine import Engine, RequestHandle
from wkvm.engine.handle import RunResult
from wkvm.models.spec import State
from wkvm.sampling_params import SamplingParams
from wkvm.state.index import StateRecord
from wkvm.state.mutations import apply_mutation
from wkvm.state.statefile import resume_inputs, valid_name
from wkvm.state.store import StateStore


@dataclass
class Resumed:
    """A generation started from a stored state; `save()` stores its final state when asked."""

    handle: RequestHandle
    source: StateRecord
    save_as: str | None

    def save(self, service: StateService, owner: str) -> StateRecord | None:
        if self.save_as is None:
            return None
        params = {"completion_tokens": len(self.handle.output.token_ids)}
        return service.save_run(owner, self.save_as, self.handle.run_result(), self.source.handle, params)


class StateService:
    def __init__(self, engine: Engine, store: StateStore):
        self.engine = engine
        self.store = store

    def create(self, owner: str, name: str, prompt_ids: list[int], timeout: float | None = None) -> StateRecord:
        """The state after exactly `prompt_ids` (the last one pending), nothing sampled."""
        valid_name(name)
        if not prompt_ids:
            raise ValueError("a state needs at least one prompt token")
        if len(prompt_ids) == 1:
            state = self.engine.model.spec.zeros(1)
        else:
            h = self.engine.submit(prompt_ids[:-1], SamplingParams(max_tokens=1), capture_state=True, prefill_only=True)
            self._wait(h, timeout)
            state = h.run_result().final_state
            if state is None:
                raise RuntimeError(h.output.error or "state creation did not finish")
        return self.store.put(
            owner, name, state, list(prompt_ids), op="create", op_params={"prompt_tokens": len(prompt_ids)}
        )

    def save_run(
        self, owner: str, name: str, result: RunResult, parent: str | None = None, op_params: dict | None = None,
        op: str = "generate", durable: bool = True,
    ) -> StateRecord | None:  # fmt: skip
        """Store a finished run's final state under `name` (every save of a generation comes here); None when
        there is no final state, or for an internal owner whose state the store chose not to keep."""
        if result.final_state is None:
            return None
        return self.store.put(owner, name, result.final_state, result.history, parent=parent, op=op,
                              op_params=op_params or {}, durable=durable)  # fmt: skip

    def save_checkpoint(self, owner: str, name: str, state: State, history: list[int], kind: str) -> StateRecord | None:
        """A prefix-reuse checkpoint (an internal owner): write-back, best effort; None when the store has no room."""
        return self.store.put(owner, name, state, history, op="checkpoint", op_params={"kind": kind}, durable=False)

    def start(
        self, owner: str, handle: str, suffix_ids: list[int], params: SamplingParams,
        save_as: str | None = None, loop: asyncio.AbstractEventLoop | None = None,
    ) -> Resumed:  # fmt: skip
        """Generate from a stored state: feed the pending token and the suffix, then sample."""
        if save_as is not None:
            valid_name(save_as)
        rec, state = self.store.load(owner, handle)
        prompt, base = resume_inputs(rec.token_ids, suffix_ids)
        h = self.engine.submit(prompt, params, initial_state=state, base_ids=base,
                               capture_state=save_as is not None, loop=loop)  # fmt: skip
        return Resumed(h, rec, save_as)

    def generate(
        self, owner: str, handle: str, suffix_ids: list[int], params: SamplingParams,
        save_as: str | None = None, timeout: float | None = None,
    ) -> tuple[RequestHandle, StateRecord | None]:  # fmt: skip
        run = self.start(owner, handle, suffix_ids, params, save_as)
        self._wait(run.handle, timeout)
        return run.handle, run.save(self, owner)

    def snapshot(self, owner: str, request_id: str, name: str, timeout: float | None = None) -> StateRecord:
        """Save a running request's state at the next token boundary; the request keeps going."""
        valid_name(name)
        fut = self.engine.snapshot(request_id)
        if not self.engine.threaded:
            self.engine.step()
        state, history = fut.result(timeout)
        return self.store.put(owner, name, state, history, op="snapshot", op_params={"request_id": request_id})

    def mutate(self, owner: str, handle: str, rule: str, params: dict) -> StateRecord:
        rec, state = self.store.load(owner, handle)
        new = apply_mutation(rule, self.store.spec, state, params, lambda h: self.store.load(owner, h)[1])
        return self.store.put(owner, rec.name, new, rec.token_ids, parent=rec.handle, op="mutate",
                              op_params={"rule": rule, **params})  # fmt: skip

    def _wait(self, h: RequestHandle, timeout: float | None) -> None:
        if not self.engine.threaded:
            while not h.done.is_set():
                self.engine.step()
        h.result(timeout)
