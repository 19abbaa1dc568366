"""The OpenAI-compatible API through the official `openai` SDK, against a live server on a random model."""

import dataclasses
import json
import re
import uuid
from types import SimpleNamespace

import httpx
import openai
import pytest
from live_server import LiveServer
from prometheus_client.parser import text_string_to_metric_families

from wkvm import LLM, SamplingParams
from wkvm.chat_template import ChatTemplate
from wkvm.server.errors import APIError
from wkvm.server.openai_routes import render_chat


@pytest.fixture(scope="module")
def server(world_pth):
    with LiveServer(model=str(world_pth), slots=4, max_tokens_limit=256, max_body_bytes=1 << 20,
                    max_prompt_tokens=5000) as s:  # fmt: skip
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_models(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [server.ctx.model_name]


def fresh_scope() -> str:
    """A `user` no other request used: its reuse scope starts with no checkpoints, so its reuse mode is known."""
    return f"user-{uuid.uuid4().hex}"


def test_greedy_completion_equals_python_api(client, world_pth):
    kw = dict(model="world", prompt="Once upon a time", max_tokens=12, temperature=0, user=fresh_scope(),
              extra_body={"return_token_ids": True, "ignore_eos": True})  # fmt: skip
    r = client.completions.create(**kw)
    expected = LLM(model=world_pth).generate("Once upon a time", SamplingParams(max_tokens=12, temperature=0,
                                                                              ignore_eos=True))[0]  # fmt: skip
    c = r.choices[0]
    assert c.text == expected.text and c.model_extra["token_ids"] == expected.token_ids
    assert r.model_extra["prompt_token_ids"] == expected.prompt_token_ids
    assert r.usage.prompt_tokens == len(expected.prompt_token_ids) and r.usage.completion_tokens == 12
    assert r.model_extra["wkvm"] == {"mode": "fresh", "reused_tokens": 0, "restart_reason": None}
    # the same prompt again resumes from the state stored after its prompt: all but the last token are reused
    again = client.completions.create(**kw)
    assert again.choices[0].model_extra["token_ids"] == expected.token_ids
    n = len(expected.prompt_token_ids)
    assert again.model_extra["wkvm"] == {"mode": "checkpoint", "reused_tokens": n - 1, "restart_reason": None}


def test_token_id_prompt_and_logprobs(client):
    r = client.completions.create(model="world", prompt=[101, 202, 303], max_tokens=5, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})  # fmt: skip
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    # greedy: the chosen token is the most likely one, so the top 3 include it and hold exactly 3 entries
    assert [len(t) for t in lp.top_logprobs] == [3] * 5
    assert all(max(t.values()) <= 0 for t in lp.top_logprobs)
    assert [t[tok] for t, tok in zip(lp.top_logprobs, lp.tokens, strict=True)] == lp.token_logprobs
    assert [max(t.values()) for t in lp.top_logprobs] == lp.token_logprobs
    assert lp.text_offset[0] == 0
    # sampled: a token outside the top k is listed beside them (OpenAI's "up to logprobs + 1"; it was left out)
    r = client.completions.create(model="world", prompt=[101, 202, 303], max_tokens=24, temperature=2.0, logprobs=1,
                                  seed=5, extra_body={"ignore_eos": True})  # fmt: skip
    lp = r.choices[0].logprobs
    assert [t[tok] for t, tok in zip(lp.top_logprobs, lp.tokens, strict=True)] == lp.token_logprobs
    sizes = [len(t) for t in lp.top_logprobs]
    assert set(sizes) <= {1, 2} and 2 in sizes  # at temperature 2, most tokens are not the most likely


