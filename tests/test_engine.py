"""The engine: continuous batching is exact, seeds are per request, cancel/preempt/timeout/queue behave."""

import asyncio
import math
import random
import threading
import time

import pytest
import torch
from conftest import greedy_reference

from wkvm.config import EngineConfig
from wkvm.engine.engine import Engine, EngineClosed, QueueFull
from wkvm.engine.request import Request
from wkvm.engine.runner import ModelRunner
from wkvm.engine.sampler import NON_FINITE_LOGITS
from wkvm.models.rwkv7.tokenizer import WorldTokenizer
from wkvm.sampling_params import MIN_TEMPERATURE, InvalidParam, SamplingParams
from wkvm.weights.loader import load_model


@pytest.fixture(scope="module")
def model(tiny_pth):
    return load_model(tiny_pth)


@pytest.fixture(scope="module")
def tok():
    return WorldTokenizer()


def greedy(n, **kw):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)


def poisoned_state(model):
    """A state of huge but finite values: the model's logits for it come out NaN (their sums overflow to inf)."""
    state = model.spec.zeros(1)
    state["layers.0.wkv"].fill_(3e38)
    return state


def test_staggered_mixed_batch_equals_alone(model, tok):
    """24 requests, staggered arrival, mixed prompt and output lengths, on 8 slots."""
    rng = random.Random(0)
    engine = Engine(model, tok, EngineConfig(n_slots=8, token_budget=48, prefill_chunk=16))
    specs = [([rng.randrange(1, 256) for _ in range(rng.randint(1, 70))], rng.randint(1, 20)) for _ in range(24)]
    handles = []
    for i, (prompt, n) in enumerate(specs):
        handles.append(engine.submit(prompt, greedy(n), request_id=f"r{i}"))
        for _ in range(rng.randint(0, 3)):
            engine.step()
    engine.run_until_done()
    assert engine.arena.num_free == 8
    for (prompt, n), h in zip(specs, handles, strict=True):
        assert h.output.token_ids == greedy_reference(model, prompt, n), h.request_id
        assert h.output.finish_reason == "length"


def test_gathered_batch_equals_alone(model, tok):
    """Non-contiguous slots go through gather/scatter; still exact."""
    engine = Engine(model, tok, EngineConfig(n_slots=4, token_budget=64, prefill_chunk=64))
    a = engine.submit([5, 6, 7], greedy(30))
    b = engine.submit([8, 9], greedy(2))
    c = engine.submit([10, 11, 12, 13], greedy(30))
    engine.run_until_done()
    assert a.output.token_ids == greedy_reference(model, [5, 6, 7], 30)
    assert b.output.token_ids == greedy_reference(model, [8, 9], 2)
    assert c.output.token_ids == greedy_reference(model, [10, 11, 12, 13], 30)


def test_seeded_sampling_independent_of_batch_mates(model, tok):
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, top_k=50, min_p=0.01, seed=42, ignore_eos=True)
    alone = Engine(model, tok)
    h = alone.submit([1, 2, 3], params)
    alone.run_until_done()
    crowded = Engine(model, tok, EngineConfig(n_slots=4))
    others = [crowded.submit([i, i + 1], SamplingParams(max_tokens=15, temperature=1.2, seed=i)) for i in range(5)]
    h2 = crowded.submit([1, 2, 3], params)
    crowded.run_until_done()
    assert h.output.token_ids == h2.output.token_ids
    assert len({tuple(o.output.token_ids) for o in others}) > 1


def test_penalties_change_the_output(model, tok):
    base = Engine(model, tok)
    a = base.submit([1, 2, 3], greedy(20))
    b = base.submit([1, 2, 3], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, frequency_penalty=2.0))
    c = base.submit([1, 2, 3], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, repetition_penalty=3.0))
    base.run_until_done()
    assert a.output.token_ids != b.output.token_ids
    assert a.output.token_ids != c.output.token_ids
    assert len(set(b.output.token_ids)) >= len(set(a.output.token_ids))


