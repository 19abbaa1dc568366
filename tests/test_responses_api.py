"""The Responses API (POST/GET/DELETE /v1/responses) through the `openai` SDK on a random tiny model: each answer
equals the chat completion of the same conversation; previous_response_id continues a stored conversation, reusing
its parked state without changing the answer; the stream's events build the same response; function tools, text
formats, tenancy, a restart keeps stored responses; bad requests are 400s naming the field."""

from __future__ import annotations

import json
import threading

import httpx
import jsonschema
import openai
import pytest
from live_server import LiveServer

from wkvm.state.responses import ResponseStore

KEYS = ["key-a", "key-b"]
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}}  # fmt: skip
GREEDY = {"temperature": 0, "max_output_tokens": 12}


@pytest.fixture(scope="module")
def server(char_model):
    with LiveServer(model=str(char_model), api_keys=KEYS, slots=4) as s:
        yield s


def sdk(server, key="key-a") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)


def chat_text(client: openai.OpenAI, messages: list[dict], user: str, **kw) -> tuple[str, int]:
    r = client.chat.completions.create(model="char-model", messages=messages, temperature=0, max_tokens=12,
                                       user=user, **kw)  # fmt: skip
    return r.choices[0].message.content or "", r.usage.prompt_tokens


def test_answer_equals_the_chat_completion_of_the_same_messages(server):
    client = sdk(server)
    r = client.responses.create(model="char-model", input="Hello there", instructions="Be brief.", user="u1", **GREEDY)
    text, prompt_tokens = chat_text(client, [{"role": "system", "content": "Be brief."},
                                             {"role": "user", "content": "Hello there"}], "other-1")  # fmt: skip
    assert r.object == "response" and r.id.startswith("resp_") and r.status in ("completed", "incomplete")
    assert r.output_text == text and r.usage.input_tokens == prompt_tokens
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert r.instructions == "Be brief." and r.store is True and r.usage.output_tokens >= 1
    raw = httpx.get(f"{server.url}/v1/responses/{r.id}", headers={"Authorization": "Bearer key-a"}).json()
    assert raw["top_logprobs"] is None and raw["max_tool_calls"] is None  # OpenAI's object has them (null: not asked)
    assert (raw["completed_at"] is not None) == (r.status == "completed")
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens" and r.usage.output_tokens == 12


def test_previous_response_id_continues_exactly_and_reuses_the_state(server):
    client = sdk(server)
    first = client.responses.create(model="char-model", input="Name a colour.", user="u2", **GREEDY)
    second = client.responses.create(model="char-model", input=[{"role": "user", "content": "And another?"}],
                                     previous_response_id=first.id, user="u2", **GREEDY)  # fmt: skip
    history = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "And another?"}]  # fmt: skip
    text, prompt_tokens = chat_text(client, history, "fresh-u2")  # another scope: computed from scratch
    assert second.output_text == text and second.usage.input_tokens == prompt_tokens
    assert second.previous_response_id == first.id
    # the first turn's prompt and answer came from its parked state, not recomputed
    assert second.usage.input_tokens_details.cached_tokens > first.usage.input_tokens
    assert first.usage.input_tokens_details.cached_tokens == 0
    third = client.responses.create(model="char-model", input="Thanks.", previous_response_id=second.id, user="u2",
                                    **GREEDY)  # fmt: skip
    assert third.usage.input_tokens_details.cached_tokens > second.usage.input_tokens


def test_stream_events_build_the_stored_response(server):
    client = sdk(server)
    events = list(client.responses.create(model="char-model", input="Stream it", stream=True, user="u3", **GREEDY))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == events[-2].item.content[0].text
    assert final.output[0].id == events[2].item.id
    text, _ = chat_text(client, [{"role": "user", "content": "Stream it"}], "fresh-u3")
    assert deltas == text
    stored = client.responses.retrieve(final.id)
    assert stored.model_dump() == final.model_dump()


def test_a_streamed_response_stores_its_answer_for_the_next_turn(server):
    """A streamed response (stored by default) keeps its conversation with its answer: the next turn that names it
    is the chat completion of the whole history, prompt tokens and all."""
    client = sdk(server)
    events = list(client.responses.create(model="char-model", input="Say something.", stream=True, user="u11",
                                          **GREEDY))  # fmt: skip
    first = events[-1].response
    assert first.output_text
    second = client.responses.create(model="char-model", input="More?", previous_response_id=first.id, user="u11",
                                     **GREEDY)  # fmt: skip
    history = [{"role": "user", "content": "Say something."}, {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "More?"}]  # fmt: skip
    text, prompt_tokens = chat_text(client, history, "fresh-u11")
    assert second.usage.input_tokens == prompt_tokens and second.output_text == text


