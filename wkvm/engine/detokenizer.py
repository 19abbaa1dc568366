"""Incremental detokenization with stop strings that may span tokens.

Text is released only when it is complete UTF-8 and cannot be the start of a stop string. A byte-level tokenizer
(`exact_bytes`) is decoded token by token; any other decodes a short window of the last tokens (vLLM's incremental
detokenization): the tokens since the last text came out, after the tokens that gave that text as context, so that
a decoder which treats the start of its input specially (a SentencePiece prefix space) only does so in the context
part. Decoding the whole output every token instead cost O(n) a token (SmolLM2's tokenizer, AMD EPYC: 40 us a token
at 512 tokens, 470 us at 8,192).
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from wkvm.tokenizer import Tokenizer

CONTEXT_TOKENS = 5  # prompt tokens decoded before the first new ones (vLLM's initial incremental offset)


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: list[str] | None = None, min_tokens: int = 0,
                 include_stop: bool = False, skip: frozenset[int] = frozenset(),
                 context: Sequence[int] = ()):  # fmt: skip
        """`context`: the last tokens before the generation (the prompt's end), decoded with the first new tokens so
        that a decoder that treats the start of its input specially (SentencePiece's prefix space) does not do so to
        the first generated token: "▁Paris" after a prompt is " Paris", as llama.cpp's server and vLLM send it."""
        self.tokenizer = tokenizer
        self.skip = skip  # tokens that add no text (the special ones, under skip_special_tokens)
        self.stop = list(stop or [])
        self.include_stop = include_stop  # vLLM's include_stop_str_in_output: the text ends with the stop string
        self.min_tokens = min_tokens  # stop strings count from the token after this many (vLLM's min_tokens)
        self._added = 0
        self.text = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text (vLLM's stop_reason)
        self._released = 0
        self._ids: list[int] = []  # the window: context tokens, then tokens whose text is not out yet
        self._context = 0  # _ids[:_context] are the context, whose text (_context_text) is already in text
        self._context_text = ""
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._bytewise = tokenizer.exact_bytes
        if not self._bytewise:
            ids = list(context[-CONTEXT_TOKENS:])
            while ids and (text := tokenizer.decode(ids)).endswith("\ufffd"):  # a character cut short: not a prefix
                ids.pop()
            if ids:
                self._ids, self._context, self._context_text = ids, len(ids), text

    def add(self, token_id: int) -> bool:
        """Append one generated token; returns True when a stop string has appeared (text is cut before it)."""
        if self.stopped:
            return True
        before = len(self.text)
        self._added += 1
        if token_id in self.skip:
            pass
        elif self._bytewise:
            self.text += self._utf8.decode(self.tokenizer.token_bytes(token_id))
        else:
            self._ids.append(token_id)
            window = self.tokenizer.decode(self._ids)
            if len(window) > len(self._context_text) and not window.endswith("\ufffd"):
                self.text += window[len(self._context_text) :]
                self._ids = self._ids[self._context :]  # the new tokens are the next window's context
                self._context = len(self._ids)
                self._context_text = self.tokenizer.decode(self._ids)
        self._find_stop(before)
        return self.stopped

    def _find_stop(self, before: int) -> None:
        """Cut the text at a stop string that ends in its part from `before` on."""
        if self.stop and self._added > self.min_tokens:
            hits = [(i, -len(s), s) for s in self.stop if (i := self.text.find(s, max(0, before - len(s) + 1))) >= 0]
            if hits:
                at, minus_len, self.matched = min(hits)  # the first stop string to begin (the longest beginning there)
                self.text = self.text[: at - minus_len if self.include_stop else at]
                self.stopped = True

    def flush(self) -> None:
        """At the end of generation: release any bytes held back as incomplete, and look for a stop string in them
        (one ending in a space whose token also held a cut character's first bytes had been left in the text)."""
        if self.stopped:
            return
        before = len(self.text)
        if self._bytewise:
            self.text += self._utf8.decode(b"", final=True)
        elif len(self._ids) > self._context:  # held back: incomplete UTF-8 (as U+FFFD)
            self.text += self.tokenizer.decode(self._ids)[len(self._context_text) :]
            self._ids, self._context, self._context_text = [], 0, ""
        self._find_stop(before)

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
        """Text not yet released; unless final, holds back the end of it that begins a stop string (it may become
        one with the next tokens). Only that end: holding the longest stop string's length whatever the text (vLLM's
        way) kept a chat's text ~9 characters behind the model (`<|im_end|>`)."""
        end = len(self.text)
        if not final and not self.stopped and self.stop:
            end -= self._stop_start()
        out = self.text[self._released : end]
        self._released = end
        return out

    def _stop_start(self) -> int:
        """The length of the longest end of the unreleased text that is the start of some stop string (0: none)."""
        tail = self.text[self._released :]
        for k in range(min(len(tail), max(len(s) for s in self.stop) - 1), 0, -1):
            if any(s.startswith(tail[-k:]) for s in self.stop):
                return k
        return 0
