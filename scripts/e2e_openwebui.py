"""Open WebUI end to end (`make e2e-openwebui`; not part of `make test`): real chats in a headless browser against
wkvm, checked against a second wkvm without reuse.

What it does:
1. installs Open WebUI (the newest release pip finds, or --openwebui-spec) and Playwright into their own venv
   outside the repository (default ~/.cache/wkvm/openwebui-venv; reused when present), with constraints.txt
   pinning torch to the CPU wheel; Chromium is Debian's `chromium` package (no browser download);
2. starts two wkvm servers on loopback with the embedded default model: the one under test (with a --state-dir)
   and an oracle with --no-prefix-reuse;
3. puts a recording proxy between Open WebUI and the wkvm under test (it forwards every byte and keeps a copy of
   each chat request and of the `wkvm` object of its answer);
4. starts Open WebUI offline with wkvm as its only OpenAI connection, forwarding user and chat identity and the
   parent-token-v1 headers, creates the admin (the first signup) and gives the model seeded sampling params
   (temperature 0.8, seed 1234, sent with every request: replies vary, and replay exactly on the oracle; the tiny
   default model's greedy reply is the same line whatever it is asked, which would check nothing);
5. drives chats in Chromium through the Open WebUI page (scripts/e2e_openwebui_browser.py, run in the side
   venv): plain follow-ups, a regenerate, an edit of an earlier user message, a branch (a second reply to an
   earlier question) and, after wkvm is restarted on the same --state-dir, a resumed chat;
6. replays every recorded request on the oracle and compares the replies, reads wkvm's restart counters, and
   writes a JSON report and a PNG plot (--out, default docs/openwebui_e2e.{json,png}).

Exit status 0 when the targets hold (>= 95% of plain follow-ups reuse the parked state exactly, no wrong
continuation), 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx

from wkvm.server.background import first_free_port

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = ROOT / ".venv" / "bin"
DEFAULT_SIDE_VENV = Path.home() / ".cache" / "wkvm" / "openwebui-venv"
CHROMIUM = "/usr/bin/chromium"
MODEL_PARAMS = {"temperature": 0.8, "seed": 1234, "max_tokens": 48}  # seeded: replies vary and replay exactly
# parent-token-v1 through Open WebUI's per-connection header templates (utils/headers.py: parse_custom_headers)
CONNECTION_HEADERS = {
    "X-WKVM-Stateful-Chat": "parent-token-v1",
    "X-WKVM-User-Message-ID": "{{USER_MESSAGE_ID}}",
    "X-WKVM-Assistant-Message-ID": "{{MESSAGE_ID}}",
    "X-WKVM-Parent-Message-ID": "{{USER_MESSAGE_PARENT_ID}}",
    "X-WKVM-Task": "{{TASK}}",
}
ADMIN = {"name": "Admin", "email": "admin@example.com", "password": "wkvm-e2e-password"}


def log(msg: str) -> None:
    print(f"[e2e-openwebui {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --- the side venv ----------------------------------------------------------------------------------------------
def side_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def ensure_side_venv(venv: Path, spec: str) -> str:
    """Open WebUI + Playwright in their own venv; returns the Open WebUI version. Reused when already installed."""
    stamp = venv / ".wkvm-e2e-installed"
    py = side_python(venv)
    if not (stamp.exists() and py.exists() and stamp.read_text().strip() == spec):
        free = shutil.disk_usage(venv.parent if venv.parent.exists() else Path.home()).free
        if free < 8 * 2**30:
            sys.exit(f"e2e-openwebui: Open WebUI needs ~4 GB in {venv}; only {free / 2**30:.1f} GiB free")
        log(f"installing {spec} and playwright into {venv} (a few minutes, ~3 GB)")
        venv.parent.mkdir(parents=True, exist_ok=True)
        if not py.exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        # constraints.txt pins torch (sentence-transformers pulls it) to the CPU wheel: no CUDA download
        subprocess.run([str(py), "-m", "pip", "install", "--quiet", "-c", str(ROOT / "constraints.txt"),
                        spec, "playwright"], check=True)  # fmt: skip
        stamp.write_text(spec + "\n")
    out = subprocess.run([str(py), "-c", "import importlib.metadata as m; print(m.version('open-webui'))"],
                         check=True, capture_output=True, text=True)  # fmt: skip
    return out.stdout.strip()


# --- processes --------------------------------------------------------------------------------------------------
def free_port(start: int) -> int:
    port = first_free_port(range(start, start + 200))
    if port is None:
        raise RuntimeError(f"no free port from {start}")
    return port


class Proc:
    """A child process in its own process group, its output in a log file."""

    def __init__(self, name: str, argv: list[str], logfile: Path, env: dict[str, str] | None = None,
                 cwd: Path | None = None):  # fmt: skip
        self.name, self.logfile = name, logfile
        self.fh = logfile.open("ab")
        self.p = subprocess.Popen(argv, stdout=self.fh, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                  start_new_session=True)  # fmt: skip

    def wait_http(self, url: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.p.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.p.returncode}); see {self.logfile}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url, timeout=5).status_code == 200:
                    return
            time.sleep(1)
        raise RuntimeError(f"{self.name} not up after {timeout:.0f}s; see {self.logfile}")

    def stop(self) -> None:
        if self.p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.p.pid, signal.SIGTERM)
            try:
                self.p.wait(30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait(10)
        self.fh.close()


def start_wkvm(name: str, port: int, state_dir: Path, work: Path, extra: list[str]) -> Proc:
    argv = [str(VENV_BIN / "wkvm"), "serve", "--host", "127.0.0.1", "--port", str(port), "--state-dir",
            str(state_dir), "--slots", "4", *extra]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("WKVM_")}
    p = Proc(name, argv, work / f"{name}.log", env)
    p.wait_http(f"http://127.0.0.1:{port}/health", 180)
    return p


def start_openwebui(venv: Path, port: int, upstream: str, model: str, work: Path) -> Proc:
    data = work / "openwebui-data"
    data.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "WKVM_"))}
    env.update({
        "DATA_DIR": str(data),
        "WEBUI_SECRET_KEY": "wkvm-e2e-secret",
        "WEBUI_AUTH": "True",
        "ENABLE_SIGNUP": "True",
        # wkvm is the only connection; no Ollama
        "ENABLE_OLLAMA_API": "False",
        "ENABLE_OPENAI_API": "True",
        "OPENAI_API_BASE_URLS": upstream,
        "OPENAI_API_KEYS": "wkvm-e2e",
        "OPENAI_API_CONFIGS": json.dumps({"0": {"enable": True, "headers": CONNECTION_HEADERS,
                                                "model_ids": [model], "connection_type": "external"}}),
        # X-OpenWebUI-User-Id, -User-Name, -User-Email, -User-Role and X-OpenWebUI-Chat-Id on every model call
        "ENABLE_FORWARD_USER_INFO_HEADERS": "True",
        # fully offline: no hub downloads, no update check, no embedding model at start
        "OFFLINE_MODE": "True",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "RAG_EMBEDDING_MODEL_AUTO_UPDATE": "False",
        "RAG_RERANKING_MODEL_AUTO_UPDATE": "False",
        "BYPASS_EMBEDDING_AND_RETRIEVAL": "True",
        "ENABLE_VERSION_UPDATE_CHECK": "False",
        "ENABLE_WEB_SEARCH": "False",
        "ENABLE_CODE_INTERPRETER": "False",
        "ENABLE_EVALUATION_ARENA_MODELS": "False",
        "ENABLE_PERSISTENT_CONFIG": "False",
        "ENABLE_BASE_MODELS_CACHE": "False",
        "SCARF_NO_ANALYTICS": "true",
        "DO_NOT_TRACK": "true",
        "ANONYMIZED_TELEMETRY": "false",
        # the background requests stay on (title, tags, follow-ups): they must not disturb a chat's parked state
        "ENABLE_TITLE_GENERATION": "True",
        "ENABLE_TAGS_GENERATION": "True",
        "ENABLE_FOLLOW_UP_GENERATION": "True",
        "GLOBAL_LOG_LEVEL": "INFO",
    })  # fmt: skip
    argv = [str(venv / "bin" / "open-webui"), "serve", "--host", "127.0.0.1", "--port", str(port)]
    p = Proc("openwebui", argv, work / "openwebui.log", env, cwd=work)
    p.wait_http(f"http://127.0.0.1:{port}/health", 600)
    return p


# --- the recording proxy ----------------------------------------------------------------------------------------
class Recorder:
    """Forwards everything to wkvm and keeps each chat request (headers, body) with its reply and `wkvm` object."""

    HOP = {"host", "content-length", "connection", "transfer-encoding", "accept-encoding", "keep-alive"}

    def __init__(self, upstream: str):
        self.upstream = upstream
        self.records: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def app(self) -> Any:
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import Response, StreamingResponse
        from starlette.routing import Route

        client = httpx.AsyncClient(base_url=self.upstream, timeout=600)

        async def forward(request: Request) -> Response:
            body = await request.body()
            headers = {k: v for k, v in request.headers.items() if k.lower() not in self.HOP}
            path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
            req = client.build_request(request.method, path, content=body, headers=headers)
            chat = request.url.path == "/v1/chat/completions" and request.method == "POST"
            rec: dict[str, Any] = {"t": time.time(), "headers": {k.lower(): v for k, v in request.headers.items()},
                                   "body": json.loads(body or b"{}")}  # fmt: skip
            if chat:
                with self.lock:
                    self.records.append(rec)
            resp = await client.send(req, stream=True)
            out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in self.HOP | {"content-encoding"}}
            if not chat:
                data = await resp.aread()
                await resp.aclose()
                return Response(data, resp.status_code, out_headers)
            rec["status"] = resp.status_code

            async def relay() -> AsyncIterator[bytes]:
                raw = b""
                try:
                    async for chunk in resp.aiter_raw():
                        raw += chunk
                        yield chunk
                finally:
                    await resp.aclose()
                    rec.update(parse_reply(raw, "text/event-stream" in resp.headers.get("content-type", "")))
                    rec["t_done"] = time.time()

            return StreamingResponse(relay(), resp.status_code, out_headers)

        return Starlette(routes=[Route("/{path:path}", forward, methods=["GET", "POST", "DELETE", "PUT"])])


def parse_reply(raw: bytes, sse: bool) -> dict[str, Any]:
    """The reply text and `wkvm` object of a chat answer (blocking JSON or SSE)."""
    text, info, err = "", None, None
    try:
        if not sse:
            obj = json.loads(raw)
            if "choices" in obj:
                text = obj["choices"][0]["message"].get("content") or ""
            info, err = obj.get("wkvm"), obj.get("error")
        else:
            for line in raw.decode("utf-8", "replace").splitlines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                err = obj.get("error", err)
                for c in obj.get("choices", []):
                    text += c.get("delta", {}).get("content") or ""
                info = obj.get("wkvm", info)
    except (ValueError, KeyError, IndexError) as e:
        err = f"unparsable reply: {e}"
    return {"reply": text, "wkvm": info, "error": err}


@contextlib.contextmanager
def serve_proxy(recorder: Recorder, port: int) -> Iterator[None]:
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(recorder.app(), host="127.0.0.1", port=port, log_level="warning",
                                           access_log=False))  # fmt: skip
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        yield
    finally:
        server.should_exit = True
        th.join(10)


# --- Open WebUI over HTTP ---------------------------------------------------------------------------------------
def create_admin(base: str) -> str:
    """The first signup becomes the admin (no network needed); returns its session token."""
    r = httpx.post(f"{base}/api/v1/auths/signup", json=ADMIN, timeout=60)
    if r.status_code != 200:  # already there (a kept data dir): sign in
        r = httpx.post(f"{base}/api/v1/auths/signin", json={k: ADMIN[k] for k in ("email", "password")}, timeout=60)
    r.raise_for_status()
    body = r.json()
    if body.get("role") != "admin":
        raise RuntimeError(f"the first user is not an admin: {body.get('role')}")
    token: str = body["token"]
    return token


def set_model_params(base: str, token: str, model: str, params: dict[str, Any]) -> None:
    """A workspace model with the connection's model id overrides its params for every call (chat and tasks)."""
    h = {"Authorization": f"Bearer {token}"}
    r = httpx.get(f"{base}/api/models", headers=h, timeout=60)
    r.raise_for_status()
    ids = [m["id"] for m in r.json()["data"]]
    if model not in ids:
        raise RuntimeError(f"Open WebUI does not list {model!r} (it lists {ids}); see openwebui.log")
    form: dict[str, Any] = {"id": model, "name": model, "base_model_id": None, "meta": {"description": "wkvm e2e"},
            "params": params, "access_grants": []}  # fmt: skip
    r = httpx.post(f"{base}/api/v1/models/create", json=form, headers=h, timeout=60)
    if r.status_code != 200:
        r = httpx.post(f"{base}/api/v1/models/model/update", params={"id": model}, json=form, headers=h, timeout=60)
    r.raise_for_status()


