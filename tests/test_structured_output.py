"""response_format JSON modes: every sampled reply of a random model parses and validates against its schema.

A random model's free output is garbage, so validity comes from the grammar mask alone. Replies are sampled at
temperature 1 with different seeds, many at once through one engine.
"""

import json
import re
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
import torch
from conftest import CHAR_VOCAB
from live_server import LiveServer

import wkvm
from wkvm.config import EngineConfig
from wkvm.engine.engine import Engine
from wkvm.engine.grammar import GrammarCompiler
from wkvm.sampling_params import InvalidParam, SamplingParams, closed_objects
from wkvm.weights.loader import load_model, load_text_tools

N_REPLIES = 50


def obj(properties, required=None):
    """An object schema closed to other keys (extra keys would be unbounded strings for a random model)."""
    keys = list(required or properties)
    return {"type": "object", "properties": properties, "required": keys, "additionalProperties": False}


NAME = {"type": "string", "maxLength": 6}
AGE = {"type": "integer", "minimum": 0, "maximum": 120}
SHORT_OR_NULL = {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 3}]}
SMALL_INTS = {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 2, "maxItems": 5}
SHORT_TAGS = {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 3}
SCHEMAS = {
    "nested": obj({"user": obj({"name": NAME, "age": AGE}), "active": {"type": "boolean"}, "note": SHORT_OR_NULL}),
    "array_min_items": obj({"xs": SMALL_INTS}),
    "enums": obj(
        {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "string", "enum": ["S", "M", "XL"]},
            "level": {"enum": [1, 2, 3]},
        }
    ),
    "numbers": obj(
        {
            "x": {"type": "number", "minimum": 0, "maximum": 10},
            "y": {"type": "number"},
            "n": {"type": "integer", "exclusiveMinimum": 0},
        },
        required=["x", "n"],
    ),
    "strings": obj(
        {
            "code": {"type": "string", "maxLength": 4},
            "tags": SHORT_TAGS,
            "word": {"type": "string", "minLength": 2, "maxLength": 5},
        }
    ),
}


def fmt(schema):
    return {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema, "strict": True}}


def sampled(seed=0, **kw):
    return SamplingParams(max_tokens=kw.pop("max_tokens", 300), temperature=1.0, seed=seed, **kw)


@pytest.fixture(scope="module")
def char(char_model):
    tok, _ = load_text_tools(char_model, "rwkv7")
    return load_model(char_model), tok


@pytest.fixture(scope="module")
def world(world_pth):
    tok, _ = load_text_tools(world_pth, "rwkv7")
    return load_model(world_pth), tok


def replies(model, tok, schema, n, prompt="Say:", **kw):
    engine = Engine(model, tok, EngineConfig(n_slots=n, token_budget=max(512, n)))
    handles = [engine.submit(tok.encode(prompt), sampled(seed=i, response_format=fmt(schema), **kw)) for i in range(n)]
    engine.run_until_done()
    return engine, [h.output for h in handles]


def check_valid(outputs, schema):
    for out in outputs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_sampled_reply_validates(char, name):
    model, tok = char
    engine, outputs = replies(model, tok, SCHEMAS[name], N_REPLIES)
    check_valid(outputs, SCHEMAS[name])
    assert len({o.text for o in outputs}) >= 10  # the seeds sample different replies
    assert engine.runner.grammars is not None and engine.runner.grammars.compilations == 1  # compiled once