def test_repetition_penalty_sees_the_resumed_state_tokens(model, tok):
    """A request resumed from a state (base_ids) samples exactly as the whole history sent as one prompt."""
    prompt = [(37 * i) % 250 + 1 for i in range(40)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, repetition_penalty=3.0)
    engine = Engine(model, tok)
    whole = engine.submit(prompt, params)
    engine.run_until_done()
    _, state = model.prefill(prompt[:-1])
    resumed = engine.submit(prompt[-1:], params, initial_state=state, base_ids=prompt[:-1])
    engine.run_until_done()
    assert resumed.output.token_ids == whole.output.token_ids


def test_cancel_frees_slot_within_one_step(model, tok):
    engine = Engine(model, tok, EngineConfig(n_slots=2))
    h = engine.submit([1, 2, 3], greedy(100))
    engine.step()
    engine.step()
    assert engine.arena.num_free == 1
    h.cancel()
    engine.step()
    assert engine.arena.num_free == 2
    assert h.output.finish_reason == "abort" and h.output.error == "cancelled"


def test_requests_ended_before_a_step_hear_it_before_its_model_run(model, tok):
    """A cancelled request and one stopped to move get their final events (and a move its continuation) before the
    step's model run for the others, not after it: a moving stream's handover does not wait a step."""
    engine = Engine(model, tok, EngineConfig(n_slots=3))
    hs = [engine.submit([1, 2, 3 + i], greedy(100)) for i in range(3)]
    engine.step()
    engine.step()
    moving = engine.suspend(hs[1].request_id)
    hs[2].cancel()
    seen = []
    run = engine.runner.run

    def watched(work):
        seen.append((hs[2].done.is_set(), hs[1].done.is_set(), moving.done()))
        return run(work)

    engine.runner.run = watched
    engine.step()
    assert seen == [(True, True, True)]
    assert hs[2].output.error == "cancelled" and hs[1].continuation is not None and not hs[0].done.is_set()


def test_preemption_round_trip_exact(model, tok):
    engine = Engine(model, tok, EngineConfig(n_slots=1))
    low = engine.submit([3, 4, 5, 6], greedy(25), priority=5)
    for _ in range(6):
        engine.step()
    high = engine.submit([7, 8], greedy(5), priority=0)
    engine.step()
    assert low.request.status.value == "parked"
    engine.run_until_done()
    assert high.output.token_ids == greedy_reference(model, [7, 8], 5)
    assert low.output.token_ids == greedy_reference(model, [3, 4, 5, 6], 25)


def test_queue_full_and_timeout(model, tok):
    engine = Engine(model, tok, EngineConfig(n_slots=1, max_queue=2))
    engine.submit([1], greedy(3))
    engine.submit([2], greedy(3))
    with pytest.raises(QueueFull, match="queue is full"):
        engine.submit([3], greedy(3))
    engine.run_until_done()
    h = engine.submit([1, 2], greedy(10_000), timeout=0.05)
    engine.run_until_done()
    assert h.output.finish_reason == "abort" and "timeout" in h.output.error
    assert engine.arena.num_free == 1


def test_submit_all_queues_every_request_or_none(model, tok):
    """An n > 1 request's choices are queued together (the scheduler sees them at once and they share their start
    state's pages) and all or none: the queue's room for two of three aborts the two at the next step."""
    engine = Engine(model, tok, EngineConfig(n_slots=1, max_queue=2))
    with pytest.raises(QueueFull):
        engine.submit_all([1, 2], [greedy(3)] * 3)
    engine.run_until_done()
    assert not engine.scheduler.has_work and not engine._handles and engine.arena.num_free == 1
    handles = engine.submit_all([1, 2], [greedy(3)] * 2)
    engine.run_until_done()
    assert [h.output.token_ids for h in handles] == [greedy_reference(model, [1, 2], 3)] * 2


