"""The client libraries people point at an OpenAI endpoint, against a live server on the embedded model: LangChain
(`langchain-openai` ChatOpenAI) and LiteLLM (`litellm.completion` with `api_base`) each complete a chat, a streamed
chat, a multi-turn conversation and a forced tool call, and get what the same request sent by hand gets.

Nothing reaches the network: LiteLLM reads its bundled model-cost map (LITELLM_LOCAL_MODEL_COST_MAP, set before
its import, which otherwise downloads it) and LangChain's tracing to LangSmith is off."""

from __future__ import annotations

import json
import os

os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
os.environ["LANGSMITH_TRACING"] = os.environ["LANGCHAIN_TRACING_V2"] = "false"

import httpx  # noqa: E402
import jsonschema  # noqa: E402
import litellm  # noqa: E402
import pytest  # noqa: E402
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402
from live_server import LiveServer  # noqa: E402

from wkvm.cli import EMBEDDED_MODEL  # noqa: E402

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}  # fmt: skip
ARGS = WEATHER["function"]["parameters"]
TURNS = [
    {"role": "system", "content": "You are a player in a play."},
    {"role": "user", "content": "Who goes there?"},
    {"role": "assistant", "content": "A friend to this ground."},
    {"role": "user", "content": "Stand and unfold yourself."},
]
GREEDY = {"temperature": 0, "max_tokens": 12}
# litellm's lazily built pydantic models warn about `ReadOnly` TypedDict items, which pydantic cannot enforce
pytestmark = pytest.mark.filterwarnings("ignore:.*ReadOnly. qualifier:UserWarning")


@pytest.fixture(scope="module")
def server(one_thread):
    with LiveServer(model=str(EMBEDDED_MODEL), slots=4) as s:
        yield s


def by_hand(server, messages: list[dict], **kw) -> dict:
    """The same chat request sent with plain HTTP: what a client library must get back."""
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": messages, **GREEDY, **kw}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def check_call(name: str, args: dict) -> None:
    assert name == "get_weather"
    jsonschema.validate(args, ARGS)


# --- LangChain ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chat_model(server):
    return ChatOpenAI(model=server.ctx.model_name, base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                      **GREEDY)  # fmt: skip


def test_langchain_chat(chat_model, server):
    reply = chat_model.invoke("Who goes there?")
    want = by_hand(server, [{"role": "user", "content": "Who goes there?"}])
    assert isinstance(reply, AIMessage) and reply.content == want["choices"][0]["message"]["content"] != ""
    assert reply.usage_metadata["input_tokens"] == want["usage"]["prompt_tokens"]
    assert reply.response_metadata["finish_reason"] == want["choices"][0]["finish_reason"]


def test_langchain_streamed_chat_equals_the_blocking_one(chat_model):
    chunks = list(chat_model.stream("Who goes there?"))
    assert len([c for c in chunks if c.content]) > 1  # really streamed, token by token
    assert "".join(c.content for c in chunks) == chat_model.invoke("Who goes there?").content


def test_langchain_multi_turn(chat_model, server):
    history = [SystemMessage(TURNS[0]["content"]), HumanMessage(TURNS[1]["content"]), AIMessage(TURNS[2]["content"]),
               HumanMessage(TURNS[3]["content"])]  # fmt: skip
    reply = chat_model.invoke(history)
    assert reply.content == by_hand(server, TURNS)["choices"][0]["message"]["content"]
    # the conversation goes on: the reply joins the history and the next turn sees all of it
    more = [*history, reply, HumanMessage("Long live the king!")]
    turns = [*TURNS, {"role": "assistant", "content": reply.content}, {"role": "user", "content": more[-1].content}]
    assert chat_model.invoke(more).content == by_hand(server, turns)["choices"][0]["message"]["content"]


def test_langchain_tool_call_and_its_result(chat_model):
    with_tools = chat_model.bind_tools([WEATHER], tool_choice="get_weather", parallel_tool_calls=False)
    ask = [HumanMessage("What is the weather in Verona?")]
    reply = with_tools.bind(max_tokens=64).invoke(ask)
    # a named tool_choice finishes "stop", as OpenAI's and vLLM's: LangChain reads the calls all the same
    assert reply.response_metadata["finish_reason"] == "stop" and len(reply.tool_calls) == 1
    call = reply.tool_calls[0]
    check_call(call["name"], call["args"])
    # streamed, the call comes in pieces (its name, then its arguments as written) that LangChain joins to the same
    chunks = list(with_tools.bind(max_tokens=64).stream(ask))
    assert len([c for c in chunks if c.tool_call_chunks]) > 2
    joined = chunks[0]
    for c in chunks[1:]:
        joined += c
    assert [(t["name"], t["args"]) for t in joined.tool_calls] == [(call["name"], call["args"])]
    # the tool's answer goes back and the model replies in words
    answer = chat_model.invoke([*ask, reply, ToolMessage('{"sky": "clear"}', tool_call_id=call["id"])])
    assert isinstance(answer.content, str) and answer.content and not answer.tool_calls


# --- LiteLLM -----------------------------------------------------------------------------------------------------
def complete(server, messages: list[dict], **kw):
    return litellm.completion(model=f"openai/{server.ctx.model_name}", api_base=f"{server.url}/v1", api_key="unused",
                              messages=messages, **{**GREEDY, **kw})  # fmt: skip


def test_litellm_chat_and_multi_turn(server):
    for messages in (TURNS[1:2], TURNS):
        r = complete(server, messages)
        want = by_hand(server, messages)
        assert r.choices[0].message.content == want["choices"][0]["message"]["content"] != ""
        assert r.usage.prompt_tokens == want["usage"]["prompt_tokens"]


def test_litellm_streamed_chat_equals_the_blocking_one(server):
    chunks = list(complete(server, TURNS[1:2], stream=True))
    parts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(parts) > 1
    assert "".join(parts) == complete(server, TURNS[1:2]).choices[0].message.content


def test_litellm_tool_call(server):
    ask = [{"role": "user", "content": "What is the weather in Verona?"}]
    r = complete(server, ask, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, max_tokens=64)
    assert r.choices[0].finish_reason == "tool_calls"
    (call,) = r.choices[0].message.tool_calls
    check_call(call.function.name, json.loads(call.function.arguments))
    chunks = list(complete(server, ask, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                           max_tokens=64, stream=True))  # fmt: skip
    assert len([c for c in chunks if c.choices and c.choices[0].delta.tool_calls]) > 2  # in pieces, as OpenAI's
    (joined,) = litellm.stream_chunk_builder(chunks, messages=ask).choices[0].message.tool_calls
    assert (joined.function.name, joined.function.arguments) == (call.function.name, call.function.arguments)
    result = {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'}
    answer = complete(server, [*ask, r.choices[0].message.model_dump(exclude_none=True), result])
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