def test_a_streamed_response_with_store_false_is_not_stored(server):
    client = sdk(server)
    events = list(client.responses.create(model="char-model", input="Not kept", stream=True, store=False,
                                          **GREEDY))  # fmt: skip
    final = events[-1].response
    assert final.store is False and final.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(final.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="char-model", input="more", previous_response_id=final.id, **GREEDY)
    assert e.value.body["param"] == "previous_response_id" and e.value.code == "previous_response_not_found"


def test_a_response_in_progress_reads_so_and_one_deleted_then_is_not_stored(server, monkeypatch):
    """OpenAI's: a stored response can be read while it runs (status in_progress). It had been a 404 on GET and
    DELETE and then stored anyway, and a continuation said it was deleted or never stored (hunt, session 49)."""
    runner = server.ctx.client.engine.runner
    run, gate = runner.run, threading.Event()
    monkeypatch.setattr(runner, "run", lambda work: gate.wait(60) and run(work))  # no step until the gate opens
    client = sdk(server)
    for delete in (False, True):
        stream = client.responses.create(model="char-model", input="Wait for it", stream=True, **GREEDY)
        first = next(iter(stream))
        assert first.type == "response.created"
        rid = first.response.id
        seen = client.responses.retrieve(rid)
        assert seen.status == "in_progress" and seen.output == []
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model="char-model", input="more", previous_response_id=rid, **GREEDY)
        assert e.value.code == "previous_response_in_progress"
        with pytest.raises(openai.NotFoundError):
            sdk(server, "key-b").responses.retrieve(rid)  # another key's running response is no more visible
        if delete:
            client.responses.delete(rid)
            with pytest.raises(openai.NotFoundError):
                client.responses.retrieve(rid)
        gate.set()
        final = list(stream)[-1].response
        assert final.id == rid and final.status in ("completed", "incomplete")
        if delete:
            with pytest.raises(openai.NotFoundError):
                client.responses.retrieve(rid)
        else:
            assert client.responses.retrieve(rid).status == final.status
        gate.clear()
    gate.set()


def test_a_response_deleted_while_it_is_being_stored_stays_deleted(server, monkeypatch):
    """A DELETE answered while the finished response's put ran (the run still live) had said deleted, and the put
    stored it anyway (review, session 49)."""
    responses = server.ctx.responses
    put, entered, gate, ids = responses.put, threading.Event(), threading.Event(), []

    def slow_put(owner, response, messages):
        ids.append(response["id"])
        entered.set()
        gate.wait(60)
        return put(owner, response, messages)

    monkeypatch.setattr(responses, "put", slow_put)
    client, answer = sdk(server), {}
    t = threading.Thread(target=lambda: answer.update(r=client.responses.create(model="char-model", input="Keep?",
                                                                              **GREEDY)))  # fmt: skip
    t.start()
    assert entered.wait(60)
    (rid,) = ids
    client.responses.delete(rid)
    gate.set()
    t.join(60)
    assert answer["r"].id == rid
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(rid)


def test_stream_with_logprobs_and_usage(server):
    client = sdk(server)
    events = list(client.responses.create(model="char-model", input="Odds?", include=["message.output_text.logprobs"],
                                          top_logprobs=2, user="u4", stream=True, **GREEDY))  # fmt: skip
    final = events[-1].response  # completed, or incomplete at max_output_tokens (the SDK's stream() wants completed)
    deltas = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [lp.model_dump() for lp in deltas] == [lp.model_dump() for lp in final.output[0].content[0].logprobs]
    lps = final.output[0].content[0].logprobs
    assert len(lps) == final.usage.output_tokens and all(len(lp.top_logprobs) == 2 for lp in lps)
    assert "".join(lp.token for lp in lps) == final.output_text
    r = client.responses.create(model="char-model", input="Odds?", user="u4b", **GREEDY)
    assert r.output[0].content[0].logprobs == [] and r.output_text == final.output_text


