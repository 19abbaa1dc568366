"""`wkvm chat`: a terminal chat that keeps the conversation's recurrent state across turns.

Each turn feeds only the new text after what the state has already consumed. A conversation with a name is on a
branch: /fork NAME or /load NAME puts it there, every answer is then saved as the branch's next version, and the
prompt shows where it is (`[scene@3] you> `); /save NAME only bookmarks the current point. Ctrl-C during an
answer stops it and keeps what was generated as the turn (before the first token, the turn is dropped); Ctrl-C
is never delivered in the middle of an engine step, which would leave the engine half-updated.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from wkvm.config import EngineConfig, kv_dtype_for
from wkvm.engine.engine import Engine
from wkvm.engine.handle import RequestHandle
from wkvm.models.spec import State
from wkvm.sampling_params import SamplingParams
from wkvm.state.index import StateRecord
from wkvm.state.quota import QuotaExceeded
from wkvm.state.statefile import resume_inputs
from wkvm.state.store import DiskFull, StateNotFound, StateStore
from wkvm.weights.loader import load_model, load_text_tools, resolved_dtype

OWNER = "local"
LEAVE = ("/quit", "/exit", "quit", "exit")
HELP = (
    "commands: /save NAME (bookmark this point), /fork NAME (save it and continue on NAME), /load NAME[@N], "
    "/states, /reset, /quit (or quit, exit, Ctrl-D); // at the start sends a message that begins with /. Ctrl-C "
    "stops an answer and keeps what it said so far"
)


@contextmanager
def ctrl_c_sets(flag: threading.Event) -> Iterator[None]:
    """Inside, Ctrl-C sets `flag` instead of raising KeyboardInterrupt wherever the main thread happens to be."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread can handle signals, and only it receives Ctrl-C
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: flag.set())
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def stream_to_stdout(engine: Engine, h: RequestHandle) -> bool:
    """Step `engine` until `h` is done, printing its text as it comes; Ctrl-C cancels it (the text so far stays).
    True if it was stopped that way."""
    interrupted = threading.Event()
    printed = 0
    with ctrl_c_sets(interrupted):
        while not h.done.is_set():
            if interrupted.is_set():
                engine.cancel(h.request_id)  # the next step ends it at a token boundary
            engine.step()
            sys.stdout.write(h.output.text[printed:])
            sys.stdout.flush()
            printed = len(h.output.text)
    sys.stdout.write(h.output.text[printed:] + "\n")
    return interrupted.is_set() and h.output.finish_reason == "abort"


