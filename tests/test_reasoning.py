"""A thinking model's reasoning apart from its answer (wkvm/server/reasoning.py, vLLM's `--reasoning-parser`):
`<think>...</think>` as `reasoning_content`, streamed as `delta.reasoning_content`, the answer (and its tool calls)
after it; pieces of any size join to the blocking reply, and a stream moved mid-way goes on from the same point.
End to end on the random char model with a template that opens a think block (a random model never closes one:
its whole reply is reasoning there; the parser's cases are unit tests)."""

from __future__ import annotations

import random
import shutil

import openai
import pytest
from live_server import LiveServer

from wkvm.server.openai_routes import ChoiceDeltas, reply
from wkvm.server.reasoning import Thinking, parts, split, thinking
from wkvm.server.tools import tool_mode

INSIDE, OUTSIDE = Thinking(inside=True), Thinking(inside=False)
CALLING = Thinking(inside=True, calls=True)  # tools may be called from the text: a <tool_call> ends the reasoning too
CALL = '{"name": "add", "arguments": {"a": 1, "b": 2}}'
XML = ("<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n2\n</parameter>\n</function>\n"
       "</tool_call>")

ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}  # fmt: skip


def test_the_reasoning_and_the_answer_of_a_finished_reply():
    assert parts("Let me see.\n</think>\n\nIt is 4.", INSIDE) == ("Let me see.\n", "\n\nIt is 4.")
    assert parts("Still thinking", INSIDE) == ("Still thinking", None)  # ended before </think>: no answer
    assert parts("</think>4", INSIDE) == ("", "4")
    assert parts("\n<think>hmm</think>4", OUTSIDE) == ("hmm", "4")  # the model opened the block itself
    assert parts("Just 4. <think>x</think>", OUTSIDE) == (None, "Just 4. <think>x</think>")  # not at its start
    assert parts("<thi", OUTSIDE) == (None, "<thi")  # ended on what looked like a tag's start: words
    assert parts("a</think>b", Thinking(inside=True, include=False)) == (None, "b")  # include_reasoning false
    assert parts("a</think>b", None) == (None, "a</think>b")


def test_an_unfinished_reply_holds_what_may_be_a_tag():
    assert split("Let me see </thi", INSIDE, False) == (0, len("Let me see "), None)  # may be </think>: waits
    assert split("Let me see </thi", INSIDE, True) == (0, len("Let me see </thi"), None)  # ended: reasoning
    assert split("a < b", INSIDE, False) == (0, 5, None)  # "<" followed by a space is no tag's start... but
    assert split("a <", INSIDE, False) == (0, 2, None)  # a last "<" may be
    assert split("  <th", OUTSIDE, False) == (0, 0, None)  # may open a block: nothing is decided
    assert split("  <tx", OUTSIDE, False) == (0, 0, 0)  # cannot: all answer
    assert split("<think>ab</think>c", OUTSIDE, False) == (7, 9, 17)
    # with tools, a call opened inside the block ends it and begins the answer (Qwen3.5), not without
    assert split(f"Let me add.\n{XML}", CALLING, False) == (0, 12, 12)
    assert split(f"Let me add.\n{XML}", INSIDE, False) == (0, len(f"Let me add.\n{XML}"), None)
    assert split("a</think>b<tool_call>", CALLING, True) == (0, 1, 9)  # the block closed first
    assert split("Let me add <tool_c", CALLING, False) == (0, len("Let me add "), None)  # may be a call: waits


def test_which_requests_are_read_for_reasoning():
    qwen = "{{ '<think>' }}...{{ '</think>' }}"
    assert thinking("auto", [qwen, None], "[user]hi[assistant]<think>\n", False) == INSIDE
    assert thinking("auto", [qwen], "[assistant]<think>\n\n</think>\n\n", False) == OUTSIDE  # thinking off
    assert thinking("auto", ["[assistant]", None], "x", False) is None  # a template that knows no </think>
    assert thinking("qwen3", [None], "x", False) == OUTSIDE  # vLLM's names: on whatever the template
    assert thinking("auto", [qwen], "[assistant]", True) is None  # a grammar shapes the reply from its start
    assert thinking("auto", [qwen], "<think>", True) == INSIDE  # ... or, the block open, from its </think> on
    assert thinking("none", [qwen], "<think>", False) is None


