"""The family conformance suite: every model family (tests/families/) passes every state operation exactly.

For each family: a tiny random checkpoint with the char tokenizer; then batched == alone, chunked prefill == token
by token, preemption (park/resume) == uninterrupted, and over HTTP: resume from every tier (device, host, disk, a
restarted server) == uninterrupted, fork isolation, export -> import into another server, chat reuse == fresh,
and a weight pack streamed through a one-layer cache == resident. Greedy tokens must be identical and logprobs
within 1e-5. A new family adds a module to tests/families/ and nothing here.
"""

from __future__ import annotations

import random

import httpx
import pytest
import safetensors.torch
import torch
from conftest import CHAR_VOCAB, greedy_reference, write_char_tokenizer
from families import all_families
from live_server import LiveServer, ServerProcess

from wkvm.config import EngineConfig
from wkvm.engine.engine import Engine
from wkvm.models import fused, int8, registry
from wkvm.sampling_params import SamplingParams
from wkvm.server.handover import STATES, HandoverError, Ticket, decode, encode
from wkvm.state.sessions import reuse_scope
from wkvm.weights.loader import load_model, load_text_tools

FAMILIES = all_families()
LP_TOL = 1e-5
PROMPT = [5, 17, 30, 2, 44, 61, 9, 12, 80, 33, 3]


@pytest.fixture(scope="module", params=FAMILIES, ids=[f.__name__.rsplit(".", 1)[-1] for f in FAMILIES])
def family_dir(request, tmp_path_factory):
    name = request.param.__name__.rsplit(".", 1)[-1]
    path = request.param.write_checkpoint(tmp_path_factory.mktemp(name) / "model", len(CHAR_VOCAB), 5)
    write_char_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def model(family_dir):
    return load_model(family_dir)


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)


def engine(model, family_dir, **config) -> Engine:
    return Engine(model, load_text_tools(family_dir, model.family)[0], EngineConfig(**config))


def test_outputs_vary_with_the_prompt(model):
    """The suite compares outputs, so a degenerate random model (same token whatever the prompt) proves nothing."""
    outs = {tuple(greedy_reference(model, [t, t + 1], 6)) for t in range(0, 60, 6)}
    assert len(outs) >= 3, outs


def test_chunked_prefill_equals_token_by_token(model):
    ids = PROMPT * 3
    want, want_state = model.prefill(ids, all_logits=True)
    steps, state = [], model.new_state(1)
    for t in ids:
        steps.append(model.decode([t], state)[0])
    torch.testing.assert_close(torch.stack(steps), want, rtol=1e-4, atol=1e-4)
    for chunk in (1, 4, 7, 16):
        got, got_state = model.prefill(ids, all_logits=True, chunk_size=chunk)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        for name in model.spec.names:
            torch.testing.assert_close(got_state[name], want_state[name], rtol=1e-4, atol=1e-5)
    for name in model.spec.names:
        torch.testing.assert_close(state[name], want_state[name], rtol=1e-4, atol=1e-5)


def test_int8_chunks_have_the_bits_of_stepping(model, family_dir, request):
    """With int8 weights (which round every matmul input to 8 bits, turning a last-bit difference into ~0.06 nats a
    token on SmolLM2) a prompt's numbers must not depend on where its chunks end: the engine's prompt logprobs, greedy
    tokens and their logprobs are equal to the bit whether the prompt goes in whole, in chunks of 7 or 4, or token by
    token. That is what makes a resumed chat, a batch and a prefix checkpoint answer as an uninterrupted run: each
    family's layers run a chunk with a step's arithmetic (`rows_alone`: native matmul kernels, attention a token at a
    time, recurrent layers stepping through it). Skipped only where a CPU or build lacks those kernels."""
    if not getattr(request.node.callspec.params["family_dir"], "INT8", True):
        pytest.skip("a family without int8 weights (tests/families/toy.py: float32 only)")
    m = load_model(family_dir, dtype="int8")
    ids = PROMPT * 3
    if not m.rows_alone(len(ids)):
        # the kernels are here: an int8 path for every row count, the fused kernels built, attention grouping rows
        kernels = int8.kernel_path() in int8.ALL_SIZES and fused.available() and not fused.narrow_attention()
        assert not kernels, f"{m.family}: no stepping's bits for a {len(ids)}-token chunk though the kernels are here"
        pytest.skip("no native int8 kernel for every row count, no compiler, or a fused attention that does not group "
                    "rows here: chunks agree to rounding")  # fmt: skip

    def run(chunk: int) -> tuple[list[int], list, list]:
        eng = engine(m, family_dir, n_slots=1, token_budget=64, prefill_chunk=chunk)
        h = eng.submit(ids, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2,
                                           prompt_logprobs=2))  # fmt: skip
        eng.run_until_done()
        assert h.output.prompt_logprobs is not None and h.output.logprobs is not None
        return h.output.token_ids, h.output.prompt_logprobs, h.output.logprobs

    want = run(1)
    for chunk in (len(ids), 7, 4):
        assert run(chunk) == want, f"{m.family}: chunks of {chunk} tokens"


