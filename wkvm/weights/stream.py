"""StreamingWeights: layers come from a pack on disk through an LRU cache of at most N layers, with read-ahead.

The model asks for layer i when it runs layer i, for the whole batch at once, so one sweep of the weights
serves every running sequence. While layer i computes, a background thread maps layer i + 1 (wrapping to
layer 0 for the next step) and faults its pages in from disk. Layers are memory-mapped, not copied: a cached
layer costs address space and page cache, which the OS can reclaim once the layer leaves the cache. Globals
(embedding, head, norms) stay resident.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from wkvm.models.rwkv7 import RWKV7Config, prepare_globals, prepare_layer
from wkvm.weights.pack import Pack
from wkvm.weights.provider import Tensors


@dataclass
class StreamStats:
    cache_hits: int = 0
    cache_misses: int = 0
    readahead_hits: int = 0  # a miss served by a read-ahead already done or under way
    readahead_misses: int = 0  # a miss nobody had started reading: computed waited for the full read
    bytes_read: int = 0
    layer_calls: int = 0


class StreamingWeights:
    def __init__(self, pack: Pack, cache_layers: int, read_ahead: bool = True, device="cpu",
                 dtype: torch.dtype = torch.float32):  # fmt: skip
        if cache_layers < 1:
            raise ValueError("cache_layers must be at least 1 (0 means: load the model resident)")
        self.pack = pack
        self.config: RWKV7Config = pack.config
        self.n_layers = self.config.n_layer
        self.capacity = min(cache_layers, self.n_layers)
        self.read_ahead = read_ahead
        self.device, self.dtype = device, dtype
        self.stats = StreamStats()
        self._cache: OrderedDict[int, Tensors] = OrderedDict()
        self._pending: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wkvm-readahead") if read_ahead else None
        self._globals = prepare_globals(pack.read(None), dtype, device)

    def globals(self) -> Tensors:
        return self._globals

    @property
    def cached_layers(self) -> list[int]:
        with self._lock:
            return list(self._cache)

    def _load(self, i: int) -> Tensors:
        """Map layer i with its pages populated (on the read-ahead thread: disk I/O happens here, not in matmuls)."""
        raw = self.pack.read(i, mapped=True)
        with self._lock:
            self.stats.bytes_read += self.pack.layer_bytes(i)
        return prepare_layer(raw, i, self.config, self.dtype, self.device, pack=False)

    def _insert(self, i: int, tensors: Tensors) -> None:
        with self._lock:
            self._cache[i] = tensors
            self._cache.move_to_end(i)
            while len(self._cache) > self.capacity:
                self._cache.popitem(last=False)

    def _prefetch(self, i: int) -> None:
        with self._lock:
            if self._pool is None or i in self._cache or i in self._pending:
                return
            fut = self._pool.submit(self._load, i)
            self._pending[i] = fut

    def layer(self, i: int) -> Tensors:
        with self._lock:
            self.stats.layer_calls += 1
            hit = self._cache.get(i)
            if hit is not None:
                self._cache.move_to_end(i)
                self.stats.cache_hits += 1
            else:
                self.stats.cache_misses += 1
            fut = None if hit is not None else self._pending.pop(i, None)
            if hit is None:
                if fut is not None:
                    self.stats.readahead_hits += 1
                elif self._pool is not None:
                    self.stats.readahead_misses += 1
        if hit is None:
            tensors = fut.result() if fut is not None else self._load(i)
            self._insert(i, tensors)
            hit = tensors
        self._prefetch((i + 1) % self.n_layers)
        return hit

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
