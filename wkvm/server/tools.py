"""Tool calling for /v1/chat/completions (issue #18): OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`.

The tools go to the chat template (its Jinja `tools` variable, as HF templates expect). `tool_choice` "required"
or a named function is enforced with the grammar engine: the reply can only be a JSON list of calls
`[{"name": ..., "arguments": {...}}]` to offered tools, arguments matching each tool's parameters schema (one
call unless `parallel_tool_calls`). "auto" (the default when tools are given) lets the model answer freely and
recognises calls in its text: Hermes / Qwen `<tool_call>{...}</tool_call>`, Qwen3-Coder's and Qwen3.5's XML inside
the same tags (`<function=NAME><parameter=KEY>value</parameter></function>`, vLLM's `qwen3_coder` parser: each value
read as its parameter's schema type says), Mistral `[TOOL_CALLS] [...]`, or a reply that is only a JSON call (or list
of calls). "none" never returns calls. See docs/http-api.md.
"""

from __future__ import annotations

import functools
import json
import math
import re
import secrets
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from wkvm.chat_template import json_or_none
from wkvm.sampling_params import InvalidParam, schema_grammar
from wkvm.server.errors import APIError

MAX_TOOLS = 128  # tools one request offers (OpenAI's limit)
# a last call the model ended without its closing tag counts too, as vLLM's Hermes parser reads it
HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|\Z)", re.S)
MISTRAL = "[TOOL_CALLS]"
# Qwen3-Coder's / Qwen3.5's calls inside <tool_call>: a function's block (its end may be missing at the reply's end)
# and its parameters (one ends at its closing tag, the next parameter, or the function's end): `xml_tags`
XML_FUNCTION = "<function="
XML_ENDS = ("</parameter>", "<parameter=", "</function>")  # what may end a parameter's value
TEXT_KINDS = ("string", "str", "text", "varchar", "char", "enum")
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
            if m.group(1).startswith(XML_FUNCTION):  # Qwen3-Coder's / Qwen3.5's form
                xml: list[Any] = xml_calls(m.group(1), mode, True)
                found.extend(xml or [None])  # a function tag not closed by `>`: no call
                continue
            x = json_or_none(m.group(1))  # a list inside the tags: SmolLM2's trained form, `<tool_call>[{...}]`
            found.extend(x if isinstance(x, list) and x else [x])
        rest = HERMES.sub("", text)
    elif MISTRAL in text:
        rest, *tails = text.split(MISTRAL)
        for tail in (t.lstrip() for t in tails):  # each marker's list (a reply may hold several), words after it
            try:  # as content
                listed, end = json.JSONDecoder().raw_decode(tail)
            except (ValueError, RecursionError):
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
        except (ValueError, RecursionError):
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


def calls_ready(text: str, mode: ToolMode, memo: dict[int, Any] | None = None) -> list[tuple[str, str]]:
    """The calls an unfinished reply has begun, as far as they can stream now, as vLLM and OpenAI stream them: per
    call (name, the start of its arguments as the finished reply spells them, `json.dumps` of the parsed object: only
    what later text cannot change). A call begins once its name is complete and names an offered tool and its
    arguments object has begun: in a forced reply (the grammar's list of calls) or after a `<tool_call>` /
    `[TOOL_CALLS]` marker under `auto` (a bare JSON reply is held whole, as before: it may be a JSON answer). Depends
    only on the text, and each longer text extends what a shorter one gave, so a stream that moves to another server
    goes on from the same point. `memo`: kept by the caller across calls on one growing text, so a token's call reads
    only what is new: complete values, an unfinished string's scan and an unfinished container's complete items
    are kept (read again from its start, a 16,941-character argument had cost 0.58 ms a token, 900 numbers 0.91 ms,
    AMD EPYC Zen 4)."""
    if mode.choice == "none" or not mode.calls_in_text:
        return []
    marker = None if mode.forced else next((m for m in MARKERS if m in text), None)  # Hermes first, as split_reply
    if mode.forced:
        starts = [0]
    elif marker is not None:
        starts = [m.end() for m in re.finditer(re.escape(marker), text)]
    else:
        return []
    calls: list[tuple[str, str]] = []
    for start in starts:
        body = text[start:].lstrip()
        if body.startswith(XML_FUNCTION) or (XML_FUNCTION.startswith(body) and body):  # Qwen3-Coder's / Qwen3.5's
            end = body.find("</tool_call>")
            begun = xml_begun(body if end < 0 else body[:end], mode)
            calls += begun
            if end < 0 or len(begun) != body[:end].count(XML_FUNCTION):  # the rest waits for this one
                return calls if mode.parallel else calls[:1]
            continue
        node = _JSON(text, memo).value(start)
        for item in ([v for _, v in node.items] if node is not None and node.kind == "[" else [node]):
            call = _begun_call(text, item, mode)
            if call is None:
                return calls if mode.parallel else calls[:1]
            calls.append(call)
    return calls if mode.parallel else calls[:1]


