"""Stored Responses API responses (`store: true`), per owner: the response object a client reads back, and the
conversation it ends (chat messages) that a later request's `previous_response_id` continues.

SQLite (WAL, synchronous=FULL) in the state directory, beside the state index: a response acknowledged to its client
is on disk, and survives a restart (vLLM keeps them in memory only). Each owner keeps its newest `MAX_PER_OWNER`
responses within `MAX_BYTES_PER_OWNER` of JSON, and each account (an API key, all its users together) ten times
that; storing one more drops the oldest beyond either (never the new one). The conversation's parked state is not
here: the chat sessions keep it, and a continuation reuses it only when its tokens match exactly (docs/http-api.md,
"The Responses API").
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

MAX_PER_OWNER = 1000
MAX_BYTES_PER_OWNER = 64 << 20
# per account: an API key (or, without keys, the server) with all the users Open WebUI's header names under it. A
# client sets that header itself, so a bound per owner alone let one key store without end (hunt 15)
ACCOUNT_BOUND = 10  # an account keeps 10x an owner's bounds


def account_of(owner: str) -> str:
    """A tenant's account: 'key-<hash>/user-<hash>' -> 'key-<hash>' (tenants are `asgi.tenant_of`'s)."""
    return owner.split("/", 1)[0]


SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    owner TEXT NOT NULL,
    id TEXT NOT NULL,
    created_at REAL NOT NULL,
    response TEXT NOT NULL,
    messages TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    PRIMARY KEY (owner, id)
);
CREATE INDEX IF NOT EXISTS responses_age ON responses (owner, created_at);
"""


class ResponseStore:
    def __init__(self, path: Path, max_per_owner: int = MAX_PER_OWNER, max_bytes: int = MAX_BYTES_PER_OWNER):
        self.path, self.max_per_owner, self.max_bytes = path, max_per_owner, max_bytes
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            for statement in SCHEMA.split(";"):
                if statement.strip():
                    self._db.execute(statement)

    def put(self, owner: str, response: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        """Store (or replace) a response and its conversation; the owner's oldest beyond the bounds go."""
        body, history = json.dumps(response), json.dumps(messages)
        row = (owner, response["id"], time.time(), body, history, len(body) + len(history))
        with self._lock, self._db:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?)", row)
            self._keep_newest("owner = ?", (owner,), self.max_per_owner, self.max_bytes)
            account = account_of(owner)  # 'key/' < its users' owners < 'key0' ('0' follows '/'): an index range
            self._keep_newest("owner = ? OR (owner > ? AND owner < ?)", (account, account + "/", account + "0"),
                              ACCOUNT_BOUND * self.max_per_owner, ACCOUNT_BOUND * self.max_bytes)  # fmt: skip

    def _keep_newest(self, where: str, args: tuple[str, ...], count: int, nbytes: int) -> None:
        """Delete the responses `where` selects beyond the newest `count` or `nbytes` (the newest is always kept).
        Newest by insertion (a row put, or put again, takes the largest rowid), not by its clock time: a clock
        stepped back had made the row just put the oldest, deleted in its own put (its id then a 404)."""
        self._db.execute(
            "DELETE FROM responses WHERE rowid IN (SELECT r FROM (SELECT rowid AS r, ROW_NUMBER() OVER w AS n, "
            f"SUM(bytes) OVER w AS total FROM responses WHERE {where} WINDOW w AS (ORDER BY rowid DESC)) "
            "WHERE n > 1 AND (n > ? OR total > ?))", (*args, count, nbytes))  # fmt: skip

    def get(self, owner: str, response_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
        """(response, conversation), or None: no such response of this owner's."""
        with self._lock:
            row = self._db.execute("SELECT response, messages FROM responses WHERE owner = ? AND id = ?",
                                   (owner, response_id)).fetchone()  # fmt: skip
        return None if row is None else (json.loads(row[0]), json.loads(row[1]))

    def ids(self) -> list[tuple[str, str]]:
        """(owner, id) of every stored response (a cluster replica reports them to a restarted directory)."""
        with self._lock:
            return [(str(o), str(i)) for o, i in self._db.execute("SELECT owner, id FROM responses").fetchall()]

    def take(self, path: Path) -> list[tuple[str, str]]:
        """Move every response stored in another server's file here (a cluster replica taking an orphaned slot's: they
        had become unreachable; cluster hunt, session 49), oldest first; (owner, id) of each. The other file keeps
        none of them after."""
        src = sqlite3.connect(path, isolation_level=None)
        try:
            rows = src.execute("SELECT owner, id, created_at, response, messages, bytes FROM responses "
                               "ORDER BY rowid").fetchall()  # fmt: skip
            with self._lock, self._db:
                self._db.execute("BEGIN IMMEDIATE")
                self._db.executemany("INSERT OR IGNORE INTO responses VALUES (?, ?, ?, ?, ?, ?)", rows)
                for owner in {str(r[0]) for r in rows}:  # within each owner's bounds, as a put keeps them
                    self._keep_newest("owner = ?", (owner,), self.max_per_owner, self.max_bytes)
            src.execute("DELETE FROM responses")
        finally:
            src.close()
        return [(str(r[0]), str(r[1])) for r in rows]

    def delete(self, owner: str, response_id: str) -> bool:
        with self._lock:
            cur = self._db.execute("DELETE FROM responses WHERE owner = ? AND id = ?", (owner, response_id))
        return cur.rowcount > 0

    def close(self) -> None:
        with self._lock:
            self._db.close()