def test_stop_string_across_tokens(world_pth):
    from wkvm import LLM

    llm = LLM(model=world_pth)
    free = llm.generate("Hello", greedy(24))[0]
    text = free.text
    assert len(text) > 6
    stop = text[3:6]  # three characters, wherever token boundaries fall
    out = llm.generate("Hello", SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.text == text[: text.find(stop)]


def test_threaded_engine_sync_async_and_shutdown(model, tok):
    engine = Engine(model, tok, EngineConfig(n_slots=2))
    engine.start()
    h = engine.submit([1, 2, 3], greedy(6))
    events = list(h)
    assert sum(len(e.token_ids) for e in events) == 6 and events[-1].finish_reason == "length"
    assert h.output.token_ids == greedy_reference(model, [1, 2, 3], 6)

    async def stream():
        loop = asyncio.get_running_loop()
        ha = engine.submit([4, 5], greedy(4), loop=loop)
        return [t async for e in ha for t in e.token_ids]

    assert asyncio.run(stream()) == greedy_reference(model, [4, 5], 4)
    pending = engine.submit([1], greedy(5))
    engine.shutdown(drain=True)
    assert pending.result(timeout=5).finish_reason == "length"
    with pytest.raises(EngineClosed):
        engine.submit([1], greedy(1))


def test_shutdown_without_drain_aborts(model, tok):
    engine = Engine(model, tok, EngineConfig(n_slots=1))
    engine.start()
    h = engine.submit([1, 2], greedy(100_000))
    next(iter(h))
    engine.shutdown(drain=False)
    assert h.result(timeout=5).finish_reason == "abort"


class VisibleEos(WorldTokenizer):
    eos_token_id = 65  # "@" in the World vocabulary: an end token whose text is not empty (as ChatML's <|im_end|>)


def test_eos_ends_the_text_without_its_own(model):
    """A reply that ends with EOS does not carry EOS's text (SmolLM2's completions ended with '<|im_end|>')."""
    tok = VisibleEos()
    assert tok.decode([tok.eos_token_id]) != ""
    engine = Engine(model, tok)
    free = engine.submit([1, 2], greedy(3))
    ends = engine.submit([1, 2], SamplingParams(max_tokens=8, temperature=0, logit_bias={tok.eos_token_id: 100.0}))
    shown = engine.submit([1, 2], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True,
                                                 logit_bias={tok.eos_token_id: 100.0}))  # fmt: skip
    engine.run_until_done()
    assert ends.output.token_ids == [tok.eos_token_id] and ends.output.finish_reason == "stop"
    assert ends.output.text == ""
    assert shown.output.text == tok.decode([tok.eos_token_id] * 3)  # ignore_eos: an ordinary token
    assert free.output.text == tok.decode(free.output.token_ids)


NAN, INF = float("nan"), float("inf")
OUT_OF_RANGE = [
    ("temperature", [NAN, INF, -0.5, 2.5]),
    ("repetition_penalty", [1e-300, NAN, 0.0, 11.0]),
    ("presence_penalty", [NAN, -INF]),
    ("frequency_penalty", [INF, 2.5]),
    ("top_p", [0.0, NAN, 1.5]),
    ("top_k", [-2, 2**31, 2**63, 1.5]),
    ("min_p", [NAN, 1.5]),
    ("max_tokens", [-1, 2.5, True]),  # 0 is valid: score the prompt, generate nothing
    ("stop_token_ids", [[-1], [True], ["7"]]),
    ("logit_bias", [{1: 101.0}, {1: NAN}, {1: -INF}, {-1: 1.0}, {"7": 1.0}, {True: 1.0}, {1: True}]),
]


@pytest.mark.parametrize(("param", "value"), [(p, v) for p, values in OUT_OF_RANGE for v in values])
def test_sampling_params_reject_values_that_could_overflow(param, value):
    with pytest.raises(InvalidParam, match=param) as err:
        SamplingParams(**{param: value})
    assert err.value.param == param