# --- the chats --------------------------------------------------------------------------------------------------
LINES = ["Good morrow, sweet Juliet.", "What news from Verona?", "Speak again, bright angel.", "Where is Tybalt now?",
         "Tell me of the Capulets.", "Shall I hear more, or shall I speak at this?", "What light through yonder "
         "window breaks?", "Is the day so young?", "Give me my sin again.", "My lord, the prince is coming.",
         "Wherefore art thou sad?", "  Thy lips are warm.  ", "Come, gentle night.", "O happy dagger!",
         "Farewell, and keep thy counsel.", "What says my love?"]  # fmt: skip


def plan_chats(n_chats: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Steps before and after the wkvm restart. Every chat has >= 7 turns; the mix covers plain follow-ups, a
    regenerate, an edit of an earlier user message, a branch back to the version before the edit, and (the last
    chat) a resume after the restart."""
    k = iter(range(10_000))

    def line() -> str:
        return LINES[next(k) % len(LINES)]

    before: list[dict[str, Any]] = []
    after: list[dict[str, Any]] = []
    for c in range(n_chats):
        name = chr(ord("A") + c)
        steps: list[dict[str, Any]] = [{"chat": name, "op": "new", "text": line()}]
        steps += [{"chat": name, "op": "say", "text": line()} for _ in range(3)]
        kind = c % 4
        if kind == 0:  # regenerate, then go on from the new answer
            steps += [{"chat": name, "op": "regenerate"}, {"chat": name, "op": "say", "text": line()},
                      {"chat": name, "op": "say", "text": line()}]  # fmt: skip
        elif kind == 1:  # edit the second user message, go on, then back to the branch before the edit
            steps += [{"chat": name, "op": "edit", "index": 1, "text": line()},
                      {"chat": name, "op": "say", "text": line()},
                      {"chat": name, "op": "branch", "index": 1, "text": line()},
                      {"chat": name, "op": "say", "text": line()}]  # fmt: skip
        elif kind == 2:  # plain follow-ups, with a regenerate in the middle
            steps += [{"chat": name, "op": "say", "text": line()}, {"chat": name, "op": "regenerate"},
                      {"chat": name, "op": "say", "text": line()}]  # fmt: skip
        before += steps
        if kind == 3 or c == n_chats - 1:  # resumed after wkvm restarts on the same --state-dir
            after += [{"chat": name, "op": "open", "text": line()}, {"chat": name, "op": "say", "text": line()},
                      {"chat": name, "op": "say", "text": line()}]  # fmt: skip
    return before, after


def drive(venv: Path, base: str, token: str, steps: list[dict[str, Any]], work: Path, tag: str) -> list[dict[str, Any]]:
    spec = work / f"steps-{tag}.json"
    out = work / f"browser-{tag}.json"
    spec.write_text(json.dumps({"base": base, "email": ADMIN["email"], "password": ADMIN["password"], "token": token,
                                "steps": steps}))  # fmt: skip
    subprocess.run([str(side_python(venv)), str(ROOT / "scripts" / "e2e_openwebui_browser.py"), str(spec),
                    str(work / "chats.json"), str(out)], check=True, timeout=3 * 3600)  # fmt: skip
    results: list[dict[str, Any]] = json.loads(out.read_text())
    return results


def metrics_restarts(port: int) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    out: dict[str, float] = {}
    for ln in text.splitlines():
        if ln.startswith("wkvm_session_restarts_total{"):
            reason = ln.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = out.get(reason, 0.0) + float(ln.rsplit(" ", 1)[1])
    return out


# --- checks -----------------------------------------------------------------------------------------------------
def oracle_replies(port: int, records: list[dict[str, Any]]) -> None:
    """Each recorded request again on the wkvm without reuse, blocking, same body (so same sampling params)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(c: httpx.Client, rec: dict[str, Any]) -> None:
        body = {**rec["body"], "stream": False}
        body.pop("stream_options", None)
        r = c.post("/v1/chat/completions", json=body)
        got: dict[str, Any] = parse_reply(r.content, False) if r.status_code == 200 else {"reply": None}
        rec["oracle"] = got["reply"]
        rec["oracle_mode"] = (got.get("wkvm") or {}).get("mode")
        rec["wrong"] = got["reply"] != rec.get("reply")

    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=1800) as c, ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda rec: one(c, rec), [r for r in records if r.get("status") == 200]))  # batched: 4 slots


