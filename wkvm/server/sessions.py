"""Where a request's state comes from: an explicit handle, or fresh (chat continuity extends this)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from wkvm.engine.engine import RequestHandle
from wkvm.models.spec import State


@dataclass
class Plan:
    feed_ids: list[int]  # tokens to feed: the base's pending token (if any) and the new ones
    base_state: State | None = None
    base_ids: list[int] = field(default_factory=list)  # tokens already inside base_state
    parent: str | None = None  # handle of the state this run started from
    info: dict = field(default_factory=lambda: {"mode": "fresh", "reused_tokens": 0, "restart_reason": None})
    capture: bool = False
    finish: Callable[[list[RequestHandle]], None] | None = None


class ChatSessions:
    def __init__(self, ctx):
        self.ctx = ctx

    def from_handle(self, tenant: str, handle: str, new_ids: list[int]) -> Plan:
        rec, state = self.ctx.store.load(tenant, handle)
        if not rec.token_ids and not new_ids:
            raise ValueError(f"state {rec.handle!r} has no token history: give a prompt to continue from it")
        info = {"mode": "state", "reused_tokens": max(rec.n_tokens - 1, 0), "restart_reason": None}
        return Plan(rec.token_ids[-1:] + new_ids, state, rec.token_ids[:-1], rec.handle, info)

    def plan(self, tenant: str, prompt_ids: list[int], state_handle: str | None = None, headers=None) -> Plan:
        if state_handle:
            return self.from_handle(tenant, state_handle, prompt_ids)
        return Plan(list(prompt_ids))