def test_store_false_delete_and_tenancy(server):
    a, b = sdk(server), sdk(server, "key-b")
    kept = a.responses.create(model="char-model", input="keep", **GREEDY)
    gone = a.responses.create(model="char-model", input="forget", store=False, **GREEDY)
    assert a.responses.retrieve(kept.id).id == kept.id
    for client, rid in ((a, gone.id), (b, kept.id)):  # not stored; another key's
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(rid)
        with pytest.raises(openai.BadRequestError) as e:  # a 400, as OpenAI's
            client.responses.create(model="char-model", input="more", previous_response_id=rid, **GREEDY)
        assert e.value.body["param"] == "previous_response_id" and e.value.code == "previous_response_not_found"
    with pytest.raises(openai.NotFoundError):
        b.responses.delete(kept.id)
    a.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(kept.id)


def test_required_function_call_and_its_output_continue(server):
    client = sdk(server)
    r = client.responses.create(model="char-model", input="Weather in Paris?", tools=[WEATHER], tool_choice="required",
                                temperature=1.0, extra_body={"seed": 3}, max_output_tokens=200)  # fmt: skip
    calls = [item for item in r.output if item.type == "function_call"]
    assert calls and r.status == "completed"
    for call in calls:
        assert call.name == "get_weather" and call.call_id
        jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": "sunny, 21 C"} for c in calls]
    after = client.responses.create(model="char-model", input=outputs, previous_response_id=r.id, tools=[WEATHER],
                                    tool_choice="none", **GREEDY)  # fmt: skip
    assert [item.type for item in after.output] == ["message"]
    # the same turn sent whole, as items, is the same conversation
    whole = client.responses.create(model="char-model", input=[{"role": "user", "content": "Weather in Paris?"},
                                    *[c.model_dump(exclude={"id", "status"}) for c in calls], *outputs],
                                    tools=[WEATHER], tool_choice="none", user="whole", **GREEDY)  # fmt: skip
    assert whole.output_text == after.output_text and whole.usage.input_tokens == after.usage.input_tokens


def test_a_forced_call_streamed_with_logprobs_is_the_blocking_answer(server):
    """A reply that can only be a call has no message item, streamed or not, with logprobs asked for (the stream had
    opened an empty message for the call's logprobs), and not when max_output_tokens cuts the call (its JSON is
    not the assistant's words)."""
    client = sdk(server)
    kw = dict(model="char-model", input="Weather?", tools=[WEATHER], tool_choice="required", temperature=1.0,
              include=["message.output_text.logprobs"], extra_body={"seed": 2})  # fmt: skip
    blocking = client.responses.create(**kw, max_output_tokens=200)
    events = list(client.responses.create(**kw, max_output_tokens=200, stream=True))
    assert [i.type for i in blocking.output] == [i.type for i in events[-1].response.output] == ["function_call"]
    assert not [e for e in events if e.type == "response.output_text.delta"]
    cut = client.responses.create(**kw, max_output_tokens=4)
    events = list(client.responses.create(**kw, max_output_tokens=4, stream=True))
    assert cut.status == events[-1].response.status == "incomplete"
    assert cut.output == events[-1].response.output == []


def test_streamed_function_call_events(server):
    client = sdk(server)
    events = list(client.responses.create(model="char-model", input="Weather?", tools=[WEATHER],
                                          tool_choice={"type": "function", "name": "get_weather"}, stream=True,
                                          temperature=1.0, extra_body={"seed": 5}, max_output_tokens=200))  # fmt: skip
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    final = events[-1].response
    assert [c.arguments for c in final.output if c.type == "function_call"] == [e.arguments for e in done]
    jsonschema.validate(json.loads(done[0].arguments), WEATHER["parameters"])
    # the arguments stream as they come (they had come in one delta after the whole call): the item opens empty
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.arguments == "" and added.item.status == "in_progress" and kinds.index(added.type) < kinds.index(
        "response.function_call_arguments.delta")
    assert len(deltas) > 1 and "".join(e.delta for e in deltas) == done[0].arguments
    assert {e.item_id for e in deltas} == {added.item.id} and final.output[0].status == "completed"


