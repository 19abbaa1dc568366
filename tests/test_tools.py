"""Tool calling through the `openai` SDK on a random tiny model: `tool_choice` required and named are enforced by
the grammar (every reply a call to an offered tool with schema-valid arguments), streaming carries the same calls
as `delta.tool_calls`, `auto` recognises Hermes, Qwen3-Coder's XML, Mistral and plain-JSON calls (parser unit tests;
a random model never calls on its own), a tool result goes back through the template, and bad tool requests are
clear 400s."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from live_server import LiveServer

from wkvm.server.errors import APIError
from wkvm.server.tools import call_deltas, calls_ready, content_ready, final_delta, parse_reply, split_reply, tool_mode

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}  # fmt: skip
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                                  "required": ["a", "b"], "additionalProperties": False}}}  # fmt: skip
TOOLS = [WEATHER, ADD]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "Weather?"}]


@pytest.fixture(scope="module")
def server(char_model):
    with LiveServer(model=str(char_model), slots=4) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def check_calls(choice, names: set[str], most: int | None = None, finish: str = "tool_calls") -> list[tuple[str, dict]]:
    """A reply that is calls; `finish`: "stop" under a named tool_choice (OpenAI's and vLLM's answer)."""
    assert choice.finish_reason == finish and choice.message.content is None, choice
    calls = choice.message.tool_calls
    assert calls and (most is None or len(calls) <= most)
    out = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, PARAMS[call.function.name])
        out.append((call.function.name, args))
    return out


def test_a_tool_without_parameters_is_called_with_none(client):
    """OpenAI: omitting `parameters` defines a function with an empty parameter list (forced calls had invented
    arguments, or run to max_tokens without closing the call)."""
    tools = [{"type": "function", "function": {"name": "get_time"}},
             {"type": "function", "function": {"name": "now", "parameters": None}}]  # fmt: skip
    for seed in range(4):
        r = client.chat.completions.create(model="char-model", messages=ASK, tools=tools, tool_choice="required",
                                           temperature=1.0, seed=seed, max_tokens=200)  # fmt: skip
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and calls, r.choices[0]
        assert all(json.loads(c.function.arguments) == {} for c in calls), calls


def test_required_and_named_replies_are_always_valid_calls(client):
    for seed in range(12):
        r = client.chat.completions.create(model="char-model", messages=ASK, tools=TOOLS, tool_choice="required",
                                           temperature=1.0, seed=seed, max_tokens=400)  # fmt: skip
        check_calls(r.choices[0], {"get_weather", "add"})
    for seed in range(6):
        r = client.chat.completions.create(model="char-model", messages=ASK, tools=TOOLS, seed=seed, temperature=1.0,
                                           tool_choice={"type": "function", "function": {"name": "add"}},
                                           parallel_tool_calls=False, max_tokens=400)  # fmt: skip
        assert [name for name, _ in check_calls(r.choices[0], {"add"}, most=1, finish="stop")] == ["add"]


def streamed_calls(deltas) -> list[tuple[str, str]]:
    """(name, arguments) per call index from a stream's `delta.tool_calls`, as the openai SDK's accumulator joins
    them: a call's first entry has its id, type and name, later ones only more arguments."""
    calls: dict[int, list[str]] = {}
    for tc in (tc for d in deltas for tc in d.tool_calls or []):
        if tc.index not in calls:
            assert tc.id.startswith("call_") and tc.type == "function" and tc.function.name, tc
            assert tc.index == len(calls)  # indexes in order
            calls[tc.index] = [tc.function.name, tc.function.arguments or ""]
        else:
            assert tc.id is None and tc.function.name is None and tc.function.arguments, tc
            calls[tc.index][1] += tc.function.arguments
    return [(name, args) for name, args in calls.values()]


def test_streamed_calls_equal_the_blocking_ones(client):
    """The calls stream as OpenAI's do: each call's id and name as soon as its name is complete, then its arguments
    piece by piece (they had come whole in the last chunk); joined, the blocking reply's calls, to the character."""
    for seed in (3, 7):
        kw = dict(model="char-model", messages=ASK, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed,
                  max_tokens=400)  # fmt: skip
        want = client.chat.completions.create(**kw).choices[0].message.tool_calls
        chunks = list(client.chat.completions.create(stream=True, **kw))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert streamed_calls(deltas) == [(c.function.name, c.function.arguments) for c in want]
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
        assert [c.choices[0].finish_reason for c in chunks if c.choices][:-1] == [None] * (len(deltas) - 1)
        pieces = [tc for d in deltas for tc in d.tool_calls or []]
        assert len(pieces) > 2 * len(want)  # the arguments came in pieces, not whole in the last chunk
        assert not any(d.content for d in deltas)  # a forced reply is calls only
        assert deltas[0].role == "assistant" and deltas[0].content is None  # OpenAI's role chunk of a reply that is
        # calls (hunt 10: it said ""); the held tokens send no empty chunks (OpenAI sends none mid-stream), only
        # OpenAI's end: an empty delta with the finish reason (sent after the turn's saves)
        assert all(d.tool_calls for d in deltas[1:-1]) and deltas[-1].model_dump(exclude_none=True) == {}


