"""Speculative decoding by prompt lookup (docs/speculative.md): the drafts, the settings, and the embedded model
copying from its prompt with drafts checked, answering as without them, in process and over HTTP. Every family's
exactness (tokens, logprobs, final states to the bit; drafts accepted whole, in part, not at all; a stop inside a
draft) is in tests/test_conformance.py."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from live_server import LiveServer

from wkvm import LLM, SamplingParams
from wkvm.config import MAX_SPECULATIVE_TOKENS, EngineConfig, ServerConfig, default_model
from wkvm.engine.drafts import NgramDrafter
from wkvm.engine.engine import Engine
from wkvm.models import fused
from wkvm.models.family import STEP_CHUNK
from wkvm.models.rwkv7 import step

# the embedded model checks drafts on wkvm's fp32 gemv kernel and RWKV-7's step kernel, both built with the machine's
# compiler (every x86-64 CPU runs them); without one the engine does not speculate (it logs why)
KERNELS_HERE = fused.available() and step.available()
needs_kernels = pytest.mark.skipif(not KERNELS_HERE, reason="wkvm's kernels do not run here (no compiler or "
                                   "WKVM_FUSED=off)")  # fmt: skip
SHAKESPEARE = Path(__file__).resolve().parent.parent / "data" / "tinyshakespeare.txt"  # the repo's own copy


def test_a_draft_is_what_followed_the_longest_recent_ngram():
    d = NgramDrafter(2, 4)
    d.extend([1, 2, 3, 4, 5, 9, 9, 1, 2, 3])
    assert d.propose(3) == [4, 5, 9]  # "1 2 3" occurred at the start: what followed it
    d.extend([4, 7])
    assert d.propose(3) == []  # "4 7" never occurred before
    d.extend([1, 2, 3, 8, 1, 2, 3])
    assert d.propose(2) == [8, 1]  # the latest occurrence of "1 2 3" wins
    d.extend([4])
    assert d.propose(9) == [7, 1, 2, 3, 8, 1, 2, 3, 4]  # "1 2 3 4" (the longest) last occurred before "7"
    assert d.propose(0) == []


def test_a_draft_stops_at_the_history_end_and_needs_min_n():
    d = NgramDrafter(1, 3)
    d.extend([5, 5, 5])
    assert d.propose(4) == [5]  # "5 5" last ended one before the end: one token follows it
    d = NgramDrafter(3, 3)
    d.extend([1, 2, 1, 2])
    assert d.propose(4) == []  # no 3-gram repeats
    with pytest.raises(ValueError, match="prompt lookup"):
        NgramDrafter(3, 2)


def test_the_settings_are_checked():
    assert MAX_SPECULATIVE_TOKENS == STEP_CHUNK - 1  # a draft and its pending token: one chunk of stepping's bits
    with pytest.raises(ValueError, match="speculative_tokens must be in 0..7"):
        EngineConfig(speculative_tokens=8)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        EngineConfig(speculative_tokens=4, prompt_lookup_min=5)
    with pytest.raises(ValueError, match="speculative_max_running"):
        EngineConfig(speculative_max_running=0)
    c = ServerConfig(speculative_tokens=3, prompt_lookup_max=5, prompt_lookup_min=1,
                     speculative_max_running=2).engine_config()  # fmt: skip
    assert (c.speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min, c.speculative_max_running) == (3, 5, 1, 2)


def copy_prompts() -> list[str]:
    text = SHAKESPEARE.read_text()[:2400]
    return [text[:900] + "\n" + text[:120], text[1000:1700] + "\n" + text[1000:1080]]


@pytest.fixture(scope="module")
def plain_and_fast():
    return LLM(speculative_tokens=0), LLM(speculative_tokens=6)


@needs_kernels
@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=80, temperature=0, ignore_eos=True, logprobs=1),
    SamplingParams(max_tokens=80, temperature=0.8, top_k=40, seed=3, ignore_eos=True),
], ids=["greedy", "seeded"])  # fmt: skip
def test_the_embedded_model_copies_with_drafts_and_answers_as_without(plain_and_fast, params):
    """The embedded RWKV-7 model (float32) repeating a passage of its prompt: prompt lookup drafts from it, drafts
    are accepted, and the replies (tokens, logprobs, text) are those of the engine without drafts."""
    plain, fast = plain_and_fast
    assert fast.engine.speculates and not plain.engine.speculates
    before = fast.engine.runner.accepted
    want = [o.outputs[0] for o in plain.generate(copy_prompts(), params)]
    got = [o.outputs[0] for o in fast.generate(copy_prompts(), params)]
    assert [(o.token_ids, o.logprobs, o.text) for o in got] == [(o.token_ids, o.logprobs, o.text) for o in want]
    assert fast.engine.runner.accepted > before


@needs_kernels
def test_the_server_speculates_and_counts_drafts(plain_and_fast):
    """`wkvm serve --speculative-tokens 6`: a streamed completion equals the offline engine's without drafts, and
    /metrics counts the drafts checked and accepted."""
    plain, _ = plain_and_fast
    prompt = copy_prompts()[0]
    want = plain.generate([prompt], SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))[0].outputs[0].text
    with LiveServer(model=str(default_model()), speculative_tokens=6) as server:
        req = {"prompt": prompt, "max_tokens": 60, "temperature": 0, "ignore_eos": True, "stream": True}
        text = ""
        with httpx.stream("POST", f"{server.url}/v1/completions", json=req, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    text += httpx.Response(200, content=line[6:]).json()["choices"][0]["text"]
        assert text == want
        metrics = httpx.get(f"{server.url}/metrics").text
    counts = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
              if line.startswith("wkvm_spec_decode_")}  # fmt: skip
    assert counts["wkvm_spec_decode_accepted_tokens_total"] > 0, counts
    assert counts["wkvm_spec_decode_draft_tokens_total"] >= counts["wkvm_spec_decode_accepted_tokens_total"]


@needs_kernels
def test_a_grammar_reply_with_drafts_answers_as_without(plain_and_fast):
    """A reply held to a grammar, with drafts that its plain run's tokens make (so they are accepted, and the grammar
    completes inside one): tokens, text and the kept state are the plain run's, greedy and seeded."""
    plain, _ = plain_and_fast
    words = "(thou|thee|my lord|good|king|queen)"
    regex = {"regex": f"{words}( {words}){{6,14}}\\."}
    params = [SamplingParams(max_tokens=60, temperature=t, seed=4, structured_outputs=regex) for t in (0, 1.0)]
    prompt = plain.tokenizer.encode("KING RICHARD:\nWhat say you, my lord?\n\nQUEEN:\n")

    def run(engine):
        handles = [engine.submit(prompt, p, capture_state=True, request_id=f"r{i}") for i, p in enumerate(params)]
        engine.run_until_done()
        return [(h.output.token_ids, h.output.text, h.run_result()) for h in handles]

    want = run(Engine(plain.model, plain.tokenizer, EngineConfig()))
    fast = Engine(plain.model, plain.tokenizer, EngineConfig(speculative_tokens=6))
    fast.scheduler.draft = lambda req, room: want[int(req.request_id[1:])][0][len(req.output_ids) :][: min(room, 6)]
    got = run(fast)
    for (tokens, text, result), (w_tokens, w_text, w_result) in zip(got, want, strict=True):
        assert (tokens, text) == (w_tokens, w_text) and text.endswith(".")
        assert result.history == w_result.history
        assert all(torch.equal(result.final_state[k], v) for k, v in w_result.final_state.items())
    assert fast.runner.accepted > 0 and fast.runner.rewound > 0, (fast.runner.accepted, fast.runner.rewound)


