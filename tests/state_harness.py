"""A state service with an inline engine for tests: creates and generates from states with the same calls the
HTTP routes make (prefill through `submit_prefill`, resume through `StateService.resume`, saves through
`StateService.save_*`), stepping the engine in this thread."""

from __future__ import annotations

from wkvm.engine.client import prefilled_state, submit_prefill
from wkvm.engine.engine import Engine, RequestHandle
from wkvm.sampling_params import SamplingParams
from wkvm.state.index import StateRecord
from wkvm.state.service import StateService
from wkvm.state.store import StateStore


class Harness:
    def __init__(self, engine: Engine, store: StateStore):
        self.engine, self.store, self.service = engine, store, StateService(store)

    def create(self, owner: str, name: str, prompt_ids: list[int]) -> StateRecord:
        if len(prompt_ids) > 1:
            h = submit_prefill(self.engine, prompt_ids[:-1])
            self.engine.run_until_done()
            state = prefilled_state(h)
        else:
            state = self.store.spec.zeros(1)
        return self.service.save_created(owner, name, prompt_ids, state)

    def generate(self, owner: str, handle: str, suffix: list[int], params: SamplingParams,
                 save_as: str | None = None) -> tuple[RequestHandle, StateRecord | None]:  # fmt: skip
        r = self.service.resume(owner, handle, suffix)
        h = self.engine.submit(r.feed_ids, params, initial_state=r.state, base_ids=r.base_ids,
                               capture_state=save_as is not None)  # fmt: skip
        self.engine.run_until_done()
        h.result()
        if save_as is None:
            return h, None
        return h, self.service.save_run(owner, save_as, h.run_result(), r.parent,
                                        {"completion_tokens": len(h.output.token_ids)})  # fmt: skip

    def snapshot(self, owner: str, request_id: str, name: str) -> StateRecord:
        fut = self.engine.snapshot(request_id)
        self.engine.step()
        state, history = fut.result(0)
        return self.service.save_snapshot(owner, name, state, history, request_id)

    def mutate(self, owner: str, handle: str, rule: str, params: dict) -> StateRecord:
        return self.service.mutate(owner, handle, rule, params)