def test_a_tool_result_goes_back_through_the_template(client):
    r = client.chat.completions.create(model="char-model", messages=ASK, tools=TOOLS, tool_choice="required", seed=1,
                                       temperature=1.0, max_tokens=400)  # fmt: skip
    call = r.choices[0].message.tool_calls[0]
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "Sunny,21"}]  # fmt: skip
    again = client.chat.completions.create(model="char-model", messages=history, tools=TOOLS, tool_choice="none",
                                           max_tokens=5, temperature=0)  # fmt: skip
    assert again.choices[0].finish_reason in ("stop", "length") and not again.choices[0].message.tool_calls


DEEP: dict = {}
for _ in range(100):  # a schema ~100 levels deep (the body parser takes it; the meta-schema check recursed out)
    DEEP = {"a": {"type": "object", "properties": DEEP}}
TYPO_TOOL = {"type": "function", "function": {"name": "typo", "parameters": {
    "type": "object", "properties": {"a": {"type": "strin"}}}}}  # fmt: skip
NOT_TOOL = {"type": "function", "function": {"name": "odd", "parameters": {
    "type": "object", "properties": {"a": {"not": {"type": "string"}}}}}}  # fmt: skip


def test_bad_tool_requests_are_clear(client):
    cases = [
        (dict(tools=[{"type": "function", "function": {"name": "x y"}}]), "tools[0].function.name"),
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": "add"}), "tool_choice"),  # had been 500s
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": None}), "tool_choice"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=[WEATHER, WEATHER]), "tools[1].function.name"),  # which one (session 47)
        (dict(tools=[{"type": "function", "function": {"name": "f", "description": 5}}]),
         "tools[0].function.description"),
        (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "response_format"),
        # a schema the grammar cannot enforce, in a forced call: which tool's (it had said `tools`)
        (dict(tools=[WEATHER, NOT_TOOL], tool_choice="required"), "tools[1].function.parameters"),
        (dict(tools=[WEATHER, NOT_TOOL], tool_choice={"type": "function", "function": {"name": "odd"}}),
         "tools[1].function.parameters"),
        # these had been 500s (review, session 47): an unhashable $schema, a schema nested too deep to check
        (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "$schema": {}}}}]),
         "tools[0].function.parameters"),
        (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                                "properties": DEEP}}}]),
         "tools[0].function.parameters"),
        # no valid JSON Schema, whatever the tool_choice: under auto (not compiled) these had been taken (hunt,
        # session 47; OpenAI refuses them)
        (dict(tools=[WEATHER, TYPO_TOOL]), "tools[1].function.parameters"),
        (dict(tools=[TYPO_TOOL], tool_choice="none"), "tools[0].function.parameters"),
    ]
    for kw, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="char-model", messages=ASK, max_tokens=4, **kw)
        assert e.value.body["param"] == param, (kw, e.value.body)
    assert "properties.a.type: not a valid JSON schema" in e.value.body["message"]
    # valid, only not enforceable by the grammar engine: fine where nothing forces a call
    assert client.chat.completions.create(model="char-model", messages=ASK, max_tokens=2, tools=[NOT_TOOL]).choices
    # an earlier call in the history without a usable function (hunt 8: a 500, the template read call["function"])
    where = "messages[1].tool_calls[0]"
    for call, param in (({"id": "c1", "type": "function"}, ".function"), ({"id": "c1", "function": "f"}, ".function"),
                        ({"id": "c1", "function": {"arguments": "{}"}}, ".function.name"),
                        ({"id": "c1", "function": {"name": "f", "arguments": 5}}, ".function.arguments"),
                        ({"id": "c1", "type": "custom", "function": {"name": "f"}}, ".type"), ({"id": 7}, ".id"),
                        ({"id": "c1", "function": {"name": "f", "arguments": "[" * 100_000}}, ".function.arguments")):
        history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]  # fmt: skip
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="char-model", messages=history, max_tokens=2)
        assert e.value.body["param"] == where + param, (call, e.value.body)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="char-model", messages=[{"role": "user", "content": []}], max_tokens=2)
    assert e.value.body["param"] == "messages[0].content"
    # calls no tool message answers, before the next message or at the end: OpenAI's 400 (tools hunt, session 47;
    # the Responses API refused the same conversation, chat had taken it)
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    two = [call, {**call, "id": "c2"}]
    for history in (ASK + [{"role": "assistant", "content": None, "tool_calls": [call]}],
                     ASK + [{"role": "assistant", "content": None, "tool_calls": two},
                            {"role": "tool", "tool_call_id": "c1", "content": "3"}, *ASK]):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="char-model", messages=history, max_tokens=2)
        assert e.value.body["param"] == "messages[1].tool_calls", e.value.body
    answered = ASK + [{"role": "assistant", "content": None, "tool_calls": two},
                      *({"role": "tool", "tool_call_id": c, "content": "3"} for c in ("c2", "c1")), *ASK]  # fmt: skip
    assert client.chat.completions.create(model="char-model", messages=answered, max_tokens=2).choices


