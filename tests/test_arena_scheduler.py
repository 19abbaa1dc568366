"""Bookkeeping without a model: the slot arena and the no-phases scheduler."""

import random

import pytest
import torch

from wkvm.config import EngineConfig
from wkvm.engine.arena import SlotArena
from wkvm.engine.request import Request, Status
from wkvm.engine.scheduler import QueueFull, Scheduler
from wkvm.models.spec import StateSpec, TensorSpec
from wkvm.sampling_params import SamplingParams

SPEC = StateSpec("toy", (TensorSpec("a", (3,)), TensorSpec("b", (2, 2))))


def make_req(rid, n_prompt, max_tokens=4, priority=0, arrival=None):
    r = Request(str(rid), list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens), priority=priority)
    if arrival is not None:
        r.arrival = arrival
    return r


def test_arena_exact_admission_and_lowest_first():
    arena = SlotArena(SPEC, 3)
    assert [arena.alloc() for _ in range(3)] == [0, 1, 2]
    assert arena.alloc() is None and arena.num_free == 0
    arena.free(1)
    assert arena.alloc() == 1
    with pytest.raises(ValueError, match="not allocated"):
        arena.free(arena.dummy)
    assert arena.tensors["b"].shape == (4, 2, 2)  # three slots and the dummy


def test_arena_reset_copy_view_scatter_read_write():
    arena = SlotArena(SPEC, 4)
    slots = [arena.alloc() for _ in range(4)]
    for s in slots:
        arena.tensors["a"][s] = s + 1.0
    arena.copy(2, 0)
    assert torch.equal(arena.tensors["a"][0], arena.tensors["a"][2])
    view, is_view = arena.view([1, 2])
    assert is_view
    view["a"].add_(10)
    assert arena.tensors["a"][1, 0] == 12
    gathered, is_view = arena.view([3, 1])
    assert not is_view
    gathered["a"].zero_()
    assert arena.tensors["a"][3, 0] == 4  # a copy until scattered
    arena.scatter([3, 1], gathered)
    assert arena.tensors["a"][3, 0] == 0 and arena.tensors["a"][1, 0] == 0
    saved = arena.read(2)
    arena.free(2)
    s = arena.alloc()
    assert s == 2 and arena.tensors["a"][2].abs().sum() == 0  # reset on alloc
    arena.write(2, saved)
    assert torch.equal(arena.tensors["a"][2], saved["a"][0])


def fake_step(sched, batch, rng, stop_prob=0.05):
    """Advance requests as the engine would, with random outputs and random stops."""
    for req, n in batch.work:
        req.num_computed_tokens += n
        req.check_invariant()
        if req.gap == 0:
            req.output_ids.append(rng.randrange(100))
            if len(req.output_ids) >= req.params.max_tokens or rng.random() < stop_prob:
                sched.finish(req, Status.FINISHED_LENGTH)


def test_budget_and_decodes_first():
    cfg = EngineConfig(n_slots=4, token_budget=10, prefill_chunk=6)
    sched = Scheduler(cfg, SlotArena(SPEC, 4))
    decoders = [make_req(i, 1, max_tokens=100) for i in range(3)]
    for r in decoders:
        sched.add(r)
    fake_step(sched, sched.schedule(), random.Random(0), stop_prob=0)
    long = make_req("long", 50, max_tokens=2)
    sched.add(long)
    for _ in range(5):
        batch = sched.schedule()
        work = dict(batch.work)
        assert batch.num_tokens <= cfg.token_budget
        assert all(work.get(r) == 1 for r in decoders), "running decodes must get their token every step"
        assert work[long] <= cfg.prefill_chunk
        fake_step(sched, batch, random.Random(1), stop_prob=0)


def test_queue_full_is_a_clear_error():
    sched = Scheduler(EngineConfig(n_slots=1, max_queue=2), SlotArena(SPEC, 1))
    sched.add(make_req(1, 3))
    sched.add(make_req(2, 3))
    with pytest.raises(QueueFull, match="queue is full"):
        sched.add(make_req(3, 3))


