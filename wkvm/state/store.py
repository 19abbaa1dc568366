"""StateStore: immutable `name@version` states in tiers (device -> host RAM -> disk), LRU with pins.

Disk is the source of truth: a user's state is acknowledged only after its file is fsynced and its index row is
committed. The device and host tiers are byte-bounded LRU caches above it; using a state moves it up, and a
full tier pushes its least recently used unpinned state one tier down. Tensors are stored content-addressed
(`blobs/<sha256>.state`, per tenant: `blobs.blob_name`), so a fork is a new record sharing the same immutable blob:
copy-on-write.

Internal states (owners with '#': prefix checkpoints, parked chat sessions) are a write-back cache kept within
the room users leave (see wkvm/state/quota.py): `put` returns None for one it cannot keep, and one may be evicted
later; neither ever raises QuotaExceeded.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import logging
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import torch

from wkvm.models.spec import State, StateSpec
from wkvm.state import statefile
from wkvm.state.blobs import BlobFiles, DigestMemo, blob_digest, blob_name, is_disk_full
from wkvm.state.dir_lock import StateDirInUse, lock_dir, unlock_dir
from wkvm.state.index import StateIndex, StateRecord
from wkvm.state.quota import INDEX_COMMIT_BYTES, DiskUsage, QuotaExceeded, StoreLimits, is_internal, state_file_bytes
from wkvm.state.statefile import (
    MAX_HISTORY_TOKENS,
    HistoryTooLong,
    StateFileError,
    StateMeta,
    check_history,
    parse_handle,
    token_digest,
    valid_name,
)
from wkvm.state.tiers import TierCache

__all__ = ["DiskFull", "QuotaExceeded", "StateDirInUse", "StateNotFound", "StatePinned", "StateStore", "StoreLimits",
           "is_internal"]  # fmt: skip
log = logging.getLogger("wkvm.state")
TIERS = ("device", "host", "disk")


class StateNotFound(KeyError):
    param = "handle"  # the request field that named the state (an interpolation's other: params.other)

    def __str__(self) -> str:
        return str(self.args[0])


class StatePinned(RuntimeError):
    """A move down a tier of a state that a pin keeps resident."""


class ForeignStateDir(ValueError):
    """A state directory that holds another model's states: opening it for this model changes nothing there."""


class PinNoRoom(RuntimeError):
    """A pin of a state that cannot be held in RAM: the device and host tiers are full of pinned states."""


DISK_FULL_WHY = "the disk is full"  # why a checkpoint was not kept, where no limit of wkvm's is at fault


class DiskFull(RuntimeError):
    """The state directory's file system is full (a file or the index could not be written): nothing was stored."""


P = ParamSpec("P")
R = TypeVar("R")


def full_disk_is_an_answer(method: Callable[P, R]) -> Callable[P, R]:
    """A store operation that writes raises DiskFull when the disk is full (an OpenAI-shaped 413 over HTTP, which a
    client can act on by deleting states), instead of the OSError or sqlite3 error (a 500; hunt, session 47)."""

    @functools.wraps(method)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return method(*args, **kwargs)
        except (OSError, sqlite3.OperationalError) as e:
            if not is_disk_full(e):
                raise
            raise DiskFull("the disk that holds the states is full, so nothing was stored: delete states you no "
                           "longer need, or free space on it") from e  # fmt: skip

    return wrapper


