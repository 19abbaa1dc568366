"""A thinking budget (engine/thinking.py; vLLM's `thinking_token_budget`, llama.cpp's `--reasoning-budget`): at most N
tokens inside a think block, then `</think>`'s tokens are forced and the reply answers. The count over a byte
vocabulary; the embedded model reasoning in a block its prompt opened, stepping, moved between engines mid-way and
checking drafts, each equal to the plain budgeted run. Over HTTP (chat, Messages, --reasoning-budget): in
tests/test_reasoning.py."""

from __future__ import annotations

import pytest

from wkvm import LLM, SamplingParams
from wkvm.config import EngineConfig
from wkvm.engine.engine import Engine
from wkvm.engine.thinking import END, WAIT, ThinkingBudget, ends_inside, partial_end, unfinished_utf8
from wkvm.models import fused
from wkvm.models.rwkv7 import step

E_ACUTE = "é".encode()
PIECES = [b"<think>", b"\n", b"a", b"b", b"</", b"think", b">", E_ACUTE[:1], E_ACUTE[1:], b" <th", b"ink>x", b"  ",
          b"<tool_call>", b"<tool_"]
TB = PIECES.__getitem__
END_IDS = [4, 5, 6]  # "</", "think", ">"


def run(budget: ThinkingBudget, wanted: list[int]) -> list[int]:
    """The tokens a reply puts out where the model wants `wanted`, one a position, under `budget`."""
    out = []
    for t in wanted:
        forced = budget.next_forced()
        out.append(t if forced is None else forced)
        budget.feed(out[-1])
    return out


def test_a_history_ends_inside_a_think_block_where_its_last_tag_opens_one():
    assert ends_inside([2, 0, 1, 2], TB)
    assert not ends_inside([0, 2, 4, 5, 6, 2], TB)  # closed, the tag over three tokens
    assert not ends_inside([2, 3], TB) and not ends_inside([], TB)
    assert ends_inside([9, 10, 2], TB)  # opened over two tokens
    assert ends_inside([0, 2, 4, 5, 6, *[2] * 500, 0, *[3] * 500], TB)  # the last tag counts, however far back


def test_a_budget_counts_the_reasoning_then_forces_its_end():
    def budget(n: int, inside: bool, end_ids: list[int] = END_IDS) -> ThinkingBudget:
        return ThinkingBudget.start(n, end_ids, TB, inside)

    # a prompt that opened the block: the first 2 tokens are the model's, then "</think>", then the model's again
    assert run(budget(2, True), [2, 3, 2, 2, 2, 2]) == [2, 3, 4, 5, 6, 2]
    assert run(budget(0, True), [2, 3, 2, 2]) == [4, 5, 6, 2]  # 0: no reasoning at all
    # the reply opens the block itself (after whitespace, over two tokens; "x" after the tag is not counted)
    assert run(budget(2, False), [11, 9, 10, 2, 3, 2, 2, 2, 2]) == [11, 9, 10, 2, 3, 4, 5, 6, 2]
    assert run(budget(1, False), [2, 0, 3, 3, 3]) == [2, 0, 3, 3, 3]  # not at the reply's start: all answer
    assert run(budget(3, True), [2, 4, 5, 6, 2, 2, 2, 2]) == [2, 4, 5, 6, 2, 2, 2, 2]  # closing at the budget: waits
    assert run(budget(1, True), [4, 2, 2, 2, 2]) == [4, 2, 4, 5, 6]  # "</" then not the tag: forced one token late
    assert run(budget(2, True), [2, 12, 2, 2, 2]) == [2, 12, 2, 2, 2]  # a call opened in the block ends the count
    assert run(budget(2, True), [2, 13, 12, 2]) == [2, 13, 12, 2]  # ... and one that may be opening waits for it
    b = budget(5, True)
    run(b, [2, 4, 5, 6])
    assert b.phase == "done" and b.count == 4
    # the budget ends inside a character: up to WAIT more tokens may finish it before the end is forced
    assert run(budget(1, True), [7, 8, 2, 2, 2, 2]) == [7, 8, 4, 5, 6, 2]
    assert run(budget(1, True), [7] * 8) == [7] * (1 + WAIT) + [4, 5, 6, 7]  # never finished: forced anyway
    assert run(budget(1, True, []), [2, 2, 2]) == [2, 2, 2]  # no tokens for </think> in the model: nothing forced
    assert unfinished_utf8(E_ACUTE[:1]) and not unfinished_utf8(E_ACUTE) and unfinished_utf8("€".encode()[:2])
    assert not unfinished_utf8(b"") and not unfinished_utf8(b"a")
    assert partial_end(b"x</thi") and partial_end(b"<") and not partial_end(b"</think>") and not partial_end(b"x")


def test_the_budget_is_checked():
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="thinking_token_budget"):
            SamplingParams(thinking_token_budget=bad)
    for bad_message in (None, "x" * 1025):
        with pytest.raises(ValueError, match="thinking_budget_message"):
            SamplingParams(thinking_budget_message=bad_message)
    assert SamplingParams(thinking_token_budget=0).thinking_token_budget == 0


PROMPT = "KING RICHARD:\nWhat say you, my lord?\n\nQUEEN:\n<think>\n"  # a template opened the block


@pytest.fixture(scope="module")
def llm():
    return LLM()