def piece(delta: dict, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
OPENING = [piece({"role": "assistant", "content": ""}), piece({"content": "Let me check."})]
WHOLE_CALL = [piece({"tool_calls": [{"index": 0, **CALL}]}, "tool_calls")]
# the call as the chat stream sends it now: id and name first, then its arguments piece by piece; the last chunk
# has its last piece and the words after it
CALL_IN_PIECES = [piece({"tool_calls": [{"index": 0, **CALL, "function": {"name": "get_weather", "arguments": ""}}]}),
                  piece({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
                  piece({"content": " Done.", "tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]},
                        "tool_calls")]  # fmt: skip


@pytest.mark.parametrize("calls", [WHOLE_CALL, CALL_IN_PIECES], ids=["whole", "pieces"])
def test_a_call_after_words_streams_at_its_own_output_index(tmp_path, calls):
    """Words, then a call (`auto`): the message is output 0 and the call output 1, in every event of each and in the
    final response's order; the call's arguments are its deltas joined, and words after the call are a message of
    their own after it. Fed the chat stream's chunks as they come for such a reply (the tests' random model never
    writes a call under `auto`)."""
    import asyncio
    from types import SimpleNamespace

    from wkvm.server.responses_routes import Running, input_messages, response_shell, stream_events
    from wkvm.server.schemas import ResponsesRequest

    usage = {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14,
             "prompt_tokens_details": {"cached_tokens": 0}}  # fmt: skip
    chunks = [*OPENING, *calls, {"choices": [], "usage": usage}, "[DONE]"]

    async def lines():
        for c in chunks:
            yield f"data: {c if isinstance(c, str) else json.dumps(c)}\n\n"

    body = ResponsesRequest(input="Weather?", tools=[WEATHER], stream=True)
    ctx = SimpleNamespace(model_name="char-model", sampling_defaults={}, responses=ResponseStore(tmp_path / "r.sqlite"))
    shell = response_shell(ctx, body, "resp_" + "0" * 32)

    async def run():
        return [e async for e in stream_events(ctx, "t", body, shell, [{"role": "user", "content": "Weather?"}],
                                               lines(), Running(shell), lambda: None)]  # fmt: skip

    events = [json.loads(e.split("data: ", 1)[1]) for e in asyncio.run(run())]
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed"
    after = ["message"] if calls is CALL_IN_PIECES else []
    assert [i["type"] for i in final["output"]] == ["message", "function_call", *after]
    assert final["output"][1]["arguments"] == CALL["function"]["arguments"] and final["output"][1]["status"] == (
        "completed")
    index = {}
    for e in events:
        if "output_index" in e:
            item_id = e["item"]["id"] if "item" in e else e["item_id"]
            index.setdefault(item_id, set()).add(e["output_index"])
    assert index == {item["id"]: {i} for i, item in enumerate(final["output"])}
    call_events = [e["type"] for e in events if e.get("output_index") == 1]
    deltas = ["response.function_call_arguments.delta"] * (2 if calls is CALL_IN_PIECES else 1)
    assert call_events == ["response.output_item.added", *deltas, "response.function_call_arguments.done",
                           "response.output_item.done"]  # fmt: skip
    if after:  # sent back as input (or continued by previous_response_id) it is one assistant turn with its call
        assert final["output"][2]["content"][0]["text"] == " Done."
        (turn,) = input_messages(final["output"])
        # the call's call_id follows from the response's id and its place (a moved stream's goes on the same)
        assert turn["content"] == "Let me check. Done." and turn["tool_calls"][0]["id"] == f"call_{'0' * 32}_1"
    ctx.responses.close()


def test_json_schema_format(server):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}  # fmt: skip
    client = sdk(server)
    for seed in range(3):
        r = client.responses.create(model="char-model", input="A number", temperature=1.0, extra_body={"seed": seed},
                                    max_output_tokens=60,
                                    text={"format": {"type": "json_schema", "name": "num", "schema": schema}})
        jsonschema.validate(json.loads(r.output_text), schema)
        assert r.text.format.type == "json_schema"
    r = client.responses.create(model="char-model", input="An object", max_output_tokens=60,
                                text={"format": {"type": "json_object"}})
    assert r.model_dump()["text"]["format"] == {"type": "json_object"}


@pytest.mark.parametrize(("body", "param"), [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "hi", "tools": [{"type": "function", "name": "bad name!"}]}, "tools[0].name"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "truncation": "auto"}, "truncation"),
    ({"input": "hi", "prompt": {"id": "pmpt_1"}}, "prompt"),  # both had been ignored: answered as if never sent
    ({"input": "hi", "max_tool_calls": 0}, "max_tool_calls"),
    ({"input": "hi", "state": "mine"}, "state"),  # chat's and completions' named states: both had been ignored
    ({"input": "hi", "save_state": "mine"}, "save_state"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": 10**6}, "max_output_tokens"),
    ({"input": "hi", "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "function": "get_weather"}},
     "tool_choice"),  # a 500 (AttributeError), as null or a list there
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"input": []}, "input"),
    ({"input": "hi", "previous_response_id": ""}, "previous_response_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c1", "output": None}]}, "input[0].output"),
    ({"input": [{"type": "function_call_output", "call_id": "c1", "output": "x"}]}, "input"),
    ({"input": [{"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
                {"role": "user", "content": "and?"}], "tools": [WEATHER]}, "input"),
    ({"input": "hi", "model": "other"}, "model"),
    ({"input": "hi", "include": ["message.output_text.logprob"]}, "include[0]"),  # a typo had gone unnoticed
    ({"input": [{"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
                {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "x"}], "tools": [WEATHER]}, "input"),
    ({"input": [{"role": "user", "content": None}]}, "input[0].content"),  # hunt 8: both had passed
    ({"input": [{"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{x"},
                {"type": "function_call_output", "call_id": "c1", "output": "x"}], "tools": [WEATHER]},
     "input[0].arguments"),  # it had named the chat's messages[1].tool_calls[0].function.arguments (session 47)
    ({"input": [{"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "[" * 100_000},
                {"type": "function_call_output", "call_id": "c1", "output": "x"}], "tools": [WEATHER]},
     "input[0].arguments"),  # too deep for the JSON parser: a 500 (review, session 47)
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]}, "input[0].content[0].text"),
])  # fmt: skip
def test_bad_requests_are_400s_naming_the_field(server, body, param):
    r = httpx.post(f"{server.url}/v1/responses", json=body, headers={"Authorization": "Bearer key-a"}, timeout=60)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param, r.text


