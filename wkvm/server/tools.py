"""Tool calling for /v1/chat/completions (issue #18): OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`.

The tools go to the chat template (its Jinja `tools` variable, as HF templates expect). `tool_choice` "required"
or a named function is enforced with the grammar engine: the reply can only be a JSON list of calls
`[{"name": ..., "arguments": {...}}]` to offered tools, arguments matching each tool's parameters schema (one
call unless `parallel_tool_calls`). "auto" (the default when tools are given) lets the model answer freely and
recognises calls in its text: Hermes / Qwen `<tool_call>{...}</tool_call>`, Mistral `[TOOL_CALLS] [...]`, or a
reply that is only a JSON call (or list of calls). "none" never returns calls. See docs/http-api.md.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from wkvm.chat_template import json_or_none
from wkvm.sampling_params import InvalidParam, schema_grammar
from wkvm.server.errors import APIError

MAX_TOOLS = 128  # tools one request offers (OpenAI's limit)
# a last call the model ended without its closing tag counts too, as vLLM's Hermes parser reads it
HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|\Z)", re.S)
MISTRAL = "[TOOL_CALLS]"
MARKERS = ("<tool_call>", MISTRAL)


@dataclass(frozen=True)
class ToolMode:
    tools: list[dict[str, Any]]  # OpenAI tool objects, as given (for the template)
    choice: str  # "none", "auto", "required" or "named"
    name: str | None = None  # the named function
    parallel: bool = True
    # "auto" only: False when response_format / structured_outputs shapes the reply: it is then the content asked
    # for, never read as calls (a JSON reply that looked like a call had become one, its arguments unchecked)
    calls_in_text: bool = True

    @property
    def functions(self) -> dict[str, dict[str, Any]]:
        return {t["function"]["name"]: t["function"] for t in self.tools}

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "named")

    @property
    def calls_finish(self) -> str:
        """The finish reason of a reply that is calls: "tool_calls", but "stop" under a named tool_choice, as OpenAI
        and vLLM answer (it had been "tool_calls" there too)."""
        return "stop" if self.choice == "named" else "tool_calls"

    def response_format(self) -> dict[str, Any]:
        """The JSON schema a forced reply must match: a list of calls to offered tools (to the named one only)."""
        names = [self.name] if self.name else list(self.functions)
        calls, defs = [], {}
        for i, n in enumerate(names):
            # OpenAI: "omitting parameters defines a function with an empty parameter list"
            args = self.functions[n].get("parameters") or {"type": "object", "properties": {},
                                                           "additionalProperties": False}  # fmt: skip
            if _has_local_ref(args):  # its "#..." pointers name places in its own schema: move it to one
                key = f"wkvm_tool_{i}"
                defs[key] = _rebased(args, f"#/$defs/{key}")
                args = {"$ref": f"#/$defs/{key}"}
            calls.append({"type": "object", "properties": {"name": {"const": n}, "arguments": args},
                          "required": ["name", "arguments"], "additionalProperties": False})
        item = calls[0] if len(calls) == 1 else {"anyOf": calls}
        schema = {"type": "array", "items": item, "minItems": 1, **({} if self.parallel else {"maxItems": 1}),
                  **({"$defs": defs} if defs else {})}  # fmt: skip
        return {"type": "json_schema", "json_schema": {"name": "tool_calls", "schema": schema, "strict": True}}


# schema keywords whose values are data, not schemas: a "$ref" key inside them is a value, left as it is
DATA_KEYWORDS = ("const", "enum", "default", "examples")


def _has_local_ref(x: Any) -> bool:
    if isinstance(x, dict):
        if isinstance(x.get("$ref"), str) and x["$ref"].startswith("#"):
            return True
        return any(_has_local_ref(v) for k, v in x.items() if k not in DATA_KEYWORDS)
    return isinstance(x, list) and any(_has_local_ref(v) for v in x)


def _rebased(x: Any, base: str) -> Any:
    """A tool's parameters schema moved to `base` inside the calls' schema: each local "$ref" ("#", "#/$defs/X",
    "#/properties/a") now points into it there (pydantic's and the openai SDK's tools refer to their own $defs)."""
    if isinstance(x, list):
        return [_rebased(v, base) for v in x]
    if not isinstance(x, dict):
        return x
    out = {k: v if k in DATA_KEYWORDS else _rebased(v, base) for k, v in x.items()}
    ref = x.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        out["$ref"] = base + ref[1:]
    return out


def tool_mode(tools: list[Any] | None, choice: Any, parallel: bool | None, shaped: bool = False) -> ToolMode | None:
    """Validate the request's tools and tool_choice; None when the request offers no tools (or chooses none and
    offers none). `shaped`: response_format or structured_outputs fixes the reply's form (see calls_in_text)."""
    if not tools:
        if choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice needs tools: offer at least one tool", "tool_choice", "invalid_value")
        return None
    if len(tools) > MAX_TOOLS:  # OpenAI's limit too; 4,000 forced tools took 2 s a grammar check
        raise APIError(400, f"tools: at most {MAX_TOOLS} tools (got {len(tools)})", "tools", "invalid_value")
    checked = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise APIError(400, f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., ...}}}}',
                           f"tools[{i}]", "invalid_value")  # fmt: skip
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise APIError(400, f"tools[{i}].function.name must be 1-64 letters, digits, _ . or -",
                           f"tools[{i}].function.name", "invalid_value")  # fmt: skip
        if fn.get("description") is not None and not isinstance(fn["description"], str):  # it went to the template
            raise APIError(400, f"tools[{i}].function.description must be a string",
                           f"tools[{i}].function.description", "invalid_value")  # fmt: skip
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema object",
                           f"tools[{i}].function.parameters", "invalid_value")  # fmt: skip
        if params and params.get("type") != "object":  # OpenAI's 400 too: a call's arguments are an object
            raise APIError(400, f'tools[{i}].function.parameters must be a JSON schema of "type": "object" (the '
                           f"call's arguments are an object); got type {str(params.get('type'))[:40]!r}",
                           f"tools[{i}].function.parameters", "invalid_value")  # fmt: skip
        if params:
            check_schema(params, f"tools[{i}].function.parameters")
        checked.append(t)
    names = [t["function"]["name"] for t in checked]
    if len(set(names)) != len(names):  # which one (it had said only "tools"; session 47)
        i = next(i for i, n in enumerate(names) if n in names[:i])
        first = names.index(names[i])
        raise APIError(400, f"tools[{i}].function.name {names[i]!r} is the name of tools[{first}] too: function "
                       "names must be distinct", f"tools[{i}].function.name", "invalid_value")  # fmt: skip
    if choice is None or choice in ("auto", "none", "required"):
        return ToolMode(checked, choice or "auto", None, parallel is not False, calls_in_text=not shaped)
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None  # "function": "f" (or null, a list) had been a 500
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise APIError(400, 'tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                       '{"name": ...}}', "tool_choice", "invalid_value")  # fmt: skip
    if name not in names:
        raise APIError(400, f"tool_choice names {name!r}, which is not among the tools", "tool_choice", "invalid_value")
    return ToolMode(checked, "named", name, False)  # one call of the named function (as vLLM answers)


