"""Chat continuity: parent-token-v1 sessions and automatic prefix reuse never change an answer."""

import json
import logging
import threading
import time
import uuid

import httpx
import openai
import pytest
import torch
from live_server import LiveServer

from wkvm.engine.handle import RunResult
from wkvm.sampling_params import SamplingParams
from wkvm.state.quota import state_file_bytes
from wkvm.state.sessions import ChatMeta

GREEDY = {"max_tokens": 10, "temperature": 0, "ignore_eos": True}
USER_TURNS = ["Goodmorrow,friend.", "Whatnewsfromthecourt?", "Speakplainly.", "Andthen?", "Farewell."]


# fixtures `reuse` and `fresh` (a server with and one without state reuse): tests/conftest.py


def chat(server, messages, headers=None):
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": messages, **GREEDY},
                   headers=headers or {}, timeout=60)  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()


def test_openai_sdk_multiturn_identical_to_fresh(reuse, fresh):
    a = openai.OpenAI(base_url=f"{reuse.url}/v1", api_key="x", max_retries=0)
    b = openai.OpenAI(base_url=f"{fresh.url}/v1", api_key="x", max_retries=0)
    messages, reused = [], []
    for turn in USER_TURNS[:4]:
        messages.append({"role": "user", "content": turn})
        ra = a.chat.completions.create(model="char-model", messages=messages, extra_body={"ignore_eos": True},
                                       max_tokens=10, temperature=0)  # fmt: skip
        rb = b.chat.completions.create(model="char-model", messages=messages, extra_body={"ignore_eos": True},
                                       max_tokens=10, temperature=0)  # fmt: skip
        assert ra.choices[0].message.content == rb.choices[0].message.content
        assert rb.model_extra["wkvm"]["mode"] == "fresh"
        reused.append(ra.model_extra["wkvm"]["reused_tokens"])
        # OpenAI's field for it too (hunt 14: only the Responses API had it)
        assert ra.usage.prompt_tokens_details.cached_tokens == reused[-1]
        assert rb.usage.prompt_tokens_details.cached_tokens == 0
        messages.append({"role": "assistant", "content": ra.choices[0].message.content})
    stream = a.chat.completions.create(model="char-model", messages=messages, max_tokens=3, temperature=0,
                                       stream=True, stream_options={"include_usage": True})  # fmt: skip
    chunks = list(stream)
    info = next(c.model_extra["wkvm"] for c in chunks if c.model_extra.get("wkvm"))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == info["reused_tokens"] > reused[-1]
    assert reused[0] == 0 and all(n > 0 for n in reused[1:])
    assert reused == sorted(reused)


class OpenWebUI:
    """Sends what Open WebUI sends with the wkvm header templates configured."""

    def __init__(self, server, user="u1", chat_id=None):
        self.server, self.user, self.chat_id = server, user, chat_id or uuid.uuid4().hex
        self.messages, self.last_assistant = [], None

    def headers(self, user_msg_id, asst_id, parent=None, **extra):
        h = {"X-WKVM-Stateful-Chat": "parent-token-v1", "X-OpenWebUI-User-Id": self.user,
             "X-OpenWebUI-Chat-Id": self.chat_id, "X-WKVM-User-Message-ID": user_msg_id,
             "X-WKVM-Assistant-Message-ID": asst_id}  # fmt: skip
        if parent:
            h["X-WKVM-Parent-Message-ID"] = parent
        h.update(extra)
        return h

    def turn(self, text, parent="auto", user_msg_id=None, asst_id=None, messages=None):
        msgs = (messages if messages is not None else self.messages) + [{"role": "user", "content": text}]
        asst_id = asst_id or uuid.uuid4().hex
        parent = self.last_assistant if parent == "auto" else parent
        r = chat(self.server, msgs, self.headers(user_msg_id or uuid.uuid4().hex, asst_id, parent))
        reply = r["choices"][0]["message"]["content"]
        self.messages = msgs + [{"role": "assistant", "content": reply.strip()}]
        self.last_assistant = asst_id
        return r


def test_parent_token_v1_continues_and_matches_fresh(reuse, fresh):
    ui = OpenWebUI(reuse)
    modes = []
    for turn in USER_TURNS[:4]:
        expected = chat(fresh, ui.messages + [{"role": "user", "content": turn}])
        r = ui.turn(turn)
        assert r["choices"][0]["message"]["content"] == expected["choices"][0]["message"]["content"]
        modes.append((r["wkvm"]["mode"], r["wkvm"]["restart_reason"]))
    assert modes[1:] == [("parent_bound", None)] * 3


