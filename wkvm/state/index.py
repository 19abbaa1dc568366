"""The state index: one SQLite table (WAL, synchronous=FULL) of immutable `name@version` records per owner."""

from __future__ import annotations

import json
import sqlite3
import threading
from dataclasses import dataclass, field
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS states (
    owner TEXT NOT NULL,
    name TEXT NOT NULL,
    version INTEGER NOT NULL,
    parent TEXT,
    op TEXT NOT NULL,
    op_params TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    spec_hash TEXT NOT NULL,
    token_ids TEXT NOT NULL,
    token_digest TEXT NOT NULL,
    n_tokens INTEGER NOT NULL,
    pinned INTEGER NOT NULL DEFAULT 0,
    blob TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    created_at REAL NOT NULL,
    PRIMARY KEY (owner, name, version)
);
CREATE INDEX IF NOT EXISTS states_blob ON states (blob);
CREATE TABLE IF NOT EXISTS checked_files (
    blob TEXT PRIMARY KEY,
    stat TEXT NOT NULL
);
"""
COLUMNS = (
    "owner", "name", "version", "parent", "op", "op_params", "fingerprint", "spec_hash",
    "token_ids", "token_digest", "n_tokens", "pinned", "blob", "bytes", "created_at",
)  # fmt: skip


@dataclass
class StateRecord:
    owner: str
    name: str
    version: int
    parent: str | None
    op: str
    op_params: dict
    fingerprint: str
    spec_hash: str
    token_ids: list[int]
    token_digest: str
    n_tokens: int
    pinned: bool
    blob: str  # sha256 of the tensor bytes; the file blobs/<blob>.state holds them
    bytes: int
    created_at: float
    tier: str = field(default="disk", compare=False)

    @property
    def handle(self) -> str:
        return f"{self.name}@{self.version}"

    def info(self, model_name: str) -> dict:
        """The StateInfo object of the HTTP API."""
        return {
            "handle": self.handle, "name": self.name, "version": self.version, "parent": self.parent,
            "op": self.op, "op_params": self.op_params, "n_tokens": self.n_tokens, "token_digest": self.token_digest,
            "model": model_name, "fingerprint": self.fingerprint, "tier": self.tier, "pinned": self.pinned,
            "bytes": self.bytes, "created_at": self.created_at,
        }  # fmt: skip


def parse_handle(handle: str) -> tuple[str, int | None]:
    """'name@3' -> ('name', 3); 'name' -> ('name', None) meaning the latest version."""
    name, sep, version = handle.partition("@")
    if not sep:
        return name, None
    if not version.isdigit() or int(version) < 1:
        raise ValueError(f"invalid handle {handle!r}: the version after '@' must be a positive integer")
    return name, int(version)


class StateIndex:
    def __init__(self, path: Path):
        self.path = path
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(SCHEMA)

    def close(self) -> None:
        self._db.close()

    def _rows(self, sql: str, args: tuple = ()) -> list[StateRecord]:
        with self._lock:
            rows = self._db.execute(f"SELECT {', '.join(COLUMNS)} FROM states {sql}", args).fetchall()
        return [self._record(r) for r in rows]

    @staticmethod
    def _record(row: tuple) -> StateRecord:
        d = dict(zip(COLUMNS, row, strict=True))
        d["op_params"] = json.loads(d["op_params"])
        d["token_ids"] = json.loads(d["token_ids"])
        d["pinned"] = bool(d["pinned"])
        return StateRecord(**d)

    def _sync(self, durable: bool):
        """Commits fsync (synchronous=FULL) unless `durable` is False: then only the OS has them until the
        next durable commit, which persists both (used for caches such as prefix checkpoints)."""
        self._db.execute(f"PRAGMA synchronous={'FULL' if durable else 'OFF'}")

    def insert(self, rec: StateRecord, durable: bool = True) -> None:
        values = [getattr(rec, c) for c in COLUMNS]
        values[COLUMNS.index("op_params")] = json.dumps(rec.op_params)
        values[COLUMNS.index("token_ids")] = json.dumps(rec.token_ids)
        values[COLUMNS.index("pinned")] = int(rec.pinned)
        with self._lock:
            self._sync(durable)
            with self._db:
                self._db.execute("BEGIN IMMEDIATE")
                self._db.execute(f"INSERT INTO states VALUES ({', '.join('?' * len(COLUMNS))})", values)
            self._sync(True)

    def next_version(self, owner: str, name: str) -> int:
        with self._lock:
            row = self._db.execute(
                "SELECT MAX(version) FROM states WHERE owner = ? AND name = ?", (owner, name)
            ).fetchone()
        return (row[0] or 0) + 1

    def get(self, owner: str, name: str, version: int | None) -> StateRecord | None:
        if version is None:
            rows = self._rows("WHERE owner = ? AND name = ? ORDER BY version DESC LIMIT 1", (owner, name))
        else:
            rows = self._rows("WHERE owner = ? AND name = ? AND version = ?", (owner, name, version))
        return rows[0] if rows else None

    def list(self, owner: str | None = None) -> list[StateRecord]:
        if owner is None:
            return self._rows("ORDER BY created_at")
        return self._rows("WHERE owner = ? ORDER BY name, version", (owner,))

    def delete(self, owner: str, name: str, version: int, durable: bool = True) -> None:
        with self._lock:
            self._sync(durable)
            with self._db:
                self._db.execute("DELETE FROM states WHERE owner = ? AND name = ? AND version = ?",
                                 (owner, name, version))  # fmt: skip
            self._sync(True)

    def set_pinned(self, owner: str, name: str, version: int, pinned: bool) -> None:
        with self._lock, self._db:
            self._db.execute(
                "UPDATE states SET pinned = ? WHERE owner = ? AND name = ? AND version = ?",
                (int(pinned), owner, name, version),
            )

    def blob_refs(self, blob: str) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM states WHERE blob = ?", (blob,)).fetchone()[0]

    def pinned_blobs(self) -> set[str]:
        with self._lock:
            return {r[0] for r in self._db.execute("SELECT DISTINCT blob FROM states WHERE pinned = 1")}

    def checked_files(self) -> dict[str, str]:
        """Blob -> the file's stat (size, mtime, inode, model) when its checksum last passed or when it was written."""
        with self._lock:
            return dict(self._db.execute("SELECT blob, stat FROM checked_files").fetchall())

    def set_checked(self, blob: str, stat: str) -> None:
        """A cache: committed without fsync (the next durable commit persists it; losing it costs one re-check)."""
        with self._lock:
            self._sync(False)
            with self._db:
                self._db.execute("INSERT OR REPLACE INTO checked_files VALUES (?, ?)", (blob, stat))
            self._sync(True)

    def forget_checked(self, blobs: set[str]) -> None:
        with self._lock, self._db:
            self._db.executemany("DELETE FROM checked_files WHERE blob = ?", [(b,) for b in blobs])

    def delete_blob_records(self, blob: str) -> int:
        with self._lock, self._db:
            return self._db.execute("DELETE FROM states WHERE blob = ?", (blob,)).rowcount
