"""`wkvm states ls|show|export|import|rm`, against a running server (--url) or a state directory (--state-dir).

With --url it only speaks HTTP and never imports torch (seconds of start-up on a loaded machine).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from wkvm.atomic import atomic_write_bytes

if TYPE_CHECKING:
    import httpx

    from wkvm.state.index import StateRecord
    from wkvm.state.store import StateStore

OWNER = "local"


class ServerStates:
    def __init__(self, url: str, api_key: str | None):
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=120)

    def _ok(self, r: httpx.Response) -> httpx.Response:
        if r.status_code >= 400:
            try:
                msg = r.json()["error"]["message"]
            except (ValueError, KeyError):
                msg = r.text
            if r.status_code < 500:  # bad input: one line, exit 2, as every command's (it had exited 1)
                raise ValueError(f"{r.status_code}: {msg}")
            raise SystemExit(f"wkvm states: the server failed: {r.status_code}: {msg}")  # its bug: exit 1
        return r

    def ls(self) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = self._ok(self.http.get("/v1/states")).json()["data"]
        return rows

    def show(self, handle: str) -> dict[str, Any]:
        info: dict[str, Any] = self._ok(self.http.get(state_path(handle))).json()
        return info

    def export(self, handle: str) -> bytes:
        return self._ok(self.http.get(state_path(handle) + "/export")).content

    def import_(self, data: bytes, name: str | None) -> dict[str, Any]:
        params = {"name": name} if name else {}
        info: dict[str, Any] = self._ok(self.http.post("/v1/states/import", content=data, params=params)).json()
        return info

    def rm(self, handle: str) -> dict[str, Any]:
        info: dict[str, Any] = self._ok(self.http.delete(state_path(handle))).json()
        return info


class DirStates:
    """A state directory, opened directly (the model is needed only to export or import)."""

    def __init__(self, state_dir: str, model: str | None, owner: str):
        self.state_dir, self.model_path, self.owner = Path(state_dir), model, owner
        self._store: StateStore | None = None
        self.context: int | None = None  # the model's context (tokens), known once the store is open

    @property
    def store(self) -> StateStore:
        if self._store is None:
            from wkvm.config import default_model
            from wkvm.state.store import StateStore
            from wkvm.weights.loader import load_model

            if not (self.state_dir / "index.sqlite").is_file():  # opening would create an empty directory
                raise FileNotFoundError(f"{self.state_dir} is not a state directory (no index.sqlite in it)")
            m = load_model(self.model_path or default_model())  # the embedded model by default, as everywhere
            self._store = StateStore(self.state_dir, m.spec, m.fingerprint, m.vocab_size)
            self.context = m.context_length or None
        return self._store

    def _info(self, rec: StateRecord) -> dict[str, Any]:
        from wkvm.config import default_model

        info: dict[str, Any] = rec.info(Path(self.model_path or default_model()).stem)  # it had said "?" by default
        return info

    def ls(self) -> list[dict[str, Any]]:
        return [self._info(r) for r in self.store.list(self.owner)]

    def other_owners(self) -> dict[str, int]:
        """The directory's other owners (not internal ones) and how many states each has."""
        from wkvm.state.quota import is_internal

        counts: dict[str, int] = {}
        for r in self.store.index.list():
            if r.owner != self.owner and not is_internal(r.owner):
                counts[r.owner] = counts.get(r.owner, 0) + 1
        return counts

    def show(self, handle: str) -> dict[str, Any]:
        return self._info(self.store.get(self.owner, checked(handle)))  # '../x' is invalid, not "not found"

    def export(self, handle: str) -> bytes:
        return self.store.export_bytes(self.owner, checked(handle))

    def import_(self, data: bytes, name: str | None) -> dict[str, Any]:
        # the model's context (a server also bounds it by its KV pool, which is not known here), and not the pages'
        # float16 range: a server with float16 pages checks the state when a request takes it
        store = self.store
        return self._info(store.import_bytes(self.owner, data, name, self.context))

    def rm(self, handle: str) -> dict[str, Any]:
        rec = self.store.get(self.owner, checked(handle))  # the version a bare name means, as the server says it
        self.store.delete(self.owner, rec.handle)
        return {"id": rec.handle, "deleted": True}


