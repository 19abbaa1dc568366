"""The RWKV World chat format (`User: ...\\n\\nAssistant:`): the default for RWKV checkpoints without a template."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from wkvm.chat_template import ChatTemplate

WORLD_ROLES = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant", "tool": "User"}


def world_text(content: str) -> str:
    """World format separates turns by a blank line, so a message may not contain one."""
    return re.sub(r"\n{2,}", "\n", content.replace("\r\n", "\n").strip())


@dataclass
class WorldTemplate(ChatTemplate):
    stop: list[str] = field(default_factory=lambda: ["\n\nUser:"])
    name: str = "rwkv-world"

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None, variables: dict[str, Any] | None = None) -> str:  # fmt: skip
        """The World format has no tool convention: `tools` are not shown (tool_choice required / named still
        force a valid call through the grammar); a tool result reads as a user turn. It reads no `variables`."""
        turns = [f"{WORLD_ROLES[m['role']]}: {world_text(m['content'] or '')}" for m in messages]
        return "\n\n".join(turns) + ("\n\nAssistant:" if add_generation_prompt else "")