def test_a_forced_reply_cut_off_keeps_the_calls_it_completed():
    """Tools hunt (session 47): under "required" with parallel calls a small model repeated a call until max_tokens
    ran out, and the reply had no call at all (finish "length", content and tool_calls empty, blocking and streamed);
    now the complete calls come back, finish_reason still "length" (as OpenAI returns what it has)."""
    from wkvm.server.openai_routes import reply

    one = '{"name": "add", "arguments": {"a": 1, "b": 2}}'
    text = f'[{one}, {one}, {{"name": "get_we'
    for parallel, n in ((True, 2), (False, 1)):
        mode = tool_mode(TOOLS, "required", parallel)
        message, finish = reply(text, "length", mode)
        assert finish == "length" and message["content"] is None and len(message["tool_calls"]) == n
        assert all(json.loads(c["function"]["arguments"]) == {"a": 1, "b": 2} for c in message["tool_calls"])
        content, calls, finish = final_delta(text, 0, "length", mode)  # the stream's last delta: the same
        assert content is None and len(calls) == n and finish == "length"
    mode = tool_mode(TOOLS, "required", None)
    for cut in ('[{"name": "add", "argum', "[", ""):  # nothing complete: no call, as before
        assert "tool_calls" not in reply(cut, "length", mode)[0] and final_delta(cut, 0, "length", mode)[1] == []
    assert reply(text, "abort", mode)[0].get("tool_calls") is None  # only max_tokens' cut keeps them
    auto = tool_mode(TOOLS, None, None)
    assert reply(one, "length", auto)[0] == {"role": "assistant", "content": one}  # words under auto, as before


def test_auto_recognises_hermes_mistral_and_plain_json_calls():
    mode = tool_mode(TOOLS, None, None)
    assert mode is not None and mode.choice == "auto"
    call = '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}'
    hermes = f"Let me check.<tool_call>\n{call}\n</tool_call>"
    content, calls = parse_reply(hermes, mode)
    assert content == "Let me check." and [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo", "unit": "celsius"}
    content, calls = parse_reply(f"Let me check.<tool_call>\n{call}\n", mode)  # no closing tag: a call, as vLLM's
    assert content == "Let me check." and len(calls) == 1  # Hermes parser reads it (it had stayed words; session 47)
    assert parse_reply(f"<tool_call>{call[:-4]}", mode) == (f"<tool_call>{call[:-4]}", [])  # cut inside: words
    _, calls = parse_reply('{"name": "get_weather", "arguments": {"city": "Zürich 東京", "unit": "celsius"}}', mode)
    assert calls[0]["function"]["arguments"] == '{"city": "Zürich 東京", "unit": "celsius"}'  # OpenAI: no \\u escapes
    content, calls = parse_reply('[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}}, '
                                 '{"name": "add", "arguments": {"a": 3, "b": 4}}]', mode)  # fmt: skip
    assert content is None and len(calls) == 2 and calls[0]["id"] != calls[1]["id"]
    # SmolLM2-Instruct's trained form, a list inside the Hermes tags (review, session 39: it had been content), and
    # Mistral's list with words after it (they had made the whole reply content)
    content, calls = parse_reply(f"<tool_call>[\n{call}, {call}\n]</tool_call>", mode)
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather"] * 2
    content, calls = parse_reply(f'[TOOL_CALLS] [{call}] Done.', mode)
    assert content == "Done." and len(calls) == 1
    assert parse_reply("<tool_call>[]</tool_call>", mode) == ("<tool_call>[]</tool_call>", [])
    content, calls = parse_reply(f"[TOOL_CALLS] [{call}][TOOL_CALLS] [{call}]", mode)  # two markers: both calls
    assert content is None and len(calls) == 2
    content, calls = parse_reply('{"name": "add", "parameters": {"a": 1, "b": 2}}', mode)
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"a": 1, "b": 2}
    for text in ('{"name": "delete_everything", "arguments": {}}', "Just words.", "<tool_call>{broken</tool_call>"):
        assert parse_reply(text, mode) == (text, [])  # unknown tool, no call, broken call: plain content
    none = tool_mode(TOOLS, "none", None)
    assert none is not None and parse_reply(hermes, none) == (hermes, [])
    one = tool_mode(TOOLS, None, False)  # parallel_tool_calls false: the first of several calls in the text
    two = f"<tool_call>{call}</tool_call><tool_call>{call}</tool_call>"
    assert one is not None and len(parse_reply(two, one)[1]) == 1 and len(parse_reply(two, mode)[1]) == 2
    with pytest.raises(APIError):
        tool_mode([{"type": "function"}], None, None)


