"""What a caller holds for a submitted request: events as they come (sync or async) and the final output."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from wkvm.engine.request import Continuation, Request
from wkvm.models.spec import State
from wkvm.outputs import GenerationOutput

if TYPE_CHECKING:
    from wkvm.engine.engine import Engine


@dataclass(frozen=True)
class RunResult:
    """What a finished request leaves behind for the state layer: its token history and the states asked for.

    `final_state` holds all of `history` but its last (pending) token; `prompt_state` all of `prompt_history` but
    its last; `branch_state` (a state inside the prompt, asked for with `capture_at`) all of `branch_history` but its
    last. Each is None when not captured (or when the request did not end at a token boundary)."""

    history: list[int]
    final_state: State | None
    prompt_history: list[int]
    prompt_state: State | None
    branch_history: list[int] = field(default_factory=list)
    branch_state: State | None = None


@dataclass
class Event:
    """What one step produced for one request: new tokens and text, and whether it finished."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    error: str | None = None
    error_code: str | None = None  # an ErrorCode value (wkvm.outputs)
    prompt_logprobs: list[dict[int, float] | None] | None = None  # with a request's first token (or prefill's end)
    stop_reason: int | str | None = None  # with a "stop" finish: the stop token id or stop string (vLLM's)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestHandle:
    """Iterate it (sync or async) for events; `result()` waits for the whole output."""

    def __init__(self, engine: Engine, req: Request, loop: asyncio.AbstractEventLoop | None):
        self.engine = engine
        self.request = req
        self.output = GenerationOutput(
            prompt_token_ids=req.prompt_ids, logprobs=[] if req.params.logprobs is not None else None
        )
        self.done = threading.Event()
        self.continuation: Continuation | None = None  # set when the engine suspended it to go on elsewhere
        self._loop = loop
        self._sync: queue.Queue[Event] = queue.Queue()
        self._async: asyncio.Queue[Event] | None = asyncio.Queue() if loop else None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def _push(self, ev: Event) -> None:
        out = self.output
        out.token_ids.extend(ev.token_ids)
        out.text += ev.text
        if out.logprobs is not None and ev.logprobs:
            out.logprobs.extend(ev.logprobs)
        if ev.prompt_logprobs is not None:
            out.prompt_logprobs = ev.prompt_logprobs
        if ev.finished:
            out.finish_reason, out.error, out.error_code = ev.finish_reason, ev.error, ev.error_code
            out.stop_reason = ev.stop_reason
        if self._loop is not None and self._async is not None:
            self._loop.call_soon_threadsafe(self._async.put_nowait, ev)
        else:
            self._sync.put(ev)
        if ev.finished:
            self.done.set()

    def __iter__(self) -> Iterator[Event]:
        while True:
            ev = self._sync.get()
            yield ev
            if ev.finished:
                return

    async def __aiter__(self) -> AsyncIterator[Event]:
        assert self._async is not None, "submit with loop= to iterate asynchronously"
        while True:
            ev = await self._async.get()
            yield ev
            if ev.finished:
                return

    def result(self, timeout: float | None = None) -> GenerationOutput:
        if not self.done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} did not finish within {timeout}s")
        return self.output

    def run_result(self) -> RunResult:
        req = self.request
        if req.final_ready is not None:  # its keys and values are still being copied out (Engine._keep_final_state)
            req.final_ready.wait()
        branch = req.base_ids + req.prompt_ids[: req.capture_at + 1] if req.capture_at is not None else []
        return RunResult(req.history(), req.final_state, req.base_ids + req.prompt_ids, req.prompt_state, branch,
                         req.branch_state)  # fmt: skip

    def cancel(self) -> None:
        self.engine.cancel(self.request_id)
