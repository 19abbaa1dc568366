"""The engine: continuous batching is exact, seeds are per request, cancel/preempt/timeout/queue behave."""

import asyncio
import random

import pytest
from conftest import greedy_reference

from wkvm.config import EngineConfig
from wkvm.engine.engine import Engine, EngineClosed, QueueFull
from wkvm.models.rwkv7 import load_rwkv7
from wkvm.sampling_params import SamplingParams
from wkvm.tokenizer import WorldTokenizer


@pytest.fixture(scope="module")
def model(tiny_pth):
    return load_rwkv7(tiny_pth)


@pytest.fixture(scope="module")
def tok():
    return WorldTokenizer()


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


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
