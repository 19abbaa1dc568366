"""Prompt-lookup drafts for speculative decoding (vLLM's `ngram` method, llama.cpp's lookup decoding).

A decoding request's last `n` tokens (n from `max_n` down to `min_n`) are looked up in everything before them (the
state's earlier turns, the prompt, the output so far); where they occurred before, the tokens that followed that
occurrence are the draft. The model then checks the draft in one chunk (`ModelRunner`), and the reply is the one it
would have given without drafts (docs/speculative.md).

The index maps each n-gram to where it last ended, so a lookup is one dict read whatever the history's length, and a
token costs one insert per n.
"""

from __future__ import annotations


class NgramDrafter:
    """One request's n-gram index over its history, grown as the history grows."""

    def __init__(self, min_n: int, max_n: int):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"prompt lookup needs 1 <= min ({min_n}) <= max ({max_n})")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        # (n-gram) -> the index just after where it last ended, before the latest token's own n-grams were added
        self._last: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before this position are in `_last`

    def extend(self, tokens: list[int]) -> None:
        """The history's next tokens (a request's tokens only grow)."""
        self.tokens += tokens

    def propose(self, k: int) -> list[int]:
        """Up to `k` tokens that followed the longest n-gram ending the history where it last occurred before; []
        when none did."""
        end = len(self.tokens)
        # index every n-gram ending before the last token (those ending at it are the lookup's keys: they must find
        # an earlier occurrence, not themselves)
        for e in range(self._indexed, end - 1):
            for n in range(self.min_n, min(self.max_n, e + 1) + 1):
                self._last[tuple(self.tokens[e + 1 - n : e + 1])] = e + 1
        self._indexed = max(self._indexed, end - 1)
        if k < 1:
            return []
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            at = self._last.get(tuple(self.tokens[end - n :]))
            if at is not None:
                return self.tokens[at : min(at + k, end)]
        return []
