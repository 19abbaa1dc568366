"""Paged key/value caches (issue #16; docs/design-paged-kv.md): a shared pool of fixed-size pages per kv tensor,
a page table per sequence, copy-on-write forks, and `PagedKV`, the `KVBatch` an attention layer gets.

The scheduler reserves pages before each step (`SlotArena.reserve`), the runner hands each batch group a
`PagedKV` and commits it after the forward.
"""

from __future__ import annotations

import functools
import heapq
import threading
from dataclasses import dataclass, field

import torch

from wkvm.models import fused
from wkvm.models.kv import grouped_attention, key_name, rope_append_attend, value_name
from wkvm.models.spec import StateSpec


class OutOfPages(RuntimeError):
    """No free page: the scheduler preempts a sequence (parks its pages to host) and retries."""


class PagePool:
    """`n_pages` pages of `page_tokens` tokens for every kv tensor of `spec`, with reference counts."""

    def __init__(self, spec: StateSpec, n_pages: int, page_tokens: int = 16, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32):  # fmt: skip
        if n_pages < 1 or page_tokens < 1:
            raise ValueError("the KV pool needs at least one page of at least one token")
        self.page_tokens = page_tokens
        self.n_pages = n_pages
        # empty, not zeros: the OS maps a page of memory only when a token is written to it, so a large pool costs
        # what is used; nothing reads a token slot before it is written (reads stop at each sequence's length)
        self.pages = {
            t.name: torch.empty((n_pages, page_tokens, *t.shape), dtype=dtype, device=device)
            for t in spec.tensors
            if t.kind == "kv"
        }
        # what states hold (their files, parked copies, reuse checkpoints): the spec's dtype whatever the pages'
        self.state_dtypes = {t.name: t.torch_dtype for t in spec.tensors if t.kind == "kv"}
        self.refs = [0] * n_pages
        # a min-heap: the lowest free page first, so a sequence's pages ascend through memory as far as the free ones
        # allow. A stack handed a freed sequence's pages to the next one in descending order, and every other
        # request read its keys and values backwards: decode after 8,000 tokens 43-45 vs 55 tok/s (SmolLM2 int8)
        self._free = list(range(n_pages))
        self._flat: dict[str, torch.Tensor] = {}
        # the engine thread takes and returns pages; a finished request's pages come back from the thread that
        # copies them out (Engine._keep_final_state)
        self._lock = threading.Lock()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        with self._lock:
            if not self._free:
                raise OutOfPages("no free KV page")
            page = heapq.heappop(self._free)
            self.refs[page] = 1
            return page

    def retain(self, page: int) -> None:
        with self._lock:
            self.refs[page] += 1

    def release(self, page: int) -> None:
        with self._lock:
            self.refs[page] -= 1
            if self.refs[page] == 0:
                heapq.heappush(self._free, page)

    def copy_page(self, src: int) -> int:
        """A private copy of page `src` (copy-on-write)."""
        dst = self.alloc()
        for pages in self.pages.values():
            pages[dst].copy_(pages[src])
        return dst

    def flat(self, name: str) -> torch.Tensor:
        """Tensor `name`'s pages as one row per token slot: [n_pages * page_tokens, *shape] (a view made once: a decode
        step asks for two a layer)."""
        flat = self._flat.get(name)
        if flat is None:
            pages = self.pages[name]
            flat = self._flat[name] = pages.view(pages.shape[0] * pages.shape[1], *pages.shape[2:])
        return flat


