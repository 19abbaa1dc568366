"""The state index: SQLite (WAL, synchronous=FULL) of immutable `name@version` records per owner.

A token history is stored once, as int32 little-endian ids keyed by its digest (table `histories`), however many
records share it (forks, versions of one conversation), and is removed with the last record using it: ten forks of
a 1M-token state add ten small rows, not ten 7 MB JSON copies. Listing never reads histories. The last version
issued per (owner, name) is kept in `names`, so a deleted version number is never issued again.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import logging
import sqlite3
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from wkvm.state.quota import is_internal
from wkvm.state.statefile import MAX_VERSION, StateMeta, token_digest

log = logging.getLogger("wkvm.state")
STATES = """
CREATE TABLE IF NOT EXISTS states (
    owner TEXT NOT NULL,
    name TEXT NOT NULL,
    version INTEGER NOT NULL,
    parent TEXT,
    op TEXT NOT NULL,
    op_params TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    spec_hash TEXT NOT NULL,
    token_digest TEXT NOT NULL,
    n_tokens INTEGER NOT NULL,
    pinned INTEGER NOT NULL DEFAULT 0,
    blob TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    created_at REAL NOT NULL,
    PRIMARY KEY (owner, name, version)
);
"""
SCHEMA = """
CREATE INDEX IF NOT EXISTS states_blob ON states (blob);
CREATE INDEX IF NOT EXISTS states_history ON states (token_digest);
CREATE TABLE IF NOT EXISTS histories (
    digest TEXT PRIMARY KEY,
    ids BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS names (
    owner TEXT NOT NULL,
    name TEXT NOT NULL,
    last_version INTEGER NOT NULL,
    PRIMARY KEY (owner, name)
);
CREATE TABLE IF NOT EXISTS checked_files (
    blob TEXT PRIMARY KEY,
    stat TEXT NOT NULL
);
"""
COLUMNS = (
    "owner", "name", "version", "parent", "op", "op_params", "fingerprint", "spec_hash",
    "token_digest", "n_tokens", "pinned", "blob", "bytes", "created_at",
)  # fmt: skip
WAL_PAGES = 64  # checkpoint the write-ahead log past this many pages; one small commit adds at most ~16 more


@dataclass
class StateRecord:
    owner: str
    name: str
    version: int
    parent: str | None
    op: str
    op_params: dict[str, Any]
    fingerprint: str
    spec_hash: str
    token_ids: builtins.list[int] | None  # None in listings: loaded by get/load only
    token_digest: str
    n_tokens: int
    pinned: bool
    blob: str  # blobs.blob_name: the sha256 of the tensor bytes (per tenant); the file blobs/<blob>.state holds them
    bytes: int
    created_at: float
    tier: str = field(default="disk", compare=False)

    @classmethod
    def new(cls, owner: str, version: int, meta: StateMeta, blob: str, nbytes: int) -> StateRecord:
        """The record of a state just stored from `meta` (unpinned)."""
        return cls(
            owner=owner,
            name=meta.name,
            version=version,
            parent=meta.parent,
            op=meta.op,
            op_params=meta.op_params,
            fingerprint=meta.fingerprint,
            spec_hash=meta.spec_hash,
            token_ids=meta.token_ids,
            token_digest=token_digest(meta.token_ids),
            n_tokens=meta.n_tokens,
            pinned=False,
            blob=blob,
            bytes=nbytes,
            created_at=meta.created_at,
        )

    @property
    def handle(self) -> str:
        return f"{self.name}@{self.version}"

    def info(self, model_name: str) -> dict[str, Any]:
        """The StateInfo object of the HTTP API."""
        return {
            "handle": self.handle, "name": self.name, "version": self.version, "parent": self.parent,
            "op": self.op, "op_params": self.op_params, "n_tokens": self.n_tokens, "token_digest": self.token_digest,
            "model": model_name, "fingerprint": self.fingerprint, "tier": self.tier, "pinned": self.pinned,
            "bytes": self.bytes, "created_at": self.created_at,
        }  # fmt: skip


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def pack_ids(token_ids: builtins.list[int]) -> bytes:
    return np.asarray(token_ids, dtype="<i4").tobytes()  # callers check ids fit (statefile.check_history)


def unpack_ids(data: bytes) -> builtins.list[int]:
    ids: builtins.list[int] = np.frombuffer(data, dtype="<i4").tolist()
    return ids


class IndexDamaged(ValueError):
    """The state directory's index.sqlite cannot be opened: not a database SQLite can read whole (disk damage, a
    foreign file), or a disk with no room to open it."""


class Damaged(sqlite3.DatabaseError):
    """What PRAGMA quick_check found."""


class StateIndex:
    def __init__(self, path: Path):
        self.path = path
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        try:
            self._open()
        except sqlite3.DatabaseError as e:  # every read had been a 500 (the server started healthy), the CLI a
            self._db.close()  # traceback (crash-safety hunt, session 47)
            code = (getattr(e, "sqlite_errorcode", 0) or 0) & 0xFF
            if isinstance(e, Damaged) or code in (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB):
                raise IndexDamaged(f"the state index {path} is damaged ({e}): restore the state directory from a "
                                   "backup, or move it away and start with an empty one") from None  # fmt: skip
            # a full disk or an I/O error: the file may be sound (opening it in WAL mode needs room)
            raise IndexDamaged(f"the state index {path} cannot be opened ({e}): free disk space (or mend the file "
                               "system) and start again; nothing in the directory was changed") from None  # fmt: skip

    def _open(self) -> None:
        with self._lock:
            # a page-level check of the whole file (the index is small: a few ms a MB): damage shows at the start
            problems = [r[0] for r in self._db.execute("PRAGMA quick_check").fetchall()]
            if problems != ["ok"]:
                raise Damaged(problems[0])
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute(f"PRAGMA wal_autocheckpoint={WAL_PAGES}")  # the WAL counts in the quota: keep it small
            self._db.execute("PRAGMA journal_size_limit=0")  # and shrink it at each checkpoint
            self.wal_reserve = (WAL_PAGES + 16) * self._db.execute("PRAGMA page_size").fetchone()[0]
            self._create_tables()
            self._migrate_json_histories()

    def _create_tables(self) -> None:
        for statement in (STATES + SCHEMA).split(";"):  # one by one: executescript would commit an open transaction
            if statement.strip():
                self._db.execute(statement)

    def _migrate_json_histories(self) -> None:
        """Index files from before shared histories hold every record's ids as JSON (column states.token_ids):
        move each history to `histories` once, rebuild `states` without the column, seed `names`."""
        if "token_ids" not in [r[1] for r in self._db.execute("PRAGMA table_info(states)")]:
            return
        log.info("state index %s: moving token histories to the shared table (one-time upgrade)", self.path)
        db = self._db
        with db:
            db.execute("BEGIN IMMEDIATE")
            for (digest,) in db.execute("SELECT DISTINCT token_digest FROM states").fetchall():
                (ids,) = db.execute("SELECT token_ids FROM states WHERE token_digest = ? LIMIT 1", (digest,)).fetchone()
                db.execute("INSERT OR IGNORE INTO histories VALUES (?, ?)", (digest, pack_ids(json.loads(ids))))
            db.execute("ALTER TABLE states RENAME TO states_json")
            db.execute("DROP INDEX states_blob")
            db.execute("DROP INDEX states_history")
            self._create_tables()
            db.execute(f"INSERT INTO states SELECT {', '.join(COLUMNS)} FROM states_json")
            db.execute("DROP TABLE states_json")
            rows = db.execute("SELECT owner, name, MAX(version) FROM states GROUP BY owner, name").fetchall()
            db.executemany("INSERT OR IGNORE INTO names VALUES (?, ?, ?)", [r for r in rows if not is_internal(r[0])])
        db.execute("VACUUM")  # give the JSON copies' pages back to the file system

    def close(self) -> None:
        self._db.close()

    def file_bytes(self, reserve_wal: bool = False) -> int:
        """Bytes on disk of the index: the database, its write-ahead log and shared-memory file. reserve_wal counts
        the log at the most it reaches between checkpoints (what a quota must leave room for)."""
        db, wal, shm = (_size(self.path.with_name(self.path.name + suffix)) for suffix in ("", "-wal", "-shm"))
        return db + (max(wal, self.wal_reserve) if reserve_wal else wal) + shm

    def _rows(self, sql: str, args: tuple[object, ...] = (), with_ids: bool = False) -> builtins.list[StateRecord]:
        cols = ", ".join(COLUMNS)
        if with_ids:  # a record whose history is missing is not served (its binding cannot be proven)
            query = f"SELECT {cols}, ids FROM states JOIN histories ON digest = token_digest {sql}"
        else:
            query = f"SELECT {cols}, NULL FROM states {sql}"
        with self._lock:
            rows = self._db.execute(query, args).fetchall()
        return [self._record(r) for r in rows]

    @staticmethod
    def _record(row: tuple[Any, ...]) -> StateRecord:
        d = dict(zip(COLUMNS, row[:-1], strict=True))
        d["op_params"] = json.loads(d["op_params"])
        d["pinned"] = bool(d["pinned"])
        return StateRecord(**d, token_ids=None if row[-1] is None else unpack_ids(row[-1]))

    def _sync(self, durable: bool) -> None:
        """Commits fsync (synchronous=FULL) unless `durable` is False (caches such as prefix checkpoints): then
        synchronous=NORMAL, whose commits only the OS has until the next durable commit persists them. Not OFF: under
        OFF an automatic checkpoint copies the log into the database without fsyncing it and the next commit restarts
        the log, so a user record acknowledged before it was durable nowhere (a power loss could drop it, and the
        start-up sweep then delete its file); NORMAL syncs the log before a checkpoint and the database after it."""
        self._db.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")

    @contextlib.contextmanager
    def _writing(self, durable: bool) -> Iterator[None]:
        """One transaction under the lock, fsynced unless not `durable` (`_sync`), and FULL again however it ends: an
        insert that failed had left NORMAL on, so later commits (a pin) skipped their fsync (hunt, session 47)."""
        with self._lock:
            self._sync(durable)
            try:
                with self._db:
                    yield
            finally:
                self._sync(True)

    def insert(self, rec: StateRecord, durable: bool = True) -> None:
        """Add a record; its history is stored if new (rec.token_ids may be None only when it is already there)."""
        values = [getattr(rec, c) for c in COLUMNS]
        values[COLUMNS.index("op_params")] = json.dumps(rec.op_params)
        values[COLUMNS.index("pinned")] = int(rec.pinned)
        with self._writing(durable):
            self._db.execute("BEGIN IMMEDIATE")
            if rec.token_ids is not None:
                history = (rec.token_digest, pack_ids(rec.token_ids))
                self._db.execute("INSERT OR IGNORE INTO histories VALUES (?, ?)", history)
            self._db.execute(f"INSERT INTO states VALUES ({', '.join('?' * len(COLUMNS))})", values)
            if not is_internal(rec.owner):  # internal names are caches: not kept once their states go
                self._db.execute(
                    "INSERT INTO names VALUES (?, ?, ?) ON CONFLICT (owner, name) "
                    "DO UPDATE SET last_version = MAX(last_version, excluded.last_version)",
                    (rec.owner, rec.name, rec.version),
                )

    def reserve_versions(self, owner: str, name: str, last: int) -> None:
        """Never issue `last` or a version below it for this name (a name moved here with its history of issues)."""
        with self._lock, self._db:
            self._db.execute("INSERT INTO names VALUES (?, ?, ?) ON CONFLICT (owner, name) "
                             "DO UPDATE SET last_version = MAX(last_version, excluded.last_version)",
                             (owner, name, last))  # fmt: skip

    def issued(self) -> builtins.list[tuple[str, str, int]]:
        """(owner, name, last version issued) of every user name: what a store taking these states over reserves."""
        with self._lock:
            rows = self._db.execute("SELECT owner, name, last_version FROM names").fetchall()
        return [(str(o), str(n), int(v)) for o, n, v in rows]

    def next_version(self, owner: str, name: str) -> int:
        """One more than the last version ever issued for this name (kept after deletes: a handle names one state)."""
        with self._lock:
            row = self._db.execute(
                "SELECT MAX(v) FROM (SELECT last_version AS v FROM names WHERE owner = ? AND name = ? "
                "UNION ALL SELECT MAX(version) FROM states WHERE owner = ? AND name = ?)",
                (owner, name, owner, name),
            ).fetchone()
        if (row[0] or 0) >= MAX_VERSION:
            raise ValueError(f"state {name!r} has used every version number; choose another name")
        return (row[0] or 0) + 1

    def get(self, owner: str, name: str, version: int | None, with_ids: bool = True) -> StateRecord | None:
        if version is None:
            rows = self._rows("WHERE owner = ? AND name = ? ORDER BY version DESC LIMIT 1", (owner, name), with_ids)
        else:
            rows = self._rows("WHERE owner = ? AND name = ? AND version = ?", (owner, name, version), with_ids)
        return rows[0] if rows else None

    def list(self, owner: str | None = None) -> builtins.list[StateRecord]:
        """Records without their token ids (see token_ids)."""
        if owner is None:
            return self._rows("ORDER BY created_at")
        return self._rows("WHERE owner = ? ORDER BY name, version", (owner,))

    def token_ids(self, digest: str) -> builtins.list[int]:
        with self._lock:
            row = self._db.execute("SELECT ids FROM histories WHERE digest = ?", (digest,)).fetchone()
        if row is None:
            raise KeyError(f"token history {digest[:12]} is not in the index")
        return unpack_ids(row[0])

    def has_history(self, digest: str, owner: str | None = None) -> bool:
        """Whether the history is stored; with `owner`: whether one of that owner's records holds it (what a
        tenant's own request may learn: another's stored history must not show)."""
        with self._lock:
            if owner is None:
                row = self._db.execute("SELECT 1 FROM histories WHERE digest = ?", (digest,)).fetchone()
            else:
                row = self._db.execute("SELECT 1 FROM states WHERE token_digest = ? AND owner = ? LIMIT 1",
                                       (digest, owner)).fetchone()  # fmt: skip
            return row is not None

    def _forget_histories(self, digests: set[str]) -> None:
        """Remove histories no record uses any more (inside the caller's transaction)."""
        self._db.executemany(
            "DELETE FROM histories WHERE digest = ? AND NOT EXISTS (SELECT 1 FROM states WHERE token_digest = ?)",
            [(d, d) for d in digests],
        )

    def _forget_checks(self, blobs: set[str]) -> None:
        """Forget the checks of files no record uses any more (inside the caller's transaction): their files go."""
        self._db.executemany(
            "DELETE FROM checked_files WHERE blob = ? AND NOT EXISTS (SELECT 1 FROM states WHERE blob = ?)",
            [(b, b) for b in blobs],
        )

    def delete(self, owner: str, name: str, version: int, durable: bool = True) -> None:
        with self._writing(durable):
            self._db.execute("BEGIN IMMEDIATE")
            rows = self._db.execute(
                "DELETE FROM states WHERE owner = ? AND name = ? AND version = ? RETURNING token_digest, blob",
                (owner, name, version),
            ).fetchall()
            self._forget_histories({r[0] for r in rows})
            self._forget_checks({r[1] for r in rows})

    def set_pinned(self, owner: str, name: str, version: int, pinned: bool) -> None:
        with self._lock, self._db:
            self._db.execute(
                "UPDATE states SET pinned = ? WHERE owner = ? AND name = ? AND version = ?",
                (int(pinned), owner, name, version),
            )

    def blob_refs(self, blob: str) -> int:
        with self._lock:
            count: int = self._db.execute("SELECT COUNT(*) FROM states WHERE blob = ?", (blob,)).fetchone()[0]
            return count

    def blob_record_owners(self, blob: str) -> builtins.list[str]:
        """The owner of each record that holds `blob` (one entry per record)."""
        with self._lock:
            return [r[0] for r in self._db.execute("SELECT owner FROM states WHERE blob = ?", (blob,))]

    def blob_owners(self, blob: str) -> set[str]:
        return set(self.blob_record_owners(blob))

    def fingerprints(self) -> set[str]:
        """The models whose states the index holds."""
        with self._lock:
            return {r[0] for r in self._db.execute("SELECT DISTINCT fingerprint FROM states")}

    def pinned_blobs(self) -> set[str]:
        with self._lock:
            return {r[0] for r in self._db.execute("SELECT DISTINCT blob FROM states WHERE pinned = 1")}

    def checked_files(self) -> dict[str, str]:
        """Blob -> the file's stat (size, mtime, inode, model) when its checksum last passed or when it was written."""
        with self._lock:
            return dict(self._db.execute("SELECT blob, stat FROM checked_files").fetchall())

    def set_checked(self, blob: str, stat: str) -> None:
        """A cache: committed without fsync (the next durable commit persists it; losing it costs one re-check)."""
        with self._writing(False):
            self._db.execute("INSERT OR REPLACE INTO checked_files VALUES (?, ?)", (blob, stat))

    def forget_checked(self, blobs: set[str]) -> None:
        with self._lock, self._db:
            self._db.executemany("DELETE FROM checked_files WHERE blob = ?", [(b,) for b in blobs])

    def delete_blob_records(self, blob: str, durable: bool = True) -> builtins.list[tuple[str, str]]:
        """Delete every record of `blob`; their (owner, handle)s."""
        with self._writing(durable):
            self._db.execute("BEGIN IMMEDIATE")
            rows = self._db.execute(
                "DELETE FROM states WHERE blob = ? RETURNING token_digest, owner, name, version", (blob,)
            ).fetchall()
            self._forget_histories({r[0] for r in rows})
            self._forget_checks({blob})
            return [(r[1], f"{r[2]}@{r[3]}") for r in rows]
