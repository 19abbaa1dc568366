"""Sentence embeddings for `/v1/embeddings`: a sentence-transformers model directory (e.g. all-MiniLM-L6-v2, which
`make minilm` fetches), run by sentence-transformers itself, so tokenization, pooling and normalisation are exactly
what the model's own configuration (modules.json) says. Inputs longer than the model's `max_seq_length` are refused,
not silently truncated. Loaded offline only (no hub access)."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch


class EmbeddingInputError(ValueError):
    """An input this model cannot embed (too long, token ids outside its vocabulary); the message says why."""


class EmbeddingCancelled(RuntimeError):
    """`embed` stopped between batches: its caller set the `stop` event (the client went away)."""


BATCH = 32  # inputs a forward pass (sentence-transformers' default): 2,048 of 256 tokens at once needed ~8 GiB


def check_model_dir(p: Path) -> None:
    """A ValueError unless `p` is a sentence-transformers model's directory (it has modules.json): `wkvm serve` asks
    before it binds its port."""
    if not p.is_dir():
        raise ValueError(f"{p}: not a directory (a sentence-transformers model's)")
    if not (p / "modules.json").is_file():
        raise ValueError(f"{p}: not a sentence-transformers model directory (no modules.json); e.g. `make minilm` "
                         "fetches all-MiniLM-L6-v2 into models/")  # fmt: skip


class EmbeddingModel:
    def __init__(self, path: str | os.PathLike[str], device: str = "cpu", name: str | None = None):
        """`name`: the id requests name it by (default: the directory's name)."""
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a hub: the directory is the model
        from sentence_transformers import SentenceTransformer

        p = Path(path)
        check_model_dir(p)
        self.name = name or p.resolve().name  # resolved: `--embeddings .` had been named ""
        self.model: Any = SentenceTransformer(str(p), device=device, local_files_only=True)
        first: Any = self.model[0]
        if not hasattr(first, "auto_model"):  # e.g. StaticEmbedding: no token ids in, an infinite max_seq_length
            raise ValueError(f"{p}: its first module is {type(first).__name__}; wkvm serves sentence-transformers "
                             "models whose first module is a Transformer (e.g. all-MiniLM-L6-v2)")  # fmt: skip
        self.tokenizer: Any = self.model.tokenizer
        self.dimensions = int(self.model.get_embedding_dimension() or 0)
        self.max_tokens = int(self.model.max_seq_length or 512)
        # the embedding matrix's rows: the tokenizer's vocab_size leaves out tokens added above it (Qwen3-Embedding's
        # <|endoftext|>, which its tokenizer appends to every text: each one had been refused)
        embedding = first.auto_model.get_input_embeddings()
        self.vocab_size = int(getattr(embedding, "num_embeddings", 0) or len(self.tokenizer))
        # the model's default prompt (config_sentence_transformers.json), prepended to texts as its `encode` does
        name = getattr(self.model, "default_prompt_name", None)
        self.prompt: str | None = (getattr(self.model, "prompts", None) or {}).get(name) if name else None
        self.prompt_length: int | None = None  # the prompt's tokens, for a pooling that leaves them out
        if self.prompt:
            length = getattr(first, "_get_prompt_length", None)
            self.prompt_length = int(length(self.prompt)) if length else len(self.token_ids("")) - 1
        self._lock = threading.Lock()  # one batch at a time: the model's threads are shared
        self.executor = ThreadPoolExecutor(1, "wkvm-embed")  # requests wait for it in its queue, holding no thread
        self.waiting = 0  # requests in the executor's queue or running (the server's event loop counts them)

    def token_ids(self, text: str) -> list[int]:
        """The ids the model embeds for `text`, its special tokens included."""
        ids: list[int] = self.tokenizer((self.prompt or "") + text, add_special_tokens=True)["input_ids"]
        return ids

    def check(self, inputs: list[list[int]]) -> None:
        """EmbeddingInputError for an empty input, one longer than the model takes, or an id outside its vocabulary
        (the route checks token-id inputs with it before they queue: behind a long queue their 400 had waited)."""
        for i, ids in enumerate(inputs):
            if not ids:
                raise EmbeddingInputError(f"input {i} is empty")
            if len(ids) > self.max_tokens:
                raise EmbeddingInputError(f"input {i} has {len(ids)} tokens; this embedding model takes at most "
                                          f"{self.max_tokens} (it is not truncated): split it")  # fmt: skip
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise EmbeddingInputError(f"input {i}: token id {bad} is outside the vocabulary "
                                          f"0..{self.vocab_size - 1}")  # fmt: skip

    def embed(self, inputs: list[list[int]], prompted: bool = False,
              stop: threading.Event | None = None) -> torch.Tensor:  # fmt: skip
        """Token-id inputs (special tokens included, as `token_ids` gives them; `prompted`: each starts with the
        model's prompt, as `token_ids` gives a text) -> [N, dimensions] fp32, batched; EmbeddingCancelled between
        batches once `stop` is set."""
        self.check(inputs)
        prompt_length = self.prompt_length if prompted else None
        out = []
        for i in range(0, len(inputs), BATCH):
            if stop is not None and stop.is_set():
                raise EmbeddingCancelled("stopped")
            out.append(self._forward(inputs[i : i + BATCH], prompt_length))
        return torch.cat(out)

    def _forward(self, inputs: list[list[int]], prompt_length: int | None) -> torch.Tensor:
        n = max(len(ids) for ids in inputs)
        input_ids = torch.zeros(len(inputs), n, dtype=torch.long)
        mask = torch.zeros(len(inputs), n, dtype=torch.long)
        for i, ids in enumerate(inputs):
            input_ids[i, : len(ids)] = torch.tensor(ids)
            mask[i, : len(ids)] = 1
        features = {"input_ids": input_ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(input_ids)}
        if prompt_length is not None:
            features["prompt_length"] = prompt_length  # type: ignore[assignment]  # read by a prompt-aware pooling
        with self._lock, torch.inference_mode():
            out: torch.Tensor = self.model(features)["sentence_embedding"]
        return out.float()
