"""StateStore: immutable `name@version` states in tiers (device -> host RAM -> disk), LRU with pins.

Disk is the source of truth: a state is acknowledged only after its file is fsynced and its index row is
committed. The device and host tiers are byte-bounded LRU caches above it; using a state moves it up, and a
full tier pushes its least recently used unpinned state one tier down. Tensors are stored content-addressed
(`blobs/<sha256>.state`), so a fork is a new record sharing the same immutable blob: copy-on-write.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from wkvm.atomic import TMP_SUFFIX, atomic_write_bytes
from wkvm.models.spec import State, StateSpec
from wkvm.state import statefile
from wkvm.state.index import StateIndex, StateRecord, parse_handle
from wkvm.state.statefile import StateFileError, StateMeta, token_digest, valid_name

log = logging.getLogger("wkvm.state")
TIERS = ("device", "host", "disk")


class StateNotFound(KeyError):
    def __str__(self) -> str:
        return str(self.args[0])


class QuotaExceeded(RuntimeError):
    pass


@dataclass
class StoreLimits:
    device_bytes: int = 256 << 20
    host_bytes: int = 1 << 30
    disk_bytes: int | None = None  # quota; None = unlimited


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
        """Insert, evicting LRU unpinned entries; returns them, or None if it cannot fit (nothing changes)."""
        size = _nbytes(tensors)
        evictable = sum(n for b, n in self.sizes.items() if not self.is_pinned(b))
        if size > self.limit - (self.nbytes - evictable):
            return None
        evicted = []
        for b in list(self.items):
            if self.nbytes + size <= self.limit:
                break
            if not self.is_pinned(b):
                evicted.append((b, self.pop(b)))
        self.items[blob] = tensors
        self.sizes[blob] = size
        self.nbytes += size
        return evicted


def _nbytes(tensors: State) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


class StateStore:
    def __init__(
        self,
        root: str | Path,
        spec: StateSpec,
        fingerprint: str,
        vocab_size: int | None = None,
        device: str | torch.device = "cpu",
        limits: StoreLimits | None = None,
        verify_on_load: bool = False,
    ):
        self.root = Path(root)
        self.blob_dir = self.root / "blobs"
        self.blob_dir.mkdir(parents=True, exist_ok=True)
        self.spec = spec
        self.fingerprint = fingerprint
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.limits = limits or StoreLimits()
        self.verify_on_load = verify_on_load
        self.index = StateIndex(self.root / "index.sqlite")
        self._lock = threading.RLock()
        self._pinned = self.index.pinned_blobs()
        self.device_cache = TierCache(self.limits.device_bytes, lambda b: b in self._pinned)
        self.host_cache = TierCache(self.limits.host_bytes, lambda b: b in self._pinned)
        self.disk_bytes = 0
        self._unwritten: dict[str, tuple[State, StateMeta]] = {}  # write-back states not on disk yet
        self.recover()

    # --- crash recovery ------------------------------------------------------------------------
    def recover(self) -> None:
        """Remove half-written and unreferenced files; drop records whose blob is missing or fails its checksum.
        A file whose size, mtime and inode are those recorded when it was written or last checked (for this
        model) is not read again, so a restart costs a stat per state, not a read and hash of every byte."""
        with self._lock:
            for tmp in self.blob_dir.glob(f"*{TMP_SUFFIX}"):
                tmp.unlink(missing_ok=True)
            referenced = {r.blob for r in self.index.list()}
            for f in self.blob_dir.glob("*.state"):
                if f.stem not in referenced:
                    f.unlink(missing_ok=True)
            checked = self.index.checked_files()
            self.index.forget_checked(set(checked) - referenced)
            self.disk_bytes = 0
            for blob in referenced:
                path = self._blob_path(blob)
                try:
                    stat = self._stat_key(path)
                    if checked.get(blob) != stat:
                        self._read_blob(blob, verify=True)
                        self.index.set_checked(blob, stat)
                    self.disk_bytes += path.stat().st_size
                except (FileNotFoundError, StateFileError) as e:
                    dropped = self.index.delete_blob_records(blob)
                    log.error("state blob %s unusable (%s): dropped %d record(s)", blob[:12], e, dropped)
            self._pinned = self.index.pinned_blobs()

    def _stat_key(self, path: Path) -> str:
        st = path.stat()
        return f"{st.st_size}:{st.st_mtime_ns}:{st.st_ino}:{self.fingerprint}"

    # --- records -------------------------------------------------------------------------------
    def get(self, owner: str, handle: str) -> StateRecord:
        name, version = parse_handle(handle)
        rec = self.index.get(owner, name, version)
        if rec is None:
            raise StateNotFound(f"state {handle!r} not found")
        rec.tier = self.tier_of(rec.blob)
        return rec

    def list(self, owner: str) -> list[StateRecord]:
        recs = self.index.list(owner)
        for r in recs:
            r.tier = self.tier_of(r.blob)
        return recs

    def tier_of(self, blob: str) -> str:
        if blob in self.device_cache:
            return "device"
        return "host" if blob in self.host_cache else "disk"

    def put(
        self, owner: str, name: str, state: State, token_ids: list[int],
        parent: str | None = None, op: str = "create", op_params: dict | None = None, durable: bool = True,
    ) -> StateRecord:  # fmt: skip
        """Store a new immutable version (state is batched [1, ...]); returns once it is durable.

        durable=False is for caches such as prefix checkpoints: the file is written only when the state
        leaves RAM (write-back), without fsyncs, and the index commit is not fsynced either. A crash may
        lose such states (recovery drops their records); it never corrupts anything.
        """
        valid_name(name)
        self.spec.check(state)
        tensors = statefile.unbatch(state)
        blob = statefile.tensor_digest(self.spec, tensors)
        with self._lock:
            meta = StateMeta(self.fingerprint, self.spec.spec_hash, list(token_ids), name, 0, parent, op,
                             op_params or {}, time.time())  # fmt: skip
            if not self._blob_path(blob).exists():
                quota = self.limits.disk_bytes
                if quota is not None and self.disk_bytes + self.spec.nbytes > quota:
                    raise QuotaExceeded(
                        f"the state disk quota ({quota} bytes) is full; delete states or raise --state-disk-quota"
                    )
                self._unwritten.setdefault(blob, (tensors, meta))
                if durable:
                    self._write(blob, durable=True)
            rec = StateRecord(
                owner=owner, name=name, version=self.index.next_version(owner, name), parent=parent, op=op,
                op_params=meta.op_params, fingerprint=self.fingerprint, spec_hash=self.spec.spec_hash,
                token_ids=meta.token_ids, token_digest=token_digest(meta.token_ids), n_tokens=meta.n_tokens,
                pinned=False, blob=blob, bytes=self.spec.nbytes, created_at=meta.created_at,
            )  # fmt: skip
            self.index.insert(rec, durable)
            self._cache(blob, tensors, "device")
            rec.tier = self.tier_of(blob)
            return rec

    def fork(self, owner: str, handle: str, name: str) -> StateRecord:
        """A new state sharing the source's tensors (no copy until someone writes, and nobody does)."""
        valid_name(name)
        with self._lock:
            src = self.get(owner, handle)
            rec = StateRecord(
                owner=owner, name=name, version=self.index.next_version(owner, name), parent=src.handle,
                op="fork", op_params={}, fingerprint=src.fingerprint, spec_hash=src.spec_hash,
                token_ids=src.token_ids, token_digest=src.token_digest, n_tokens=src.n_tokens, pinned=False,
                blob=src.blob, bytes=src.bytes, created_at=time.time(),
            )  # fmt: skip
            self.index.insert(rec)
            rec.tier = self.tier_of(rec.blob)
            return rec

    def delete(self, owner: str, handle: str, durable: bool = True) -> None:
        with self._lock:
            rec = self.get(owner, handle)
            self.index.delete(owner, rec.name, rec.version, durable)
            if self.index.blob_refs(rec.blob) == 0:
                self.device_cache.pop(rec.blob)
                self.host_cache.pop(rec.blob)
                self._unwritten.pop(rec.blob, None)
                path = self._blob_path(rec.blob)
                self.disk_bytes -= path.stat().st_size if path.exists() else 0
                path.unlink(missing_ok=True)
            self._pinned = self.index.pinned_blobs()

    def discard(self, owner: str, handle: str, durable: bool = True) -> bool:
        """Delete if present; True when something was deleted."""
        try:
            self.delete(owner, handle, durable)
            return True
        except StateNotFound:
            return False

    def set_pinned(self, owner: str, handle: str, pinned: bool) -> StateRecord:
        with self._lock:
            rec = self.get(owner, handle)
            self.index.set_pinned(owner, rec.name, rec.version, pinned)
            self._pinned = self.index.pinned_blobs()
            if pinned:  # a pinned state is kept resident: bring it up, then LRU never evicts it
                self.load(owner, rec.handle)
            return self.get(owner, rec.handle)

    # --- tensors and tiers ---------------------------------------------------------------------
    def load(self, owner: str, handle: str) -> tuple[StateRecord, State]:
        """The record and its state (batched [1, ...] on the device); promotes it to the device tier."""
        with self._lock:
            rec = self.get(owner, handle)
            tensors = self.device_cache.get(rec.blob)
            if tensors is None:
                tensors = self.host_cache.pop(rec.blob)
                if tensors is None:
                    tensors, _ = self._read_blob(rec.blob, verify=self.verify_on_load)
                self._cache(rec.blob, tensors, "device")
            rec.tier = self.tier_of(rec.blob)
            return rec, {k: v.unsqueeze(0) for k, v in tensors.items()}

    def hibernate(self, owner: str, handle: str, tier: str) -> StateRecord:
        """Move a state down to 'host' (out of device memory) or 'disk' (out of RAM)."""
        if tier not in ("host", "disk"):
            raise ValueError("tier must be 'host' or 'disk'")
        with self._lock:
            rec = self.get(owner, handle)
            tensors = self.device_cache.pop(rec.blob)
            if tier == "host" and tensors is not None:
                self._cache(rec.blob, tensors, "host")
            elif tier == "disk":
                self.host_cache.pop(rec.blob)
                self._write(rec.blob, durable=False)
            return self.get(owner, handle)

    def _cache(self, blob: str, tensors: State, tier: str) -> None:
        """Place tensors in `tier`; evicted entries move down a tier (host evictions just leave RAM)."""
        if tier == "device":
            evicted = self.device_cache.put(blob, {k: v.to(self.device) for k, v in tensors.items()})
            if evicted is None:
                self._cache(blob, tensors, "host")
                return
            for b, t in evicted:
                self._cache(b, t, "host")
        else:
            evicted = self.host_cache.put(blob, {k: v.to("cpu") for k, v in tensors.items()})
            for b, _ in evicted if evicted is not None else [(blob, tensors)]:
                self._write(b, durable=False)  # leaving RAM: a write-back state gets its file now

    def _write(self, blob: str, durable: bool) -> None:
        """Write a blob's file if it has none yet (atomic; fsynced when durable)."""
        pending = self._unwritten.pop(blob, None)
        if pending is None:
            return
        tensors, meta = pending
        data = statefile.encode(self.spec, tensors, meta, digest=blob)
        atomic_write_bytes(self._blob_path(blob), data, durable)
        if durable:  # fsynced, written from the tensors: correct. A write-back file (not fsynced) could lose its
            self.index.set_checked(blob, self._stat_key(self._blob_path(blob)))  # data in a power cut: check it
        self.disk_bytes += len(data)

    # --- files ---------------------------------------------------------------------------------
    def _blob_path(self, blob: str) -> Path:
        return self.blob_dir / f"{blob}.state"

    def _read_blob(self, blob: str, verify: bool) -> tuple[State, StateMeta | None]:
        if not verify:
            return statefile.read_tensors(self._blob_path(blob), self.spec), None
        data = self._blob_path(blob).read_bytes()
        tensors, meta = statefile.decode(data, self.spec, self.fingerprint, self.vocab_size)
        if statefile.tensor_digest(self.spec, tensors) != blob:
            raise StateFileError("blob content does not match its name")
        return tensors, meta

    def export_bytes(self, owner: str, handle: str) -> bytes:
        rec, state = self.load(owner, handle)
        meta = StateMeta(rec.fingerprint, rec.spec_hash, rec.token_ids, rec.name, rec.version, rec.parent, rec.op,
                         rec.op_params, rec.created_at)  # fmt: skip
        return statefile.encode(self.spec, statefile.unbatch(state), meta)

    def import_bytes(self, owner: str, data: bytes, name: str | None = None) -> StateRecord:
        """Validate every field of an exported file, then store it as a new version."""
        tensors, meta = statefile.decode(data, self.spec, self.fingerprint, self.vocab_size)
        lineage = {"from": f"{meta.name}@{meta.version}", "parent": meta.parent, "op": meta.op}
        return self.put(owner, name or meta.name, {k: v.unsqueeze(0) for k, v in tensors.items()}, meta.token_ids,
                        parent=None, op="import", op_params=lineage)  # fmt: skip

    def close(self) -> None:
        """Write back what only RAM holds (so checkpoints survive a clean restart), then close the index."""
        with self._lock:
            for blob in list(self._unwritten):
                self._write(blob, durable=False)
        self.index.close()
