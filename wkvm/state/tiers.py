"""TierCache: a byte-bounded LRU of blob -> tensors (one per RAM tier of the StateStore); pinned blobs stay."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from wkvm.models.spec import State


class TierCache:
    """Byte-bounded LRU of blob -> unbatched tensors; `is_pinned` blobs are never evicted."""

    def __init__(self, limit: int, is_pinned: Callable[[str], bool]):
        self.limit = limit
        self.is_pinned = is_pinned
        self.items: OrderedDict[str, State] = OrderedDict()
        self.sizes: dict[str, int] = {}
        self.nbytes = 0

    def __contains__(self, blob: str) -> bool:
        return blob in self.items

    def get(self, blob: str) -> State | None:
        if blob in self.items:
            self.items.move_to_end(blob)
            return self.items[blob]
        return None

    def pop(self, blob: str) -> State | None:
        tensors = self.items.pop(blob, None)
        if tensors is not None:
            self.nbytes -= self.sizes.pop(blob)
        return tensors

    def put(self, blob: str, tensors: State) -> list[tuple[str, State]] | None:
        """Insert (or replace), evicting LRU unpinned entries; returns them, or None if it cannot fit (then `blob` is
        not in this tier)."""
        self.pop(blob)  # the same blob again (equal tensors): counted once
        size = nbytes(tensors)
        evictable = sum(n for b, n in self.sizes.items() if not self.is_pinned(b))
        if size > self.limit - (self.nbytes - evictable):
            return None
        evicted: list[tuple[str, State]] = []
        for b in list(self.items):
            if self.nbytes + size <= self.limit:
                break
            if not self.is_pinned(b):
                evicted.append((b, self.items[b]))
                self.pop(b)
        self.items[blob] = tensors
        self.sizes[blob] = size
        self.nbytes += size
        return evicted


def nbytes(tensors: State) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())