def test_forward_groups_equal_separate_forwards(model):
    a, b = torch.tensor([PROMPT[:5], PROMPT[3:8]]), torch.tensor([PROMPT])
    sa, sb = model.new_state(2), model.new_state(1)
    ra, rb = model.forward_groups([(a, sa), (b, sb)])
    sa2, sb2 = model.new_state(2), model.new_state(1)
    torch.testing.assert_close(ra, model.forward(a, sa2), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rb, model.forward(b, sb2), rtol=1e-5, atol=1e-5)


def test_batched_equals_alone(model, family_dir):
    """Staggered arrivals, mixed prompt and output lengths, chunked prefill beside decodes, on 4 slots."""
    rng = random.Random(0)
    eng = engine(model, family_dir, n_slots=4, token_budget=24, prefill_chunk=8)
    specs = [([rng.randrange(0, len(CHAR_VOCAB)) for _ in range(rng.randint(1, 30))], rng.randint(1, 10))
             for _ in range(9)]  # fmt: skip
    handles = []
    for i, (prompt, n) in enumerate(specs):
        handles.append(eng.submit(prompt, greedy(n), request_id=f"r{i}"))
        for _ in range(rng.randint(0, 2)):
            eng.step()
    eng.run_until_done()
    for (prompt, n), h in zip(specs, handles, strict=True):
        assert h.output.token_ids == greedy_reference(model, prompt, n), h.request_id


def test_prompt_logprobs_equal_a_whole_prefill(model, family_dir):
    """Prompt logprobs (echo + logprobs, lm-eval's scoring) come from the engine's chunked, batched prefill: each
    equals the logprob of a plain all-positions prefill, beside a decode and a request that generates after scoring."""
    ids = PROMPT * 3
    want = torch.log_softmax(model.prefill(ids, all_logits=True)[0], -1)[:-1]
    want = want.gather(-1, torch.tensor(ids[1:]).unsqueeze(-1))[:, 0].tolist()
    eng = engine(model, family_dir, n_slots=3, token_budget=12, prefill_chunk=5)
    decoding = eng.submit(PROMPT[:3], greedy(12))
    eng.step()
    scored = eng.submit(ids, SamplingParams(max_tokens=0, prompt_logprobs=2))
    scored_then_generated = eng.submit(ids, greedy(3, prompt_logprobs=0))
    eng.run_until_done()
    for h in (scored, scored_then_generated):
        lps = h.output.prompt_logprobs
        assert lps is not None and lps[0] is None and len(lps) == len(ids)
        got = [d[t] for d, t in zip(lps[1:], ids[1:], strict=True)]
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4
    assert scored.output.token_ids == [] and scored.output.finish_reason == "length"
    assert scored_then_generated.output.token_ids == greedy_reference(model, ids, 3)
    assert decoding.output.token_ids == greedy_reference(model, PROMPT[:3], 12)


def test_preemption_parks_and_resumes_exactly(model, family_dir):
    eng = engine(model, family_dir, n_slots=1)
    low = eng.submit(PROMPT, greedy(16), priority=5)
    for _ in range(5):
        eng.step()
    high = eng.submit([7, 8], greedy(5), priority=0)
    eng.step()
    assert low.request.status.value == "parked"
    eng.run_until_done()
    assert high.output.token_ids == greedy_reference(model, [7, 8], 5)
    assert low.output.token_ids == greedy_reference(model, PROMPT, 16)


