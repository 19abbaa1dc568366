"""Unit tests on hand-built inputs: the prefix trie, the RAM tier cache, the sampler's filters and penalties,
and every reason a parked chat session is refused."""

import asyncio
import json
import math

import pytest
import torch
from torch.testing import assert_close

from wkvm.engine.sampler import SamplerRow, apply_penalties, draw, filtered_probs, top_p_filter, uniform
from wkvm.models.spec import StateSpec, TensorSpec
from wkvm.sampling_params import SamplingParams
from wkvm.state.prefix import PrefixTrie
from wkvm.state.sessions import ChatSessions, Session
from wkvm.state.tiers import TierCache


def keys(checkpoints) -> list[str]:
    return [c.key for c in checkpoints]


def test_trie_finds_the_longest_checkpoint_leaving_a_token_to_feed():
    trie = PrefixTrie(capacity=8)
    assert trie.insert([1, 2, 3, 4], "a", "turn_end") == []
    assert trie.insert([1, 2, 3], "b", "prompt_end") == []
    a = trie.longest([1, 2, 3, 4, 5])
    assert (a.key, a.n_fed, a.kind, a.full_ids) == ("a", 3, "turn_end", (1, 2, 3, 4))
    assert trie.longest([1, 2, 3, 4]).key == "a"  # holds 1, 2, 3; token 4 is still to feed
    assert trie.longest([1, 2, 3]).key == "b"  # "a" holds every token of this prompt: nothing would be left
    assert trie.longest([1, 2]) is None
    assert trie.longest([1, 2, 9, 9]).key == "b"
    assert trie.longest([2, 1, 2, 3, 4]) is None  # a prefix, not any substring
    assert len(trie) == 2


def test_trie_remove_prunes_and_keeps_the_rest():
    trie = PrefixTrie(capacity=8)
    trie.insert([1, 2, 3, 4], "a", "turn_end")
    trie.insert([1, 2, 3], "b", "prompt_end")
    assert trie.remove([1, 2, 3]).key == "a"
    assert trie.remove([1, 2, 3]) is None and trie.remove([7]) is None
    assert trie.longest([1, 2, 3, 4, 5]).key == "b" and len(trie) == 1
    assert trie.root.children[1].children[2].children == {}  # the emptied branch is gone
    assert trie.remove([1, 2]).key == "b"
    assert trie.root.children == {} and len(trie) == 0


def test_trie_replaces_a_key_and_evicts_least_recently_used():
    trie = PrefixTrie(capacity=2)
    trie.insert([1, 2], "x", "turn_end")
    assert trie.insert([1, 2], "x", "turn_end") == []  # the same key again: nothing to discard
    assert keys(trie.insert([1, 2], "x2", "turn_end")) == ["x"]  # same tokens, new key: the old one is returned
    trie.insert([5, 6], "y", "turn_end")
    assert trie.longest([1, 2, 3]).key == "x2"  # a lookup makes x2 the most recently used
    assert keys(trie.insert([7, 8], "z", "turn_end")) == ["y"]
    assert len(trie) == 2 and trie.longest([5, 6, 7]) is None
    assert keys(trie.insert([9, 9], "w", "turn_end")) == ["x2"]
    assert [trie.longest(p).key for p in ([7, 8, 0], [9, 9, 0])] == ["z", "w"]


def test_tries_count_their_nodes_in_a_shared_count():
    """Each stored token is a node on the heap: tries sharing a NodeCount keep it exact through inserts, replaced
    keys, evictions and removals (ChatSessions bounds the nodes of all scopes' tries by it)."""
    from wkvm.state.prefix import NodeCount

    count = NodeCount()
    a, b = PrefixTrie(capacity=2, count=count), PrefixTrie(capacity=8, count=count)
    a.insert([1, 2, 3, 4], "a1", "turn_end")  # 3 nodes (the pending token is not stored)
    a.insert([1, 2, 9, 9], "a2", "turn_end")  # 1 more (9): 1, 2 shared
    b.insert([5, 6], "b1", "turn_end")
    assert (a.nodes, b.nodes, count.n) == (4, 1, 5)
    assert keys(a.insert([7, 7], "a3", "turn_end")) == ["a1"]  # capacity 2: a1 goes, its branch 3 pruned
    assert (a.nodes, count.n) == (4, 5)
    assert a.pop_oldest().key == "a2" and (a.nodes, count.n) == (1, 2)
    assert b.remove_key("b1").key == "b1" and a.pop_oldest().key == "a3" and a.pop_oldest() is None
    assert count.n == 0 and a.root.children == {} and b.root.children == {}


