"""StreamingWeights: layers come from a pack on disk through a cache of at most N layers, with read-ahead.

The model asks for layer i when it runs layer i, for the whole batch at once, so one sweep of the weights
serves every running sequence. Sweeps are cyclic (0, 1, ..., L-1, 0, ...), and for a cyclic pattern an LRU
cache smaller than the model never hits: each layer is evicted just before it is needed again. So the cache
is split instead, the optimal policy for cyclic access: the first N - 1 layers are read once and stay
(prepacked like resident weights; every sweep hits them), and one reusable buffer takes the other layers in
turn. N = L keeps every layer.

Reading a layer copies it into the buffer, allocated once (no allocation, mapping or page-table work per read):
when a sample of its pages is in the OS page cache, from a read-only mapping of its file kept for the server's
life, with all of torch's threads; otherwise with one sequential `preadv` scattered into the buffer (the disk
path: faulting pages in through the mapping read the disk 30% slower). On CPU the files are the pack's
compute-form copy (`wkvm/weights/blocked.py`): with oneDNN and float32/bfloat16, matrices in the layout of the
fast matmul kernel; with int8/int4, the quantized layers (a quarter or less of fp32's bytes). A read is then a
few large copies and nothing else. Otherwise the pack's plain files are read and converted per read. Globals
(embedding, head, norms) stay resident.

Read-ahead: when layer i is served, the next streamed layer is looked at: if a sample of its pages is in RAM
(`mincore`, ~20 us) nothing more is done; otherwise a background thread asks the OS to read it into the page
cache (`madvise(MADV_WILLNEED)`), so disk latency overlaps compute and the copy finds the data in RAM. (Asking
for a layer that is already cached costs ~0.12 ms of page-cache walking, 5-10% of a B=8 step on 2 cores.)
The copy itself is not moved to that thread: it needs the memory bandwidth and cores the matmuls are using
(measured on 2 cores: a background copy slowed them more than it saved; see docs/performance.md).

One sweep at a time: the buffer is overwritten when the next streamed layer is asked for.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import warnings
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from wkvm.models.provider import Tensors
from wkvm.weights.blocked import SUFFIX, compute_copy, memory, template
from wkvm.weights.pack import DTYPES, Pack, PackError

RESIDENCY_SAMPLES = 8
_libc = ctypes.CDLL(None, use_errno=True)  # the process's own symbols, libc's included: no library search


@dataclass
class StreamStats:
    cache_hits: int = 0
    cache_misses: int = 0
    readahead_hits: int = 0  # a miss whose layer the read-ahead had looked at (found in RAM or asked the OS for)
    readahead_misses: int = 0  # a miss with no read-ahead before it
    readahead_requests: int = 0  # layers the read-ahead asked the OS to read from disk
    bytes_read: int = 0  # bytes copied from the pack's files into the cache
    disk_reads: int = 0  # layers read with preadv because a sample of their pages was not in the OS cache
    layer_calls: int = 0


@dataclass
class _LayerFile:
    """A layer file mapped read-only, with its tensors in file order (contiguous, as safetensors writes them)."""

    path: Path
    fd: int  # for reads of pages the OS has not cached
    map: mmap.mmap
    data: torch.Tensor  # uint8 over the whole mapping
    tensors: list[tuple[str, dict[str, Any]]]  # name, manifest entry (JSON)
    nbytes: int

    @staticmethod
    def open(d: Path, entry: dict[str, Any]) -> _LayerFile:
        path = d / entry["file"]
        tensors = sorted(entry["tensors"].items(), key=lambda kv: kv[1]["offset"])
        for (name, a), (_, b) in zip(tensors, tensors[1:], strict=False):
            if a["offset"] + a["length"] != b["offset"]:
                raise PackError(f"{path}: tensor data is not contiguous after {name}")
        fd = os.open(path, os.O_RDONLY)
        mm = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        if len(mm) != entry["bytes"]:
            raise PackError(f"{path}: changed size since the pack was opened")
        with warnings.catch_warnings():  # torch warns that the buffer is read-only; it is only copied from
            warnings.simplefilter("ignore", UserWarning)
            data = torch.frombuffer(mm, dtype=torch.uint8)
        return _LayerFile(path, fd, mm, data, tensors, sum(t["length"] for _, t in tensors))

    def plain_bytes(self) -> int:
        return sum(t["length"] for name, t in self.tensors if not name.endswith(SUFFIX))

    def signature(self) -> tuple[tuple[Any, ...], ...]:
        return tuple((name, t["dtype"], tuple(t["shape"]), t["offset"], t["length"]) for name, t in self.tensors)

    def in_ram(self) -> bool:
        """Whether a sample of this file's pages is in the OS page cache (False where mincore is unavailable)."""
        if not hasattr(_libc, "mincore"):
            return False
        page, n = mmap.PAGESIZE, len(self.map)
        flag = ctypes.c_ubyte()
        for k in range(RESIDENCY_SAMPLES):
            addr = self.data.data_ptr() + (n * k // RESIDENCY_SAMPLES) // page * page
            if _libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(1), ctypes.byref(flag)) != 0 or not flag.value & 1:
                return False
        return True

    def advise(self) -> None:
        """Have the OS start reading this file into its cache (read-ahead; returns before the reads finish).
        Filling page tables ahead (MADV_POPULATE_READ) was measured too: 1.2 ms per 30 MB layer even when
        present, more than the copy's own page faults cost, so it is not done."""
        self.map.madvise(mmap.MADV_WILLNEED)