def test_invalid_unicode_in_a_message_is_placed_in_that_message(server):
    """A lone surrogate is refused naming the message and its offset in it (it was an offset in the rendered chat)."""
    body = b'{"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "ab\\udfff"}]}'
    r = httpx.post(f"{server.url}/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "messages[1].content", r.text
    assert "character 2 " in error["message"], r.text


def test_a_request_without_max_tokens_gets_a_default_within_the_servers_limit(server):
    """Chat's default of 1,024 tokens above this server's --max-tokens-limit (256) had refused every chat that set no
    max_tokens; min_tokens above the default raises it (its check had named a max_tokens the client never sent)."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=chat)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 256, r.text
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "min_tokens": 40, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 40, r.text


def test_prompt_list_reports_each_prompt(client):
    kw = dict(model="world", prompt=[[7, 8, 9, 10], [101, 202, 303]], max_tokens=4, temperature=0, n=2,
              user=fresh_scope(), extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
    r = client.completions.create(**kw)
    assert len(r.choices) == 4
    fresh = {"mode": "fresh", "reused_tokens": 0, "restart_reason": None}
    assert r.model_extra["wkvm"]["prompts"] == [fresh, fresh]
    assert r.model_extra["prompt_token_ids"][1] == [101, 202, 303]
    assert [c.model_extra["prompt_token_ids"] for c in r.choices][2:] == [[101, 202, 303]] * 2
    last = [c for c in client.completions.create(stream=True, **kw) if c.choices][-1]
    # n > 1 checkpoints the shared prefill (the prompt's end), so the same request resumes each prompt from it
    resumed = [{"mode": "checkpoint", "reused_tokens": n, "restart_reason": None} for n in (3, 2)]
    assert last.model_extra["wkvm"]["prompts"] == resumed
    assert [c.text for c in client.completions.create(**kw).choices] == [c.text for c in r.choices]
    # a later list reports, per prompt, whether it resumed from a checkpoint
    mixed = client.completions.create(**{**kw, "n": 1, "prompt": [[7, 8, 9, 10], [55, 66]]})
    assert mixed.model_extra["wkvm"]["prompts"] == [resumed[0], fresh]


def test_logit_bias_through_the_sdk(client, server):
    """OpenAI's logit_bias (token ids as string keys): -100 bans a token in completions and chat alike; a key that is
    not a token id of the model, or a value out of [-100, 100], is a 400 naming logit_bias."""
    kw = dict(model="world", prompt=[101, 202, 303], max_tokens=8, temperature=0,
              extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
    ids = client.completions.create(**kw).choices[0].model_extra["token_ids"]
    one = client.completions.create(**kw, logit_bias={str(ids[0]): -100}).choices[0].model_extra["token_ids"]
    assert one[0] != ids[0] and ids[0] not in one
    banned = client.completions.create(**kw, logit_bias={str(t): -100 for t in set(ids)})
    assert not set(banned.choices[0].model_extra["token_ids"]) & set(ids)
    msgs = [{"role": "user", "content": "Hello"}]
    chat = client.chat.completions.create(model="world", messages=msgs, max_tokens=6, temperature=0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
    chat_ids = chat.choices[0].model_extra["token_ids"]
    again = client.chat.completions.create(model="world", messages=msgs, max_tokens=6, temperature=0,
                                           logit_bias={str(chat_ids[0]): -100},
                                           extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
    assert again.choices[0].model_extra["token_ids"][0] != chat_ids[0]
    vocab = server.ctx.model.vocab_size
    for bad in ({str(vocab): 1}, {"x": 1}, {"-1": 1}, {"5": 101}, {"5": "1"}):
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "logit_bias": bad})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("logit_bias"), (bad, r.text)


def test_continue_final_message_prefills_the_reply(client, server):
    """vLLM's continue_final_message: the prompt ends with the last (assistant) message's own text, so the reply
    continues it, exactly as a completion of that text; /tokenize gives the same ids."""
    messages = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Once upon"}]
    extra = {"continue_final_message": True, "add_generation_prompt": False, "return_token_ids": True,
             "ignore_eos": True, "user": fresh_scope()}  # fmt: skip
    chat = client.chat.completions.create(model="world", messages=messages, max_tokens=8, temperature=0,
                                          extra_body=extra)  # fmt: skip
    ids = chat.model_extra["prompt_token_ids"]
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": ids}).json()["prompt"]
    assert text == "User: Hello\n\nAssistant: Once upon"
    done = client.completions.create(model="world", prompt=text, max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True, "return_token_ids": True, "user": fresh_scope()})
    assert chat.choices[0].model_extra["token_ids"] == done.choices[0].model_extra["token_ids"]
    t = httpx.post(f"{server.url}/tokenize", json={"messages": messages, "continue_final_message": True,
                                                   "add_generation_prompt": False}).json()  # fmt: skip
    assert t["tokens"] == ids
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": messages, "continue_final_message": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"
    # an empty prefill opens the turn, as transformers' apply_chat_template and vLLM do (it had been a 400; hunt,
    # session 48)
    empty = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": ""}]
    t = httpx.post(f"{server.url}/tokenize", json={"messages": empty, "continue_final_message": True,
                                                   "add_generation_prompt": False}).json()  # fmt: skip
    opened = httpx.post(f"{server.url}/detokenize", json={"tokens": t["tokens"]}).json()["prompt"]
    assert opened == "User: Hello\n\nAssistant:", opened


def test_continue_final_message_cuts_the_template_after_the_last_text():
    """With a template that closes each message, the prompt still ends right after the last message's text."""
    ctx = SimpleNamespace(template=ChatTemplate("{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>"
                                                "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"))
    messages = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi, I"}]
    assert render_chat(ctx, messages, None, False, True) == "<user>Say hi</user><assistant>Hi, I"
    assert render_chat(ctx, messages, None) == "<user>Say hi</user><assistant>Hi, I</assistant><assistant>"
    for final in ("<", "a", "r>", "Hi </"):  # text the closing marks also hold: cut after the message's own text
        msgs = [*messages[:-1], {"role": "assistant", "content": final}]
        assert render_chat(ctx, msgs, None, False, True) == f"<user>Say hi</user><assistant>{final}", final
    msgs = [*messages[:-1], {"role": "assistant", "content": ""}]  # the turn opened, as transformers renders it
    assert render_chat(ctx, msgs, None, False, True) == "<user>Say hi</user><assistant>"
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    for content in (None, ""):  # tool calls, with no content or "" (as chat_messages makes null): they would go
        with pytest.raises(APIError, match="no text to continue"):
            render_chat(ctx, [*messages[:-1], {"role": "assistant", "content": content, "tool_calls": calls}], None,
                        False, True)  # fmt: skip
    trims = SimpleNamespace(template=ChatTemplate("{% for m in messages %}[{{ m.content | trim }}]{% endfor %}"))
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "So "}]
    assert render_chat(trims, msgs, None, False, True) == "[Hi][So"  # as transformers cuts a trimmed message


def test_developer_messages_are_system_messages_to_a_template_without_that_role():
    """OpenAI's developer role is the system role: a template that knows no developer role (most HF templates) gets
    it as system (SmolLM2 had rendered an untrained `<|im_start|>developer` and added its default system prompt);
    one that names it gets it as it is."""
    plain = ChatTemplate("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    knows = ChatTemplate("{% for m in messages %}{% if m.role == 'developer' %}<dev>{% endif %}{{ m.content }}"
                         "{% endfor %}")  # fmt: skip
    msgs = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert plain.render(msgs, False) == "<system>Be brief.<user>Hi"
    assert knows.render(msgs, False) == "<dev>Be brief.Hi"