def test_trie_longest_shared_cuts_any_checkpoint_below_the_deepest_match():
    trie = PrefixTrie(capacity=8)
    assert trie.longest_shared([1, 2, 3]) is None
    trie.insert([1, 2, 3, 4, 5, 6], "long", "turn_end")  # holds 1..5
    cp, n = trie.longest_shared([1, 2, 3, 9, 9])
    assert (cp.key, n) == ("long", 3)  # shares 1, 2, 3: cut to them
    assert trie.longest_shared([1, 2, 3, 4, 5, 6, 7])[1] == 5  # all it holds
    assert trie.longest_shared([1, 2, 3, 4])[1] == 3  # one token left to feed
    assert trie.longest_shared([1]) is None and trie.longest_shared([9, 1, 2]) is None
    trie.insert([1, 2, 7, 8], "side", "turn_end")
    assert trie.longest_shared([1, 2, 7, 0]) == (trie.longest([1, 2, 7, 8, 0]), 3)
    trie.remove([1, 2, 3, 4, 5])
    assert trie.longest_shared([1, 2, 3, 0]) == (trie.longest([1, 2, 7, 8, 0]), 2)  # only "side" shares 1, 2


def test_state_cut_keeps_the_first_tokens_of_kv_only_states():
    kv = StateSpec("attn", (TensorSpec("layers.0.k", (2, 3), kind="kv"), TensorSpec("layers.0.v", (2, 3), kind="kv")))
    state = {"layers.0.k": torch.randn(1, 5, 2, 3), "layers.0.v": torch.randn(1, 5, 2, 3)}
    cut = kv.cut(state, 2)
    assert kv.cuttable and kv.kv_length(cut) == 2 and torch.equal(cut["layers.0.v"], state["layers.0.v"][:, :2])
    with pytest.raises(ValueError, match="cannot cut"):
        kv.cut(state, 6)
    mixed = StateSpec("hybrid", kv.tensors + (TensorSpec("layers.1.s", (4,)),))
    with pytest.raises(ValueError, match="fixed-size"):
        mixed.cut({**state, "layers.1.s": torch.zeros(1, 4)}, 2)
    assert not mixed.cuttable and not StateSpec("empty", ()).cuttable


def blob(n: int) -> dict[str, torch.Tensor]:
    return {"t": torch.zeros(n, dtype=torch.uint8)}


def test_tier_cache_is_a_byte_bounded_lru():
    cache = TierCache(100, is_pinned=lambda b: False)
    assert cache.put("a", blob(40)) == [] and cache.put("b", blob(40)) == []
    assert cache.nbytes == 80
    assert cache.get("a") is not None  # a is now the most recently used
    evicted = cache.put("c", blob(40))
    assert [b for b, _ in evicted] == ["b"] and evicted[0][1]["t"].numel() == 40
    assert list(cache.items) == ["a", "c"] and cache.nbytes == 80 and "b" not in cache
    assert cache.put("c", blob(50)) == [] and cache.nbytes == 90  # the same blob again: counted once
    assert [b for b, _ in cache.put("d", blob(100))] == ["a", "c"] and cache.nbytes == 100
    assert cache.get("a") is None and cache.pop("d")["t"].numel() == 100 and cache.nbytes == 0


