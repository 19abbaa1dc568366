"""One process at a time in a state directory: an flock on `<dir>/lock`, released when its holder closes or dies.

A store's start-up check drops the write-back records whose files are not on disk: in a directory a running server
uses, those are the server's own checkpoints and parked chats, in its RAM (hunt 20: `wkvm states --state-dir` on a
server's directory emptied its reuse cache). So a second process is refused, naming the holder; the same process
may open a directory again (a test's simulated crash, a replica taking over a slot it already holds).
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from pathlib import Path

log = logging.getLogger("wkvm.state")
LOCK_FILE = "lock"
_held: dict[Path, tuple[int, int]] = {}  # this process's locks: directory -> (descriptor, openers)
_guard = threading.Lock()


class StateDirInUse(OSError):
    """Another process holds the state directory."""


def lock_dir(root: Path, wait: float = 0.0) -> Path:
    """Hold `root` for this process (waiting up to `wait` seconds for another to let go); returns the key to pass
    to `unlock_dir`."""
    key = root.resolve()
    deadline, said = time.monotonic() + wait, False
    while True:
        with _guard:  # not held while waiting: other directories open and close meanwhile
            if key in _held:
                fd, n = _held[key]
                _held[key] = (fd, n + 1)
                return key
            fd = os.open(key / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
            else:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                _held[key] = (fd, 1)
                return key
        if time.monotonic() >= deadline:
            raise StateDirInUse(f"the state directory {root} is in use by another wkvm process (pid {holder}): ask "
                                "that server (`wkvm states --url ...`), stop it, or use another directory")  # fmt: skip
        if not said:
            log.info("waiting up to %.0f s for wkvm process %s to let go of the state directory %s", wait, holder, root)
            said = True
        time.sleep(0.1)


def unlock_dir(key: Path) -> None:
    with _guard:
        if key not in _held:
            return
        fd, n = _held.pop(key)
        if n > 1:
            _held[key] = (fd, n - 1)
        else:
            os.close(fd)  # closing the descriptor releases the flock
