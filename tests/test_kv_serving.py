"""Attention models in the engine and the server: the KV page pool under pressure (grow and preempt), the context
limit, and --max-state-tokens bounding stored states. On the conformance suite's tiny random Llama."""

from __future__ import annotations

import time

import httpx
import pytest
import torch
from conftest import CHAR_VOCAB, greedy_reference, write_char_tokenizer
from families import llama
from live_server import LiveServer

from wkvm.config import EngineConfig
from wkvm.engine.engine import Engine
from wkvm.models import fused
from wkvm.sampling_params import SamplingParams
from wkvm.weights.loader import load_model, load_text_tools


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = llama.write_checkpoint(tmp_path_factory.mktemp("llama") / "model", len(CHAR_VOCAB), 3)
    write_char_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def model(model_dir):
    return load_model(model_dir)


def engine(model, model_dir, pages: int, page_tokens: int = 4, **config) -> Engine:
    kv_bytes = pages * page_tokens * model.spec.token_nbytes
    cfg = EngineConfig(kv_cache_bytes=kv_bytes, kv_page_tokens=page_tokens, **config)
    return Engine(model, load_text_tools(model_dir, model.family)[0], cfg)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def test_a_short_pool_preempts_and_every_answer_is_exact(model, model_dir):
    """Four requests of 8 + 10 tokens need 72 cached tokens; the pool holds 24: requests park (their keys and values
    copied to host) and resume, and each answer equals its run alone."""
    eng = engine(model, model_dir, pages=6, n_slots=4, token_budget=16, prefill_chunk=8)
    prompts = [[(7 * i + j) % len(CHAR_VOCAB) for j in range(8)] for i in range(4)]
    handles = [eng.submit(p, greedy(10)) for p in prompts]
    parked: list[int] = []  # cached tokens of each request parked for want of pages
    park = eng.scheduler.park

    def counting_park(req) -> None:
        parked.append(len(eng.arena.kv[req.slot].pages) if req.slot in eng.arena.kv else 0)
        park(req)

    eng.scheduler.park = counting_park
    eng.run_until_done()
    assert parked and max(parked) > 0  # requests were preempted holding pages
    assert eng.arena.pool is not None and eng.arena.pool.num_free == 6  # every page back
    for p, h in zip(prompts, handles, strict=True):
        assert h.output.token_ids == greedy_reference(model, p, 10)


def peak_pages(pool) -> list[int]:
    """Record the pool's pages in use after every page it hands out (its peak is the list's max)."""
    peak = [pool.n_pages - pool.num_free]
    alloc = pool.alloc

    def counted() -> int:
        page = alloc()
        peak.append(pool.n_pages - pool.num_free)
        return page

    pool.alloc = counted
    return peak