def classify(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> dict[str, str]:
    """Assistant message id -> the kind of turn: first, follow_up (plain: continues the answer just given),
    regenerate, edit, branch, resumed (the first turn after wkvm restarted)."""
    kinds: dict[str, str] = {}
    for r in before + after:
        aid = r.get("assistant_id")
        if not aid:
            continue
        op = r["op"]
        if op == "new":
            kinds[aid] = "first"
        elif op == "say":
            kinds[aid] = "follow_up"
        elif op == "open":
            kinds[aid] = "resumed_after_restart"
        else:
            kinds[aid] = op
    return kinds


def report(version: str, before: list[dict[str, Any]], after: list[dict[str, Any]], records: list[dict[str, Any]],
           restarts_metrics: dict[str, float], args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    kinds = classify(before, after)
    turns, tasks = [], []
    for rec in records:
        h = rec["headers"]
        info = rec.get("wkvm") or {}
        row = {"chat_id": h.get("x-openwebui-chat-id"), "assistant_id": h.get("x-wkvm-assistant-message-id"),
               "task": h.get("x-wkvm-task") or None, "status": rec.get("status"), "mode": info.get("mode"),
               "reused_tokens": info.get("reused_tokens"), "restart_reason": info.get("restart_reason"),
               "wrong": rec.get("wrong"), "reply": rec.get("reply"), "oracle": rec.get("oracle"),
               "messages": len(rec["body"].get("messages", [])),
               "seconds": round(rec.get("t_done", 0) - rec["t"], 2)}  # fmt: skip
        if row["task"]:
            tasks.append(row)
        else:
            row["kind"] = kinds.get(row["assistant_id"] or "", "unmatched")
            turns.append(row)
    by_kind: dict[str, dict[str, Any]] = {}
    for t in turns:
        k = by_kind.setdefault(t["kind"], {"n": 0, "modes": Counter(), "restart_reasons": Counter()})
        k["n"] += 1
        k["modes"][t["mode"] or f"http_{t['status']}"] += 1
        if t["restart_reason"]:
            k["restart_reasons"][t["restart_reason"]] += 1
    follow = [t for t in turns if t["kind"] == "follow_up"]
    exact = [t for t in follow if t["mode"] == "parent_bound"]
    stored = {r["assistant_id"]: r.get("reply") for r in before + after if r.get("assistant_id")}
    ui_changed = [t for t in turns if t["assistant_id"] in stored and stored[t["assistant_id"]] != t["reply"]]
    wrong = [t for t in turns + tasks if t["wrong"]]
    failed_steps = [r for r in before + after if r.get("failed")]
    out = {
        "what": "Open WebUI end to end: real chats in headless Chromium against wkvm (parent-token-v1), every reply "
                "checked against a wkvm with --no-prefix-reuse",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "open_webui_version": version,
        "model": args.model_id,
        "model_params": MODEL_PARAMS,
        "connection_headers": CONNECTION_HEADERS,
        "chats": len({t["chat_id"] for t in turns}),
        "turns": len(turns),
        "background_tasks": len(tasks),
        "plain_follow_ups": len(follow),
        "plain_follow_ups_reusing_parked_state": len(exact),
        "reuse_share": round(len(exact) / len(follow), 4) if follow else None,
        "wrong_continuations": len(wrong),
        "replies_checked": sum(1 for t in turns + tasks if t["wrong"] is not None),
        "ui_stored_reply_differs": len(ui_changed),
        "restarts_by_reason": dict(Counter(t["restart_reason"] for t in turns if t["restart_reason"])),
        "restarts_by_reason_metrics": restarts_metrics,
        "tasks_by_mode": dict(Counter(t["mode"] or f"http_{t['status']}" for t in tasks)),
        "tasks_counted_as_restarts": sum(1 for t in tasks if t["restart_reason"]),
        "by_kind": {k: {"n": v["n"], "modes": dict(v["modes"]), "restart_reasons": dict(v["restart_reasons"])}
                    for k, v in sorted(by_kind.items())},  # fmt: skip
        "failed_browser_steps": [{"chat": r["chat"], "op": r["op"], "failed": r["failed"]} for r in failed_steps],
        "http_errors": [t for t in turns + tasks if t["status"] != 200],
        "turn_log": turns,
        "task_log": tasks,
    }
    out["targets_met"] = bool(follow) and len(exact) >= 0.95 * len(follow) and not wrong and not failed_steps
    return out


def plot(rep: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    kinds = list(rep["by_kind"])
    modes = sorted({m for k in kinds for m in rep["by_kind"][k]["modes"]})
    bottom = [0] * len(kinds)
    for m in modes:
        vals = [rep["by_kind"][k]["modes"].get(m, 0) for k in kinds]
        a.bar(kinds, vals, bottom=bottom, label=m)
        bottom = [x + y for x, y in zip(bottom, vals, strict=True)]
    a.set_ylabel("chat turns")
    a.set_title(f"How each turn started (reuse share of plain follow-ups {rep['reuse_share']:.0%}, "
                f"wrong continuations {rep['wrong_continuations']})", fontsize=9)  # fmt: skip
    a.legend(fontsize=8)
    a.tick_params(axis="x", labelsize=8, rotation=15)
    reasons = rep["restarts_by_reason"] or {"(none)": 0}
    b.barh(list(reasons), list(reasons.values()), color="tab:orange")
    b.set_title("Session restarts by reason (chat turns)", fontsize=9)
    b.set_xlabel("turns")
    fig.suptitle(f"wkvm + Open WebUI {rep['open_webui_version']} in Chromium, {rep['chats']} chats, {rep['turns']} "
                 f"turns, {rep['background_tasks']} background tasks ({rep['date'][:10]})", fontsize=10)  # fmt: skip
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--venv", type=Path, default=DEFAULT_SIDE_VENV, help="the Open WebUI venv (made when missing)")
    ap.add_argument("--openwebui-spec", default="open-webui", help="what pip installs (default: the newest release)")
    ap.add_argument("--chats", type=int, default=4, help="chats (>= 4 covers every kind of turn)")
    ap.add_argument("--port", type=int, default=18400, help="first port to try (four are used)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "openwebui_e2e.json", help="report (+ .png)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs, data) for a look")
    ap.add_argument("--plot-only", type=Path, help="redraw the PNG from a report JSON")
    args = ap.parse_args()
    if args.plot_only:
        plot(json.loads(args.plot_only.read_text()), args.plot_only.with_suffix(".png"))
        return 0
    if not Path(CHROMIUM).exists():
        sys.exit(f"e2e-openwebui: {CHROMIUM} is missing: install Debian's chromium (apt-get install -y chromium)")
    version = ensure_side_venv(args.venv, args.openwebui_spec)
    log(f"Open WebUI {version} in {args.venv}")
    work = Path(tempfile.mkdtemp(prefix="wkvm-e2e-openwebui-"))
    state_dir = work / "state"
    p_wkvm = free_port(args.port)
    p_oracle = free_port(p_wkvm + 1)
    p_proxy = free_port(p_oracle + 1)
    p_webui = free_port(p_proxy + 1)
    procs: list[Proc] = []
    recorder = Recorder(f"http://127.0.0.1:{p_wkvm}")
    try:
        log(f"wkvm on {p_wkvm} (state dir {state_dir}), oracle (--no-prefix-reuse) on {p_oracle}")
        wkvm = start_wkvm("wkvm", p_wkvm, state_dir, work, [])
        procs.append(wkvm)
        procs.append(start_wkvm("oracle", p_oracle, work / "oracle-state", work, ["--no-prefix-reuse"]))
        args.model_id = httpx.get(f"http://127.0.0.1:{p_wkvm}/v1/models").json()["data"][0]["id"]
        with serve_proxy(recorder, p_proxy):
            log(f"Open WebUI on {p_webui}, its OpenAI connection http://127.0.0.1:{p_proxy}/v1 (recording proxy)")
            procs.append(start_openwebui(args.venv, p_webui, f"http://127.0.0.1:{p_proxy}/v1", args.model_id, work))
            base = f"http://127.0.0.1:{p_webui}"
            token = create_admin(base)
            set_model_params(base, token, args.model_id, MODEL_PARAMS)
            before_steps, after_steps = plan_chats(args.chats)
            log(f"driving {len(before_steps)} steps in Chromium")
            before = drive(args.venv, base, token, before_steps, work, "before")
            time.sleep(5)  # let the last background tasks reach wkvm
            restarts = metrics_restarts(p_wkvm)
            log("restarting wkvm on the same --state-dir")
            wkvm.stop()
            procs.remove(wkvm)
            wkvm = start_wkvm("wkvm", p_wkvm, state_dir, work, [])
            procs.append(wkvm)
            log(f"driving {len(after_steps)} steps after the restart")
            after = drive(args.venv, base, token, after_steps, work, "after")
            deadline = time.monotonic() + 300
            while any("t_done" not in r for r in recorder.records) and time.monotonic() < deadline:
                time.sleep(1)
            for reason, n in metrics_restarts(p_wkvm).items():
                restarts[reason] = restarts.get(reason, 0.0) + n
        log(f"replaying {len(recorder.records)} requests on the oracle")
        oracle_replies(p_oracle, recorder.records)
        rep = report(version, before, after, recorder.records, restarts, args)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rep, indent=1) + "\n")
        plot(rep, args.out.with_suffix(".png"))
        (work / "records.json").write_text(json.dumps(recorder.records, indent=1))
        log(f"report {args.out} (+ .png); work dir {work}")
        print(json.dumps({k: rep[k] for k in ("open_webui_version", "chats", "turns", "plain_follow_ups",
                                              "plain_follow_ups_reusing_parked_state", "reuse_share",
                                              "wrong_continuations", "restarts_by_reason", "tasks_by_mode",
                                              "failed_browser_steps", "targets_met")}, indent=1))  # fmt: skip
        return 0 if rep["targets_met"] else 1
    finally:
        for p in reversed(procs):
            p.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