def test_tier_cache_never_evicts_pins_and_refuses_what_cannot_fit():
    pinned = {"p"}
    cache = TierCache(100, is_pinned=lambda b: b in pinned)
    cache.put("p", blob(60))
    cache.put("a", blob(30))
    assert [b for b, _ in cache.put("b", blob(40))] == ["a"]  # p is older but pinned
    assert list(cache.items) == ["p", "b"] and cache.nbytes == 100
    before = (list(cache.items), dict(cache.sizes), cache.nbytes)
    assert cache.put("big", blob(41)) is None  # 100 - 60 pinned bytes leave 40: b would go and still not do
    assert (list(cache.items), dict(cache.sizes), cache.nbytes) == before and "big" not in cache
    pinned.discard("p")
    assert [b for b, _ in cache.put("big", blob(41))] == ["p"] and cache.nbytes == 81


LOGITS = torch.log(torch.tensor([0.1, 0.2, 0.3, 0.4]))
ROOTS = [math.sqrt(p) for p in (0.1, 0.2, 0.3, 0.4)]


FILTER_CASES = [
    (dict(), [0.1, 0.2, 0.3, 0.4]),
    (dict(temperature=0.5), [1 / 30, 4 / 30, 9 / 30, 16 / 30]),  # p ** (1 / T), normalized
    (dict(temperature=2.0), [r / sum(ROOTS) for r in ROOTS]),
    (dict(top_k=2), [0, 0, 3 / 7, 4 / 7]),
    (dict(top_k=4), [0.1, 0.2, 0.3, 0.4]),
    (dict(top_p=0.5), [0, 0, 3 / 7, 4 / 7]),  # 0.4 alone < 0.5: the smallest set reaching it adds 0.3
    (dict(top_p=0.8), [0, 2 / 9, 3 / 9, 4 / 9]),
    (dict(min_p=0.6), [0, 0, 3 / 7, 4 / 7]),  # below 0.6 * 0.4 = 0.24 goes
    (dict(min_p=0.3), [0, 2 / 9, 3 / 9, 4 / 9]),  # below 0.12 goes
    (dict(temperature=0.5, top_k=3), [0, 4 / 29, 9 / 29, 16 / 29]),  # temperature first, then the filters
    # min-p, then top-p on what it leaves, as vLLM orders them: 4/7 alone reaches 0.5 (top-p first had kept 3/7 too;
    # sampling hunt, session 48)
    (dict(top_p=0.5, min_p=0.6), [0.0, 0.0, 0.0, 1.0]),
]


def case_id(params: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in params.items()) or "defaults"


@pytest.mark.parametrize("params, expected", FILTER_CASES, ids=[case_id(p) for p, _ in FILTER_CASES])
def test_filtered_probs(params, expected):
    assert_close(filtered_probs(LOGITS, SamplingParams(**params)), torch.tensor(expected), atol=2e-5, rtol=0)


PENALTY_LOGITS = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])


PENALTY_CASES = [
    (dict(frequency_penalty=0.5), [2 - 2 * 0.5, -1.0, 0.5, 3 - 0.5, -2.0]),  # token 0 came out twice, 3 once
    (dict(presence_penalty=0.25), [2 - 0.25, -1.0, 0.5, 3 - 0.25, -2.0]),
    (dict(frequency_penalty=0.5, presence_penalty=0.25), [0.75, -1.0, 0.5, 2.25, -2.0]),
    (dict(frequency_penalty=-0.5), [3.0, -1.0, 0.5, 3.5, -2.0]),  # a negative penalty encourages
    # every token seen in the state (4), the prompt (1) or the output (0, 3): positive / 2, negative * 2
    (dict(repetition_penalty=2.0), [1.0, -2.0, 0.5, 1.5, -4.0]),
    # vLLM's order: repetition first (2 / 2, 3 / 2), then frequency (- 2 * 0.5, - 0.5); the other way round had given
    # [0.5, -2.0, 0.5, 1.25, -4.0] (sampling hunt, session 48)
    (dict(frequency_penalty=0.5, repetition_penalty=2.0), [0.0, -2.0, 0.5, 1.0, -4.0]),
]