@pytest.mark.parametrize("pages", [400, 70])
def test_n_choices_share_their_prompts_pages(model, model_dir, pages):
    """An n > 1 request's choices start from one prefilled state: each had written it into pages of its own (4 x 50
    pages for a 200-token prompt); they fork one copy now, copy-on-write (each copies the partial last page and
    takes its own for what it generates). With 70 pages (one prompt and a little) they still all finish, exactly."""
    prompt = [(3 * j + 1) % len(CHAR_VOCAB) for j in range(202)]
    eng = engine(model, model_dir, pages=pages, n_slots=4, token_budget=64, prefill_chunk=64)
    assert eng.arena.pool is not None
    peak = peak_pages(eng.arena.pool)
    state = model.prefill(prompt[:-1])[1]
    handles = [eng.submit(prompt[-1:], greedy(8), initial_state=state, base_ids=prompt[:-1]) for _ in range(4)]
    eng.run_until_done()
    want = greedy_reference(model, prompt, 8)
    assert all(h.output.token_ids == want for h in handles)
    shared = -(-201 // 4)  # 51 pages: 50 full and 1 partial
    if pages == 400:  # nothing parked: the prompt once, then per choice its partial page's copy and 2 of its own
        assert max(peak) <= shared + 4 * 3, max(peak)
    assert eng.arena.pool.num_free == pages and not any(eng.arena.pool.refs) and not eng.arena._kept


@pytest.mark.parametrize(("pages", "max_tokens"), [(6, 30), (2, 2)])
def test_kept_pages_never_stop_choices_that_can_run_alone(model, model_dir, pages, max_tokens):
    """Review of the sharing: with one slot, the running choice parked itself for pages its waiting sibling's kept
    copy pinned, and neither could start again (6 pages); a kept first write needs its partial page's copy too, which
    a 2-page pool cannot give (it waited for good). Kept pages go when the pool is short, and a start that cannot keep
    goes alone: both finish, exactly, as before the sharing."""
    prompt = [(3 * j + 1) % len(CHAR_VOCAB) for j in range(6)]
    eng = engine(model, model_dir, pages=pages, n_slots=1, token_budget=16, prefill_chunk=8)
    state = model.prefill(prompt[:-1])[1]
    handles = [eng.submit(prompt[-1:], greedy(max_tokens), initial_state=state, base_ids=prompt[:-1])
               for _ in range(2)]  # fmt: skip
    for _ in range(400):
        if not eng.scheduler.has_work:
            break
        eng.step()
    assert not eng.scheduler.has_work
    n = min(max_tokens, eng.runner.context_limit - len(prompt))  # the pool is the context: 18 tokens with 6 pages
    assert all(h.output.token_ids == greedy_reference(model, prompt, n) for h in handles)
    assert eng.arena.pool is not None and eng.arena.pool.num_free == pages and not eng.arena._kept


def test_an_n_request_over_http_holds_its_prompt_once(model, model_dir):
    """The choices are queued together: queued one by one, a choice the engine admitted before the next was queued
    let the prompt's shared pages go and the next wrote its own copy (a peak of 110 pages, not 62, in a two-process
    suite run on a loaded machine; session 51). Each submit and step here is slowed to make that order certain."""
    import time

    prompt = "".join(sorted(CHAR_VOCAB, key=CHAR_VOCAB.get)[(3 * j + 1) % len(CHAR_VOCAB)] for j in range(200))
    kv_bytes = 400 * 4 * load_model(model_dir).spec.token_nbytes
    with LiveServer(model=str(model_dir), kv_page_tokens=4, kv_cache_bytes=kv_bytes, slots=8) as s:
        engine = s.ctx.client.engine
        submit = engine.submit
        engine.submit = lambda *a, **kw: (submit(*a, **kw), time.sleep(0.1))[0]
        step = engine.step  # and each step, so that a choice admitted alone still runs when the next is queued
        engine.step = lambda: time.sleep(0.05) or step()
        pool = engine.arena.pool
        peak = peak_pages(pool)
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "n": 4}
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert len({c["text"] for c in r.json()["choices"]}) == 1
    n = r.json()["usage"]["prompt_tokens"]
    assert max(peak) <= -(-n // 4) + 4 * 3, max(peak)  # had been 4 copies: 208 pages


def test_a_finished_requests_keys_and_values_are_copied_off_the_step_and_its_pages_come_back(model, model_dir):
    """The final state's keys and values are copied out of the pages on another thread (they had held up every
    stream's step: 45-90 ms at 3.5k SmolLM2 tokens), with torch on one thread there (a second thread's parallel
    regions had made later decode steps 3x slower); the copy equals the slot's state read in the step, and every page
    comes back."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2)  # two even on a one-core machine: the copier's count must differ from the process's
    try:
        copies_off_the_step(model, model_dir)
    finally:
        torch.set_num_threads(before)


def copies_off_the_step(model, model_dir):
    import threading

    import torch

    prompts = [[(5 * i + j) % len(CHAR_VOCAB) for j in range(9 + i)] for i in range(3)]
    states = {}
    for mode in ("copier", "in the step"):
        eng = engine(model, model_dir, pages=24, n_slots=3)
        if mode == "in the step":
            eng._keep_final_state = lambda req, slot, e=eng: setattr(req, "final_state", e.runner.read_state(slot))
        handles = [eng.submit(p, greedy(6), capture_state=True) for p in prompts]
        eng.run_until_done()
        states[mode] = [h.run_result().final_state for h in handles]
        assert eng.arena.pool is not None and eng.arena.pool.num_free == 24
        if mode == "copier":
            assert all(h.request.final_ready is not None for h in handles)
            assert eng._copier.submit(torch.get_num_threads).result() == 1
            # and only there: a new thread of the caller's program still takes the process's count
            other: list[int] = []
            thread = threading.Thread(target=lambda seen=other: seen.append(torch.get_num_threads()))
            thread.start()
            thread.join()
            assert other == [2]
        eng.shutdown()
    for a, b in zip(states["copier"], states["in the step"], strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the copier's one thread is its own: a step loop started after it runs on its creator's threads
    eng = engine(model, model_dir, pages=8, n_slots=1)
    seen: list[int] = []
    step = eng.step
    eng.step = lambda: seen.append(torch.get_num_threads()) or step()
    eng.start()
    h = eng.submit([1, 2, 3], greedy(2))
    deadline = time.monotonic() + 60
    while h.output.finish_reason is None and time.monotonic() < deadline:
        time.sleep(0.01)
    eng.shutdown()
    assert h.output.finish_reason == "length" and set(seen) == {torch.get_num_threads()}


def test_pages_a_pending_copy_holds_are_waited_for_not_preempted_around(model, model_dir, monkeypatch):
    """Review of session 31: while a finished request's copy held its pages, a short pool parked a running request
    (its keys and values copied to host inside the step) and the loop spun through empty steps (22,216 in the repro);
    now the scheduler waits for the copy when, and only when, it is short of pages."""
    from wkvm.engine.kv_pages import SeqKV

    to_dense = SeqKV.to_dense

    def slow(self, pool):
        time.sleep(0.05)
        return to_dense(self, pool)

    monkeypatch.setattr(SeqKV, "to_dense", slow)
    eng = engine(model, model_dir, pages=6, n_slots=2)
    parked, steps = [], []
    park, step = eng.scheduler.park, eng.step
    eng.scheduler.park = lambda req: parked.append(req.request_id) or park(req)
    eng.step = lambda: steps.append(1) or step()
    a = eng.submit([1 + j for j in range(8)], greedy(2), capture_state=True)
    b = eng.submit([20, 21, 22, 23], greedy(12))
    eng.run_until_done()
    assert parked == [] and len(steps) < 40, (parked, len(steps))
    assert a.run_result().final_state is not None and len(b.output.token_ids) == 12
    assert eng.arena.pool is not None and eng.arena.pool.num_free == 6
    a = eng.submit([1 + j for j in range(8)], greedy(2), capture_state=True)
    eng.run_until_done()  # a's copy now holds 3 of the 6 pages for 50 ms
    steps.clear()
    c = eng.submit([2 + j for j in range(19)], greedy(1))  # needs 5 pages
    eng.run_until_done()
    assert len(c.output.token_ids) == 1 and len(steps) < 10, len(steps)  # it had spun through empty steps
    eng.shutdown()


def test_a_request_stopped_inside_its_prompt_keeps_no_state(model, model_dir, tmp_path):
    """Cancelled (or timed out: the same rule) with prompt tokens still unfed, a request's state holds part of its
    history. It is not kept: kept under the whole history, it had been stored as if complete, continued at the wrong
    positions and its own export was refused on import. A state-creating prefill fails instead of returning it, and
    the store refuses a kv state whose length does not fit its token ids."""
    from wkvm.engine.client import PrefillFailed, prefilled_state, submit_prefill
    from wkvm.state.statefile import StateFileError
    from wkvm.state.store import StateStore

    prompt = [(3 * j) % len(CHAR_VOCAB) for j in range(20)]
    eng = engine(model, model_dir, pages=64, n_slots=2, prefill_chunk=4, token_budget=4)
    h = eng.submit(prompt, greedy(5), capture_state=True)
    eng.step()  # 4 of the 20 prompt tokens in
    eng.cancel(h.request_id)
    eng.run_until_done()
    assert h.output.error_code == "cancelled" and h.run_result().final_state is None
    p = submit_prefill(eng, prompt[:-1])
    eng.step()
    eng.cancel(p.request_id)
    eng.run_until_done()
    with pytest.raises(PrefillFailed):
        prefilled_state(p)
    # at a token boundary a cancelled request keeps its state, history and keys and values alike
    h = eng.submit(prompt[:6], greedy(8), capture_state=True)
    while len(h.output.token_ids) < 3:
        eng.step()
    eng.cancel(h.request_id)
    eng.run_until_done()
    run = h.run_result()
    assert run.final_state is not None and model.spec.kv_length(run.final_state) == len(run.history) - 1
    store = StateStore(tmp_path / "states", model.spec, model.fingerprint, model.vocab_size)
    assert store.put("alice", "s", run.final_state, run.history) is not None
    with pytest.raises(StateFileError, match="hold 8 tokens"):
        store.put("alice", "t", run.final_state, run.history + [1])
    eng.shutdown()


def test_context_limit_refuses_long_prompts_and_ends_with_length(model, model_dir):
    eng = engine(model, model_dir, pages=4, n_slots=2)  # 16 tokens in all: the context limit
    assert eng.runner.context_limit == 16
    with pytest.raises(ValueError, match="at most 16 .*--kv-cache-bytes"):
        eng.submit(list(range(16)), greedy(4))
    prompt = list(range(1, 13))
    h = eng.submit(prompt, greedy(50))
    eng.run_until_done()
    assert h.output.finish_reason == "length" and len(h.output.token_ids) == 4  # 12 + 4 = 16
    assert h.output.token_ids == greedy_reference(model, prompt, 4)


def test_a_prompt_over_the_context_limit_is_a_400_also_after_a_reused_prefix(model, model_dir):
    """OpenAI's context_length_exceeded 400 naming the field, whether the prompt is long by itself or resumes a
    checkpoint (the engine's refusal was a 500 over HTTP, found by hand on SmolLM2 with an 8,301-token prompt after an
    8,181-token one); a state is not created at the limit either."""
    with LiveServer(model=str(model_dir), kv_page_tokens=4, kv_cache_bytes=16 * model.spec.token_nbytes) as s:
        c = httpx.Client(base_url=s.url, timeout=60)
        assert c.get("/v1/models").json()["data"][0]["max_model_len"] == 16
        for prompt in (list(range(1, 21)), list(range(1, 17))):
            r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
            r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "n": 2})  # before any prefill
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        assert c.post("/v1/completions", json={"prompt": list(range(1, 13)), "max_tokens": 2}).status_code == 200
        # scoring a prompt (echo, max_tokens 0) may fill the context: it generates nothing (refused before session 54)
        score = {"prompt": list(range(1, 17)), "max_tokens": 0, "echo": True, "logprobs": 1}
        r = c.post("/v1/completions", json=score)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 16, r.text
        assert len(r.json()["choices"][0]["logprobs"]["token_logprobs"]) == 16, r.text
        r = c.post("/v1/completions", json={**score, "prompt": list(range(1, 18))})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        assert "with room" not in r.json()["error"]["message"], r.text
        # vLLM's truncate_prompt_tokens -1: the prompt's end, as much as leaves room for a token (it kept 16 and failed)
        long = {"prompt": list(range(1, 21)), "max_tokens": 2, "truncate_prompt_tokens": -1}
        r = c.post("/v1/completions", json=long)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 15, r.text
        r = c.post("/v1/completions", json={"prompt": list(range(1, 13)) + [5, 6, 7, 8], "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        assert "context is 16 tokens" in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == "prompt"
        chat = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * 40}]})
        assert chat.status_code == 400 and chat.json()["error"]["code"] == "context_length_exceeded", chat.text
        assert chat.json()["error"]["param"] == "messages"  # OpenAI's
        # a state with no room left to generate from is refused as its completion would be (it was stored, unusable)
        r = c.post("/v1/states", json={"name": "full", "prompt_ids": list(range(1, 17))})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        assert r.json()["error"]["param"] == "prompt_ids"
        ok = c.post("/v1/states", json={"name": "room", "prompt_ids": list(range(1, 16))})
        assert ok.status_code == 200 and ok.json()["n_tokens"] == 15, ok.text
        assert c.post("/v1/states/room/generate", json={"max_tokens": 1}).status_code == 200
        # a generation that fills the context is not saved: its state could not be generated from or imported
        r = c.post("/v1/states/room/generate", json={"max_tokens": 4, "save_as": "filled"}).json()
        assert r["state_error"]["code"] == "context_length_exceeded" and "state" not in r, r
        assert c.get("/v1/states/filled").status_code == 404
        metrics = c.get("/metrics").text  # the pool's 4 pages of 4 tokens, none held once every request is done
        assert "wkvm_kv_cache_pages 4.0" in metrics and "wkvm_kv_cache_usage_ratio 0.0" in metrics, metrics
    # with a disk quota too small for it, such a state is still the context's 400, not the quota's 413 ("delete
    # states or raise --state-disk-quota" can never make it fit; hunt, session 46)
    with LiveServer(model=str(model_dir), kv_page_tokens=4, kv_cache_bytes=16 * model.spec.token_nbytes,
                    state_disk_quota=1) as s:  # fmt: skip
        r = httpx.post(f"{s.url}/v1/states", json={"name": "full", "prompt_ids": list(range(1, 17))}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        r = httpx.post(f"{s.url}/v1/states", json={"name": "room", "prompt_ids": list(range(1, 16))}, timeout=60)
        assert r.status_code == 413 and r.json()["error"]["code"] == "state_quota_exceeded", r.text


def test_a_prefill_past_the_request_timeout_ends_n_choices_as_one_and_creates_no_state(model, model_dir):
    """--request-timeout hit in a shared prefill: n choices end with "abort" and nothing generated, as one request
    does (it was a 503, logged as a server error); a state's creation is a 408 naming the flag (a 503 before)."""
    prompt = [(7 * j + 2) % len(CHAR_VOCAB) for j in range(400)]
    with LiveServer(model=str(model_dir), request_timeout=0.001, prefill_chunk=2, token_budget=8) as s:
        c = httpx.Client(base_url=s.url, timeout=60)
        for n in (1, 3):
            r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, "n": n})
            assert r.status_code == 200, r.text
            assert [(x["finish_reason"], x["text"]) for x in r.json()["choices"]] == [("abort", "")] * n, r.text
        r = c.post("/v1/states", json={"name": "late", "prompt_ids": prompt})
        assert r.status_code == 408 and "--request-timeout" in r.json()["error"]["message"], r.text
        assert r.json()["error"]["code"] == "timeout" and c.get("/v1/states").json()["data"] == []


