"""Disk accounting for the state store: users' states against the quota, internal states as a best-effort cache.

Internal states are the server's own: prefix-reuse checkpoints (owner `<scope>#ckpt`) and parked chat sessions
(`<tenant>#sessions`). They never count against users: a user put is refused only when the users' files, the index
and the new state would exceed `--state-disk-quota`, and internal files are evicted (least recently used first) to
make that room. Internal states live within their own budget (`--checkpoint-bytes`, RAM and disk together) and
within whatever room the quota leaves; one that does not fit is dropped, never an error. A blob (files are
content-addressed) referenced by any user record is a user blob.

This module only keeps the figures and picks victims; the store evicts them (records, caches, file).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from wkvm.config import ServerConfig
from wkvm.models.spec import StateSpec

if TYPE_CHECKING:  # index imports this module
    from wkvm.state.index import StateRecord

INDEX_COMMIT_BYTES = 32 << 10  # what a record may add to the index file: a page split in each table it touches


class QuotaExceeded(RuntimeError):
    """The users' states fill --state-disk-quota (HTTP 413)."""


@dataclass
class StoreLimits:
    device_bytes: int = 256 << 20
    host_bytes: int = 1 << 30
    disk_bytes: int | None = None  # quota on users' state files plus the index; None = unlimited
    tenant_bytes: int | None = None  # quota on one tenant's state files (--state-tenant-quota); None = unlimited
    internal_bytes: int | None = None  # budget of internal states (RAM and disk): --checkpoint-bytes; None = unlimited
    kv_tokens: int = 1 << 16  # attention models: most cached tokens one stored state holds (--max-state-tokens)

    @classmethod
    def from_config(cls, cfg: ServerConfig) -> StoreLimits:
        """From a ServerConfig: --state-device-bytes, --state-host-bytes, --state-disk-quota, --state-tenant-quota,
        --checkpoint-bytes, --max-state-tokens."""
        return cls(cfg.state_device_bytes, cfg.state_host_bytes, cfg.state_disk_quota, cfg.state_tenant_quota,
                   cfg.checkpoint_bytes, cfg.max_state_tokens)  # fmt: skip


def state_file_bytes(spec: StateSpec, n_tokens: int) -> int:
    """An upper bound of a state file's bytes: tensors, their header, metadata, ids as JSON (<= 12 chars each)."""
    return spec.nbytes + spec.token_nbytes * n_tokens + 256 * len(spec.tensors) + 2048 + 12 * n_tokens


def is_internal(owner: str) -> bool:
    """Owners `<scope>#ckpt` and `<tenant>#sessions` are the server's caches; tenants and scopes never hold '#'."""
    return "#" in owner


def quota_tenant(owner: str) -> str:
    """Whose share an owner's (or a reuse scope's) states take of what tenants share (`--state-tenant-quota`, the
    chat-session table): its API key's (`key-<hash>`, or "anonymous"), the part before any '/' (an Open WebUI user,
    a request's `user` or `cache_salt` narrow it for privacy, but the client chooses them: counted apart, one key had
    a new room for every id it sent; review, session 48)."""
    return owner.partition("#")[0].partition("/")[0]