def test_top_p_keeps_a_token_while_the_ones_before_it_sum_to_less_than_p():
    """vLLM's cut: two tokens of exactly 0.5 and top_p 0.5 keep one (the first by id), not both (sampling hunt,
    session 48); the fused kernel draws the same."""
    from wkvm.models import fused

    assert filtered_probs(torch.zeros(2), SamplingParams(top_p=0.5)).tolist() == [1.0, 0.0]
    if fused.available():
        assert {fused.sample(torch.zeros(2), 1.0, 0, 0.5, 0.0, u) for u in (0.1, 0.6, 0.99)} == {0}
    # ten tied tokens (0.1 each, inexact in binary): half reach 0.5; a float32 cumsum of renormalized values had kept
    # six on the torch path, the kernel five (review, session 48)
    for n, top_p in ((10, 0.5), (20, 0.35), (100, 0.25)):
        kept = int((filtered_probs(torch.zeros(n), SamplingParams(top_p=top_p)) > 0).sum())
        assert kept == round(n * top_p), (n, top_p, kept)
        if fused.available():
            drawn = {fused.sample(torch.zeros(n), 1.0, 0, top_p, 0.0, u / 50) for u in range(50)}
            assert drawn == set(range(kept)), (n, top_p, drawn)


@pytest.mark.parametrize("params, expected", PENALTY_CASES, ids=[case_id(p) for p, _ in PENALTY_CASES])
def test_apply_penalties(params, expected):
    row = SamplerRow(SamplingParams(**params), prompt_ids=[1], output_ids=[0, 3, 0], base_ids=[4])
    logits = PENALTY_LOGITS.clone()
    assert_close(apply_penalties(logits, row), torch.tensor(expected))
    assert torch.equal(logits, PENALTY_LOGITS)  # the model's logits are left as they were


def test_penalties_kept_as_the_output_grows_equal_a_fresh_count():
    """A row keeps its penalty counts as tokens come out (not recounted each token): after each new token (and after
    its output list is cut back and regrown), its penalized logits equal those of a new row with the same tokens."""
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(frequency_penalty=0.7, presence_penalty=-0.3, repetition_penalty=1.3)
    logits = torch.randn(300, generator=gen)
    prompt, out = torch.randint(0, 300, (40,), generator=gen).tolist(), []
    row = SamplerRow(params, prompt_ids=prompt, output_ids=out, base_ids=[299])
    for t in torch.randint(0, 310, (60,), generator=gen).tolist():  # some ids past the logits' 300: not counted
        out.append(t)
        fresh = SamplerRow(params, prompt_ids=prompt, output_ids=list(out), base_ids=[299])
        assert torch.equal(apply_penalties(logits, row), apply_penalties(logits, fresh))
    del out[10:]
    assert torch.equal(apply_penalties(logits, row), apply_penalties(logits, SamplerRow(params, prompt_ids=prompt,
                       output_ids=list(out), base_ids=[299])))  # fmt: skip


def full_sort_top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """top-p over the whole vocabulary sorted (the sampler's way before it sorted only the top tokens)."""
    sorted_p, order = torch.sort(probs, descending=True)
    drop = (sorted_p.cumsum(-1) - sorted_p) > top_p
    return probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))


@pytest.mark.parametrize("scale", [0.3, 3.0, 30.0])  # flat (top-k grows to the whole vocabulary) to peaked
def test_top_p_filter_keeps_the_set_a_full_sort_keeps(scale):
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):
        probs = torch.softmax(torch.randn(5000, generator=gen) * scale, -1)
        for top_p in (0.05, 0.5, 0.9, 0.99):
            assert torch.equal(top_p_filter(probs, top_p) > 0, full_sort_top_p(probs, top_p) > 0)
            assert_close(top_p_filter(probs, top_p), full_sort_top_p(probs, top_p), atol=0, rtol=0)