def test_tiny_temperature_is_raised_and_samples_beside_others(model, tok):
    """temperature 1e-300 once made the sampler's multinomial raise, failing every request in the engine."""
    tiny = SamplingParams(max_tokens=6, temperature=1e-300, seed=1, ignore_eos=True)
    assert tiny.temperature == MIN_TEMPERATURE
    engine = Engine(model, tok)
    a = engine.submit([1, 2, 3], tiny)
    b = engine.submit([4, 5], greedy(6))
    engine.run_until_done()
    assert a.output.finish_reason == "length" and len(a.output.token_ids) == 6
    assert b.output.token_ids == greedy_reference(model, [4, 5], 6)


def test_poisoned_state_fails_only_its_own_request(model, tok):
    sampled = SamplingParams(max_tokens=8, temperature=1.0, seed=5, ignore_eos=True, logprobs=2)
    alone = Engine(model, tok)
    ref = alone.submit([7, 8, 9], sampled)
    alone.run_until_done()
    engine = Engine(model, tok, EngineConfig(n_slots=4))
    healthy = engine.submit([1, 2, 3], greedy(8, logprobs=2))
    bad = engine.submit([4, 5], greedy(8, logprobs=2), initial_state=poisoned_state(model), capture_state=True)
    other = engine.submit([7, 8, 9], sampled)
    engine.run_until_done()
    assert healthy.output.token_ids == greedy_reference(model, [1, 2, 3], 8)
    assert other.output.token_ids == ref.output.token_ids
    assert not any(math.isnan(v) for lp in healthy.output.logprobs + other.output.logprobs for v in lp.values())
    out = bad.output
    assert out.finish_reason == "error" and out.error_code == "non_finite" and "non-finite logits" in out.error
    assert out.token_ids == [] and out.logprobs == [] and bad.request.final_state is None
    assert engine.arena.num_free == 4


@pytest.mark.parametrize(
    ("param", "value"), [("temperature", 1e-300), ("repetition_penalty", 1e-300), ("frequency_penalty", INF)]
)
def test_params_that_bypass_validation_fail_only_their_request(model, tok, param, value):
    params = greedy(8)
    setattr(params, param, value)  # past __post_init__, as a buggy caller could
    engine = Engine(model, tok)
    healthy = engine.submit([1, 2, 3], greedy(8))
    bad = engine.submit([1, 2, 3], params)
    engine.run_until_done()
    assert healthy.output.token_ids == greedy_reference(model, [1, 2, 3], 8)
    assert bad.output.finish_reason == "error" and bad.output.error_code == "non_finite"


def test_prefill_only_from_a_poisoned_state_fails(model, tok):
    engine = Engine(model, tok)
    h = engine.submit([4, 5], greedy(1), initial_state=poisoned_state(model), capture_state=True, prefill_only=True)
    engine.run_until_done()
    assert h.output.finish_reason == "error" and h.output.error_code == "non_finite"
    assert h.request.final_state is None


def test_the_slot_a_poisoned_request_leaves_is_clean(model, tok):
    engine = Engine(model, tok, EngineConfig(n_slots=1))
    bad = engine.submit([4, 5], greedy(8), initial_state=poisoned_state(model))
    engine.run_until_done()
    assert bad.output.finish_reason == "error"
    nxt = engine.submit([1, 2, 3], greedy(8))
    engine.step()
    assert nxt.request.slot == 0  # the very slot the poisoned state was in
    engine.run_until_done()
    assert nxt.output.token_ids == greedy_reference(model, [1, 2, 3], 8)