class DiskUsage:
    def __init__(self, quota: int | None, internal_budget: int | None, tenant_quota: int | None = None):
        self.quota = quota  # None: unlimited
        self.budget = internal_budget  # None: unlimited
        self.tenant_quota = tenant_quota  # one tenant's user files; None: unlimited
        self.user: dict[str, int] = {}  # user blob -> bytes of its file
        self.user_tenant: dict[str, str] = {}  # user blob -> its quota_tenant (blobs are never shared across them)
        self.tenant_bytes: dict[str, int] = {}  # quota_tenant -> bytes of its user blobs
        self.internal: OrderedDict[str, int] = OrderedDict()  # internal blob -> bytes (file, else estimate); LRU first
        self.internal_files: set[str] = set()  # internal blobs with a file on disk
        self.user_bytes = 0

    def internal_file_bytes(self) -> int:
        return sum(self.internal[b] for b in self.internal_files)

    def blob_bytes(self) -> int:
        """Bytes of every state file on disk."""
        return self.user_bytes + self.internal_file_bytes()

    def is_user(self, blob: str) -> bool:
        return blob in self.user

    def known(self, blob: str) -> bool:
        return blob in self.user or blob in self.internal

    def touch(self, blob: str) -> None:
        if blob in self.internal:
            self.internal.move_to_end(blob)

    def add_user(self, blob: str, size: int, owner: str) -> None:
        """A blob a user record of `owner` references (its file is on disk)."""
        self.forget(blob)
        self.user[blob] = size
        self.user_bytes += size
        tenant = self.user_tenant[blob] = quota_tenant(owner)
        self.tenant_bytes[tenant] = self.tenant_bytes.get(tenant, 0) + size

    def add_internal(self, blob: str, size: int, on_disk: bool) -> None:
        """A blob only internal records reference: `size` is its file's bytes, or an estimate while RAM holds it."""
        self.forget(blob)
        self.internal[blob] = size
        if on_disk:
            self.internal_files.add(blob)

    def add_records(self, records: list[StateRecord], sizes: dict[str, int]) -> None:
        """Account the files of existing records (given by created_at: a blob's last use sets its LRU place)."""
        users = {r.blob: r.owner for r in records if not is_internal(r.owner)}
        for r in records:
            if r.blob in users:
                self.add_user(r.blob, sizes[r.blob], users[r.blob])
            else:
                self.add_internal(r.blob, sizes[r.blob], on_disk=True)
                self.touch(r.blob)

    def forget(self, blob: str) -> None:
        size = self.user.pop(blob, 0)
        self.user_bytes -= size
        tenant = self.user_tenant.pop(blob, None)
        if tenant is not None:
            self.tenant_bytes[tenant] -= size
            if not self.tenant_bytes[tenant]:
                del self.tenant_bytes[tenant]
        self.internal.pop(blob, None)
        self.internal_files.discard(blob)

    def user_room(self, blob: str, new_bytes: int, index_bytes: int, owner: str, file_bytes: int = 0,
                  tenant_quota: bool = True) -> list[str]:  # fmt: skip
        """Internal files to evict so that user `blob` of `owner`, adding `new_bytes` to users' bytes (its file, if not
        theirs yet, and the index's growth), fits; QuotaExceeded if users' states, the index and it exceed the quota,
        or (`tenant_quota`) the owner's tenant's files and its new file's `file_bytes` the tenant's own quota."""
        held = self.tenant_bytes.get(quota_tenant(owner), 0)
        if tenant_quota and self.tenant_quota is not None and file_bytes and held + file_bytes > self.tenant_quota:
            raise QuotaExceeded(  # its own figures only: another tenant's saves never show here
                f"your states use {held} of your {self.tenant_quota} bytes (--state-tenant-quota) and this one needs "
                f"{file_bytes} more: delete states you no longer need"
            )
        if self.quota is None:
            return []
        need = self.user_bytes + index_bytes + new_bytes
        if need > self.quota and not self.user_bytes:  # nothing stored: "full" had misled (docs hunt, session 49)
            raise QuotaExceeded(
                f"the server's state disk quota ({self.quota} bytes) cannot hold this state: it needs {new_bytes} "
                f"bytes beside the index's {index_bytes} (counted at its largest); raise --state-disk-quota"
            )
        if need > self.quota:
            raise QuotaExceeded(
                f"the server's state disk quota ({self.quota} bytes, every tenant's states together) is full: this "
                f"state needs {new_bytes} bytes, more than is left; delete states or raise --state-disk-quota"
            )  # not the total held: every tenant's saves
        return self._victims(None, need + self.internal_file_bytes() - self._file_size(blob), blob)[0]

    def footprint(self, blob: str) -> tuple[int, int]:
        """(bytes of the internal budget, bytes of internal files) that `blob` holds now."""
        if blob not in self.internal:
            return 0, 0
        return self.internal[blob], self._file_size(blob)

    def internal_room(self, blob: str, size: int, file: int, index_bytes: int) -> list[str] | None:
        """Blobs to evict (least recently used first) so that internal `blob`, holding `size` bytes of the budget and
        `file` bytes on disk (0 while only RAM holds it), fits the budget and, with the index, the quota; None if it
        cannot even then (drop it instead). A blob a user shares holds nothing (size and file 0)."""
        held = sum(self.internal.values()) - self.internal.get(blob, 0) + size
        on_disk = self.blob_bytes() - self._file_size(blob) + file + index_bytes
        victims, fits = self._victims(held, on_disk, blob)
        return victims if fits else None

    def excess(self, index_bytes: int) -> list[str]:
        """Internal blobs to evict (LRU first) until internal states fit their budget and all files the quota."""
        return self._victims(sum(self.internal.values()), self.blob_bytes() + index_bytes, None)[0]

    def _file_size(self, blob: str) -> int:
        return self.internal[blob] if blob in self.internal_files else 0

    def _victims(self, held: int | None, on_disk: int | None, keep: str | None) -> tuple[list[str], bool]:
        """Least recently used internal blobs (never `keep`) to evict until `held` (internal bytes, None: no budget
        check) fits the budget and `on_disk` (None: no quota check) the quota; and whether that is reached."""

        def over() -> tuple[bool, bool]:
            budget = held is not None and self.budget is not None and held > self.budget
            return budget, on_disk is not None and self.quota is not None and on_disk > self.quota

        victims = []
        for b, size in self.internal.items():
            over_budget, over_quota = over()
            if not (over_budget or over_quota):
                break
            if b == keep or not (over_budget or b in self.internal_files):
                continue  # over quota only: a state that only RAM holds frees no disk
            victims.append(b)
            if held is not None:
                held -= size
            if on_disk is not None and b in self.internal_files:
                on_disk -= size
        return victims, not any(over())