def test_draw_follows_the_distribution_and_never_draws_a_zero():
    """20,000 seeded draws from [0, .1, 0, .2, .3, .4] (unnormalized x3): each share within 0.012 of its probability
    (about 4 standard deviations), token 0 and 2 never; the same seed gives the same draws; no valid distribution
    (NaN, all zero) gives None."""
    probs = torch.tensor([0.0, 0.1, 0.0, 0.2, 0.3, 0.4]) * 3
    gen = torch.Generator().manual_seed(7)
    draws = [draw(probs, uniform(gen)) for _ in range(20000)]
    shares = torch.bincount(torch.tensor(draws), minlength=6).double() / len(draws)
    assert shares[0] == 0 and shares[2] == 0
    assert_close(shares, probs.double() / 3, atol=0.012, rtol=0)
    again = torch.Generator().manual_seed(7)
    assert [draw(probs, uniform(again)) for _ in range(100)] == draws[:100]
    assert draw(torch.zeros(6), 0.5) is None and draw(torch.tensor([0.5, float("nan")]), 0.5) is None
    assert draw(torch.tensor([0.0, 0.0, 1e-30, 0.0]), 0.999) == 2


HISTORY = [("user", "Hail!"), ("assistant", "Who?")]


def parked(**changes) -> Session:
    """A session parked after one turn: tokens 1..4 (4 pending), answer a1 to user message u1."""
    fields = dict(fingerprint="fp", handle="s@1", token_ids=[1, 2, 3, 4], history=list(HISTORY),
                  last_assistant_id="a1", message_ids={"u1", "a1"})  # fmt: skip
    return Session(**{**fields, **changes})


def reason(sess, fp="fp", parent="a1", asst="a2", user="u2", history=HISTORY, prompt=(1, 2, 3, 4, 5, 6)):
    return ChatSessions._reason(sess, fp, parent, asst, user, list(history), list(prompt))


def test_a_valid_continuation_has_no_reason():
    assert reason(parked()) is None
    assert reason(parked(), prompt=[1, 2, 3, 9]) is None  # the pending token is fed again, so it may differ
    assert reason(None, parent=None) is None  # a chat's first turn


@pytest.mark.parametrize(
    "sess, kwargs, expected",
    [
        (None, {}, "no_session"),
        (parked(handle=None), {}, "no_session"),  # its state could not be kept
        (parked(), dict(fp="other"), "model_changed"),
        (parked(), dict(asst="a1"), "message_id_reused"),
        (parked(), dict(user="u1"), "message_id_reused"),
        (parked(), dict(parent="a0"), "stale_parent"),
        (parked(), dict(parent=None), "edited_history"),  # a first turn again in a known chat: it was redone
        (parked(), dict(history=[("user", "Hail,Caesar!"), ("assistant", "Who?")]), "edited_history"),
        (parked(), dict(prompt=[1, 9, 3, 4, 5]), "token_mismatch"),
        (parked(), dict(prompt=[1, 2, 3]), "token_mismatch"),  # nothing left to feed
        (parked(token_ids=[]), {}, "token_mismatch"),
        (parked(), dict(fp="other", parent="a0"), "model_changed"),  # the first reason found is given
    ],
)
def test_each_session_rejection_reason(sess, kwargs, expected):
    assert reason(sess, **kwargs) == expected