def generate(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> list[tuple[list[int], str]]:
    handles = [engine.submit(p, sp, request_id=f"r{i}") for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]
    engine.run_until_done()
    return [(h.output.token_ids, h.output.text) for h in handles]


def test_the_embedded_model_reasons_within_its_budget_then_answers(llm):
    """Greedy and seeded: the reply's first N tokens are the free reply's, then `</think>`'s tokens, then the model's
    answer (not the free reply's tokens: the state took the end); logprobs are the model's own, forced ones too."""
    end = llm.tokenizer.encode(END)
    for seed in (None, 7):
        kw = dict(max_tokens=30, temperature=0 if seed is None else 1.0, seed=seed, ignore_eos=True, logprobs=2)
        free = llm.generate([PROMPT], SamplingParams(**kw))[0].outputs[0]
        for n in (0, 6):
            out = llm.generate([PROMPT], SamplingParams(**kw, thinking_token_budget=n))[0].outputs[0]
            assert out.token_ids[:n] == free.token_ids[:n] and out.token_ids[n : n + len(end)] == end, (seed, n)
            assert out.logprobs[:n] == free.logprobs[:n]
            assert all(t in lp and lp[t] <= 0 for t, lp in zip(out.token_ids, out.logprobs, strict=True))
            assert out.text.count(END) == 1 and len(out.token_ids) == 30
        said = llm.generate([PROMPT], SamplingParams(**kw, thinking_token_budget=6,  # llama.cpp's budget message
                                                     thinking_budget_message="\nTime to answer."))[0].outputs[0]
        assert said.token_ids[:6] == free.token_ids[:6] and said.text.count("Time to answer.</think>") == 1
        long = llm.generate([PROMPT], SamplingParams(**kw, thinking_token_budget=100))[0].outputs[0]
        assert long.token_ids == free.token_ids  # a budget the reply never reaches changes nothing
    opened_by_reply = llm.generate([PROMPT.removesuffix("<think>\n")],  # no block: nothing to count
                                   SamplingParams(max_tokens=20, temperature=0, thinking_token_budget=0))
    plain = llm.generate([PROMPT.removesuffix("<think>\n")], SamplingParams(max_tokens=20, temperature=0))
    assert opened_by_reply[0].outputs[0].token_ids == plain[0].outputs[0].token_ids


def test_a_budgeted_request_moved_to_another_engine_goes_on_exactly(llm):
    """Suspended after each of the first steps (before the budget, while the end is forced, after it), a budgeted
    request goes on in another engine as it would have: the destination replays its output through the count."""
    prompt = llm.tokenizer.encode(PROMPT)
    params = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, thinking_token_budget=4),
              SamplingParams(max_tokens=20, temperature=1.0, seed=3, ignore_eos=True, thinking_token_budget=2)]
    want = generate(Engine(llm.model, llm.tokenizer, EngineConfig()), [prompt] * 2, params)
    assert all(END in text for _, text in want)
    for steps in range(1, 11):
        src = Engine(llm.model, llm.tokenizer, EngineConfig())
        handles = [src.submit(prompt, sp, request_id=f"r{i}") for i, sp in enumerate(params)]
        for _ in range(steps):
            src.step()
        moving = [src.suspend(h.request_id) for h in handles]
        src.step()
        dst = Engine(llm.model, llm.tokenizer, EngineConfig())
        moved = [dst.resume_continuation(f.result(), sp, request_id=f"r{i}")
                 for i, (f, sp) in enumerate(zip(moving, params, strict=True))]  # fmt: skip
        dst.run_until_done()
        assert [(h.output.token_ids, h.output.text) for h in moved] == want, f"moved after {steps} steps"


@pytest.mark.skipif(not (fused.available() and step.available()), reason="wkvm's kernels do not run here (no "
                    "compiler or WKVM_FUSED=off): the engine checks no drafts without them")  # fmt: skip
def test_drafts_checked_under_a_budget_answer_as_stepping(llm):
    """Drafts made from the budgeted run's own tokens (every other one made wrong, so some are refused): the forced
    end goes through the same count position by position, and the reply is the stepping one."""
    prompt = llm.tokenizer.encode(PROMPT)
    params = [SamplingParams(max_tokens=30, temperature=t, seed=5, ignore_eos=True, thinking_token_budget=5)
              for t in (0, 1.0)]  # fmt: skip
    want = generate(Engine(llm.model, llm.tokenizer, EngineConfig()), [prompt] * 2, params)
    fast = Engine(llm.model, llm.tokenizer, EngineConfig(speculative_tokens=6))
    calls = [0]

    def draft(req, room):
        calls[0] += 1
        d = want[int(req.request_id[1:])][0][len(req.output_ids) :][: min(room, 6)]
        return [t + 1 if calls[0] % 2 and i == len(d) - 1 else t for i, t in enumerate(d)]

    fast.scheduler.draft = draft
    assert generate(fast, [prompt] * 2, params) == want
    assert fast.runner.accepted > 0 and fast.runner.accepted < fast.runner.drafted


def test_only_a_history_s_last_tokens_are_read_for_an_opened_block():
    """`ends_inside` reads the last SCAN tokens (it runs on the event loop under the engine's lock): a block opened
    further back is not seen; one opened within them is, whatever the window its tag is cut by."""
    from wkvm.engine.thinking import SCAN

    for gap in (0, 1, 62, 63, 64, 65, 250, 1000, SCAN - 2):
        assert ends_inside([0, *[2] * gap], TB), gap
        assert ends_inside([2, 9, 10, *[2] * gap], TB), gap  # the tag over two tokens
    assert not ends_inside([0, *[2] * SCAN], TB)