def test_an_attention_turn_keeps_one_checkpoint_and_later_prompts_reuse_any_prefix_of_it(model, model_dir):
    """Keys and values cut to any shorter history are exact, so a turn's final state serves every prefix: no prompt-end
    or branch checkpoint is taken besides it (each had cost the engine a copy of the context, a hash and the memory)."""
    with LiveServer(model=str(model_dir)) as s:
        c = httpx.Client(base_url=s.url, timeout=60)

        def complete(prompt: list[int], n: int) -> dict:
            r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": n, "temperature": 0,
                                                "ignore_eos": True, "return_token_ids": True})  # fmt: skip
            assert r.status_code == 200, r.text
            return r.json()

        def checkpoints() -> list[str]:
            return sorted(r.op_params["kind"] for r in s.ctx.store.index.list("anonymous#ckpt"))

        prompt = [(5 * j + 3) % len(CHAR_VOCAB) for j in range(12)]
        out = complete(prompt, 4)["choices"][0]["token_ids"]
        assert checkpoints() == ["turn_end"]
        for later, reused in ((prompt + out[:3] + [7, 8], 15), (prompt[:6] + [1, 2, 3], 6)):
            r = complete(later, 3)
            assert r["wkvm"]["reused_tokens"] == reused, r
            assert r["choices"][0]["token_ids"] == greedy_reference(model, later, 3)
        assert checkpoints() == ["turn_end"] * 3