def test_objects_that_list_their_properties_are_closed_to_others(char):
    """An object schema with `properties` and nothing said of other keys takes only those (vLLM's xgrammar default and
    llama.cpp's converter; OpenAI's strict mode demands it written): a forced tool call on SmolLM2 had invented a key
    and repeated it to max_tokens. Said otherwise (`additionalProperties`, `patternProperties`), or under `allOf`, a
    schema is kept as written."""
    open_nested = {"type": "object", "properties": {"user": {"type": "object", "properties": {"name": NAME}},
                                                    "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}}},
                   "$defs": {"tag": {"type": "object", "properties": {"t": {"type": "string", "maxLength": 2}}}}}
    model, tok = char
    _, outputs = replies(model, tok, open_nested, 20)
    check_valid(outputs, closed_objects(open_nested))
    assert closed_objects(open_nested)["properties"]["user"]["additionalProperties"] is False
    assert closed_objects(open_nested)["$defs"]["tag"]["additionalProperties"] is False
    # a property named "properties" is a property, not a schema; what a schema says of other keys stands
    named = {"type": "object", "properties": {"properties": {"type": "integer"}},
             "additionalProperties": {"type": "integer"}}  # fmt: skip
    assert closed_objects(named) == named
    assert closed_objects({"properties": {"properties": {"type": "object", "properties": {}}}}) == {
        "properties": {"properties": {"type": "object", "properties": {}, "additionalProperties": False}},
        "additionalProperties": False}  # fmt: skip
    both = {"allOf": [{"properties": {"a": AGE}}, {"properties": {"b": AGE}}]}
    assert closed_objects(both) == both and closed_objects({"type": "object"}) == {"type": "object"}


def test_properties_beside_any_of_one_of_or_ref_are_intersected_not_closed(char):
    """`properties` beside `anyOf` / `oneOf` / `$ref` intersects object schemas as `allOf` does: closing the parent
    and each branch (or the target) had left no key both allow, so valid schemas were 400s ("unsatisfiable"). And
    `oneOf` is read as `anyOf` (docs/http-api.md), overlapping branches too (they had been a 400)."""
    kinds = {"type": "object", "properties": {"kind": {"enum": ["a", "b"]}}, "required": ["kind"],
             "anyOf": [{"properties": {"x": AGE}, "required": ["x"]},
                       {"properties": {"y": {"type": "boolean"}}, "required": ["y"]}]}  # fmt: skip
    based = {"$defs": {"base": {"type": "object", "properties": {"id": AGE}, "required": ["id"]}},
             "$ref": "#/$defs/base", "properties": {"id": AGE, "name": NAME}, "required": ["id", "name"]}
    number = {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"enum": [1, 2, 3]}]}
    model, tok = char
    for schema in (kinds, based):  # kept open, as written: a random model may add keys up to max_tokens ("length")
        assert closed_objects(schema) == schema
        _, outputs = replies(model, tok, schema, 4, max_tokens=120)
        for out in outputs:
            assert out.finish_reason in ("stop", "length"), out
            if out.finish_reason == "stop":
                jsonschema.validate(json.loads(out.text), schema)
    _, outputs = replies(model, tok, number, 4)
    check_valid(outputs, {"anyOf": number["oneOf"]})  # 1 is valid for both of `number`'s branches: anyOf's reading