def test_a_request_moved_to_another_engine_equals_uninterrupted(model, family_dir):
    """Live migration at the engine level: requests suspended mid-prefill and mid-decode (greedy, and seeded sampling
    with penalties) go on in another engine and give exactly the tokens and text of a run that never moved."""
    sampled = SamplingParams(max_tokens=14, temperature=0.9, top_p=0.95, seed=123, presence_penalty=0.5,
                             frequency_penalty=0.3, repetition_penalty=1.2, ignore_eos=True)  # fmt: skip
    jobs = [(PROMPT * 3, greedy(12)), (PROMPT, greedy(12)), (PROMPT[2:], sampled)]
    whole = engine(model, family_dir, n_slots=3)
    want = [whole.submit(p, sp) for p, sp in jobs]
    whole.run_until_done()
    src = engine(model, family_dir, n_slots=3, token_budget=16, prefill_chunk=4)
    running = [src.submit(p, sp) for p, sp in jobs]
    for _ in range(4):  # the long prompt is still prefilling; the others have sampled a few tokens
        src.step()
    assert running[0].request.is_prefilling and len(running[1].request.output_ids) >= 2
    moving = [src.suspend(h.request_id) for h in running]
    src.step()
    dst = engine(model, family_dir, n_slots=2)
    moved = [dst.resume_continuation(f.result(), sp) for f, (_, sp) in zip(moving, jobs, strict=True)]
    dst.run_until_done()
    for h, m, w in zip(running, moved, want, strict=True):
        assert h.output.finish_reason == "abort" and h.output.error_code == "migrated" and h.continuation is not None
        assert m.output.token_ids == w.output.token_ids
        assert m.output.text == w.output.text and m.output.finish_reason == w.output.finish_reason


def test_a_precopied_move_equals_uninterrupted(model, family_dir):
    """A pre-copied move (`Engine.precopy`): the state of one token boundary goes ahead while the request goes on; the
    stop a few tokens later ships only the tokens, generator and text (a ticket without state), and the destination
    feeds the tokens generated since the pre-copy in one chunk. Greedy and seeded sampling with penalties give exactly
    the tokens and text of a run that never moved; a ticket without its pre-copy, or with another's, is refused."""
    sampled = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=7, presence_penalty=0.5,
                             frequency_penalty=0.3, repetition_penalty=1.2, ignore_eos=True)  # fmt: skip
    jobs = [(PROMPT, greedy(16, logprobs=0)), (PROMPT[3:], sampled)]
    whole = engine(model, family_dir, n_slots=2)
    want = [whole.submit(p, sp) for p, sp in jobs]
    whole.run_until_done()
    src = engine(model, family_dir, n_slots=2)
    running = [src.submit(p, sp) for p, sp in jobs]
    while any(len(h.request.output_ids) < 2 for h in running):
        src.step()
    copies = [src.precopy(h.request_id) for h in running]
    for _ in range(3):  # the pre-copies are taken as the first of these steps starts: three tokens come after them
        src.step()
    moving = [src.suspend(h.request_id) for h in running]
    src.step()
    m = model
    tickets = [Ticket(h.request_id, 0, "t") for h in running]
    bases = [decode(encode(m.spec, m.fingerprint, c.result(), t), m.spec, m.fingerprint, m.vocab_size)
             for c, t in zip(copies, tickets, strict=True)]  # fmt: skip
    stops = [encode(m.spec, m.fingerprint, f.result(), t, c.result())
             for f, c, t in zip(moving, copies, tickets, strict=True)]  # fmt: skip
    assert all(not k.startswith(STATES) for stop in stops for k in safetensors.torch.load(stop))  # no state in it
    for c, f in zip(copies, moving, strict=True):
        assert len(f.result().output_ids) - len(c.result().output_ids) == 3
    with pytest.raises(HandoverError, match="pre-copy"):
        decode(stops[0], m.spec, m.fingerprint, m.vocab_size)
    with pytest.raises(HandoverError, match="pre-copy"):
        decode(stops[0], m.spec, m.fingerprint, m.vocab_size, bases[1])
    dst = engine(model, family_dir, n_slots=2)
    moved = [dst.resume_continuation(decode(stop, m.spec, m.fingerprint, m.vocab_size, b)[0][0], sp)
             for stop, b, (_, sp) in zip(stops, bases, jobs, strict=True)]  # fmt: skip
    dst.step()  # one step feeds the three tokens and samples the next
    assert all(len(h.output.token_ids) == len(f.result().output_ids) + 1 for h, f in zip(moved, moving, strict=True))
    dst.run_until_done()
    for m_, w in zip(moved, want, strict=True):
        assert m_.output.token_ids == w.output.token_ids
        assert m_.output.text == w.output.text and m_.output.finish_reason == w.output.finish_reason
    resumed = moved[0].output.logprobs  # from the first token sampled after the catch-up
    pairs = list(zip(resumed, want[0].output.logprobs[-len(resumed) :], strict=True))
    assert pairs and all(a.keys() == b.keys() for a, b in pairs)
    close = [abs(sum(a.values()) - sum(b.values())) for a, b in pairs]
    # the same bits where the model runs a short chunk as steps (`rows_alone` at 8 tokens), else within rounding
    assert max(close) == 0 if model.chunks_equal_steps else max(close) < LP_TOL, (model.chunks_equal_steps, close)


