"""Chat templates: the model's Jinja template (sandboxed), else its family's format (`default_chat_template`).

A template renders in the environment transformers' `apply_chat_template` gives it (vLLM renders through that too),
so a prompt is the text the model's own tooling would write: `tojson` is plain `json.dumps` (Jinja's own sorts the
keys and escapes `<`, `>`, `&` and `'`, so a tool's schema read otherwise), `raise_exception(message)` fails the
render with the template's message (a 400 saying e.g. that roles must alternate), `strftime_now(format)` is today's
date (Llama 3.1's system header), `{% break %}` / `{% continue %}` work, and `{% generation %}` (training templates'
assistant-mask marker) renders its body."""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import Template, nodes
from jinja2.exceptions import TemplateError
from jinja2.ext import Extension
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from wkvm.tokenizer import TOOL_USE_TEMPLATE, read_json


class ChatTemplateError(ValueError):
    pass


class TemplateVariableError(ValueError):
    """A chat_template_kwargs name the request sets with a field of its own (RESERVED_VARIABLES)."""


# names a template gets from the request's own fields (and transformers' apply_chat_template arguments that are not
# template variables): not settable as chat_template_kwargs
RESERVED_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "continue_final_message", "chat_template",
                                "tokenize", "documents"})  # fmt: skip


@dataclass
class ChatTemplate:
    """A Jinja chat template (HF convention: `messages`, `add_generation_prompt`) and the stop strings that end an
    answer. `source=None` is a model without any chat format: rendering fails with a message a user can act on."""

    source: str | None = None
    stop: list[str] = field(default_factory=list)
    name: str = "none"
    # the tokenizer's special tokens as HF's apply_chat_template passes them (`{{ bos_token }}` starts Llama 3's)
    special_tokens: dict[str, str] = field(default_factory=dict)
    # a model's template named "tool_use" beside its default: transformers renders with it when tools are given
    tool_source: str | None = None

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None, variables: dict[str, Any] | None = None) -> str:  # fmt: skip
        """The prompt text. `variables`: more names for the template (vLLM's `chat_template_kwargs`, e.g. Qwen's
        `enable_thinking`); TemplateVariableError for one that is a name render sets itself (RESERVED_VARIABLES)."""
        if variables is not None and not isinstance(variables, dict):  # it had been blamed on the messages
            raise TemplateVariableError(f"chat_template_kwargs must be a dict of names and values, not "
                                        f"{type(variables).__name__}")  # fmt: skip
        taken = sorted(set(variables or {}) & RESERVED_VARIABLES)
        if taken:
            raise TemplateVariableError(f"{taken[0]!r} is set by the request's own field, not as a template variable")
        source = self.tool_source if tools and self.tool_source is not None else self.source
        if source is None:
            raise ChatTemplateError("this model has no chat template (none shipped with it, and its family has no "
                                    "default): use /v1/completions, or add chat_template.jinja beside the model")
        if "developer" not in source:  # OpenAI's developer role is the system role, for a template that
            messages = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]  # knows none
        try:
            # the request's variables win over the special tokens, as transformers merges them
            names = {**self.special_tokens, **(variables or {})}
            return compiled(source).render(**names, messages=messages, tools=tools,
                                           add_generation_prompt=add_generation_prompt)  # fmt: skip
        except TemplateError as e:
            raise ChatTemplateError(f"the model's chat template failed: {e}") from None
        except Exception as e:  # TypeError, OverflowError, ...: the template met messages or tools it cannot take
            reason = (str(e).splitlines() or [""])[0][:200]
            raise ChatTemplateError(f"the model's chat template failed on these messages: {type(e).__name__}: "
                                    f"{reason}") from None  # fmt: skip


def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
           separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:  # fmt: skip
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def raise_exception(message: str) -> None:
    raise TemplateError(message)


def strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class Generation(Extension):
    """`{% generation %}...{% endgeneration %}`: the body, as it is (transformers marks the assistant's tokens with
    it for training masks; a prompt needs only the text)."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


@functools.lru_cache(maxsize=32)
def compiled(source: str) -> Template:
    """`source` compiled once (a server renders the same template for every chat request)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols", Generation])  # fmt: skip
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    return env.from_string(source)