IMPORT_NOTE = (
    "import FILE stores the file under the name it was exported with, or --name NAME; if that name already has "
    "versions, the import becomes its newest version (older ones stay; a bare NAME now means the import) and the "
    "output says so"
)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("states", help="list, show, export, import or remove states", description=IMPORT_NOTE)
    p.add_argument("action", choices=["ls", "show", "export", "import", "rm"], help="what to do")
    p.add_argument("args", nargs="*", help="show/rm: HANDLE; export: HANDLE FILE; import: FILE")
    p.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000 (env WKVM_URL)")
    p.add_argument("--api-key", help="API key for --url (env WKVM_API_KEY)")
    p.add_argument("--state-dir", help="a state directory instead of a server (env WKVM_STATE_DIR, where no URL is "
                   "given)")
    p.add_argument("--model", help="with --state-dir: the model the states belong to (default: the embedded model)")
    p.add_argument("--owner", default=OWNER, help="with --state-dir: whose states (default: local, `wkvm chat`'s; a "
                   "server keeps a keyless client's as anonymous, a keyed one's as key-<hash>)")
    p.add_argument("--name", help="import: store under this name instead of the file's")
    p.add_argument("--json", action="store_true", help="print JSON (default: readable text)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    url = args.url or os.environ.get("WKVM_URL")
    backend: DirStates | ServerStates
    if args.state_dir and args.url:  # the directory had silently won over the server named beside it
        print("wkvm states: give --url (a running server) or --state-dir, not both", file=sys.stderr)
        return 2
    state_dir = args.state_dir or (None if url else os.environ.get("WKVM_STATE_DIR") or None)  # as serve and chat
    if state_dir:
        backend = DirStates(state_dir, args.model or os.environ.get("WKVM_MODEL"), args.owner)
    elif url:
        backend = ServerStates(url, args.api_key or os.environ.get("WKVM_API_KEY"))
    else:
        print("wkvm states: give --url (a running server) or --state-dir", file=sys.stderr)
        return 2
    need = {"ls": 0, "show": 1, "rm": 1, "export": 2, "import": 1}[args.action]
    if len(args.args) != need:
        usage = {"ls": "", "show": " HANDLE", "rm": " HANDLE", "export": " HANDLE FILE",
                 "import": " FILE [--name NAME]"}
        print(f"wkvm states {args.action}: expected {need} argument(s): wkvm states {args.action}{usage[args.action]}",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.action == "ls":
        rows = backend.ls()
        if args.json:
            print(json.dumps(rows, indent=2))
        for r in [] if args.json else rows:
            pinned = "pinned" if r["pinned"] else ""
            print(f"{r['handle']:32} {r['n_tokens']:7} tokens  {r['op']:9} {r['tier']:6} {pinned}")
        others = backend.other_owners() if not rows and isinstance(backend, DirStates) else {}
        if others:  # a server's directory listed as `local`'s printed nothing, with no hint why (hunt, session 47)
            held = ", ".join(f"{o or '(empty)'} ({n})" for o, n in sorted(others.items()))
            print(f"(no states of owner {args.owner!r} here; this directory holds states of: {held}: give --owner)",
                  file=sys.stderr)  # fmt: skip
        return 0
    if args.action == "export":
        if Path(args.args[1]).is_dir():  # before the state is read; the rename's "[Errno 21]" line had said it
            example = Path(args.args[1]) / "NAME.wkvm-state"  # (it had suggested DIR//NAME.state)
            raise ValueError(f"{args.args[1]} is a directory: give the file to write (e.g. {example})")
        data = backend.export(args.args[0])
        if args.args[1] == "-":  # to standard output, as curl -o - (the message then goes to stderr)
            sys.stdout.buffer.write(data)
            sys.stdout.flush()
        else:  # never half a file, nor an old one lost to a full disk
            atomic_write_bytes(Path(args.args[1]), data)
        print(f"wrote {args.args[1]} ({len(data)} bytes)", file=sys.stderr if args.args[1] == "-" else sys.stdout)
        return 0
    if args.action == "import":
        data = sys.stdin.buffer.read() if args.args[0] == "-" else Path(args.args[0]).read_bytes()
        out = backend.import_(data, args.name)
    else:
        out = backend.show(args.args[0]) if args.action == "show" else backend.rm(args.args[0])
    if args.json:
        print(json.dumps(out, indent=2))
    elif args.action == "import":
        print(imported(args.args[0], out))
    elif args.action == "rm":
        print(f"deleted {out['id']}")
    else:
        print(key_values(out))
    return 0


def imported(file: str, info: dict[str, Any]) -> str:
    """What an import did; a name that already existed gets a new version, which a user should not miss."""
    if info["version"] == 1:
        return f"imported {file} as {info['handle']} (new name {info['name']})"
    return (
        f"imported {file} as {info['handle']}: added version {info['version']} to existing name {info['name']} "
        f"(a bare {info['name']} now means this version; --name NAME imports under another name)"
    )


def key_values(info: dict[str, Any]) -> str:
    width = max(map(len, info))
    lines = []
    for key, value in info.items():
        text = json.dumps(value) if isinstance(value, dict | list) else "-" if value is None else str(value)
        lines.append(f"{key + ':':{width + 1}} {text}")
    return "\n".join(lines)


def checked(handle: str) -> str:
    """`handle` if it is one (ValueError naming what is wrong otherwise; a state directory's `show ../etc` had said
    "not found"). Imported here: with --url this module never imports torch."""
    from wkvm.state.statefile import valid_handle

    return valid_handle(handle)


def state_path(handle: str) -> str:
    """`/v1/states/{handle}` for a handle that is one (ValueError otherwise): `show ../../v1/models` had printed the
    model list, and `rm ../responses/ID` deleted a stored response."""
    return f"/v1/states/{checked(handle)}"