def test_a_client_cannot_choose_its_response_id(server):
    """The id header is a cluster front's (it strips a client's): a single server had taken it from the client, which
    could then write over its own stored response."""
    headers = {"Authorization": "Bearer key-a"}
    first = httpx.post(f"{server.url}/v1/responses", json={"input": "hi", **GREEDY}, headers=headers, timeout=60).json()
    again = httpx.post(f"{server.url}/v1/responses", json={"input": "other", **GREEDY}, timeout=60,
                       headers={**headers, "x-wkvm-response-id": first["id"]}).json()  # fmt: skip
    assert again["id"] != first["id"]
    kept = httpx.get(f"{server.url}/v1/responses/{first['id']}", headers=headers).json()
    assert kept["output"] == first["output"]


def test_errors_name_the_responses_fields_in_their_words(server):
    r = httpx.post(f"{server.url}/v1/responses", json={"input": "hi", "max_output_tokens": 10**6},
                   headers={"Authorization": "Bearer key-a"}, timeout=60)  # fmt: skip
    message = r.json()["error"]["message"]
    assert "max_output_tokens" in message and "max_tokens" not in message, message
    from wkvm.server.responses_routes import responses_text

    said = responses_text("response_format.json_schema.schema: bad; the tool 'max_tokens' (a user's name) is kept")
    assert said == "text.format.schema: bad; the tool 'max_tokens' (a user's name) is kept"
    said = responses_text("tools[0].function.parameters must be a JSON schema object")
    assert said == "tools[0].parameters must be a JSON schema object"  # as its param (it had said .function.)


def test_stored_responses_survive_a_restart(char_model, tmp_path):
    with LiveServer(model=str(char_model), api_keys=KEYS, state_dir=str(tmp_path), slots=2) as first:
        r = sdk(first).responses.create(model="char-model", input="Remember me", user="u9", **GREEDY)
    with LiveServer(model=str(char_model), api_keys=KEYS, state_dir=str(tmp_path), slots=2) as again:
        client = sdk(again)
        assert client.responses.retrieve(r.id).output_text == r.output_text
        more = client.responses.create(model="char-model", input="Again", previous_response_id=r.id, user="u9",
                                       **GREEDY)  # fmt: skip
        history = [{"role": "user", "content": "Remember me"}, {"role": "assistant", "content": r.output_text},
                   {"role": "user", "content": "Again"}]  # fmt: skip
        assert more.output_text == chat_text(client, history, "fresh-u9")[0]