def xml_call(name: str, args: dict, closed: bool = True) -> str:
    """A call as Qwen3-Coder's and Qwen3.5's templates teach it (a value as text, a newline either side)."""
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items())
    return f"<tool_call>\n<function={name}>\n{params}" + ("</function>\n</tool_call>" if closed else "")


def test_auto_recognises_qwen3_coder_xml_calls_by_their_schema_types():
    """Qwen3.5's form (vLLM's `qwen3_coder` parser): each parameter's text read as the tool's schema types it (an
    integer, a string that looks like a number kept a string, JSON for objects and arrays, "null"), several calls,
    closing tags missing at the reply's end; an unknown tool or an unfinished tag is content."""
    tools = [*TOOLS, {"type": "function", "function": {"name": "plan", "parameters": {"type": "object", "properties": {
        "steps": {"type": "array"}, "opts": {"type": "object"}, "fast": {"type": "boolean"}, "t": {"type": "number"},
        "note": {"type": ["string", "null"]}, "n": {"type": ["integer", "null"]}}}}}]  # fmt: skip
    mode = tool_mode(tools, None, None)
    assert mode is not None
    content, calls = parse_reply("Let me add.\n" + xml_call("add", {"a": 12, "b": -3}), mode)
    assert content == "Let me add." and calls[0]["function"] == {"name": "add", "arguments": '{"a": 12, "b": -3}'}
    text = xml_call("plan", {"steps": '["a", 2]', "opts": '{"x": {"y": null}}', "fast": "True", "t": "2.50",
                             "note": "null", "n": "7", "extra": "42"})  # fmt: skip
    (call,) = parse_reply(text, mode)[1]
    assert json.loads(call["function"]["arguments"]) == {"steps": ["a", 2], "opts": {"x": {"y": None}}, "fast": True,
                                                         "t": 2.5, "note": None, "n": 7, "extra": "42"}  # fmt: skip
    weather = xml_call("get_weather", {"city": "1984\nline two", "unit": "celsius"})
    (call,) = parse_reply(weather, mode)[1]  # a string stays a string, its inner newline kept
    assert json.loads(call["function"]["arguments"]) == {"city": "1984\nline two", "unit": "celsius"}
    content, calls = parse_reply(xml_call("add", {"a": 1, "b": 2}) + "\n" + xml_call("add", {"a": 3}, closed=False),
                                 mode)  # fmt: skip
    assert content is None and [json.loads(c["function"]["arguments"]) for c in calls] == [{"a": 1, "b": 2}, {"a": 3}]
    bad = {"t": "Infinity", "opts": "{NaN: 1}", "n": "seven", "steps": "NaN"}  # not JSON numbers: the text as written
    (call,) = parse_reply(xml_call("plan", bad), mode)[1]
    assert json.loads(call["function"]["arguments"]) == bad
    for text in (xml_call("delete_everything", {}), "<tool_call>\n<function=add\n<parameter=a>\n1"):
        assert parse_reply(text, mode) == (text, [])
    one = tool_mode(tools, None, False)
    assert one is not None and len(parse_reply(xml_call("add", {}) * 2, one)[1]) == 1


