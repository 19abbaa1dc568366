"""Tokenizers: the RWKV World tokenizer (vocab rwkv_vocab_v20230424) and HF `tokenizers` files."""

from __future__ import annotations

import ast
import os
from functools import cached_property
from pathlib import Path
from typing import Protocol

import pyrwkv_tokenizer

from wkvm.atomic import atomic_write_bytes


class Tokenizer(Protocol):
    vocab_size: int
    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...


class WorldTokenizer:
    """Encoding by the maintained Rust wheel; decoding from the vocab's byte table, so partial UTF-8 is exact."""

    eos_token_id = 0

    def __init__(self, vocab_file: str | os.PathLike | None = None):
        default = Path(pyrwkv_tokenizer.__file__).with_name("rwkv_vocab_v20230424.txt")
        self.vocab_file = Path(vocab_file or default)
        self._rust = pyrwkv_tokenizer.WorldTokenizer(str(self.vocab_file))

    @cached_property
    def _bytes(self) -> dict[int, bytes]:
        table: dict[int, bytes] = {}
        for line in self.vocab_file.read_text(encoding="utf-8").splitlines():
            idx, rest = line.split(" ", 1)
            literal, length = rest.rsplit(" ", 1)
            value = ast.literal_eval(literal)
            b = value.encode("utf-8") if isinstance(value, str) else value
            if len(b) != int(length):
                raise ValueError(f"{self.vocab_file}: token {idx} has {len(b)} bytes, file says {length}")
            table[int(idx)] = b
        return table

    @property
    def vocab_size(self) -> int:
        return max(self._bytes) + 1

    def encode(self, text: str) -> list[int]:
        return list(self._rust.encode(text))

    def token_bytes(self, token_id: int) -> bytes:
        return self._bytes.get(token_id, b"")

    def decode_bytes(self, ids: list[int]) -> bytes:
        return b"".join(self.token_bytes(i) for i in ids)

    def decode(self, ids: list[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizer.json` read by HF `tokenizers`."""

    def __init__(self, path: str | os.PathLike, eos_token: str | None = None):
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


def load_tokenizer(model_path: str | os.PathLike) -> Tokenizer:
    """`tokenizer.json` in a model directory (or `NAME.tokenizer.json` beside `NAME.pth`), else RWKV World."""
    p = Path(model_path)
    candidates = [p / "tokenizer.json"] if p.is_dir() else [p.with_suffix(".tokenizer.json")]
    for candidate in candidates:
        if candidate.is_file():
            return HFTokenizer(candidate)
    return WorldTokenizer()


COMPANIONS = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json")


def companion_path(model_path: str | os.PathLike, name: str) -> Path:
    """Where a model keeps its companion file `name`: inside a directory (HF, pack), or `NAME.<name>` beside a
    `.pth` (only the tokenizer and chat template files have that form)."""
    p = Path(model_path)
    return p / name if p.is_dir() or not p.suffix else p.with_name(f"{p.stem}.{name}")


def copy_companions(src: str | os.PathLike, dst: str | os.PathLike) -> list[str]:
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