def call_deltas(ready: list[tuple[str, str]], sent: list[tuple[str, str]],
                ids: list[str] | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """The `delta.tool_calls` entries that take a streamed choice's calls from `sent` (per call its name and the
    arguments sent; extended here) to `ready` (calls_ready's, or the finished reply's calls, `ids` theirs), as OpenAI
    streams them: a call's first entry has its index, id, type, name and arguments so far, later ones its index and
    more arguments. A finished call that does not go on from what was sent (a reply the model broke after its call
    began) gets nothing more: what went out stays as it went."""
    out: list[dict[str, Any]] = []
    for j, (name, args) in enumerate(ready):
        if j == len(sent):
            call_id = ids[j] if ids else new_call_id()
            out.append({"index": j, "id": call_id, "type": "function", "function": {"name": name, "arguments": args}})
            sent.append((name, args))
        elif sent[j][0] == name and args.startswith(sent[j][1]) and len(args) > len(sent[j][1]):
            out.append({"index": j, "function": {"arguments": args[len(sent[j][1]) :]}})
            sent[j] = (name, args)
    return out


def xml_calls(body: str, mode: ToolMode, finished: bool) -> list[dict[str, Any]]:
    """The calls in one `<tool_call>` of Qwen3-Coder's XML form as {"name", "arguments"} (`_call` checks them), each
    parameter's text (less one newline either side, as the model writes them) read as its schema's type says
    (`xml_value`); `finished`: the reply has ended, so a block or parameter the text ends inside counts (as vLLM
    reads a call whose closing tags are missing), else only closed parameters."""
    out = []
    for name, inner, closed, _ in xml_tags(body, "function"):
        name = name.strip()
        schema = mode.functions.get(name, {}).get("parameters") or {}
        props = p if isinstance(p := schema.get("properties"), dict) else {}
        args: dict[str, Any] = {}
        pending = None  # unfinished: the parameter the text ends inside, as (key, its text so far, kept as text)
        for key, raw, ended, stop in xml_tags(inner, "parameter", "<parameter="):
            key = key.strip()
            if not (finished or ended or closed or stop < len(inner)):
                pending = key, raw, xml_kind(props.get(key)) is None  # the text may go on inside this value
                break
            raw = raw.removeprefix("\n").removesuffix("\n")
            args[key] = xml_value(raw, props.get(key))
        out.append({"name": name, "arguments": args, "closed": closed, "pending": pending})
    return out


def xml_tags(text: str, tag: str, also: str = "") -> Iterator[tuple[str, str, bool, int]]:
    """(name, value, closed, where the value ends) for each `<tag=NAME>value` in `text` (NAME without `>` or a line
    break): the value runs to the first `</tag>` (closed: it is taken with it), to the first `also` (left for the
    next), or to the text's end. Read with `str.find`: a lazy regex over a 17 kB file the model was writing had taken
    1.1 ms a streamed token (AMD EPYC Zen 4)."""
    opening, closing = f"<{tag}=", f"</{tag}>"
    at = 0
    while (start := text.find(opening, at)) >= 0:
        head = start + len(opening)
        name_end = text.find(">", head)
        if name_end < 0 or "\n" in text[head:name_end]:
            at = start + 1
            continue
        value = name_end + 1
        ends = [(e, True) for e in [text.find(closing, value)] if e >= 0]
        ends += [(e, False) for e in ([text.find(also, value)] if also else []) if e >= 0]
        stop, closed = min(ends) if ends else (len(text), False)
        yield text[head:name_end], text[value:stop], closed, stop
        at = stop + len(closing) if closed else stop


def xml_kind(schema: Any) -> str | None:
    """The type a parameter's schema gives its text (the first of a list that is not null); None: kept as text (a
    string, or no schema or type)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):  # ["integer", "null"]
        kind = next((k for k in kind if k != "null"), None)
    return None if not isinstance(kind, str) or kind in TEXT_KINDS else kind


def xml_value(raw: str, schema: Any) -> Any:
    """A Qwen3-Coder parameter's text as its schema's `type` reads it, as vLLM's `qwen3_coder` parser converts it:
    "null" is null; a string (or no schema, no type) stays the text; an integer parses; a number parses (as an
    integer where it is written as one); boolean is whether it says true; objects, arrays and the rest parse as JSON
    (no NaN or Infinity: the arguments must stay JSON); what does not parse stays the text."""
    if raw.strip().lower() == "null":
        return None
    kind = xml_kind(schema)
    if kind is None:
        return raw
    try:
        if kind.startswith(("int", "uint", "long", "short", "unsigned")):
            return int(raw.strip())
        if kind.startswith(("num", "float")):
            try:
                return int(raw.strip())
            except ValueError:
                x = float(raw.strip())
                return x if math.isfinite(x) else raw
        if kind in ("boolean", "bool", "binary"):
            return raw.strip().lower() == "true"
        return json.loads(raw, parse_constant=_not_json)
    except (ValueError, RecursionError):
        return raw


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def xml_begun(body: str, mode: ToolMode) -> list[tuple[str, str]]:
    """The calls of one unfinished `<tool_call>` of Qwen3-Coder's form as far as they can stream (`calls_ready`'s
    pairs): a call once its function's name is complete and offered, its arguments as `json.dumps` of the finished
    call writes them up to its last closed parameter (the `}` once `</function>` is there), then the value written
    so far of a parameter kept as text (a file's content streams as the model writes it, as vLLM streams it)."""
    out = []
    for call in xml_calls(body, mode, False):
        if call["name"] not in mode.functions:
            break
        args = call["arguments"]
        text = json.dumps(args, ensure_ascii=False)
        if call["closed"]:
            out.append((call["name"], text))
            continue
        text = text[:-1]
        if call["pending"] is not None and call["pending"][2] and call["pending"][0] not in args:
            key, raw, _ = call["pending"]
            if shown := text_so_far(raw):  # its opening quote and what later text cannot change
                text += (", " if args else "") + json.dumps(key, ensure_ascii=False) + ": "
                text += json.dumps(shown, ensure_ascii=False)[:-1]
        out.append((call["name"], text))
        break
    return out


def text_so_far(raw: str) -> str:
    """The start of a text parameter's final value that its unfinished text fixes: its one leading newline left out,
    holding back a last newline and what may be the start of the tag that ends it (the final value drops one newline
    before the tag), and nothing while it may yet be "null" (which is null, not a string)."""
    value = raw.removeprefix("\n")
    cut = len(value) - value.endswith("\n")
    at = value.rfind("<")
    if at >= 0 and any(tag.startswith(value[at:]) for tag in XML_ENDS):
        cut = min(cut, at - (at > 0 and value[at - 1] == "\n"))
    shown = value[:cut]
    return "" if "null".startswith(shown.strip().lower()) or not raw else shown


def _begun_call(text: str, node: _Node | None, mode: ToolMode) -> tuple[str, str] | None:
    if node is None or node.kind != "{":
        return None
    fields = {k.text: v for k, v in node.items if k is not None and k.done and v is not None}
    name = fields.get("name")
    if name is None or name.kind != '"' or not name.done or name.text not in mode.functions:
        return None
    if node.done:  # the whole call: its arguments as the finished reply's (a string of JSON, "parameters", none)
        if node.call is None:  # read once (a complete node is kept in the stream's memo)
            call = _call(json_or_none(text[node.start : node.end]), mode)
            node.call = (call["function"]["name"], call["function"]["arguments"]) if call else ()
        return node.call or None
    args = fields.get("arguments")
    return (name.text, args.canonical()) if args is not None and args.kind == "{" else None


@dataclass
class _Node:
    """A JSON value as far as the text goes: `kind` its first character class ('{', '[', '"', '0' for a number, 't'
    for true / false / null), `done` once it is complete; a string's decoded `text` (so far), an object's `items`
    as (key, value) pairs (None: not begun), an array's `items` as (None, value), a number's or literal's `text`."""

    kind: str
    start: int
    end: int = -1
    done: bool = False
    text: str = ""
    items: list[tuple[_Node | None, _Node | None]] = field(default_factory=list)
    # a complete node's canonical text and, for a complete call object, its (name, arguments) (`()`: not a call),
    # each worked out once: complete nodes stay in a stream's memo while the rest of the reply grows
    written: str | None = None
    call: tuple[str, str] | tuple[()] | None = None

    def canonical(self) -> str:
        """The start of `json.dumps(value, ensure_ascii=False)` that the text so far fixes (the whole when done)."""
        if self.written is not None:
            return self.written
        text = self._canonical()
        if self.done:
            self.written = text
        return text

    def _canonical(self) -> str:
        if self.kind == '"':
            quoted = json.dumps(self.text, ensure_ascii=False)  # escapes character by character: prefix-safe
            return quoted if self.done else quoted[:-1]
        if self.kind == "0":  # as json.loads reads it and json.dumps writes it
            if not self.done:
                return ""
            return str(int(self.text)) if self.text.lstrip("-").isdigit() else json.dumps(float(self.text))
        if self.kind == "t":
            return self.text
        out = self.kind
        for i, (key, value) in enumerate(self.items):
            out += ", " if i else ""
            for part in (key, value) if self.kind == "{" else (value,):
                if part is None:
                    return out
                out += part.canonical()
                if not part.done:
                    return out
                out += ": " if part is key else ""
        return out + ("}" if self.kind == "{" else "]") if self.done else out


class _JSON:
    """Reads a JSON value at a place in a text that may end anywhere, or turn out not to be JSON (then the value is
    left unfinished where it stopped being JSON: the finished reply will not parse, and nothing more streams)."""

    def __init__(self, text: str, memo: dict[int, Any] | None = None):
        # `memo` (the text only grows between reads): complete values by where they start, and where an unfinished
        # string's scan stopped with what it decoded so far
        self.s, self.memo = text, {} if memo is None else memo

    def skip(self, i: int) -> int:
        while i < len(self.s) and self.s[i] in " \t\n\r":
            i += 1
        return i

    def value(self, i: int, depth: int = 0) -> _Node | None:
        i = self.skip(i)
        if i >= len(self.s) or depth > MAX_DEPTH:
            return None
        if isinstance(known := self.memo.get(i), _Node):
            return known
        node = self.read(i, depth)
        if node is not None and node.done:
            self.memo[i] = node
        return node

    def read(self, i: int, depth: int) -> _Node | None:
        c = self.s[i]
        if c == '"':
            return self.string(i)
        if c in "{[":
            return self.container(i, depth)
        if c in "-0123456789":
            j = NUMBER_CHARS.match(self.s, i).end()  # type: ignore[union-attr]
            # finished where something follows it, if it is a number (it is rewritten as json.dumps writes it)
            done = j < len(self.s) and NUMBER.fullmatch(self.s, i, j) is not None
            if done and "." not in self.s[i:j] and j - i > sys.get_int_max_str_digits():
                done = False  # an integer json.loads refuses: the finished reply will not parse
            return _Node("0", i, j, done, self.s[i:j])
        for word in ("true", "false", "null"):
            if self.s.startswith(word, i):
                return _Node("t", i, i + len(word), True, word)
        return None

    def string(self, i: int) -> _Node:
        if isinstance(known := self.memo.get(i), _Node):
            return known
        node = _Node('"', i)
        j, out = self.memo.get(i, (i + 1, []))  # where an earlier read of a shorter text stopped
        while j < len(self.s):
            c = self.s[j]
            if c == '"':
                node.done, node.end = True, j + 1
                break
            if c < " ":  # a raw control character: not JSON
                break
            if c != "\\":
                plain = PLAIN.match(self.s, j)  # a run of plain characters at once (the text is read every token)
                assert plain is not None
                out.append(plain.group())
                j = plain.end()
                continue
            e = self.s[j + 1 : j + 2]
            if e and e in SIMPLE_ESCAPES:
                out.append(SIMPLE_ESCAPES[e])
                j += 2
                continue
            code = _hex4(self.s, j + 2) if e == "u" else None
            if code is None:  # cut inside an escape (or a bad one)
                break
            if 0xD800 <= code < 0xDC00:  # a high surrogate: joined with a low one after it, as json.loads does
                after = self.s[j + 6 : j + 12]
                if len(after) < 6 and PARTNER_START.fullmatch(after):
                    break  # the text ends where its partner may still come
                low = _hex4(after, 2) if after.startswith("\\u") else None
                if low is not None and 0xDC00 <= low < 0xE000:
                    out.append(chr(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)))
                    j += 12
                    continue
            out.append(chr(code))
            j += 6
        node.text = "".join(out)
        self.memo[i] = node if node.done else (j, [node.text])
        return node

    def container(self, i: int, depth: int) -> _Node:
        node, close = _Node(self.s[i], i), "}" if self.s[i] == "{" else "]"
        saved = self.memo.get(i)
        if isinstance(saved, tuple):  # an earlier read stopped inside it: its complete items stand
            j, items = saved
            node.items = list(items)
        else:
            j = self.skip(i + 1)
            if j < len(self.s) and self.s[j] == close:
                node.done, node.end = True, j + 1
                return node
        resume = self.items(node, j, close, depth)
        if not node.done and len(node.items) > 1:  # read again from after its last complete item (the comma)
            self.memo[i] = (resume, node.items[:-1])
        return node

    def items(self, node: _Node, j: int, close: str, depth: int) -> int:
        """A container's items from `j` (after its opening or a comma) into `node.items`, node.done once it closes;
        where the last item began."""
        while True:
            top, key = j, None
            if node.kind == "{":
                j = self.skip(j)
                if j >= len(self.s) or self.s[j] != '"':
                    node.items.append((None, None))
                    return top
                key = self.string(j)
                j = self.skip(key.end) if key.done else len(self.s)
                if not key.done or j >= len(self.s) or self.s[j] != ":":
                    node.items.append((key, None))
                    return top
                j += 1
            value = self.value(j, depth + 1)
            node.items.append((key, value))
            if value is None or not value.done:
                return top
            j = self.skip(value.end)
            if j < len(self.s) and self.s[j] == close:
                node.done, node.end = True, j + 1
                return top
            if j >= len(self.s) or self.s[j] != ",":
                return top
            j += 1


NUMBER_CHARS = re.compile(r"[-+0-9.eE]*")
NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
MAX_DEPTH = 200  # nesting a streamed call is read to (json.loads recurses out near 1,000; a call is rarely past 10)
PLAIN = re.compile(r'[^"\\\x00-\x1f]+')
PARTNER_START = re.compile(r"(\\(u[0-9a-fA-F]{0,3})?)?")  # what a text cut inside a low surrogate's escape ends with
SIMPLE_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


def _hex4(s: str, i: int) -> int | None:
    digits = s[i : i + 4]
    return int(digits, 16) if len(digits) == 4 and all(c in "0123456789abcdefABCDEF" for c in digits) else None


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def _call(x: Any, mode: ToolMode) -> dict[str, Any] | None:
    if not isinstance(x, dict) or x.get("name") not in mode.functions:
        return None
    args = x.get("arguments", x.get("parameters", {}))
    if isinstance(args, str):
        args = json_or_none(args)
    if not isinstance(args, dict):
        return None
    return {"id": new_call_id(), "type": "function",
            "function": {"name": x["name"], "arguments": json.dumps(args, ensure_ascii=False)}}  # fmt: skip
