"""/v1/embeddings on tiny random sentence-transformers models built here (runs everywhere; tests/test_embeddings.py
runs all-MiniLM-L6-v2 where `make minilm` could fetch it): vectors equal the model's own `encode` with a default
prompt and with a token added above the tokenizer's vocab_size; a burst of embedding requests holds no thread other
routes need; /version answers on an embeddings-only server; a model wkvm cannot run is refused at load, saying why."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from live_server import LiveServer, until

pytest.importorskip("sentence_transformers")

WORDS = ["a", "man", "is", "eating", "food", "the", "stock", "market", "fell", "sharply", "today", "hello", "world"]


def tiny_model(path: Path, eos: bool = False, prompt: str | None = None) -> Path:
    """A 2-layer random BERT with mean pooling and normalisation, in sentence-transformers' format; `eos`: its
    tokenizer appends an added token whose id is past the tokenizer's vocab_size (as Qwen3-Embedding's does);
    `prompt`: config_sentence_transformers.json's default prompt."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *sorted(set(WORDS)), *"abcdefghijklmnopqrstuvwxyz.,!?"]
    tk = Tokenizer(models.WordPiece({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
    tk.normalizer = normalizers.BertNormalizer(lowercase=True)
    tk.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tk.decoder = decoders.WordPiece()
    extra = ["[EOS]"] if eos else []
    tk.add_special_tokens(extra)
    tail = " [EOS]" if eos else ""
    tk.post_processor = processors.TemplateProcessing(
        single=f"[CLS] $A [SEP]{tail}", special_tokens=[("[CLS]", 2), ("[SEP]", 3), *((t, len(vocab)) for t in extra)])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                  sep_token="[SEP]", mask_token="[MASK]", model_max_length=64)  # fmt: skip
    path.mkdir(parents=True)
    tok.save_pretrained(path)
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=len(vocab) + len(extra), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=64)  # fmt: skip
    BertModel(cfg).save_pretrained(path)
    t = Transformer(str(path), max_seq_length=32)
    st = SentenceTransformer(modules=[t, Pooling(t.get_embedding_dimension(), pooling_mode="mean"), Normalize()])
    if prompt is not None:
        st.prompts, st.default_prompt_name = {"query": prompt, "document": ""}, "query"
    st.save(str(path))
    return path


def encoded(path: Path, texts: list[str]) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(path), local_files_only=True).encode(texts, convert_to_tensor=True).float()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("embedders")
    return {"plain": tiny_model(root / "plain"), "eos": tiny_model(root / "eos", eos=True),
            "prompt": tiny_model(root / "prompt", prompt="the ")}  # fmt: skip


@pytest.mark.parametrize("kind", ["plain", "eos", "prompt"])
def test_vectors_equal_the_models_own_encode(models, kind):
    """`eos`: its tokenizer's vocab_size leaves the appended token out, and every text had been refused (token id
    outside the vocabulary); `prompt`: the default prompt had been left out (vectors off by ~0.1)."""
    texts = ["hello world", "a man is eating food.", "the stock market fell sharply today"]
    with LiveServer(model="none", embeddings=str(models[kind])) as s:
        r = httpx.post(f"{s.url}/v1/embeddings", json={"input": texts}, timeout=60)
        assert r.status_code == 200, r.text
        got = torch.tensor([d["embedding"] for d in r.json()["data"]])
        version = httpx.get(f"{s.url}/version")  # an embeddings-only server had answered 404
        assert version.status_code == 200 and version.json()["embeddings"] == kind, version.text
    torch.testing.assert_close(got, encoded(models[kind], texts), atol=1e-6, rtol=0)
    if kind == "prompt":
        config = json.loads((models[kind] / "config_sentence_transformers.json").read_text())
        assert config["default_prompt_name"] == "query"


def test_waiting_embedding_requests_hold_no_thread_other_routes_need(models, monkeypatch):
    """Each waiting embedding request had held one of the shared pool's 40 threads: a burst held /health (a plain
    `def` route, run in that pool) behind the whole burst. Here the model is held until /health has answered: before,
    /health could not answer until it was let go."""
    from wkvm.embeddings import EmbeddingModel

    release, started = threading.Event(), threading.Event()
    original = EmbeddingModel.embed

    def held(self, inputs, prompted=False, stop=None):
        started.set()
        release.wait(60)
        return original(self, inputs, prompted, stop)

    monkeypatch.setattr(EmbeddingModel, "embed", held)
    with LiveServer(model="none", embeddings=str(models["plain"])) as s, ThreadPoolExecutor(60) as pool:
        answers = [pool.submit(httpx.post, f"{s.url}/v1/embeddings", json={"input": "hello"}, timeout=120)
                   for _ in range(60)]  # fmt: skip
        assert started.wait(30)
        try:
            health = httpx.get(f"{s.url}/health", timeout=20)
        finally:
            release.set()
        assert health.status_code == 200
        assert all(a.result().status_code == 200 for a in answers)