def test_a_union_fields_wrong_element_is_named_with_the_forms_it_takes():
    """A list that one branch of a union accepts but for one element names that element (the branch it came closest
    to) and every form the field takes; a value no branch's container takes lists each branch's complaint."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from wkvm.server.errors import install_error_handlers
    from wkvm.server.schemas import EmbeddingRequest

    app = FastAPI()
    install_error_handlers(app)

    @app.post("/e")
    def embed(body: EmbeddingRequest) -> dict:
        return {}

    client = TestClient(app)
    forms = "a string, a list of strings, a list of integers (token ids) or a list of lists of integers"
    for value, param, says in [([101, 2.5, 102], "input[1]", "valid integer"), (["a", 5], "input[1]", "valid string"),
                               ([[101, -0.5]], "input[0][1]", "valid integer")]:  # fmt: skip
        err = client.post("/e", json={"model": "m", "input": value}).json()["error"]
        assert err["param"] == param and says in err["message"] and f"(input takes {forms})" in err["message"], err
    err = client.post("/e", json={"model": "m", "input": {"text": "x"}}).json()["error"]
    assert err["param"] == "input" and "valid string; or" in err["message"] and "valid list" in err["message"], err


def test_shutdown_answers_one_code_with_retry_after_whichever_way_a_request_meets_it():
    """A request arriving during shutdown (EngineClosed) and a state creation whose prefill shutdown cut off
    (PrefillFailed "shutdown") answer the same 503 `shutting_down` with Retry-After: an announced outage that the
    5xx log leaves alone (the cut-off prefill had answered code `shutdown`, logged as a server error)."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from wkvm.engine.client import PrefillFailed
    from wkvm.engine.engine import EngineClosed
    from wkvm.outputs import ErrorCode
    from wkvm.server.errors import install_error_handlers

    app = FastAPI()
    install_error_handlers(app)

    @app.post("/closed")
    def closed() -> dict:
        raise EngineClosed("the server is shutting down")

    @app.post("/cut")
    def cut() -> dict:
        raise PrefillFailed("the server is shutting down", ErrorCode.SHUTDOWN)

    client = TestClient(app)
    for path in ("/closed", "/cut"):
        r = client.post(path)
        assert r.status_code == 503 and r.headers["retry-after"] == "1", path
        assert r.json()["error"]["code"] == "shutting_down", path


@pytest.mark.allows_5xx
def test_an_unhandled_error_is_logged_once_with_the_id_its_500_names(caplog):
    """A route's bug answers an OpenAI-shaped 500 naming an error id, and the log holds one record with that id and
    the traceback (Starlette's handler for Exception re-raised after answering: uvicorn logged the traceback again,
    and nothing tied the client's 500 to it). An event stream a bug cuts off after its first bytes ends with an error
    event naming the id (as vLLM's; it had ended cleanly, so a client could not tell it from a whole answer), then
    `data: [DONE]` as every stream of the chat and completions routes; any other
    body cut off is left unended (uvicorn closes the connection: the client sees it incomplete)."""
    import logging
    import re

    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse
    from fastapi.testclient import TestClient

    from wkvm.server.asgi import RequestMetrics
    from wkvm.server.errors import install_error_handlers

    app = FastAPI()
    install_error_handlers(app)
    counted: list[tuple[str, int]] = []
    told: list[str] = []
    app.add_middleware(RequestMetrics, count=lambda route, status: counted.append((route, status)),
                       on_server_error=lambda path, status: told.append(path))  # fmt: skip

    @app.post("/boom")
    def boom() -> dict:
        raise KeyError("x")

    @app.post("/cut")
    def cut() -> StreamingResponse:
        def chunks():
            yield "data: 1\n\n"
            raise ValueError("mid-stream")

        return StreamingResponse(chunks(), media_type="text/event-stream")

    @app.post("/v1/messages")  # Anthropic's stream: its SDK raises on a named `error` event; no [DONE]
    def cut_messages() -> StreamingResponse:
        def chunks():
            yield "event: message_start\ndata: {}\n\n"
            raise ValueError("mid-messages")

        return StreamingResponse(chunks(), media_type="text/event-stream")

    @app.post("/api/chat")  # Ollama's NDJSON stream: an error line
    def cut_ollama() -> StreamingResponse:
        def chunks():
            yield '{"done": false}\n'
            raise ValueError("mid-ndjson")

        return StreamingResponse(chunks(), media_type="application/x-ndjson")

    @app.post("/cut-bytes")
    def cut_bytes() -> StreamingResponse:
        def chunks():
            yield b"\x00\x01"
            raise ValueError("mid-file")

        return StreamingResponse(chunks(), media_type="application/octet-stream")

    client = TestClient(app, raise_server_exceptions=True)  # an exception reaching the client would fail here
    with caplog.at_level(logging.ERROR, logger="wkvm.server"):
        r = client.post("/boom")
        assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error", r.text
        ref = re.search(r"error id ([0-9a-f]{12})", r.json()["error"]["message"]).group(1)
        records = [rec for rec in caplog.records if ref in rec.getMessage()]
        assert len(records) == 1 and records[0].exc_info and "KeyError" in records[0].getMessage(), caplog.text
        r = client.post("/cut")
        first, last, done = r.text.removesuffix("\n\n").split("\n\n")
        assert r.status_code == 200 and first == "data: 1" and done == "data: [DONE]", r.text
        error = json.loads(last.removeprefix("data: "))["error"]
        ref = re.search(r"error id ([0-9a-f]{12})", error["message"]).group(1)
        assert error["code"] == "internal_error" and ref in caplog.records[-1].getMessage()
        r = client.post("/v1/messages")
        first, last = r.text.removesuffix("\n\n").split("\n\n")
        kind, data = last.split("\n")
        assert kind == "event: error" and json.loads(data.removeprefix("data: "))["type"] == "error", r.text
        lines = client.post("/api/chat").text.splitlines()
        assert lines[0] == '{"done": false}' and "error id" in json.loads(lines[1])["error"] and len(lines) == 2
        sent: list[dict] = []
        asyncio.run(cut_off(app, sent))
        assert [m.get("more_body") for m in sent if m["type"] == "http.response.body"][-1] is True  # left unended
    assert "ValueError" in caplog.text and len(caplog.records) == 5, caplog.text
    assert counted == [("/boom", 500), ("/cut", 200), ("/v1/messages", 200), ("/api/chat", 200),
                       ("/cut-bytes", 200)] and told == [], (counted, told)  # fmt: skip