def test_weight_pack_streamed_equals_resident(model, family_dir, tmp_path):
    from wkvm.weights.pack import write_pack

    write_pack(family_dir, tmp_path / "pack")
    streamed = load_model(tmp_path / "pack", weight_cache_layers=1)
    assert streamed.fingerprint == model.fingerprint
    assert greedy_reference(streamed, PROMPT, 12) == greedy_reference(model, PROMPT, 12)
    torch.testing.assert_close(streamed.prefill(PROMPT, all_logits=True)[0], model.prefill(PROMPT, all_logits=True)[0],
                               rtol=1e-5, atol=1e-5)  # fmt: skip


# --- over HTTP: the state API and chat reuse ---------------------------------------------------------------------


def body(n: int = 8) -> dict:
    return {"max_tokens": n, "temperature": 0, "ignore_eos": True, "return_token_ids": True, "logprobs": 2}


def completion(c: httpx.Client, prompt: list[int], n: int = 8) -> dict:
    r = c.post("/v1/completions", json={"prompt": prompt, **body(n)})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def from_state(c: httpx.Client, handle: str, prompt: list[int], n: int = 8, **extra) -> dict:
    r = c.post(f"/v1/states/{handle}/generate", json={"prompt_ids": prompt, **body(n), **extra})
    assert r.status_code == 200, r.text
    return r.json()


def assert_same(a: dict, b: dict) -> None:
    assert a["token_ids"] == b["token_ids"]
    for x, y in zip(a["logprobs"]["token_logprobs"], b["logprobs"]["token_logprobs"], strict=True):
        assert abs(x - y) < LP_TOL


@pytest.fixture(scope="module")
def server(family_dir, tmp_path_factory):
    state_dir = tmp_path_factory.mktemp("states")
    with LiveServer(model=str(family_dir), state_dir=str(state_dir), slots=4) as s:
        s.state_dir = state_dir
        yield s


@pytest.mark.parametrize("tier", ["device", "host", "disk"])
def test_resume_from_every_tier_equals_uninterrupted(server, tier):
    c = httpx.Client(base_url=server.url, timeout=60)
    want = completion(c, PROMPT + [4, 5])
    r = c.post("/v1/states", json={"name": f"t-{tier}", "prompt_ids": PROMPT})
    assert r.status_code == 200, r.text
    if tier != "device":
        assert c.post(f"/v1/states/t-{tier}/hibernate", json={"tier": tier}).json()["tier"] == tier
    assert_same(from_state(c, f"t-{tier}", [4, 5])["choices"][0], want)


def test_a_states_bytes_count_its_keys_and_values(server, model):
    """A stored state reports its own tensors' bytes: the fixed part, and for attention layers keys and values that
    grow with its tokens (an attention state used to report 0: only the fixed part was counted)."""
    c = httpx.Client(base_url=server.url, timeout=60)
    short = c.post("/v1/states", json={"name": "b-short", "prompt_ids": PROMPT}).json()
    long = c.post("/v1/states", json={"name": "b-long", "prompt_ids": PROMPT * 3}).json()
    spec = model.spec
    assert short["bytes"] > 0 and short["bytes"] >= spec.nbytes
    assert long["bytes"] - short["bytes"] == 2 * len(PROMPT) * spec.token_nbytes  # 0 per token without attention
    assert c.get("/v1/states/b-long").json()["bytes"] == long["bytes"]