@pytest.mark.allows_5xx  # the simulated step failure is logged as an error, on purpose
def test_error_codes_for_cancel_timeout_and_engine_error(model, tok):
    engine = Engine(model, tok, EngineConfig(n_slots=2))
    cancelled = engine.submit([1, 2], greedy(100))
    timed_out = engine.submit([3, 4], greedy(10_000), timeout=0.05)
    engine.step()
    cancelled.cancel()
    engine.run_until_done()
    assert (cancelled.output.finish_reason, cancelled.output.error_code) == ("abort", "cancelled")
    assert (timed_out.output.finish_reason, timed_out.output.error_code) == ("abort", "timeout")

    def broken(work):
        raise RuntimeError("simulated kernel failure")

    engine.runner.run = broken
    engine.start()
    h = engine.submit([1, 2], greedy(5))
    assert h.result(timeout=30).finish_reason == "error" and h.output.error_code == "engine_error"
    engine.shutdown(drain=False)


def test_abort_all_ends_running_and_waiting_requests_at_once(model, tok):
    engine = Engine(model, tok, EngineConfig(n_slots=1))
    engine.start()
    running = engine.submit([1, 2], greedy(100_000))
    events = iter(running)
    next(events)
    waiting = engine.submit([3, 4], greedy(5))
    engine.abort_all("the server is shutting down")
    assert running.done.is_set() and waiting.done.is_set()  # final events dispatched before abort_all returns
    for h in (running, waiting):
        assert (h.output.finish_reason, h.output.error_code) == ("abort", "shutdown")
        assert h.output.error == "the server is shutting down"
    assert list(events)[-1].finish_reason == "abort"  # the stream ends
    after = engine.submit([5, 6], greedy(4))  # abort_all alone does not close the engine
    assert after.result(timeout=30).token_ids == greedy_reference(model, [5, 6], 4)
    assert engine.arena.num_free == 1
    engine.shutdown()


def test_stop_accepting_and_queue_room(model, tok):
    engine = Engine(model, tok, EngineConfig(n_slots=1, max_queue=3))
    assert engine.queue_room() == 3
    a = engine.submit([1, 2], greedy(4))
    engine.submit([3, 4], greedy(4))
    assert engine.queue_room() == 1
    engine.step()  # admits one: it leaves the queue
    assert engine.queue_room() == 2
    engine.stop_accepting()
    assert engine.queue_room() == 0
    with pytest.raises(EngineClosed):
        engine.submit([5], greedy(1))
    engine.run_until_done()  # work already in carries on
    assert a.output.token_ids == greedy_reference(model, [1, 2], 4)


def test_shutdown_with_drain_timeout_aborts_what_is_left(model, tok):
    engine = Engine(model, tok, EngineConfig(n_slots=1))
    engine.start()
    h = engine.submit([1, 2], greedy(10_000_000))
    next(iter(h))
    stopper = threading.Thread(target=engine.shutdown, kwargs={"drain": True, "timeout": 0.1})
    stopper.start()
    stopper.join(60)  # a hang guard, not a speed bound: without the abort this would run for hours
    assert not stopper.is_alive()
    assert (h.output.finish_reason, h.output.error_code) == ("abort", "shutdown")
    assert engine.arena.num_free == 1


def runner_request(runner, rid, prompt, params, state=None, **kw):
    """A request placed in a slot of the runner's arena, as the scheduler would admit it."""
    req = Request(rid, prompt, params, **kw)
    req.slot = runner.arena.alloc()
    if state is not None:
        runner.write_state(req.slot, state)
    runner.add(req)
    return req


def test_runner_step_fails_only_the_poisoned_rows(model):
    runner = ModelRunner(model, EngineConfig(n_slots=4))
    healthy = runner_request(runner, "healthy", [1, 2, 3], greedy(4))
    bad = runner_request(runner, "bad", [4, 5, 6], greedy(4), poisoned_state(model))
    bad_prefill = runner_request(runner, "bad-prefill", [7, 8], greedy(1), poisoned_state(model), prefill_only=True)
    ok_prefill = runner_request(runner, "ok-prefill", [7, 8], greedy(1), prefill_only=True)
    work = [(healthy, 3), (bad, 3), (bad_prefill, 2), (ok_prefill, 2)]
    out = {r.request_id: s for r, s in runner.run(work).caught_up}
    assert [r.num_computed_tokens for r, _ in work] == [3, 3, 2, 2]
    assert out["healthy"].token == greedy_reference(model, [1, 2, 3], 1)[0] and out["healthy"].error is None
    assert (out["bad"].token, out["bad"].error) == (None, NON_FINITE_LOGITS)
    assert (out["bad-prefill"].token, out["bad-prefill"].error) == (None, NON_FINITE_LOGITS)
    assert (out["ok-prefill"].token, out["ok-prefill"].error) == (None, None)


