"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) through the `anthropic` SDK on a random
tiny model: each answer equals the chat completion of the same conversation; the stream's events build the same
message; tool_use / tool_result round trips; a conversation's next turn reuses its parked state (per API key)
without changing the answer; a prefill, stop sequences, a JSON schema; bad requests are 400s in Anthropic's error
shape naming the field."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest
from live_server import LiveServer

KEYS = ["key-a", "key-b"]
MODEL = "char-model"
GREEDY = {"max_tokens": 12, "extra_body": {"temperature": 0}}  # the SDK no longer offers temperature: sent as extra
WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                            "required": ["city"], "additionalProperties": False}}  # fmt: skip


@pytest.fixture(scope="module")
def server(char_model):
    with LiveServer(model=str(char_model), api_keys=KEYS, slots=4) as s:
        yield s


def client(server, key="key-a") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0)


def chat(server, messages: list[dict], user: str, **kw) -> openai.types.chat.ChatCompletion:
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="key-a", max_retries=0)
    return c.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=12, user=user, **kw)


def text_of(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_a_message_equals_the_chat_completion_of_the_same_conversation(server):
    m = client(server).messages.create(model=MODEL, system="Be brief.", metadata={"user_id": "u1"},
                                       messages=[{"role": "user", "content": "Hello there"}], **GREEDY)  # fmt: skip
    c = chat(server, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}], "o1")
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_") and m.model == MODEL
    assert text_of(m) == c.choices[0].message.content and [b.type for b in m.content] == ["text"]
    assert m.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[c.choices[0].finish_reason]
    assert m.stop_sequence is None
    # Anthropic counts the tokens read from a cache apart: together they are the prompt
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == c.usage.prompt_tokens
    assert m.usage.output_tokens == c.usage.completion_tokens and m.usage.cache_creation_input_tokens == 0
    counted = client(server).messages.count_tokens(model=MODEL, system="Be brief.",
                                                   messages=[{"role": "user", "content": "Hello there"}])
    assert counted.input_tokens == c.usage.prompt_tokens


def test_stream_events_build_the_same_message(server):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Stream it"}], metadata={"user_id": "u2"}, **GREEDY)
    with client(server).messages.stream(**kw) as s:
        events = list(s)
        final = s.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    assert sum(k == "text" for k in kinds) > 3  # as it comes, not in one piece
    blocking = client(server).messages.create(**{**kw, "metadata": {"user_id": "u2b"}})
    assert text_of(final) == text_of(blocking) and final.stop_reason == blocking.stop_reason
    start = events[0].message.usage
    assert start.input_tokens + start.cache_read_input_tokens == (
        final.usage.input_tokens + final.usage.cache_read_input_tokens)
    assert final.usage.output_tokens == blocking.usage.output_tokens


def test_tool_use_and_tool_result_round_trip(server):
    c = client(server)
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    kw = dict(model=MODEL, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"}, max_tokens=200,
              extra_body={"temperature": 1.0, "seed": 3})  # fmt: skip
    m = c.messages.create(messages=ask, metadata={"user_id": "u3"}, **kw)
    (call,) = m.content
    assert call.type == "tool_use" and call.name == "get_weather" and m.stop_reason == "tool_use"
    jsonschema.validate(call.input, WEATHER["input_schema"])  # the grammar holds the call to the tool's schema
    with c.messages.stream(messages=ask, metadata={"user_id": "u3s"}, **kw) as s:
        kinds = [e.type for e in s]
        streamed = s.get_final_message()
    assert kinds.count("input_json") >= 2 and streamed.stop_reason == "tool_use"  # arguments piece by piece
    assert [(b.name, b.input) for b in streamed.content] == [(call.name, call.input)]
    answer = c.messages.create(model=MODEL, tools=[WEATHER], messages=[
        *ask, {"role": "assistant", "content": m.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C"}]},
    ], metadata={"user_id": "u3"}, **GREEDY)  # fmt: skip
    args = json.dumps(call.input, ensure_ascii=False)
    same = chat(server, [*ask, {"role": "assistant", "content": "", "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}], "o3",
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER["input_schema"],
                                                 "description": WEATHER["description"]}}])  # fmt: skip
    assert text_of(answer) == same.choices[0].message.content