async def cut_off(app, sent: list[dict]) -> None:
    """POST /cut-bytes straight through the ASGI app, keeping every message it sends."""
    scope = {"type": "http", "method": "POST", "path": "/cut-bytes", "raw_path": b"/cut-bytes", "query_string": b"",
             "headers": [(b"host", b"testserver")], "http_version": "1.1", "scheme": "http", "root_path": "",
             "client": ("127.0.0.1", 1), "server": ("testserver", 80)}  # fmt: skip

    asked: list[int] = []

    async def receive() -> dict:
        if not asked:
            asked.append(1)
            return {"type": "http.request", "body": b"", "more_body": False}
        await asyncio.Event().wait()  # the client stays: only the body's end or error ends the response
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    await app(scope, receive, send)


def test_every_choice_is_timed_as_its_tokens_come_and_from_the_requests_arrival():
    """wait_all read the choices one after another, so a later choice's tokens waited in its queue and were timed in a
    burst (its first token at the first choice's whole run); the clock started after an n > 1 request's shared prefill,
    so its time to first token read ~0 (hunt 19). Here choice 0 cannot go on until choice 1's first token has been
    timed (reading in turn deadlocks: the wait_for fails), and t0 is the arrival the ASGI layer recorded."""
    import asyncio
    from types import SimpleNamespace

    from wkvm.engine.handle import Event
    from wkvm.outputs import GenerationOutput
    from wkvm.server.asgi import ARRIVED
    from wkvm.server.generation import Watch, wait_all

    seen: list[tuple[float, int]] = []
    metrics = SimpleNamespace(ttft=SimpleNamespace(observe=lambda v: seen.append(("ttft", v))),
                              itl=SimpleNamespace(observe=lambda v: None),
                              generated_tokens=SimpleNamespace(inc=lambda n: None),
                              finished=lambda reason, seconds, queued: seen.append((reason, seconds)))  # fmt: skip
    ctx = SimpleNamespace(metrics=metrics)

    class Request:
        scope = {ARRIVED: 12.5}

        async def is_disconnected(self) -> bool:
            return False

    async def run() -> None:
        second_timed = asyncio.Event()

        class Handle:
            def __init__(self, i: int):
                self.i, self.done = i, asyncio.Event()
                self.output = GenerationOutput(prompt_token_ids=[1], finish_reason="length")

            def cancel(self) -> None:
                pass

            async def __aiter__(self):
                if self.i == 0:
                    yield Event("a", [1], "")
                    await second_timed.wait()  # choice 1's first token must be timed while choice 0 runs
                else:
                    yield Event("b", [2], "")
                    while len(seen) < 2:
                        await asyncio.sleep(0)
                    second_timed.set()
                self.done.set()
                yield Event("ab"[self.i], [], "", finish_reason="length")

        await asyncio.wait_for(wait_all(ctx, Request(), [Handle(0), Handle(1)]), timeout=10)
        assert Watch(ctx, Request(), []).t0 == 12.5

    asyncio.run(run())
    assert [kind for kind, _ in seen] == ["ttft", "ttft", "length", "length"]  # each choice's end counted, once