@dataclass
class _Plan:
    """How one file layout lands in the buffer: copies (destination, source offset) and the tensors it yields."""

    copies: list[tuple[torch.Tensor, int]]
    tensors: Tensors  # views into the buffer, named as in the file (suffix removed)


@dataclass
class _Buffer:
    plain: torch.Tensor  # uint8: the small tensors (all tensors, for plain files)
    matrices: dict[str, torch.Tensor]  # blocked oneDNN matrices by name, overwritten by each read
    plans: dict[tuple[tuple[Any, ...], ...], _Plan] = field(default_factory=dict)
    layer: int | None = None
    tensors: Tensors | None = None

    def plan(self, f: _LayerFile) -> _Plan:
        key = f.signature()
        if key not in self.plans:
            copies: list[tuple[torch.Tensor, int]] = []
            tensors: Tensors = {}
            pos, run_start, run_offset = 0, 0, None
            for name, t in f.tensors:
                if name.endswith(SUFFIX):  # a blocked matrix: its own copy, into the oneDNN tensor's memory
                    name = name.removesuffix(SUFFIX)
                    copies.append((torch.frombuffer(memory(self.matrices[name]), dtype=torch.uint8), t["offset"]))
                    tensors[name] = self.matrices[name]
                    continue
                part = self.plain[pos : pos + t["length"]]
                tensors[name] = part.view(DTYPES[t["dtype"]]).view(t["shape"])
                if run_offset is None or run_offset + pos - run_start != t["offset"]:
                    if run_offset is not None:  # small tensors next to each other in the file: one copy
                        copies.append((self.plain[run_start:pos], run_offset))
                    run_start, run_offset = pos, t["offset"]
                pos += t["length"]
            if run_offset is not None:
                copies.append((self.plain[run_start:pos], run_offset))
            copies.sort(key=lambda c: c[1])  # file order: a read from disk fills them in one sequential pass
            self.plans[key] = _Plan(copies, tensors)
        return self.plans[key]

    def fill(self, f: _LayerFile, cached: bool) -> Tensors:
        """Copy layer file `f` in: from the mapping when the OS has it cached (torch's threads copy, 0.6 ms per
        30 MB layer here), else with sequential reads (page faults through the mapping read the disk at 1.2-1.5
        GB/s here, `preadv` at 1.8-2.1 GB/s)."""
        plan = self.plan(f)
        if cached:
            for dst, offset in plan.copies:
                dst.copy_(f.data[offset : offset + dst.numel()])
        else:
            # numpy's stubs give ndarray the buffer protocol (__buffer__) only for Python >= 3.12
            _preadv_all(f.fd, [memoryview(dst.numpy()) for dst, _ in plan.copies], plan.copies[0][1])  # type: ignore[arg-type]
        return plan.tensors


def _preadv_all(fd: int, views: list[memoryview], offset: int) -> None:
    """Read the file from `offset` into `views` in order (preadv may return short counts)."""
    while views:
        got = os.preadv(fd, views, offset)
        if got == 0:
            raise PackError("a layer file ended early (it changed while the server streams from it)")
        offset += got
        while views and got >= len(views[0]):
            got -= len(views[0])
            views = views[1:]
        if views and got:
            views = [views[0][got:], *views[1:]]


