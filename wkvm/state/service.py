"""State operations that need the engine: create from a prompt, generate from a handle, snapshot, mutate."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from wkvm.engine.engine import Engine, RequestHandle
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
        req = self.handle.request
        if self.save_as is None or req.final_state is None:
            return None
        params = {"prompt_tokens": len(req.prompt_ids) - 1, "completion_tokens": len(req.output_ids)}
        return service.store.put(owner, self.save_as, req.final_state, req.history(), parent=self.source.handle,
                                 op="generate", op_params=params)  # fmt: skip


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
            if h.request.final_state is None:
                raise RuntimeError(h.output.error or "state creation did not finish")
            state = h.request.final_state
        return self.store.put(
            owner, name, state, list(prompt_ids), op="create", op_params={"prompt_tokens": len(prompt_ids)}
        )

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