def test_auto_streams_the_words_before_a_call_and_holds_the_call():
    """With `auto`, a reply streamed in pieces of any size sends as content what can no longer be a call's start,
    never a marker's first characters, a call after a marker as it comes (its name, then its arguments piece by
    piece), and its last delta the rest: the same calls as the blocking reply, the same content (whole, when there
    is no call; to its stripped ends, when there is). A bare JSON reply's call comes whole at the end."""
    import random

    mode = tool_mode(TOOLS, None, None)
    assert mode is not None
    call = '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}'
    replies = [f"Let me check <the> weather.\n<tool_call>\n{call}\n</tool_call>", f"\n<tool_call>{call}</tool_call>",
               f"One.<tool_call>{call}</tool_call> Two.<tool_call>{call}</tool_call>", f"Sure: [TOOL_CALLS] [{call}]",
               f"[TOOL_CALLS] [{call}]", call, "Just words, a < b and [x] {y}.", "Ends in a half marker <tool_c",
               "<tool_call>{broken</tool_call> and after", "  [1, 2] is a list", "<b>bold</b> text",
               f"<tool_call>[{call}]</tool_call>", f"[TOOL_CALLS] [{call}] Done.",
               f"[TOOL_CALLS] [{call}][TOOL_CALLS] [{call}]"]  # fmt: skip
    rng = random.Random(0)
    for text in replies:
        want_content, want_calls = parse_reply(text, mode)
        for _ in range(5):
            sent, released, at, opened, pieces = "", 0, 0, list[tuple[str, str]](), []
            while at < len(text):
                at = min(len(text), at + rng.randint(1, 6))
                ready = content_ready(text[:at], mode)
                assert ready >= released and not any(m in text[:ready] for m in ("<tool_call>", "[TOOL_CALLS]"))
                sent, released = sent + text[released:ready], max(ready, released)
                pieces += call_deltas(calls_ready(text[:at], mode), opened)
            tail, calls, finish = final_delta(text, released, "stop", mode)
            sent += tail or ""
            pieces += call_deltas([(c["function"]["name"], c["function"]["arguments"]) for c in calls], opened,
                                  [c["id"] for c in calls])  # fmt: skip
            joined: dict[int, list[str]] = {}  # what a client joins from the pieces: the blocking reply's calls
            for p in pieces:
                name, args = joined.setdefault(p["index"], [p["function"].get("name"), ""])
                joined[p["index"]] = [name, args + p["function"]["arguments"]]
            assert [tuple(v) for v in joined.values()] == [
                (c["function"]["name"], c["function"]["arguments"]) for c in want_calls], text
            # a call in tags or after [TOOL_CALLS] streams as it comes; a bare JSON reply comes whole at the end
            assert len(pieces) > len(want_calls) or text == call or not want_calls
            if calls:  # the blocking reply's content; only a leading space it strips may have gone out already
                assert finish == "tool_calls" and sent.lstrip() == (want_content or ""), (text, sent)
            else:
                assert finish == "stop" and sent == text, text
    assert content_ready("Hi there", tool_mode(TOOLS, "required", None)) == 0  # a forced reply is the call
    assert content_ready("<tool_call>", tool_mode(TOOLS, "none", None)) == 11  # "none": all of it


def test_auto_streams_a_plain_answer_as_it_comes(client):
    """Offered tools it does not call, a model's answer streams chunk by chunk (before, it all came in the last
    chunk), and the streamed content equals the blocking reply's."""
    kw = dict(model="char-model", messages=ASK, tools=TOOLS, temperature=0, max_tokens=40)
    want = client.chat.completions.create(**kw).choices[0].message
    assert not want.tool_calls and want.content and want.content.lstrip()[0] not in "{["
    deltas = [c.choices[0].delta for c in client.chat.completions.create(stream=True, **kw) if c.choices]
    parts = [d.content for d in deltas if d.content]
    assert len(parts) > 5 and "".join(parts) == want.content


def test_a_tool_round_trip_keeps_reuse_exact(client, server):
    """After a forced call, the next turn (call + result in the history) resumes from a stored checkpoint that its
    prompt really starts with, and answers exactly as a fresh run (another reuse scope)."""
    import httpx

    user = "tools-roundtrip"
    first = client.chat.completions.create(model="char-model", messages=ASK, tools=TOOLS, tool_choice="required",
                                           seed=2, temperature=1.0, max_tokens=400, user=user,
                                           parallel_tool_calls=False)  # fmt: skip
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "Sunny"}]  # fmt: skip
    body = {"model": "char-model", "messages": history, "tools": TOOLS, "max_tokens": 6, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    again = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "user": user}, timeout=60).json()
    fresh = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "user": "tools-fresh"}, timeout=60).json()
    assert again["wkvm"]["reused_tokens"] >= first.usage.prompt_tokens - 1, again["wkvm"]
    assert fresh["wkvm"]["reused_tokens"] == 0
    assert again["choices"][0]["message"] == fresh["choices"][0]["message"]