def check_schema(schema: dict[str, Any], param: str) -> None:
    """A 400 naming `param` and the place inside it where `schema` is no valid JSON Schema (its draft's meta-schema),
    whatever the tool_choice, as OpenAI answers: under "auto" a tool's schema is never compiled, so a typo
    ("type": "strin", "required": "a") had been taken there and refused only once the client forced a call."""
    try:
        problem = schema_problem(json.dumps(schema, sort_keys=True))
    except (TypeError, ValueError, RecursionError):  # nested too deep for the encoder (the body parser took it)
        problem = "", "nested too deep"
    if problem is not None:
        raise APIError(400, f"{param}{problem[0]}: not a valid JSON schema: {problem[1]}", param, "invalid_value")


@functools.lru_cache(maxsize=512)  # agents send the same tools every turn: ~0.6 ms a small schema, 0.5 s for 128
def schema_problem(canonical: str) -> tuple[str, str] | None:
    """(where inside the schema, what) for a schema (as sorted JSON) its draft's meta-schema refuses; None if valid."""
    import jsonschema  # type: ignore[import-untyped]
    from jsonschema.validators import validator_for  # type: ignore[import-untyped]

    schema = json.loads(canonical)
    try:
        validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except (TypeError, RecursionError):  # "$schema": {} (unhashable), a schema nested ~100 deep: they had been 500s
        return "", "a non-string $schema, or nested too deep"
    except jsonschema.SchemaError as e:
        where = "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in e.absolute_path)
        return where, e.message.splitlines()[0][:200]
    return None


def unenforceable_tool(mode: ToolMode) -> None:
    """After the forced calls' grammar failed to compile: the 400 of the first tool whose parameters schema is the
    cause, naming it (the failure had named `tools`, not which); nothing where no single tool's is."""
    for i, t in enumerate(mode.tools):
        fn = t["function"]
        if fn.get("parameters") and mode.name in (None, fn["name"]):
            try:
                schema_grammar(fn["parameters"], f"tools[{i}].function.parameters")
            except InvalidParam as e:
                raise APIError(400, str(e), e.param, "invalid_value") from None