def test_fork_branches_are_independent(server):
    c = httpx.Client(base_url=server.url, timeout=60)
    assert c.post("/v1/states", json={"name": "root", "prompt_ids": PROMPT}).status_code == 200
    assert c.post("/v1/states/root/fork", json={"name": "branch"}).json()["parent"] == "root@1"
    a = from_state(c, "root", [1, 2], save_as="root")
    b = from_state(c, "branch", [3, 4], save_as="branch")
    assert_same(a["choices"][0], completion(c, PROMPT + [1, 2]))
    assert_same(b["choices"][0], completion(c, PROMPT + [3, 4]))
    assert_same(from_state(c, "root@1", [3, 4])["choices"][0], b["choices"][0])  # the fork left root@1 untouched


def test_export_import_and_restart(server, family_dir, tmp_path):
    c = httpx.Client(base_url=server.url, timeout=60)
    assert c.post("/v1/states", json={"name": "moving", "prompt_ids": PROMPT}).status_code == 200
    assert c.post("/v1/states/moving/hibernate", json={"tier": "disk"}).status_code == 200
    data = c.get("/v1/states/moving/export").content
    want = completion(c, PROMPT + [6])
    with LiveServer(model=str(family_dir), state_dir=str(tmp_path / "other"), slots=2) as other:
        o = httpx.Client(base_url=other.url, timeout=60)
        r = o.post("/v1/states/import", content=data, headers={"Content-Type": "application/octet-stream"})
        assert r.status_code == 200, r.text
        assert_same(from_state(o, r.json()["handle"], [6])["choices"][0], want)
    with LiveServer(model=str(family_dir), state_dir=str(server.state_dir), slots=2) as again:  # a restart
        a = httpx.Client(base_url=again.url, timeout=60)
        assert a.get("/v1/states/moving").json()["tier"] == "disk"
        assert_same(from_state(a, "moving", [6])["choices"][0], want)