def test_a_turn_too_long_to_store_keeps_its_prompt_cut_from_its_final_state(model, model_dir):
    """Review of session 31: with no prompt-end copy taken, an answer that made the final state longer than
    --max-state-tokens left no checkpoint at all (the prompt-end one had kept 11 tokens reusable)."""
    with LiveServer(model=str(model_dir), max_state_tokens=20) as s:
        c = httpx.Client(base_url=s.url, timeout=60)
        prompt = [(3 * j + 1) % len(CHAR_VOCAB) for j in range(12)]
        body = {"max_tokens": 16, "temperature": 0, "ignore_eos": True}
        assert c.post("/v1/completions", json={"prompt": prompt, **body}).status_code == 200
        assert [r.op_params["kind"] for r in s.ctx.store.index.list("anonymous#ckpt")] == ["prompt_end"]
        r = c.post("/v1/completions", json={"prompt": prompt + [4, 5], **body, "max_tokens": 3}).json()
        assert r["wkvm"]["reused_tokens"] == 11, r["wkvm"]
        assert r["choices"][0]["text"] == c.post("/v1/completions", json={"prompt": prompt + [4, 5], **body,
                                                 "max_tokens": 3, "cache_salt": "cold"}).json()["choices"][0]["text"]


def test_max_state_tokens_bounds_saves_and_imports(model_dir, tmp_path):
    prompt = list(range(1, 21))
    with LiveServer(model=str(model_dir), state_dir=str(tmp_path / "a")) as big:
        c = httpx.Client(base_url=big.url, timeout=60)
        assert c.post("/v1/states", json={"name": "long", "prompt_ids": prompt}).status_code == 200
        data = c.get("/v1/states/long/export").content
    with LiveServer(model=str(model_dir), state_dir=str(tmp_path / "b"), max_state_tokens=8) as small:
        c = httpx.Client(base_url=small.url, timeout=60)
        r = c.post("/v1/states", json={"name": "long", "prompt_ids": prompt})  # refused before its prefill
        says = r.json()["error"]["message"]
        assert r.status_code == 400 and "at most 9 tokens (8 cached, --max-state-tokens)" in says, r.text
        assert (r.json()["error"]["param"], r.json()["error"]["code"]) == ("prompt_ids", "history_too_long"), r.text
        r = c.post("/v1/states/import", content=data, headers={"Content-Type": "application/octet-stream"})
        assert r.status_code == 400 and "at most 8" in r.json()["error"]["message"], r.text
        r = c.post("/v1/completions", json={"prompt": prompt[:5], "max_tokens": 10, "save_state": "s"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "history_too_long", r.text
        ok = c.post("/v1/states", json={"name": "short", "prompt_ids": prompt[:9]})  # 8 cached + 1 pending
        assert ok.status_code == 200, ok.text
    # a state stored under a larger limit stays usable after a restart with a smaller one: nothing is stranded
    with LiveServer(model=str(model_dir), state_dir=str(tmp_path / "a"), max_state_tokens=8) as restarted:
        c = httpx.Client(base_url=restarted.url, timeout=60)
        assert c.post("/v1/states/long/generate", json={"max_tokens": 2}).status_code == 200
        assert c.post("/v1/states/long/hibernate", json={"tier": "disk"}).status_code == 200
        exported = c.get("/v1/states/long/export")
        assert exported.status_code == 200 and abs(len(exported.content) - len(data)) < 256  # the header may differ


def test_float16_keys_and_values(model, model_dir, monkeypatch):
    """`--kv-dtype float16`: pages of half the bytes (twice as many for the same budget); answers within float16's
    rounding of fp32's, a request's answer independent of its batch, decode on the fused kernel equal to the torch
    path, and states (what files and parked copies hold) in the spec's fp32, back into pages without loss."""
    from wkvm.engine.kv_pages import PagePool, SeqKV
    from wkvm.models import fused

    prompts = [[(7 * i + j) % len(CHAR_VOCAB) for j in range(8)] for i in range(4)]

    def run(batch: list[list[int]], kv_dtype: str) -> tuple[Engine, list[tuple[list[int], list[dict[int, float]]]]]:
        eng = engine(model, model_dir, pages=64, n_slots=4, token_budget=16, prefill_chunk=8, kv_dtype=kv_dtype)
        params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=1)
        handles = [eng.submit(p, params) for p in batch]
        eng.run_until_done()
        return eng, [(h.output.token_ids, h.output.logprobs) for h in handles]

    eng32, exact = run(prompts, "float32")
    eng16, half = run(prompts, "float16")
    assert eng32.arena.pool is not None and eng16.arena.pool is not None
    assert eng16.arena.pool.n_pages == 2 * eng32.arena.pool.n_pages
    assert all(p.dtype == torch.float16 for p in eng16.arena.pool.pages.values())
    for (t32, l32), (t16, l16) in zip(exact, half, strict=True):
        assert t16 == t32  # measured: logprobs within 1.6e-3 here
        assert max(abs(a[t] - b[t]) for a, b in zip(l32, l16, strict=True) for t in a.keys() & b.keys()) < 1e-2
    assert [run([p], "float16")[1][0] for p in prompts] == half  # alone == batched, to the bit
    with monkeypatch.context() as m:
        m.setattr(fused, "pages_fit", lambda *a: False)
        torch_path = run(prompts, "float16")[1]
    for (t1, l1), (t2, l2) in zip(half, torch_path, strict=True):
        assert t1 == t2
        assert max(abs(a[t] - b[t]) for a, b in zip(l1, l2, strict=True) for t in a.keys() & b.keys()) < 1e-4
    pool = PagePool(model.spec, 8, 4, dtype=torch.float16)
    dense = {name: torch.randn(6, *pages.shape[2:]).half().float() for name, pages in pool.pages.items()}
    seq = SeqKV.from_dense(pool, dense)
    back = seq.to_dense(pool)
    assert all(back[k].dtype == torch.float32 and torch.equal(back[k], dense[k]) for k in dense)


def test_an_import_beyond_float16_is_refused_where_the_pages_are_float16(model, model_dir, tmp_path):
    """A key or value above float16's 65,504 (inside the file's own 1e6 bound) would be inf in float16 pages and the
    attention over it garbage: a server with float16 pages refuses its import with a 400 naming the tensor (a hunt
    in session 46 got finite answers from such a state, where the docs promised non_finite); float32 pages take it."""
    from wkvm.state import statefile

    with LiveServer(model=str(model_dir), kv_dtype="float32", state_dir=str(tmp_path / "a")) as s:
        c = httpx.Client(base_url=s.url, timeout=60)
        assert c.post("/v1/states", json={"name": "st", "prompt_ids": list(range(1, 9))}).status_code == 200
        tensors, meta = statefile.decode(c.get("/v1/states/st/export").content, model.spec, model.fingerprint,
                                         model.vocab_size)  # fmt: skip
        key = next(t.name for t in model.spec.tensors if t.paged)
        tensors[key].view(-1)[3] = 1e5
        big = statefile.encode(model.spec, tensors, meta)
        octet = {"Content-Type": "application/octet-stream"}
        assert c.post("/v1/states/import?name=big", content=big, headers=octet).status_code == 200
    with LiveServer(model=str(model_dir), kv_dtype="float16", state_dir=str(tmp_path / "b")) as s:
        r = httpx.post(f"{s.url}/v1/states/import?name=big", content=big, headers=octet, timeout=60)
        assert r.status_code == 400 and f"tensor {key} holds a value of magnitude 1e+05" in r.text, r.text
        assert "float16 pages" in r.json()["error"]["message"]
        tensors[key].view(-1)[3] = 6e4  # within float16's range: taken
        r = httpx.post(f"{s.url}/v1/states/import?name=ok", content=statefile.encode(model.spec, tensors, meta),
                       headers=octet, timeout=60)  # fmt: skip
        assert r.status_code == 200, r.text
    # stored by the float32 server (or `wkvm states import --state-dir`, which cannot know the pages): refused when
    # a float16 server is asked to go on from it (it had answered 200 with garbage text; hunt, session 48)
    with LiveServer(model=str(model_dir), kv_dtype="float16", state_dir=str(tmp_path / "a")) as s:
        c = httpx.Client(base_url=s.url, timeout=60)
        for route, body, param in (("states/big/generate", {"prompt_ids": [1]}, "handle"),
                                   ("completions", {"prompt": [1], "state": "big"}, "state")):  # fmt: skip
            r = c.post(f"/v1/{route}", json={**body, "max_tokens": 2})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
            assert f"tensor {key} holds a value of magnitude 1e+05" in r.text and "float16 pages" in r.text, r.text
        assert c.post("/v1/states/st/generate", json={"prompt_ids": [1], "max_tokens": 2}).status_code == 200


def test_kv_dtype_auto_follows_the_weights(model_dir, tmp_path):
    """`wkvm serve`'s --kv-dtype auto (the default): float32 pages for float32 weights (exact against transformers),
    float16 for every rounded weight dtype (as llama.cpp's f16 cache; docs/design-paged-kv.md); an explicit choice
    wins, and a wrong one names the choices before anything loads."""
    from wkvm.cli_chat import ChatREPL
    from wkvm.config import ServerConfig
    from wkvm.llm import LLM

    assert ServerConfig().kv_dtype == "auto"
    chosen = {d: ServerConfig(dtype=d).engine_config().kv_dtype for d in ("float32", "fp32", "bfloat16", "bf16",
                                                                          "int8", "int4", "INT8")}  # fmt: skip
    assert chosen == {"float32": "float32", "fp32": "float32", "bfloat16": "float16", "bf16": "float16",
                      "int8": "float16", "int4": "float16", "INT8": "float16"}  # fmt: skip
    assert ServerConfig(dtype="int8", kv_dtype="float32").engine_config().kv_dtype == "float32"
    assert ServerConfig(dtype="float32", kv_dtype="float16").engine_config().kv_dtype == "float16"
    with pytest.raises(ValueError, match="kv_dtype 'bf16' is not supported; use auto, float32, float16"):
        ServerConfig(kv_dtype="bf16")
    # the CLI takes the names LLM(kv_dtype=...) takes ('fp16' had been refused by its choices)
    from wkvm.cli import build_parser

    for given, kv in (("fp16", "float16"), ("HALF", "float16"), ("fp32", "float32"), ("Auto", "auto")):
        assert ServerConfig(kv_dtype=build_parser().parse_args(["serve", "--kv-dtype", given]).kv_dtype).kv_dtype == kv

    def page_dtype(eng: Engine) -> torch.dtype:
        assert eng.arena.pool is not None
        return next(iter(eng.arena.pool.pages.values())).dtype

    def pages(**kw) -> torch.dtype:  # LLM() (the offline API) resolves auto alike
        return page_dtype(LLM(str(model_dir), **kw).engine)

    assert pages() == pages(kv_dtype="auto") == pages(dtype="int8", kv_dtype="float32") == torch.float32
    assert pages(dtype="int8") == pages(dtype="float32", kv_dtype="float16") == torch.float16
    assert pages(dtype="int8", config=EngineConfig(kv_dtype="float32")) == torch.float32  # a given config is kept
    for dtype, want in (("int4", torch.float16), ("float32", torch.float32)):  # `wkvm chat` alike
        chat = ChatREPL(str(model_dir), tmp_path / dtype, SamplingParams(max_tokens=1), dtype=dtype)
        assert page_dtype(chat.engine) == want


def test_the_torch_attention_path_is_batch_independent(model, model_dir, monkeypatch):
    """Without the fused decode op (no compiler, WKVM_FUSED=off, an odd head size) rows attend one at a time: each
    request's tokens and logprobs equal its run alone, to the bit (they differed at float rounding when rows were
    padded into one masked batch)."""
    from wkvm.models import fused

    monkeypatch.setattr(fused, "pages_fit", lambda *a: False)
    prompts = [[(5 * i + 3 * j) % len(CHAR_VOCAB) for j in range(3 + 2 * i)] for i in range(4)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)

    def run(batch: list[list[int]]) -> list[tuple[list[int], list[dict[int, float]]]]:
        eng = engine(model, model_dir, pages=64, n_slots=4, token_budget=16, prefill_chunk=4)
        handles = [eng.submit(p, params) for p in batch]
        eng.run_until_done()
        return [(h.output.token_ids, h.output.logprobs) for h in handles]

    assert run(prompts) == [run([p])[0] for p in prompts]


@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])  # float16: `wkvm serve`'s default for int8 / int4
@pytest.mark.parametrize("dtype", ["int8", "int4", "float32"])
def test_a_prompt_has_the_bits_of_stepping_however_it_is_chunked_or_resumed(model_dir, dtype, kv_dtype):
    """Where a Llama's matmuls are row-independent (`rows_alone`: the int8 / int4 kernels, fp32 on the gemv kernel
    up to its rows) attention takes a chunk's tokens one at a time on the decode kernel, so prefilling a prompt in
    chunks of any size, resuming it from a state of its first tokens, or scoring it (prompt logprobs) gives the
    tokens and logprobs of feeding it token by token, to the bit. (With int8 / int4 the torch attention's rounding
    differences had become other tokens: the kernels round their inputs to int8.) Elsewhere only to rounding."""
    m = load_model(model_dir, dtype=dtype)
    prompt = [(7 * j + 3) % len(CHAR_VOCAB) for j in range(23)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2)

    def run(chunk: int, start: int = 0, **extra) -> tuple[list[int], list[dict[int, float]]]:
        eng = engine(m, model_dir, pages=64, n_slots=2, token_budget=64, prefill_chunk=chunk, kv_dtype=kv_dtype)
        state, base = None, None
        if start:  # a state of the prompt's first `start` tokens (a one-token answer's history but its last token)
            h = eng.submit(prompt[:start], SamplingParams(max_tokens=1, temperature=0), capture_state=True)
            eng.run_until_done()
            state, base = h.run_result().final_state, prompt[:start]
        h = eng.submit(prompt[len(base or []) :], SamplingParams(**{**params.__dict__, **extra}), initial_state=state,
                       base_ids=base)  # fmt: skip
        eng.run_until_done()
        return h.output.token_ids, h.output.logprobs

    want = run(1)  # token by token
    exact = m.rows_alone(len(prompt))
    for got in (run(64), run(5), run(64, start=9), run(4, start=16), run(64, prompt_logprobs=1)):
        assert got[0] == want[0]
        if exact:
            assert got[1] == want[1]  # every logprob, to the bit
        else:
            for a, b in zip(got[1], want[1], strict=True):
                assert max(abs(a[t] - b[t]) for t in a.keys() & b.keys()) < 1e-3


