"""A trie over token sequences: find the longest stored checkpoint whose tokens start a new prompt.

A checkpoint's state holds all but the last (pending) of its token ids, so it serves a prompt P when its *fed*
tokens are a prefix of P and P has at least one more token; the resumed run feeds P from there. Entries are
LRU-bounded by count; the caller keeps the states themselves (in the StateStore's tiers), and bounds the tries'
nodes (a node a stored token, ~NODE_BYTES of Python heap) through the `NodeCount` they share.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

# heap per stored token: a node, its children dict, the ids in tuples (316 B: tracemalloc, 20 x 20,000 ids, Python 3.11)
NODE_BYTES = 320


@dataclass
class NodeCount:
    n: int = 0  # nodes (stored tokens) of every trie sharing this count


@dataclass
class Checkpoint:
    key: str  # what the caller stores the state under
    n_fed: int  # tokens inside the state
    kind: str  # "turn_end" (after an answer) or "prompt_end" (after a prompt)
    full_ids: tuple[int, ...]  # fed tokens plus the pending one


class _Node:
    __slots__ = ("children", "checkpoint")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.checkpoint: Checkpoint | None = None


class PrefixTrie:
    def __init__(self, capacity: int, count: NodeCount | None = None):
        self.capacity = capacity
        self.count = count if count is not None else NodeCount()  # shared with other tries
        self.nodes = 0  # this trie's own
        self.root = _Node()
        self.lru: OrderedDict[tuple[int, ...], Checkpoint] = OrderedDict()
        self.fed_of: dict[str, tuple[int, ...]] = {}  # a checkpoint's key -> its fed tokens

    def __len__(self) -> int:
        return len(self.lru)

    def insert(self, token_ids: list[int], key: str, kind: str) -> list[Checkpoint]:
        """Record a checkpoint whose history is `token_ids` (last one pending); returns evicted checkpoints."""
        fed = tuple(token_ids[:-1])
        node = self.root
        for t in fed:
            child = node.children.get(t)
            if child is None:
                child = node.children[t] = _Node()
                self._grow(1)
            node = child
        replaced = [node.checkpoint] if node.checkpoint is not None and node.checkpoint.key != key else []
        for cp in replaced:
            self.fed_of.pop(cp.key, None)
        node.checkpoint = Checkpoint(key, len(fed), kind, tuple(token_ids))
        self.lru.pop(fed, None)
        self.lru[fed] = node.checkpoint
        self.fed_of[key] = fed
        evicted = replaced
        while len(self.lru) > self.capacity:
            old_fed, _ = next(iter(self.lru.items()))
            gone = self.remove(list(old_fed))
            if gone is not None:
                evicted.append(gone)
        return evicted

    def longest(self, prompt: list[int]) -> Checkpoint | None:
        """The checkpoint with the most fed tokens that prefix `prompt`, leaving at least one token to feed."""
        node, best = self.root, None
        for t in prompt[:-1]:
            child = node.children.get(t)
            if child is None:
                break
            node = child
            if node.checkpoint is not None:
                best = node.checkpoint
        if best is not None:
            self.lru.move_to_end(tuple(prompt[: best.n_fed]))
        return best

    def branch_point(self, prompt: list[int]) -> int:
        """How many leading tokens of `prompt` (all but its last) some stored history shares, where no checkpoint
        is stored yet: the place two histories part (e.g. the end of a shared system prompt), worth a checkpoint
        of its own. 0 when there is none."""
        node, depth = self._deepest(prompt)
        return depth if node.checkpoint is None else 0

    def _deepest(self, prompt: list[int]) -> tuple[_Node, int]:
        """The deepest node the prompt's tokens (all but its last) reach, and its depth."""
        node, depth = self.root, 0
        for t in prompt[:-1]:
            child = node.children.get(t)
            if child is None:
                break
            node, depth = child, depth + 1
        return node, depth

    def longest_shared(self, prompt: list[int]) -> tuple[Checkpoint, int] | None:
        """For states that can be cut at any token (`StateSpec.cuttable`: keys and values only): a checkpoint whose
        fed tokens share the most leading tokens with `prompt` (leaving at least one to feed), and that count.
        The checkpoint's state cut to that many tokens is the state after them, whatever followed."""
        node, depth = self._deepest(prompt)
        if depth == 0:
            return None
        stack = [node]  # any checkpoint at or below the deepest shared node serves
        while stack:
            below = stack.pop()
            if below.checkpoint is not None:
                self.lru.move_to_end(below.checkpoint.full_ids[:-1])
                return below.checkpoint, depth
            stack.extend(below.children.values())
        return None

    def remove(self, fed: list[int]) -> Checkpoint | None:
        path = [self.root]
        for t in fed:
            nxt = path[-1].children.get(t)
            if nxt is None:
                return None
            path.append(nxt)
        cp, path[-1].checkpoint = path[-1].checkpoint, None
        self.lru.pop(tuple(fed), None)
        if cp is not None:
            self.fed_of.pop(cp.key, None)
        for depth in range(len(fed), 0, -1):  # prune branches that hold nothing now
            node = path[depth]
            if node.checkpoint is None and not node.children:
                del path[depth - 1].children[fed[depth - 1]]
                self._grow(-1)
            else:
                break
        return cp

    def _grow(self, n: int) -> None:
        self.nodes += n
        self.count.n += n

    def pop_oldest(self) -> Checkpoint | None:
        """Remove the least recently used checkpoint (None when there is none)."""
        return self.remove(list(next(iter(self.lru)))) if self.lru else None

    def remove_key(self, key: str) -> Checkpoint | None:
        """Remove the checkpoint stored under `key` (the caller's store let it go), if it is here."""
        fed = self.fed_of.get(key)
        return None if fed is None else self.remove(list(fed))