def load_chat_template(model_path: str | os.PathLike[str], default: ChatTemplate | None = None) -> ChatTemplate:
    """`chat_template.jinja` (+ optional `chat_template.json` with "stop") in the model directory, or
    `NAME.chat_template.jinja` beside `NAME.pth`; `tokenizer_config.json`'s "chat_template" (a string, or
    transformers' list of named templates: "default", and "tool_use" for requests with tools); else the family's
    `default`; else a template that refuses to render."""
    p = Path(model_path)
    base = p if p.is_dir() else p.parent
    prefix = "" if p.is_dir() else f"{p.stem}."
    jinja = base / f"{prefix}chat_template.jinja"
    if jinja.is_file():
        extra = base / f"{prefix}chat_template.json"
        opts = read_json(extra)  # not JSON: a ValueError naming the file (an AttributeError traceback for a list)
        stop = opts.get("stop", [])
        if not (isinstance(stop, list) and all(isinstance(x, str) and x for x in stop)):
            # a string had become its characters, each a stop string: "</s>" cut answers at every "s"
            raise ValueError(f"{extra}: \"stop\" must be a list of non-empty strings")
        # transformers (4.50+) saves named templates beside the default as additional_chat_templates/NAME.jinja
        tool_use = base / TOOL_USE_TEMPLATE
        tool_source = template_text(tool_use) if p.is_dir() and tool_use.is_file() else None
        return ChatTemplate(template_text(jinja), stop, str(opts.get("name", jinja.name)), tool_source=tool_source)
    if p.is_dir():
        config = base / "tokenizer_config.json"
        tpl = read_json(config).get("chat_template")  # a file that is no JSON is named
        if isinstance(tpl, str):
            return ChatTemplate(tpl, [], config.name)
        if isinstance(tpl, dict):  # transformers' in-memory form of named templates: {name: template}
            tpl = [{"name": k, "template": v} for k, v in tpl.items()]
        if isinstance(tpl, list):  # transformers' named templates: [{"name": "default", "template": ...}, ...]
            named: dict[str, str] = {t["name"]: t["template"] for t in tpl if isinstance(t, dict) and
                                     isinstance(t.get("name"), str) and isinstance(t.get("template"), str)}  # fmt: skip
            if not named or len(named) != len(tpl):
                raise ValueError(f"{config}: \"chat_template\" as a list takes objects with a string \"name\" and "
                                 "\"template\"")  # fmt: skip
            if "default" not in named:  # transformers refuses to choose too (apply_chat_template raises)
                raise ValueError(f"{config}: chat templates named {', '.join(sorted(named))} and none \"default\": "
                                 "add chat_template.jinja beside the model to choose one")  # fmt: skip
            return ChatTemplate(named["default"], [], config.name, tool_source=named.get("tool_use"))
        if tpl is not None:  # it had been dropped without a word: every chat then said the model has no template
            raise ValueError(f"{config}: \"chat_template\" must be a template (a string) or a list of named ones, "
                             f"not {type(tpl).__name__}")  # fmt: skip
    return default or ChatTemplate()


def template_text(path: Path) -> str:
    """A template file's text; one that is not UTF-8 is a ValueError naming it (the codec's message named no file;
    loading hunt, session 49)."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for the chat template: assistant tool_calls with their arguments as objects (HF templates render
    `tool_call.function.arguments` with `tojson`; a JSON string had been encoded twice). No arguments (missing, null,
    "" or "null") are `{}`, as vLLM gives them (they had rendered as null)."""

    def arguments(fn: dict[str, Any]) -> Any:
        value = fn.get("arguments")
        value = json_or_none(value) if isinstance(value, str) else value
        return {} if value is None else value

    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [{**c, "function": {**c["function"], "arguments": arguments(c["function"])}}
                     for c in m["tool_calls"]]  # fmt: skip
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def plain_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI-shaped messages as the server hands them to a template (vLLM's LLM.chat parses them alike): a content
    list of text parts joined with newlines, a missing content as "", tool calls' JSON-string arguments as objects.
    ValueError for a part that is not text. The offline `LLM.chat` had rendered a list's Python repr."""
    out = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None  # an assistant's refusal reads as text
                text = part.get(kind) if isinstance(part, dict) and kind in ("text", "refusal") else None
                if not isinstance(text, str):
                    raise ValueError(f"messages[{i}].content[{j}]: only text parts ({{'type': 'text', 'text': ...}}) "
                                     "are supported")  # fmt: skip
                texts.append(text)
            content = "\n".join(texts)
        out.append({**m, "content": content or ""})
    return template_messages(out)


def json_or_none(text: str) -> Any:
    """`text` parsed as JSON, or None where it is not JSON (or nested deeper than the parser recurses: a reply of
    5,000 `[` after a `<tool_call>` had been a 500)."""
    try:
        return json.loads(text.strip())
    except (ValueError, RecursionError):
        return None