@pytest.mark.parametrize("reason", ["stale_parent", "edited_history", "message_id_reused", "missing_metadata",
                                    "no_session", "model_changed", "token_mismatch"])  # fmt: skip
def test_each_rejection_restarts_with_its_reason(reuse, fresh, reason):
    ui = OpenWebUI(reuse)
    ui.turn("Hail!")
    first_user_id = uuid.uuid4().hex
    ui.turn("Whogoesthere?", user_msg_id=first_user_id)
    msgs = ui.messages
    next_turn = {"text": "Standandunfoldyourself."}
    if reason == "stale_parent":
        next_turn["parent"] = uuid.uuid4().hex
    elif reason == "edited_history":
        msgs = [dict(m) for m in msgs]
        msgs[0]["content"] = "Hail,Caesar!"
        next_turn["messages"] = msgs
    elif reason == "message_id_reused":
        next_turn["user_msg_id"] = first_user_id
    elif reason == "no_session":
        ui.chat_id = uuid.uuid4().hex  # a chat this server never saw, continued from a parent
    elif reason in ("model_changed", "token_mismatch"):
        sessions = reuse.ctx.sessions
        sess = next(s for k, s in sessions.sessions.items() if k[2] == ui.chat_id)
        if reason == "model_changed":
            sess.fingerprint = "another-model"
        else:
            sess.token_ids = [t + 1 for t in sess.token_ids]
    before = reuse.ctx.metrics.restarts.labels(reason)._value.get()
    if reason == "missing_metadata":
        h = ui.headers(uuid.uuid4().hex, "", ui.last_assistant)
        del h["X-WKVM-Assistant-Message-ID"]
        msgs = ui.messages + [{"role": "user", "content": next_turn["text"]}]
        r = chat(reuse, msgs, h)
    else:
        r = ui.turn(**next_turn)
        msgs = (next_turn.get("messages") or msgs) + [{"role": "user", "content": next_turn["text"]}]
    assert r["wkvm"]["restart_reason"] == reason and r["wkvm"]["mode"] != "parent_bound"
    assert reuse.ctx.metrics.restarts.labels(reason)._value.get() == before + 1
    expected = chat(fresh, msgs)
    assert r["choices"][0]["message"]["content"] == expected["choices"][0]["message"]["content"]


def test_edit_turn_3_of_5_resumes_from_turn_2_checkpoint(reuse, fresh):
    messages, prompts, answers = [], [], []
    for turn in USER_TURNS:
        messages.append({"role": "user", "content": turn})
        r = chat(reuse, messages)
        prompts.append(r["usage"]["prompt_tokens"])
        answers.append(r["usage"]["completion_tokens"])
        messages.append({"role": "assistant", "content": r["choices"][0]["message"]["content"]})
    edited = messages[:4] + [{"role": "user", "content": "Nay,speakofthewar."}]
    r = chat(reuse, edited)
    expected = chat(fresh, edited)
    assert r["choices"][0]["message"]["content"] == expected["choices"][0]["message"]["content"]
    # the edited prompt starts with turn 2's prompt and answer: the turn-2 end checkpoint holds all of those
    # tokens but its pending last one, and nothing stored goes further into the edited prompt
    turn2_end = prompts[1] + answers[1] - 1
    assert r["wkvm"] == {"mode": "exact_prefix", "reused_tokens": turn2_end, "restart_reason": None}
    assert turn2_end < r["usage"]["prompt_tokens"]


def test_two_users_same_chat_id_never_share(reuse, fresh):
    chat_id = uuid.uuid4().hex
    alice = OpenWebUI(reuse, user="alice", chat_id=chat_id)
    alice.turn("IamAlice.")
    alice.turn("Rememberme.")
    bob = OpenWebUI(reuse, user="bob", chat_id=chat_id)
    bob.messages, bob.last_assistant = alice.messages, alice.last_assistant  # Bob replays Alice's ids
    history = list(alice.messages)
    r = bob.turn("WhoamI?")
    assert r["wkvm"]["mode"] != "parent_bound" and r["wkvm"]["restart_reason"] == "no_session"
    assert r["wkvm"]["reused_tokens"] == 0  # Bob's checkpoints are his own, and he has none
    expected = chat(fresh, history + [{"role": "user", "content": "WhoamI?"}])
    assert r["choices"][0]["message"]["content"] == expected["choices"][0]["message"]["content"]