def test_tokenize_gives_the_ids_a_request_feeds(server, model):
    """/tokenize (vLLM's shape) returns exactly the prompt ids a chat or a completion feeds the model; /detokenize
    gives the text back; max_model_len is the one-sequence limit of attention models, null without a window."""
    c = httpx.Client(base_url=server.url, timeout=60)
    messages = [{"role": "user", "content": "Goodmorrow,friend."}]
    chat = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1, "return_token_ids": True,
                                                "user": "tokenize"})  # its own reuse scope: other tests' stays empty
    t = c.post("/tokenize", json={"messages": messages}).json()
    assert t["tokens"] == chat.json()["prompt_token_ids"] and t["count"] == chat.json()["usage"]["prompt_tokens"]
    done = c.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()["tokens"]
    assert len(done) < len(t["tokens"])
    completion = c.post("/v1/completions", json={"prompt": "Whatnews?", "max_tokens": 1, "return_token_ids": True,
                                                 "user": "tokenize"})  # fmt: skip
    p = c.post("/tokenize", json={"prompt": "Whatnews?", "return_token_strs": True}).json()
    assert p["tokens"] == completion.json()["prompt_token_ids"] and "".join(p["token_strs"]) == "Whatnews?"
    assert c.post("/detokenize", json={"tokens": p["tokens"]}).json() == {"prompt": "Whatnews?"}
    limit = c.get("/v1/models").json()["data"][0]["max_model_len"]
    assert p["max_model_len"] == limit
    assert limit is None if model.context_length is None else 0 < limit <= model.context_length
    for bad in ({}, {"prompt": "a", "messages": messages}):
        r = c.post("/tokenize", json=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = c.post("/detokenize", json={"tokens": [model.vocab_size]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_token"


def test_chat_reuse_equals_fresh(server, family_dir):
    """A 4-turn chat: each turn reuses every token of the turn before (all but its pending last one) and answers
    exactly as a server without reuse."""
    with LiveServer(model=str(family_dir), slots=2, prefix_reuse=False) as fresh:
        messages, reused, previous = [], [], []
        for turn in ["Goodmorrow,friend.", "Whatnews?", "Speakplainly.", "Farewell."]:
            messages.append({"role": "user", "content": turn})
            req = {"messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            a = httpx.post(f"{server.url}/v1/chat/completions", json=req, timeout=60).json()
            b = httpx.post(f"{fresh.url}/v1/chat/completions", json=req, timeout=60).json()
            assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
            assert b["wkvm"]["mode"] == "fresh"
            reused.append(a["wkvm"]["reused_tokens"])
            previous.append(a["usage"]["prompt_tokens"] + a["usage"]["completion_tokens"] - 1)
            messages.append({"role": "assistant", "content": a["choices"][0]["message"]["content"]})
        assert reused == [0] + previous[:-1], (reused, previous)


def test_an_int8_chat_reuses_to_the_bit(family_dir, request):
    """With int8 weights, where a last-bit difference becomes a different rounding downstream: a 4-turn chat on a
    server with reuse answers every turn with the tokens and logprobs, to the bit, of a server that recomputes each
    prompt (chunks of the prompt there end elsewhere: the fresh server feeds the previous answer as prompt, the other
    resumed after decoding it). Skipped where this CPU or build lacks the kernels that give chunks stepping's bits."""
    if not getattr(request.node.callspec.params["family_dir"], "INT8", True):
        pytest.skip("a family without int8 weights (tests/families/toy.py: float32 only)")
    if not load_model(family_dir, dtype="int8").rows_alone(16):  # the servers' chunks: at most 16 tokens
        pytest.skip("no native int8 kernel for every row count or no compiler here: reuse is exact to rounding")
    config = {"model": str(family_dir), "slots": 2, "dtype": "int8", "prefill_chunk": 16}
    with LiveServer(**config) as reusing, LiveServer(**config, prefix_reuse=False) as fresh:
        messages, modes = [], []
        for turn in ["Goodmorrow,friend.", "Whatnews?", "Speakplainly.", "Farewell."]:
            messages.append({"role": "user", "content": turn})
            req = {"messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": True,
                   "top_logprobs": 2}  # fmt: skip
            a = httpx.post(f"{reusing.url}/v1/chat/completions", json=req, timeout=60).json()
            b = httpx.post(f"{fresh.url}/v1/chat/completions", json=req, timeout=60).json()
            assert a["choices"][0]["logprobs"] == b["choices"][0]["logprobs"], f"turn {len(modes) + 1}"
            modes.append(a["wkvm"]["mode"])
            messages.append({"role": "assistant", "content": a["choices"][0]["message"]["content"]})
        assert modes[0] == "fresh" and all(m != "fresh" for m in modes[1:]), modes


def test_wkvm_serve_runs_the_family(model, family_dir):
    """`wkvm serve --model DIR` in its own process: loads the family, answers a chat and a completion, exits 0."""
    if model.family not in registry.MODULES:
        pytest.skip("a test-only family is registered in this test process only")
    with ServerProcess("--model", str(family_dir)) as s:
        chat = {"messages": [{"role": "user", "content": "Hail."}], "max_tokens": 4, "temperature": 0}
        r = httpx.post(f"{s.url}/v1/chat/completions", json=chat, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
        r = httpx.get(f"{s.url}/v1/models", timeout=60)
        assert r.json()["data"][0]["family"] == model.family
        assert s.stop() == 0


def test_prefix_reuse_at_any_token(server, model):
    """A prompt that shares only its first tokens with a stored history: an attention-only state is cut to the
    shared tokens (any token boundary) and the answer equals a fresh run; a recurrent one cannot be cut, so it
    restarts."""
    c = httpx.Client(base_url=server.url, timeout=60)
    shared = [41, 42, 43, 44, 45, 46, 47]
    completion(c, shared + [50, 51, 52, 53])
    prompt = shared + [60, 61]
    r = c.post("/v1/completions", json={"prompt": prompt, **body(6)})
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["choices"][0]["token_ids"] == greedy_reference(model, prompt, 6)
    if model.spec.cuttable:
        assert got["wkvm"]["mode"] == "kv_prefix" and got["wkvm"]["reused_tokens"] == len(shared), got["wkvm"]
    else:
        assert got["wkvm"]["mode"] == "fresh" and got["wkvm"]["reused_tokens"] == 0, got["wkvm"]


def test_a_shared_system_prompt_is_reused_from_the_second_request(server, model):
    """Chats that share a system prompt and ask different questions: the first keeps a checkpoint at the end of the
    system messages (their tokens are an exact prefix), so every later one reuses at least all of them, whatever
    the family; every answer equals a run without reuse."""
    c = httpx.Client(base_url=server.url, timeout=60)
    system = {"role": "system", "content": "Thouartacourtierofgreatwit;answerbrieflyandinverse." * 2}
    head = server.ctx.tokenizer.encode(server.ctx.template.render([system], add_generation_prompt=False))
    user = f"sys-{random.random()}"  # a reuse scope of its own: no other test's checkpoints
    reused = []
    for q in ["Whatnews?", "Whocomes?", "Whereisthedog?", "Sing!", "Whatisthehour?"]:
        req = {"messages": [system, {"role": "user", "content": q}], "max_tokens": 6, "temperature": 0,
               "ignore_eos": True, "return_token_ids": True, "user": user}  # fmt: skip
        r = c.post("/v1/chat/completions", json=req).json()
        assert r["choices"][0]["token_ids"] == greedy_reference(model, r["prompt_token_ids"], 6)
        reused.append(r["wkvm"]["reused_tokens"])
    assert reused[0] == 0 and all(n >= len(head) for n in reused[1:]), (reused, len(head))
    # every checkpoint these requests left (the system prompt's branch point, each prompt's end, each answer's end)
    # holds the state of exactly the tokens it records, all but the last (pending): answer equality alone misses an
    # off-by-one on tiny random models, which often answer the same after a token more or less (hunt 21)
    store = server.ctx.store
    mine = [r for r in store.index.list() if r.owner.startswith(reuse_scope("anonymous", user, None) + "#")]
    assert len(mine) >= 5, [r.handle for r in mine]
    for rec in mine:
        full, state = store.load(rec.owner, rec.handle)
        want = model.prefill(full.token_ids[:-1])[1]
        assert sorted(state) == sorted(want), rec.handle
        for k in want:
            assert state[k].shape == want[k].shape, (rec.handle, k)
            assert torch.allclose(state[k].float(), want[k].float(), rtol=1e-4, atol=1e-4), (rec.handle, k)


SPEC_PROMPTS = [PROMPT * 3, PROMPT[3:] * 2 + PROMPT[:5], [7, 8, 9, 7, 8, 9, 7, 8]]
SPEC_PARAMS = [
    SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2),
    SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True, logprobs=1),
    SamplingParams(max_tokens=24, temperature=0.8, seed=5, ignore_eos=True, frequency_penalty=0.4,
                   repetition_penalty=1.2),
]  # fmt: skip


def speculative_engine(m, family_dir, k: int) -> Engine:
    eng = engine(m, family_dir, n_slots=3, token_budget=32, prefill_chunk=8, speculative_tokens=k)
    if k and not eng.speculates:
        pytest.skip(f"{m.family}: a chunk of {k + 1} tokens does not have stepping's bits here (no native kernel "
                    "for these weights on this CPU, or no compiler): the engine does not speculate")  # fmt: skip
    return eng


def run_all(eng: Engine, prompts, params) -> list:
    handles = [eng.submit(p, sp, capture_state=True, request_id=f"r{i}")
               for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]  # fmt: skip
    eng.run_until_done()
    return [(h.output.token_ids, h.output.logprobs, h.output.text, h.output.finish_reason, h.run_result())
            for h in handles]  # fmt: skip


def draft_from(eng: Engine, runs: list, wrong_every: int = 0) -> None:
    """The engine's drafts are the tokens the plain run put out next (so they are accepted), the third of every
    `wrong_every`-th draft made wrong (a draft refused there, the tokens before it accepted) and every draft after
    the 9th output token wrong from its first (all refused): each path of the check, whatever the random model
    writes (prompt lookup finds little in a random model's output)."""
    vocab = eng.model.vocab_size
    calls = iter(range(1 << 30))

    def draft(req, room: int) -> list[int]:
        want, i = runs[int(req.request_id[1:])][0], len(req.output_ids)
        d = list(want[i : i + min(room, 5)])
        if wrong_every and d and i > 9:
            d[0] = (d[0] + 1) % vocab
        elif wrong_every and len(d) > 2 and next(calls) % wrong_every == 0:
            d[2] = (d[2] + 1) % vocab
        return d

    eng.scheduler.draft = draft


def assert_same_runs(got: list, want: list, family: str) -> None:
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a[:4] == b[:4], f"{family}: request {i}"
        assert a[4].history == b[4].history, f"{family}: request {i}'s history"
        assert b[4].final_state is not None and a[4].final_state is not None, f"{family}: request {i}'s final state"
        for name, t in b[4].final_state.items():
            assert torch.equal(a[4].final_state[name], t), f"{family}: request {i}'s final state {name}"


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_speculative_decoding_answers_as_stepping(family_dir, request, dtype):
    """Drafts checked in one chunk (speculative decoding): greedy, seeded top-p and penalized sampling give the
    tokens, logprobs and final states, to the bit, of an engine that steps token by token, for three requests
    batched, with drafts accepted whole, in part and not at all."""
    if dtype == "int8" and not getattr(request.node.callspec.params["family_dir"], "INT8", True):
        pytest.skip("a family without int8 weights (tests/families/toy.py: float32 only)")
    m = load_model(family_dir, dtype=dtype)
    fast = speculative_engine(m, family_dir, 5)
    want = run_all(speculative_engine(m, family_dir, 0), SPEC_PROMPTS, SPEC_PARAMS)
    draft_from(fast, want, wrong_every=2)
    assert_same_runs(run_all(fast, SPEC_PROMPTS, SPEC_PARAMS), want, m.family)
    r = fast.runner
    assert 0 < r.accepted < r.drafted, (r.accepted, r.drafted)


def test_a_stop_inside_a_checked_draft_keeps_the_state_of_stepping(family_dir):
    """A stop string that ends the reply inside an accepted draft, or inside one refused after it: the state kept
    (chat reuse's) holds exactly the history but its pending token, as a step-by-step run's, after the engine puts
    it back (`ModelRunner.rewind`)."""
    m = load_model(family_dir)
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    plain = run_all(speculative_engine(m, family_dir, 0), SPEC_PROMPTS, [sp] * 3)
    rewound = 0
    for i, (_, _, text, _, _) in enumerate(plain):
        for cut, wrong in ((5, 0), (9, 0), (14, 2), (18, 3)):  # stop strings ending at several places of the reply
            stop = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[text[cut - 2 : cut]])
            want = run_all(speculative_engine(m, family_dir, 0), [SPEC_PROMPTS[i]], [stop])
            fast = speculative_engine(m, family_dir, 6)
            draft_from(fast, [plain[i]], wrong)
            assert_same_runs(run_all(fast, [SPEC_PROMPTS[i]], [stop]), want, m.family)
            rewound += fast.runner.rewound
    assert rewound > 0, "no stop fell inside a checked draft: the test proves nothing"


def test_a_request_checking_drafts_moves_to_another_engine_exactly(family_dir):
    """Live migration with drafts on both sides: requests suspended after each of the first steps (some after a
    refused draft, when a recurrent state waits to feed the accepted tokens again) go on in another engine and give
    the tokens and text of a run that never drafted nor moved."""
    m = load_model(family_dir)
    want = run_all(speculative_engine(m, family_dir, 0), SPEC_PROMPTS, SPEC_PARAMS)
    for steps in range(1, 7):
        src = speculative_engine(m, family_dir, 5)
        draft_from(src, want, wrong_every=2)
        handles = [src.submit(p, sp, request_id=f"r{i}")
                   for i, (p, sp) in enumerate(zip(SPEC_PROMPTS, SPEC_PARAMS, strict=True))]  # fmt: skip
        for _ in range(steps):
            src.step()
        moving = [src.suspend(h.request_id) for h in handles]
        src.step()
        dst = speculative_engine(m, family_dir, 5)
        draft_from(dst, want, wrong_every=3)
        moved = [dst.resume_continuation(f.result(), sp, request_id=f"r{i}")
                 for i, (f, sp) in enumerate(zip(moving, SPEC_PARAMS, strict=True))]  # fmt: skip
        dst.run_until_done()
        for i, (h, w) in enumerate(zip(moved, want, strict=True)):
            assert (h.output.token_ids, h.output.text) == (w[0], w[2]), f"{m.family}: request {i} after {steps} steps"