def test_the_store_keeps_each_owners_newest_within_its_bounds(tmp_path):
    store = ResponseStore(tmp_path / "r.sqlite", max_per_owner=3, max_bytes=2000)
    for i in range(5):
        store.put("a", {"id": f"r{i}"}, [{"role": "user", "content": "x"}])
    store.put("b", {"id": "r0"}, [])
    assert [rid for rid in ("r0", "r1", "r2", "r3", "r4") if store.get("a", rid)] == ["r2", "r3", "r4"]
    assert store.get("b", "r0") == ({"id": "r0"}, []) and store.get("b", "r4") is None
    store.put("a", {"id": "big"}, [{"role": "user", "content": "y" * 2100}])  # alone past the byte bound: kept
    assert store.get("a", "big") is not None and store.get("a", "r4") is None
    assert store.delete("a", "big") and not store.delete("a", "big") and not store.delete("b", "r4")
    # an account (a key) with many users (Open WebUI's header, which a client sets itself) keeps 10x an owner's
    # bounds in all, its newest; it had a fresh allowance for each made-up user (hunt 15). Other accounts keep theirs.
    for i in range(40):
        store.put(f"key-k/user-{i}", {"id": f"u{i}"}, [])
    kept = [i for i in range(40) if store.get(f"key-k/user-{i}", f"u{i}")]
    assert kept == list(range(10, 40))
    assert store.get("b", "r0") is not None
    store.close()


def test_responses_taken_from_another_store_move_within_the_bounds(tmp_path):
    """A cluster replica taking an orphaned slot's responses (`take`): all move, the source keeps none, and each owner
    stays within its bounds, the newest kept (review, session 49)."""
    here, there = (ResponseStore(tmp_path / f"{n}.sqlite", max_per_owner=3) for n in ("here", "there"))
    for i in range(2):
        here.put("a", {"id": f"h{i}"}, [])
    for i in range(3):
        there.put("a", {"id": f"t{i}"}, [])
    there.close()
    assert sorted(here.take(tmp_path / "there.sqlite")) == [("a", "t0"), ("a", "t1"), ("a", "t2")]
    assert [rid for rid in ("h0", "h1", "t0", "t1", "t2") if here.get("a", rid)] == ["t0", "t1", "t2"]
    assert ResponseStore(tmp_path / "there.sqlite").ids() == []
    here.close()


def test_a_response_put_while_the_clock_steps_back_is_kept(tmp_path, monkeypatch):
    """The newest is the last put, not the latest clock time: a response put after an NTP step back had been the
    oldest at its owner's bound and deleted in its own put (its id answered, then a 404)."""
    import wkvm.state.responses as responses

    clock, real = [1000.0, 2000.0, 3000.0, 500.0], responses.time.time
    monkeypatch.setattr(responses.time, "time", lambda: clock.pop(0) if clock else real())
    store = ResponseStore(tmp_path / "r.sqlite", max_per_owner=3, max_bytes=10**6)
    for i in range(4):
        store.put("a", {"id": f"r{i}"}, [])
    assert [rid for rid in ("r0", "r1", "r2", "r3") if store.get("a", rid)] == ["r1", "r2", "r3"]
    store.close()


def test_a_cut_or_failed_answer_says_so_in_its_items_and_events(char_model):
    """max_output_tokens cuts the message: it is `incomplete` (OpenAI's item status), blocking and streamed. A request
    that times out mid-stream sends an `error` event before `response.failed`, as every failure does (hunt 8: only
    `response.failed` came)."""
    with LiveServer(model=str(char_model), slots=2, request_timeout=3) as s:  # 16,000 tokens take far longer
        client = sdk(s)
        cut = client.responses.create(model="char-model", input="Hello", temperature=0, max_output_tokens=3)
        events = list(client.responses.create(model="char-model", input="Hello", temperature=0, max_output_tokens=3,
                                              stream=True))  # fmt: skip
        assert [e.item.status for e in events if e.type == "response.output_item.done"] == ["incomplete"]
        for r in (cut, events[-1].response):
            assert r.status == "incomplete" and [i.status for i in r.output] == ["incomplete"]
            assert r.output[0].content[0].text
        # greedy on this random model runs on without an end token (the tests' char model: checked)
        events = list(client.responses.create(model="char-model", input="Tell a long story", temperature=0,
                                              max_output_tokens=16_000, stream=True))  # fmt: skip
        kinds = [e.type for e in events]
        assert kinds[-2:] == ["error", "response.failed"], kinds[-4:]
        assert events[-1].response.output[-1].status == "incomplete"


def test_an_output_refusal_part_reads_as_its_text():
    """Review (session 39): replaying an OpenAI Responses output with a refusal part was a 400; chat read it already."""
    from wkvm.server.errors import APIError
    from wkvm.server.responses_routes import text_of

    parts = [{"type": "output_text", "text": "a"}, {"type": "refusal", "refusal": "No."}]
    assert text_of(parts, "input[1]") == "a\nNo."
    with pytest.raises(APIError) as e:
        text_of([{"type": "refusal"}], "input[1].content")
    assert e.value.param == "input[1].content[0].refusal"
