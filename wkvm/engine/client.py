"""EngineClient: everything the HTTP layer asks of an engine. `LocalEngineClient` runs today's in-process engine;
a remote one (replicas behind a router) implements the same contract.

Generation with n > 1 choices and state creation share one prefill: the prompt but its last token is fed once
(`submit_prefill` -> `prefilled_state`), and each choice starts from that state with the last token pending; choices
that score their prompt (`prompt_logprobs`) are each fed the whole prompt instead.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from dataclasses import dataclass
from typing import Protocol

from wkvm.engine.engine import Engine, EngineStats
from wkvm.engine.handle import RequestHandle
from wkvm.engine.request import Continuation
from wkvm.models.spec import State, StateSpec
from wkvm.outputs import ErrorCode
from wkvm.sampling_params import SamplingParams


class PrefillFailed(RuntimeError):
    """A shared prefill ended without a state: `error_code` says why (aborted, timeout, engine error)."""

    def __init__(self, message: str, error_code: str | None):
        super().__init__(message)
        self.error_code = error_code


@dataclass(frozen=True)
class ModelInfo:
    """What callers of an engine may know about its model (no tensors, no weights)."""

    family: str
    fingerprint: str
    vocab_size: int
    spec: StateSpec
    chunks_equal_steps: bool = False  # LanguageModel's: a moved stream's catch-up gives the bits of stepping
    context_limit: int | None = None  # tokens one sequence may hold (attention layers); None: no window


class EngineClient(Protocol):
    model: ModelInfo

    async def generate(
        self, prompt_ids: list[int], params: list[SamplingParams], base_state: State | None = None,
        base_ids: list[int] | None = None, capture: bool = False, capture_prompt: bool = False,
        capture_at: int | None = None,
    ) -> list[RequestHandle]:  # fmt: skip
        """Start len(params) generations of one prompt (all or none); n > 1 prefills once and forks n ways (with
        `prompt_logprobs` each choice is fed the whole prompt instead). `capture` keeps the final state,
        `capture_prompt` the state after all of the prompt but its last token, `capture_at` (n = 1 only) the state
        after that many prompt tokens: a branch point worth checkpointing."""
        ...

    async def prefill(self, prompt_ids: list[int], base_state: State | None = None,
                      base_ids: list[int] | None = None) -> State:  # fmt: skip
        """The state after feeding `prompt_ids` (from `base_state`); raises PrefillFailed."""
        ...

    def snapshot(self, request_id: str) -> concurrent.futures.Future[tuple[State, list[int]]]:
        """A running request's state and history at its next token boundary, without stopping it."""
        ...

    def suspend(self, request_id: str) -> concurrent.futures.Future[Continuation]:
        """Stop a running request at its next token boundary so that it goes on elsewhere (`resume`)."""
        ...

    def precopy(self, request_id: str) -> concurrent.futures.Future[Continuation]:
        """What `suspend` would give at the next token boundary, while the request goes on (a move's pre-copy)."""
        ...

    async def resume(self, c: Continuation, params: SamplingParams) -> RequestHandle:
        """Go on with a request suspended in another engine on the same model."""
        ...

    def queue_room(self) -> int: ...

    def grammar_problem(self, grammar: str) -> str | None:
        """Why a reply's grammar cannot start with this model's vocabulary (GrammarCompiler.problem), or None."""
        ...

    def stats(self) -> EngineStats: ...

    def loop_failed(self) -> bool: ...

    def stop_accepting(self) -> None: ...

    def abort_all(self, reason: str) -> None: ...

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None: ...


def submit_prefill(engine: Engine, prompt_ids: list[int], base_state: State | None = None,
                   base_ids: list[int] | None = None, loop: asyncio.AbstractEventLoop | None = None) -> RequestHandle:
    """Feed `prompt_ids` and stop: the request's final state is the state after them."""
    return engine.submit(prompt_ids, SamplingParams(max_tokens=1), initial_state=base_state, base_ids=base_ids,
                         capture_state=True, prefill_only=True, loop=loop)  # fmt: skip