class StreamingWeights:
    def __init__(self, pack: Pack, cache_layers: int, read_ahead: bool = True, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32):  # fmt: skip
        if cache_layers < 1:
            raise ValueError("cache_layers must be at least 1 (0 means: load the model resident)")
        self.family, self.config = pack.family, pack.config
        self.n_layers = self.config.n_layer
        self.capacity = min(cache_layers, self.n_layers)
        self.device, self.dtype = device, dtype
        self.stats = StreamStats()
        self._lock = threading.Lock()
        self._closed = False
        n_pinned = self.capacity if self.capacity == self.n_layers else self.capacity - 1
        streams = n_pinned < self.n_layers
        blocked = compute_copy(pack, dtype) if streams and torch.device(device).type == "cpu" else None
        d, entries = (blocked.path, blocked.layers) if blocked else (pack.path, pack.manifest["layers"])
        self.blocked = blocked is not None  # files hold the compute form (blocked or quantized matrices)
        self._globals = self.family.prepare_globals(pack.read(None), self.config, dtype, device)
        self._pinned: dict[int, Tensors] = {}
        for i in range(n_pinned):
            self._pinned[i] = self.family.prepare_layer(pack.read(i), i, self.config, dtype, device, pack=True)
            self.stats.bytes_read += pack.layer_bytes(i)
        self._files = {i: _LayerFile.open(d, entries[i]) for i in range(n_pinned, self.n_layers)}
        self._close_files = weakref.finalize(self, _close_fds, [f.fd for f in self._files.values()])
        self._buffer = self._new_buffer(pack, blocked.shapes if blocked else {}) if self._files else None
        self.read_ahead = read_ahead and self._buffer is not None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="wkvm-readahead") if self.read_ahead else None
        self._ahead: dict[int, Future[None] | None] = {}  # looked at ahead: None when found in RAM

    def _new_buffer(self, pack: Pack, shapes: dict[str, list[int]]) -> _Buffer:
        files = self._files.values()
        sizes = {n.removesuffix(SUFFIX): t["length"] for f in files for n, t in f.tensors if n.endswith(SUFFIX)}
        if set(sizes) - set(shapes):
            raise PackError(f"{pack.path}: its blocked copy holds matrices {sorted(set(sizes) - set(shapes))} that "
                            "the family does not list (delete onednn-*/)")  # fmt: skip
        matrices = {k: template(shapes[k], self.dtype) for k in sizes}
        if any(len(memory(m)) != sizes[k] for k, m in matrices.items()):
            raise PackError(f"{pack.path}: its blocked copy does not match this CPU's layout (delete onednn-*/)")
        plain = torch.zeros(max(f.plain_bytes() for f in files), dtype=torch.uint8)
        return _Buffer(plain, matrices)

    def globals(self) -> Tensors:
        return self._globals

    @property
    def cached_layers(self) -> list[int]:
        """Layers held in memory now (pinned, or in the buffer)."""
        with self._lock:
            held = [] if self._buffer is None or self._buffer.layer is None else [self._buffer.layer]
            return [*self._pinned, *held]

    def _next_streamed(self, i: int) -> int:
        j = (i + 1) % self.n_layers
        return len(self._pinned) if j in self._pinned else j

    def layer(self, i: int) -> Tensors:
        if self._closed:  # its files' descriptors may be another file's by now
            raise PackError("these streaming weights are closed")
        with self._lock:
            self.stats.layer_calls += 1
            buf = self._buffer
            hit = i in self._pinned or (buf is not None and buf.layer == i)
            self.stats.cache_hits += hit
            self.stats.cache_misses += not hit
            requested = False  # the read-ahead asked the OS to read this layer from disk
            if not hit and self.read_ahead:
                looked = i in self._ahead
                requested = self._ahead.pop(i, None) is not None
                self.stats.readahead_hits += looked
                self.stats.readahead_misses += not looked
        if i in self._pinned:
            tensors = self._pinned[i]
        elif hit and buf is not None and buf.tensors is not None:  # buf.layer == i: its tensors are set with it
            tensors = buf.tensors
        else:
            assert buf is not None, f"layer {i} is neither pinned nor streamed"
            with self._lock:
                buf.layer, buf.tensors = None, None
            f = self._files[i]
            if f.map.size() != len(f.map):  # fstat, ~1 us: a shrunk file would fault the copy (SIGBUS)
                raise PackError(f"{f.path}: changed size while the server streams from it; restart the server")
            # a layer being read ahead may look cached by its sampled pages while most are still on their way,
            # and faulting the rest in through the mapping is the slow way: read it
            cached = not requested and f.in_ram()
            tensors = buf.fill(f, cached)
            if not self.blocked:  # plain files: convert (and move to the device) per read; on a CPU its matrices
                prefix = self.family.layer_prefix(i)  # packed as resident ones are, so the same kernel gives the
                raw = {prefix + k: v for k, v in tensors.items()}  # same bits (oneDNN's plain-weight matmul sums
                pack = torch.device(self.device).type == "cpu"  # in another order: logits ~1e-6 apart)
                tensors = self.family.prepare_layer(raw, i, self.config, self.dtype, self.device, pack=pack)
            with self._lock:
                buf.layer, buf.tensors = i, tensors
                self.stats.bytes_read += f.nbytes
                self.stats.disk_reads += not cached
        if self.read_ahead:
            self._ask_ahead(self._next_streamed(i))
        return tensors

    def _ask_ahead(self, j: int) -> None:
        if self._pool is None or self._buffer is None:  # no read-ahead (__init__ makes both when it reads ahead)
            return
        if j in self._ahead or self._buffer.layer == j:
            return
        f = self._files[j]
        request = None if f.in_ram() else self._pool.submit(f.advise)
        with self._lock:
            self._ahead[j] = request
            self.stats.readahead_requests += request is not None

    def drop_from_os_cache(self, i: int) -> None:
        """Evict streamed layer i's file pages from the OS page cache, so its next read comes from disk: how
        benchmarks emulate a model larger than RAM. Unmaps them from our mapping first (pages read with preadv
        were never mapped; pages copied through the mapping are), then drops the clean pages. A no-op for
        pinned layers."""
        if i in self._files:
            f = self._files[i]
            f.map.madvise(mmap.MADV_DONTNEED)
            os.posix_fadvise(f.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        self._close_files()


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