def test_streaming_completion_matches_blocking(client):
    kw = dict(model="world", prompt="The king", max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    blocking = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == blocking
    assert chunks[-1].usage.completion_tokens == 10
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_include_usage_puts_usage_null_on_every_other_chunk(server):
    """OpenAI: with stream_options.include_usage, every chunk carries `usage` (null) and a last one, with no choices,
    its value; clients read `chunk.usage` on each."""
    hi = {"messages": [{"role": "user", "content": "Hi"}]}
    for path, body in (("completions", {"prompt": "The king"}), ("chat/completions", hi)):
        r = httpx.post(f"{server.url}/v1/{path}", json={**body, "max_tokens": 4, "temperature": 0, "stream": True,
                                                        "stream_options": {"include_usage": True}}, timeout=60)
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        assert all("usage" in c and c["usage"] is None for c in chunks[:-1]), chunks
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4


def test_allowed_token_ids_over_http(client):
    allowed = [40, 41, 42]
    r = client.completions.create(model="world", prompt="The king", max_tokens=8, temperature=1.0, seed=1,
                                  extra_body={"allowed_token_ids": allowed, "ignore_eos": True,
                                              "return_token_ids": True})  # fmt: skip
    assert len(r.choices[0].token_ids) == 8 and set(r.choices[0].token_ids) <= set(allowed)


def test_truncate_prompt_tokens_keeps_the_prompts_end(server, client):
    """vLLM's truncate_prompt_tokens: only the prompt's last N tokens are read (the answer is that prompt's)."""
    ids = list(range(40, 52))
    kw = dict(model="world", max_tokens=4, temperature=0)
    r = client.completions.create(prompt=ids, extra_body={"truncate_prompt_tokens": 3, "return_token_ids": True}, **kw)
    short = client.completions.create(prompt=ids[-3:], **kw)
    assert r.model_extra["prompt_token_ids"] == ids[-3:] and r.choices[0].text == short.choices[0].text
    assert r.usage.prompt_tokens == 3
    # echo: the kept tokens' text, which the logprobs cover, blocking and streamed (the whole prompt's text had been
    # echoed, its offsets jumping over the cut; hunt, session 46)
    text = "The king is dead, long live the king"
    echo = dict(prompt=text, logprobs=1, echo=True, extra_body={"truncate_prompt_tokens": 3, "return_token_ids": True})
    r = client.completions.create(**echo, **kw)
    lp, kept = r.choices[0].logprobs, r.model_extra["prompt_token_ids"]
    head = "".join(lp.tokens[:3])  # the kept prompt tokens' text
    assert len(kept) == 3 and text.endswith(head) and len(head) < len(text) and r.choices[0].text.startswith(head)
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    streamed = "".join(c.choices[0].text for c in client.completions.create(**echo, **kw, stream=True))
    assert streamed == r.choices[0].text
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "Hi there"}], **kw,
                                          extra_body={"truncate_prompt_tokens": 2, "return_token_ids": True})
    assert len(chat.model_extra["prompt_token_ids"]) == 2
    for bad in (0, -2):
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "truncate_prompt_tokens": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text