def test_long_chunks_attend_through_torch_where_the_fused_attention_cannot_group_rows(model_dir, monkeypatch):
    """Built without AVX2 + FMA or AVX-512 the fused attention takes each of a chunk's rows alone
    (`fused.narrow_attention`), several times slower than torch's on a long chunk (SmolLM2 int8's engine prefill of
    1,024 tokens ran 0.72x that way on an AVX2-only Zen 3 before the AVX2 grouped rows): there a chunk of more than
    UNGROUPED_ROWS tokens attends through torch (to rounding), a shorter one still a token at a time (stepping's bits).
    Where rows are grouped, every length a token at a time. Either way a long prompt answers as it does token by
    token."""
    from wkvm.models import int8
    from wkvm.models.llama import model as llama_model

    m = load_model(model_dir, dtype="int8")  # (the tiny model's int4 matrices are not all int4: K is not 32 k)
    n = fused.UNGROUPED_ROWS
    if not m.rows_alone(n):
        pytest.skip("no native int8 kernel here: every chunk attends through torch")
    if int8.kernel_for(m.weights.layer(0)[llama_model.LINEAR[0]], 2 * n) is None:
        # (session 58, the path forced on an AMD EPYC Zen 4: a token differed at the sixth)
        pytest.skip(f"the int8 kernel does not take {2 * n} rows here (AVX-512BW without VNNI dequantizes more than "
                    f"{int8.KERNEL_ROWS} for oneDNN, x not rounded to int8): a long chunk answers to that rounding, "
                    "not as token by token")  # fmt: skip
    monkeypatch.setattr(fused, "narrow_attention", lambda: True)
    assert m.rows_alone(n) and not m.rows_alone(n + 1)
    prompt = [(5 * j + 2) % len(CHAR_VOCAB) for j in range(2 * n)]

    def tokens(chunk: int) -> list[int]:
        eng = engine(m, model_dir, pages=64, n_slots=1, token_budget=128, prefill_chunk=chunk)
        h = eng.submit(prompt, greedy(8))
        eng.run_until_done()
        return h.output.token_ids

    assert tokens(2 * n) == tokens(1)
    monkeypatch.setattr(fused, "narrow_attention", lambda: False)
    assert m.rows_alone(4 * n) == (int8.kernel_path() in int8.ALL_SIZES)


