"""The scheduler: no phases, one token budget per step.

Running requests take their gap first (1 token when decoding, a capped chunk when prefilling or when a moved request
catches up on the tokens its source generated after the pre-copy), then waiting requests are admitted while budget
and slots last. When no slot is free and a waiting request outranks (priority, then arrival) the lowest-ranked
running one, that one is parked in host memory and resumes later.

Models with attention layers also need KV pages for the tokens a step feeds (grow and preempt, as vLLM does):
each request's pages are reserved when it is scheduled; when the pool is out of pages the lowest-ranked other
running request is parked (its keys and values copied to host, never recomputed), and if there is none the
request waits itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from wkvm.config import EngineConfig
from wkvm.engine.arena import SlotArena
from wkvm.engine.kv_pages import OutOfPages
from wkvm.engine.request import Request, Status
from wkvm.models.family import STEP_CHUNK
from wkvm.models.spec import State


@dataclass
class ScheduledBatch:
    work: list[tuple[Request, int]]  # (request, tokens to feed this step)
    parked: list[Request]  # preempted this step (their state is already in host memory)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.work)


class QueueFull(RuntimeError):
    pass


class Scheduler:
    def __init__(self, config: EngineConfig, arena: SlotArena):
        self.config = config
        self.arena = arena
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.park: Callable[[Request], None] = self._park
        self.unpark: Callable[[Request], None] = self._unpark
        # speculative decoding: a decoding request's draft of at most n tokens (the Engine's prompt lookup, when on)
        self.draft: Callable[[Request, int], list[int]] = lambda req, n: []

    @property
    def queue_room(self) -> int:
        """How many more requests `add` accepts now (parked requests count as waiting)."""
        return max(0, self.config.max_queue - len(self.waiting))

    def add(self, req: Request) -> None:
        if self.queue_room == 0:
            raise QueueFull(
                f"the queue is full ({self.config.max_queue} waiting requests); retry later or raise --max-queue"
            )
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        budget = self.config.token_budget
        work: list[tuple[Request, int]] = []
        parked = self._preempt_for_waiting()
        for req in sorted(self.running, key=lambda r: r.sort_key):
            if req.status != Status.RUNNING:
                continue  # parked this step to make room for a higher-ranked request's pages
            n = self._take(req, budget)
            if n and self._pages_for(req, n, work, parked):
                work.append((req, n))
                budget -= n
        self.waiting.sort(key=lambda r: r.sort_key)
        while self.waiting and budget > 0 and self.arena.num_free > 0:
            head = self.waiting[0]
            if any(head is p for p in parked):
                break  # parked this step for want of KV pages: it waits for the next one
            n = self._take(head, budget)
            state = head.parked_state if head.parked_state is not None else head.initial_state
            if not self._can_start(state, n):
                break  # its keys and values and this step's tokens do not fit the free pages: wait, in order
            # its pages kept for the requests waiting to start from the same state, if its partial page's copy fits too
            keep = head.parked_state is None and state is not None and self._starts_from(state, but=head)
            keep = keep and self.arena.can_start(state, n, keep=True)
            req = self.waiting.pop(0)
            if not self._admit(req, keep):
                self.waiting.insert(0, req)
                break
            if n and not self._pages_for(req, n, work, parked):
                break
            if n:
                work.append((req, n))
                budget -= n
        for req in self.running:
            req.check_invariant()
        return ScheduledBatch(work, parked)

    def _can_start(self, state: State | None, n: int) -> bool:
        """Whether a waiting request's start fits the free pages, after taking back pages finished requests' copies
        hold and then the pages kept for n > 1 choices (when the head cannot start: they would pin them for good)."""
        arena = self.arena
        return (arena.can_start(state, n) or (arena.reclaim() and arena.can_start(state, n))
                or (arena.let_go_all() and arena.can_start(state, n)))  # fmt: skip

    def _take(self, req: Request, budget: int) -> int:
        req.draft = []
        if req.gap <= 0:
            return 0
        if not req.is_prefilling:  # 1 when decoding; more for a moved request catching up (`Engine.precopy`) or
            n = min(req.gap, STEP_CHUNK, budget)  # feeding again a draft's accepted tokens, in chunks a model runs
            if n == 1:  # with the bits of stepping; a decode may check a draft after its pending token, as one chunk
                req.draft = self.draft(req, min(budget, STEP_CHUNK) - 1)
            return n + len(req.draft)
        left = len(req.prompt_ids) - req.num_computed_tokens
        if req.capture_prompt_state and req.prompt_state is None and left > 1:
            left -= 1  # stop one short, so the state before the last prompt token can be captured
        if req.capture_at is not None and req.num_computed_tokens < req.capture_at:
            left = min(left, req.capture_at - req.num_computed_tokens)  # stop at the branch point too
        return min(req.gap, left, self.config.prefill_chunk, budget)

    def _preempt_for_waiting(self) -> list[Request]:
        parked = []
        while self.waiting and self.arena.num_free == 0 and self.running:
            best = min(self.waiting, key=lambda r: r.sort_key)
            worst = max(self.running, key=lambda r: r.sort_key)
            if not best.sort_key < worst.sort_key:
                break
            self.park(worst)
            parked.append(worst)
        return parked

    def _pages_for(self, req: Request, n: int, work: list[tuple[Request, int]], parked: list[Request]) -> bool:
        """Reserve KV pages for `n` tokens of `req`, parking lower-ranked running requests not yet given work this
        step while the pool is short; False (and `req` parked) when nothing can make room."""
        assert req.slot is not None
        while True:
            try:
                self.arena.reserve(req.slot, n)
                return True
            except OutOfPages:
                if self.arena.reclaim() or self.arena.let_go_all():  # pages came back (a finished request's copy,
                    continue  # or those kept for choices yet to start): try again before parking anyone
                scheduled = {id(r) for r, _ in work}
                others = [r for r in self.running if r is not req and id(r) not in scheduled]
                victim = max(others, key=lambda r: r.sort_key, default=None)
                if victim is None or not req.sort_key < victim.sort_key:
                    victim = req
                self.park(victim)
                parked.append(victim)
                if victim is req:
                    return False

    def _admit(self, req: Request, keep: bool = False) -> bool:
        """Give `req` a slot and its state (`keep`: its start state's pages kept for other waiting requests starting
        from it); False (nothing changed) when its keys and values do not fit the pool."""
        slot = self.arena.alloc()
        assert slot is not None
        req.slot = slot
        try:
            if req.status == Status.PARKED:
                self.unpark(req)
            elif req.initial_state is not None:  # shared with requests still waiting (n > 1): its pages are kept
                self.arena.write(slot, req.initial_state, keep=keep)
        except OutOfPages:
            self.arena.free(slot)
            req.slot = None
            return False
        req.status = Status.RUNNING
        if req.admitted is None:
            req.admitted = time.monotonic()
        self.running.append(req)
        return True

    def _park(self, req: Request) -> None:
        """Preempt: move the state to host memory (never recompute) and requeue."""
        assert req.slot is not None  # a running request holds a slot
        req.parked_state = self.arena.read(req.slot)
        self.arena.free(req.slot)
        req.slot = None
        req.status = Status.PARKED
        self.running.remove(req)
        self.waiting.append(req)

    def _unpark(self, req: Request) -> None:
        assert req.slot is not None and req.parked_state is not None  # just given a slot; parked with a state
        self.arena.write(req.slot, req.parked_state)
        req.parked_state = None

    def finish(self, req: Request, status: Status) -> None:
        """Leave the scheduler: free the slot at once."""
        req.status = status
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        if req.slot is not None:
            self.arena.free(req.slot)
            req.slot = None
        req.parked_state = None
        if req.initial_state is not None and not self._starts_from(req.initial_state):
            self.arena.let_go(req.initial_state)  # a choice ended while waiting: the pages kept for it go

    def _starts_from(self, state: State, but: Request | None = None) -> bool:
        """Whether a waiting request (other than `but`) will start from `state` (one never admitted: a parked one goes
        on from its own copy)."""
        return any(r.initial_state is state and r.parked_state is None and r is not but for r in self.waiting)