def test_busy_session_gets_409(reuse):
    """A second turn waits BUSY_WAIT_S for the session's running turn, then gets 409; while it waits, a third gets
    its 409 at once (one waiting thread a session: a client sending many cannot hold the server's threads)."""
    ui = OpenWebUI(reuse)
    ui.turn("Begin.")
    body = {"messages": ui.messages + [{"role": "user", "content": "Goon."}], "max_tokens": 16384,
            "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    started, stop = threading.Event(), threading.Event()

    def long_request():
        with httpx.stream("POST", f"{reuse.url}/v1/chat/completions", json=body, timeout=60,
                          headers=ui.headers(uuid.uuid4().hex, uuid.uuid4().hex, ui.last_assistant)) as r:  # fmt: skip
            for _ in r.iter_lines():
                started.set()
                if stop.is_set():
                    break  # disconnecting cancels the long request

    def next_turn(answers: list) -> None:
        r = httpx.post(f"{reuse.url}/v1/chat/completions", json={**body, "stream": False, "max_tokens": 2}, timeout=60,
                       headers=ui.headers(uuid.uuid4().hex, uuid.uuid4().hex, ui.last_assistant))  # fmt: skip
        answers.append((time.monotonic(), r))

    engine = reuse.ctx.client.engine
    step = engine.step
    engine.step = lambda: time.sleep(0.01) or step()  # the long turn runs until its client leaves, on any machine
    try:
        t = threading.Thread(target=long_request)
        t.start()
        assert started.wait(30)
        answers: list = []
        turns = [threading.Thread(target=next_turn, args=(answers,)) for _ in range(2)]
        for turn in turns:
            turn.start()
        for turn in turns:
            turn.join()
        stop.set()
        t.join()
    finally:
        engine.step = step
    assert [r.status_code for _, r in answers] == [409, 409] and {r.json()["error"]["code"] for _, r in answers} == {
        "session_busy"}  # fmt: skip
    assert answers[1][0] - answers[0][0] > 1.0  # one waited for the running turn, the other did not


def test_a_turn_sent_as_the_client_stops_the_last_one_is_served_not_409(reuse, fresh):
    """Open WebUI's stop, then a message at once: the stopped stream's turn takes ~0.3-0.7 s to end after its client
    leaves, and the next turn had been a 409 session_busy meanwhile (noticed session 50; fixed session 54: it waits
    for the ending turn, BUSY_WAIT_S at most)."""
    ui = OpenWebUI(reuse)
    ui.turn("Begin.")
    stopped = uuid.uuid4().hex
    body = {"messages": ui.messages + [{"role": "user", "content": "Goon."}], "max_tokens": 16384,
            "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    engine = reuse.ctx.client.engine
    step = engine.step
    engine.step = lambda: time.sleep(0.2) or step()  # steps as slow as a real model's under load: the server learns
    try:  # that the client left at its next step's output, as it does with SmolLM2 behind Open WebUI
        with httpx.stream("POST", f"{reuse.url}/v1/chat/completions", json=body, timeout=60,
                          headers=ui.headers(uuid.uuid4().hex, stopped, ui.last_assistant)) as r:  # fmt: skip
            for line in r.iter_lines():
                if line.startswith("data: ") and json.loads(line[6:]).get("choices"):
                    break  # the stop: the client leaves mid-answer
        messages = ui.messages + [{"role": "user", "content": "Again."}]
        r = httpx.post(f"{reuse.url}/v1/chat/completions", json={"messages": messages, **GREEDY}, timeout=60,
                       headers=ui.headers(uuid.uuid4().hex, uuid.uuid4().hex, ui.last_assistant))  # fmt: skip
    finally:
        engine.step = step
    assert r.status_code == 200, r.text
    want = chat(fresh, messages)["choices"][0]["message"]["content"]
    assert r.json()["choices"][0]["message"]["content"] == want


def test_tight_caps_evict_and_stay_correct(char_model, fresh):
    one = None
    with LiveServer(model=str(char_model), slots=2, max_chat_sessions=1, checkpoint_bytes=1) as tight:
        one = tight.ctx.model.spec.nbytes
        assert tight.ctx.sessions.capacity == 1 and one > 1
        a, b = OpenWebUI(tight), OpenWebUI(tight)
        for turn in USER_TURNS[:3]:
            for ui in (a, b):
                expected = chat(fresh, ui.messages + [{"role": "user", "content": turn}])
                r = ui.turn(turn)
                assert r["choices"][0]["message"]["content"] == expected["choices"][0]["message"]["content"]
        assert len(tight.ctx.sessions.sessions) == 1
        assert all(len(t) <= 1 for t in tight.ctx.sessions.tries.values())


def test_a_full_session_table_makes_room_from_the_tenant_holding_the_most():
    """Security hunt (session 48): least recently used across tenants, one key's flood of new chats (each under its
    own `user`, too) pushed every other tenant's parked chats out. The victim is now the least recently used session
    of the tenant (API key) holding the most; `user`, `cache_salt` and an Open WebUI user id, which the client
    chooses, do not make a new tenant (review, session 48)."""
    from collections import OrderedDict

    from wkvm.state.quota import quota_tenant
    from wkvm.state.sessions import ChatSessions, reuse_scope

    sessions = object.__new__(ChatSessions)  # only the table matters here
    sessions.sessions = OrderedDict()
    sessions.sessions[("key-a", "", "c1")] = None  # the least recently used of all
    for i in range(3):  # each under another `user` and Open WebUI user id: one tenant still
        sessions.sessions[(reuse_scope(f"key-b/user-{i:016x}", f"u{i}", "salt"), "", f"b{i}")] = None
    assert sessions._victim() == (reuse_scope(f"key-b/user-{0:016x}", "u0", "salt"), "", "b0")
    sessions.sessions.popitem(last=False)
    sessions.sessions.pop((reuse_scope(f"key-b/user-{0:016x}", "u0", "salt"), "", "b0"))
    sessions.sessions.pop((reuse_scope(f"key-b/user-{1:016x}", "u1", "salt"), "", "b1"))
    sessions.sessions[("key-a", "", "c2")] = None
    sessions.sessions[("key-a", "", "c3")] = None
    assert sessions._victim() == ("key-a", "", "c2")
    assert quota_tenant(reuse_scope("key-a/user-0123456789abcdef", "x", "y")) == "key-a"


def test_checkpoints_the_store_evicts_leave_their_trie_and_a_scope_without_any_goes(char_model, reuse):
    """Hunt 22: each reuse scope (a `user`, say) kept a trie of every checkpoint it was told of after the store had
    evicted them, and the scope's trie stayed: ~115 MB per 1,000 users. Now the tries hold just what the store holds."""
    ckpt = state_file_bytes(reuse.ctx.model.spec, 24)  # the same model's
    with LiveServer(model=str(char_model), slots=2, checkpoint_bytes=4 * ckpt) as server:
        ctx = server.ctx
        OpenWebUI(server).turn(USER_TURNS[0])  # a parked session: its state is evicted as well
        assert all(s.handle for s in ctx.sessions.sessions.values())
        for i in range(12):
            run_plan(ctx, "t", ctx.tokenizer.encode(f"[user]Scope{i}.[assistant]"), scope=f"t/u{i}")
        records = ctx.store.index.list()
        stored = {(r.owner.removesuffix("#ckpt"), r.handle) for r in records if r.owner.endswith("#ckpt")}
        known = {(scope, key) for scope, trie in ctx.sessions.tries.items() for key in trie.fed_of}
        assert known == stored and 0 < len(stored) <= 4
        assert all(len(trie) > 0 for trie in ctx.sessions.tries.values()) and len(ctx.sessions.tries) <= 4
        assert [(s.handle, s.token_ids) for s in ctx.sessions.sessions.values()] == [(None, [])]
        info, _ = run_plan(ctx, "t", ctx.tokenizer.encode("[user]Scope11.[assistant]Again"), scope="t/u11")
        assert info["reused_tokens"] > 0  # the newest are still reused


def test_a_parked_chat_that_evicts_its_own_older_state_keeps_the_new_one(char_model, reuse):
    """Review of 73edb59: with room for one session state, a chat's next save evicts its own older state, and the
    store gives the new one the same handle (no version of the name is left): the session had then discarded its new
    state as the old one, and the queued eviction notice had cleared it too. The next turn restarted (no_session)."""
    spec = reuse.ctx.model.spec
    with LiveServer(model=str(char_model), slots=2, checkpoint_bytes=int(1.5 * state_file_bytes(spec, 200))) as server:
        ctx = server.ctx
        ui = OpenWebUI(server)
        ui.turn(USER_TURNS[0])
        ((key, sess),) = ctx.sessions.sessions.items()
        old = sess.handle
        state = {t.name: torch.randn((1, *t.shape), generator=torch.Generator().manual_seed(3)) for t in spec.tensors}
        chat = ChatMeta([{"role": "user", "content": "x"}], True, key[1], key[2], "a2", "u2", ui.last_assistant)
        ctx.sessions._update_session(key, chat, RunResult(sess.token_ids + [5, 6], state, [], None), "reply")
        assert sess.handle == old and (key[0] + "#sessions", old) in ctx.sessions.evicted  # given again
        with ctx.sessions.lock:
            ctx.sessions._forget_evicted()
        assert sess.handle == old and ctx.store.load(key[0] + "#sessions", old)[0].token_ids == sess.token_ids


def test_expired_chat_sessions_go_even_if_their_chat_never_returns(char_model):
    with LiveServer(model=str(char_model), slots=2, chat_session_ttl=0.5) as server:
        a, b = OpenWebUI(server), OpenWebUI(server)
        a.turn(USER_TURNS[0])
        assert len(server.ctx.sessions.sessions) == 1
        time.sleep(0.6)
        b.turn(USER_TURNS[0])  # parking b's session sweeps a's, expired
        assert [k[2] for k in server.ctx.sessions.sessions] == [b.chat_id]


def test_no_prefix_reuse_switch(fresh):
    msgs = [{"role": "user", "content": "Hello"}]
    first = chat(fresh, msgs)
    again = chat(fresh, msgs + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                                {"role": "user", "content": "Again"}])  # fmt: skip
    assert again["wkvm"] == {"mode": "fresh", "reused_tokens": 0, "restart_reason": None}


def test_a_failing_checkpoint_never_fails_the_answer(reuse, fresh, monkeypatch):
    def broken_put(*args, **kwargs):
        raise OSError("no space left on device")

    monkeypatch.setattr(reuse.ctx.store, "put", broken_put)
    msgs = [{"role": "user", "content": "Isthediskfull?"}]
    r = chat(reuse, msgs)  # checkpoints are a cache: the answer comes back whatever happens to them
    assert r["choices"][0]["message"]["content"] == chat(fresh, msgs)["choices"][0]["message"]["content"]


def test_a_streams_last_token_does_not_wait_for_the_turns_checkpoints(reuse, monkeypatch):
    """The turn's checkpoints (a long context's keys and values hashed and copied: 0.4 s at 3.5k SmolLM2 tokens) come
    after the answer's last token: only the end chunk (empty delta, finish reason, `wkvm`), as OpenAI's, waits."""
    saving, release = threading.Event(), threading.Event()
    store_put = reuse.ctx.store.put

    def held_put(*args, **kwargs):
        saving.set()
        assert release.wait(30)
        return store_put(*args, **kwargs)

    monkeypatch.setattr(reuse.ctx.store, "put", held_put)
    body = {"messages": [{"role": "user", "content": "Waitforme."}], **GREEDY, "stream": True, "return_token_ids": True}
    chunks = []
    with httpx.stream("POST", f"{reuse.url}/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        while sum(len(c["choices"][0].get("token_ids", [])) for c in chunks if c["choices"]) < GREEDY["max_tokens"]:
            line = next(lines)
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
        assert saving.wait(30) and not release.is_set()  # every token is out while the checkpoint is held
        release.set()
        rest = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks)
    assert rest[0]["choices"][0] == {"index": 0, "delta": {}, "finish_reason": "length", "logprobs": None,
                                     "stop_reason": None, "token_ids": []}  # fmt: skip
    assert rest[0]["wkvm"]["mode"] == "fresh"


def test_a_sibling_turn_planned_while_the_last_turn_parks_is_exact(reuse, fresh, monkeypatch):
    """Review (session 38, a chaos storm): a turn whose handles are done is no longer busy, but its session is parked
    after that (`_update_session`). A sibling turn (a regenerate: the same parent) planned meanwhile checked the
    session under the lock and read its handle and tokens after it: the old state with the new turn's token count,
    a wrong answer (a 500 where the prompt was no longer). Here the park lands between the sibling's load and its
    plan: the sibling must answer as a fresh server does."""
    ui = OpenWebUI(reuse)
    ui.turn(USER_TURNS[0])
    parent, before = ui.last_assistant, list(ui.messages)
    sessions, store = reuse.ctx.sessions, reuse.ctx.store
    update, load = sessions._update_session, store.load
    parking, go, parked = threading.Event(), threading.Event(), threading.Event()

    def held_update(*args, **kwargs):
        parking.set()
        assert go.wait(30)
        try:
            return update(*args, **kwargs)
        finally:
            parked.set()

    def racing_load(owner, handle, *args, **kwargs):
        out = load(owner, handle, *args, **kwargs)
        if owner.endswith("#sessions") and parking.is_set() and not go.is_set():
            go.set()  # the last turn parks now, after this load and before the plan
            assert parked.wait(30)
        return out

    monkeypatch.setattr(sessions, "_update_session", held_update)
    monkeypatch.setattr(store, "load", racing_load)
    second = threading.Thread(target=ui.turn, args=(USER_TURNS[1],))
    second.start()
    assert parking.wait(30)
    sibling = OpenWebUI(reuse, ui.user, ui.chat_id)
    sibling.messages = before
    r = sibling.turn(USER_TURNS[2], parent=parent)
    second.join(30)
    expected = chat(fresh, before + [{"role": "user", "content": USER_TURNS[2]}])
    assert r["choices"][0]["message"]["content"] == expected["choices"][0]["message"]["content"]
    assert go.is_set() and r["wkvm"]["mode"] == "parent_bound", r["wkvm"]


def test_full_quota_never_fails_a_chat_answer(char_model, fresh, tmp_path):
    """Users' states fill --state-disk-quota: chat turns still answer, and their checkpoints stay within it."""
    quota, root = 600_000, tmp_path / "quota"
    with LiveServer(model=str(char_model), slots=2, state_dir=str(root), state_disk_quota=quota) as server:
        for i in range(200):
            r = httpx.post(f"{server.url}/v1/states", json={"name": f"fill{i}", "prompt": f"Fill{i}."}, timeout=60)
            if r.status_code != 200:
                break
        assert r.status_code == 413 and r.json()["error"]["code"] == "state_quota_exceeded"
        messages = []
        for turn in USER_TURNS[:3]:
            messages.append({"role": "user", "content": turn})
            reply = chat(server, messages)["choices"][0]["message"]["content"]  # 413 here before
            assert reply == chat(fresh, messages)["choices"][0]["message"]["content"]
            messages.append({"role": "assistant", "content": reply})
        # an Open WebUI turn whose save_state does not fit: 413, and the session it reserved is given back (every
        # retry had been a 409 session_busy for 30 s)
        ui = OpenWebUI(server)
        ui.turn(USER_TURNS[0])
        msgs = ui.messages + [{"role": "user", "content": USER_TURNS[1]}]
        for extra in ({"save_state": "toolarge"}, {}):
            r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": msgs, **GREEDY, **extra},
                           headers=ui.headers(uuid.uuid4().hex, uuid.uuid4().hex, ui.last_assistant), timeout=60)
            assert r.status_code == (413 if extra else 200), r.text
    assert sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) <= quota