def test_a_conversation_reuses_its_parked_state_per_api_key(server):
    turn1 = [{"role": "user", "content": "Name a colour."}]
    first = client(server).messages.create(model=MODEL, messages=turn1, **GREEDY)
    turn2 = [*turn1, {"role": "assistant", "content": first.content}, {"role": "user", "content": "And another?"}]
    second = client(server).messages.create(model=MODEL, messages=turn2, **GREEDY)
    fresh = chat(server, [*turn1, {"role": "assistant", "content": text_of(first)},
                          {"role": "user", "content": "And another?"}], "fresh-u4")  # another scope: from scratch
    assert text_of(second) == fresh.choices[0].message.content
    assert second.usage.cache_read_input_tokens > first.usage.input_tokens  # the first turn was not recomputed
    other = client(server, "key-b").messages.create(model=MODEL, messages=turn2, **GREEDY)
    assert other.usage.cache_read_input_tokens == 0 and other.content == second.content  # key-b sees none of key-a's


def test_max_tokens_past_the_server_s_limit_runs_to_the_limit(char_model):
    """Clients send their model's ceiling as the required max_tokens (Claude Code 32,000): not a 400 here, as the
    chat's would be, but the server's limit."""
    with LiveServer(model=str(char_model), slots=2, max_tokens_limit=6) as s:
        # streamed: the SDK refuses to wait for a request this long whole
        kw = dict(model=MODEL, messages=[{"role": "user", "content": "Go"}], max_tokens=32000,
                  extra_body={"temperature": 0})  # fmt: skip
        with client(s).messages.stream(**kw) as stream:
            m = stream.get_final_message()
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 6


def test_the_sampling_extras_reach_the_chat():
    """temperature, top_p, top_k (older clients'), seed and ignore_eos (vLLM's and llama-server's, for fixed-length
    benchmark replies) go on to the chat completion the request runs."""
    from wkvm.server.messages_routes import chat_request
    from wkvm.server.schemas import MessagesRequest

    extras = {"temperature": 0.5, "top_p": 0.9, "top_k": 7, "seed": 3, "ignore_eos": True}
    body = MessagesRequest.model_validate({"model": MODEL, "max_tokens": 9, "messages": [{"role": "user"}], **extras})
    chat = chat_request(body, [{"role": "user", "content": "a"}], False, 100)
    assert {k: getattr(chat, k) for k in extras} == extras and chat.max_completion_tokens == 9


def test_a_system_message_among_the_turns_stays_where_it_is(server):
    """The API's system role in `messages` (Claude Code sends one after its first user message)."""
    turns = [{"role": "user", "content": "Hi"}, {"role": "system", "content": [{"type": "text", "text": "Be kind."}]},
             {"role": "user", "content": "Go"}]  # fmt: skip
    m = client(server).messages.create(model=MODEL, messages=turns, **GREEDY)
    c = chat(server, [{"role": "user", "content": "Hi"}, {"role": "system", "content": "Be kind."},
                      {"role": "user", "content": "Go"}], "o7")  # fmt: skip
    assert text_of(m) == c.choices[0].message.content


def test_a_prefill_goes_on_from_the_assistant_s_text(server):
    messages = [{"role": "user", "content": "Say more"}, {"role": "assistant", "content": "Well,"}]
    m = client(server).messages.create(model=MODEL, messages=messages, **GREEDY)
    c = chat(server, messages, "o5", extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert text_of(m) == c.choices[0].message.content  # the continuation only, as Anthropic returns it


def test_stop_sequences_end_the_reply_and_are_named(server):
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "Go on"}], max_tokens=20,
               extra_body={"temperature": 0})  # fmt: skip
    full = text_of(client(server).messages.create(**ask))
    stop = full[6:8]
    m = client(server).messages.create(stop_sequences=[stop], **ask)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop and text_of(m) == full[: full.find(stop)]


def test_a_json_schema_output_format_is_followed(server):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}  # fmt: skip
    m = client(server).messages.create(model=MODEL, messages=[{"role": "user", "content": "A number"}],
                                       output_config={"format": {"type": "json_schema", "schema": schema}},
                                       max_tokens=30, extra_body={"temperature": 0})  # fmt: skip
    jsonschema.validate(json.loads(text_of(m)), schema)


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "system", "content": [{"type": "image"}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "x"}]}]},
     "messages[0].content[0].tool_use_id"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]}, {"role": "user", "content": "b"}]},
     "messages[2].content"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": []}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "web_search_20250305", "name": "s"}]},
     "tools[0].type"),
    ({"messages": [{"role": "user", "content": "a"}], "thinking": {"type": "sometimes"}}, "thinking"),
    ({"messages": [{"role": "user", "content": "a"}], "temperature": 1.5}, "temperature"),
    ({"messages": [{"role": "user", "content": "a"}], "tool_choice": {"type": "whichever"}, "tools": [WEATHER]},
     "tool_choice"),
    ({"messages": [{"role": "user", "content": "a"}], "max_tokens": 0}, "max_tokens"),
    # the chat's own checks, named as the Messages request names the fields
    ({"messages": [{"role": "user", "content": "a"}], "tools": [{"name": "a b", "input_schema": {}}]}, "tools[0].name"),
    ({"messages": [{"role": "user", "content": "a"}], "stop_sequences": [""]}, "stop_sequences"),
    ({"messages": [{"role": "user", "content": "a"}],
      "output_config": {"format": {"type": "json_schema", "schema": {"type": "nonsense"}}}}, "output_config.format"),
])  # fmt: skip
def test_bad_requests_are_400s_in_anthropic_s_shape_naming_the_field(server, body, param):
    r = httpx.post(f"{server.url}/v1/messages", headers={"x-api-key": "key-a"},
                   json={"model": MODEL, "max_tokens": 5, **body})  # fmt: skip
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert err["error"]["param"] == param and err["error"]["message"]