def stream(text: str, mode, think, rng: random.Random, cut: int | None = None) -> list[dict]:
    """The deltas of `text` fed in random pieces; `cut`: moved to another server there (a new ChoiceDeltas that
    knows only the text sent so far)."""
    choice, deltas, at = ChoiceDeltas(mode, think), [], 0
    while at < len(text):
        step = min(len(text), at + rng.randint(1, 5))
        if cut is not None and at < cut < step:
            step = cut
        deltas.append(choice.feed(text[at:step], None)[0])
        at = step
        if at == cut:  # the stream moves: the new server knows the text so far, not what the old one held back
            choice = ChoiceDeltas(mode, think, text[:at])
    deltas.append(choice.feed("", "stop")[0])
    return deltas


def test_streamed_pieces_join_to_the_blocking_reply():
    """Any piece sizes, with and without tools, moved mid-way or not: joined reasoning, content and calls equal the
    blocking message's; a tag's characters never go out as reasoning or content."""
    rng = random.Random(3)
    auto = tool_mode([ADD], None, None)
    cases = [("Let me add.\n</think>\n\nIt is 3.", INSIDE, None),
             ("Thinking </th still </think>done", INSIDE, None),
             ("no end in sight", INSIDE, None), ("\n<think>so</think>Words.", OUTSIDE, None),
             ("Plain <b>words</b>", OUTSIDE, None), ("<thinking>is not a tag</thinking>", OUTSIDE, None),
             (f"I should add.</think>\n<tool_call>{CALL}</tool_call>", INSIDE, auto),
             (f"Sure.<tool_call>{CALL}</tool_call>", OUTSIDE, auto),
             ("hm</think>Just words.", INSIDE, auto),
             (f"I should add.\n</think>\n\n{XML}", INSIDE, auto), (f"I should add.\n{XML}", CALLING, auto),
             (f"I should add.<tool_call>{CALL}</tool_call>", CALLING, auto), (f"Sure.\n{XML[:-25]}", OUTSIDE, auto),
             (f"Two.{XML}\n{XML[:-12]}", CALLING, auto),
             (f"<tool_call>{CALL}</tool_call>", None, tool_mode([ADD], "none", None)),  # as it comes: nothing held
             (CALL, None, tool_mode([ADD], None, None, shaped=True)), ("Plain words.", None, None)]  # fmt: skip
    for text, think, mode in cases:
        want, _ = reply(text, "stop", mode, think)
        for cut in (None, *rng.sample(range(len(text)), 3)):
            deltas = stream(text, mode, think, rng, cut)
            thought = "".join(d.get("reasoning_content", "") for d in deltas)
            words = "".join(d.get("content") or "" for d in deltas)
            assert thought == (want.get("reasoning_content") or ""), (text, cut, thought)
            assert words == (want["content"] or "") or words.lstrip() == want["content"], (text, cut, words)
            assert "</think>" not in thought + words and "<think>" not in thought
            calls: dict[int, list[str]] = {}
            for tc in (tc for d in deltas for tc in d.get("tool_calls", [])):
                name, args = calls.setdefault(tc["index"], [tc["function"].get("name"), ""])
                calls[tc["index"]] = [name, args + tc["function"]["arguments"]]
            assert [tuple(c) for c in calls.values()] == [
                (c["function"]["name"], c["function"]["arguments"]) for c in want.get("tool_calls", [])], text


THINKING_TEMPLATE = ("{% for m in messages %}[{{ m.role }}]{% if m.reasoning_content %}<think>{{ m.reasoning_content }}"
                     "</think>{% endif %}{{ m.content }}{% endfor %}{% if add_generation_prompt %}[assistant]"
                     "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% else %}<think>"
                     "{% endif %}{% endif %}")  # fmt: skip