def test_stop_strings_stream_as_they_block_with_and_without_the_stop_string(client):
    kw = dict(model="world", prompt="The king", max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    stop = full[6:8]
    at = full.find(stop)
    for include in (False, True):
        body = {"ignore_eos": True, "include_stop_str_in_output": include}
        blocking = client.completions.create(**{**kw, "extra_body": body}, stop=[stop]).choices[0]
        assert blocking.text == full[: at + (len(stop) if include else 0)] and blocking.finish_reason == "stop"
        chunks = list(client.completions.create(**{**kw, "extra_body": body}, stop=[stop], stream=True))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == blocking.text


def test_a_template_stop_token_beyond_the_models_rows_is_no_refusal(char_model, tmp_path):
    """Review of session 30: with a tokenizer larger than its model, the template's end-of-turn token (never generated:
    no row) became a stop token id that the new vocabulary check refused, a 400 on a field the client never sent."""
    import shutil

    from conftest import CHAR_VOCAB
    from tokenizers import AddedToken, Tokenizer

    path = tmp_path / "bigger-tokenizer"
    shutil.copytree(char_model, path)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens([AddedToken("<|end|>", special=True)])
    tok.save(str(path / "tokenizer.json"))
    (path / "chat_template.json").write_text(json.dumps({"stop": ["<|end|>"]}))
    llm = LLM(model=str(path))
    assert llm.tokenizer.encode("<|end|>") == [len(CHAR_VOCAB)] == [llm.model.vocab_size]
    hi = [{"role": "user", "content": "Hi"}]
    assert llm.chat(hi, SamplingParams(max_tokens=4))[0].finish_reason == "length"
    with LiveServer(model=str(path)) as s:
        r = httpx.post(f"{s.url}/v1/chat/completions", json={"messages": hi, "max_tokens": 4}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text


def test_chat_blocking_and_streaming(client):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    r = client.chat.completions.create(model="world", messages=msgs, max_tokens=8, temperature=0,
                                       logprobs=True, top_logprobs=2)  # fmt: skip
    msg = r.choices[0].message
    assert msg.role == "assistant" and r.choices[0].finish_reason in ("stop", "length")
    assert len(r.choices[0].logprobs.content) == r.usage.completion_tokens
    assert len(r.choices[0].logprobs.content[0].top_logprobs) == 2
    stream = list(client.chat.completions.create(model="world", messages=msgs, max_tokens=8, temperature=0,
                                                 stream=True))  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == msg.content
    # OpenAI's system_fingerprint, on every answer and chunk: what a seeded answer depends on (left out before
    # session 49)
    done = client.completions.create(model="world", prompt="Hi", max_tokens=2)
    fingerprints = {r.system_fingerprint, done.system_fingerprint, *(c.system_fingerprint for c in stream)}
    assert len(fingerprints) == 1 and re.fullmatch("fp_[0-9a-f]{12}", r.system_fingerprint)


def test_n2_forks_one_prefill(client, server):
    model = server.ctx.client.engine.model
    fed = []
    real_forward = model.forward_groups

    def counting_forward(groups, all_logits=False):
        fed.extend(tokens.numel() for tokens, _ in groups)
        return real_forward(groups, all_logits)

    model.forward_groups = counting_forward
    try:
        kw = dict(model="world", prompt=[5, 6, 7, 8, 9, 10, 11, 12], max_tokens=6, n=2, temperature=1.0, seed=5,
                  extra_body={"ignore_eos": True})  # fmt: skip
        r = client.completions.create(**kw)
    finally:
        model.forward_groups = real_forward
    assert sorted(c.index for c in r.choices) == [0, 1]
    # one prefill of 7 tokens, then each choice feeds the last prompt token and 5 sampled ones (not 2 x 8 + ...)
    assert sum(fed) == 7 + 2 * (1 + 5)
    again = client.completions.create(**kw)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]


def test_errors_are_openai_shaped(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="world", prompt="x", max_tokens=5, temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="x", max_tokens=5)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="world", messages=[{"role": "user", "content": "x"}],
                                       tools=[{"type": "function", "function": {"name": "no spaces"}}])  # fmt: skip
    assert e.value.body["param"] == "tools[0].function.name"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="world", messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:,"}}]}])  # fmt: skip
    assert "content[0]" in e.value.body["param"]
    # an OpenAI transcript's assistant refusal part is its text, as vLLM reads it (it had been a 400 "unsupported")
    u, said = {"role": "user", "content": "x"}, {"role": "assistant", "content": "No."}
    refused = {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]}
    tokens = [httpx.post(f"{server.url}/tokenize", json={"messages": [u, m, u]}).json()["tokens"]
              for m in (said, refused)]  # fmt: skip
    assert tokens[0] == tokens[1]
    empty = {"role": "assistant", "content": [{"type": "refusal"}]}
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": [u, empty, u], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[1].content[0].refusal", r.text
    from wkvm.chat_template import plain_messages

    assert plain_messages([refused]) == [said]
    r = httpx.post(f"{server.url}/v1/completions", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 10**6})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "stop": ["a", "b", "c", "d", "e"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2, "min_tokens": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 3, "min_tokens": 3,
                                                         "temperature": 0})  # fmt: skip
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    r = httpx.get(f"{server.url}/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x" * (2 << 20)})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"

    def chunked():
        yield b'{"prompt": "'
        for _ in range(40):
            yield b"y" * 65536
        yield b'"}'

    r = httpx.post(f"{server.url}/v1/completions", content=chunked(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": [1] * 6000, "max_tokens": 1})
    assert r.status_code == 413 and r.json()["error"]["code"] == "prompt_too_large"


def test_a_text_surely_over_the_prompt_limit_is_refused_before_tokenizing(server, monkeypatch):
    """No token covers more bytes than the vocabulary's longest, so a text with more than twice that many bytes per
    allowed token is a 413 without tokenizing it (a 20 MB prompt took 19 s of tokenizing before its 413, and the GIL
    with it: hunt 15); a stop string is at most 1,024 characters (each is tokenized at admission)."""
    assert server.ctx.longest_token_bytes == 128  # the World vocabulary's longest token
    # a bound of 16 bytes a token keeps the text under this server's 1 MiB body limit (128 would need 1.28 MB)
    monkeypatch.setattr(server.ctx, "longest_token_bytes", 16)
    encode = server.ctx.tokenizer.encode  # stop strings are still tokenized; the long text must not be
    monkeypatch.setattr(server.ctx.tokenizer, "encode", lambda text: encode(text) if len(text) < 1000 else 1 / 0)
    text = "a" * (2 * 16 * 5000 + 1)  # --max-prompt-tokens 5000
    chat = {"messages": [{"role": "user", "content": text}]}
    for path, body in [("/v1/completions", {"prompt": text}), ("/v1/chat/completions", chat),
                       ("/tokenize", {"prompt": text})]:  # fmt: skip
        r = httpx.post(f"{server.url}{path}", json={**body, "max_tokens": 1})
        assert r.status_code == 413 and r.json()["error"]["code"] == "prompt_too_large", (path, r.text)
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "stop": ["y" * 1025]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop" and "1024 characters" in r.text


def test_a_slow_chat_template_holds_no_other_request(server, monkeypatch):
    """A chat's template renders off the event loop: a model's template whose loops ran for minutes had held /health
    and every other request (loading hunt, session 49)."""
    import threading
    import time

    render = server.ctx.template.render
    for messages in ([{"role": "user", "content": "Hi"}],  # a system message is rendered alone too, for its checkpoint
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]):  # (review, 49)
        calls, started, rendered, n = [], threading.Event(), threading.Event(), len(messages)

        def slow(*args, calls=calls, started=started, rendered=rendered, last=n, **kw):
            calls.append(1)
            if len(calls) == last:  # the chat's last render: its whole prompt's, or its system messages'
                started.set()
                time.sleep(4)
                rendered.set()
            return render(*args, **kw)

        monkeypatch.setattr(server.ctx.template, "render", slow)
        body = {"messages": messages, "max_tokens": 1}
        chat = threading.Thread(target=lambda body=body: httpx.post(f"{server.url}/v1/chat/completions", json=body,
                                                                    timeout=60))  # fmt: skip
        chat.start()
        assert started.wait(30)
        assert httpx.get(f"{server.url}/health", timeout=60).status_code == 200
        assert not rendered.is_set()  # answered while the template still rendered, not after it
        chat.join(60)


def test_truncation_cuts_a_text_as_long_as_the_default_limit_tokenizes(server, monkeypatch):
    """truncate_prompt_tokens cuts a text longer than --max-prompt-tokens allows (vLLM's use: a document's end), up to
    what a server with the default limit tokenizes; beyond, a 413 before tokenizing (15 MB had taken 10 s and 2.2 GB,
    context hunt; the guard at --max-prompt-tokens itself had refused a 1 MB document to be cut, regression hunt,
    session 49)."""
    from wkvm.config import MAX_PROMPT_TOKENS

    monkeypatch.setattr(server.ctx, "longest_token_bytes", 1)  # guards: 10,000 bytes here, 262,144 by default
    mid, huge = "a " * 20_000, "a" * (2 * MAX_PROMPT_TOKENS + 1)
    for path, body in [("/v1/completions", {"prompt": mid}), ("/v1/chat/completions",
                                                              {"messages": [{"role": "user", "content": mid}]})]:
        r = httpx.post(f"{server.url}{path}", json={**body, "max_tokens": 1}, timeout=120)
        assert r.status_code == 413, r.text  # over this server's --max-prompt-tokens 5000, untruncated
        r = httpx.post(f"{server.url}{path}", json={**body, "max_tokens": 1, "truncate_prompt_tokens": 5}, timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 5, r.text
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": huge, "max_tokens": 1, "truncate_prompt_tokens": 5})
    assert r.status_code == 413 and "too long to truncate" in r.json()["error"]["message"], r.text


def test_truncating_to_the_context_keeps_within_the_prompt_limit():
    """truncate_prompt_tokens -1 keeps as many tokens as the context holds with room for one, and no more than
    --max-prompt-tokens allows (it had kept the context's worth, then refused them with a 413; hunt, session 49)."""
    from wkvm.server.generation import encode_prompt

    def ctx(context: int, most: int) -> SimpleNamespace:
        return SimpleNamespace(tokenizer=None, model=SimpleNamespace(vocab_size=100, context_limit=context),
                               config=SimpleNamespace(max_prompt_tokens=most))  # fmt: skip

    ids = list(range(1, 31))
    assert encode_prompt(ctx(48, 10), ids, keep=-1) == ids[-10:]
    assert encode_prompt(ctx(16, 100), ids, keep=-1) == ids[-15:]


def test_disconnect_mid_stream_frees_slot(world_pth):
    import time

    # 16000 tokens take about a minute here: only the cancel on disconnect can free the slot before the deadline
    body = {"prompt": "Long", "max_tokens": 16000, "temperature": 0, "stream": True, "ignore_eos": True}
    with LiveServer(model=str(world_pth), slots=2) as server:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            seen = []
            lines = r.iter_lines()  # one iterator: httpx refuses a second (session 53's failure said only that)
            for line in lines:
                seen.append(line)
                if line.startswith("data: ") and json.loads(line[6:]).get("choices"):
                    break
            # seen free while streaming three times (fresh-clone runs under load, sessions 27, 40 and 53; not
            # reproduced alone). Say what came, and how the stream ended, to find out why
            engine = server.ctx.client.engine
            if engine.arena.num_free != 1:
                free, running, waiting = engine.arena.num_free, list(engine.scheduler.running), engine.scheduler.waiting
                rest = [line for _, line in zip(range(50), lines, strict=False)]
                raise AssertionError(f"{free} slots free while streaming; running {running}, waiting {waiting}; "
                                     f"first lines {seen}; the stream went on with {rest[-3:]}")  # fmt: skip
        deadline = time.monotonic() + 10
        while server.ctx.client.engine.arena.num_free != 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.ctx.client.engine.arena.num_free == 2
        metrics = scrape(server)  # the cancelled choice ended as `abort` (review: a cut-off stream was never counted)
        assert metrics[("wkvm_choices_finished_total", (("finished_reason", "abort"),))] == 1
        assert metrics[("wkvm_e2e_request_latency_seconds_count", ())] == 1


def test_a_client_gone_while_an_n_gt_1_request_waits_for_its_shared_prefill_cancels_it(world_pth):
    """Streaming hunt (session 47): an n > 1 request waits for its shared prefill (queued, then the whole prompt)
    before its handles exist, and a client that left meanwhile had left it to run to the end (7 s of a 3,000-token
    prompt on SmolLM2)."""
    import time

    with LiveServer(model=str(world_pth), slots=2, prefill_chunk=8) as server:
        engine = server.ctx.client.engine
        step = engine.step
        engine.step = lambda: time.sleep(0.05) or step()  # a slow prefill: 8 tokens a step, 20 steps a second
        body = {"prompt": "To be, or not to be: that is the question. " * 200, "n": 2, "max_tokens": 4}
        with pytest.raises(httpx.ReadTimeout):  # the client gives up during the shared prefill (~15 s of it)
            httpx.post(f"{server.url}/v1/completions", json=body, timeout=1.0)
        deadline = time.monotonic() + 8  # well inside the ~14 s left of the prefill, with room for a loaded machine
        while (engine.scheduler.running or engine.scheduler.waiting) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not engine.scheduler.running and not engine.scheduler.waiting  # cancelled, not run to the end


def scrape(server) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics: (name, sorted labels) -> value."""
    text = httpx.get(f"{server.url}/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}  # fmt: skip


def test_metrics(server, client):
    ok = ("wkvm_requests_total", (("route", "/v1/completions"), ("status", "200")))
    before = scrape(server)
    r = client.completions.create(model="world", prompt="a", max_tokens=2, user=fresh_scope(),
                                  extra_body={"ignore_eos": True})  # fmt: skip
    after = scrape(server)

    def moved(name, labels=()):
        return after[(name, labels)] - before.get((name, labels), 0.0)

    assert r.usage.completion_tokens == 2
    assert moved(*ok) == 1
    assert moved("wkvm_prompt_tokens_total") == r.usage.prompt_tokens
    assert moved("wkvm_generation_tokens_total") == 2
    assert moved("wkvm_time_to_first_token_seconds_count") == 1
    assert moved("wkvm_inter_token_latency_seconds_count") == 1  # one gap between two tokens
    assert moved("wkvm_choices_finished_total", (("finished_reason", "length"),)) == 1
    assert moved("wkvm_e2e_request_latency_seconds_count") == 1 == moved("wkvm_request_queue_time_seconds_count")
    assert moved("wkvm_e2e_request_latency_seconds_sum") >= moved("wkvm_time_to_first_token_seconds_sum") > 0
    assert moved("wkvm_prefix_reuse_misses_total") == 1 and moved("wkvm_prefix_reuse_hits_total") == 0
    assert moved("wkvm_prefix_reuse_tokens_total") == 0
    assert after[("wkvm_slots_total", ())] == after[("wkvm_slots_free", ())] == 4
    assert after[("wkvm_queue_depth", ())] == 0
    assert after[("wkvm_state_bytes", (("tier", "device"),))] > 0  # the completion's checkpoints
    assert moved("wkvm_checkpoints_not_kept_total") == 0 and after[("wkvm_checkpoints_not_kept_total", ())] >= 0
    again = client.completions.create(model="world", prompt="a b c d", max_tokens=3, extra_body={"ignore_eos": True})
    last = scrape(server)
    assert last[ok] - after[ok] == 1
    assert last[("wkvm_generation_tokens_total", ())] - after[("wkvm_generation_tokens_total", ())] == 3
    assert last[("wkvm_prompt_tokens_total", ())] - after[("wkvm_prompt_tokens_total", ())] == again.usage.prompt_tokens


def test_a_loaded_server_freezes_its_startup_heap_and_thaws_it_when_it_stops(world_pth):
    """Full garbage collections walked every object of a loaded server (~150 ms, every stream stalled): what loading
    left alive is frozen out of them, and given back when the server shuts down."""
    import gc
    import time

    from fastapi.testclient import TestClient

    from wkvm.config import ServerConfig
    from wkvm.server.app import create_app

    gc.unfreeze()
    with TestClient(create_app(ServerConfig(model=str(world_pth), slots=1)), base_url="http://localhost") as c:
        deadline = time.monotonic() + 30
        while not c.app.state.ctx.ready.is_set() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.get("/health").status_code == 200
        frozen = gc.get_freeze_count()
        assert frozen > 1000  # the model, the engine, the app and every module loaded for them
        ctx = c.app.state.ctx
        assert not any(o is ctx for o in gc.get_objects())  # frozen: out of the collector's lists
    assert gc.get_freeze_count() == 0


def test_only_the_step_loop_runs_torch_on_several_threads(world_pth):
    """A server's other threads (anyio's workers: state import and export, saves, KV cuts, embeddings) run torch on
    one thread, its step loop on the count the server started with: one other thread that had run a two-thread op
    made every later decode step ~2x slower (libgomp throttles its waits once it manages more threads than CPUs)."""
    import contextlib
    import ctypes
    import threading
    import time
    from pathlib import Path

    import torch
    from fastapi.testclient import TestClient

    from wkvm.config import ServerConfig
    from wkvm.server.app import create_app

    mkl_threads = lambda: 2  # noqa: E731  (a torch without MKL: OpenMP's count alone)
    with contextlib.suppress(OSError, AttributeError):  # MKL's own count (torch's fp32 bmm, linear without oneDNN)
        mkl_threads = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so")).MKL_Get_Max_Threads
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # two even on a one-core machine: the counts below must differ
    try:
        with TestClient(create_app(ServerConfig(model=str(world_pth), slots=1)), base_url="http://localhost") as c:
            deadline = time.monotonic() + 30
            while not c.app.state.ctx.ready.is_set() and time.monotonic() < deadline:
                time.sleep(0.05)
            engine = c.app.state.ctx.client.engine
            seen: list[tuple[int, int]] = []
            step = engine.step
            engine.step = lambda: seen.append((torch.get_num_threads(), mkl_threads())) or step()
            r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
            other: list[int] = []
            worker = threading.Thread(target=lambda: other.append(torch.get_num_threads()))
            worker.start()
            worker.join()
        worker = threading.Thread(target=lambda: other.append(torch.get_num_threads()))
        worker.start()
        worker.join()
        assert seen and set(seen) == {(2, 2)} and other == [1, 2]  # and 2 again once the server has shut down
    finally:
        torch.set_num_threads(before)


@pytest.mark.allows_5xx
def test_health_is_503_until_a_model_is_loaded(tmp_path):
    import time

    from fastapi.testclient import TestClient

    from wkvm.config import ServerConfig
    from wkvm.server.app import create_app

    with TestClient(create_app(ServerConfig(model=str(tmp_path / "missing.pth"))), base_url="http://localhost") as c:
        deadline = time.monotonic() + 10
        while c.app.state.ctx.load_error is None and time.monotonic() < deadline:
            time.sleep(0.05)
        r = c.get("/health")
        assert r.status_code == 503 and "failed to load" in r.json()["error"]["message"]
        r = c.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_load_failed"


def test_a_loading_server_says_when_to_retry_and_logs_no_error(world_pth, monkeypatch, caplog):
    """While the model loads, a route answers 503 not_ready with Retry-After (the openai SDK waits that long before
    its retry), and the server does not log it as a server error (a client polling /v1/models at start-up filled the
    log with ERROR lines)."""
    import threading

    from fastapi.testclient import TestClient

    from wkvm.config import ServerConfig
    from wkvm.server.app import create_app
    from wkvm.server.context import ServerContext

    gate, real_load = threading.Event(), ServerContext.load
    monkeypatch.setattr(ServerContext, "load", lambda self: (gate.wait(30), real_load(self)))
    app = create_app(ServerConfig(model=str(world_pth)))
    with caplog.at_level("ERROR", logger="wkvm.server"), TestClient(app, base_url="http://localhost") as c:
        r = c.get("/v1/models")
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready" and r.headers["retry-after"] == "1"
        gate.set()
    assert not [rec for rec in caplog.records if "server error" in rec.getMessage()]


@pytest.mark.allows_5xx
def test_health_is_503_when_the_engine_loop_has_died(server):
    """A server whose step loop died would hang every request: /health says so (and a replica's probe fails)."""
    engine_client = server.ctx.client
    assert httpx.get(f"{server.url}/health").status_code == 200
    engine_client.loop_failed = lambda: True
    try:
        r = httpx.get(f"{server.url}/health")
        assert r.status_code == 503 and "step loop has stopped" in r.json()["error"]["message"]
    finally:
        del engine_client.loop_failed
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_fields_the_server_does_not_read_are_logged_once(caplog):
    from wkvm.server.schemas import CompletionRequest

    name = f"field_{uuid.uuid4().hex[:8]}"
    with caplog.at_level("WARNING", logger="wkvm.server"):
        for _ in range(3):
            CompletionRequest.model_validate({"prompt": "x", name: 1, "temperature": 0})
    noted = [r.getMessage() for r in caplog.records if name in r.getMessage()]
    assert noted == [f"CompletionRequest: fields this server does not read, ignored: {name}"]
    # and inside the option objects (review, session 39: stream_options.continuous_usage_stats went unsaid)
    with caplog.at_level("WARNING", logger="wkvm.server"):
        CompletionRequest.model_validate({"prompt": "x", "stream": True, "stream_options": {name: True},
                                          "structured_outputs": {"regex": "a", f"{name}_2": 1}})  # fmt: skip
    noted = [r.getMessage() for r in caplog.records if name in r.getMessage()]
    assert noted[1:] == [f"StreamOptions: fields this server does not read, ignored: {name}",
                         f"StructuredOutputs: fields this server does not read, ignored: {name}_2"]  # fmt: skip
    forged = f"x\n2026-12-05 07:59:59,000 ERROR fake: {name}"  # security review: a name forged a log line
    with caplog.at_level("WARNING", logger="wkvm.server"):
        CompletionRequest.model_validate({"prompt": "x", forged: 1})
    assert not any("\n" in r.getMessage() for r in caplog.records)


def test_a_messages_name_and_reasoning_reach_the_template():
    """A message's `name` and an assistant's `reasoning_content` go to the template, as vLLM passes them (they had
    been dropped: a template reading `message.name` rendered nothing there)."""
    from wkvm.server.openai_routes import chat_messages
    from wkvm.server.schemas import ChatMessage

    ctx = SimpleNamespace(template=ChatTemplate(
        "{% for m in messages %}<{{ m.role }}{% if m.name %} {{ m.name }}{% endif %}>"
        "{% if m.reasoning_content %}({{ m.reasoning_content }}){% endif %}{{ m.content }}{% endfor %}"))
    msgs = [ChatMessage(role="user", content="Hi", name="ann"),
            ChatMessage(role="assistant", content="Hello", reasoning_content="greet back"),
            ChatMessage(role="user", content="Bye")]  # fmt: skip
    assert render_chat(ctx, chat_messages(msgs), None, False) == "<user ann>Hi<assistant>(greet back)Hello<user>Bye"


def test_a_blocking_answer_is_built_off_the_event_loop(server, monkeypatch):
    """Review (session 38): a blocking answer's choices, logprobs and JSON were built on the event loop (n = 16 with
    logprobs 20 and 8,192 tokens: 70 MB, /health held ~10 s). They are built and serialized on a worker thread now."""
    import threading

    from wkvm.server import openai_routes

    where = []

    class Recorded(openai_routes.JSONResponse):
        def render(self, content):
            where.append(threading.current_thread().name)
            return super().render(content)

    monkeypatch.setattr(openai_routes, "JSONResponse", Recorded)
    body = {"max_tokens": 3, "n": 2, "logprobs": 2, "temperature": 0}
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", **body}, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "n": 2, "logprobs": True,
            "top_logprobs": 2}  # fmt: skip
    r = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
    loop_thread = threading.main_thread().name
    assert len(where) == 2 and all(name.startswith("AnyIO worker") for name in where), (where, loop_thread)


def test_a_stream_that_fails_sends_its_error_event_and_no_error_finish(server):
    """Review (session 38): a stream whose request failed mid-way sent a chunk with finish_reason "error" (a value
    OpenAI never sends; typed clients reject it) before its error event. Now only the error event, then [DONE], as
    vLLM ends such a stream."""
    eos = 0  # the World vocabulary's
    body = {"prompt": "x", "max_tokens": 5, "n": 2, "stream": True, "allowed_token_ids": [eos], "min_tokens": 2}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["error"]["code"] == "no_token_left", chunks
    assert not any(c["finish_reason"] == "error" for x in chunks[:-1] for c in x.get("choices", [])), chunks


def test_stop_reason_says_which_stop_ended_a_choice(client, server, world_pth):
    """vLLM's `stop_reason` (it had no field here): the request's stop string or stop_token_ids id that ended a
    choice, null for the model's end of sequence, a length finish, and the stops the server adds itself (a chat
    template's end of turn). Blocking and streamed alike."""
    base = {"model": server.ctx.model_name, "prompt": "ROMEO:", "max_tokens": 12, "temperature": 0,
            "extra_body": {"return_token_ids": True, "ignore_eos": True}}  # fmt: skip
    free = client.completions.create(**base).choices[0]
    assert free.finish_reason == "length" and free.model_extra["stop_reason"] is None
    word = next(ch for ch in free.text[2:] if not ch.isspace())  # a character the answer has after its start
    by_string = client.completions.create(**base, stop=[word]).choices[0]
    assert (by_string.finish_reason, by_string.model_extra["stop_reason"]) == ("stop", word)
    tok = free.model_extra["token_ids"][3]
    by_id = client.completions.create(**{**base, "extra_body": {**base["extra_body"], "stop_token_ids": [tok]}})
    assert (by_id.choices[0].finish_reason, by_id.choices[0].model_extra["stop_reason"]) == ("stop", tok)
    ends = [c for chunk in client.completions.create(**base, stop=[word], stream=True) for c in chunk.choices
            if c.finish_reason]  # fmt: skip
    assert [(c.finish_reason, c.model_extra["stop_reason"]) for c in ends] == [("stop", word)]
    from wkvm.server import generation as gen
    from wkvm.server.schemas import ChatRequest

    body = ChatRequest(messages=[{"role": "user", "content": "Speak."}], stop=[word])
    # the World template's "\n\nUser:" is a stop the server adds: vLLM reads a template's end of turn as EOS
    assert gen.stop_reason(server.ctx, body, "\n\nUser:") is None and gen.stop_reason(server.ctx, body, word) == word
    assert gen.stop_reason(server.ctx, body, tok) is None  # a stop token the request did not ask for
    llm = LLM(str(world_pth))
    out = llm.generate("ROMEO:", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[word]))[0]
    assert (out.finish_reason, out.stop_reason, out.text) == ("stop", word, by_string.text)
    # LLM.chat: the template's stop string ends the answer but is not the caller's: None, as the server answers
    # (review: it had been reported); the caller's own stop is
    messages = [{"role": "user", "content": "Speak."}]
    free = llm.chat(messages, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    mark = next(ch for ch in free.text[1:] if not ch.isspace())
    llm.template = dataclasses.replace(llm.template, stop=[mark])
    ended = llm.chat(messages, SamplingParams(max_tokens=12, temperature=0))[0]
    assert (ended.finish_reason, ended.stop_reason) == ("stop", None)
    mine = llm.chat(messages, SamplingParams(max_tokens=12, temperature=0, stop=[mark]))[0]
    assert (mine.finish_reason, mine.stop_reason) == ("stop", mark)


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(client, server):
    """vLLM's return_tokens_as_token_ids (ignored with a log line until session 39): every logprob token, chosen or
    top, is `token_id:N` (chat: its bytes are that text's), echo's prompt tokens too; the numbers are unchanged."""
    name = server.ctx.model_name
    kw = {"model": name, "prompt": "ROMEO:", "max_tokens": 4, "temperature": 0, "logprobs": 2, "echo": True}
    plain = client.completions.create(**kw, extra_body={"return_token_ids": True}).choices[0]
    ids = client.completions.create(**kw, extra_body={"return_tokens_as_token_ids": True}).choices[0]
    prompt_ids = server.ctx.tokenizer.encode_prompt("ROMEO:")
    assert ids.logprobs.tokens == [f"token_id:{t}" for t in prompt_ids + plain.model_extra["token_ids"]]
    assert ids.logprobs.token_logprobs == plain.logprobs.token_logprobs
    assert all(all(k.startswith("token_id:") for k in top) for top in ids.logprobs.top_logprobs[1:])
    chat = {"model": name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0,
            "logprobs": True, "top_logprobs": 2}  # fmt: skip
    streamed = [c for chunk in client.chat.completions.create(**chat, stream=True, extra_body={
        "return_tokens_as_token_ids": True, "return_token_ids": True}) for c in chunk.choices]  # fmt: skip
    content = [e for c in streamed if c.logprobs for e in c.logprobs.content]
    tokens = [t for c in streamed for t in c.model_extra.get("token_ids") or []]
    assert [e.token for e in content] == [f"token_id:{t}" for t in tokens]
    assert all(bytes(e.bytes).decode() == e.token and e.top_logprobs[0].token.startswith("token_id:") for e in content)


def test_continuous_usage_stats_give_every_chunk_its_choice_s_usage_so_far(server):
    """vLLM's `stream_options.continuous_usage_stats` (with include_usage): each chunk's usage is its choice's tokens
    so far (the role chunk's 0), chat and completions, n = 2; the last usage chunk is the whole request's as before.
    Without it, chunks' usage stays null (OpenAI's)."""
    import httpx

    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
                       ("/v1/completions", {"prompt": "Romeo:"})):  # fmt: skip
        for continuous in (True, False):
            req = {**body, "max_tokens": 9, "n": 2, "temperature": 1.0, "seed": 3, "ignore_eos": True, "stream": True,
                   "return_token_ids": True,
                   "stream_options": {"include_usage": True, "continuous_usage_stats": continuous}}  # fmt: skip
            with httpx.stream("POST", f"{server.url}{path}", json=req, timeout=60) as r:
                chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
            *parts, last = chunks
            assert last["choices"] == [] and last["usage"]["completion_tokens"] == 18
            seen = {0: 0, 1: 0}
            for c in parts:
                (choice,) = c["choices"]
                seen[choice["index"]] += len(choice.get("token_ids") or [])
                if not continuous:
                    assert c["usage"] is None
                    continue
                p = c["usage"]["prompt_tokens"]
                assert c["usage"] == {"prompt_tokens": p, "completion_tokens": seen[choice["index"]],
                                      "total_tokens": p + seen[choice["index"]]}, (path, c)  # fmt: skip
            assert seen == {0: 9, 1: 9}