def run_plan(ctx, tenant: str, prompt_ids: list[int], scope: str | None = None) -> tuple[dict, list[int]]:
    """One request through ChatSessions.plan, the engine and the plan's finish (as the server runs it)."""
    plan = ctx.sessions.plan(tenant, prompt_ids, scope=scope)
    run = {"initial_state": plan.base_state, "base_ids": plan.base_ids, "capture_state": True}
    h = ctx.client.engine.submit(plan.feed_ids, SamplingParams(**GREEDY), **run, capture_prompt_state=True)
    h.result(60)
    plan.finish([h])
    return plan.info, h.output.token_ids


def test_checkpoints_are_reused_only_within_their_scope(char_model, tmp_path, monkeypatch, caplog):
    tenant, a, b = "key-1f2e", "key-1f2e/user-9a0b:fp=ab12cd", "key-1f2e/user-9a0b:fp=ffff00"
    config = {"model": str(char_model), "slots": 2, "state_dir": str(tmp_path / "scoped")}
    with LiveServer(**config) as server:
        ctx = server.ctx
        prompt = ctx.tokenizer.encode("[user]Scopedprefix.[assistant]")
        info, out = run_plan(ctx, tenant, prompt, scope=a)
        assert info["mode"] == "fresh"
        longer = prompt + out + ctx.tokenizer.encode("[user]More.[assistant]")
        assert run_plan(ctx, tenant, longer, scope=b)[0]["reused_tokens"] == 0
        assert run_plan(ctx, tenant, longer)[0]["reused_tokens"] == 0  # the default scope is the tenant
        info, _ = run_plan(ctx, tenant, longer, scope=a)
        assert info["mode"] == "exact_prefix" and info["reused_tokens"] == len(prompt) + len(out) - 1
    with LiveServer(**config) as restarted:  # checkpoint owners map back to their scopes
        ctx = restarted.ctx
        assert {a, b, tenant} <= set(ctx.sessions.tries)
        assert run_plan(ctx, tenant, longer + [5, 6], scope=a)[0]["reused_tokens"] >= len(longer) - 1
        assert run_plan(ctx, tenant, longer + [5, 6], scope="key-1f2e/user-9a0b:fp=000000")[0]["mode"] == "fresh"
    # the same weights and dtype on another kernel path (the native int8 kernel's dequantizing fallback: a reused
    # turn's logprobs had moved by 0.026; dtype hunt, session 49): not this server's checkpoints either
    with monkeypatch.context() as m:
        m.setattr("wkvm.state.sessions.compute_paths", lambda dtype, device: "torch 0, another kernel")
        with caplog.at_level(logging.INFO, logger="wkvm.sessions"), LiveServer(**config) as other_path:
            assert not other_path.ctx.sessions.tries and not other_path.ctx.store.index.list()
        assert any("chat checkpoint(s) computed otherwise" in r.getMessage() for r in caplog.records)  # said so
    # weights computed otherwise: not this server's checkpoints (they were resumed: a turn's logprobs moved by up to
    # 0.07 after an int8 server's, found by review)
    with LiveServer(**config, dtype="bfloat16") as other:
        ctx = other.ctx
        assert not ctx.sessions.tries and not ctx.store.index.list()
        assert run_plan(ctx, tenant, longer + [5, 6], scope=a)[0]["mode"] == "fresh"