@needs_kernels
def test_no_drafts_while_more_requests_run_than_allowed():
    """`speculative_max_running`: two requests running together on an engine that drafts for one at most check no
    draft; one alone does."""
    llm = LLM(speculative_tokens=6, speculative_max_running=1)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    llm.generate(copy_prompts(), params)
    assert llm.engine.runner.drafted == 0
    llm.generate(copy_prompts()[:1], params)
    assert llm.engine.runner.drafted > 0


@needs_kernels
def test_a_chat_with_drafts_answers_as_one_without():
    """Four chat turns quoting the conversation back (prompt lookup drafts from the earlier turns a resumed state
    holds) on a server with drafts: every turn's tokens and logprobs equal those of a server without, later turns
    resume from the state the turn before parked (a reply's kept state is exact), and drafts were checked."""
    config = {"model": str(default_model()), "slots": 2}
    text = SHAKESPEARE.read_text()[6000:6600]
    with LiveServer(**config, speculative_tokens=6) as fast, LiveServer(**config) as plain:
        messages, modes = [], []
        for turn in [text[:300], "Again:" + text[:120], text[300:600], "Once more:" + text[300:420]]:
            messages.append({"role": "user", "content": turn})
            req = {"messages": messages, "max_tokens": 40, "temperature": 0, "ignore_eos": True, "logprobs": True}
            a = httpx.post(f"{fast.url}/v1/chat/completions", json=req, timeout=60).json()
            b = httpx.post(f"{plain.url}/v1/chat/completions", json=req, timeout=60).json()
            assert a["choices"][0]["logprobs"] == b["choices"][0]["logprobs"], f"turn {len(modes) + 1}"
            modes.append(a["wkvm"]["mode"])
            messages.append({"role": "assistant", "content": a["choices"][0]["message"]["content"]})
        metrics = httpx.get(f"{fast.url}/metrics").text
    assert modes[0] == "fresh" and all(m != "fresh" for m in modes[1:]), modes
    drafted = [line for line in metrics.splitlines() if line.startswith("wkvm_spec_decode_draft_tokens_total")]
    assert drafted and float(drafted[0].split()[1]) > 0, drafted


@needs_kernels
def test_the_cli_takes_speculative_tokens(capsys, tmp_path):
    """`wkvm generate --speculative-tokens 6` prints the text it prints without drafts; `wkvm chat`'s engine drafts."""
    from wkvm.cli import build_parser, main
    from wkvm.cli_chat import ChatREPL

    prompt = copy_prompts()[0]
    argv = ["generate", prompt, "--max-tokens", "40", "--temperature", "0", "--json"]
    assert main(argv) == 0
    want = capsys.readouterr().out
    assert main([*argv, "--speculative-tokens", "6"]) == 0
    assert capsys.readouterr().out == want
    args = build_parser().parse_args(["chat", "--speculative-tokens", "5"])
    repl = ChatREPL(str(default_model()), tmp_path / "chat", SamplingParams(max_tokens=4), args.dtype,
                    args.speculative_tokens)  # fmt: skip
    assert repl.engine.speculates and repl.engine.config.speculative_tokens == 5
