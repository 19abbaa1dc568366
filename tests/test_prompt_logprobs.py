"""`echo` and prompt logprobs on /v1/completions (what lm-eval's `local-completions` scores with), and
`SamplingParams.prompt_logprobs` in Python: the prompt tokens' logprobs come from the forward that prefills the
prompt, equal BlinkDL's `rwkv` package on the embedded RWKV-7 model, and stay exact across chunks, batches, n > 1,
streaming and stored checkpoints (a scored prompt never resumes from one)."""

from __future__ import annotations

import json
import uuid
from dataclasses import replace

import httpx
import pytest
import torch
from conftest import reference_model
from live_server import LiveServer

from wkvm import LLM, SamplingParams
from wkvm.cli import EMBEDDED_MODEL
from wkvm.models.rwkv7.checkpoint import convert

TOL = 1e-4  # invariant 1: fp32 CPU within 1e-4 of the rwkv package
PROMPT = "ROMEO:\nBut, soft! what light through yonder window breaks?\nIt is the east, and Juliet is the sun."


@pytest.fixture(scope="module")
def server(one_thread):
    # small prefill chunks: a prompt is scored across several steps
    with LiveServer(model=str(EMBEDDED_MODEL), slots=4, prefill_chunk=8) as s:
        yield s


@pytest.fixture(scope="module")
def rwkv_logprobs(tmp_path_factory):
    """Prompt token ids -> the rwkv package's logprob of each token after the first, and the top-1 logprob there."""
    pth = tmp_path_factory.mktemp("embedded") / "model.pth"
    convert(EMBEDDED_MODEL, pth)
    ref = reference_model(pth)

    def score(ids: list[int]) -> tuple[list[float], list[float]]:
        logits, _ = ref.forward(ids, None, full_output=True)
        lp = torch.log_softmax(logits.float(), -1)[:-1]
        return lp.gather(-1, torch.tensor(ids[1:]).unsqueeze(-1))[:, 0].tolist(), lp.max(-1).values.tolist()

    return score


def complete(server, **body) -> dict:
    r = httpx.post(f"{server.url}/v1/completions", json={"user": uuid.uuid4().hex, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_echo_scores_the_prompt_like_the_rwkv_package(server, rwkv_logprobs):
    r = complete(server, prompt=PROMPT, echo=True, logprobs=3, max_tokens=0, return_token_ids=True)
    (c,) = r["choices"]
    ids = r["prompt_token_ids"]
    assert c["text"] == PROMPT and c["finish_reason"] == "length" and c["token_ids"] == []
    assert r["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids),
                          "prompt_tokens_details": {"cached_tokens": 0}}  # fmt: skip
    lp = c["logprobs"]
    assert "".join(lp["tokens"]) == PROMPT and len(lp["tokens"]) == len(ids) > 2 * 8
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # nothing precedes the first token
    theirs, their_top = rwkv_logprobs(ids)
    assert max(abs(a - b) for a, b in zip(lp["token_logprobs"][1:], theirs, strict=True)) < TOL
    # the top 3, and the prompt's own token beside them where it is not among them (OpenAI's "up to logprobs + 1")
    tops = list(zip(lp["top_logprobs"][1:], lp["tokens"][1:], strict=True))
    assert all(tok in t and (len(t) == 3 or (len(t) == 4 and t[tok] == min(t.values()))) for t, tok in tops)
    assert max(abs(max(t.values()) - b) for t, b in zip(lp["top_logprobs"][1:], their_top, strict=True)) < TOL
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(ids))]


def test_echo_puts_the_prompt_before_the_completion(server):
    body = dict(prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2, ignore_eos=True)
    plain = complete(server, **body)["choices"][0]
    (c,) = complete(server, echo=True, **body)["choices"]
    scored = complete(server, prompt=PROMPT, echo=True, logprobs=2, max_tokens=0)["choices"][0]["logprobs"]
    assert c["text"] == PROMPT + plain["text"]
    lp, n = c["logprobs"], len(scored["tokens"])
    assert lp["tokens"] == scored["tokens"] + plain["logprobs"]["tokens"]
    assert lp["token_logprobs"][n:] == pytest.approx(plain["logprobs"]["token_logprobs"], abs=1e-5)
    assert lp["token_logprobs"][1:n] == pytest.approx(scored["token_logprobs"][1:], abs=1e-5)
    assert lp["text_offset"][:n] == scored["text_offset"]
    assert lp["text_offset"][n:] == [len(PROMPT) + o for o in plain["logprobs"]["text_offset"]]
    assert len(lp["top_logprobs"]) == len(lp["tokens"])


def test_a_scored_prompt_never_resumes_from_a_checkpoint(server):
    kw = dict(prompt=PROMPT, max_tokens=2, temperature=0, user=uuid.uuid4().hex)
    first = complete(server, echo=True, logprobs=1, **kw)
    for _ in range(2):  # a plain request stores a checkpoint; the second one resumes from it
        resumed = complete(server, **kw)
    assert resumed["wkvm"]["mode"] == "checkpoint"
    again = complete(server, echo=True, logprobs=1, **kw)
    assert again["wkvm"] == {"mode": "fresh", "reused_tokens": 0, "restart_reason": None}
    assert again["choices"][0]["logprobs"] == first["choices"][0]["logprobs"]