def prefilled_state(h: RequestHandle) -> State:
    state = h.run_result().final_state
    if state is None or h.output.error_code is not None:  # cancelled or timed out: not every token is in
        raise PrefillFailed(h.output.error or "the prefill was aborted", h.output.error_code)
    return state


class LocalEngineClient:
    """The engine in this process (its step loop on its own thread)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        m = engine.model
        self.model = ModelInfo(m.family, m.fingerprint, m.vocab_size, m.spec, m.chunks_equal_steps,
                               engine.runner.context_limit)

    async def prefill(self, prompt_ids: list[int], base_state: State | None = None,
                      base_ids: list[int] | None = None) -> State:  # fmt: skip
        h = submit_prefill(self.engine, prompt_ids, base_state, base_ids, asyncio.get_running_loop())
        try:
            async for _ in h:
                pass
        finally:
            h.cancel()  # a no-op once it finished; frees the slot if the caller was abandoned meanwhile
        return await asyncio.to_thread(prefilled_state, h)  # it may wait for its keys and values' copy

    async def generate(
        self, prompt_ids: list[int], params: list[SamplingParams], base_state: State | None = None,
        base_ids: list[int] | None = None, capture: bool = False, capture_prompt: bool = False,
        capture_at: int | None = None,
    ) -> list[RequestHandle]:  # fmt: skip
        loop = asyncio.get_running_loop()
        base_ids = list(base_ids or [])
        if len(params) == 1:
            return [self.engine.submit(prompt_ids, params[0], initial_state=base_state, base_ids=base_ids,
                                       capture_state=capture, capture_prompt_state=capture_prompt,
                                       capture_at=capture_at, loop=loop)]  # fmt: skip
        # before the shared prefill, not after it
        self.engine.check_context(len(base_ids) + len(prompt_ids), any(p.max_tokens != 0 for p in params))
        state, feed, prompt_state = base_state, prompt_ids, None
        shared = params[0].prompt_logprobs is None  # a choice scoring its prompt is fed all of it itself
        # the choices keep the request's deadline (--request-timeout from now), not one of their own after the prefill
        limit, start = self.engine.config.request_timeout, time.monotonic()
        if shared and len(prompt_ids) > 1:
            try:
                state = await self.prefill(prompt_ids[:-1], base_state, base_ids)
            except PrefillFailed as e:
                if e.error_code != ErrorCode.TIMEOUT:
                    raise
                # timed out: the choices, no time left, end at once as a timed-out n = 1 request does ("abort",
                # nothing generated), not as a 503 for n > 1 only
                shared = False
            else:
                base_ids, feed = base_ids + prompt_ids[:-1], prompt_ids[-1:]
        if shared and capture_prompt:  # the shared prefill is the prompt-end state: each choice reports it, to be
            prompt_state = state  # checkpointed as for n = 1
        left = None if limit is None else max(limit - (time.monotonic() - start), 1e-6)  # 0 would mean no limit
        return self.engine.submit_all(feed, params, initial_state=state, base_ids=base_ids, capture_state=capture,
                                      capture_prompt_state=capture_prompt and not shared, prompt_state=prompt_state,
                                      timeout=left, loop=loop)  # fmt: skip

    def snapshot(self, request_id: str) -> concurrent.futures.Future[tuple[State, list[int]]]:
        return self.engine.snapshot(request_id)

    def suspend(self, request_id: str) -> concurrent.futures.Future[Continuation]:
        return self.engine.suspend(request_id)

    def precopy(self, request_id: str) -> concurrent.futures.Future[Continuation]:
        return self.engine.precopy(request_id)

    async def resume(self, c: Continuation, params: SamplingParams) -> RequestHandle:
        return self.engine.resume_continuation(c, params, loop=asyncio.get_running_loop())

    def queue_room(self) -> int:
        return self.engine.queue_room()

    def grammar_problem(self, grammar: str) -> str | None:
        grammars = self.engine.runner.grammars
        return grammars.problem(grammar) if grammars is not None else None

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def loop_failed(self) -> bool:
        return self.engine.loop_failed

    def stop_accepting(self) -> None:
        self.engine.stop_accepting()

    def abort_all(self, reason: str) -> None:
        self.engine.abort_all(reason)

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        self.engine.shutdown(drain, timeout)
