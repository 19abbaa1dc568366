"""Incremental detokenization with stop strings that may span tokens.

Text is released only when it is complete UTF-8 and cannot be the start of a stop string.
"""

from __future__ import annotations

import codecs

from wkvm.tokenizer import Tokenizer


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: list[str] | None = None):
        self.tokenizer = tokenizer
        self.stop = list(stop or [])
        self.text = ""
        self.stopped = False
        self._released = 0
        self._ids: list[int] = []
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._bytewise = tokenizer.exact_bytes

    def add(self, token_id: int) -> bool:
        """Append one generated token; returns True when a stop string has appeared (text is cut before it)."""
        if self.stopped:
            return True
        before = len(self.text)
        if self._bytewise:
            self.text += self._utf8.decode(self.tokenizer.token_bytes(token_id))
        else:
            self._ids.append(token_id)
            full = self.tokenizer.decode(self._ids)
            self.text = full[: len(full) - 1] if full.endswith("\ufffd") else full
        if self.stop:
            start = max(0, before - max(len(s) for s in self.stop))
            hits = [i for s in self.stop if (i := self.text.find(s, start)) >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True
        return self.stopped

    def flush(self) -> None:
        """At the end of generation: release any bytes held back as incomplete."""
        if self._bytewise and not self.stopped:
            self.text += self._utf8.decode(b"", final=True)
        elif self._ids and not self.stopped:
            self.text = self.tokenizer.decode(self._ids)

    @property
    def released(self) -> str:
        """The text delta() has handed out so far."""
        return self.text[: self._released]

    def replay(self, token_ids: list[int], released: str) -> None:
        """Catch up with a generation begun elsewhere: its tokens, of which `released` was already handed out."""
        for t in token_ids:
            self.add(t)
        if not self.text.startswith(released):
            raise ValueError("the replayed tokens do not give the text already sent (another tokenizer?)")
        self._released = len(released)

    def delta(self, final: bool = False) -> str:
        """Text not yet released; holds back a possible stop-string prefix unless final."""
        end = len(self.text)
        if not final and not self.stopped and self.stop:
            hold = max(len(s) for s in self.stop) - 1
            end = max(self._released, end - hold)
        out = self.text[self._released : end]
        self._released = end
        return out