def test_tool_parameters_with_their_own_refs_are_enforced_where_they_point():
    """pydantic's and the openai SDK's tools refer to their own `$defs` ("#/$defs/Unit"), or to themselves ("#"):
    inside the calls' schema those pointers are moved along (hunt 10: a 400 "Pointer '/$defs/Unit' does not exist",
    and a recursive tool whose "#" meant the list of calls)."""
    import llguidance

    unit = {"type": "function", "function": {"name": "temp", "parameters": {
        "type": "object", "$defs": {"Unit": {"enum": ["c", "f"], "type": "string"}},
        "properties": {"city": {"type": "string"}, "unit": {"$ref": "#/$defs/Unit"}},
        "required": ["city", "unit"], "additionalProperties": False}}}  # fmt: skip
    tree = {"type": "function", "function": {"name": "tree", "parameters": {
        "type": "object", "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9},
                                         "kid": {"anyOf": [{"type": "null"}, {"$ref": "#"}]},
                                         "same": {"$ref": "#/properties/v"}, "data": {"const": {"$ref": "#"}}},
        "required": ["v", "kid"], "additionalProperties": False}}}  # fmt: skip
    for tools in ([unit], [unit, tree], [tree, ADD]):
        mode = tool_mode(tools, "required", None)
        assert mode is not None
        schema = mode.response_format()["json_schema"]["schema"]
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        assert not llguidance.LLMatcher.validate_grammar_with_warnings(grammar)[0], tools
        for t in tools:  # a call with valid arguments is in the calls' schema; one the tool's schema refuses is not
            name, params = t["function"]["name"], t["function"]["parameters"]
            good = {"temp": {"city": "Oslo", "unit": "c"}, "tree": {"v": 1, "kid": {"v": 2, "kid": None}},
                    "add": {"a": 1, "b": 2}}[name]  # fmt: skip
            bad = {"temp": {"city": "Oslo", "unit": "kelvin"}, "tree": {"v": 1, "kid": [{"name": "tree"}]},
                   "add": {"a": "x", "b": 2}}[name]  # fmt: skip
            jsonschema.validate(good, params)
            jsonschema.validate([{"name": name, "arguments": good}], schema)
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate([{"name": name, "arguments": bad}], schema)
    data = tool_mode([tree], "required", None).response_format()["json_schema"]["schema"]["$defs"]
    assert data["wkvm_tool_0"]["properties"]["data"] == {"const": {"$ref": "#"}}  # a value, not a pointer


def test_a_forced_call_with_refs_comes_back_valid(client):
    unit = {"type": "function", "function": {"name": "temp", "parameters": {
        "type": "object", "$defs": {"Unit": {"enum": ["c", "f"], "type": "string"}},
        "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"$ref": "#/$defs/Unit"}},
        "required": ["city", "unit"], "additionalProperties": False}}}  # fmt: skip
    for seed in range(3):
        r = client.chat.completions.create(model="char-model", messages=ASK, tools=[unit], tool_choice="required",
                                           temperature=1.0, seed=seed, max_tokens=300)  # fmt: skip
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), unit["function"]["parameters"])


