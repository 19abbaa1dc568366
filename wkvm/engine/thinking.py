"""A thinking budget: at most N tokens of reasoning, then `</think>` (vLLM's `thinking_token_budget`, llama.cpp's
`--reasoning-budget`, Anthropic's `thinking.budget_tokens`).

A reply is reasoning where its prompt ends inside a think block (its last `<think>` after its last `</think>`, in
its last `SCAN` tokens: a thinking template opened it) or where it opens with `<think>` itself (after whitespace),
as the server's reasoning parser reads it (`server/reasoning.py`). Its tokens after the opening are counted; when
`budget` of them are out and the block is still open, the next tokens are the tokenizer's tokens of `</think>`,
forced (a forced token is chosen whatever the logits; its logprobs stay the model's own), and the reply goes on as
its answer. A block the model closes itself ends the count, and so does a `<tool_call>` opened inside it (Qwen3.5
calls tools from its reasoning; the server's parser then reads the call as the answer's, where tools are offered).
Where the budget runs out partway through a UTF-8 character (as llama.cpp's budget waits) or through what may be the
model's own `</think>` or `<tool_call>`, up to `WAIT` more tokens may finish it before the end is forced. Only the
first block is counted.

Everything here follows from the output's tokens: a request moved to another engine replays its output through
`feed` and is where it was (`ModelRunner.resume`), and a checked draft's positions go through the same `feed` as
stepping's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

START, END = "<think>", "</think>"
CALL = "<tool_call>"  # a call opened inside the block ends it too (Qwen3.5 does not always close it first)
_START, _END, _CALL = START.encode(), END.encode(), CALL.encode()
SCAN = 4096  # a history's last tokens read for an opened think block (`ends_inside`)
WAIT = 3  # tokens past the budget that may finish a character or the model's own `</think>` before the end is forced
_SPACE = b" \t\r\n"


def ends_inside(ids: list[int], token_bytes: Callable[[int], bytes]) -> bool:
    """Whether a token history ends inside a think block: its last `<think>` after its last `</think>`, among its
    last `SCAN` tokens (a thinking template's tag is among the very last). Read in growing windows from the end, each
    joined in one pass (a tag cut by a window's start is found by a wider one). Bounded because it runs on the
    server's event loop under the engine's lock, and a history without a tag is read to its start: all 121k SmolLM2
    tokens of Shakespeare took 34 ms joined, 66 ms token by token, the last 4,096 2 ms (AMD EPYC Zen 4)."""
    size = 64
    while True:
        size = min(size, SCAN)
        lo = max(0, len(ids) - size)
        data = b"".join(map(token_bytes, ids[lo:]))
        start, end = data.rfind(_START), data.rfind(_END)
        if start >= 0 or end >= 0:
            return start > end
        if lo == 0 or size == SCAN:
            return False
        size *= 4


def partial_end(data: bytes) -> bool:
    """Whether `data` ends with the start of `</think>` or `<tool_call>` (the model may be ending the block itself)."""
    return any(data.endswith(tag[:k]) for tag in (_END, _CALL) for k in range(1, len(tag)))


def unfinished_utf8(data: bytes) -> bool:
    """Whether `data` ends partway through a UTF-8 character (a lead byte without all its continuation bytes)."""
    for back in range(1, min(4, len(data)) + 1):
        b = data[-back]
        if b & 0xC0 == 0x80:  # a continuation byte: look further back for its lead
            continue
        need = 2 if b & 0xE0 == 0xC0 else 3 if b & 0xF0 == 0xE0 else 4 if b & 0xF8 == 0xF0 else 1
        return back < need
    return False


@dataclass
class ThinkingBudget:
    """One reply's count: `next_forced` is the token to choose next (None: the sampler chooses), `feed` each token
    the reply put out, forced or not. `phase`: "opening" (the reply may yet open a block), "counting", "forcing",
    "done" (no block, or it is closed)."""

    budget: int
    end_ids: list[int]  # the tokenizer's tokens of `</think>`
    token_bytes: Callable[[int], bytes]
    phase: str = "opening"
    count: int = 0  # tokens inside the block so far
    forced: int = 0  # of end_ids, forced so far
    seen: bytes = b""  # opening: the reply so far (whitespace left out); counting: its last bytes

    @classmethod
    def start(cls, budget: int, end_ids: list[int], token_bytes: Callable[[int], bytes],
              inside: bool) -> ThinkingBudget:  # fmt: skip
        """A reply's budget; `inside`: its prompt ends inside a think block (`ends_inside`)."""
        b = cls(budget, end_ids, token_bytes)
        if inside:
            b._count_from(b"")
        return b

    def next_forced(self) -> int | None:
        return self.end_ids[self.forced] if self.phase == "forcing" else None

    def feed(self, token: int) -> None:
        if self.phase == "forcing":
            self.forced += 1
            if self.forced == len(self.end_ids):
                self.phase = "done"
        elif self.phase == "opening":
            data = (self.seen + self.token_bytes(token)).lstrip(_SPACE)
            if data.startswith(_START):
                self._count_from(data[len(_START) :])
            elif _START.startswith(data):
                self.seen = data  # nothing yet, or the tag's first bytes
            else:
                self.phase = "done"  # the reply is all answer
        elif self.phase == "counting":
            self.count += 1
            self._read(self.seen + self.token_bytes(token))

    def _count_from(self, data: bytes) -> None:
        """The block is open; `data`: what the reply wrote in it so far (the opening token's bytes after `<think>`)."""
        self.phase, self.seen = "counting", b""
        self._read(data)

    def _read(self, data: bytes) -> None:
        if _END in data or _CALL in data:
            self.phase = "done"
            return
        keep = len(_CALL) - 1  # the longer tag's start may be at the end
        self.seen = data[len(data) - keep :] if len(data) >= keep else data
        over = self.count - self.budget
        if over >= 0 and (over >= WAIT or not (unfinished_utf8(data) or partial_end(data))):
            self.phase = "done" if not self.end_ids else "forcing"
