"""`wkvm chat`: a terminal chat that keeps the conversation's recurrent state across turns.

Each turn feeds only the new text after what the state has already consumed. Commands: /save NAME, /fork NAME,
/load NAME, /states, /reset, /quit.
"""

from __future__ import annotations

import sys
from pathlib import Path

from wkvm.chat_template import load_chat_template
from wkvm.config import EngineConfig
from wkvm.engine.engine import Engine
from wkvm.models.loader import load_model
from wkvm.sampling_params import SamplingParams
from wkvm.state.statefile import resume_inputs
from wkvm.state.store import StateNotFound, StateStore
from wkvm.tokenizer import load_tokenizer

OWNER = "local"
HELP = "commands: /save NAME, /fork NAME, /load NAME, /states, /reset, /quit"


class ChatREPL:
    def __init__(self, model_path: str, state_dir: Path, max_tokens: int, temperature: float, dtype: str = "float32"):
        self.model = load_model(model_path, dtype=dtype)
        self.tokenizer = load_tokenizer(model_path)
        self.template = load_chat_template(model_path)
        self.engine = Engine(self.model, self.tokenizer, EngineConfig(n_slots=1))
        self.store = StateStore(state_dir, self.model.spec, self.model.fingerprint, self.model.vocab_size)
        self.params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=0.9,
                                     stop=self.template.stop)  # fmt: skip
        self.name = "chat"
        self.reset()

    def reset(self) -> None:
        self.messages: list[dict[str, str]] = []
        self.state = None
        self.token_ids: list[int] = []  # the state holds all but the last (pending)
        self.consumed = ""  # text of token_ids

    def turn(self, text: str) -> str:
        self.messages.append({"role": "user", "content": text})
        full = self.template.render(self.messages)
        if self.state is not None and full.startswith(self.consumed):
            new = self.tokenizer.encode(full[len(self.consumed) :])
            prompt, base = resume_inputs(self.token_ids, new)
        else:  # first turn, or the rendering no longer extends what the state holds
            self.state, prompt, base = None, self.tokenizer.encode(full), []
        h = self.engine.submit(prompt, self.params, initial_state=self.state, base_ids=base, capture_state=True)
        printed = 0
        while not h.done.is_set():
            self.engine.step()
            sys.stdout.write(h.output.text[printed:])
            sys.stdout.flush()
            printed = len(h.output.text)
        sys.stdout.write(h.output.text[printed:] + "\n")
        self.state, self.token_ids = h.request.final_state, h.request.history()
        self.consumed = self.tokenizer.decode(self.token_ids)
        self.messages.append({"role": "assistant", "content": h.output.text.strip()})
        return h.output.text

    def command(self, line: str) -> bool:
        """Run a /command; returns False to quit."""
        cmd, _, arg = line.partition(" ")
        arg = arg.strip()
        if cmd in ("/quit", "/exit"):
            return False
        if cmd == "/reset":
            self.reset()
            print("(new conversation)")
        elif cmd in ("/save", "/fork") and arg:
            if self.state is None:
                print("(nothing to save yet)")
            else:
                rec = self.store.put(OWNER, arg, self.state, self.token_ids, op=cmd[1:],
                                     op_params={"messages": self.messages})  # fmt: skip
                if cmd == "/fork":
                    self.name = arg
                print(f"(saved {rec.handle}, {rec.n_tokens} tokens)")
        elif cmd == "/load" and arg:
            try:
                rec, state = self.store.load(OWNER, arg)
            except (StateNotFound, ValueError) as e:
                print(f"({e})")
                return True
            self.state, self.token_ids, self.name = state, rec.token_ids, rec.name
            self.consumed = self.tokenizer.decode(rec.token_ids)
            self.messages = list(rec.op_params.get("messages", []))
            note = "" if self.messages else " (no chat transcript saved with it: the next turn starts fresh)"
            print(f"(loaded {rec.handle}, {rec.n_tokens} tokens){note}")
        elif cmd == "/states":
            for rec in self.store.list(OWNER):
                print(f"  {rec.handle:24} {rec.n_tokens:6} tokens  {rec.op:8} {rec.tier}")
        else:
            print(HELP)
        return True

    def run(self, lines=None) -> None:
        print(f"wkvm chat on {self.model.family} ({HELP})")
        source = lines if lines is not None else iter(lambda: input("> "), None)
        try:
            for line in source:
                line = line.strip()
                if line.startswith("/"):
                    if not self.command(line):
                        break
                elif line:
                    self.turn(line)
        except (EOFError, KeyboardInterrupt):
            print()
        finally:
            self.store.close()