def test_tool_fixes_from_hunt_10(client):
    """Parameters that are not an object schema are a 400 (as OpenAI's); a named tool_choice gives one call; a
    forced call cut off by max_tokens is no content in words; a tool message must answer an earlier call; with
    response_format under `auto`, a reply that reads as a call stays the content asked for."""
    for params in ({"type": "string"}, {"type": "array", "items": {"type": "integer"}}, {"properties": {}}):
        tool = {"type": "function", "function": {"name": "f", "parameters": params}}
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="char-model", messages=ASK, max_tokens=2, tool_choice="required",
                                           tools=[tool])  # fmt: skip
        assert e.value.body["param"] == "tools[0].function.parameters", e.value.body
    for seed in range(4):
        r = client.chat.completions.create(model="char-model", messages=ASK, tools=TOOLS, seed=seed, temperature=1.0,
                                           tool_choice={"type": "function", "function": {"name": "add"}},
                                           max_tokens=400)  # fmt: skip
        check_calls(r.choices[0], {"add"}, most=1, finish="stop")
    kw = dict(model="char-model", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=5, temperature=0)
    cut = client.chat.completions.create(**kw).choices[0]
    assert cut.finish_reason == "length" and cut.message.content is None and not cut.message.tool_calls
    chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **kw) if c.choices]
    assert chunks[-1].finish_reason == "length" and not any(c.delta.content for c in chunks)
    stopped = {**kw, "max_tokens": 60, "stop": ["city"], "tool_choice": {"type": "function",
               "function": {"name": "get_weather"}}}  # fmt: skip
    cut = client.chat.completions.create(**stopped).choices[0]  # a stop string inside the call: no words (as streamed)
    assert cut.finish_reason == "stop" and cut.message.content is None and not cut.message.tool_calls, cut
    chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **stopped) if c.choices]
    assert chunks[-1].finish_reason == "stop" and not any(c.delta.content for c in chunks)
    history = ASK + [{"role": "tool", "tool_call_id": "call_nowhere", "content": "Sunny"}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="char-model", messages=history, max_tokens=2)
    assert e.value.body["param"] == "messages[1].tool_call_id"
    mode = tool_mode(TOOLS, "auto", None, shaped=True)
    call = '{"name": "add", "arguments": {"zzz": 1}}'
    assert mode is not None and parse_reply(call, mode) == (call, []) and content_ready(call, mode) == len(call)
    assert final_delta(call, len(call), "stop", mode) == (None, [], "stop")
    const = {"type": "json_schema", "json_schema": {"name": "c", "schema": {"const": {"name": "add",
                                                                                  "arguments": {"a": 1, "b": 2}}}}}
    r = client.chat.completions.create(model="char-model", messages=ASK, tools=TOOLS, response_format=const,
                                       max_tokens=40, temperature=0)  # fmt: skip
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
    assert json.loads(r.choices[0].message.content) == {"name": "add", "arguments": {"a": 1, "b": 2}}


def test_a_reply_with_one_good_and_one_broken_call_is_all_content():
    """`auto`: when any call in a reply fails to parse (broken JSON, a tool not offered, arguments not an object),
    none of them is returned: the whole reply is the content (split_reply's rule), blocking and streamed alike; the
    good call alone is no answer to what the model wrote."""
    mode = tool_mode(TOOLS, None, None)
    assert mode is not None
    good = '{"name": "add", "arguments": {"a": 1, "b": 2}}'
    replies = [f"Sure.<tool_call>{good}</tool_call><tool_call>{{broken</tool_call>",
               f"<tool_call>{{broken</tool_call>\n<tool_call>{good}</tool_call>",
               f'<tool_call>{good}</tool_call><tool_call>{{"name": "nope", "arguments": {{}}}}</tool_call>',
               f'[TOOL_CALLS] [{good}, {{"name": "add", "arguments": 5}}]',
               f'[{good}, {{"name": "delete_everything", "arguments": {{}}}}]']  # fmt: skip
    for text in replies:
        assert parse_reply(text, mode) == (text, []), text
        assert final_delta(text, 0, "stop", mode) == (text, [], "stop"), text
    assert parse_reply(f"<tool_call>{good}</tool_call>", mode)[1]  # the good call alone is a call


def test_a_named_tool_choice_constrains_the_calls_to_that_tool():
    """tool_choice {"type": "function", "function": {"name": X}} with two tools offered: the grammar's schema
    allows one call, of X only (the schema had been built over every offered tool: a forced call could name any)."""
    for name, other in (("add", "get_weather"), ("get_weather", "add")):
        mode = tool_mode(TOOLS, {"type": "function", "function": {"name": name}}, None)
        assert mode is not None and mode.choice == "named" and mode.name == name
        schema = mode.response_format()["json_schema"]["schema"]
        assert schema["maxItems"] == 1 and schema["items"]["properties"]["name"] == {"const": name}, schema
        assert f'"{other}"' not in json.dumps(schema)
        args = {"add": {"a": 1, "b": 2}, "get_weather": {"city": "Oslo", "unit": "celsius"}}
        jsonschema.validate([{"name": name, "arguments": args[name]}], schema)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate([{"name": other, "arguments": args[other]}], schema)