@dataclass
class SeqKV:
    """One sequence's cache: its page table and how many tokens it holds."""

    pages: list[int] = field(default_factory=list)
    length: int = 0

    def reserve(self, pool: PagePool, n_new: int) -> None:
        """Make room for `n_new` more tokens: a shared, partially filled last page is copied first (only this side
        appends to it), then new pages are taken. All or nothing: raises OutOfPages having taken none."""
        P = pool.page_tokens
        need = -(-(self.length + n_new) // P) - len(self.pages)
        # the page the next token goes to (not the table's last: pages reserved past the length may follow it)
        at = self.length // P
        cow = n_new > 0 and self.length % P != 0 and at < len(self.pages) and pool.refs[self.pages[at]] > 1
        if max(need, 0) + cow > pool.num_free:
            raise OutOfPages(f"{max(need, 0) + cow} KV pages needed, {pool.num_free} free")
        if cow:
            shared = self.pages[at]
            self.pages[at] = pool.copy_page(shared)
            pool.release(shared)
        self.pages += [pool.alloc() for _ in range(need)]

    def fork(self, pool: PagePool) -> SeqKV:
        """A second sequence sharing every page that holds tokens (copy-on-write: no page is copied now). Pages
        reserved past the length (a step that raised commits none) stay this side's: shared, both sides would append
        into the same slots, which `reserve` copies only for a partially filled last page."""
        used = self.pages[: -(-self.length // pool.page_tokens)]
        for p in used:
            pool.retain(p)
        return SeqKV(list(used), self.length)

    def drop_last(self, pool: PagePool, n: int) -> None:
        """Forget the last `n` tokens (a speculative step's refused draft) and give back the pages past the new end.
        They were written this step, into pages `reserve` made this side's own, so no other sequence sees them."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot drop {n} of {self.length} tokens")
        self.length -= n
        keep = -(-self.length // pool.page_tokens)
        for p in self.pages[keep:]:
            pool.release(p)
        del self.pages[keep:]

    def free(self, pool: PagePool) -> None:
        for p in self.pages:
            pool.release(p)
        self.pages, self.length = [], 0

    def slots(self, pool: PagePool, start: int, end: int) -> torch.Tensor:
        """Flat token-slot indices of positions start..end-1 (their pages must be reserved)."""
        pos = torch.arange(start, end)
        table = torch.tensor(self.pages, dtype=torch.long)
        return table[pos // pool.page_tokens] * pool.page_tokens + pos % pool.page_tokens

    def to_dense(self, pool: PagePool) -> dict[str, torch.Tensor]:
        """The used tokens of every kv tensor, [length, *shape] (what a state file stores): whole pages copied as
        blocks, then the last one's used rows (20 -> 13.7 ms for 3.5k SmolLM2 tokens against gathering token rows, warm
        memory, Intel Xeon with AVX-512: a finished request's copy, Engine._keep_final_state)."""
        P, n = pool.page_tokens, self.length
        full = n // P
        table = torch.tensor(self.pages[:full], dtype=torch.long)
        out = {}
        for name, pages in pool.pages.items():
            dense = torch.empty((n, *pages.shape[2:]), dtype=pages.dtype, device=pages.device)
            torch.index_select(pages, 0, table.to(pages.device), out=dense[: full * P].view(full, *pages.shape[1:]))
            if n > full * P:
                dense[full * P :] = pages[self.pages[full], : n - full * P]
            out[name] = dense.to(pool.state_dtypes[name])
        return out

    @classmethod
    def from_dense(cls, pool: PagePool, dense: dict[str, torch.Tensor]) -> SeqKV:
        n = next(iter(dense.values())).shape[0] if dense else 0
        seq = cls()
        seq.reserve(pool, n)
        idx = seq.slots(pool, 0, n)
        for name, x in dense.items():
            pool.flat(name)[idx] = x.to(pool.flat(name).dtype)
        seq.length = n
        return seq


class PagedKV:
    """The `KVBatch` of B sequences feeding T new tokens each: appends go to their pages (reserved beforehand with
    `SeqKV.reserve`), attention reads each row's tokens. `commit()` after the forward advances the lengths.

    On the torch path (prefill; decode without the fused op) rows attend one at a time, each as it would alone, so a
    row's answer does not depend on its batch. A row whose pages are consecutive in the pool (the common case:
    pages are handed out lowest first) is read as a view of the pool, without a copy; otherwise its tokens are
    gathered. One new token needs no mask."""

    def __init__(self, pool: PagePool, seqs: list[SeqKV], n_new: int):
        self.pool, self.seqs, self.n_new = pool, seqs, n_new
        self._start = torch.tensor([s.length for s in seqs], dtype=torch.long)
        self._table: torch.Tensor | None = None  # [B * T, pages] for the fused kernel, made on first use
        self._lengths = self._start  # [B * T]: each fused row's cached tokens
        self._fused = False

    # what the torch path needs, made on first use (a decode step on the fused kernel needs none of it)
    @functools.cached_property
    def _write(self) -> torch.Tensor:
        """[B, T] token slots of the new tokens."""
        return torch.stack([s.slots(self.pool, s.length, s.length + self.n_new) for s in self.seqs])

    @functools.cached_property
    def _rows(self) -> list[tuple[tuple[int, int] | None, torch.Tensor | None, torch.Tensor | None]]:
        """Per row: (span, read, mask): span (first token slot, length) when its pages are consecutive, else read
        [L] token slots; mask [1, 1, T, L] (causal from the row's start), None for one new token. Rows attend one
        at a time, each exactly as it would alone: a row's answer never depends on the others in its batch."""
        rows = []
        for seq, start in zip(self.seqs, self._start.tolist(), strict=True):
            n = start + self.n_new
            span = _consecutive(seq, self.pool, n)
            read = None if span else seq.slots(self.pool, 0, n)
            mask = None
            if self.n_new > 1:
                t, j = torch.arange(self.n_new).view(1, self.n_new, 1), torch.arange(n).view(1, 1, n)
                mask = (j <= start + t).unsqueeze(1)
            rows.append((span, read, mask))
        return rows

    def positions(self) -> torch.Tensor:
        return self._start.clone()

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        for name, x in ((key_name(layer), k), (value_name(layer), v)):
            flat = self.pool.flat(name)
            flat[self._write.reshape(-1)] = x.reshape(-1, *x.shape[2:]).to(flat.dtype)

    def attend(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        kf, vf = self.pool.flat(key_name(layer)), self.pool.flat(value_name(layer))
        out = []
        for b, (span, read, mask) in enumerate(self._rows):
            k, v = (f[span[0] : span[0] + span[1]] if span else f[read] for f in (kf, vf))  # a view when consecutive
            out.append(grouped_attention(q[b : b + 1], k.unsqueeze(0), v.unsqueeze(0), mask, scale))
        return out[0] if len(out) == 1 else torch.cat(out)

    def rope_attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, scale: float, token_rows: bool = False) -> torch.Tensor:  # fmt: skip
        """New tokens on fp32 CPU pages: a decode step (one new token per row) on the fused kernel, which reads and
        writes the pages in place; several new tokens a row, with `token_rows`, each token as a row of its own on it;
        else `rope_append_attend`. (Per layer of a small model this is hot: what it needs is made once.)

        Several new tokens a row go there only when the model's layers are row-independent (`token_rows`): every key
        and value is written before any row attends and a row reads only up to its own token, so each token gets a
        one-token step's arithmetic, and a chunked prefill, a resumed prefix and stepping give the same bits (int8 /
        int4 kernels round their inputs to int8, which turned the torch path's rounding differences into other
        tokens: a resumed chat answered otherwise)."""
        if fused.cpu_fp32(q, k, v) and (self.n_new == 1 or token_rows):
            B, T = q.shape[:2]
            fq, fk, fv, fcos, fsin = (x if T == 1 else x.reshape(B * T, 1, *x.shape[2:]) for x in (q, k, v, cos, sin))
            if (pages := self.fused_pages(layer, q.shape[-1], fcos, fsin)) is not None:
                return fused.rope_attend(fq, fk, fv, fcos, fsin, *pages, scale).view(q.shape)
        return rope_append_attend(self, layer, q, k, v, cos, sin, scale)

    def fused_pages(self, layer: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> fused.Pages | None:
        """`layer`'s pools as the fused decode ops take them, with the page table and lengths of their rows (each new
        token a row: row b * T + t has row b's pages and its length before token t) and the page size; None where
        they do not run (`fused.pages_fit`, decided once a step)."""
        if self._table is None:
            self._fused = fused.pages_fit(1, head_dim, cos, sin, *self.pool.pages.values())
            width, T = max(len(s.pages) for s in self.seqs), self.n_new
            table = torch.tensor([s.pages + [0] * (width - len(s.pages)) for s in self.seqs], dtype=torch.long)
            self._table = table if T == 1 else table.repeat_interleave(T, 0)
            self._lengths = self._start if T == 1 else (self._start[:, None] + torch.arange(T)).reshape(-1)
        if not self._fused:
            return None
        pool = self.pool
        return pool.flat(key_name(layer)), pool.flat(value_name(layer)), self._table, self._lengths, pool.page_tokens

    def commit(self) -> None:
        for s in self.seqs:
            s.length += self.n_new


def _consecutive(seq: SeqKV, pool: PagePool, n: int) -> tuple[int, int] | None:
    """(first token slot, n) when the pages holding seq's first n tokens follow each other in the pool."""
    used = seq.pages[: -(-n // pool.page_tokens)]
    if used and all(b == a + 1 for a, b in zip(used, used[1:], strict=False)):
        return used[0] * pool.page_tokens, n
    return None