def warn_if_open_to_others(root: Path) -> None:
    """A warning when other users of this machine can list or read the state directory (one made by wkvm before
    session 48 is 0755; its files take the umask's 0644, so every tenant's token histories and states were readable
    to them). Its mode is its owner's to set: wkvm says so rather than changing it."""
    mode = root.stat().st_mode & 0o777
    if mode & 0o077:
        log.warning("state directory %s has mode %o: other users of this machine can read every tenant's states and "
                    "token histories there; `chmod 700 %s` makes it its owner's alone (as wkvm makes new ones)",
                    root, mode, root)  # fmt: skip


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
        lock_wait: float = 0.0,
    ):
        """`lock_wait`: seconds to wait for another process to let go of the directory (`dir_lock`), then
        StateDirInUse."""
        self.root = Path(root)
        # a directory made here is its owner's alone (every tenant's token histories and states, stored responses):
        # it had been 0755, its files readable by every user of the machine (security hunt, session 48); one that
        # exists keeps the modes its owner gave it
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        warn_if_open_to_others(self.root)
        self._dir_key: Path | None = lock_dir(self.root, lock_wait)
        try:
            self._open(spec, fingerprint, vocab_size, device, limits, verify_on_load)
        except BaseException:
            unlock_dir(self._dir_key)
            raise

    def _open(self, spec: StateSpec, fingerprint: str, vocab_size: int | None, device: str | torch.device,
              limits: StoreLimits | None, verify_on_load: bool) -> None:  # fmt: skip
        self.files = BlobFiles(self.root, spec, fingerprint, vocab_size)
        self.spec = spec
        self.fingerprint = fingerprint
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.limits = limits or StoreLimits()
        self.verify_on_load = verify_on_load
        self.index = StateIndex(self.root / "index.sqlite")
        self._lock = threading.RLock()
        self._digests = DigestMemo()
        self._pinned = self.index.pinned_blobs()
        self.device_cache = TierCache(self.limits.device_bytes, lambda b: b in self._pinned)
        self.host_cache = TierCache(self.limits.host_bytes, lambda b: b in self._pinned)
        self.usage = DiskUsage(self.limits.disk_bytes, self.limits.internal_bytes, self.limits.tenant_bytes)
        self._unwritten: dict[str, tuple[State, StateMeta]] = {}  # write-back states not on disk yet
        self._lost: set[str] = set()  # blobs gone whose records a full disk kept the index from deleting
        self._deletes: list[tuple[str, str, int]] = []  # records deleted whose commit a full disk refused
        # told (owner, handle) of each internal record the store evicts, under the store's lock: it must not block
        self.on_evict: Callable[[str, str], None] | None = None
        self.internal_not_kept = 0  # internal states (checkpoints, parked chats) put but not kept: /metrics
        self.recover()

    @property
    def disk_bytes(self) -> int:
        """Bytes on disk: state files and the index (what --state-disk-quota bounds, with internal files)."""
        with self._lock:  # the metrics thread reads it
            return self.usage.blob_bytes() + self.index.file_bytes()

    # --- crash recovery ------------------------------------------------------------------------
    def recover(self) -> None:
        """Check the files against the index (BlobFiles.recover), then evict internal states beyond their budget or
        the quota (an older server wrote them all back)."""
        with self._lock:
            # another model's states (another family, or a fine-tune) would read as unusable and be dropped: refuse
            # the directory instead, before anything in it changes
            others = self.index.fingerprints() - {self.fingerprint}
            if others:
                self.index.close()  # SQLite then removes its -wal and -shm files: the directory is as it was
                raise ForeignStateDir(f"the state directory {self.root} holds states of another model (fingerprint "
                                      f"{sorted(others)[0][:16]}), not this one ({self.fingerprint[:16]}); nothing in "
                                      "it was changed: give each model its own state directory")  # fmt: skip
            records, sizes, self._lost = self.files.recover(self.index)
            self.usage.add_records(records, sizes)
            self._settle()
            self._pinned = self.index.pinned_blobs()

    def bring_up_pins(self) -> None:
        """Pinned states up into RAM, as pinning brought them: a server's pins outlive its restart (a restarted server
        had listed them pinned on disk and refused their hibernation as "resident"; docs hunt, session 49). Called by
        the server only (`wkvm states`, `wkvm chat` and a replica absorbing a slot's directory read no pins). One that
        the tiers (smaller this time) cannot hold stays on disk, pinned, with a warning; one that cannot be read is
        left to its first use, whose request gets the error (it must not keep the server from starting)."""
        with self._lock:
            for blob in sorted(self._pinned - self._lost):
                if self.usage.known(blob):
                    self._bring_up(blob)

    def keep_pin(self, owner: str, handle: str) -> None:
        """Record the pin a state had where it came from (a cluster replica taking an orphaned slot's states) and bring
        it up as a restart does: where the tiers have no room it stays pinned on disk, logged (the merge had dropped
        every such pin; cluster hunt, session 49)."""
        with self._lock:
            rec = self._record(owner, handle, with_ids=False)
            self.index.set_pinned(owner, rec.name, rec.version, True)
            self._pinned = self.index.pinned_blobs()
            self._bring_up(rec.blob)

    def _bring_up(self, blob: str) -> None:
        try:
            self._cache(blob, self.files.read(blob, verify=self.verify_on_load), "device")
        except Exception as e:  # noqa: BLE001  # a damaged file's torch error, a device out of memory: logged
            log.warning("pinned state %s not brought up at start: %s", blob[:12], e)
            return
        if self.tier_of(blob) == "disk":
            log.warning("pinned state %s stays on disk: pinned states fill --state-device-bytes and "
                        "--state-host-bytes; unpin some or raise them", blob[:12])  # fmt: skip

    # --- records -------------------------------------------------------------------------------
    def get(self, owner: str, handle: str) -> StateRecord:
        """The record with its token history."""
        return self._record(owner, handle, with_ids=True)

    def has(self, owner: str, handle: str) -> bool:
        name, version = parse_handle(handle)
        rec = self.index.get(owner, name, version, False)
        return rec is not None and not self._hidden(rec)

    def _hidden(self, rec: StateRecord) -> bool:
        """A record a full disk kept the index from deleting: its file is gone, or its delete is not committed yet."""
        return rec.blob in self._lost or (rec.owner, rec.name, rec.version) in self._deletes

    def _record(self, owner: str, handle: str, with_ids: bool) -> StateRecord:
        name, version = parse_handle(handle)
        rec = self.index.get(owner, name, version, with_ids)
        if rec is None or self._hidden(rec):
            raise StateNotFound(f"state {handle[:160]!r} not found")
        rec.tier = self.tier_of(rec.blob)
        return rec

    def list(self, owner: str) -> builtins.list[StateRecord]:
        """The owner's records, without token histories (`token_ids` is None; `get` has them)."""
        recs = [r for r in self.index.list(owner) if not self._hidden(r)]
        for r in recs:
            r.tier = self.tier_of(r.blob)
        return recs

    def token_ids(self, rec: StateRecord) -> builtins.list[int]:
        """A record's token history (for records from `list`)."""
        return rec.token_ids if rec.token_ids is not None else self.index.token_ids(rec.token_digest)

    def tier_stats(self) -> dict[str, tuple[int | None, int]]:
        """tier -> (states held, bytes) for metrics; on disk only bytes (the state files and the index)."""
        with self._lock:
            device, host = self.device_cache, self.host_cache
            return {"device": (len(device.items), device.nbytes), "host": (len(host.items), host.nbytes),
                    "disk": (None, self.disk_bytes)}  # fmt: skip

    def tier_of(self, blob: str) -> str:
        if blob in self.device_cache:
            return "device"
        return "host" if blob in self.host_cache else "disk"

    @full_disk_is_an_answer
    def put(
        self,
        owner: str,
        name: str,
        state: State,
        token_ids: builtins.list[int],
        parent: str | None = None,
        op: str = "create",
        op_params: dict[str, Any] | None = None,
        durable: bool = True,
        version: int | None = None,
        created_at: float | None = None,
        frozen: bool = False,
        tenant_quota: bool = True,
    ) -> StateRecord | None:
        """Store a new immutable version (state is batched [1, ...]); returns once it is durable.

        A user state raises QuotaExceeded when users' states and the index leave no room (internal files are evicted
        first), StateFileError (HistoryTooLong) for a history it cannot take. An internal state (owner with '#')
        raises neither: None means it was not kept. durable=False (internal states only) is write-back: the file is
        written, unfsynced, when the state leaves RAM, and the index commit is not fsynced; a crash may lose such
        states (recovery drops their records), never corrupt anything. `version` and `created_at` keep a moved
        state's identity (`adopt_bytes`); by default the next version and now. `frozen`: the caller never changes
        these tensors (a finished request's copies), so storing them again skips hashing them (`DigestMemo`).
        `tenant_quota`: False for a state moved here (its tenant's room is counted per replica; a move or a merge of
        slots relocates what it holds, it saves nothing new).
        """
        valid_name(name)
        self.spec.check(state)
        internal = is_internal(owner)
        durable = durable or not internal
        try:
            check_history(token_ids, self.vocab_size)
            n_kv = self.spec.kv_length(state)
            self.check_kv_tokens(n_kv)
            statefile.check_kv_count(self.spec, n_kv, len(token_ids))  # as an imported file is checked
        except StateFileError as e:
            if internal:  # a cache entry the store cannot take is simply not kept
                self._not_kept(len(token_ids), str(e))
                return None
            raise
        tensors = statefile.unbatch(state)
        blob = blob_name(owner, self._digests.digest(self.spec, state, tensors, frozen))
        with self._lock:
            ids: builtins.list[int] = list(token_ids)
            meta = StateMeta(
                self.fingerprint, self.spec.spec_hash, ids, name, 0, parent, op, op_params or {},
                time.time() if created_at is None else created_at,
            )
            growth = self._index_growth(owner, token_digest(ids), len(ids))
            if internal and not self._admit_internal(blob, tensors, meta, growth):
                self._not_kept(len(ids), "it does not fit the checkpoint budget (--checkpoint-bytes) or the disk "
                               "quota's room (--state-disk-quota)")  # fmt: skip
                return None
            if version is not None and self.index.get(owner, name, version, with_ids=False) is not None:
                raise ValueError(f"state {name}@{version} exists already")  # before any file: none is left over
            version = self.index.next_version(owner, name) if version is None else version  # may refuse: first
            was_user = self.usage.is_user(blob)
            if not internal:
                self._admit_user(owner, blob, tensors, meta, growth, tenant_quota)
            # the tensors' own bytes: an attention state's keys and values grow with its tokens (spec.nbytes is only
            # the fixed part, 0 for a pure transformer)
            nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
            rec = StateRecord.new(owner, version, meta, blob, nbytes)
            try:
                self.index.insert(rec, durable)
            except (OSError, sqlite3.Error) as e:  # the file just written (or counted) had been left, orphaned
                if not self.index.blob_owners(blob):
                    self._remove_blob(blob)
                elif not internal and not was_user and all(is_internal(o) for o in self.index.blob_owners(blob)):
                    self.usage.add_internal(blob, self.usage.user[blob], on_disk=True)  # still only a cache's (its
                    # file written now, if only RAM had held it)
                if internal and is_disk_full(e):  # a cache entry: not kept, as when it does not fit
                    self._not_kept(len(ids), DISK_FULL_WHY)
                    return None
                raise
            self._lost.discard(blob)  # its file is back: records of it dropped on a full disk may show again
            self._retry_deletes()  # the index has room again
            self._cache(blob, tensors, "device")
            if not self.usage.known(blob):  # an internal state evicted while the tiers made room
                self._not_kept(len(ids), "it is larger than the state tiers hold (--state-device-bytes, "
                               "--state-host-bytes)")  # fmt: skip
                return None
            rec.tier = self.tier_of(blob)
            return rec

    def _not_kept(self, n_tokens: int, why: str) -> None:
        """An internal state not kept: counted, and said once at WARNING (prefix reuse silently stopped at a length
        whose checkpoint fits nowhere: every later turn ran fresh), then at DEBUG."""
        self.internal_not_kept += 1
        level = logging.WARNING if self.internal_not_kept == 1 else logging.DEBUG
        fix = "free disk space" if why == DISK_FULL_WHY else "raise the limit for reuse at that length"
        log.log(level, "a reuse checkpoint of %d tokens was not kept: %s. Answers are unchanged; prompts past it are "
                "computed afresh (%s; later ones are logged at debug level)", n_tokens, why, fix)  # fmt: skip

    @property
    def max_tokens(self) -> int:
        """The longest token history a state may have: the file format's cap, and for attention models
        --max-state-tokens (keys and values grow with the history; the pending token holds none)."""
        return min(MAX_HISTORY_TOKENS, self.limits.kv_tokens + 1) if self.spec.has_kv else MAX_HISTORY_TOKENS

    def check_kv_tokens(self, n_kv: int) -> None:
        if n_kv > self.limits.kv_tokens:
            raise HistoryTooLong(f"the state caches keys and values of {n_kv} tokens; a stored state caches at most "
                                 f"{self.limits.kv_tokens} (--max-state-tokens; a history of "
                                 f"{self.limits.kv_tokens + 1}): start a shorter one")  # fmt: skip

    def put_user(self, owner: str, name: str, state: State, token_ids: builtins.list[int], parent: str | None = None,
                 op: str = "create", op_params: dict[str, Any] | None = None) -> StateRecord:  # fmt: skip
        """`put` for a user's state, which is stored or raises, never None."""
        if is_internal(owner):
            raise ValueError(f"owner {owner!r} is internal: use put")
        rec = self.put(owner, name, state, token_ids, parent, op, op_params)
        assert rec is not None  # put returns None only for internal owners
        return rec

    def _admit_internal(self, blob: str, tensors: State, meta: StateMeta, index_growth: int) -> bool:
        """Make room in the internal budget and the room the quota leaves (evicting least recently used internal
        states); False if it cannot fit."""
        known = self.usage.known(blob)
        size, file = self.usage.footprint(blob) if known else (state_file_bytes(self.spec, meta.n_tokens), 0)
        victims = self.usage.internal_room(blob, size, file, self._index_bytes() + index_growth)
        if victims is None:
            return False
        for b in victims:
            self._evict(b)
        if known:
            self.usage.touch(blob)
        else:
            self.usage.add_internal(blob, size, on_disk=False)
            self._unwritten[blob] = (tensors, meta)
        return True

    def _admit_user(self, owner: str, blob: str, tensors: State, meta: StateMeta, index_growth: int,
                    tenant_quota: bool = True) -> None:  # fmt: skip
        """Write a user state's file durably (or make an internal one durable), within the quota (and the owner's
        tenant's, unless `tenant_quota` is False: a state moved between replicas, not a new save)."""
        data = None
        if self.usage.is_user(blob):
            size, new = self.usage.user[blob], 0
        elif blob in self.usage.internal_files:
            size = new = self.usage.internal[blob]
        else:
            data = statefile.encode(self.spec, tensors, meta, digest=blob_digest(blob))
            size = new = len(data)
        for b in self.usage.user_room(blob, new + index_growth, self._index_bytes(), owner, new, tenant_quota):
            self._evict(b)
        if data is not None:
            self._unwritten.pop(blob, None)
            self.files.write(blob, data, durable=True)
        elif new:  # a write-back file becomes a user's: make it durable now
            self.files.make_durable(blob)
        if new:  # fsynced: a restart need not read it back (a cache: a full index only costs that read)
            with contextlib.suppress(sqlite3.OperationalError):
                self.index.set_checked(blob, self.files.stat_key(blob))
        self.usage.add_user(blob, size, owner)

    def check_room(self, owner: str, n_tokens: int = 0) -> None:
        """Raise QuotaExceeded now if a new state of `owner` could not be stored (checked before generating one to
        save); internal files do not count: they would be evicted."""
        if not is_internal(owner):
            size = state_file_bytes(self.spec, n_tokens)
            self.usage.user_room("", size + INDEX_COMMIT_BYTES, self._index_bytes(), owner, size)

    def _index_growth(self, owner: str, digest: str, n_tokens: int) -> int:
        """A new history (int32 ids) lands in the WAL, then in the database. Counted as new unless one of `owner`'s
        own records holds it: whether another tenant's does had changed the room asked for (and the 413 said how
        much), so a tenant at the quota's edge could confirm another's exact prompt or saved text."""
        return INDEX_COMMIT_BYTES + (0 if self.index.has_history(digest, owner) else 2 * 4 * n_tokens)

    def _index_bytes(self) -> int:
        return self.index.file_bytes(reserve_wal=True)

    @full_disk_is_an_answer
    def fork(self, owner: str, handle: str, name: str) -> StateRecord:
        """A new state sharing the source's tensors (no copy until someone writes, and nobody does)."""
        valid_name(name)
        with self._lock:
            src = self._record(owner, handle, with_ids=False)
            if not is_internal(owner):
                for b in self.usage.user_room(src.blob, INDEX_COMMIT_BYTES, self._index_bytes(), owner):
                    self._evict(b)
            rec = replace(src, owner=owner, name=name, parent=src.handle, op="fork", op_params={}, pinned=False,
                          version=self.index.next_version(owner, name), created_at=time.time())  # fmt: skip
            self.index.insert(rec)  # its token_ids are None: the history is stored already
            return self.get(owner, rec.handle)

    @full_disk_is_an_answer
    def delete(self, owner: str, handle: str, durable: bool = True) -> None:
        with self._lock:
            rec = self._record(owner, handle, with_ids=False)
            try:
                self.index.delete(owner, rec.name, rec.version, durable)
            except sqlite3.OperationalError as e:
                # a full disk must not keep a user from freeing it: where no other user's record holds the file
                # (internal ones are a cache), it goes first and its records read as not found; then the commit is
                # tried again, and if even that fails the record stays hidden until a later commit goes through
                # (`_retry_deletes`: the same tensors saved again must not bring it back) or the next start drops
                # it, its file gone (as after a crash between the two)
                others = self.index.blob_record_owners(rec.blob)
                others.remove(owner)
                if not is_disk_full(e) or not all(is_internal(o) for o in others):
                    raise
                self._remove_blob(rec.blob)
                self._lost.add(rec.blob)
                try:
                    self.index.delete(owner, rec.name, rec.version, durable)
                except sqlite3.OperationalError:
                    self._deletes.append((owner, rec.name, rec.version))
                self._pinned = self.index.pinned_blobs() - self._lost
                return
            owners = self.index.blob_owners(rec.blob)
            if not owners:
                self._remove_blob(rec.blob)
            elif self.usage.is_user(rec.blob) and all(is_internal(o) for o in owners):
                self.usage.add_internal(rec.blob, self.usage.user[rec.blob], on_disk=True)  # now a cache entry
                self._settle()
            self._pinned = self.index.pinned_blobs()

    def _retry_deletes(self) -> None:
        """Commit the deletes a full disk had refused (their records are hidden until then)."""
        while self._deletes:
            try:
                self.index.delete(*self._deletes[0])
            except sqlite3.OperationalError:
                return
            self._deletes.pop(0)

    def discard(self, owner: str, handle: str, durable: bool = True) -> bool:
        """Delete if present; True when something was deleted."""
        try:
            self.delete(owner, handle, durable)
            return True
        except StateNotFound:
            return False

    @full_disk_is_an_answer
    def set_pinned(self, owner: str, handle: str, pinned: bool) -> StateRecord:
        with self._lock:
            rec = self._record(owner, handle, with_ids=False)
            if pinned:  # a pinned state is kept resident: bring it up first, then LRU never evicts it
                self.load(owner, rec.handle)
                if self.tier_of(rec.blob) == "disk":  # no room beside other pins: the pin would be a false promise
                    raise PinNoRoom(f"state {rec.handle!r} cannot be pinned: pinned states fill the device tier "
                                    f"({self.device_cache.limit} bytes) and the host tier ({self.host_cache.limit} "
                                    "bytes); unpin another state, or start the server with larger "
                                    "--state-device-bytes / --state-host-bytes")  # fmt: skip
            self.index.set_pinned(owner, rec.name, rec.version, pinned)
            self._pinned = self.index.pinned_blobs()
            return self.get(owner, rec.handle)

    # --- internal states: eviction -------------------------------------------------------------
    def _evict(self, blob: str) -> None:
        """Drop an internal-only blob: its records, its tensors in RAM, its file."""
        dropped = self.index.delete_blob_records(blob, durable=False)
        log.debug("internal state %s evicted (%d record(s))", blob[:12], len(dropped))
        self._remove_blob(blob)
        if self.on_evict is not None:
            for owner, handle in dropped:
                self.on_evict(owner, handle)

    def _remove_blob(self, blob: str) -> None:
        self.device_cache.pop(blob)
        self.host_cache.pop(blob)
        self._unwritten.pop(blob, None)
        self.files.remove(blob)
        self.usage.forget(blob)

    def _settle(self) -> None:
        """Evict internal states until they fit their budget and all files the quota."""
        for b in self.usage.excess(self._index_bytes()):
            self._drop(b)  # (at a start on a full disk too)

    # --- tensors and tiers ---------------------------------------------------------------------
    def load(self, owner: str, handle: str) -> tuple[StateRecord, State]:
        """The record and its state (batched [1, ...] on the device); promotes it to the device tier."""
        with self._lock:
            rec = self.get(owner, handle)
            tensors = self.device_cache.get(rec.blob)
            if tensors is None:
                tensors = self.host_cache.pop(rec.blob)
                if tensors is None:
                    tensors = self.files.read(rec.blob, verify=self.verify_on_load)
                self._cache(rec.blob, tensors, "device")
            self.usage.touch(rec.blob)
            rec.tier = self.tier_of(rec.blob)
            return rec, {k: v.unsqueeze(0) for k, v in tensors.items()}

    @full_disk_is_an_answer
    def hibernate(self, owner: str, handle: str, tier: str) -> StateRecord:
        """Move a state down to 'host' (out of device memory) or 'disk' (out of RAM)."""
        if tier not in ("host", "disk"):
            raise ValueError("tier must be 'host' or 'disk'")
        with self._lock:
            rec = self._record(owner, handle, with_ids=False)
            if rec.blob in self._pinned:  # pinning keeps it resident (docs/state-file.md); it (or a state with the
                # same tensors) would have gone to disk while still listed as pinned
                what = handle if rec.pinned else f"{handle} (the same tensors as a pinned state)"
                raise StatePinned(f"state {what} is pinned, which keeps it resident: unpin it first")
            tensors = self.device_cache.pop(rec.blob)
            if tier == "host" and tensors is not None:
                self._cache(rec.blob, tensors, "host")
            elif tier == "disk":
                self.host_cache.pop(rec.blob)
                self._spill(rec.blob)
            return self.get(owner, handle)

    def _cache(self, blob: str, tensors: State, tier: str) -> None:
        """Place tensors in `tier`; evicted entries move down a tier (host evictions just leave RAM)."""
        if not self.usage.known(blob):
            return  # evicted meanwhile (an internal state making room for another)
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
                self._spill(b)  # leaving RAM: a write-back state gets its file now

    def _spill(self, blob: str, make_room: bool = True) -> None:
        """Write a write-back state's file (not fsynced) if the quota and the internal budget leave room (evicting
        older internal files unless not `make_room`); else drop it."""
        pending = self._unwritten.pop(blob, None)
        if pending is None:
            return
        data = statefile.encode(self.spec, *pending, digest=blob_digest(blob))
        victims = self.usage.internal_room(blob, len(data), len(data), self._index_bytes())
        if victims is None or (victims and not make_room):
            self._drop(blob)  # (its records may not be deletable now: a full disk)
            return
        for b in victims:
            self._drop(b)
        try:
            self.files.write(blob, data, durable=False)
        except OSError as e:  # a full disk: the entry is dropped; it had failed the user's save that pushed it out
            if not is_disk_full(e):
                raise
            log.warning("internal state %s dropped: its file could not be written (%s)", blob[:12], e)
            self._drop(blob)
            return
        self.usage.add_internal(blob, len(data), on_disk=True)

    def _drop(self, blob: str) -> None:
        """Evict an internal blob whose records the index may be unable to delete now (a full disk): its tensors
        and file go, and until a restart drops the records (their file is missing) they read as not found."""
        try:
            self._evict(blob)
        except sqlite3.OperationalError as e:
            if not is_disk_full(e):
                raise
            self._remove_blob(blob)
            self._lost.add(blob)

    # --- files ---------------------------------------------------------------------------------
    def _blob_path(self, blob: str) -> Path:
        return self.files.path(blob)

    def export_bytes(self, owner: str, handle: str) -> bytes:
        rec, state = self.load(owner, handle)
        meta = StateMeta(rec.fingerprint, rec.spec_hash, self.token_ids(rec), rec.name, rec.version, rec.parent,
                         rec.op)  # fmt: skip
        meta.op_params, meta.created_at = rec.op_params, rec.created_at
        return statefile.encode(self.spec, statefile.unbatch(state), meta)

    @full_disk_is_an_answer
    def import_bytes(self, owner: str, data: bytes, name: str | None = None, context: int | None = None,
                     page_max: float | None = None) -> StateRecord:  # fmt: skip
        """Validate every field of an exported file, then store it as a new version. `context`: the model's context
        (tokens), which a state must leave room in to generate (as a created one must); `page_max`: the largest
        key or value the server's pages hold (float16's 65,504; None: float32 pages, the file's own bound)."""
        tensors, meta = statefile.decode(data, self.spec, self.fingerprint, self.vocab_size)
        if context is not None and meta.n_tokens >= context:
            raise StateFileError(f"the state holds {meta.n_tokens} tokens, which leaves no room to generate within "
                                 f"this model's context of {context} tokens")  # fmt: skip
        if page_max is not None:  # it would become inf in the pages, and the attention over it garbage, silently
            statefile.check_magnitude(self.spec, tensors, page_max, paged_only=True,
                                      why="this server keeps keys and values in float16 pages (--kv-dtype float32 "
                                          "holds it)")  # fmt: skip
        # the source's own provenance, kept (its rule and parameters, when it was made; they were dropped): one level
        # deep whatever the number of hops, so that an import's export imports again
        if meta.op == "import":
            lineage = {**meta.op_params, "via": f"{meta.name}@{meta.version}"}
        else:
            lineage = {"from": f"{meta.name}@{meta.version}", "parent": meta.parent, "op": meta.op,
                       "created_at": meta.created_at, "op_params": meta.op_params}  # fmt: skip
        if not statefile.nests_within_limits(lineage):  # a source at the import limits: its parameters cannot
            if meta.op == "import":  # nest one deeper, nor take one more key (its export had not imported again)
                lineage = {"via": lineage["via"]}
            else:
                lineage.pop("op_params")
        state = {k: v.unsqueeze(0) for k, v in tensors.items()}
        return self.put_user(owner, name or meta.name, state, meta.token_ids, op="import", op_params=lineage)

    @full_disk_is_an_answer
    def adopt_bytes(self, owner: str, data: bytes, tenant_quota: bool = True) -> StateRecord:
        """Store an exported file under its own name and version, with its lineage and creation time: a state moved
        here from another replica keeps its handle. Every field is validated as for an import. `tenant_quota`: False
        for a relocation the server makes (a restart with fewer replicas merging slots had been refused, and the
        launcher had failed; review, session 48), not for a tenant's own migrate (else one key could pile its states
        onto one replica, past its room there)."""
        tensors, meta = statefile.decode(data, self.spec, self.fingerprint, self.vocab_size)
        state = {k: v.unsqueeze(0) for k, v in tensors.items()}
        rec = self.put(owner, meta.name, state, meta.token_ids, meta.parent, meta.op, meta.op_params,
                       version=meta.version, created_at=meta.created_at, tenant_quota=tenant_quota)  # fmt: skip
        assert rec is not None  # a user's state is stored or raises
        return rec

    def versions(self, owner: str, name: str) -> builtins.list[StateRecord]:
        """Every stored version of a name, oldest first."""
        return sorted((r for r in self.list(owner) if r.name == name), key=lambda r: r.version)

    def close(self) -> None:
        """Write back what only RAM holds (so checkpoints survive a clean restart) while the quota and the internal
        budget leave room, most recently used first; drop the rest. Then close the index."""
        with self._lock:
            for blob in reversed(list(self.usage.internal)):
                try:
                    self._spill(blob, make_room=False)
                except (OSError, sqlite3.Error) as e:  # one that cannot be written must not keep the index open
                    log.warning("internal state %s not written back at shutdown: %s", blob[:12], e)
            self._retry_deletes()
        self.index.close()
        key, self._dir_key = self._dir_key, None  # a second close must not let go of another opener's hold
        if key is not None:
            unlock_dir(key)
