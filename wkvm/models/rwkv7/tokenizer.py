"""The RWKV World tokenizer (vocab rwkv_vocab_v20230424): the default for RWKV checkpoints without tokenizer.json."""

from __future__ import annotations

import codecs
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
        quote inside is its text (most of the 65,529 lines; 72 vs 330 ms for all through `ast.literal_eval`), the rest
        go through `literal_bytes`."""
        table: dict[int, bytes] = {}
        for line in self.vocab_file.read_text(encoding="utf-8").splitlines():
            idx, rest = line.split(" ", 1)
            literal, length = rest.rsplit(" ", 1)
            q = literal[0]
            plain = q in "'\"" and len(literal) >= 2 and literal[-1] == q and "\\" not in literal
            quoted = plain and q not in literal[1:-1]
            b = literal[1:-1].encode("utf-8") if quoted else literal_bytes(literal)
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


def literal_bytes(literal: str) -> bytes:
    """A vocab line's Python literal as it repr()s: a bytes literal (ASCII, backslash escapes) or a str literal (its
    characters and \\x / \\u / \\U escapes), as the bytes of its value (a str's UTF-8). Not `ast.literal_eval`:
    CPython 3.11's AST constructor keeps one recursion counter per interpreter, not per thread, and a server loading
    this table on its load thread failed once in the test suite with "SystemError: AST constructor recursion depth
    mismatch" (another thread parsing meanwhile). A str's characters past Latin-1 become escapes, so
    `unicode_escape` (which reads bytes as Latin-1) gives every character back."""
    if literal[0] == "b":
        return codecs.escape_decode(literal[2:-1].encode("ascii"))[0]
    escaped = literal[1:-1].encode("latin-1", "backslashreplace")
    return escaped.decode("unicode_escape").encode("utf-8")
