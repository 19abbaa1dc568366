"""The browser half of scripts/e2e_openwebui.py: runs in the Open WebUI side venv (it needs Playwright) and drives
chats through the Open WebUI page in Debian's Chromium, like a user.

    python e2e_openwebui_browser.py STEPS.json STATE.json OUT.json

STEPS: {"base": url, "email": ..., "password": ..., "token": jwt (for its API reads),
        "steps": [{"chat": name, "op": op, "text": ..., "index": ...}]}; op is one of
  new         open a new chat and send `text`
  say         send `text` as the next message of the chat (a plain follow-up)
  regenerate  click Regenerate on the last answer
  edit        edit the user message number `index` (0-based, on the page) to `text` and send it
  branch      show the previous version of user message `index` (the branch before an edit), then send `text`
  open        reopen the chat from its URL (a fresh page load, e.g. after the server restarted) and send `text`
STATE: chat names -> Open WebUI chat ids, carried from one run to the next.
OUT: one result per step: chat id, the new assistant and user message ids, the reply as Open WebUI stored it.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from playwright.sync_api import Page, sync_playwright

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]  # fmt: skip
TURN_TIMEOUT = 300.0


class Driver:
    def __init__(self, page: Page, base: str, token: str):
        self.page, self.base, self.token = page, base.rstrip("/"), token

    def api_chat(self, chat_id: str) -> dict[str, Any]:
        r = self.page.request.get(f"{self.base}/api/v1/chats/{chat_id}",
                                  headers={"Authorization": f"Bearer {self.token}"})  # fmt: skip
        if not r.ok:
            raise RuntimeError(f"GET chat {chat_id}: {r.status} {r.text()[:200]}")
        data: dict[str, Any] = r.json()
        return data

    def messages(self, chat_id: str | None) -> dict[str, Any]:
        if chat_id is None:
            return {}
        msgs: dict[str, Any] = self.api_chat(chat_id)["chat"]["history"]["messages"]
        return msgs

    def dismiss(self) -> None:
        btn = self.page.get_by_text("Okay, Let's Go!")
        if btn.count():
            btn.first.click()

    def goto(self, path: str) -> None:
        self.page.goto(self.base + path)
        self.page.wait_for_selector("#chat-input", timeout=60_000)
        self.dismiss()

    def send(self, text: str) -> None:
        box = self.page.locator("#chat-input")
        box.click()
        self.page.keyboard.type(text)
        self.page.keyboard.press("Enter")

    def chat_ids(self) -> set[str]:
        r = self.page.request.get(f"{self.base}/api/v1/chats/?page=1",
                                  headers={"Authorization": f"Bearer {self.token}"})  # fmt: skip
        return {c["id"] for c in r.json()}

    def new_chat_id(self, before: set[str]) -> str:
        """The chat the page just created (the URL changes only later)."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            new = self.chat_ids() - before
            if new:
                return new.pop()
            time.sleep(0.3)
        raise RuntimeError("the page created no chat")

    def wait_answer(self, chat_id: str, known: set[str]) -> dict[str, Any]:
        """The new assistant message once Open WebUI has stored it complete, and the page shows it."""
        deadline = time.monotonic() + TURN_TIMEOUT
        while time.monotonic() < deadline:
            msgs = self.messages(chat_id)
            new = [m for k, m in msgs.items() if k not in known and m.get("role") == "assistant"]
            if new and all(m.get("done") for m in new):
                m = new[-1]
                self.page.wait_for_selector(f"#message-{m['id']}", timeout=60_000)
                time.sleep(0.5)  # the page's own save of the chat after the answer
                parent = msgs.get(m.get("parentId") or "", {})
                return {"assistant_id": m["id"], "user_message_id": parent.get("id"), "reply": m.get("content", ""),
                        "user_text": parent.get("content"), "error": m.get("error")}  # fmt: skip
            time.sleep(0.5)
        raise RuntimeError(f"no answer in chat {chat_id} after {TURN_TIMEOUT:.0f}s")

    def user_message(self, index: int) -> Any:
        users = self.page.locator(".user-message")
        users.nth(index).wait_for(timeout=30_000)
        return users.nth(index)

    def step(self, step: dict[str, Any], chats: dict[str, str]) -> dict[str, Any]:
        op, text = step["op"], step.get("text", "")
        chat_id = chats.get(step["chat"])
        known = set(self.messages(chat_id))
        if op == "new":
            self.goto("/")
            before = self.chat_ids()
            self.send(text)
            chat_id = self.new_chat_id(before)
            chats[step["chat"]] = chat_id
        else:
            assert chat_id is not None, f"chat {step['chat']} was never started"
            if op == "open" or f"/c/{chat_id}" not in self.page.url:
                self.goto(f"/c/{chat_id}")
                time.sleep(1)
            if op in ("say", "open"):
                self.send(text)
            elif op == "regenerate":
                last = self.page.locator(".chat-assistant").last
                last.hover()
                self.page.locator("button[aria-label=Regenerate]").last.click()
                self.page.get_by_text("Try Again", exact=True).last.click()  # the menu: try again / add details / ...
            elif op == "edit":
                msg = self.user_message(step["index"])
                msg.hover()
                msg.locator("button[aria-label=Edit]").first.click()
                area = msg.locator("textarea[id^=message-edit-]")
                area.fill(text)
                msg.locator("#confirm-edit-message-button").click()
            elif op == "branch":
                msg = self.user_message(step["index"])
                msg.hover()
                msg.locator("button[aria-label='Previous message']").first.click()
                time.sleep(1)
                self.send(text)
            else:
                raise ValueError(f"unknown op {op!r}")
        t0 = time.time()
        out = self.wait_answer(chat_id, known)
        return {**step, "chat_id": chat_id, "t_start": t0, "t_end": time.time(), **out}


def sign_in(page: Page, base: str, email: str, password: str) -> None:
    """Through the sign-in form, as a user does."""
    page.goto(base + "/auth")
    page.locator("input[type=email]").fill(email)
    page.locator("input[type=password]").fill(password)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_selector("#chat-input", timeout=60_000)


def main() -> None:
    steps_file, state_file, out_file = map(Path, sys.argv[1:4])
    spec = json.loads(steps_file.read_text())
    chats: dict[str, str] = json.loads(state_file.read_text()) if state_file.exists() else {}
    results: list[dict[str, Any]] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        sign_in(page, spec["base"], spec["email"], spec["password"])
        d = Driver(page, spec["base"], spec["token"])
        try:
            for i, step in enumerate(spec["steps"]):
                print(f"[browser] {i + 1}/{len(spec['steps'])} chat {step['chat']}: {step['op']}", flush=True)
                try:
                    results.append(d.step(step, chats))
                except Exception as e:  # record it and go on: one broken step must not hide the others
                    page.screenshot(path=str(out_file.with_suffix(f".step{i}.png")))
                    results.append({**step, "chat_id": chats.get(step["chat"]), "failed": f"{type(e).__name__}: {e}"})
                    print(f"[browser] step failed: {e}", flush=True)
        finally:
            state_file.write_text(json.dumps(chats))
            out_file.write_text(json.dumps(results, indent=1))
            browser.close()


if __name__ == "__main__":
    main()