def test_a_parked_chat_resumes_only_in_its_reuse_scope(reuse):
    """A parent-token-v1 session is parked under its request's `user` and `cache_salt` too: another scope's next turn
    restarts from its own checkpoints, as automatic reuse does (the session had been resumed across them)."""
    ui = OpenWebUI(reuse)
    ui.turn(USER_TURNS[0])
    msgs = ui.messages + [{"role": "user", "content": USER_TURNS[1]}]
    headers = ui.headers(uuid.uuid4().hex, uuid.uuid4().hex, ui.last_assistant)
    for body in ({"user": "bob"}, {"cache_salt": "salt-two"}):
        r = httpx.post(f"{reuse.url}/v1/chat/completions", json={"messages": msgs, **GREEDY, **body}, headers=headers,
                       timeout=60)  # fmt: skip
        assert r.status_code == 200 and r.json()["wkvm"]["mode"] != "parent_bound", r.text


def test_the_tries_nodes_stay_within_the_checkpoint_budget(char_model, fresh, tmp_path):
    """The store charges a checkpoint its state and ~12 B a token, but the trie keeps a node of ~300 B a token: distinct
    long prompts had grown the tries ~25x past --checkpoint-bytes. Their nodes are bounded by it (NODE_BYTES each),
    the largest scope's oldest checkpoints going first; reuse stays exact."""
    from wkvm.state.prefix import NODE_BYTES

    budget = 120 * NODE_BYTES  # 120 stored tokens: a few prompts' worth
    with LiveServer(model=str(char_model), slots=2, state_dir=str(tmp_path / "s"), checkpoint_bytes=budget) as s:
        sessions = s.ctx.sessions
        trimmed, trim = [], sessions._trim_tries

        def counted():
            gone = trim()
            trimmed.extend(gone)
            return gone

        sessions._trim_tries = counted
        for i in range(8):
            messages = [{"role": "user", "content": f"Prompt{i}:" + "abcdefghij"[i:] * 5}]
            assert chat(s, messages)["choices"][0]["message"] == chat(fresh, messages)["choices"][0]["message"]
            nodes = sum(t.nodes for t in sessions.tries.values())
            assert sessions.trie_nodes.n == nodes <= sessions.max_trie_nodes == 120, (i, nodes)
        assert sessions.tries and trimmed  # the bound, not the store's budget, let the oldest go; the newest stay
