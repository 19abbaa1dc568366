"""Chat templates: a Jinja template shipped with the model, else the RWKV World `User: ...\\n\\nAssistant:` format."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

WORLD_ROLES = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant"}


class ChatTemplateError(ValueError):
    pass


def world_text(content: str) -> str:
    """World format separates turns by a blank line, so a message may not contain one."""
    return re.sub(r"\n{2,}", "\n", content.replace("\r\n", "\n").strip())


@dataclass
class ChatTemplate:
    source: str | None = None  # Jinja source; None = RWKV World format
    stop: list[str] = field(default_factory=lambda: ["\n\nUser:"])
    name: str = "rwkv-world"

    def render(self, messages: list[dict[str, str]]) -> str:
        if self.source is None:
            turns = [f"{WORLD_ROLES[m['role']]}: {world_text(m['content'])}" for m in messages]
            return "\n\n".join(turns) + "\n\nAssistant:"
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        try:
            return env.from_string(self.source).render(messages=messages, add_generation_prompt=True)
        except TemplateError as e:
            raise ChatTemplateError(f"the model's chat template failed: {e}") from None


def load_chat_template(model_path: str | os.PathLike) -> ChatTemplate:
    """`chat_template.jinja` (+ optional `chat_template.json` with "stop") in the model directory, or
    `NAME.chat_template.jinja` beside `NAME.pth`; `tokenizer_config.json`'s "chat_template"; else World."""
    p = Path(model_path)
    base = p if p.is_dir() else p.parent
    prefix = "" if p.is_dir() else f"{p.stem}."
    jinja = base / f"{prefix}chat_template.jinja"
    if jinja.is_file():
        extra = base / f"{prefix}chat_template.json"
        opts = json.loads(extra.read_text()) if extra.is_file() else {}
        return ChatTemplate(jinja.read_text(), list(opts.get("stop", [])), opts.get("name", jinja.name))
    tok_cfg = base / "tokenizer_config.json"
    if p.is_dir() and tok_cfg.is_file():
        tpl = json.loads(tok_cfg.read_text()).get("chat_template")
        if isinstance(tpl, str):
            return ChatTemplate(tpl, [], "tokenizer_config.json")
    return ChatTemplate()