def test_the_fused_attention_groups_a_chunks_rows_on_every_cpu_with_avx2_and_fma():
    """AVX2 + FMA is every x86 CPU CI runs on: there the fused attention groups a prompt chunk's rows
    (`scores_lanes` over eight tokens a vector), so Llama's long chunks keep stepping's bits (the next test). Until
    session 53 only an AVX-512 build did, and AVX2-only CPUs attended long chunks through torch's SDPA."""
    from wkvm.models import int8

    flags = int8.cpu_flags().split()
    if not fused.available() or fused.MARCH != "native" or not {"avx2", "fma"} <= set(flags):
        pytest.skip("the fused kernel is not built here for this CPU's AVX2 + FMA (no compiler, another -march, or a "
                    "CPU without them)")  # fmt: skip
    assert not fused.narrow_attention()


def test_a_long_chunk_has_the_bits_of_stepping_where_the_fused_attention_groups_rows(tmp_path):
    """A prompt of more than UNGROUPED_ROWS tokens in one chunk, its tokens as rows of the fused attention's groups,
    gives the tokens and logprobs of feeding it token by token, to the bit (int8 matrices, float16 pages as `wkvm
    serve` keeps them; head size 16 and three query heads a kv head, as SmolLM2's 64 and 3: sizes the groups take)."""
    model_dir = llama.write_checkpoint(tmp_path / "model", len(CHAR_VOCAB), 4, head_dim=16)
    write_char_tokenizer(model_dir)
    m = load_model(model_dir, dtype="int8")
    n = 2 * fused.UNGROUPED_ROWS + 5
    if fused.narrow_attention() or not m.rows_alone(n):
        pytest.skip("no int8 kernel path that takes 69 rows (none built, or AVX-512BW without VNNI), or a fused "
                    "attention that does not group rows (no AVX2 + FMA build)")  # fmt: skip
    prompt = [(5 * j + 2) % len(CHAR_VOCAB) for j in range(n)]

    def run(chunk: int) -> tuple[list[int], list[dict[int, float]]]:
        eng = engine(m, model_dir, pages=64, n_slots=1, token_budget=128, prefill_chunk=chunk, kv_dtype="float16")
        h = eng.submit(prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2))
        eng.run_until_done()
        return h.output.token_ids, h.output.logprobs

    assert run(n) == run(1)