def parse_reply(text: str, mode: ToolMode) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) for a finished reply: calls in OpenAI's shape, content the text around them (None
    when nothing else was said). A reply whose calls do not parse, or name tools not offered, is plain content."""
    rest, calls = split_reply(text, mode)
    if not calls:
        return text, []
    return rest.strip() or None, calls


def split_reply(text: str, mode: ToolMode) -> tuple[str, list[dict[str, Any]]]:
    """(the text around the calls as written, the calls) for a finished reply; ([text], []) when it holds no call
    that parses (see parse_reply)."""
    if mode.choice == "none" or not mode.calls_in_text:
        return text, []
    found: list[Any] = []
    rest = text
    if mode.forced:
        found = json_or_none(text) or []
        rest = ""
    elif HERMES.search(text):
        for m in HERMES.finditer(text):
            x = json_or_none(m.group(1))  # a list inside the tags: SmolLM2's trained form, `<tool_call>[{...}]`
            found.extend(x if isinstance(x, list) and x else [x])
        rest = HERMES.sub("", text)
    elif MISTRAL in text:
        rest, *tails = text.split(MISTRAL)
        for tail in (t.lstrip() for t in tails):  # each marker's list (a reply may hold several), words after it
            try:  # as content
                listed, end = json.JSONDecoder().raw_decode(tail)
            except ValueError:
                listed, end = None, 0
            found.extend(listed if isinstance(listed, list) and listed else [None])
            rest += tail[end:]
    else:
        whole = json_or_none(text)
        if isinstance(whole, (dict, list)):
            found, rest = whole if isinstance(whole, list) else [whole], ""
    calls = [c for c in (_call(x, mode) for x in found) if c is not None]
    if not calls or len(calls) != len(found):
        return text, []
    return rest, calls if mode.parallel else calls[:1]  # parallel_tool_calls false: the first call only


def cut_calls(text: str, finish_reason: str | None, mode: ToolMode) -> list[dict[str, Any]]:
    """The complete calls at the start of a forced reply that `max_tokens` cut off inside its list (OpenAI returns
    what it has with finish_reason "length" too): a small model that repeats a call until the tokens run out had
    answered no call at all. Nothing for another finish, or for a reply cut inside its first call."""
    if not mode.forced or finish_reason != "length" or not text.lstrip().startswith("["):
        return []
    decoder, at = json.JSONDecoder(), text.index("[") + 1
    found: list[Any] = []
    while True:
        rest = text[at:].lstrip().removeprefix(",").lstrip() if found else text[at:].lstrip()
        try:
            x, end = decoder.raw_decode(rest)
        except ValueError:
            break
        found.append(x)
        at = len(text) - len(rest) + end
    calls = [c for c in (_call(x, mode) for x in found) if c is not None]
    return calls if mode.parallel else calls[:1]


def content_ready(text: str, mode: ToolMode) -> int:
    """How much of an unfinished reply (a prefix length) can stream as content now, when tools may be called: with
    `auto`, everything before where a call could begin: nothing while the reply is only whitespace or starts with `{`
    or `[` (it may be a whole JSON call, or Mistral's `[TOOL_CALLS]`), else the text up to the first `<tool_call>` /
    `[TOOL_CALLS]`, holding back an end that may be the start of one (as vLLM's Hermes parser streams the words
    before a call) and trailing whitespace (a blocking reply strips it before a call: so does the stream).
    Nothing with a forced call (the reply is the call), everything with "none". Depends only on the
    text, so a stream that moves to another server goes on from the same point."""
    if mode.choice == "none" or not mode.calls_in_text:
        return len(text)
    stripped = text.lstrip()
    if mode.forced or not stripped or stripped[0] in "{[":
        return 0
    end = len(text)
    starts = [i for m in MARKERS if (i := text.find(m)) >= 0]
    if starts:
        end = min(starts)
    else:
        for k in range(min(len(text), max(len(m) for m in MARKERS) - 1), 0, -1):
            if any(m.startswith(text[-k:]) for m in MARKERS):
                end = len(text) - k
                break
    return len(text[:end].rstrip())  # whitespace waits for what follows it: before a call, the reply drops it


def final_delta(text: str, released: int, finish_reason: str | None,
                mode: ToolMode) -> tuple[str | None, list[dict[str, Any]], str | None]:  # fmt: skip
    """A streamed reply's last delta: (the content not yet sent, or None; its tool calls; the finish reason), given
    the `released` characters of `text` already sent as content (content_ready). With calls, the content sent in all
    is the text around them with its end stripped (the blocking reply strips both ends: a reply that begins with
    whitespace then words then a call keeps that whitespace when streamed); without, the whole text."""
    rest, calls = split_reply(text, mode) if finish_reason == "stop" else (text, [])
    if not calls:
        if mode.forced:  # cut off (length, abort): the call's unfinished JSON is no answer in words (as Responses);
            return None, cut_calls(text, finish_reason, mode), finish_reason  # the calls it completed are
        return text[released:] or None, [], finish_reason
    tail = rest[released:].rstrip() if released else rest.strip()
    return tail or None, calls, mode.calls_finish


def _call(x: Any, mode: ToolMode) -> dict[str, Any] | None:
    if not isinstance(x, dict) or x.get("name") not in mode.functions:
        return None
    args = x.get("arguments", x.get("parameters", {}))
    if isinstance(args, str):
        args = json_or_none(args)
    if not isinstance(args, dict):
        return None
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function",
            "function": {"name": x["name"], "arguments": json.dumps(args, ensure_ascii=False)}}  # fmt: skip