def test_seeds_past_32_bits_draw_differently():
    """torch's CPU generator keeps a seed's low 32 bits: 0, 2^32 and 2^33 drew alike (the docs said 63 bits). A seed
    below 2^32 keeps its draws; one from 2^32 up is hashed to 32 bits; a negative one is taken modulo 2^64."""
    from wkvm.engine.sampler import make_generator

    def draws(seed):
        return torch.rand(4, generator=make_generator(seed)).tolist()

    assert draws(12345) == torch.rand(4, generator=torch.Generator().manual_seed(12345)).tolist()
    seeds = [0, 1, 2**32, 2**32 + 1, 2**33, 2**63, 2**64 - 1]
    assert len({tuple(draws(s)) for s in seeds}) == len(seeds)
    assert draws(-1) == draws(2**64 - 1) and draws(-(2**63)) == draws(2**63)
    assert make_generator(None) is None


def test_the_default_served_name_is_the_whole_directory_or_file_name():
    """`Path.stem` had cut a directory's name at its last dot (Qwen2.5-0.5B-Instruct -> Qwen2.5-0): only .gguf and
    .pth go, as the README says."""
    from wkvm.config import ServerConfig

    names = {"models/Qwen2.5-0.5B-Instruct": "Qwen2.5-0.5B-Instruct", "m/SmolLM2.Q4_1.gguf": "SmolLM2.Q4_1",
             "m/tiny.pth": "tiny", "m/pack/": "pack"}  # fmt: skip
    assert {m: ServerConfig(model=m).served_name() for m in names} == names


def test_atomic_writes_use_a_fresh_temp_file_each(tmp_path):
    """Security review (session 39): the temp name was `.NAME.PID.wkvm-tmp`, predictable, and a writer followed a link
    planted there; two threads writing one target shared it. Each write now makes its own, exclusively."""
    import os

    from wkvm.atomic import atomic_path

    target = tmp_path / "f.bin"
    planted = tmp_path / f".f.bin.{os.getpid()}.wkvm-tmp"
    outside = tmp_path / "outside"
    planted.symlink_to(outside)
    with atomic_path(target) as a, atomic_path(target) as b:
        assert a != b and a.is_file() and not a.is_symlink()
        a.write_bytes(b"a")
        b.write_bytes(b"b")
    assert target.read_bytes() == b"a" and not outside.exists()  # the outer write replaced last
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["f.bin", planted.name])


def test_mutation_params_hold_what_a_state_file_may():
    """Review (session 47): an integer beyond 64 bits in a mutation's params was recorded in the new state's
    op_params, whose export then did not import (an import refuses them)."""
    import pydantic

    from wkvm.server.schemas import MutateRequest

    assert MutateRequest(rule="x", params={"n": 2**63, "b": True, "s": "a"}).params == {"n": 2**63, "b": True, "s": "a"}
    with pytest.raises(pydantic.ValidationError):
        MutateRequest(rule="x", params={"n": 10**4000})