def test_a_models_generation_config_sets_the_sampling_a_request_leaves_out(model, model_dir, tmp_path):
    """vLLM's `--generation-config auto` (its default): a request without temperature / top_p / top_k / min_p /
    repetition_penalty takes the model's generation_config.json values (wkvm had sampled such a request at OpenAI's
    temperature 1 whatever the model's authors set). Here the file sets top_k 1: left out, the answer is greedy; a
    request that sets top_k, or a server with --generation-config none, samples as before."""
    import shutil

    from wkvm.llm import LLM

    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    # every value the file sets is a setting (temperature 1.0 too, a no-op); min_p -1 is refused
    (copy / "generation_config.json").write_text('{"top_k": 1, "top_p": 0.9, "temperature": 1.0, "min_p": -1}')
    prompt = [(3 * j + 1) % len(CHAR_VOCAB) for j in range(6)]
    greedy_ids = greedy_reference(model, prompt, 12)
    body = {"prompt": prompt, "max_tokens": 12, "seed": 7, "ignore_eos": True, "return_token_ids": True}

    def ids(s, **extra) -> list[int]:
        r = httpx.post(f"{s.url}/v1/completions", json={**body, **extra}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    with LiveServer(model=str(copy), slots=2) as c:
        assert ids(c) == greedy_ids and ids(c, top_k=None) == greedy_ids  # null is "left out", as in vLLM
        sampled = ids(c, top_k=-1)  # the request's own top_k wins (top_p 0.9 still from the file)
        assert sampled != greedy_ids and ids(c, top_k=-1, top_p=0.9) == sampled
    with LiveServer(model=str(copy), slots=2, generation_config="none") as c:
        assert ids(c) == ids(c, top_k=-1, top_p=1.0) != greedy_ids
    llm = LLM(str(copy))
    defaults = llm.get_default_sampling_params()
    assert (defaults.top_k, defaults.top_p, defaults.temperature, defaults.min_p) == (1, 0.9, 1.0, 0.0)
    assert llm.generate([{"prompt_token_ids": prompt}])[0].outputs[0].token_ids == greedy_reference(model, prompt, 16)
    assert LLM(str(copy), generation_config="none").get_default_sampling_params().top_k == 0


def test_chat_template_kwargs_reach_the_template(model_dir, tmp_path):
    """vLLM's `chat_template_kwargs` (Qwen3's `enable_thinking`) had been ignored with a log line: a template that reads
    such a variable rendered as if it were unset. They are template variables now (chat, /tokenize, LLM.chat); a name
    the request sets itself is a 400, and a per-request `chat_template` is refused as vLLM refuses it by default."""
    import shutil

    from wkvm.llm import LLM

    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    (copy / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}N{% else %}T{% endif %}")
    messages = [{"role": "user", "content": "Hi"}]
    with LiveServer(model=str(copy), slots=2) as s:
        def post(path, **body):
            return httpx.post(f"{s.url}{path}", json={"messages": messages, **body}, timeout=60)

        def strs(**body) -> str:
            r = post("/tokenize", return_token_strs=True, **body)
            assert r.status_code == 200, r.text
            return "".join(r.json()["token_strs"])

        assert strs() == "HiT" and strs(chat_template_kwargs={"enable_thinking": False}) == "HiN"
        chat = {"max_tokens": 2, "temperature": 0, "return_token_ids": True}
        off = post("/v1/chat/completions", chat_template_kwargs={"enable_thinking": False}, **chat)
        on = post("/v1/chat/completions", **chat)
        assert off.status_code == on.status_code == 200, off.text
        assert off.json()["usage"]["prompt_tokens"] == on.json()["usage"]["prompt_tokens"] == 3
        assert off.json()["prompt_token_ids"] != on.json()["prompt_token_ids"]
        for body, param in (({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
                            ({"chat_template": "{{ 1 }}"}, "chat_template")):  # fmt: skip
            r = post("/v1/chat/completions", **body, **chat)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    out = LLM(str(copy)).chat(messages, chat_template_kwargs={"enable_thinking": False})
    assert out[0].prompt == "HiN"


def test_wkvm_states_import_into_a_directory_checks_the_context(tmp_path, capsys):
    """`wkvm states import --state-dir` refuses a state that fills the model's context, as a server's import does (it
    stored it: hunt, session 48); a state within it is taken."""
    from wkvm.cli import main
    from wkvm.state.store import StateStore

    path = llama.write_checkpoint(tmp_path / "m", len(CHAR_VOCAB), 3, max_position_embeddings=8)
    write_char_tokenizer(path)
    m = load_model(path)
    store = StateStore(tmp_path / "sd", m.spec, m.fingerprint, m.vocab_size)
    for name, n in (("full", 8), ("room", 7)):
        _, state = m.prefill(list(range(1, n)))
        store.put("local", name, state, list(range(1, n + 1)))
    store.close()
    base = ["--state-dir", str(tmp_path / "sd"), "--model", str(path)]
    for name in ("full", "room"):
        assert main(["states", "export", name, str(tmp_path / f"{name}.state"), *base]) == 0
    capsys.readouterr()
    assert main(["states", "import", str(tmp_path / "full.state"), "--name", "again", *base]) != 0
    assert "leaves no room to generate within this model's context of 8 tokens" in capsys.readouterr().err
    assert main(["states", "import", str(tmp_path / "room.state"), "--name", "again", *base]) == 0
