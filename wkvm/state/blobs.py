"""BlobFiles: the store's content-addressed state files, `blobs/<blob>.state` (wkvm-state-v1), where a blob is the
sha256 of the tensors, prefixed by its tenant's scope for every tenant but the default one (`blob_name`).

Writes are atomic (temp, rename; fsynced when durable). A file's stat key (size, mtime, inode, model) recorded
when it was written durably or last verified lets a restart skip re-reading unchanged files.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import sqlite3
import threading
import weakref
from collections import deque
from pathlib import Path

import torch

from wkvm.atomic import TMP_SUFFIX, atomic_write_bytes, fsync_dir
from wkvm.models.spec import State, StateSpec
from wkvm.state import statefile
from wkvm.state.index import StateIndex, StateRecord
from wkvm.state.quota import is_internal
from wkvm.state.statefile import StateFileError

log = logging.getLogger("wkvm.state")


def blob_name(owner: str, digest: str) -> str:
    """Where `owner`'s tensors of this `digest` (statefile.tensor_digest) are kept: states of one tenant with the same
    tensors share a blob (a fork is a record, copy-on-write), two tenants never do. The digest itself for the default
    tenant (owner "" or "#..."), else `<16 hex digits of the owner's scope's hash>-<digest>` (the scope: the owner
    before '#', so a tenant's internal states share with its own). A blob shared across tenants showed one tenant
    another's: its residency tier moved when the other used it, and a pin of the other's refused a hibernate."""
    scope = owner.partition("#")[0]
    return digest if not scope else f"{hashlib.sha256(scope.encode()).hexdigest()[:16]}-{digest}"


def blob_digest(blob: str) -> str:
    """The tensor digest a blob name carries (its file's tensor_sha256)."""
    return blob.rpartition("-")[2]


class DigestMemo:
    """`statefile.tensor_digest` of the last few finished requests' states stored, known by their tensors' names and
    identity: a chat turn's final state is stored up to three times (its reuse checkpoint, its parked session, a
    `save_state`), and hashing it is most of a save's cost (0.12 s for 3.5k SmolLM2 tokens' keys and values). Only
    for states no one changes after storing them (`StateStore.put(frozen=True)`: the engine's own copies): a tensor
    changed in place keeps its identity, and its version counter does not move for every write (the model's own
    in-place prefill). Weak references: a remembered state is not kept alive, nor mistaken for a new one at its
    address."""

    def __init__(self, size: int = 4):
        self.entries: deque[tuple[list[tuple[str, weakref.ref[torch.Tensor]]], str]] = deque(maxlen=size)
        self.lock = threading.Lock()

    def digest(self, spec: StateSpec, state: State, tensors: State, frozen: bool) -> str:
        """The digest of `tensors` (`state` unbatched: the batched tensors are what a caller passes again)."""
        if not frozen:
            return statefile.tensor_digest(spec, tensors)
        held = list(state.items())
        with self.lock:
            for refs, digest in self.entries:
                if len(refs) == len(held) and all(n == m and r() is t for (m, r), (n, t) in zip(refs, held)):  # noqa: B905
                    return digest
        digest = statefile.tensor_digest(spec, tensors)
        with self.lock:
            self.entries.append(([(n, weakref.ref(t)) for n, t in held], digest))
        return digest


class BlobFiles:
    def __init__(self, root: Path, spec: StateSpec, fingerprint: str, vocab_size: int | None):
        self.dir = root / "blobs"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.spec = spec
        self.fingerprint = fingerprint
        self.vocab_size = vocab_size

    def path(self, blob: str) -> Path:
        return self.dir / f"{blob}.state"

    def size(self, blob: str) -> int:
        return self.path(blob).stat().st_size

    def stat_key(self, blob: str) -> str:
        st = self.path(blob).stat()
        return f"{st.st_size}:{st.st_mtime_ns}:{st.st_ino}:{self.fingerprint}"

    def write(self, blob: str, data: bytes, durable: bool) -> None:
        atomic_write_bytes(self.path(blob), data, durable)

    def make_durable(self, blob: str) -> None:
        """fsync a file written without it (a write-back file that a user's state now shares)."""
        fd = os.open(self.path(blob), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_dir(self.dir)

    def remove(self, blob: str) -> None:
        self.path(blob).unlink(missing_ok=True)

    def sweep(self, referenced: set[str]) -> None:
        """Remove half-written files and files no record references."""
        for tmp in self.dir.glob(f"*{TMP_SUFFIX}"):
            tmp.unlink(missing_ok=True)
        for f in self.dir.glob("*.state"):
            if f.stem not in referenced:
                f.unlink(missing_ok=True)

    def read(self, blob: str, verify: bool) -> State:
        """The tensors (views into one read); verify: decode every field and check the content digest."""
        if not verify:
            return statefile.read_tensors(self.path(blob), self.spec)
        data = self.path(blob).read_bytes()
        tensors, _ = statefile.decode(data, self.spec, self.fingerprint, self.vocab_size, imported=False)
        if statefile.tensor_digest(self.spec, tensors) != blob_digest(blob):
            raise StateFileError("blob content does not match its name")
        return tensors

    def recover(self, index: StateIndex) -> tuple[list[StateRecord], dict[str, int], set[str]]:
        """Remove half-written and unreferenced files; drop records whose blob is missing or fails its checksum.
        A file whose size, mtime and inode are those recorded when it was written or last checked (for this
        model) is not read again, so a restart costs a stat per state, not a read and hash of every byte.
        Returns the records (by created_at), the usable blobs' file sizes, and the unusable blobs whose records the
        index could not drop (a full disk: they read as not found until a start with room drops them; such a start
        had failed)."""
        records = index.list()
        referenced = {r.blob for r in records}
        self.sweep(referenced)
        checked = index.checked_files()
        with contextlib.suppress(sqlite3.OperationalError):  # a cache's rows: a full disk leaves them for later
            index.forget_checked(set(checked) - referenced)
        sizes, lost = {}, set()
        for blob in referenced:
            try:
                stat = self.stat_key(blob)
                if checked.get(blob) != stat:
                    self.read(blob, verify=True)
                    with contextlib.suppress(sqlite3.OperationalError):  # a cache: a full disk only costs a re-check
                        index.set_checked(blob, stat)
                sizes[blob] = self.size(blob)
            except (FileNotFoundError, StateFileError) as e:
                try:
                    dropped = len(index.delete_blob_records(blob))
                except sqlite3.OperationalError as full:
                    if not is_disk_full(full):
                        raise
                    lost.add(blob)
                    self.remove(blob)  # a file that failed its check: the room it takes is what a full disk needs
                    log.error("state blob %s unusable (%s); its records stay until a start with free disk space "
                              "(they read as not found)", blob[:12], e)  # fmt: skip
                    continue
                # a write-back checkpoint's file may never have been written before a crash (state-file.md): expected
                internal = all(is_internal(r.owner) for r in records if r.blob == blob)
                log.log(logging.INFO if internal else logging.ERROR, "%s blob %s unusable (%s): dropped %d record(s)",
                        "internal state" if internal else "state", blob[:12], e, dropped)  # fmt: skip
        return [r for r in records if r.blob in sizes], sizes, lost


def is_disk_full(e: BaseException) -> bool:
    """ENOSPC / EDQUOT from a file write, or SQLite's SQLITE_FULL ("database or disk is full")."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return isinstance(e, sqlite3.OperationalError) and getattr(e, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL
