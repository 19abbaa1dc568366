"""The engine: a step loop (schedule -> runner.run -> postprocess) on its own thread or inline; it holds no tensor."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from wkvm.config import EngineConfig
from wkvm.engine.arena import SlotArena
from wkvm.engine.detokenizer import CONTEXT_TOKENS, Detokenizer
from wkvm.engine.drafts import NgramDrafter
from wkvm.engine.handle import Event, RequestHandle
from wkvm.engine.kv_pages import OutOfPages
from wkvm.engine.request import Continuation, Request, Status
from wkvm.engine.runner import ModelRunner, StepOutput
from wkvm.engine.scheduler import QueueFull, Scheduler
from wkvm.engine.threads import keep_thread_count
from wkvm.models.family import LanguageModel
from wkvm.models.spec import State
from wkvm.outputs import ErrorCode
from wkvm.sampling_params import SamplingParams
from wkvm.tokenizer import Tokenizer

T = TypeVar("T")

log = logging.getLogger("wkvm.engine")


def settle(fut: concurrent.futures.Future[T], result: T | None = None, error: BaseException | None = None) -> None:
    """Resolve a caller's future (a move, a pre-copy, a snapshot) unless the caller gave up on it first: a move whose
    call timed out cancels its future, and resolving a cancelled one raises, which must not stop the engine."""
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)  # type: ignore[arg-type]
    except concurrent.futures.InvalidStateError:
        pass


__all__ = ["Engine", "EngineClosed", "EngineStats", "Event", "QueueFull", "RequestHandle"]
SHUTDOWN_MESSAGE = "the engine shut down before this request finished"
MIGRATED_MESSAGE = "moved to another engine, where it goes on"


class EngineClosed(RuntimeError):
    pass


class ContextTooLong(ValueError):
    """A request whose earlier tokens and prompt leave no room to generate within the model's context limit."""


@dataclass(frozen=True)
class EngineStats:
    waiting: int
    running: int
    slots_free: int
    slots_total: int
    weight_stream: object | None  # the streaming weight provider's counters (StreamStats), None when resident
    kv_pages_used: int = 0  # attention models: pages of the key/value pool held by sequences (0 / 0 without one)
    kv_pages_total: int = 0
    speculates: bool = False  # speculative decoding is on: draft tokens checked so far, and accepted
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)


