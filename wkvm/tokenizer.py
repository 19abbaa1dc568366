"""Tokenizers: the protocol, HF `tokenizers` files, and the companion files that travel with a model.

A model family may give a default tokenizer for checkpoints that ship none (`ModelFamily.default_tokenizer`)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from wkvm.atomic import atomic_write_bytes


class Tokenizer(Protocol):
    # read-only: a plain attribute or a property satisfies each
    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_id(self) -> int | None: ...

    @property
    def exact_bytes(self) -> bool:
        """token_bytes(i) is exactly token i's bytes (byte-level vocab): detokenize byte by byte."""
        ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...


class HFTokenizer:
    """A `tokenizer.json` read by HF `tokenizers`."""

    exact_bytes = False

    def __init__(self, path: str | os.PathLike[str], eos_token: str | None = None):
        from tokenizers import Tokenizer as _Tok

        self._tok = _Tok.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        eos = eos_token or next(
            (t for t in ("<|endoftext|>", "</s>", "<eos>", "<|eos|>") if self._tok.token_to_id(t) is not None),
            None,
        )
        self.eos_token_id = self._tok.token_to_id(eos) if eos else None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        return self.decode([token_id]).encode("utf-8")


def load_tokenizer(
    model_path: str | os.PathLike[str], default: Callable[[], Tokenizer | None] | None = None
) -> Tokenizer:
    """`tokenizer.json` in a model directory (or `NAME.tokenizer.json` beside `NAME.pth`), else the family's
    `default` tokenizer."""
    p = Path(model_path)
    candidate = p / "tokenizer.json" if p.is_dir() else p.with_suffix(".tokenizer.json")
    if candidate.is_file():
        return HFTokenizer(candidate)
    tokenizer = default() if default else None
    if tokenizer is None:
        raise ValueError(f"{model_path}: no {candidate.name} beside the model, and its family has no default "
                         "tokenizer: put the model's tokenizer.json there")  # fmt: skip
    return tokenizer


COMPANIONS = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json")


def companion_path(model_path: str | os.PathLike[str], name: str) -> Path:
    """Where a model keeps its companion file `name`: inside a directory (HF, pack), or `NAME.<name>` beside a
    `.pth` (only the tokenizer and chat template files have that form)."""
    p = Path(model_path)
    return p / name if p.is_dir() or not p.suffix else p.with_name(f"{p.stem}.{name}")


def copy_companions(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> list[str]:
    """Copy the tokenizer and chat template files that go with model `src` to converted model `dst`, so the
    converted model encodes text and formats chats the same way. Returns the names copied."""
    copied = []
    for name in COMPANIONS:
        source, target = companion_path(src, name), companion_path(dst, name)
        if name == "tokenizer_config.json" and Path(dst).suffix == ".pth":
            continue  # a .pth has no place for it (its chat template would need NAME.chat_template.jinja)
        if source.is_file():
            atomic_write_bytes(target, source.read_bytes())
            copied.append(name)
    return copied