def test_world_vocabulary(world):
    """The grammar engine takes the World tokenizer (65,536 logits, 65,530 tokens): pad rows are never sampled."""
    model, tok = world
    tags = {"type": "array", "items": {"enum": ["a", "bb"]}, "minItems": 1, "maxItems": 3}
    schema = obj({"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}, "tags": tags})
    _, outputs = replies(model, tok, schema, 12)
    check_valid(outputs, schema)
    assert all(t < tok.vocab_size for o in outputs for t in o.token_ids)


def test_json_object(char):
    """json_object: an object at the top level; the reply ends when it closes."""
    model, tok = char
    engine = Engine(model, tok, EngineConfig(n_slots=20))
    params = [sampled(seed=i, max_tokens=2000, response_format={"type": "json_object"}) for i in range(20)]
    handles = [engine.submit(tok.encode("Go"), p) for p in params]
    engine.run_until_done()
    for h in handles:
        assert h.output.finish_reason == "stop"
        assert isinstance(json.loads(h.output.text), dict)


def test_mask_and_eos(world):
    """EOS is allowed only once the grammar accepts; tokens past the tokenizer's vocabulary never are."""
    model, tok = world
    state = GrammarCompiler(tok).state(sampled(response_format=fmt({"type": "integer"})).grammar())
    width = 65536
    allowed = state.allowed(width)
    assert not allowed[tok.vocab_size :].any() and not allowed[tok.eos_token_id]
    state.accept(tok.encode("7")[0])
    allowed = state.allowed(width)
    assert allowed[tok.eos_token_id] and allowed[tok.encode("3")[0]] and not state.done
    assert not allowed[tok.encode("a")[0]]


def test_a_grammar_is_checked_against_the_vocabulary_at_admission(world, monkeypatch):
    """`GrammarCompiler.problem` (the server's 400 on the request's field before admission, hunt 15): a grammar that
    does not compile, or whose first mask is empty, is named; the compiled grammar stays cached for the engine."""
    import llguidance

    from wkvm.engine.grammar import GrammarState

    compiler = GrammarCompiler(world[1])
    digits = llguidance.LLMatcher.grammar_from_regex("[0-9]{4}")
    assert compiler.problem(digits) is None and compiler.compilations == 1
    compiler.state(digits)
    assert compiler.compilations == 1  # the engine's request reuses the compiled grammar
    assert "did not compile" in compiler.problem('{"grammars": [{"lark_grammar": "start: undefined_rule"}]}')
    monkeypatch.setattr(GrammarState, "allowed", lambda self, width: torch.zeros(width, dtype=torch.bool))
    assert compiler.problem(digits) == "it allows no first token"


def test_grammar_cache_is_lru(world):
    _, tok = world
    compiler = GrammarCompiler(tok, cache_size=2)
    grammars = [sampled(response_format=fmt({"enum": [i]})).grammar() for i in range(3)]
    for g in grammars + grammars[2:]:
        compiler.state(g)
    assert compiler.compilations == 3  # the third schema evicted the first; repeating the third compiles nothing
    compiler.state(grammars[0])
    assert compiler.compilations == 4


@pytest.mark.parametrize(
    "response_format, problem",
    [
        ({"type": "xml"}, '"type" is one of'),
        ({"type": "json_schema"}, "JSON schema object"),
        (fmt({"type": "strnig"}), "Invalid type: strnig"),
        (fmt({"type": "string", "minLength": 5, "maxLength": 2}), "minLength (5) is greater than maxLength (2)"),
        (fmt({"not": {"type": "string"}}), "Unimplemented keys"),
        (fmt({"type": "number", "maximum": float("nan")}), "not plain JSON"),
    ],
)
def test_invalid_response_format(response_format, problem):
    with pytest.raises(InvalidParam, match="response_format") as e:
        SamplingParams(response_format=response_format)
    assert e.value.param == "response_format" and problem in str(e.value)


def test_free_rows_unchanged_by_a_constrained_neighbour(char):
    model, tok = char
    greedy = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    prompts = [tok.encode(p) for p in ("Hello", "World!", "abc")]

    def free_tokens(with_constrained):
        engine = Engine(model, tok, EngineConfig(n_slots=4))
        free = [engine.submit(p, greedy) for p in prompts]
        if with_constrained:
            c = engine.submit(tok.encode("Hi"), sampled(response_format=fmt(SCHEMAS["nested"])))
        engine.run_until_done()
        if with_constrained:
            check_valid([c.output], SCHEMAS["nested"])
        return [h.output.token_ids for h in free]

    assert free_tokens(True) == free_tokens(False)


def test_preempted_constrained_request_resumes_its_parse(char):
    """Parked mid-reply and resumed, a constrained request continues its parse: same reply as uninterrupted."""
    model, tok = char
    schema = SCHEMAS["strings"]
    params = sampled(seed=3, response_format=fmt(schema))

    def run(preempt):
        engine = Engine(model, tok, EngineConfig(n_slots=1))
        low = engine.submit(tok.encode("Hey"), params, priority=5)
        for _ in range(6):
            engine.step()
        if preempt:
            engine.submit(tok.encode("xy"), SamplingParams(max_tokens=5, temperature=0), priority=0)
            engine.step()
            assert low.request.status.value == "parked" and low.request.output_ids
        engine.run_until_done()
        return low.output

    alone, parked = run(False), run(True)
    check_valid([parked], schema)
    assert parked.token_ids == alone.token_ids


@pytest.fixture(scope="module")
def server(char_model):
    with LiveServer(model=str(char_model), slots=4) as s:
        yield s


CHAT = {
    "messages": [{"role": "user", "content": "Give"}],
    "max_tokens": 300,
    "temperature": 1.0,
    "seed": 7,
    "response_format": fmt(SCHEMAS["nested"]),
}


def streamed_text(url, body, field):
    out = []
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                out += [field(c) or "" for c in chunk["choices"]]
    return "".join(out)


def test_http_streaming_equals_blocking(server):
    url = f"{server.url}/v1/chat/completions"
    blocking = httpx.post(url, json=CHAT, timeout=60).json()["choices"][0]
    assert blocking["finish_reason"] == "stop"
    check_valid_text(blocking["message"]["content"], SCHEMAS["nested"])
    assert streamed_text(url, CHAT, lambda c: c["delta"].get("content")) == blocking["message"]["content"]

    body = {"prompt": "Go", "max_tokens": 300, "seed": 2, "response_format": fmt(SCHEMAS["enums"])}
    url = f"{server.url}/v1/completions"
    text = httpx.post(url, json=body, timeout=60).json()["choices"][0]["text"]
    check_valid_text(text, SCHEMAS["enums"])
    assert streamed_text(url, body, lambda c: c["text"]) == text


def test_http_state_generate(server):
    r = httpx.post(f"{server.url}/v1/states", json={"name": "ctx", "prompt": "Facts:"}, timeout=60)
    assert r.status_code == 200, r.text
    body = {"prompt": "Now", "max_tokens": 300, "seed": 1, "response_format": fmt(SCHEMAS["numbers"])}
    url = f"{server.url}/v1/states/{r.json()['handle']}/generate"
    c = httpx.post(url, json=body, timeout=60).json()["choices"][0]
    assert c["finish_reason"] == "stop"
    check_valid_text(c["text"], SCHEMAS["numbers"])
    assert streamed_text(url, body, lambda ch: ch["text"]) == c["text"]


def test_llama_cpp_json_object_with_its_schema(server):
    """llama.cpp's server reads `{"type": "json_object", "schema": ...}` as that schema (it was ignored: any object)."""
    for seed in range(3):
        body = {**CHAT, "seed": seed, "response_format": {"type": "json_object", "schema": SCHEMAS["enums"]}}
        c = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
        assert c["finish_reason"] == "stop"
        check_valid_text(c["message"]["content"], SCHEMAS["enums"])


def check_valid_text(text, schema):
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize(
    "response_format, param, problem",
    [
        (fmt({"type": "object", "properties": {"a": {"type": "strnig"}}}), "response_format", "Invalid type: strnig"),
        (fmt({"type": "array", "uniqueItems": True}), "response_format", "uniqueItems"),
        ({"type": "yaml"}, "response_format.type", "json_schema"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema", "required"),
        ({"type": "json_schema", "schema": {"type": "object"}}, "response_format.schema", "json_object"),
    ],
)
def test_http_invalid_schema_is_400(server, response_format, param, problem):
    for path, body in (("chat/completions", CHAT), ("completions", {"prompt": "x"})):
        r = httpx.post(f"{server.url}/v1/{path}", json={**body, "response_format": response_format}, timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and problem in err["message"], err


def test_openai_sdk_json_schema(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    schema = SCHEMAS["enums"]
    r = client.chat.completions.create(
        model=server.ctx.model_name,
        messages=[{"role": "user", "content": "Pick a color and a size."}],
        response_format={"type": "json_schema", "json_schema": {"name": "pick", "schema": schema, "strict": True}},
        temperature=1.0,
        seed=11,
    )
    assert r.choices[0].finish_reason == "stop"
    check_valid_text(r.choices[0].message.content, schema)
    hi = [{"role": "user", "content": "Hi"}]
    r = client.chat.completions.create(
        model=server.ctx.model_name, messages=hi, response_format={"type": "json_object"}, max_tokens=2000, seed=4
    )
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)


def test_a_grammar_dead_end_is_the_requests_own_400(server):
    """A schema this vocabulary cannot finish (the char tokenizer has no space): the request fails alone with a
    400 that says why, and an unconstrained request beside it is untouched."""
    schema = {"type": "object", "properties": {"a": {"const": "x y"}}, "required": ["a"], "additionalProperties": False}
    body = {"messages": [{"role": "user", "content": "Give"}], "max_tokens": 50, "temperature": 0,
            "response_format": fmt(schema)}  # fmt: skip
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "grammar_dead_end" and "allows no token" in r.json()["error"]["message"]
    ok = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "response_format": None}, timeout=60)
    assert ok.status_code == 200


def test_a_constrained_request_moved_to_another_engine_resumes_its_parse(char):
    """Suspended mid-reply and resumed in another engine (live migration), a constrained request's grammar replays
    the tokens it already produced: the same valid reply as uninterrupted."""
    model, tok = char
    schema = SCHEMAS["nested"]
    params = sampled(seed=5, response_format=fmt(schema))
    whole = Engine(model, tok, EngineConfig(n_slots=1))
    want = whole.submit(tok.encode("Hey"), params)
    whole.run_until_done()
    src = Engine(model, tok, EngineConfig(n_slots=1))
    h = src.submit(tok.encode("Hey"), params)
    for _ in range(8):
        src.step()
    assert h.request.output_ids and not h.done.is_set()
    moving = src.suspend(h.request_id)
    src.step()
    dst = Engine(model, tok, EngineConfig(n_slots=1))
    moved = dst.resume_continuation(moving.result(), params)
    dst.run_until_done()
    check_valid([moved.output], schema)
    assert moved.output.token_ids == want.output.token_ids and moved.output.text == want.output.text


def valid_json(text, schema):
    jsonschema.validate(json.loads(text), schema)
    return True


STRUCTURED = [
    ({"choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
    ({"regex": r"[a-c]{2}-[0-9]{3}"}, lambda t: re.fullmatch(r"[a-c]{2}-[0-9]{3}", t) is not None),
    ({"json": SCHEMAS["enums"]}, lambda t: valid_json(t, SCHEMAS["enums"])),
    ({"json": json.dumps(SCHEMAS["numbers"])}, lambda t: valid_json(t, SCHEMAS["numbers"])),
    ({"grammar": 'start: "id" NUM ("," "id" NUM)?\nNUM: /[0-9]{2}/'},
     lambda t: re.fullmatch(r"id[0-9]{2}(,id[0-9]{2})?", t) is not None),
    # GBNF, as llama.cpp and vLLM's default xgrammar backend read grammars (llguidance's converter)
    ({"grammar": 'root ::= "id" num ("," "id" num)?\nnum ::= [0-9] [0-9]'},
     lambda t: re.fullmatch(r"id[0-9]{2}(,id[0-9]{2})?", t) is not None),
]  # fmt: skip


@pytest.mark.parametrize(("structured", "valid"), STRUCTURED,
                         ids=["choice", "regex", "json", "json_text", "lark", "gbnf"])  # fmt: skip
def test_structured_outputs_every_sampled_reply_matches(char, structured, valid):
    """vLLM's structured_outputs (choice, regex, JSON schema as an object or text, Lark grammar) through the same
    grammar mask as response_format: every sampled reply of a random model matches and ends when it is complete."""
    model, tok = char
    engine = Engine(model, tok, EngineConfig(n_slots=20, token_budget=512))
    handles = [engine.submit(tok.encode("Say:"), sampled(seed=i, structured_outputs=structured)) for i in range(20)]
    engine.run_until_done()
    texts = [h.output.text for h in handles]
    assert all(h.output.finish_reason == "stop" for h in handles), texts
    assert all(valid(t) for t in texts), texts
    assert len(set(texts)) >= 2  # the seeds sample different replies


def test_structured_outputs_over_http_and_its_old_names(server):
    url = f"{server.url}/v1/completions"
    base = {"prompt": "Pick", "max_tokens": 50, "seed": 3}
    for extra in ({"structured_outputs": {"choice": ["yes", "no"]}}, {"guided_choice": ["yes", "no"]},
                  {"grammar": 'root ::= "yes" | "no"'}):  # llama-server's field, a GBNF grammar
        r = httpx.post(url, json={**base, **extra}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("yes", "no"), r.text
    chat = {"messages": [{"role": "user", "content": "Code?"}], "max_tokens": 50, "seed": 5, "guided_regex": "[0-9]{4}"}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=60)
    assert re.fullmatch("[0-9]{4}", r.json()["choices"][0]["message"]["content"]), r.text
    # vLLM's json_object kind, and its old guided_json_object (hunt 10: ignored with a warning, the reply free text)
    for extra in ({"structured_outputs": {"json_object": True}}, {"guided_json_object": True}):
        r = httpx.post(url, json={**base, "max_tokens": 300, "temperature": 1.0, **extra}, timeout=60)  # greedy loops
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop" and isinstance(json.loads(choice["text"]), dict), r.text
    for bad in ({"structured_outputs": {"choice": ["a"], "regex": "b"}}, {"structured_outputs": {}},
                {"structured_outputs": {"regex": "(unclosed"}}, {"structured_outputs": {"choice": []}},
                {"structured_outputs": {"json": "{not json"}},
                {"structured_outputs": {"choice": ["a"]}, "guided_regex": "b"},
                {"structured_outputs": {"json_object": False}}, {"guided_json_object": True, "guided_regex": "b"},
                {"structured_outputs": {"grammar": "root ::= undefined"}}, {"grammar": 'start ::= "a"'},
                {"structured_outputs": {"grammar": "root ::= " + "(" * 3000 + '"a"' + ")" * 3000}},
                {"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}}):  # fmt: skip
        r = httpx.post(url, json={**base, **bad}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs", (bad, r.text)
    with pytest.MonkeyPatch.context() as m:  # what the vocabulary check at admission says becomes the field's 400
        m.setattr(server.ctx.client, "grammar_problem", lambda grammar: "it allows no first token")
        for stream in (False, True):
            r = httpx.post(url, json={**base, "guided_regex": "[0-9]", "stream": stream}, timeout=60)
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == "structured_outputs" and "no first token" in err["message"]
    # one llguidance gives up on while it runs (its lexer's budget is shared by the copies of a compiled grammar, so
    # no check at admission sees it): the request's 400 with llguidance's reason, not its parser's state
    r = httpx.post(url, json={**base, "structured_outputs": {"regex": "(a|aa){99999}"}}, timeout=60)
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "grammar_dead_end" and len(err["message"]) < 400, r.text



def test_characters_split_over_byte_level_tokens():
    """A byte-level BPE vocabulary (the embedded model's, as GPT-2, SmolLM2, Qwen) splits a character over tokens
    that hold part of its bytes: the grammar sees each token's own bytes, so such characters can be produced (before,
    those tokens read as U+FFFD and every request whose answer needed one was a 400)."""
    path = Path(wkvm.__file__).parent / "assets" / "wkvm-tiny-shakespeare"
    tok, _ = load_text_tools(path, "rwkv7")
    text = "日本 naïve é"
    ids = tok.encode(text)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()
    assert any(b"\xef\xbf\xbd" not in tok.token_bytes(i) and not is_utf8(tok.token_bytes(i)) for i in ids)
    choices = ["日本", "中国", "naïve"]
    engine = Engine(load_model(path), tok, EngineConfig(n_slots=12, token_budget=512))
    handles = [engine.submit(tok.encode("Say:"), sampled(seed=i, structured_outputs={"choice": choices}))
               for i in range(12)]  # fmt: skip
    engine.run_until_done()
    texts = [h.output.text for h in handles]
    assert all(h.output.finish_reason == "stop" for h in handles) and set(texts) <= set(choices), texts


def is_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_special_and_end_tokens_are_never_a_grammars_text(tmp_path):
    """Every special and end token is special to the grammar engine (only the main EOS had been): a grammar whose
    text spells `<|endoftext|>` (a second end token, as SmolLM2's) had let the model pick that token, which ended the
    reply mid-value with finish_reason "stop" (or, as a non-end special token, vanished from the text)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    from wkvm.tokenizer import HFTokenizer

    raw = Tokenizer(models.BPE(vocab=dict(CHAR_VOCAB), merges=[]))
    raw.decoder = decoders.Fuse()
    raw.add_special_tokens([AddedToken(t, special=True) for t in ("<|im_end|>", "<|endoftext|>", "<|im_start|>")])
    raw.save(str(tmp_path / "tokenizer.json"))
    end, other_end, start = (raw.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>", "<|im_start|>"))
    tok = HFTokenizer(tmp_path / "tokenizer.json", "<|im_end|>", [other_end])
    assert tok.eos_token_id == end and tok.eos_token_ids == {end, other_end} and start in tok.special_ids
    for text in ("<|endoftext|>", "<|im_start|>"):
        grammar = sampled(structured_outputs={"regex": "a" + re.escape(text) + "b"}).grammar()
        state = GrammarCompiler(tok).state(grammar)
        state.accept(tok.encode("a")[0])
        allowed = state.allowed(tok.vocab_size)
        assert allowed[tok.encode("<")[0]] and not allowed[[end, other_end, start]].any()



def test_a_constrained_rows_logprobs_are_its_masked_distributions(char):
    """As vLLM's (its model runner masks the logits before its sampler reads them): a token the grammar forces has
    logprob 0, and tokens it rules out are never among the top logprobs (they had been the unmasked model's)."""
    model, tok = char
    engine = Engine(model, tok, EngineConfig(n_slots=2))
    forced = engine.submit(tok.encode("Say:"), sampled(structured_outputs={"choice": ["abc"]}, logprobs=3))
    free = engine.submit(tok.encode("Say:"), sampled(max_tokens=3, logprobs=3))
    engine.run_until_done()
    assert forced.output.text == "abc" and len(forced.output.logprobs) == 3
    for step in forced.output.logprobs:
        assert max(step.values()) == 0.0 and sorted(step.values())[-2] == float("-inf"), step
    assert all(max(step.values()) < 0 for step in free.output.logprobs)  # the free row keeps the model's own


def test_a_format_is_built_and_checked_once(monkeypatch):
    """A grammar was built and checked at creation, again at admission, once more for each seeded choice's new params
    and by the engine for each row: 8 seeded choices of a 50,000-way choice took 29 s (review, session 38).
    Now once per distinct format."""
    from wkvm.sampling_params import _cached_grammar
    from wkvm.server.generation import per_choice

    built = []
    original = SamplingParams._grammar_of
    monkeypatch.setattr(SamplingParams, "_grammar_of", lambda self: built.append(1) or original(self))
    _cached_grammar.cache_clear()
    params = SamplingParams(structured_outputs={"choice": ["yes", "no"]}, seed=1, temperature=1.0)
    choices = per_choice(params, 16)
    assert [c.seed for c in choices] == list(range(1, 17)) and {c.grammar() for c in choices} == {params.grammar()}
    assert len(built) == 1
    # the cache keeps a schema's key order: its properties come out in that order
    za, az = ({"type": "object", "properties": dict(p), "required": [k for k, _ in p]}
              for p in ([("z", AGE), ("a", AGE)], [("a", AGE), ("z", AGE)]))  # fmt: skip
    grammars = [SamplingParams(response_format=fmt(x)).grammar() for x in (za, az)]
    assert grammars[0] != grammars[1] and grammars[0].index('"z"') < grammars[0].index('"a"')
