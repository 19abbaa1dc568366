"""What the real Open WebUI (0.12) sends beside a chat's turns: background tasks (title, tags, follow-up
suggestions) carrying the chat's identity headers, sent while the next turn may already run. They must neither
make the chat busy (409) nor count as session restarts nor disturb the parked state (found by
scripts/e2e_openwebui.py)."""

import threading
import uuid

import httpx
import pytest

GREEDY = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}


# fixtures `reuse` and `fresh` (a server with and one without state reuse): tests/conftest.py


class Chat:
    """Headers as Open WebUI 0.12 sends them with the documented connection headers: its own X-OpenWebUI-* and the
    templates {{USER_MESSAGE_ID}}, {{MESSAGE_ID}}, {{USER_MESSAGE_PARENT_ID}} and {{TASK}} (each '' when unset)."""

    def __init__(self, server):
        self.server, self.chat_id, self.messages = server, uuid.uuid4().hex, []
        self.last_user, self.last_assistant = "", ""

    def headers(self, user_msg: str, asst: str, parent: str, task: str = "") -> dict[str, str]:
        return {"X-OpenWebUI-User-Id": "u-owui", "X-OpenWebUI-Chat-Id": self.chat_id,
                "X-WKVM-Stateful-Chat": "parent-token-v1", "X-WKVM-User-Message-ID": user_msg,
                "X-WKVM-Assistant-Message-ID": asst, "X-WKVM-Parent-Message-ID": parent,
                "X-WKVM-Task": task}  # fmt: skip

    def turn(self, text: str) -> dict:
        msgs = self.messages + [{"role": "user", "content": text}]
        user_msg, asst = uuid.uuid4().hex, uuid.uuid4().hex
        r = post(self.server, msgs, self.headers(user_msg, asst, self.last_assistant))
        assert r.status_code == 200, r.text
        body = r.json()
        self.messages = msgs + [{"role": "assistant", "content": body["choices"][0]["message"]["content"]}]
        self.last_user, self.last_assistant = user_msg, asst
        return body

    def task_headers(self, task: str) -> dict[str, str]:
        """A background task after a turn: the turn's user message id, no assistant id, no parent."""
        return self.headers(self.last_user, "", "", task)


def post(server, messages, headers, **extra):
    return httpx.post(f"{server.url}/v1/chat/completions", json={"messages": messages, **GREEDY, **extra},
                      headers=headers, timeout=60)  # fmt: skip


def title_prompt(messages) -> list[dict]:
    history = "\n".join(f"{m['role'].upper()}: {m['content']}" for m in messages)
    return [{"role": "user", "content": f"### Task:\nGenerate a concise title.\n<chat_history>\n{history}\n"}]


def restarts(server) -> float:
    return sum(s.value for m in server.ctx.metrics.restarts.collect() for s in m.samples if s.name.endswith("_total"))


def test_tasks_neither_restart_nor_disturb_the_parked_chat(reuse, fresh):
    ui = Chat(reuse)
    ui.turn("Goodmorrow.")
    before = restarts(reuse)
    for task in ("title_generation", "tags_generation", "follow_up_generation"):
        r = post(reuse, title_prompt(ui.messages), ui.task_headers(task))
        assert r.status_code == 200, r.text
        assert r.json()["wkvm"]["restart_reason"] is None  # a side request, not a restarted chat
        expected = post(fresh, title_prompt(ui.messages), {})
        assert r.json()["choices"][0]["message"]["content"] == expected.json()["choices"][0]["message"]["content"]
    assert restarts(reuse) == before
    r = ui.turn("Whatnews?")
    assert r["wkvm"]["mode"] == "parent_bound" and r["wkvm"]["restart_reason"] is None
    expected = post(fresh, ui.messages[:-1], {})
    assert r["choices"][0]["message"]["content"] == expected.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize("task", ["follow_up_generation", ""], ids=["task-header", "no-task-header"])
def test_a_running_task_never_makes_the_next_turn_409(reuse, fresh, task):
    """Open WebUI sends the follow-up suggestions request after an answer and lets the user send the next turn at
    once. Without X-WKVM-Task (an older connection config) the task has no assistant id: still not the chat's."""
    ui = Chat(reuse)
    ui.turn("Begin.")
    body = {"messages": title_prompt(ui.messages), "max_tokens": 3000, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    started, stop = threading.Event(), threading.Event()

    def long_task():
        with httpx.stream("POST", f"{reuse.url}/v1/chat/completions", json=body, timeout=60,
                          headers=ui.task_headers(task)) as r:  # fmt: skip
            for _ in r.iter_lines():
                started.set()
                if stop.is_set():
                    break  # disconnecting cancels it

    t = threading.Thread(target=long_task)
    t.start()
    try:
        assert started.wait(30)
        r = ui.turn("Goon.")
    finally:
        stop.set()
        t.join()
    assert r["wkvm"]["mode"] == "parent_bound"
    expected = post(fresh, ui.messages[:-1], {})
    assert r["choices"][0]["message"]["content"] == expected.json()["choices"][0]["message"]["content"]
