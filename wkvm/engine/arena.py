"""SlotArena: every sequence's recurrent state lives in one fixed-size slot of preallocated tensors."""

from __future__ import annotations

import heapq

import torch

from wkvm.models.spec import FIXED_KINDS, State, StateSpec


class SlotArena:
    """`n_slots` usable slots plus one dummy slot (index n_slots) that may pad batches.

    Admission is exact: a request gets a slot iff one is free. Free slots are handed out lowest first, which
    keeps running sequences packed so a decode batch is often a contiguous range (a view, no copy).
    """

    def __init__(self, spec: StateSpec, n_slots: int, device: str | torch.device = "cpu"):
        if n_slots < 1:
            raise ValueError("the arena needs at least one slot")
        paged = [t.name for t in spec.tensors if t.kind not in FIXED_KINDS]
        if paged:
            raise ValueError(f"state tensors {paged[:3]} are of a paged kind (kv), which the slot arena does not "
                             "hold yet (see docs/state-file.md)")  # fmt: skip
        self.spec = spec
        self.n_slots = n_slots
        self.device = torch.device(device)
        self.tensors: State = spec.zeros(n_slots + 1, self.device)
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
        heapq.heappush(self._free, slot)

    def reset(self, slot: int) -> None:
        for t in self.tensors.values():
            t[slot].zero_()

    def copy(self, src: int, dst: int) -> None:
        """Fork: dst becomes an exact copy of src."""
        for t in self.tensors.values():
            t[dst].copy_(t[src])

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
        """A copy of one slot's state (batch dim 1), e.g. to park it in host memory."""
        return {k: t[slot : slot + 1].to(device, copy=True) for k, t in self.tensors.items()}

    def write(self, slot: int, state: State) -> None:
        self.spec.check(state)
        for k, t in self.tensors.items():
            t[slot].copy_(state[k][0])