def test_count_tokens_refuses_what_its_tokenizer_cannot_read(server):
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "\ud800"}]})  # a lone surrogate
    r = httpx.post(f"{server.url}/v1/messages/count_tokens", content=body,
                   headers={"x-api-key": "key-a", "content-type": "application/json"})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content", r.text


def test_the_key_is_checked_and_errors_read_as_anthropic_s(server):
    with pytest.raises(anthropic.AuthenticationError) as e:
        client(server, "wrong").messages.create(model=MODEL, messages=[{"role": "user", "content": "a"}], max_tokens=2)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError):  # another model's name: 404, as OpenAI's routes answer it
        client(server).messages.create(model="claude-x", messages=[{"role": "user", "content": "a"}], max_tokens=2)


def test_anthropic_s_sdk_lists_and_retrieves_the_model(server):
    """/v1/models carries Anthropic's fields beside OpenAI's (Claude Code lists models through it)."""
    page = client(server).models.list()
    assert [m.id for m in page.data] == [MODEL] and page.has_more is False and page.first_id == MODEL
    one = client(server).models.retrieve(MODEL)
    assert one.type == "model" and one.display_name == MODEL and one.created_at.year >= 2026
    assert openai.OpenAI(base_url=f"{server.url}/v1", api_key="key-a").models.list().data[0].owned_by == "wkvm"


def test_stream_blocks_open_and_close_in_order():
    """Text, then a call whose arguments come in pieces, then text again: three blocks, indexed in order, each
    started and stopped once; the call's input as partial JSON; stop_reason tool_use whenever a call was made."""
    import asyncio

    from wkvm.server.messages_routes import stream_events

    chunks = [{"choices": [{"delta": {"content": "Let me "}, "finish_reason": None}]},
              {"choices": [{"delta": {"content": "see."}, "finish_reason": None}]},
              {"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "c0", "type": "function",
                                                      "function": {"name": "f", "arguments": '{"a'}}]},
                            "finish_reason": None}]},
              {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": '": 1}'}}]},
                            "finish_reason": None}]},
              {"choices": [{"delta": {"content": "Done."}, "finish_reason": "stop", "stop_reason": None}]},
              {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 9,
                                        "prompt_tokens_details": {"cached_tokens": 2}}}]  # fmt: skip

    async def lines():
        for c in chunks:
            yield f"data: {json.dumps(c)}\n\n"
        yield "data: [DONE]\n\n"

    async def read() -> list[dict]:
        return [json.loads(ev.split("data: ", 1)[1]) async for ev in stream_events({"id": "m"}, (5, 2), lines(), None)]

    events = asyncio.run(read())
    kinds = [(e["type"], e.get("index")) for e in events]
    assert kinds == [("message_start", None), ("content_block_start", 0), ("content_block_delta", 0),
                     ("content_block_delta", 0), ("content_block_stop", 0), ("content_block_start", 1),
                     ("content_block_delta", 1), ("content_block_delta", 1), ("content_block_stop", 1),
                     ("content_block_start", 2), ("content_block_delta", 2), ("content_block_stop", 2),
                     ("message_delta", None), ("message_stop", None)]  # fmt: skip
    assert events[5]["content_block"] == {"type": "tool_use", "id": "c0", "name": "f", "input": {}}
    assert "".join(e["delta"]["partial_json"] for e in events[6:8]) == '{"a": 1}'
    assert events[0]["message"]["usage"]["input_tokens"] == 3 and events[0]["message"]["usage"][
        "cache_read_input_tokens"] == 2
    assert events[12]["delta"]["stop_reason"] == "tool_use" and events[12]["usage"]["output_tokens"] == 9