def test_runner_captures_the_prompt_state_before_the_last_prompt_token(model):
    runner = ModelRunner(model, EngineConfig(n_slots=2))
    req = runner_request(runner, "r", [1, 2, 3, 4], greedy(2), capture_prompt_state=True)
    assert runner.run([(req, 3)]).caught_up == []  # not caught up yet: the last prompt token is still to feed
    _, expected = model.prefill([1, 2, 3])
    for k, v in expected.items():
        assert torch.allclose(req.prompt_state[k], v, atol=1e-6), k
    [(r, s)] = runner.run([(req, 1)]).caught_up
    assert r is req and s.token == greedy_reference(model, [1, 2, 3, 4], 1)[0]
    assert torch.equal(runner.request_state(req)["layers.0.wkv"], runner.read_state(req.slot)["layers.0.wkv"])


def test_a_move_asked_of_a_request_that_just_ended_is_answered_at_once(model, tok):
    """A threaded engine with nothing to run answers a pending move (the request ended first) right away, not at its
    next request (a move's call timed out waiting, and its caller gave up)."""
    engine = Engine(model, tok, EngineConfig(n_slots=2))
    engine.start()
    try:
        h = engine.submit([1, 2, 3], greedy(2))
        assert h.done.wait(30)
        engine._handles[h.request_id] = h  # the moment between a request's end and its handle's removal
        moving = engine.suspend(h.request_id)
        engine._handles.pop(h.request_id, None)
        with pytest.raises(KeyError, match="finished before it could move"):
            moving.result(timeout=10)
    finally:
        engine.shutdown(drain=False)


def test_a_move_given_up_on_neither_stops_the_request_nor_the_engine(model, tok):
    """A move whose caller gave up before the engine took it (a timed-out call cancels its future): the request goes
    on where it is, and the engine too (resolving the cancelled future raised inside the step, which killed the
    engine's thread: every later request hung)."""
    engine = Engine(model, tok, EngineConfig(n_slots=2))
    running = engine.submit([4, 5, 6], greedy(20))
    engine.step()
    engine.step()
    abandoned = engine.suspend(running.request_id)
    abandoned.cancel()
    ended = engine.submit([7, 8], greedy(3))
    engine.step()
    ending = engine.suspend(ended.request_id)
    engine.run_until_done()
    assert running.output.token_ids == greedy_reference(model, [4, 5, 6], 20) and running.continuation is None
    assert ended.continuation is not None and ending.result(timeout=0) is ended.continuation


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the loop is made to die
def test_a_step_loop_that_dies_says_so(model, tok):
    """`loop_failed`: the step loop's thread ended without a shutdown (what /health and a replica's probe report);
    not after an ordinary shutdown."""
    engine = Engine(model, tok, EngineConfig(n_slots=1))

    def broken() -> None:
        raise SystemExit("a failure the loop does not catch")

    engine.step = broken
    engine.start()
    engine.submit([1, 2], greedy(2))
    engine._thread.join(10)
    assert engine.loop_failed
    fine = Engine(model, tok, EngineConfig(n_slots=1))
    fine.start()
    assert not fine.loop_failed
    fine.shutdown(drain=False)
    assert not fine.loop_failed