def test_an_abandoned_request_is_never_computed_and_the_queue_is_bounded(models, monkeypatch):
    """Review, session 38: a request whose client had left was still computed (12 abandoned batches held a one-word
    request 96 s), and the model's queue had no bound. Now a queued request whose client leaves never runs, and
    past --max-queue waiting requests the answer is a 429. --served-model-name names an embeddings-only server's
    model (it had named only /health's: requests naming it were 404s), and /v1/models/ is a 404 there (a 500)."""
    from wkvm.embeddings import EmbeddingModel

    release, started, ran = threading.Event(), threading.Event(), []
    original = EmbeddingModel.embed

    def held(self, inputs, prompted=False, stop=None):
        ran.append(inputs)
        started.set()
        release.wait(60)
        return original(self, inputs, prompted, stop)

    monkeypatch.setattr(EmbeddingModel, "embed", held)
    name = "text-embedding-3-small"
    with LiveServer(model="none", embeddings=str(models["plain"]), max_queue=2, served_model_name=name) as s, \
            ThreadPoolExecutor(2) as pool:  # fmt: skip
        url, body = f"{s.url}/v1/embeddings", {"input": "hello", "model": name}
        first = pool.submit(httpx.post, url, json=body, timeout=60)
        assert started.wait(30)
        with pytest.raises(httpx.ReadTimeout):  # queued behind the first, then abandoned
            httpx.post(url, json={"input": "a man"}, timeout=0.5)
        waiting = lambda n: until(lambda: s.ctx.embedder.waiting == n)  # noqa: E731
        assert waiting(1)  # the abandoned one left the queue (the route polls its client every 0.2 s)
        second = pool.submit(httpx.post, url, json={"input": "world"}, timeout=60)
        assert waiting(2)
        full = httpx.post(url, json={"input": "food"}, timeout=10)
        release.set()
        assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full", full.text
        assert first.result().status_code == 200 and second.result().status_code == 200
        assert len(ran) == 2  # the abandoned one never ran
        assert [m["id"] for m in httpx.get(f"{s.url}/v1/models").json()["data"]] == [name]
        card = httpx.get(f"{s.url}/v1/models/{name}").json()
        assert card["dimensions"] == 32 and card["max_model_len"] == 32, card  # as /tokenize says (session 47)
        for missing in ("", "other"):
            r = httpx.get(f"{s.url}/v1/models/{missing}")
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text


def test_tokenize_answers_for_the_embedding_model(models):
    """As vLLM's for a pooling model: /tokenize gives the ids /v1/embeddings embeds (the default prompt and special
    tokens included; usage counts them), /detokenize reads them back; on an embeddings-only server both had been
    404s, and beside a generative model a request naming the embedding model was a 404."""
    from wkvm.config import default_model
    from wkvm.embeddings import EmbeddingModel

    want = EmbeddingModel(models["prompt"]).token_ids("hello world")
    with LiveServer(model="none", embeddings=str(models["prompt"])) as alone, \
            LiveServer(model=str(default_model()), embeddings=str(models["prompt"])) as both:  # fmt: skip
        for s, named in ((alone, {}), (both, {"model": "prompt"})):
            r = httpx.post(f"{s.url}/tokenize", json={"prompt": "hello world", **named}, timeout=30).json()
            assert r["tokens"] == want and r["count"] == len(want) and r["max_model_len"] == 32, r
            used = httpx.post(f"{s.url}/v1/embeddings", json={"input": "hello world"}, timeout=30).json()["usage"]
            assert used["prompt_tokens"] == len(want)
            text = httpx.post(f"{s.url}/detokenize", json={"tokens": want, **named}, timeout=30).json()["prompt"]
            assert "hello world" in text, text
            r = httpx.post(f"{s.url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}], **named})
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
            if named:  # neither: "prompt", not "not chat messages" (hunt, session 47)
                r = httpx.post(f"{s.url}/tokenize", json=named)
                assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        generative = httpx.post(f"{both.url}/tokenize", json={"prompt": "hello world"}, timeout=30).json()
        assert generative["tokens"] != want  # without the name: the generative model's, as before


def test_a_model_whose_first_module_takes_no_token_ids_is_refused_at_load(models, tmp_path):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import StaticEmbedding
    from tokenizers import Tokenizer

    from wkvm.embeddings import EmbeddingModel

    tk = Tokenizer.from_file(str(models["plain"] / "tokenizer.json"))
    SentenceTransformer(modules=[StaticEmbedding(tk, embedding_dim=8)]).save(str(tmp_path / "static"))
    with pytest.raises(ValueError, match="first module is StaticEmbedding"):  # it had been an OverflowError
        EmbeddingModel(tmp_path / "static")
