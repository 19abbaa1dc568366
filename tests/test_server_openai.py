"""The OpenAI-compatible API through the official `openai` SDK, against a live server on a random model."""

import json

import httpx
import openai
import pytest
from live_server import LiveServer

from wkvm import LLM, SamplingParams


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


def test_greedy_completion_equals_python_api(client, world_pth):
    r = client.completions.create(model="world", prompt="Once upon a time", max_tokens=12, temperature=0,
                                  extra_body={"return_token_ids": True, "ignore_eos": True})  # fmt: skip
    expected = LLM(model=world_pth).generate("Once upon a time", SamplingParams(max_tokens=12, temperature=0,
                                                                              ignore_eos=True))[0]  # fmt: skip
    c = r.choices[0]
    assert c.text == expected.text and c.model_extra["token_ids"] == expected.token_ids
    assert r.model_extra["prompt_token_ids"] == expected.prompt_token_ids
    assert r.usage.prompt_tokens == len(expected.prompt_token_ids) and r.usage.completion_tokens == 12
    assert r.model_extra["wkvm"]["mode"] in ("fresh", "checkpoint", "exact_prefix")


def test_token_id_prompt_and_logprobs(client):
    r = client.completions.create(model="world", prompt=[101, 202, 303], max_tokens=5, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})  # fmt: skip
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(len(t) >= 1 and max(t.values()) <= 0 for t in lp.top_logprobs)
    assert lp.text_offset[0] == 0


def test_prompt_list_reports_each_prompt(client):
    kw = dict(model="world", prompt=[[7, 8, 9, 10], [101, 202, 303]], max_tokens=4, temperature=0, n=2,
              extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
    r = client.completions.create(**kw)
    assert len(r.choices) == 4
    prompts = r.model_extra["wkvm"]["prompts"]
    assert len(prompts) == 2 and all(p["mode"] in ("fresh", "checkpoint", "exact_prefix") for p in prompts)
    assert r.model_extra["prompt_token_ids"][1] == [101, 202, 303]
    assert [c.model_extra["prompt_token_ids"] for c in r.choices][2:] == [[101, 202, 303]] * 2
    last = [c for c in client.completions.create(stream=True, **kw) if c.choices][-1]
    assert len(last.model_extra["wkvm"]["prompts"]) == 2


def test_streaming_completion_matches_blocking(client):
    kw = dict(model="world", prompt="The king", max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    blocking = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == blocking
    assert chunks[-1].usage.completion_tokens == 10
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_blocking_and_streaming(client):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    r = client.chat.completions.create(model="world", messages=msgs, max_tokens=8, temperature=0,
                                       logprobs=True, top_logprobs=2)  # fmt: skip
    msg = r.choices[0].message
    assert msg.role == "assistant" and r.choices[0].finish_reason in ("stop", "length")
    assert len(r.choices[0].logprobs.content) == r.usage.completion_tokens
    assert len(r.choices[0].logprobs.content[0].top_logprobs) == 2
    stream = client.chat.completions.create(model="world", messages=msgs, max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == msg.content


def test_n2_forks_one_prefill(client, server):
    model = server.ctx.engine.model
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
                                       tools=[{"type": "function", "function": {"name": "f"}}])  # fmt: skip
    assert e.value.body["param"] == "tools"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="world", messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:,"}}]}])  # fmt: skip
    assert "content[0]" in e.value.body["param"]
    r = httpx.post(f"{server.url}/v1/completions", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 10**6})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "stop": ["a", "b", "c", "d", "e"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
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


def test_disconnect_mid_stream_frees_slot(world_pth):
    import time

    # 16000 tokens take about a minute here: only the cancel on disconnect can free the slot before the deadline
    body = {"prompt": "Long", "max_tokens": 16000, "temperature": 0, "stream": True, "ignore_eos": True}
    with LiveServer(model=str(world_pth), slots=2) as server:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and json.loads(line[6:])["choices"]:
                    break
            assert server.ctx.engine.arena.num_free == 1
        deadline = time.monotonic() + 10
        while server.ctx.engine.arena.num_free != 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.ctx.engine.arena.num_free == 2


def test_metrics(server, client):
    client.completions.create(model="world", prompt="a", max_tokens=2)
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("wkvm_requests_total", "wkvm_prompt_tokens_total", "wkvm_generation_tokens_total",
                 "wkvm_time_to_first_token_seconds", "wkvm_inter_token_latency_seconds", "wkvm_queue_depth",
                 "wkvm_slots_free", "wkvm_slots_total", "wkvm_states", "wkvm_state_bytes",
                 "wkvm_prefix_reuse_tokens_total", "wkvm_session_restarts_total"):  # fmt: skip
        assert name in text, name
    assert 'route="/v1/completions",status="200"' in text


@pytest.mark.allows_5xx
def test_health_is_503_until_a_model_is_loaded(tmp_path):
    import time

    from fastapi.testclient import TestClient

    from wkvm.config import ServerConfig
    from wkvm.server.app import create_app

    with TestClient(create_app(ServerConfig(model=str(tmp_path / "missing.pth")))) as c:
        deadline = time.monotonic() + 10
        while c.app.state.ctx.load_error is None and time.monotonic() < deadline:
            time.sleep(0.05)
        r = c.get("/health")
        assert r.status_code == 503 and "failed to load" in r.json()["error"]["message"]
        r = c.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_load_failed"
