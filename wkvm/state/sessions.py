"""Where a request's state comes from: an explicit handle, a parked chat session (parent-token-v1), the
longest stored checkpoint that prefixes the prompt, or nothing (fresh).

Reuse never changes an answer: a state is continued only when the tokens it holds are exactly the first
tokens of the new prompt (retokenized in full); the rest of the prompt is fed as usual.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from wkvm.config import ServerConfig, dtype_name, weight_dtype
from wkvm.engine.handle import RequestHandle, RunResult
from wkvm.models.linear import compute_paths
from wkvm.models.spec import State
from wkvm.state.prefix import NODE_BYTES, Checkpoint, NodeCount, PrefixTrie
from wkvm.state.quota import quota_tenant
from wkvm.state.service import StateService
from wkvm.state.statefile import StateFileError, StateMeta, decode, encode, unbatch
from wkvm.state.store import StateNotFound

log = logging.getLogger("wkvm.sessions")
CKPT, SESS = "#ckpt", "#sessions"  # owner suffixes: tenants and scopes never contain '#' (store.is_internal)
HEADER_MODE = "x-wkvm-stateful-chat"
HEADER_TASK = "x-wkvm-task"  # Open WebUI's {{TASK}}: title_generation, tags_generation, ... ('' on a chat turn)
PARENT_TOKEN_V1 = "parent-token-v1"
RESERVATION_S = 30.0
# a turn for a session still generating waits this long for it before its 409: a client that stops a stream and
# sends again at once (Open WebUI's stop, then regenerate) finds the stopped turn still ending for ~0.3-0.7 s
BUSY_WAIT_S = 2.0


def reuse_scope(tenant: str, user: str | None, cache_salt: str | None) -> str:
    """Whose checkpoints a request may resume from: the tenant (API key, Open WebUI user), narrowed by the
    request's `user` and `cache_salt`, so reuse (and its latency) never confirms another user's prompt."""
    scope = tenant
    for tag, value in (("u", user), ("salt", cache_salt)):
        if value:
            scope += f"/{tag}-{hashlib.sha256(value.encode('utf-8', 'surrogatepass')).hexdigest()[:16]}"
    return scope


SessionKey = tuple[str, str, str]  # (reuse scope: the tenant narrowed by `user` and `cache_salt`, Open WebUI user id,
# chat id): a session parked under one scope is never resumed under another


class SessionBusy(RuntimeError):
    """A parent-token-v1 chat session is already generating (the server answers 409)."""


class ReuseMetrics(Protocol):
    """What chat reuse reports (the server's Prometheus counters)."""

    def reuse_hit(self, tokens: int) -> None: ...

    def reuse_miss(self) -> None: ...

    def restart(self, reason: str) -> None: ...


@dataclass
class Plan:
    feed_ids: list[int]  # tokens to feed: the base's pending token (if any) and the new ones
    base_state: State | None = None
    base_ids: list[int] = field(default_factory=list)  # tokens already inside base_state
    parent: str | None = None  # handle of the state this run started from
    info: dict[str, Any] = field(default_factory=lambda: {"mode": "fresh", "reused_tokens": 0, "restart_reason": None})
    capture: bool = False
    finish: Callable[[list[RequestHandle]], None] | None = None
    capture_at: int | None = None  # a branch point inside feed_ids whose state is worth a checkpoint


@dataclass(frozen=True)
class ChatMeta:
    """A chat turn: its messages, how many prompt tokens its leading system messages take (0: none, or not an exact
    token prefix), how many the next turn's prompt keeps where it drops this one's end (`next_tokens`), and the
    parent-token-v1 identity headers."""

    messages: list[dict[str, Any]]
    stateful: bool = False  # X-WKVM-Stateful-Chat: parent-token-v1
    user: str | None = None
    chat: str | None = None
    assistant_id: str | None = None
    user_message_id: str | None = None
    parent_id: str | None = None
    system_tokens: int = 0
    task: str | None = None  # a background request about the chat (title, tags, follow-ups), not a turn of it
    # the prompt's leading tokens the next turn's prompt keeps, where the template renders this turn's answer
    # otherwise than its generation prompt began it (a thinking template's opened <think>, dropped from earlier
    # turns); 0: nothing dropped, or not known
    next_tokens: int = 0

    @classmethod
    def from_headers(cls, headers: Mapping[str, str], messages: list[dict[str, Any]],
                     system_tokens: int = 0, next_tokens: int = 0) -> ChatMeta:  # fmt: skip
        return cls(
            messages, headers.get(HEADER_MODE) == PARENT_TOKEN_V1, headers.get("x-openwebui-user-id"),
            headers.get("x-openwebui-chat-id"), headers.get("x-wkvm-assistant-message-id"),
            headers.get("x-wkvm-user-message-id"), headers.get("x-wkvm-parent-message-id") or None, system_tokens,
            headers.get(HEADER_TASK) or None, next_tokens,
        )  # fmt: skip

    @property
    def turn(self) -> bool:
        """A parent-token-v1 turn of the chat. Open WebUI sends its background tasks (title, tags, follow-ups)
        with the chat's headers while the next turn may already run: with X-WKVM-Task set they are served from
        checkpoints like any request and never touch the chat's parked session."""
        return self.stateful and self.task is None

    @property
    def bound(self) -> bool:
        """A turn carrying every id its session needs: the one request that session is busy with."""
        return self.turn and all((self.user, self.chat, self.assistant_id, self.user_message_id))


@dataclass
class Session:
    """A parked chat: its state (in the store) bound to model, ids, visible history and exact tokens."""

    fingerprint: str
    handle: str | None = None
    token_ids: list[int] = field(default_factory=list)
    history: list[tuple[str, str]] = field(default_factory=list)
    last_assistant_id: str | None = None
    message_ids: set[str] = field(default_factory=set)
    inflight: list[RequestHandle] = field(default_factory=list)
    reserved_at: float | None = None  # a request is being planned (its handles are not known yet)
    last_used: float = field(default_factory=time.monotonic)

    @property
    def busy(self) -> bool:
        if self.reserved_at is not None and time.monotonic() - self.reserved_at < RESERVATION_S:
            return True
        return any(not h.done.is_set() for h in self.inflight)


@dataclass(frozen=True)
class ParkedCopy:
    """A parked session as another server can take it over: its state file (the state and its exact tokens, checked
    like an import when taken) and what binds it to the chat."""

    data: bytes  # wkvm-state-v1
    history: list[tuple[str, str]]
    last_assistant_id: str | None
    message_ids: list[str]


class SessionMirror(Protocol):
    """Where a server's parked sessions are also kept for the others (the cluster's directory): a turn that lands on
    another server (its owner was full, or restarted) takes its session over instead of recomputing it."""

    def publish(self, key: SessionKey, copy: ParkedCopy) -> None: ...

    def fetch(self, key: SessionKey) -> ParkedCopy | None: ...

    def forget(self, key: SessionKey) -> None: ...


def visible(messages: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """Open WebUI stores messages with outer whitespace stripped: compare after the same normalisation."""
    return [(m["role"], m["content"].strip()) for m in messages]


class ChatSessions:
    def __init__(self, service: StateService, fingerprint: str, config: ServerConfig, metrics: ReuseMetrics):
        self.service, self.store = service, service.store
        self.fingerprint, self.config, self.metrics = fingerprint, config, metrics
        self.enabled = config.prefix_reuse
        # what else decides a checkpoint's numbers: the same weights stored or computed otherwise give other states
        kv, dtype = config.engine_kv_dtype(), weight_dtype(config.dtype)
        # torch's version and ISA and the kernel the weights run too (`compute_paths`: a checkpoint of the native int8
        # kernel had been reused by a server on its dequantizing fallback, moving logprobs; dtype hunt, session 49)
        self.compute = f"weights {dtype}, kv {kv}, {config.device.split(':')[0]}, " \
                       f"{compute_paths(dtype_name(config.dtype), config.device)}"  # fmt: skip
        spec = self.store.spec  # a checkpoint holds at least one token: the most the budget can hold
        self.capacity = max(1, config.checkpoint_bytes // max(spec.nbytes + spec.token_nbytes, 1))
        self.tries: dict[str, PrefixTrie] = {}  # per reuse scope; a scope's goes when its last checkpoint does
        # their tokens' nodes on the heap (~NODE_BYTES each), bounded by the same budget: the store charges a
        # checkpoint its state and ~12 B a token, and distinct long prompts had grown the tries ~25x faster
        self.trie_nodes, self.max_trie_nodes = NodeCount(), max(1, config.checkpoint_bytes // NODE_BYTES)
        self.evicted: deque[tuple[str, str]] = deque()  # (owner, handle) the store evicted, not yet forgotten here
        self.store.on_evict = lambda owner, handle: self.evicted.append((owner, handle))
        self.sessions: OrderedDict[SessionKey, Session] = OrderedDict()
        self.lock = threading.RLock()
        self.waiting: set[SessionKey] = set()  # sessions a turn waits on (`_wait_while_busy`): one at a time
        self.mirror: SessionMirror | None = None  # set by a cluster replica
        self._rebuild()

    def _rebuild(self) -> None:
        """Checkpoints survive restarts (they are stored states, owner `<scope>#ckpt`) where this server computes as
        the one that made them (`compute`: another --dtype, --kv-dtype or device gives other numbers, and a reused
        checkpoint must not change an answer); parked sessions do not."""
        store, other = self.store, Counter[str]()
        for rec in store.index.list():
            if rec.owner.endswith(CKPT) and rec.op_params.get("compute") != self.compute:
                other[str(rec.op_params.get("compute"))] += 1
                store.discard(rec.owner, rec.handle)
            elif rec.owner.endswith(CKPT):
                scope = rec.owner.removesuffix(CKPT)
                for s, cp in self._insert(scope, store.token_ids(rec), rec.handle, rec.op_params.get("kind", "")):
                    store.discard(s + CKPT, cp.key, durable=False)
            elif rec.owner.endswith(SESS):
                store.discard(rec.owner, rec.handle)
        for compute, n in other.items():  # said: the next turns of those chats recompute their prompts
            log.info("dropped %d chat checkpoint(s) computed otherwise (%s; this server: %s)", n, compute, self.compute)

    def _trie(self, scope: str) -> PrefixTrie:
        trie = self.tries.get(scope)
        if trie is None:
            trie = self.tries[scope] = PrefixTrie(self.capacity, self.trie_nodes)
        return trie

    def _insert(self, scope: str, token_ids: list[int], key: str, kind: str) -> list[tuple[str, Checkpoint]]:
        """Put a checkpoint in its scope's trie; (scope, checkpoint) of those that leave for it (beyond the trie's
        capacity or the nodes' bound): the caller discards their states."""
        return [(scope, cp) for cp in self._trie(scope).insert(token_ids, key, kind)] + self._trim_tries()

    def _trim_tries(self) -> list[tuple[str, Checkpoint]]:
        """While the tries' nodes pass their bound, the largest trie's least recently used checkpoint goes (the
        caller discards its state); returns (scope, checkpoint) of each."""
        gone: list[tuple[str, Checkpoint]] = []
        while self.trie_nodes.n > self.max_trie_nodes and self.tries:
            scope, trie = max(self.tries.items(), key=lambda kv: kv[1].nodes)
            cp = trie.pop_oldest()
            if cp is not None:
                gone.append((scope, cp))
            if not trie:
                del self.tries[scope]
        return gone

    def _forget_evicted(self) -> None:
        """Forget what the store evicted to keep within its budget (under self.lock): checkpoints leave their trie,
        an empty trie its scope, and an evicted parked session its state (its next turn restarts: no_session). The
        store only queues them, as it evicts under its own lock. An internal name's version can be given again once
        all its versions are gone, so a notice whose handle the store holds again is about an older state: skipped."""
        sessions: set[tuple[str, str]] = set()
        while self.evicted:
            owner, handle = self.evicted.popleft()
            if self.store.has(owner, handle):
                continue
            if owner.endswith(CKPT):
                self._untrie(owner.removesuffix(CKPT), handle)
            elif owner.endswith(SESS):
                sessions.add((owner.removesuffix(SESS), handle))
        if sessions:
            for key, sess in self.sessions.items():
                if (key[0], sess.handle) in sessions:
                    sess.handle, sess.token_ids = None, []

    def _untrie(self, scope: str, key: str) -> None:
        trie = self.tries.get(scope)
        if trie is not None:
            trie.remove_key(key)
            if not trie:
                del self.tries[scope]

    # --- planning ------------------------------------------------------------------------------
    def from_handle(self, tenant: str, handle: str, new_ids: list[int]) -> Plan:
        r = self.service.resume(tenant, handle, new_ids)
        info = {"mode": "state", "reused_tokens": len(r.base_ids), "restart_reason": None}
        return Plan(r.feed_ids, r.state, r.base_ids, r.parent, info)

    def plan(
        self,
        tenant: str,
        prompt_ids: list[int],
        state_handle: str | None = None,
        chat: ChatMeta | None = None,
        scope: str | None = None,
    ) -> Plan:
        """Where this request starts. Checkpoints are stored and looked up under `scope` (an opaque string the
        server builds; default: the tenant); explicit handles and parked sessions always belong to the tenant."""
        if state_handle:
            return self.from_handle(tenant, state_handle, prompt_ids)
        if not self.enabled:
            return Plan(list(prompt_ids))
        scope = tenant if scope is None else scope
        session_key = None
        if chat is not None and chat.turn:
            plan, session_key = self._parent_bound(scope, prompt_ids, chat)
        else:
            plan = self._from_checkpoint(scope, prompt_ids, None)
            plan.capture_at = self._branch(scope, prompt_ids, len(plan.base_ids), chat.system_tokens if chat else 0)
        if chat is not None and (at := self._next_turn(prompt_ids, len(plan.base_ids), chat)) is not None:
            plan.capture_at = at
        plan.capture = True
        plan.finish = lambda handles: self._after(tenant, scope, plan, handles, session_key, chat)
        return plan

    def _from_checkpoint(self, scope: str, prompt_ids: list[int], reason: str | None) -> Plan:
        """The longest stored checkpoint that starts this prompt; for attention-only models (a state cut to any
        shorter history is exact) the checkpoint sharing the most leading tokens, cut to them."""
        spec = self.store.spec
        found = None
        with self.lock:
            self._forget_evicted()
            trie = self.tries.get(scope)
            if trie is not None and spec.cuttable:
                found = trie.longest_shared(prompt_ids)
            elif trie is not None:
                cp = trie.longest(prompt_ids)
                found = (cp, cp.n_fed) if cp is not None else None
        state = None
        if found is not None:
            try:
                _, state = self.store.load(scope + CKPT, found[0].key)
            except StateNotFound:  # evicted by the store since (its budget, or room for users' states)
                with self.lock:
                    self._untrie(scope, found[0].key)
        if found is None or state is None:
            self.metrics.reuse_miss()
            return Plan(list(prompt_ids), info={"mode": "fresh", "reused_tokens": 0, "restart_reason": reason})
        cp, n = found
        if n < cp.n_fed:
            state, mode = spec.cut(state, n), "kv_prefix"
        elif cp.kind == "turn_end" and tuple(prompt_ids[: len(cp.full_ids)]) == cp.full_ids:
            mode = "exact_prefix"
        else:
            mode = "checkpoint"
        self.metrics.reuse_hit(n)
        info = {"mode": mode, "reused_tokens": n, "restart_reason": reason}
        return Plan(prompt_ids[n:], state, prompt_ids[:n], cp.key, info)

    def _branch(self, scope: str, prompt_ids: list[int], reused: int, system_tokens: int) -> int | None:
        """A point beyond what this prompt reuses where a checkpoint would serve later prompts (relative to the
        tokens it feeds): where it parts from a stored history, else the end of its system messages (shared by
        many conversations from their first). The run keeps the state there."""
        with self.lock:
            trie = self.tries.get(scope)
            point = (trie.branch_point(prompt_ids) if trie is not None else 0) or system_tokens
        return point - reused if reused < point < len(prompt_ids) - 1 else None

    @staticmethod
    def _next_turn(prompt_ids: list[int], reused: int, chat: ChatMeta) -> int | None:
        """Where the conversation's next prompt parts from this one (`ChatMeta.next_tokens`), as the point to keep the
        state at (relative to the tokens fed), once this turn reuses its system messages (before, their end is the
        checkpoint to make: many conversations share it). Without it a thinking template's next turn parts from every
        stored history at this turn's opened `<think>`, and feeds this turn's prompt again from an earlier branch."""
        point = chat.next_tokens
        if not reused < point < len(prompt_ids) - 1 or reused < chat.system_tokens:
            return None
        return point - reused

    def _parent_bound(self, scope: str, prompt_ids: list[int],
                      meta: ChatMeta) -> tuple[Plan, SessionKey | None]:  # fmt: skip
        user, chat, messages = meta.user, meta.chat, meta.messages
        asst_id, user_msg_id, parent_id = meta.assistant_id, meta.user_message_id, meta.parent_id
        if not (user and chat and asst_id and user_msg_id):
            self.metrics.restart("missing_metadata")
            return self._from_checkpoint(scope, prompt_ids, "missing_metadata"), None
        key = (scope, user, chat)
        fp = self.fingerprint
        if parent_id is not None and self.mirror is not None:
            with self.lock:
                known = key in self.sessions
            if not known:
                self._take_over(key)
        self._wait_while_busy(key)
        with self.lock:
            sess = self.sessions.get(key)
            if sess is not None and time.monotonic() - sess.last_used > self.config.chat_session_ttl:
                self._drop(key)
                sess = None
            if sess is not None and sess.busy:
                raise SessionBusy("this chat session is already generating an answer; wait for it to finish")
            reason = self._reason(sess, fp, parent_id, asst_id, user_msg_id, visible(messages[:-1]), prompt_ids)
            if sess is None or reason is not None:
                sess = Session(fp)
                self._park(key, sess)
            sess.last_used = time.monotonic()
            sess.reserved_at = time.monotonic()
            self.sessions.move_to_end(key)
            # what the checks above read, taken together: the last turn's `_update_session` (after its answer's
            # handles are done, so not busy) or `_forget_evicted` may change the session once the lock is let go,
            # and reading them after the load had paired the old state with the new turn's token count (a wrong
            # answer, or an empty prompt's 500)
            handle, n = sess.handle, len(sess.token_ids) - 1
        if reason is not None:
            self.metrics.restart(reason)
        if reason is None and handle is not None and 0 <= n < len(prompt_ids):
            try:
                _, state = self.store.load(scope + SESS, handle)
            except StateNotFound:  # replaced or evicted meanwhile: the turn restarts (exact)
                state, reason = None, "no_session"
                self.metrics.restart(reason)
            if state is not None:
                self.metrics.reuse_hit(n)
                info = {"mode": "parent_bound", "reused_tokens": n, "restart_reason": None}
                return Plan(prompt_ids[n:], state, prompt_ids[:n], handle, info), key
        return self._from_checkpoint(scope, prompt_ids, reason), key

    def _wait_while_busy(self, key: SessionKey) -> None:
        """Up to BUSY_WAIT_S for the session's running turn to end (a thread of the server's pool waits, not the
        event loop): one its client has left ends within a second, so the next turn starts instead of a 409. One
        turn waits on a session at a time (more get their 409 at once), so a client sending many cannot hold the
        server's threads."""
        with self.lock:
            sess = self.sessions.get(key)
            if sess is None or not sess.busy or key in self.waiting:
                return
            self.waiting.add(key)
        try:
            deadline = time.monotonic() + BUSY_WAIT_S
            while (left := deadline - time.monotonic()) > 0:
                with self.lock:
                    sess = self.sessions.get(key)
                    if sess is None or not sess.busy:
                        return
                    running = next((h for h in sess.inflight if not h.done.is_set()), None)
                if running is not None:
                    running.done.wait(min(left, 0.05))
                else:  # reserved by a turn being planned: its handles come in a moment
                    time.sleep(min(left, 0.02))
        finally:
            with self.lock:
                self.waiting.discard(key)

    def _take_over(self, key: SessionKey) -> None:
        """Park here the session another server parked (its mirror copy), if there is one and it is valid; the usual
        checks then decide whether this turn continues it."""
        assert self.mirror is not None
        copy = self.mirror.fetch(key)
        if copy is None:
            return
        try:
            tensors, meta = decode(copy.data, self.store.spec, self.fingerprint, self.store.vocab_size)
        except StateFileError as e:
            log.warning("a mirrored chat session could not be taken over (%s); the turn restarts", e)
            return
        if meta.op_params.get("compute") != self.compute:  # another replica's arithmetic (a rolling upgrade's older
            return  # code): its state would move this turn's answer, as a checkpoint's would (review, session 49)
        run = RunResult(meta.token_ids, {k: v.unsqueeze(0) for k, v in tensors.items()}, [], None)
        name = "s-" + hashlib.sha256(repr(key).encode()).hexdigest()[:32]
        rec = self.service.save_run(key[0] + SESS, name, run, op="session", durable=False)
        if rec is None:
            return
        sess = Session(self.fingerprint, rec.handle, meta.token_ids, list(copy.history), copy.last_assistant_id,
                       set(copy.message_ids))  # fmt: skip
        with self.lock:
            if key not in self.sessions:
                self._park(key, sess)
                return
        self.store.discard(key[0] + SESS, rec.handle, durable=False)  # parked here meanwhile

    @staticmethod
    def _reason(sess: Session | None, fp: str, parent_id: str | None, asst_id: str, user_msg_id: str,
                history: list[tuple[str, str]], prompt_ids: list[int]) -> str | None:  # fmt: skip
        """Why the parked session cannot continue (None: it can)."""
        if parent_id is None:
            return None if sess is None else "edited_history"  # a first turn; in a known chat it was redone
        if sess is None or sess.handle is None:
            return "no_session"
        if sess.fingerprint != fp:
            return "model_changed"
        if asst_id in sess.message_ids or user_msg_id in sess.message_ids:
            return "message_id_reused"
        if parent_id != sess.last_assistant_id:
            return "stale_parent"
        if history != sess.history:
            return "edited_history"
        n = len(sess.token_ids) - 1
        if n < 0 or len(prompt_ids) <= n or prompt_ids[:n] != sess.token_ids[:n]:
            return "token_mismatch"
        return None

    # --- after a turn --------------------------------------------------------------------------
    def _after(self, tenant: str, scope: str, plan: Plan, handles: list[RequestHandle], session_key: SessionKey | None,
               chat: ChatMeta | None) -> None:  # fmt: skip
        """Checkpoint the turn and park the session: a cache, so a failure is logged and never fails the answer."""
        try:
            h = handles[0]
            run = h.run_result()
            if h.output.finish_reason not in ("stop", "length") or run.final_state is None:
                return
            kept = self._checkpoint(scope, run.history, run.final_state, "turn_end")
            if not kept and run.prompt_state is None and self.store.spec.cuttable:
                self._cut_checkpoint(scope, run)
            if run.prompt_state is not None:
                self._checkpoint(scope, run.prompt_history, run.prompt_state, "prompt_end")
            if run.branch_state is not None:
                self._checkpoint(scope, run.branch_history, run.branch_state, "branch")
            if session_key is not None and chat is not None:
                self._update_session(session_key, chat, run, h.output.text)
        except Exception:
            log.warning("could not store this turn's checkpoints/session; the next turn recomputes", exc_info=True)

    def _cut_checkpoint(self, scope: str, run: RunResult) -> None:
        """An attention-only turn whose final state the store did not keep (longer than --max-state-tokens, or no room
        in --checkpoint-bytes) keeps its prompt instead, cut from the final state, as long as a stored state may be:
        the server takes no prompt-end copy of such a turn (the final state serves every prefix when it is kept)."""
        assert run.final_state is not None
        n = min(len(run.prompt_history) - 1, self.store.limits.kv_tokens)  # tokens whose keys and values it keeps
        if n > 0:
            self._checkpoint(scope, run.history[: n + 1], self.store.spec.cut(run.final_state, n), "prompt_end")

    def _checkpoint(self, scope: str, token_ids: list[int], state: State, kind: str) -> bool:
        """Store a checkpoint of `state` (all of `token_ids` but the last) and put it in the trie; False when the
        store did not keep it."""
        store = self.store
        name = "c-" + hashlib.sha256(repr(token_ids).encode()).hexdigest()[:32]
        rec = self.service.save_checkpoint(scope + CKPT, name, state, token_ids, kind, self.compute)
        if rec is None:  # the store had no room within its checkpoint budget: this prefix is not reusable
            return False
        with self.lock:
            self._forget_evicted()
            evicted = self._insert(scope, token_ids, rec.handle, kind)
        for s, cp in evicted:
            store.discard(s + CKPT, cp.key, durable=False)
        if any(cp.key == rec.handle for _, cp in evicted):
            return False  # alone longer than the tries' bound
        if rec.version > 1:  # the same tokens again: keep only the newest version
            store.discard(scope + CKPT, f"{name}@{rec.version - 1}", durable=False)
        return True

    def _update_session(self, key: SessionKey, chat: ChatMeta, run: RunResult, reply: str) -> None:
        store, owner = self.store, key[0] + SESS  # the session's scope's
        messages = chat.messages
        name = "s-" + hashlib.sha256(repr(key).encode()).hexdigest()[:32]
        rec = self.service.save_run(owner, name, run, op="session", durable=False)
        new = rec.handle if rec is not None else None  # None: not kept (no room); the next turn restarts, no_session
        copy = None
        with self.lock:
            sess = self.sessions.get(key)
            if sess is None:  # dropped meanwhile
                old = new
            else:
                old = sess.handle
                sess.handle, sess.token_ids = new, run.history if new is not None else []
                sess.history = visible(messages) + [("assistant", reply.strip())]
                sess.last_assistant_id = chat.assistant_id
                sess.message_ids |= {i for i in (chat.assistant_id, chat.user_message_id) if i is not None}
                sess.last_used = time.monotonic()
                if new is not None and self.mirror is not None and run.final_state is not None:
                    copy = (list(sess.history), sess.last_assistant_id, sorted(sess.message_ids))
        if old is not None and old != new:  # the same handle: the old state was evicted and its version given again
            store.discard(owner, old, durable=False)
        if copy is not None and self.mirror is not None and run.final_state is not None:
            meta = StateMeta(self.fingerprint, store.spec.spec_hash, run.history, op="session",
                             op_params={"compute": self.compute})  # fmt: skip
            self.mirror.publish(key, ParkedCopy(encode(store.spec, unbatch(run.final_state), meta), *copy))

    def continued(self, tenant: str, scope: str, plan: Plan, chat: ChatMeta | None) -> None:
        """A turn that began on another server and moved here mid-answer: after it, checkpoint it here and park its
        session here (the next turn is routed here), as `plan` would have done there."""
        key = None
        if chat is not None and chat.bound and chat.user is not None and chat.chat is not None:
            key = (scope, chat.user, chat.chat)
            with self.lock:
                self._park(key, Session(self.fingerprint, reserved_at=time.monotonic()))
        plan.finish = lambda handles: self._after(tenant, scope, plan, handles, key, chat)

    def keep_prompt_end(self, scope: str, history: list[int], state: State) -> None:
        """The prompt-end checkpoint of a turn that moves to another server mid-answer (kept here, not shipped)."""
        try:
            self._checkpoint(scope, history, state, "prompt_end")
        except Exception:
            log.warning("could not store a moved turn's prompt checkpoint", exc_info=True)

    def moved(self, handles: list[RequestHandle]) -> None:
        """These handles' turn moved to another server: the session parked here for it is stale, so drop it."""
        with self.lock:
            for key in [k for k, s in self.sessions.items() if any(h in s.inflight for h in handles)]:
                self._drop(key)

    def track(self, chat: ChatMeta | None, scope: str, handles: list[RequestHandle]) -> None:
        """Mark the session busy while these handles run (a second turn waits up to BUSY_WAIT_S, then gets 409).
        Only a turn bound to the session does: a background task or a turn without its ids never parks there, so it
        never makes the chat busy."""
        if chat is None or not chat.bound or chat.user is None or chat.chat is None:
            return
        key = (scope, chat.user, chat.chat)
        with self.lock:
            if key in self.sessions:
                self.sessions[key].inflight = list(handles)
                self.sessions[key].reserved_at = None

    def _park(self, key: SessionKey, sess: Session) -> None:
        old = self.sessions.get(key)
        if old is not None and old.handle:
            self._drop(key)
        now, ttl = time.monotonic(), self.config.chat_session_ttl  # expired chats that never came back go too
        for k in [k for k, s in self.sessions.items() if now - s.last_used > ttl and not s.busy]:
            self._drop(k)
        self.sessions[key] = sess
        while len(self.sessions) > self.config.max_chat_sessions:
            self._drop(self._victim())

    def _victim(self) -> SessionKey:
        """The session to make room with: the least recently used one of the tenant (API key: `quota_tenant`) holding
        the most. Least recently used across tenants, one key's flood of new chats had pushed every other tenant's
        parked chats out (their next turns restarted: slower, and `restart_reason` told them others were busy;
        security hunt, session 48)."""
        counts = Counter(quota_tenant(k[0]) for k in self.sessions)
        most = max(counts.values())
        return next(k for k in self.sessions if counts[quota_tenant(k[0])] == most)

    def _drop(self, key: SessionKey) -> None:
        sess = self.sessions.pop(key, None)
        if sess is not None and sess.handle:
            self.store.discard(key[0] + SESS, sess.handle, durable=False)
            if self.mirror is not None:
                self.mirror.forget(key)