def test_queued_and_parked_requests_time_out_without_a_slot(model, tok):
    """Every slot is busy with a long request. A request queued behind them and one parked (preempted) past their
    deadlines end at the next step, as timeouts, while still waiting: neither waits for a slot first; the long
    requests go on exactly as before."""
    engine = Engine(model, tok, EngineConfig(n_slots=2))
    long = engine.submit([1, 2, 3], greedy(30), priority=0)
    parked = engine.submit([4, 5], greedy(30), priority=5)
    engine.step()
    engine.step()
    high = engine.submit([6, 7], greedy(30), priority=1)
    engine.step()  # high outranks parked: parked goes to host memory and waits to resume
    assert parked.request.status.value == "parked" and parked.request.admitted is not None
    queued = engine.submit([8, 9], greedy(5), priority=9, timeout=0.05)  # ranks below all: never gets a slot
    engine.step()
    parked.request.deadline = time.monotonic() - 1.0  # its deadline passes while it is parked
    time.sleep(0.1)  # past queued's deadline (an input, not a bound on anything)
    engine.step()
    for h in (queued, parked):
        assert h.done.is_set(), h.request_id
        assert (h.output.finish_reason, h.output.error_code) == ("abort", "timeout"), h.request_id
        assert h.request.slot is None and h.request.parked_state is None
    assert queued.request.admitted is None and queued.output.token_ids == []
    assert parked.output.token_ids == greedy_reference(model, [4, 5], len(parked.output.token_ids))
    assert not long.done.is_set() and not high.done.is_set()
    engine.run_until_done()
    assert long.output.token_ids == greedy_reference(model, [1, 2, 3], 30) and long.output.finish_reason == "length"
    assert high.output.token_ids == greedy_reference(model, [6, 7], 30) and high.output.finish_reason == "length"
    assert engine.arena.num_free == 2 and not engine.scheduler.has_work


def test_seed_zero_is_a_seed(model, tok):
    """seed=0 samples from the request's own generator (0 is no 'unset'): the same tokens whatever the process's
    global random state, in a fresh engine or beside another request, and a generator state to move with."""
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=0, ignore_eos=True)
    outputs = []
    with torch.random.fork_rng():
        for global_seed, n_slots in ((1, 1), (2, 4)):
            torch.manual_seed(global_seed)
            engine = Engine(model, tok, EngineConfig(n_slots=n_slots))
            if n_slots > 1:
                engine.submit([9, 8], SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True))
            h = engine.submit([1, 2, 3], params)
            engine.step()
            assert engine.runner.generator_state(h.request_id) is not None
            engine.run_until_done()
            outputs.append(h.output.token_ids)
    assert len(outputs[0]) == 12 and outputs[0] == outputs[1]


def test_keep_thread_count_falls_back_to_torchs_setter_and_says_so_once(monkeypatch, caplog):
    """Where OpenMP's per-thread setter is out of reach (a torch built on another OpenMP), the step loop's count is
    still set, through torch's process-wide setter, and the log says once what that costs."""
    import torch

    from wkvm.engine import threads

    monkeypatch.setattr(threads, "_setters", lambda: [])
    monkeypatch.setattr(threads, "_warned", False)
    before = torch.get_num_threads()
    other = 2 if before == 1 else 1
    try:
        with caplog.at_level("WARNING", logger="wkvm.engine.threads"):
            threads.keep_thread_count(other)
            assert torch.get_num_threads() == other
            threads.keep_thread_count(before)
            assert torch.get_num_threads() == before
        assert sum("cannot set one thread's" in r.getMessage() for r in caplog.records) == 1
    finally:
        torch.set_num_threads(before)


