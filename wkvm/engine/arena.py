"""SlotArena: every sequence's fixed-size state lives in one slot of preallocated tensors; its attention keys and
values (kind `kv`), if the model has any, in pages of a shared pool (`wkvm/engine/kv_pages.py`), one page table
per slot. Reads and writes of a slot's state carry both, the kv part as dense `[1, n, ...]` tensors."""

from __future__ import annotations

import heapq
from collections.abc import Callable

import torch

from wkvm.engine.kv_pages import PagedKV, PagePool, SeqKV
from wkvm.models.spec import State, StateSpec


class SlotArena:
    """`n_slots` usable slots plus one dummy slot (index n_slots) that may pad batches.

    Admission is exact: a request gets a slot iff one is free. Free slots are handed out lowest first, which
    keeps running sequences packed so a decode batch is often a contiguous range (a view, no copy).
    """

    def __init__(self, spec: StateSpec, n_slots: int, device: str | torch.device = "cpu", kv_pages: int = 0,
                 page_tokens: int = 16, kv_dtype: torch.dtype = torch.float32):  # fmt: skip
        if n_slots < 1:
            raise ValueError("the arena needs at least one slot")
        if spec.has_kv and kv_pages < 1:
            raise ValueError("this model has attention layers: give the KV cache some pages")
        self.spec = spec
        self.n_slots = n_slots
        self.device = torch.device(device)
        self.tensors: State = {
            t.name: torch.zeros((n_slots + 1, *t.shape), dtype=t.torch_dtype, device=self.device)
            for t in spec.tensors
            if not t.paged
        }
        self.pool = PagePool(spec, kv_pages, page_tokens, self.device, kv_dtype) if spec.has_kv else None
        self.kv: dict[int, SeqKV] = {}  # slot -> its pages (models with kv tensors only)
        # start states several waiting requests share (an n > 1 request's choices: one object), by id: the state
        # (held, so the id stays its own) and pages holding its keys and values, which each one's slot forks
        self._kept: dict[int, tuple[State, SeqKV]] = {}
        # waits until pages that finished requests' copies hold are back; True if there were any (set by the Engine)
        self.reclaim: Callable[[], bool] = lambda: False
        self._free = list(range(n_slots))
        heapq.heapify(self._free)
        self._used: set[int] = set()

    @property
    def dummy(self) -> int:
        return self.n_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        """A zeroed free slot, or None when all are taken."""
        if not self._free:
            return None
        slot = heapq.heappop(self._free)
        self._used.add(slot)
        self.reset(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise ValueError(f"slot {slot} is not allocated")
        self._used.remove(slot)
        self._drop_kv(slot)
        heapq.heappush(self._free, slot)

    def reset(self, slot: int) -> None:
        for t in self.tensors.values():
            t[slot].zero_()
        self._drop_kv(slot)

    def _drop_kv(self, slot: int) -> None:
        seq = self.kv.pop(slot, None)
        if seq is not None and self.pool is not None:
            seq.free(self.pool)

    def take(self, slot: int) -> Callable[[], State]:
        """`slot`'s state, to be copied later on any thread: its fixed tensors are copied now and its pages leave the
        arena (freeing the slot keeps them); the call returned builds the state as `read` does, then returns them."""
        fixed = {k: t[slot : slot + 1].clone() for k, t in self.tensors.items()}
        seq = self.kv.pop(slot, None) or SeqKV()

        def build() -> State:
            try:
                return self._with_kv(fixed, seq, "cpu")
            finally:
                if self.pool is not None:
                    seq.free(self.pool)

        return build

    def copy(self, src: int, dst: int) -> None:
        """Fork: dst becomes an exact copy of src (its kv pages shared copy-on-write)."""
        for t in self.tensors.values():
            t[dst].copy_(t[src])
        if self.pool is not None:
            self._drop_kv(dst)
            self.kv[dst] = self.kv.get(src, SeqKV()).fork(self.pool)

    def reserve(self, slot: int, n_new: int) -> None:
        """Room in `slot`'s pages for `n_new` more tokens (before a forward feeds them); raises OutOfPages having
        taken none. A no-op for models without kv tensors."""
        if self.pool is not None:
            self.kv.setdefault(slot, SeqKV()).reserve(self.pool, n_new)

    def fixed(self, slot: int) -> State:
        """A copy of `slot`'s fixed-size tensors (its recurrent state; no kv), to put back with `restore_fixed`."""
        return {k: t[slot].clone() for k, t in self.tensors.items()}

    def restore_fixed(self, slot: int, fixed: State) -> None:
        for k, t in self.tensors.items():
            t[slot].copy_(fixed[k])

    def drop_last(self, slot: int, n: int) -> None:
        """Forget `slot`'s last `n` keys and values (a no-op for models without kv tensors)."""
        if self.pool is not None and n:
            self.kv[slot].drop_last(self.pool, n)

    def can_start(self, state: State | None, n_new: int, keep: bool = False) -> bool:
        """Whether a new sequence starting from `state` (written with `keep`) and taking `n_new` tokens fits the free
        KV pages (always, without kv)."""
        return self.pool is None or self.pages_to_start(state, n_new, keep) <= self.pool.num_free

    def kv_batch(self, slots: list[int], n_new: int) -> PagedKV | None:
        """The attention view of `slots` feeding `n_new` tokens each (pages reserved); None without kv tensors.
        Call `commit()` on it after the forward."""
        if self.pool is None:
            return None
        return PagedKV(self.pool, [self.kv.setdefault(s, SeqKV()) for s in slots], n_new)

    def view(self, slots: list[int]) -> tuple[State, bool]:
        """The batch state for `slots`: a view when they form a contiguous range, else a gathered copy.

        Returns (state, is_view); a copy must be written back with `scatter`.
        """
        first = slots[0]
        if slots == list(range(first, first + len(slots))):
            return {k: t[first : first + len(slots)] for k, t in self.tensors.items()}, True
        idx = torch.tensor(slots, device=self.device)
        return {k: t.index_select(0, idx) for k, t in self.tensors.items()}, False

    def scatter(self, slots: list[int], state: State) -> None:
        idx = torch.tensor(slots, device=self.device)
        for k, t in self.tensors.items():
            t.index_copy_(0, idx, state[k])

    def read(self, slot: int, device: str | torch.device = "cpu") -> State:
        """A copy of one slot's state (batch dim 1), e.g. to park it in host memory; kv tensors as [1, n, ...]."""
        fixed = {k: t[slot : slot + 1].to(device, copy=True) for k, t in self.tensors.items()}
        return self._with_kv(fixed, self.kv.get(slot, SeqKV()), device)

    def _with_kv(self, fixed: State, seq: SeqKV, device: str | torch.device) -> State:
        if self.pool is not None:
            fixed.update({k: v.unsqueeze(0).to(device) for k, v in seq.to_dense(self.pool).items()})
        return fixed

    def write(self, slot: int, state: State, keep: bool = False) -> None:
        """Set one slot's state (batch dim 1); its kv tensors go into fresh pages (raises OutOfPages), or share the
        pages of the same state object written before with `keep` (copy-on-write: an n > 1 request's choices hold
        their prompt's keys and values once). `keep`: more slots will start from this state object; the last write
        without it lets the kept pages go."""
        self.spec.check(state)
        if self.pool is not None:
            kept = self._kept.get(id(state))
            if kept is not None:
                seq = kept[1].fork(self.pool)
            else:
                dense = {t.name: state[t.name][0] for t in self.spec.tensors if t.paged}
                seq = SeqKV.from_dense(self.pool, dense)  # before dropping the old pages: all or nothing
                if keep:
                    self._kept[id(state)] = (state, seq.fork(self.pool))
            if not keep:
                self.let_go(state)
            self._drop_kv(slot)
            self.kv[slot] = seq
        for k, t in self.tensors.items():
            t[slot].copy_(state[k][0])

    def let_go(self, state: State) -> None:
        """No more slot starts from `state`: the pages kept for it go (those a slot shares stay with the slot)."""
        kept = self._kept.pop(id(state), None)
        if kept is not None and self.pool is not None:
            kept[1].free(self.pool)

    def let_go_all(self) -> bool:
        """Every kept start state's pages (a cache: the waiting requests hold their states, and the next one admitted
        writes its own); True if there were any. Called when the pool is short: kept pages had pinned it while a
        parked sibling, first in line, waited for pages for good."""
        kept = list(self._kept.values())
        for state, _ in kept:
            self.let_go(state)
        return bool(kept)

    def pages_to_start(self, state: State | None, n_new: int, keep: bool = False) -> int:
        """Free pages a new sequence starting from `state` needs to take `n_new` tokens: a state written before with
        `keep` shares its pages, and one written now with `keep` shares them at once (either way, a partially filled
        last page is copied on the first append)."""
        if self.pool is None:
            return 0
        P = self.pool.page_tokens
        length = self.spec.kv_length(state) if state else 0
        copied = int(length % P != 0 and n_new > 0)
        if state is not None and id(state) in self._kept:
            return -(-(length + n_new) // P) - -(-length // P) + copied
        return -(-(length + n_new) // P) + (copied if keep else 0)
