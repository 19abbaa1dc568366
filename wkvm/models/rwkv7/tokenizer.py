"""The RWKV World tokenizer (vocab rwkv_vocab_v20230424): the default for RWKV checkpoints without tokenizer.json."""

from __future__ import annotations

import ast
import os
from functools import cached_property
from pathlib import Path

import pyrwkv_tokenizer


class WorldTokenizer:
    """Encoding by the maintained Rust wheel; decoding from the vocab's byte table, so partial UTF-8 is exact."""

    eos_token_id = 0
    exact_bytes = True

    bos_token = None
    bos_token_id = None
    add_bos = False
    eos_token = None  # token 0 has no text

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset({self.eos_token_id})

    def encode_prompt(self, text: str) -> list[int]:
        return self.encode(text)  # RWKV has no BOS
    special_ids: frozenset[int] = frozenset()  # token 0 (end of text) has no bytes

    def __init__(self, vocab_file: str | os.PathLike[str] | None = None):
        default = Path(pyrwkv_tokenizer.__file__).with_name("rwkv_vocab_v20230424.txt")
        self.vocab_file = Path(vocab_file or default)
        self._rust = pyrwkv_tokenizer.WorldTokenizer(str(self.vocab_file))

    @cached_property
    def _bytes(self) -> dict[int, bytes]:
        """Token id -> bytes, from the vocab file's Python literals: a quoted string without a backslash or its own
        quote inside is its text (most of the 65,529 lines; 72 vs 330 ms for all through `ast.literal_eval`)."""
        table: dict[int, bytes] = {}
        for line in self.vocab_file.read_text(encoding="utf-8").splitlines():
            idx, rest = line.split(" ", 1)
            literal, length = rest.rsplit(" ", 1)
            q = literal[0]
            plain = q in "'\"" and len(literal) >= 2 and literal[-1] == q and "\\" not in literal
            value = literal[1:-1] if plain and q not in literal[1:-1] else ast.literal_eval(literal)
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