def test_streamed_echo_equals_the_blocking_one(server):
    body = dict(prompt=PROMPT, max_tokens=5, temperature=0, logprobs=1, echo=True, ignore_eos=True)
    want = complete(server, **body)["choices"][0]
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    choices = [ch["choices"][0] for ch in chunks]
    assert choices[-1] == {"index": 0, "text": "", "finish_reason": "length", "logprobs": None,
                           "stop_reason": None}  # OpenAI's end chunk, with vLLM's stop_reason
    choices = choices[:-1]
    assert choices[0]["text"].startswith(PROMPT) and len(choices) == 5
    assert "".join(c["text"] for c in choices) == want["text"]
    for key in ("tokens", "text_offset"):
        assert [x for c in choices for x in c["logprobs"][key]] == want["logprobs"][key]
    got = [x for c in choices for x in c["logprobs"]["token_logprobs"]]
    assert got[0] is None and got[1:] == pytest.approx(want["logprobs"]["token_logprobs"][1:], abs=1e-5)


def test_streamed_offsets_equal_the_blocking_ones_when_a_stop_spans_tokens(server):
    """A stop string that starts in one token and ends in the next holds text back: the stream's text_offset had
    counted the text sent (the tokens after the held text pointed at its start), the blocking answer the tokens' own
    text (hunt 8). Both now give each token's offset in the tokens' text."""
    body = dict(prompt=PROMPT, max_tokens=10, temperature=0, logprobs=0, ignore_eos=True)
    tokens = complete(server, **body)["choices"][0]["logprobs"]["tokens"]
    text = "".join(tokens)
    for j in range(1, len(tokens) - 2):  # the first boundary where a 2-character stop first appears across it
        at = len("".join(tokens[: j + 1]))
        stop = text[at - 1 : at + 1]
        if tokens[j] and tokens[j + 1] and text.find(stop) == at - 1:
            break
    else:
        pytest.fail(f"no token boundary to put a stop across in {tokens!r}")
    want = complete(server, **body, stop=[stop])["choices"][0]
    assert want["finish_reason"] == "stop" and want["text"] == text[: at - 1]
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stop": [stop], "stream": True},
                      timeout=60) as r:  # fmt: skip
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    lps = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
    assert [x for lp in lps for x in lp["text_offset"]] == want["logprobs"]["text_offset"]
    assert want["logprobs"]["text_offset"][-1] == at  # the token that completes the stop starts after its first part


def test_lm_eval_batch_of_token_prompts(server):
    """lm-eval's loglikelihood request: token-id prompts in one list, echo, logprobs 1, max_tokens 1, and n = 2."""
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [40, 41, 42], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 99]]
    r = complete(server, prompt=prompts, echo=True, logprobs=1, max_tokens=1, temperature=0, n=2)
    assert len(r["choices"]) == 6
    for i, c in enumerate(r["choices"]):
        ids = prompts[i // 2]
        alone = complete(server, prompt=ids, echo=True, logprobs=1, max_tokens=0)["choices"][0]["logprobs"]
        lp = c["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) + 1 and lp["token_logprobs"][0] is None
        assert lp["token_logprobs"][1 : len(ids)] == pytest.approx(alone["token_logprobs"][1:], abs=1e-5)
        assert lp["tokens"][: len(ids)] == alone["tokens"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 0, "echo": True, "save_state": "s"}, "save_state"),
        ({"prompt": "x", "echo": True, "logprobs": 1, "state": "s"}, "state"),
        ({"prompt": "x", "max_tokens": -1, "echo": True}, "max_tokens"),
    ],
)
def test_echo_errors_name_the_field(server, body, param):
    r = httpx.post(f"{server.url}/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_python_api_prompt_logprobs(one_thread):
    llm = LLM(EMBEDDED_MODEL, prefill_chunk=5)
    ids = llm.encode_prompt(PROMPT)
    logits, _ = llm.model.prefill(ids, all_logits=True)
    want = torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(ids[1:]).unsqueeze(-1))[:, 0].tolist()
    greedy = SamplingParams(max_tokens=4, temperature=0)
    plain = llm.generate(ids[:9], greedy)[0]
    # scored alone (nothing generated), and batched with a request that scores and generates
    score_only, score_and_generate = SamplingParams(max_tokens=0, prompt_logprobs=1), replace(greedy, prompt_logprobs=0)
    scored, both = llm.generate([ids, ids[:9]], [score_only, score_and_generate])
    assert scored.token_ids == [] and scored.finish_reason == "length" and scored.prompt_logprobs is not None
    assert scored.prompt_logprobs[0] is None and len(scored.prompt_logprobs) == len(ids)
    got = [d[t] for d, t in zip(scored.prompt_logprobs[1:], ids[1:], strict=True)]
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-5
    assert all(t in d and len(d) <= 2 for d, t in zip(scored.prompt_logprobs[1:], ids[1:], strict=True))
    assert both.token_ids == plain.token_ids and plain.prompt_logprobs is None  # scoring changes no token
    assert [list(d) for d in both.prompt_logprobs[1:]] == [[t] for t in ids[1:9]]  # k = 0: its own token only


def test_a_scored_prompt_leaves_no_wrong_checkpoint(server):
    """max_tokens 0 feeds the whole prompt and samples nothing: its final state has no pending token, so it must not
    become a checkpoint of its prompt (a later request would resume one token ahead)."""
    kw = dict(prompt=PROMPT, temperature=0, ignore_eos=True, user=uuid.uuid4().hex)
    for _ in range(2):
        complete(server, echo=True, max_tokens=0, **kw)
    after = complete(server, max_tokens=8, **kw)
    fresh = complete(server, max_tokens=8, **{**kw, "user": uuid.uuid4().hex})
    assert after["choices"][0]["text"] == fresh["choices"][0]["text"]
    assert fresh["wkvm"]["mode"] == "fresh"