def test_queue_room_counts_down_and_never_goes_negative():
    sched = Scheduler(EngineConfig(n_slots=1, max_queue=2), SlotArena(SPEC, 1))
    assert sched.queue_room == 2
    low = make_req("low", 3, max_tokens=50, priority=5)
    sched.add(low)
    sched.schedule()
    assert sched.queue_room == 2  # admitted: running requests leave the queue
    sched.add(make_req(1, 3, priority=0))
    sched.add(make_req(2, 3, priority=0))
    assert sched.queue_room == 0
    sched.park(low)  # a parked request rejoins the queue even when it is full
    assert len(sched.waiting) == 3 and sched.queue_room == 0


def test_preemption_parks_lowest_rank_and_resumes():
    arena = SlotArena(SPEC, 1)
    sched = Scheduler(EngineConfig(n_slots=1, token_budget=8), arena)
    low = make_req("low", 2, max_tokens=50, priority=5)
    sched.add(low)
    fake = random.Random(0)
    batch = sched.schedule()
    fake_step(sched, batch, fake)
    arena.tensors["a"][low.slot] = 7.0
    high = make_req("high", 2, max_tokens=3, priority=0)
    sched.add(high)
    batch = sched.schedule()
    assert batch.parked == [low] and low.status == Status.PARKED and low.parked_state["a"][0, 0] == 7.0
    assert [r for r, _ in batch.work] == [high]
    while high.status == Status.RUNNING:
        fake_step(sched, batch, fake)
        batch = sched.schedule()
    assert low.status == Status.RUNNING and arena.tensors["a"][low.slot, 0] == 7.0
    # the queue time (/metrics) ends at the first slot: a preempted request's return does not move it
    assert low.arrival <= low.admitted < high.arrival <= high.admitted, (low.admitted, high.arrival)


@pytest.mark.parametrize("seed", range(5))
def test_invariant_randomized(seed):
    rng = random.Random(seed)
    cfg = EngineConfig(n_slots=rng.randint(1, 6), token_budget=rng.randint(6, 40), prefill_chunk=rng.randint(1, 16))
    arena = SlotArena(SPEC, cfg.n_slots)
    sched = Scheduler(cfg, arena)
    finished = 0
    for step in range(400):
        if rng.random() < 0.3 and len(sched.waiting) < cfg.max_queue:
            sched.add(make_req(step, rng.randint(1, 60), rng.randint(1, 20), rng.randint(0, 3)))
        batch = sched.schedule()
        assert batch.num_tokens <= cfg.token_budget
        assert len(sched.running) + arena.num_free == cfg.n_slots
        assert len({r.slot for r in sched.running}) == len(sched.running)
        before = len(sched.running)
        fake_step(sched, batch, rng)
        finished += before - len(sched.running)
    assert finished > 10


@pytest.mark.parametrize(
    ("running", "victim"),
    [
        ({"p5-first": (5, 1.0), "p3-second": (3, 2.0)}, "p5-first"),  # the lowest priority, though it came first
        ({"p4-first": (4, 1.0), "p4-second": (4, 2.0)}, "p4-second"),  # a tie: the later arrival
    ],
    ids=["lower-priority", "tie-later-arrival"],
)
def test_preemption_parks_the_lowest_ranked_of_several_running(running, victim):
    """Both slots busy: a waiting request that outranks them displaces the lowest-ranked running one (highest
    priority number, then latest arrival), not any other; one that ties on priority and came later displaces none."""
    sched = Scheduler(EngineConfig(n_slots=2, token_budget=16), SlotArena(SPEC, 2))
    reqs = {rid: make_req(rid, 2, max_tokens=50, priority=p, arrival=t) for rid, (p, t) in running.items()}
    for r in reqs.values():
        sched.add(r)
    fake_step(sched, sched.schedule(), random.Random(0), stop_prob=0)
    assert all(r.status == Status.RUNNING for r in reqs.values())
    urgent = make_req("urgent", 2, max_tokens=5, priority=0, arrival=3.0)
    sched.add(urgent)
    batch = sched.schedule()
    assert [r.request_id for r in batch.parked] == [victim] and reqs[victim].status == Status.PARKED
    kept = next(r for rid, r in reqs.items() if rid != victim)
    assert kept.status == Status.RUNNING and urgent.status == Status.RUNNING
    assert {r for r, _ in batch.work} == {kept, urgent}
    tied = make_req("tied", 2, max_tokens=5, priority=kept.priority, arrival=kept.arrival + 0.5)
    sched.add(tied)
    assert sched.schedule().parked == [] and tied.status == Status.WAITING