def test_streamed_arguments_are_always_a_start_of_the_finished_ones():
    """`calls_ready` on every prefix of a reply (random arguments: escapes, surrogate pairs written as \\u escapes,
    numbers json.dumps rewrites, nesting, any spacing; forced lists, Hermes tags, SmolLM2's list in tags,
    [TOOL_CALLS], Qwen3-Coder's XML): what it gives only grows, is always the start of the finished reply's calls
    (names equal, arguments as the blocking reply spells them), and is those calls at the end. A stream of pieces can
    therefore never send what the finished call contradicts."""
    import random

    rng = random.Random(5)
    atoms = [0, -7, 3.25, 1e21, 2.5e-8, -0.0, True, False, None, "", "plain", 'q"b\\s/n\nt\t\x01', "é\u2028😀",
             12345678901234567890]  # fmt: skip

    def value(depth: int = 0):
        r = rng.random()
        if depth > 2 or r < 0.4:
            return rng.choice(atoms)
        if r < 0.7:
            return {rng.choice(["k", "a b", 'ü"', "😀"]) + str(i): value(depth + 1) for i in range(rng.randint(0, 3))}
        return [value(depth + 1) for _ in range(rng.randint(0, 3))]

    def dumps(x) -> str:
        return json.dumps(x, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 1]),
                          separators=rng.choice([None, (",", ":")]))  # fmt: skip

    forced, auto = tool_mode(TOOLS, "required", None), tool_mode(TOOLS, None, None)
    # XML text values the stream must hold back: null (not a string), newlines the final value drops, tag starts
    TRICKY = ["null", " Null ", "nu", "a\n", "\n\nb\n\n", "x</par", "<", "a <b> c", "é\n<parameter", "</function", ""]
    for _ in range(80):
        calls = [{"name": rng.choice(["get_weather", "add"]), "arguments": {"k": value(), "z": value()}}
                 for _ in range(rng.randint(1, 2))]  # fmt: skip
        mode, text = rng.choice([(forced, dumps(calls)),
                                 (auto, "Sure. " + "".join(f"<tool_call>\n{dumps(c)}\n</tool_call>" for c in calls)),
                                 (auto, f"<tool_call>{dumps(calls)}</tool_call>"),
                                 (auto, f"[TOOL_CALLS] {dumps(calls)}"),
                                 (auto, "Sure. " + "".join(xml_call(c["name"], {
                                     k: dumps(v) if rng.random() < 0.6 else rng.choice(TRICKY)
                                     for k, v in c["arguments"].items()}) for c in calls))])  # fmt: skip
        want = [(c["function"]["name"], c["function"]["arguments"]) for c in split_reply(text, mode)[1]]
        assert len(want) == len(calls)
        before: list[tuple[str, str]] = []
        memo: dict = {}  # a stream's reading of its growing text: the same as reading each prefix afresh
        for at in range(len(text) + 1):
            got = calls_ready(text[:at], mode)
            assert calls_ready(text[:at], mode, memo) == got, text[:at]
            assert len(before) <= len(got) <= len(want), text[:at]
            for (name, args), (was_name, was_args) in zip(got, before, strict=False):
                assert name == was_name and args.startswith(was_args), text[:at]
            for (name, args), (want_name, want_args) in zip(got, want, strict=False):
                assert name == want_name and want_args.startswith(args), (text[:at], args, want_args)
            before = got
        assert before == want
    cut = '[{"name": "add", "arguments": {"a": 12, "b": 3'
    assert calls_ready(cut, forced) == [("add", '{"a": 12, "b": ')]  # 3 may go on: not sent yet
    opened: list[tuple[str, str]] = []
    (first,) = call_deltas(calls_ready(cut, forced), opened)
    assert first["function"] == {"name": "add", "arguments": '{"a": 12, "b": '} and first["id"].startswith("call_")
    # cut off there, the blocking reply has no call, and the stream's last delta adds nothing to the one it began
    assert final_delta(cut, 0, "length", forced)[1] == [] and call_deltas([], opened) == []
    assert calls_ready('<tool_call>{"name": "nope", "arguments": {', auto) == []  # a tool not offered: no call
    assert calls_ready('{"name": "add", "arguments": {"a": 1', auto) == []  # a bare JSON reply waits for its end
    # a text parameter streams as it is written (a file's content), holding back what may be its end
    assert calls_ready("<tool_call>\n<function=get_weather>\n<parameter=city>\nOs", auto) == [
        ("get_weather", '{"city": "Os')]
    assert calls_ready("<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</para", auto) == [
        ("get_weather", '{"city": "Oslo')]
    assert calls_ready("<tool_call>\n<function=add>\n<parameter=a>\n12", auto) == [("add", "{")]  # an integer waits
    deep = "[" * 5000  # nested past the parser's recursion: no call, no 500 (parse_reply's had been a RecursionError)
    for text in (f"<tool_call>{deep}", f"[TOOL_CALLS] {deep}", f'<tool_call>{{"name": "add", "arguments": {deep}'):
        assert parse_reply(text, auto) == (text, []) and len(calls_ready(text, auto)) <= 1
    assert calls_ready(deep, forced) == [] and final_delta(deep, 0, "length", forced)[1] == []
