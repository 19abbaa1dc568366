"""Ollama's API (/api/chat, /api/generate, /api/tags, /api/show, /api/ps, /api/version, /api/embed) through the
`ollama` client on a random tiny model: each answer equals the chat completion of the same messages, blocking and
streamed; options, format, tool calls in the history; a conversation resent whole reuses its parked state; what
it refuses is a 400 naming the field."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import jsonschema
import ollama
import openai
import pytest
from live_server import LiveServer

MODEL = "char-model"
MINILM = Path(__file__).resolve().parent.parent / "models" / "all-MiniLM-L6-v2"
GREEDY = {"temperature": 0, "num_predict": 12}


@pytest.fixture(scope="module")
def server(char_model):
    embeddings = str(MINILM) if (MINILM / "modules.json").is_file() else None
    with LiveServer(model=str(char_model), slots=4, embeddings=embeddings) as s:
        yield s


def client(server) -> ollama.Client:
    return ollama.Client(host=server.url)


def chat(server, messages: list[dict], **kw) -> openai.types.chat.ChatCompletion:
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    return c.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=12, **kw)


def reused(server) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    return float(re.search(r"^wkvm_prefix_reuse_tokens_total (\S+)", text, re.M).group(1))


def test_chat_equals_the_chat_completion_blocking_and_streamed(server):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    r = client(server).chat(model=MODEL, messages=messages, options=GREEDY)
    c = chat(server, messages, user="o1")
    assert r.message.role == "assistant" and r.message.content == c.choices[0].message.content and r.done
    assert r.done_reason == {"length": "length", "stop": "stop"}[c.choices[0].finish_reason]
    assert r.prompt_eval_count == c.usage.prompt_tokens and r.eval_count == c.usage.completion_tokens
    assert r.total_duration > 0 and r.model == MODEL
    parts = list(client(server).chat(model=MODEL, messages=messages, options=GREEDY, stream=True))
    assert "".join(p.message.content for p in parts) == r.message.content and len(parts) > 3  # as it comes
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    last = parts[-1]
    assert last.eval_count == r.eval_count and last.done_reason == r.done_reason
    assert 0 < last.prompt_eval_duration < last.total_duration and last.eval_duration > 0


def test_generate_is_the_chat_of_its_system_and_prompt(server):
    g = client(server).generate(model=MODEL, prompt="Go on", system="Be brief.", options=GREEDY)
    c = chat(server, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Go on"}], user="o2")
    assert g.response == c.choices[0].message.content and g.done
    short = client(server).generate(model=MODEL, prompt="Go on", options={"temperature": 0, "num_predict": 3})
    assert short.done_reason == "length" and short.eval_count == 3
    for unbounded in (-1, 10**9):  # Ollama's "no limit", and more than the server allows: its limit, not a 400
        options = {"num_predict": unbounded, "stop": ["e"], "seed": 1}
        r = httpx.post(f"{server.url}/api/generate", json={"model": MODEL, "prompt": "Go", "stream": False,
                                                           "options": options})  # fmt: skip
        assert r.status_code == 200 and r.json()["done"], r.text
    streamed = list(client(server).generate(model=MODEL, prompt="Go on", system="Be brief.", options=GREEDY,
                                            stream=True))  # fmt: skip
    assert "".join(p.response for p in streamed) == g.response and streamed[-1].done


def test_a_raw_generate_is_the_completion_of_its_prompt(server):
    """raw: true completes the prompt as it is (no template), as /v1/completions does."""
    kw = dict(model=MODEL, prompt="ROMEO: But soft", raw=True, options=GREEDY)
    g = client(server).generate(**kw)
    c = httpx.post(f"{server.url}/v1/completions", json={"prompt": "ROMEO: But soft", "max_tokens": 12,
                                                         "temperature": 0}).json()  # fmt: skip
    assert g.response == c["choices"][0]["text"] and g.eval_count == c["usage"]["completion_tokens"]
    assert g.prompt_eval_count == c["usage"]["prompt_tokens"] and g.done
    streamed = list(client(server).generate(**kw, stream=True))
    assert "".join(p.response for p in streamed) == g.response and streamed[-1].done_reason == g.done_reason


def test_options_format_and_stops(server):
    ask = [{"role": "user", "content": "Go on"}]
    full = client(server).chat(model=MODEL, messages=ask, options={"temperature": 0, "num_predict": 20})
    stop = full.message.content[5:7]
    cut = client(server).chat(model=MODEL, messages=ask, options={"temperature": 0, "num_predict": 20, "stop": [stop]})
    assert cut.message.content == full.message.content[: full.message.content.find(stop)]
    seeded = [client(server).chat(model=MODEL, messages=ask, options={"temperature": 1.0, "seed": 7, "num_predict": 8})
              for _ in range(2)]  # fmt: skip
    assert seeded[0].message.content == seeded[1].message.content
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}  # fmt: skip
    r = client(server).chat(model=MODEL, messages=ask, format=schema, options={"temperature": 0, "num_predict": 30})
    jsonschema.validate(json.loads(r.message.content), schema)
    r = client(server).chat(model=MODEL, messages=ask, format="json", options={"temperature": 1, "seed": 1,
                                                                                "num_predict": 300})  # fmt: skip
    assert isinstance(json.loads(r.message.content), dict)


def test_tool_calls_in_the_history_and_a_resent_conversation_reuses_its_state(server):
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
               {"role": "tool", "content": "Sunny", "tool_name": "get_weather"}]  # fmt: skip
    call = {"id": "call_1_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    as_chat = [history[0], {"role": "assistant", "content": "", "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1_0", "content": "Sunny"}]  # fmt: skip
    r = client(server).chat(model=MODEL, messages=history, options=GREEDY)
    assert r.message.content == chat(server, as_chat, user="o4").choices[0].message.content
    before = reused(server)
    more = [{"role": "assistant", "content": r.message.content}, {"role": "user", "content": "Thanks"}]
    again = client(server).chat(model=MODEL, messages=[*history, *more], options=GREEDY)
    assert reused(server) - before > r.prompt_eval_count // 2  # the first turn came from its parked state
    fresh = chat(server, [*as_chat, *more], user="o4-fresh")  # another scope: computed from scratch
    assert again.message.content == fresh.choices[0].message.content  # reuse changed nothing


def test_the_model_s_listing(server):
    assert client(server).list().models[0].model == MODEL
    shown = client(server).show(MODEL)
    assert shown.details.family == "rwkv7" and "completion" in shown.capabilities and shown.template is not None
    assert client(server).ps().models[0].name == MODEL
    assert httpx.get(f"{server.url}/api/version").json()["version"]
    assert client(server).chat(model=MODEL, messages=[]).done_reason == "load"  # Ollama's "load the model"


@pytest.mark.skipif(not (MINILM / "modules.json").is_file(), reason=f"{MINILM} absent: make minilm fetches it")
def test_embed_equals_the_openai_embeddings(server):
    e = client(server).embed(model="all-MiniLM-L6-v2", input=["a cat", "a dog"])
    o = httpx.post(f"{server.url}/v1/embeddings", json={"input": ["a cat", "a dog"]}).json()
    assert e.embeddings == [d["embedding"] for d in o["data"]] and e.prompt_eval_count == o["usage"]["prompt_tokens"]
    old = httpx.post(f"{server.url}/api/embeddings", json={"model": "all-MiniLM-L6-v2", "prompt": "a cat"}).json()
    assert old == {"embedding": e.embeddings[0]}  # the older endpoint, one prompt


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/api/chat", {"messages": [{"role": "user", "content": "a", "images": ["aGk="]}]}, "messages[0].images"),
    ("/api/chat", {"messages": [{"role": "robot", "content": "a"}]}, "messages[0].role"),
    ("/api/chat", {"messages": [{"role": "tool", "content": "a"}]}, "messages[0]"),
    ("/api/chat", {"messages": [{"role": "user", "content": "a"}], "format": "yaml"}, "format"),
    ("/api/chat", {"messages": [{"role": "user", "content": "a"}], "options": {"temperature": -1}},
     "options.temperature"),
    ("/api/chat", {"messages": [{"role": "user", "content": "a"}], "format": {"type": "nonsense"}}, "format"),
    ("/api/chat", {"messages": [{"role": "user", "content": "a"}], "options": {"num_predict": "5"}},
     "options.num_predict"),
    ("/api/generate", {"prompt": "\ud800"}, "prompt"),
    ("/api/generate", {"prompt": "a", "raw": True, "system": "s"}, "system"),
    ("/api/generate", {"prompt": "a", "context": [1, 2]}, "context"),
    ("/api/generate", {"prompt": "a", "suffix": "b"}, "suffix"),
])  # fmt: skip
def test_what_is_refused_is_a_400_naming_the_field(server, path, body, param):
    r = httpx.post(f"{server.url}{path}", content=json.dumps({"model": MODEL, "stream": False, **body}),
                   headers={"content-type": "application/json"})  # (json.dumps: httpx refuses a lone surrogate)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_another_model_s_name_is_a_404(server):
    with pytest.raises(ollama.ResponseError) as e:
        client(server).chat(model="llama3", messages=[{"role": "user", "content": "a"}])
    assert e.value.status_code == 404


def test_a_key_guards_the_ollama_routes(char_model):
    with LiveServer(model=str(char_model), api_keys=["k"], slots=1) as s:
        assert httpx.get(f"{s.url}/api/tags").status_code == 401
        assert ollama.Client(host=s.url, headers={"Authorization": "Bearer k"}).list().models[0].model == MODEL


def test_a_streamed_reply_s_tool_calls_come_whole_at_its_end():
    """The chat stream's call pieces (OpenAI's delta.tool_calls) are joined: Ollama's stream carries each call whole,
    arguments as an object, in one line before the done line."""
    import asyncio

    from wkvm.server.ollama_routes import ndjson

    pieces = [{"index": 0, "id": "c0", "type": "function", "function": {"name": "get_weather", "arguments": '{"ci'}},
              {"index": 0, "function": {"arguments": 'ty": "Paris"}'}},
              {"index": 1, "id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]  # fmt: skip
    chunks = [{"choices": [{"delta": {"content": "Let me see."}, "finish_reason": None}]},
              *({"choices": [{"delta": {"tool_calls": [p]}, "finish_reason": None}]} for p in pieces),
              {"choices": [{"delta": {}, "finish_reason": "tool_calls"}]},
              {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 9}}]  # fmt: skip

    async def lines():
        for c in chunks:
            yield f"data: {json.dumps(c)}\n\n"
        yield "data: [DONE]\n\n"

    async def read() -> list[dict]:
        import time

        return [json.loads(line) async for line in ndjson("m", "message", time.perf_counter(), lines())]

    out = asyncio.run(read())
    assert [o["done"] for o in out] == [False, False, True] and out[0]["message"]["content"] == "Let me see."
    assert out[1]["message"]["tool_calls"] == [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                                               {"function": {"name": "f", "arguments": {}}}]  # fmt: skip
    assert out[2]["done_reason"] == "stop" and out[2]["eval_count"] == 9 and out[2]["prompt_eval_count"] == 5