@pytest.fixture(scope="module")
def thinker(char_model, tmp_path_factory):
    """The char model with a template that opens a think block (as Qwen's and DeepSeek-R1's thinking templates do)."""
    path = tmp_path_factory.mktemp("thinker") / "thinker"
    shutil.copytree(char_model, path)
    (path / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def servers(thinker):
    with LiveServer(model=str(thinker), slots=4) as on, LiveServer(model=str(thinker), slots=4,
                                                                   reasoning_parser="none") as off:  # fmt: skip
        yield (openai.OpenAI(base_url=f"{on.url}/v1", api_key="unused", max_retries=0),
               openai.OpenAI(base_url=f"{off.url}/v1", api_key="unused", max_retries=0))  # fmt: skip


def test_a_thinking_template_s_reply_is_reasoning_blocking_and_streamed(servers):
    on, off = servers
    kw = dict(model="thinker", messages=[{"role": "user", "content": "Why?"}], max_tokens=30, temperature=0)
    raw = off.chat.completions.create(**kw).choices[0].message
    assert not (raw.model_extra or {}).get("reasoning_content") and raw.content  # parser off: the text as it is
    r = on.chat.completions.create(**kw)
    message = r.choices[0].message
    # the random model never writes </think>: all of it is reasoning, and there is no answer (vLLM's null)
    assert message.model_extra["reasoning_content"] == raw.content and message.content is None
    assert r.usage.completion_tokens_details.reasoning_tokens == r.usage.completion_tokens == 30  # OpenAI's count
    chunks = list(on.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 30
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == raw.content
    assert not any(d.content for d in deltas) and len([d for d in deltas if d.model_extra]) > 5  # as it comes
    hidden = on.chat.completions.create(**kw, extra_body={"include_reasoning": False}).choices[0].message
    assert hidden.model_extra["reasoning_content"] is None and hidden.content is None
    # thinking switched off in the template (Qwen's enable_thinking): the prompt closed the block, all is answer
    plain = on.chat.completions.create(**kw, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert plain.choices[0].message.content and plain.choices[0].message.model_extra["reasoning_content"] is None
    assert plain.usage.completion_tokens_details.reasoning_tokens == 0
    assert off.chat.completions.create(**kw).usage.completion_tokens_details is None  # not read for reasoning
    # a reply a grammar shapes reasons first, freely (the grammar waits for </think>, which never comes here: the
    # same tokens as unshaped), where the template opened the block; where it did not, it is all answer in the form
    shaped = on.chat.completions.create(**kw, response_format={"type": "json_object"}).choices[0].message
    assert shaped.model_extra["reasoning_content"] == raw.content and shaped.content is None
    closed = on.chat.completions.create(**kw, response_format={"type": "json_object"},
                                        extra_body={"chat_template_kwargs": {"enable_thinking": False}})  # fmt: skip
    assert closed.choices[0].message.content.lstrip().startswith("{")
    assert "reasoning_content" not in (closed.choices[0].message.model_extra or {})


def test_the_responses_api_gives_the_reasoning_its_own_item(servers):
    """A `reasoning` item (its text as `content`, as vLLM's Responses API), before the answer's items, blocking and
    streamed alike (`response.reasoning_text.delta` as it comes); cut off while reasoning, it is the incomplete one."""
    on, off = servers
    kw = dict(model="thinker", input="Why?", max_output_tokens=30, temperature=0)
    raw = off.responses.create(**kw).output_text
    r = on.responses.create(**kw)
    assert r.status == "incomplete" and [i.type for i in r.output] == ["reasoning"] and r.output_text == ""
    assert r.output[0].content[0].text == raw and r.output[0].status == "incomplete"
    assert r.usage.output_tokens_details.reasoning_tokens == r.usage.output_tokens == 30  # it had said 0 always
    events = list(on.responses.create(stream=True, **kw))
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert len(deltas) > 5 and "".join(deltas) == raw
    final = events[-1].response
    assert final.status == "incomplete" and [i.model_dump(exclude={"id"}) for i in final.output] == [
        i.model_dump(exclude={"id"}) for i in r.output]
    (done,) = [e for e in events if e.type == "response.reasoning_text.done"]
    assert done.text == raw


def test_the_messages_api_gives_the_reasoning_a_thinking_block(servers):
    """Anthropic's Messages API: the reasoning is a `thinking` block before the answer's, blocking and streamed
    (`thinking_delta` as it comes); `thinking: {"type": "disabled"}` is the template's enable_thinking false."""
    import anthropic

    on, off = servers
    url = str(on.base_url).removesuffix("/").removesuffix("/v1")
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    kw = dict(model="thinker", messages=[{"role": "user", "content": "Why?"}], max_tokens=30,
              extra_body={"temperature": 0})  # fmt: skip
    raw = off.chat.completions.create(model="thinker", messages=kw["messages"], max_tokens=30, temperature=0)
    m = client.messages.create(**kw)
    assert [b.type for b in m.content] == ["thinking"] and m.content[0].thinking == raw.choices[0].message.content
    assert m.stop_reason == "max_tokens"
    with client.messages.stream(**kw) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert kinds.count("thinking") > 5 and final.content[0].thinking == m.content[0].thinking
    plain = client.messages.create(**kw, thinking={"type": "disabled"})
    assert [b.type for b in plain.content] == ["text"]


def test_ollama_s_api_gives_the_reasoning_as_thinking(servers):
    """Ollama's /api/chat: the reasoning as `message.thinking`, the answer as content; /api/show says "thinking"."""
    import ollama

    on, off = servers
    url = str(on.base_url).removesuffix("/").removesuffix("/v1")
    client = ollama.Client(host=url)
    raw = off.chat.completions.create(model="thinker", messages=[{"role": "user", "content": "Why?"}], max_tokens=30,
                                      temperature=0).choices[0].message.content  # fmt: skip
    r = client.chat(model="thinker", messages=[{"role": "user", "content": "Why?"}],
                    options={"temperature": 0, "num_predict": 30})  # fmt: skip
    assert r.message.thinking == raw and r.message.content == ""
    parts = list(client.chat(model="thinker", messages=[{"role": "user", "content": "Why?"}], stream=True,
                             options={"temperature": 0, "num_predict": 30}))  # fmt: skip
    assert "".join(p.message.thinking or "" for p in parts) == raw
    assert "thinking" in client.show("thinker").capabilities
    assert "thinking" not in ollama.Client(host=str(off.base_url).removesuffix("/").removesuffix("/v1")).show(
        "thinker").capabilities  # --reasoning-parser none: replies as they are


def test_reasoning_tokens_are_those_before_the_answer():
    """`completion_tokens_details.reasoning_tokens`: the tokens that begin before the answer (the `</think>` tag's
    included), whatever the token boundaries."""
    from types import SimpleNamespace

    from wkvm.server.openai_routes import reasoning_tokens

    pieces = ["a", "b</", "think", ">\n", "cd"]  # a tag split across tokens, the last one spilling into the answer
    vocab = {i: p.encode() for i, p in enumerate(pieces)}
    ctx = SimpleNamespace(tokenizer=SimpleNamespace(token_bytes=vocab.__getitem__, special_ids=frozenset()))
    body = SimpleNamespace(skip_special_tokens=True)

    def answer(ids):
        return SimpleNamespace(output=SimpleNamespace(text="".join(pieces[i] for i in ids), token_ids=ids))

    assert reasoning_tokens(ctx, body, [answer([0, 1, 2, 3, 4])], INSIDE) == 4  # ">\n" begins inside the tag
    assert reasoning_tokens(ctx, body, [answer([0, 1, 2])], INSIDE) == 3  # cut off while reasoning: all of it
    assert reasoning_tokens(ctx, body, [answer([0, 4])], OUTSIDE) == 0 and reasoning_tokens(
        ctx, body, [answer([0])], None) is None


def test_a_grammar_waits_for_the_end_of_the_reasoning():
    """`SamplingParams.grammar_after` (a shaped reply of a template that opened a think block): tokens before
    `</think>` come out as the model wants them, JSON or not; from there only what the grammar allows; the text after
    `</think>` in the token that ends it is the grammar's first (the World tokenizer writes "</think>{" as "</",
    "think", ">{"). A moved request's grammar replays the same way (`ModelRunner.resume` feeds `feed_grammar`)."""
    import torch

    from wkvm.engine.grammar import GrammarCompiler
    from wkvm.engine.sampler import GrammarGate, SamplerRow, sample
    from wkvm.models.rwkv7.tokenizer import WorldTokenizer
    from wkvm.sampling_params import SamplingParams

    tok = WorldTokenizer()
    compiler = GrammarCompiler(tok)

    def row_for() -> SamplerRow:
        p = SamplingParams(max_tokens=50, temperature=0, response_format={"type": "json_object"},
                           grammar_after="</think>")  # fmt: skip
        row = SamplerRow(p, None)
        row.grammar = compiler.state(p.grammar())
        assert p.grammar_after is not None
        row.gate = GrammarGate(p.grammar_after.encode(), tok.token_bytes, tok.encode)
        return row

    def step(row: SamplerRow, want: int) -> int:  # the model's favourite token is `want`
        logits = torch.full((1, tok.vocab_size), -10.0)
        logits[0, want] = 10.0
        (s,) = sample(logits, [row])
        assert s.token is not None, s.error
        row.output_ids.append(s.token)
        return s.token

    x = tok.encode("x")[0]
    row = row_for()
    for t in tok.encode("Plain x, not JSON </think>"):  # free: a JSON grammar would have refused "P"
        assert step(row, t) == t
    assert row.constrained and not row.grammar.allowed(tok.vocab_size)[x]
    assert tok.token_bytes(step(row, x)).startswith(b"{")  # the grammar decides now: "x" refused, an object opens
    row = row_for()
    for t in tok.encode("Hmm</think>{"):  # ">{": the brace inside the closing token is the grammar's
        step(row, t)
    assert row.constrained and row.grammar.allowed(tok.vocab_size)[tok.encode("}")[0]]  # {} may close now
    replay = row_for()
    for t in row.output_ids:  # a moved request's replay reaches the same place
        replay.feed_grammar(t)
    assert replay.constrained and bool((replay.grammar.allowed(tok.vocab_size) == row.grammar.allowed(
        tok.vocab_size)).all())


def test_a_thinking_budget_ends_the_reasoning_and_the_reply_answers(servers, thinker):
    """`thinking_token_budget` (vLLM's): the reasoning is the free reply's first N tokens, `</think>` is forced, and
    the rest is the answer, blocking and streamed; Anthropic's `thinking.budget_tokens` the same; `--reasoning-budget`
    (llama.cpp's) a chat's default that a request's -1 lifts. The random model never closes its block itself."""
    import anthropic

    on, _ = servers
    kw = dict(model="thinker", messages=[{"role": "user", "content": "Why?"}], max_tokens=30, temperature=0)
    free = on.chat.completions.create(**kw).choices[0].message.model_extra["reasoning_content"]
    r = on.chat.completions.create(**kw, extra_body={"thinking_token_budget": 5})
    message, end = r.choices[0].message, len("</think>")  # the char model: a token a character
    assert message.model_extra["reasoning_content"] == free[:5] and message.content
    assert r.usage.completion_tokens == 30 and r.usage.completion_tokens_details.reasoning_tokens == 5 + end
    chunks = list(on.chat.completions.create(stream=True, extra_body={"thinking_token_budget": 5}, **kw))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == free[:5]
    assert "".join(d.content or "" for d in deltas) == message.content
    url = str(on.base_url).removesuffix("/").removesuffix("/v1")
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    m = client.messages.create(model="thinker", messages=kw["messages"], max_tokens=30, extra_body={"temperature": 0},
                               thinking={"type": "enabled", "budget_tokens": 5})  # fmt: skip
    assert [(b.type, getattr(b, "thinking", None) or b.text) for b in m.content] == [
        ("thinking", free[:5]), ("text", message.content)]
    with pytest.raises(openai.BadRequestError, match="thinking_token_budget"):
        on.chat.completions.create(**kw, extra_body={"thinking_token_budget": -2})
    with pytest.raises(anthropic.BadRequestError, match="budget_tokens"):
        client.messages.create(model="thinker", messages=kw["messages"], max_tokens=30,
                               thinking={"type": "enabled", "budget_tokens": "many"})  # fmt: skip
    with LiveServer(model=str(thinker), slots=2, reasoning_budget=5) as capped:
        c = openai.OpenAI(base_url=f"{capped.url}/v1", api_key="unused", max_retries=0)
        assert c.chat.completions.create(**kw).choices[0].message.model_dump() == message.model_dump()
        lifted = c.chat.completions.create(**kw, extra_body={"thinking_token_budget": -1}).choices[0].message
        assert lifted.model_extra["reasoning_content"] == free and lifted.content is None
        raw = c.completions.create(model="thinker", prompt="Why?<think>", max_tokens=20, temperature=0).choices[0]
        assert "</think>" not in raw.text  # completions take a request's own budget only
    # --reasoning-budget-message (llama.cpp's): forced before </think>, the reasoning closes with it
    with LiveServer(model=str(thinker), slots=2, reasoning_budget=5, reasoning_budget_message="Done.") as said:
        c = openai.OpenAI(base_url=f"{said.url}/v1", api_key="unused", max_retries=0)
        closed = c.chat.completions.create(**kw).choices[0].message
        assert closed.model_extra["reasoning_content"] == free[:5] + "Done." and closed.content


def test_a_thinking_template_s_next_turn_reuses_all_but_this_turn_s_answer(thinker):
    """The template drops earlier turns' reasoning, so a next prompt parts from every stored history at the `<think>`
    this turn's prompt opened. The turn keeps its state there (`next_turn_prefix`; the first turn keeps its system
    messages' end instead, as before), and the next turn reuses all of this turn's prompt but `<think>`: it had gone
    back to the branch point the turn before kept, feeding two turns again. Answers equal a server's without reuse."""
    import httpx

    config = {"model": str(thinker), "slots": 2}
    with LiveServer(**config) as reuse, LiveServer(**config, prefix_reuse=False) as fresh:
        messages, reused, prompts = [{"role": "system", "content": "Be brief."}], [], []
        for turn in range(4):
            messages.append({"role": "user", "content": f"Question {turn}?"})
            req = {"model": "thinker", "messages": messages, "max_tokens": 16, "temperature": 0,
                   "thinking_token_budget": 3}  # fmt: skip
            a = httpx.post(f"{reuse.url}/v1/chat/completions", json=req, timeout=60).json()
            b = httpx.post(f"{fresh.url}/v1/chat/completions", json=req, timeout=60).json()
            assert a["choices"][0]["message"] == b["choices"][0]["message"], turn
            reused.append(a["wkvm"]["reused_tokens"])
            prompts.append(a["usage"]["prompt_tokens"])
            messages.append({"role": "assistant", "content": a["choices"][0]["message"]["content"]})
    assert 0 < reused[1] < prompts[0] - len("<think>")  # the system messages' end, kept by the first turn
    assert reused[2:] == [p - len("<think>") for p in prompts[1:3]], (reused, prompts)  # a token a character


def test_default_chat_template_kwargs_switch_thinking_off_unless_a_request_asks(thinker):
    """`--default-chat-template-kwargs` (vLLM's): every chat request's template variables unless it sets them itself;
    /tokenize renders with them too. Anything but a JSON object is refused at start."""
    import httpx

    from wkvm.config import ServerConfig

    off = '{"enable_thinking": false}'
    with LiveServer(model=str(thinker), slots=2, default_chat_template_kwargs=off) as server:
        c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        kw = dict(model="thinker", messages=[{"role": "user", "content": "Why?"}], max_tokens=10, temperature=0)
        plain = c.chat.completions.create(**kw).choices[0].message
        assert plain.content and plain.model_extra["reasoning_content"] is None
        asked = c.chat.completions.create(**kw, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
        assert asked.choices[0].message.model_extra["reasoning_content"] and asked.choices[0].message.content is None
        ids = httpx.post(f"{server.url}/tokenize", json={"messages": kw["messages"]}).json()["tokens"]
        text = httpx.post(f"{server.url}/detokenize", json={"tokens": ids}).json()["prompt"]
        assert text.endswith("<think></think>")
    for bad in ("[1]", "{nope", '"x"'):
        with pytest.raises(ValueError, match="default_chat_template_kwargs must be a JSON object"):
            ServerConfig(default_chat_template_kwargs=bad)


def test_the_common_prefix_of_two_renderings():
    import os

    from wkvm.server.openai_routes import common_prefix

    rng = random.Random(2)
    for _ in range(500):
        a, b = ("".join(rng.choice("ab") for _ in range(rng.randint(0, 40))) for _ in range(2))
        assert common_prefix(a, b) == len(os.path.commonprefix([a, b])), (a, b)