def test_a_cancelled_or_timed_out_answer_keeps_the_text_it_held_back(char_model):
    """Review (session 38): the text held back as a possible stop string's start (or incomplete UTF-8) was dropped
    when a request was cancelled, timed out or shut down: its partial answer lacked the last characters of the
    tokens it reported. It is released with the final event now."""
    from wkvm.weights.loader import load_text_tools

    model, tok = load_model(char_model), load_text_tools(char_model, "rwkv7")[0]
    engine = Engine(model, tok)
    prompt = tok.encode("Say:")
    free = engine.submit(prompt, greedy(8))
    engine.run_until_done()
    held = free.output.text[4]
    for end in ("cancel", "shutdown"):
        h = engine.submit(prompt, greedy(8, stop=[held + "\u2603"]))  # never stops: only holds `held` back
        while len(h.output.token_ids) < 5:
            engine.step()
        if end == "cancel":
            h.cancel()
            engine.step()
        else:
            engine.abort_all("shutting down")
        assert h.output.finish_reason == "abort" and h.output.token_ids == free.output.token_ids[:5]
        assert h.output.text == free.output.text[:5], (end, h.output.text)


def test_the_largest_top_k_samples_as_no_top_k(model, tok):
    """A top_k past the vocabulary keeps every token (2^63 had failed the engine step for every request in it; the
    bound is now 2^31 - 1, and that much is off)."""
    engine = Engine(model, tok)
    params = dict(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True)
    a = engine.submit([1, 2, 3], SamplingParams(**params, top_k=2**31 - 1))
    b = engine.submit([1, 2, 3], SamplingParams(**params))
    engine.run_until_done()
    assert a.output.token_ids == b.output.token_ids and len(a.output.token_ids) == 6


def test_warm_up_runs_one_request_through_the_loop_and_leaves_nothing(model, tok, tiny_pth, monkeypatch):
    """`wkvm serve` runs it before it says it is ready, so that the kernels are built (or loaded) then and not inside
    the first request (a fresh `make serve`'s first answer had taken 18 s while /health said ready: session 60)."""
    from wkvm.server.context import ServerContext

    engine = Engine(model, tok, EngineConfig(n_slots=2))
    ran = []
    submit = engine.submit

    def spy(prompt_ids, params, **kw):
        ran.append(submit(prompt_ids, params, **kw))
        return ran[-1]

    monkeypatch.setattr(engine, "submit", spy)
    engine.start()
    try:
        assert engine.warm_up() >= 0
        (h,) = ran
        assert h.output.finish_reason == "length" and len(h.output.token_ids) == 2, h.output
        assert engine.stats().running == 0 and engine.stats().waiting == 0 and engine.arena.num_free == 2
    finally:
        engine.shutdown()
    inline = Engine(model, tok, EngineConfig(n_slots=2))  # no step loop started: it runs the request itself
    assert inline.warm_up() >= 0 and inline.arena.num_free == 2
    # and the server runs it before it is ready
    seen = []
    monkeypatch.setattr(Engine, "warm_up", lambda self: seen.append(ctx.ready.is_set()) or 0.0)
    from wkvm.config import ServerConfig

    ctx = ServerContext(ServerConfig(model=str(tiny_pth)))
    ctx.load()
    try:
        assert ctx.load_error is None and seen == [False] and ctx.ready.is_set()
    finally:
        ctx.shutdown()


@pytest.mark.allows_5xx  # the failed load's own error line
def test_a_load_that_fails_after_the_warm_up_stops_the_step_loop(tiny_pth, monkeypatch):
    """The step loop starts (and warms up) before the state store opens; a store that cannot open (a directory
    another server holds) fails the load, and the loop it started stops instead of holding the model's memory."""
    from wkvm.config import ServerConfig
    from wkvm.server import context

    def in_use(*args, **kwargs):
        raise OSError("state directory in use by pid 1")

    monkeypatch.setattr(context, "StateStore", in_use)
    threads = []
    warm_up = Engine.warm_up
    monkeypatch.setattr(Engine, "warm_up", lambda self: threads.append(self._thread) or warm_up(self))
    ctx = context.ServerContext(ServerConfig(model=str(tiny_pth)))
    ctx.load()
    assert ctx.load_error is not None and "in use" in ctx.load_error and not ctx.ready.is_set()
    (thread,) = threads  # the loop ran the warm-up, then stopped with the load
    assert thread is not None and not thread.is_alive() and ctx.client.engine._thread is None