class ChatREPL:
    def __init__(self, model_path: str, state_dir: Path | None, params: SamplingParams, dtype: str = "float32",
                 speculative_tokens: int = 0):  # fmt: skip
        """`state_dir` None: this model's own folder under ~/.cache/wkvm/chat-states (a state directory holds one
        model's states); `speculative_tokens`: EngineConfig's (drafts by prompt lookup, the same answers)."""
        dtype = resolved_dtype(dtype, model_path)  # its name: the pages' type follows it
        self.model = load_model(model_path, dtype=dtype)
        self.tokenizer, self.template = load_text_tools(model_path, self.model.family)
        kv = kv_dtype_for("auto", dtype)  # as `wkvm serve`: float16 keys and values for rounded weights
        config = EngineConfig(n_slots=1, kv_dtype=kv, speculative_tokens=speculative_tokens)
        self.engine = Engine(self.model, self.tokenizer, config)
        self.state_dir = state_dir or Path.home() / ".cache" / "wkvm" / "chat-states" / self.model.fingerprint[:16]
        self.store = StateStore(self.state_dir, self.model.spec, self.model.fingerprint, self.model.vocab_size)
        self.params = replace(params, stop=[*params.stop, *self.template.stop])
        self.reset()

    def reset(self) -> None:
        self.messages: list[dict[str, str]] = []
        self.state: State | None = None
        self.token_ids: list[int] = []  # the state holds all but the last (pending)
        self.consumed = ""  # text of token_ids
        self.branch: str | None = None  # the name every answer is saved under; None: answers are not saved
        self.handle: str | None = None  # the stored version this conversation is at
        self.saved: str | None = None  # the version a /save stored of exactly where the conversation is

    def prompt(self) -> str:
        return f"[{self.handle or self.branch}] you> " if self.branch else "you> "

    def turn(self, text: str) -> str:
        # a Ctrl-C outside the answer's streaming (its tokenizing, bookkeeping and save) does nothing: one pressed
        # right after the first had left the chat and lost the turn's save (hunt, session 47)
        with ctrl_c_sets(threading.Event()):
            return self._turn(text)

    def _turn(self, text: str) -> str:
        self.messages.append({"role": "user", "content": text})
        full = self.template.render(self.messages)
        state = self.state
        base: list[int]
        if state is not None and full.startswith(self.consumed):
            new = self.tokenizer.encode(full[len(self.consumed) :])
            prompt, base = resume_inputs(self.token_ids, new)
        else:  # first turn, or the rendering no longer extends what the state holds
            state, prompt, base = None, self.tokenizer.encode(full), []
        h = self.engine.submit(prompt, self.params, initial_state=state, base_ids=base, capture_state=True)
        stopped = stream_to_stdout(self.engine, h)
        run = h.run_result()
        if run.final_state is None or (stopped and not h.output.token_ids):
            self.messages.pop()  # the state is still the one before this turn
            why = "stopped before the answer began" if stopped else f"the model failed: {h.output.error}"
            print(f"({why}: this turn is dropped)")
            return ""
        # with an answer begun the whole prompt was fed: the state holds the history but its last token
        self.state, self.token_ids, self.saved = run.final_state, run.history, None
        self.consumed = self.tokenizer.decode(self.token_ids)
        self.messages.append({"role": "assistant", "content": h.output.text.strip()})
        if stopped:
            print("(stopped: the answer so far is kept as this turn)")
        if self.branch is not None:
            rec = self._put(self.branch, "generate")
            self.handle = rec.handle if rec else None
        return h.output.text

    def _put(self, name: str, op: str) -> StateRecord | None:
        transcript = {"messages": self.messages}  # /load brings the chat back, not just the state
        assert self.state is not None, "nothing to save"  # save() checks; turn() saves the state its run left
        try:
            parent = self.handle or self.saved  # the stored version this state is (a /fork after a /save: the save)
            return self.store.put(OWNER, name, self.state, self.token_ids, parent, op, transcript)
        except (ValueError, QuotaExceeded, DiskFull) as e:
            print(f"(not saved: {e})")
            return None

    def command(self, line: str) -> bool:
        """Run a command; returns False to leave."""
        cmd, _, arg = line.partition(" ")
        arg = arg.strip()
        if cmd.lower() in LEAVE:
            return False
        if cmd == "/reset":
            self.reset()
            print("(new conversation)")
        elif cmd in ("/save", "/fork") and arg:
            self.save(arg, fork=cmd == "/fork")
        elif cmd == "/load" and arg:
            self.load(arg)
        elif cmd in ("/save", "/fork", "/load"):  # the whole help had answered a missing name
            print(f"({cmd} needs a NAME: {cmd} NAME{'[@VERSION]' if cmd == '/load' else ''})")
        elif cmd == "/states":
            recs = self.store.list(OWNER)
            for rec in recs:
                print(f"  {rec.handle:24} {rec.n_tokens:6} tokens  {rec.op:8} {rec.tier}")
            if not recs:
                print("(no saved states yet: /save NAME saves this conversation)")
        else:
            print(HELP)
        return True

    def save(self, name: str, fork: bool) -> None:
        """Store the current state under `name`; a fork also moves the conversation onto that branch."""
        if self.state is None:
            print("(nothing to save yet: say something first)")
            return
        rec = self._put(name, "fork" if fork else "save")
        if rec is None:
            return
        if fork:
            origin = self.handle or self.saved or "the unsaved conversation"
            print(f"(forked {rec.handle} from {origin}, which stays as it was; the next turns continue on {name})")
            self.branch = name
        else:
            print(f"(saved {rec.handle}, {rec.n_tokens} tokens)")
            self.saved = rec.handle
        if self.branch == name:
            self.handle = rec.handle

    def load(self, handle: str) -> None:
        try:
            rec, state = self.store.load(OWNER, handle)
        except (StateNotFound, ValueError) as e:
            print(f"({e})")
            return
        assert rec.token_ids is not None  # load() reads the token ids (only listings leave them None)
        self.state, self.token_ids = state, rec.token_ids
        self.branch, self.handle = rec.name, rec.handle
        self.consumed = self.tokenizer.decode(rec.token_ids)
        self.messages = list(rec.op_params.get("messages", []))
        note = "" if self.messages else " (no chat transcript saved with it: the next turn starts fresh)"
        print(f"(loaded {rec.handle}, {rec.n_tokens} tokens; the next turns continue on {rec.name}){note}")

    def run(self, lines: Iterable[str] | None = None) -> None:
        """Chat over `lines`, or what is typed at the prompt, until a leave command or the end of input."""
        print(f"wkvm chat on {self.model.family}; states in {self.state_dir}. {HELP}")
        try:
            for line in lines if lines is not None else self._typed():
                line = line.strip()
                try:
                    if line.startswith("//"):  # a message that begins with "/" (it had been taken as a command)
                        self.turn(line[1:])
                    elif line.startswith("/") or line.lower() in LEAVE:
                        if not self.command(line):
                            break
                    elif line:
                        self.turn(line)
                except KeyboardInterrupt:  # inside a command: back to the prompt, as at the prompt itself
                    print("\n(interrupted; to leave: /quit, quit, exit or Ctrl-D)")
        finally:
            self.store.close()

    def _typed(self) -> Iterator[str]:
        """Lines typed at the prompt until EOF (Ctrl-D); Ctrl-C at the prompt only says how to leave."""
        while True:
            try:
                yield input(self.prompt())
            except EOFError:
                print()
                return
            except KeyboardInterrupt:
                print("\n(to leave: /quit, quit, exit or Ctrl-D)")