KV_SPEC = StateSpec("toy-kv", (TensorSpec("a", (3,)), TensorSpec("layers.0.k", (1, 2), kind="kv"),
                               TensorSpec("layers.0.v", (1, 2), kind="kv")))  # fmt: skip


def feed(arena, batch):
    """The runner's part for a paged model: each scheduled request's tokens enter its pages, then it advances (a
    sampled token whenever it has caught up)."""
    for req, n in batch.work:
        kv = arena.kv_batch([req.slot], n)
        kv.commit()
        req.num_computed_tokens += n
        if req.gap == 0:
            req.output_ids.append(7)


def test_out_of_kv_pages_parks_the_lowest_ranked_other_running_request():
    """Three sequences fill a 3-page pool (pages of 4 tokens). The top-ranked one then needs a page: of the two others
    not yet given work this step, the lowest-ranked (priority, then arrival) is parked, here the earlier arrival,
    and the other keeps its pages and its token."""
    arena = SlotArena(KV_SPEC, 3, kv_pages=3, page_tokens=4)
    sched = Scheduler(EngineConfig(n_slots=3, token_budget=64, prefill_chunk=64), arena)
    top = Request("top", [1, 2, 3, 4], SamplingParams(max_tokens=20), priority=0)
    top.arrival = 3.0
    low = Request("low", [1, 2, 3], SamplingParams(max_tokens=20), priority=2)
    low.arrival = 1.0
    mid = Request("mid", [1, 2, 3], SamplingParams(max_tokens=20), priority=1)
    mid.arrival = 2.0
    for r in (low, mid, top):
        sched.add(r)
    batch = sched.schedule()
    assert [r for r, _ in batch.work] == [top, mid, low] and batch.parked == []
    feed(arena, batch)
    assert arena.pool.num_free == 0  # 4 + 3 + 3 tokens, one page each
    batch = sched.schedule()  # top's 5th token needs a second page; mid's and low's 4th fit theirs
    assert batch.parked == [low] and low.status == Status.PARKED and low.slot is None
    assert [r for r, _ in batch.work] == [top, mid] and mid.status == Status.RUNNING
    assert len(arena.kv[top.slot].pages) == 2 and len(arena.kv[mid.slot].pages) == 1


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    """One slot, four requests queued out of order: each is admitted in turn by (priority, arrival), whatever the
    order they were added in."""
    sched = Scheduler(EngineConfig(n_slots=1, token_budget=16), SlotArena(SPEC, 1))
    specs = [("a", 1, 1.0), ("b", 0, 3.0), ("c", 0, 2.0), ("d", 2, 0.0)]  # (id, priority, arrival)
    for rid, priority, arrival in specs:
        sched.add(make_req(rid, 2, max_tokens=2, priority=priority, arrival=arrival))
    admitted = []
    rng = random.Random(0)
    while sched.has_work:
        batch = sched.schedule()
        assert batch.parked == []
        admitted += [r.request_id for r, _ in batch.work if r.request_id not in admitted]
        fake_step(sched, batch, rng, stop_prob=0)
    assert admitted == ["c", "b", "a", "d"]
