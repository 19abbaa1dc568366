"""Atomic file writes: write a temp file beside the target, fsync it, rename over the target."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

TMP_SUFFIX = ".wkvm-tmp"
_UMASK = os.umask(0o022)  # read once at import (os.umask can only be read by setting it), then restored
os.umask(_UMASK)
FILE_MODE = 0o666 & ~_UMASK  # what open() gives a new file; some writers (safetensors) create theirs 0600


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(target: Path, durable: bool = True) -> Iterator[Path]:
    """Yield a temp path to write; on success it replaces `target` (fsynced when durable), on error it is removed."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    # a name no other process or thread uses, created here first (O_EXCL | O_NOFOLLOW): a writer then opens a regular
    # file this process made, never a link planted under a predictable name (security review, session 39)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}")
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600))
    try:
        yield tmp
        os.chmod(tmp, FILE_MODE)
        if durable:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, target)
        if durable:
            fsync_dir(target.parent)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def atomic_write_bytes(target: Path, data: bytes, durable: bool = True) -> None:
    with atomic_path(target, durable) as tmp:
        tmp.write_bytes(data)