class Engine:
    def __init__(self, model: LanguageModel, tokenizer: Tokenizer, config: EngineConfig | None = None):
        self.tokenizer = tokenizer
        self.config = config or EngineConfig()
        self.runner = ModelRunner(model, self.config, tokenizer)
        self.scheduler = Scheduler(self.config, self.runner.arena)  # slot bookkeeping; parks states through it
        self.speculates = self._speculates()
        if self.speculates:
            self.scheduler.draft = self._draft
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._handles: dict[str, RequestHandle] = {}
        self._detok: dict[str, Detokenizer] = {}
        self._ids = itertools.count()
        self._snapshots: list[tuple[str, concurrent.futures.Future[tuple[State, list[int]]]]] = []
        self._suspends: list[tuple[str, concurrent.futures.Future[Continuation], bool]] = []  # (id, future, stop)
        self._thread: threading.Thread | None = None
        self._loop_ready = threading.Event()  # the step loop's thread has taken its torch thread count
        # one thread, and torch on one thread in it: a second thread's parallel regions (OpenMP) had made every later
        # decode step 3x slower (21 vs 7 ms for SmolLM2 at batch 1). Its own count only: torch.set_num_threads would
        # also set the process's, which every new thread of the caller's program then takes
        self._copier = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="wkvm-final-state",
                                                             initializer=keep_thread_count, initargs=(1,))
        self._threads = torch.get_num_threads()  # the step loop's thread takes its creator's count
        self._copies: list[concurrent.futures.Future[None]] = []  # pending, each holding a finished request's pages
        self.arena.reclaim = self._wait_for_copies
        self._accepting = True
        self._stopping = False
        self._drain = True
        self.steps = 0

    @property
    def model(self) -> LanguageModel:
        return self.runner.model

    def _speculates(self) -> bool:
        """--speculative-tokens, where this model checks a draft with stepping's bits (else answers could move, so
        it does not speculate: logged)."""
        k = self.config.speculative_tokens
        if k == 0:
            return False
        checks = getattr(self.model, "checks_drafts", None)
        if checks is None or not checks(k + 1):
            log.warning("speculative decoding is off: this model's weights (dtype and kernels on this CPU) do not give "
                        "a chunk of %d tokens the bits of stepping, so a checked draft could change answers (int8 "
                        "and int4 weights do; docs/speculative.md)", k + 1)  # fmt: skip
            return False
        return True

    def _draft(self, req: Request, room: int) -> list[int]:
        """Up to `room` draft tokens for a decoding request (prompt lookup), cut before an end of sequence or stop
        token (the sample there ends the reply: no token after it is worth checking) and to what max_tokens and the
        context leave."""
        p = req.params
        limit = self.runner.context_limit
        room = min(room, self.config.speculative_tokens, req.draft_room or room, p.max_tokens - len(req.output_ids) - 1)
        if limit is not None:
            room = min(room, limit - len(req.base_ids) - req.num_tokens)
        if room < 1 or req.prefill_only or len(self.scheduler.running) > self.config.speculative_max_running:
            return []
        if req.drafter is None:
            req.drafter = NgramDrafter(self.config.prompt_lookup_min, self.config.prompt_lookup_max)
        d = req.drafter
        d.extend(req.history_from(len(d.tokens)))
        draft = d.propose(room)
        ends = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.tokenizer.eos_token_ids))
        for i, t in enumerate(draft):
            if t in ends:
                return draft[:i]
        return draft

    @property
    def arena(self) -> SlotArena:
        return self.runner.arena

    def stats(self) -> EngineStats:
        """What the server reports (metrics, shutdown): read under the lock, no internals handed out."""
        with self._lock:
            sched, pool = self.scheduler, self.arena.pool
            total = pool.n_pages if pool is not None else 0
            return EngineStats(len(sched.waiting), len(sched.running), self.arena.num_free, self.arena.n_slots,
                               getattr(self.model.weights, "stats", None), total - (pool.num_free if pool else 0),
                               total, self.speculates, self.runner.drafted, self.runner.accepted)  # fmt: skip

    # --- submission ----------------------------------------------------------------------------
    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        timeout: float | None = None,
        initial_state: State | None = None,
        base_ids: list[int] | None = None,
        capture_state: bool = False,
        prefill_only: bool = False,
        capture_prompt_state: bool = False,
        prompt_state: State | None = None,
        capture_at: int | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
        resume: Continuation | None = None,
        hold: list[tuple[RequestHandle, Detokenizer]] | None = None,
    ) -> RequestHandle:
        """Queue a request. `resume` continues one suspended in another engine (`suspend`): `prompt_ids`,
        `base_ids`, `initial_state` and the capture arguments must be its own (`resume_continuation` passes them).
        `hold`: built, not queued, and appended there (`submit_all` queues them together)."""
        if not prompt_ids:
            raise ValueError("a request needs at least one prompt token")
        params.check_vocabulary(self.model.vocab_size)
        self.check_context(len(base_ids or []) + len(prompt_ids), params.max_tokens != 0)
        timeout = timeout if timeout is not None else self.config.request_timeout
        now = time.monotonic()
        req = Request(
            request_id=request_id or f"req-{next(self._ids)}", prompt_ids=list(prompt_ids), params=params,
            arrival=now, priority=priority, deadline=now + timeout if timeout else None,
            initial_state=initial_state, base_ids=list(base_ids or []), capture_state=capture_state,
            prefill_only=prefill_only or params.max_tokens == 0, capture_prompt_state=capture_prompt_state,
            prompt_state=prompt_state,
            capture_at=capture_at if capture_at is not None and 0 < capture_at < len(prompt_ids) else None,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
        )  # fmt: skip
        detok = Detokenizer(self.tokenizer, params.stop, params.min_tokens, params.include_stop_str_in_output,
                            self.tokenizer.special_ids if params.skip_special_tokens else frozenset(),
                            context=(req.base_ids + req.prompt_ids)[-CONTEXT_TOKENS:])  # fmt: skip
        if resume is not None:
            req.output_ids, req.num_computed_tokens = list(resume.output_ids), resume.num_computed_tokens
            req.branch_state = resume.branch_state
            req.check_invariant()
            detok.replay(req.output_ids, resume.text)
        handle = RequestHandle(self, req, loop)
        if resume is not None:
            handle.output.token_ids, handle.output.text = list(req.output_ids), resume.text
        if hold is not None:
            hold.append((handle, detok))
            return handle
        with self._lock:
            self._queue(handle, detok, resume)
        return handle

    def _queue(self, handle: RequestHandle, detok: Detokenizer, resume: Continuation | None = None) -> None:
        """Put a built request in the scheduler's queue (under the lock)."""
        req = handle.request
        if not self._accepting:
            raise EngineClosed("the engine is shutting down and accepts no new requests")
        if req.request_id in self._handles:
            raise ValueError(f"request id {req.request_id!r} is already in flight")
        self.runner.add(req)  # first: it refuses a grammar that does not compile for this tokenizer
        try:
            if resume is not None:
                self.runner.resume(req, resume.generator)
            self.scheduler.add(req)
        except (QueueFull, ValueError):
            self.runner.release(req.request_id)
            raise
        self._handles[req.request_id] = handle
        self._detok[req.request_id] = detok
        self._wake.notify()

    def submit_all(self, prompt_ids: list[int], params: list[SamplingParams], **kwargs: Any) -> list[RequestHandle]:
        """One request per `params` (`submit`'s other arguments shared), queued together or not at all: the
        scheduler sees every one at once. An n > 1 request's choices start from one state and share its pages while
        more of them wait; queued one by one, a choice admitted before the next was queued let the pages go and the
        next wrote its own copy of the prompt's keys and values (a peak of twice the prompt, under load)."""
        if "resume" in kwargs:
            raise TypeError("submit_all starts new requests; a suspended one resumes through submit")
        built: list[tuple[RequestHandle, Detokenizer]] = []
        for p in params:
            self.submit(prompt_ids, p, hold=built, **kwargs)
        queued: list[RequestHandle] = []
        with self._lock:
            try:
                for handle, detok in built:
                    self._queue(handle, detok)
                    queued.append(handle)
            except BaseException:
                for handle in queued:  # all or none: those queued are aborted at the next step
                    handle.request.cancel_requested = True
                raise
        return [handle for handle, _ in built]

    def queue_room(self) -> int:
        """How many more requests submit() would accept right now: 0 once the engine stops accepting."""
        with self._lock:
            return self.scheduler.queue_room if self._accepting else 0

    def stop_accepting(self) -> None:
        """From now on submit() raises EngineClosed; running and waiting requests carry on."""
        with self._lock:
            self._accepting = False

    def cancel(self, request_id: str) -> None:
        """Abort a request; its slot is freed at the start of the next step."""
        with self._lock:
            handle = self._handles.get(request_id)
            if handle is not None:
                handle.request.cancel_requested = True
                self._wake.notify()

    def snapshot(self, request_id: str) -> concurrent.futures.Future[tuple[State, list[int]]]:
        """At the next token boundary, copy a request's state without stopping it.

        The future yields (state [1, ...] on the host, token history whose last token is pending).
        """
        fut: concurrent.futures.Future[tuple[State, list[int]]] = concurrent.futures.Future()
        with self._lock:
            if request_id not in self._handles:
                raise KeyError(f"no request {request_id!r} in flight")
            self._snapshots.append((request_id, fut))
            self._wake.notify()
        return fut

    def resume_continuation(self, c: Continuation, params: SamplingParams, request_id: str | None = None,
                            timeout: float | None = None, loop: asyncio.AbstractEventLoop | None = None,
                            ) -> RequestHandle:  # fmt: skip
        """Go on with a request `suspend` stopped in another engine (same model): it samples, stops and reports as
        it would have there."""
        return self.submit(c.prompt_ids, params, request_id, timeout=timeout, initial_state=c.state,
                           base_ids=c.base_ids, capture_state=c.capture_state,
                           capture_prompt_state=c.capture_prompt_state, prompt_state=c.prompt_state,
                           capture_at=c.capture_at, loop=loop, resume=c)  # fmt: skip

    def suspend(self, request_id: str, stop: bool = True) -> concurrent.futures.Future[Continuation]:
        """At the next token boundary, stop a request so that it can go on in another engine (live migration);
        with `stop` False only copy what it would leave (`precopy`).

        The future yields its `Continuation`; the request ends with finish_reason "abort" and error_code "migrated",
        and its handle's `continuation` is set before that final event. Refused (ValueError): requests that only
        prefill (nothing to go on with), and requests scoring their prompt before their first token (their prompt
        logprobs are complete only then; after it the destination has nothing left to score).
        """
        fut: concurrent.futures.Future[Continuation] = concurrent.futures.Future()
        with self._lock:
            handle = self._handles.get(request_id)
            if handle is None:
                raise KeyError(f"no request {request_id!r} in flight")
            req = handle.request
            if req.prefill_only:
                raise ValueError("a request that only prefills its prompt cannot move")
            if req.prompt_logprobs is not None and not req.output_ids:
                raise ValueError("a request scoring its prompt moves only once its first token is out")
            self._suspends.append((request_id, fut, stop))
            self._wake.notify()
        return fut

    def precopy(self, request_id: str) -> concurrent.futures.Future[Continuation]:
        """At the next token boundary, the `Continuation` the request would leave if it stopped there, while it goes
        on (a move's pre-copy: the destination receives this state while the source keeps generating, and the later
        stop's `Continuation` only adds the tokens since, which the destination feeds in one chunk)."""
        return self.suspend(request_id, stop=False)

    def _take_suspends(self) -> tuple[list[Event], list[tuple[concurrent.futures.Future[Continuation], Continuation]]]:
        """Stop the requests asked to move (and copy those asked for a pre-copy, which go on): their final events, and
        their futures with what to resolve them with (resolved by the caller once it has let go of the lock: a
        future's callback may take its time, e.g. encode and send the request's state, and it runs before this step's
        model run and events, so a move does not wait on them)."""
        events, stopped = [], []
        for rid, fut, stop in self._suspends:
            if fut.cancelled():  # the mover gave up (its call timed out): the request goes on here
                continue
            handle = self._handles.get(rid)
            if handle is None or handle.request.status.finished:
                settle(fut, error=KeyError(f"request {rid!r} finished before it could move"))
                continue
            req = handle.request
            c = Continuation(
                list(req.prompt_ids), list(req.base_ids), list(req.output_ids), req.num_computed_tokens,
                self.runner.request_state(req), self.runner.generator_state(rid), self._detok[rid].released,
                req.capture_state, req.capture_prompt_state, req.prompt_state, req.capture_at, req.branch_state,
            )  # fmt: skip
            if not stop:
                stopped.append((fut, c))
                continue
            self._finish(req, Status.FINISHED_ABORTED, MIGRATED_MESSAGE, ErrorCode.MIGRATED)
            handle.continuation = c
            stopped.append((fut, c))
            events.append(Event(rid, [], "", None, Status.FINISHED_ABORTED.value, MIGRATED_MESSAGE, ErrorCode.MIGRATED))
        self._suspends.clear()
        return events, stopped

    def _take_snapshots(self) -> None:
        for rid, fut in self._snapshots:
            handle = self._handles.get(rid)
            if handle is None or handle.request.status.finished:
                settle(fut, error=KeyError(f"request {rid!r} finished before its snapshot"))
                continue
            settle(fut, (self.runner.request_state(handle.request), handle.request.snapshot_history()))
        self._snapshots.clear()

    # --- the step ------------------------------------------------------------------------------
    def step(self) -> list[Event]:
        """One engine step: schedule, run the model (and sample), postprocess."""
        with self._lock:
            self._take_snapshots()
            events, stopped = self._take_suspends()
            events += self._reap()
            batch = self.scheduler.schedule()
        for fut, c in stopped:
            settle(fut, c)
        self._dispatch(events)  # requests that ended before this step's run (moved, cancelled, timed out) need not wait
        if not batch.work:
            return events
        out = self.runner.run(batch.work)
        with self._lock:
            done = self._postprocess(out)
        self.steps += 1
        self._dispatch(done)
        return events + done

    def _postprocess(self, out: StepOutput) -> list[Event]:
        events = []
        for req, s in out.caught_up:  # a request that checked a draft comes once per token it sampled, in order
            if req.status.finished:  # aborted from another thread while the model ran, or stopped at a token before
                continue
            if s.error:
                events.append(self._fail_one(req, s.error, s.error_code))
            elif req.prefill_only:
                events.append(self._end_prefill(req))
            else:
                assert s.token is not None  # a row without an error sampled a token
                events.append(self._append(req, s.token, s.logprobs, s.grammar_done))
        for req, _ in out.caught_up:
            req.speculated = req.before_draft = None  # its draft's tokens are now all known, or it has finished
        return events

    def _append(self, req: Request, tok: int, lp: dict[int, float] | None, grammar_done: bool = False) -> Event:
        """Add one sampled token; finish the request on a stop (or a completed response_format) or at max_tokens."""
        p, detok = req.params, self._detok[req.request_id]
        req.output_ids.append(tok)
        status = None
        reason: int | str | None = None  # vLLM's stop_reason: a stop token id or the stop string
        eos = tok in self.tokenizer.eos_token_ids and not p.ignore_eos
        # a stop token (EOS, stop_token_ids) ends the text without adding its own, unless include_stop_str_in_output
        # asks for it (vLLM's detokenizer does the same: `<|im_end|>` is no part of an answer; until session 27 a
        # stop_token_ids token's text stayed and the flag did nothing for it)
        if eos or tok in p.stop_token_ids:
            if p.include_stop_str_in_output:
                detok.add(tok)
            status = Status.FINISHED_STOPPED
            reason = None if eos else tok
        elif detok.add(tok) or grammar_done:
            status = Status.FINISHED_STOPPED
        elif len(req.output_ids) >= p.max_tokens or self._at_context_limit(req):
            status = Status.FINISHED_LENGTH
        if status is not None:
            detok.flush()  # the text held back may complete a stop string: then it ends as stopped
            status = Status.FINISHED_STOPPED if detok.stopped else status
            reason = detok.matched if detok.stopped else reason
            self._finish(req, status)
        ev = Event(req.request_id, [tok], detok.delta(final=status is not None), [lp] if lp else None)
        ev.finish_reason = status.value if status else None
        ev.stop_reason = reason
        if len(req.output_ids) == 1:
            ev.prompt_logprobs = req.prompt_logprobs
        return ev

    def _at_context_limit(self, req: Request) -> bool:
        """A sequence whose tokens reach the context limit ends with finish_reason "length", as in vLLM."""
        limit = self.runner.context_limit
        return limit is not None and len(req.base_ids) + req.num_tokens >= limit

    def check_context(self, n: int, generates: bool = True) -> None:
        """Raise ContextTooLong where `n` earlier and prompt tokens leave no room to generate one token (`generates`),
        or do not fit at all (a request that only scores its prompt, `max_tokens` 0, may fill the context exactly;
        a state, made by a prefill, keeps room to generate from)."""
        limit = self.runner.context_limit
        if limit is not None and n + generates > limit:
            room = ", with room for at least one generated token" if generates else ""
            raise ContextTooLong(
                f"the request's context is {n} tokens and this model holds at most {limit} ({self._limit_reason()})"
                f"{room}: shorten the prompt or the conversation"
            )

    def _limit_reason(self) -> str:
        trained = self.model.context_length
        if trained is not None and trained == self.runner.context_limit:
            return "its trained context"
        return "the KV cache's pages: raise --kv-cache-bytes"

    def _end_prefill(self, req: Request) -> Event:
        """A prefill-only request is done once its prompt is in (the runner fails one whose logits are non-finite)."""
        self._finish(req, Status.FINISHED_LENGTH)
        return Event(req.request_id, [], "", None, Status.FINISHED_LENGTH.value, prompt_logprobs=req.prompt_logprobs)

    def _fail_one(self, req: Request, message: str, code: str = ErrorCode.NON_FINITE) -> Event:
        """This request's numbers went out of range, or its grammar left no token: it alone fails, and its slot is
        freed (zeroed on reuse)."""
        self._finish(req, Status.FINISHED_ERROR, message, code)
        return Event(req.request_id, [], "", None, Status.FINISHED_ERROR.value, message, code)

    def _finish(self, req: Request, status: Status, error: str | None = None, error_code: str | None = None) -> None:
        if req.capture_state and error_code in (None, ErrorCode.CANCELLED, ErrorCode.TIMEOUT) and req.draft_room:
            try:  # it stopped inside a checked draft, or before a refused one's accepted tokens were fed again
                self.runner.rewind(req)
            except OutOfPages:  # its state is not kept (no reuse from it), as for a stop inside a prompt
                log.warning("request %s: no KV page to put its state to where it stopped: not kept", req.request_id)
        # the state is kept only when the step itself ended a healthy request, at a token boundary, with every token
        # of its history fed but the pending last one: a request cancelled or timed out inside its prompt holds only
        # part of it, and kept under its whole history that state would have continued at the wrong positions
        at_boundary = error_code in (None, ErrorCode.CANCELLED, ErrorCode.TIMEOUT) and req.gap <= 1
        if req.capture_state and req.slot is not None and at_boundary:
            self._keep_final_state(req, req.slot)
        req.error, req.error_code = error, error_code
        self.scheduler.finish(req, status)

    def _keep_final_state(self, req: Request, slot: int) -> None:
        """`req.final_state`: a host copy of the slot's state. Keys and values are copied out of their pages on
        another thread (`req.final_ready` is set when done; the pages come back after): a long context's copy into
        new memory had held up every stream's step, 45-90 ms at 3.5k SmolLM2 tokens (page faults, mostly)."""
        arena = self.arena
        if arena.pool is None or arena.device.type != "cpu":
            req.final_state = self.runner.read_state(slot)
            return
        build, ready = arena.take(slot), threading.Event()
        req.final_ready = ready

        def copy() -> None:
            try:
                req.final_state = build()
            except Exception:  # not kept, as a state that could not be read: the answer stands, nothing is saved
                log.exception("could not copy a finished request's keys and values")
            finally:
                ready.set()

        self._copies = [f for f in self._copies if not f.done()]
        try:
            self._copies.append(self._copier.submit(copy))
        except RuntimeError:  # the engine was shut down (a step run by hand after it): copy here
            copy()

    def _wait_for_copies(self) -> bool:
        """The scheduler is short of KV pages: wait for the copies still holding finished requests' pages (rather
        than park a request, or hold one back, for pages about to come back). True if any were pending."""
        pending = [f for f in self._copies if not f.done()]
        self._copies.clear()
        concurrent.futures.wait(pending)
        return bool(pending)

    def _reap(self) -> list[Event]:
        """Finish cancelled and timed-out requests, freeing their slots."""
        now = time.monotonic()
        events = []
        for req in list(self.scheduler.running) + list(self.scheduler.waiting):
            reason = code = None
            if req.cancel_requested:
                reason, code = "cancelled", ErrorCode.CANCELLED
            elif req.deadline is not None and now > req.deadline:
                reason, code = "timeout: the request ran past its time limit", ErrorCode.TIMEOUT
            if reason:
                self._finish(req, Status.FINISHED_ABORTED, reason, code)
                events.append(Event(req.request_id, [], self._held_text(req.request_id), None, "abort", reason, code))
        return events

    def _held_text(self, rid: str) -> str:
        """An ending request's text still held back (a possible stop string's start, incomplete UTF-8): its partial
        answer is the text of the tokens it reports (a timed-out answer had lost its last characters)."""
        detok = self._detok.get(rid)
        if detok is None:
            return ""
        try:
            detok.flush()
            return detok.delta(final=True)
        except Exception:  # an ending request's last characters are not worth failing its end (or every request's)
            log.warning("could not release a request's held-back text", exc_info=True)
            return ""

    def _dispatch(self, events: list[Event]) -> None:
        for ev in events:
            with self._lock:  # pushed under the lock: no event reaches a handle after its final one
                handle = self._handles.get(ev.request_id)
                if ev.finished:
                    self._handles.pop(ev.request_id, None)
                    self.runner.release(ev.request_id)
                    self._detok.pop(ev.request_id, None)
                if handle is not None:
                    handle._push(ev)

    def _fail_all(self, message: str, status: Status, error_code: str) -> None:
        with self._lock:
            reqs = list(self.scheduler.running) + list(self.scheduler.waiting)
            held = {r.request_id: self._held_text(r.request_id) for r in reqs}
            for req in reqs:
                self._finish(req, status, message, error_code)
            self._take_snapshots()  # pending snapshots of these requests fail rather than wait forever
            for rid, fut, _ in self._suspends:
                settle(fut, error=KeyError(f"request {rid!r} ended before it could move"))
            self._suspends.clear()
        self._dispatch([Event(r.request_id, [], held[r.request_id], None, status.value, message, error_code)
                        for r in reqs])  # fmt: skip

    def abort_all(self, reason: str) -> None:
        """Finish every running and waiting request now as aborted (error_code "shutdown"), ending their streams.

        Safe from any thread while the step loop runs: a step in flight drops its results for these requests.
        Their slots are freed; a captured final state is not kept, since a step may be writing it.
        """
        self._fail_all(reason, Status.FINISHED_ABORTED, ErrorCode.SHUTDOWN)

    # --- running -------------------------------------------------------------------------------
    def run_until_done(self) -> None:
        """Step inline until no request is left (offline use; no thread)."""
        while self.scheduler.has_work or self._snapshots or self._suspends:
            try:
                self.step()
            except Exception as e:  # a bug: the caller hears of it, and no request is left in flight to spin on
                self._fail_all(f"internal engine error: {e}", Status.FINISHED_ERROR, ErrorCode.ENGINE_ERROR)
                raise

    @property
    def loop_failed(self) -> bool:
        """Whether the step loop's thread ended without being asked to stop (a bug): every request would then
        wait forever, so the server reports itself unhealthy (/health, and Serve's probe of a replica)."""
        return self._thread is not None and not self._thread.is_alive() and not self._stopping

    @property
    def threaded(self) -> bool:
        """True when the step loop runs on its own thread (else callers step inline)."""
        return self._thread is not None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="wkvm-engine", daemon=True)
            self._thread.start()
            self._loop_ready.wait()

    def warm_up(self) -> float:
        """Run one tiny greedy request (two prompt tokens, two new ones) through the step loop, so that every C++
        kernel the model runs (int8 / int4, the fused layers, the recurrent step, the sampler) is built or loaded
        now: a server says it is ready only after this. On a fresh machine the first use builds them (10-60 s each on
        two cores), and a fresh `make serve`'s first answer had taken 18 s while /health said ready (AMD EPYC, session
        60); llama.cpp's server warms up the same way. Nothing of it stays: the slot and pages are freed, no state or
        checkpoint is stored and no route's counters see it. Returns the seconds it took."""
        started = time.monotonic()
        params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        try:
            handle = self.submit([0, min(1, self.model.vocab_size - 1)], params, request_id="warm-up", timeout=0)
            if self._thread is None:  # no step loop running (an engine driven inline, as LLM's): run it here
                self.run_until_done()
            out = handle.result()
        except Exception as e:  # e.g. a context too short for it: requests say what is wrong when they come
            out = None
            log.warning("the warm-up request did not run (%s): the first request builds the kernels", e)
        if out is not None and out.error:  # the model failed on it: so will requests, each with this error
            log.warning("the warm-up request failed: %s", out.error)
        return time.monotonic() - started

    def _loop(self) -> None:
        try:  # this thread's counts (its own only), taken before `start` returns and the server sets 1 for the others
            keep_thread_count(self._threads)
        finally:
            self._loop_ready.set()
        while True:
            with self._lock:
                # a move or snapshot asked of a request that has just ended is answered now, not at the next request
                while not (self.scheduler.has_work or self._suspends or self._snapshots) and not self._stopping:
                    self._wake.wait()
                if self._stopping and not (self._drain and self.scheduler.has_work):
                    break
            keep_thread_count(self._threads)  # a C++ extension's first op on this thread takes the process's count
            try:
                self.step()
            except Exception as e:  # a bug: fail the in-flight requests loudly rather than hang them
                log.exception("engine step failed")
                try:
                    self._fail_all(f"internal engine error: {e}", Status.FINISHED_ERROR, ErrorCode.ENGINE_ERROR)
                except Exception:  # the loop goes on: a dead loop would hang every later request
                    log.exception("failing the in-flight requests failed too")
        self.abort_all(SHUTDOWN_MESSAGE)

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop accepting; finish in-flight work (drain) or abort it; join the thread.

        With drain and a timeout, whatever still runs after `timeout` seconds is aborted at once, so this returns
        within about `timeout` plus the step then in flight.
        """
        with self._lock:
            self._accepting = False
            self._stopping = True
            self._drain = drain
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                self.abort_all(SHUTDOWN_MESSAGE)  # nothing is left to drain, so the loop exits after this step
                self._thread.join()
            self._thread = None
        else:
            self.abort_all(SHUTDOWN_MESSAGE)
        self._copier.shutdown(wait=True)  # every final state copied out, its pages back
