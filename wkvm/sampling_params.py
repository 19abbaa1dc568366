"""SamplingParams: what a request asks of the sampler (names follow vLLM and the OpenAI API).

Every number is bounded so the sampler's arithmetic cannot overflow (a temperature of 1e-300 turns logits into
infinities); the ranges are module constants so the server's schema and docs state the same limits.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import numbers
import os
from collections.abc import KeysView
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import llguidance
from llguidance.gbnf_to_lark import gbnf_to_lark, is_lark_syntax

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # declared in the stub only

log = logging.getLogger("wkvm.sampling")
MAX_STOP_STRINGS = 4
MAX_CHOICES = 2000  # structured_outputs.choice: llguidance refuses a longer alternation anyway
MAX_GRAMMAR_CHARS = 1 << 16  # structured_outputs.regex / grammar text
MAX_BAD_WORDS = 64
# characters in one stop string or bad word: each is tokenized when the request is made (an 8 MB stop string held
# the interpreter for 7 s, hunt 15), and the detokenizer holds back as much text as the longest stop string
MAX_WORD_CHARS = 1024
MAX_LOGPROBS = 20
MAX_TOP_K = 2**31 - 1
TEMPERATURE_RANGE = (0.0, 2.0)
MIN_TEMPERATURE = 0.01  # a positive temperature below this is raised to it, as in vLLM
TOP_P_RANGE = (0.0, 1.0)  # open at 0: top_p must be > 0
MIN_P_RANGE = (0.0, 1.0)
PENALTY_RANGE = (-2.0, 2.0)  # presence_penalty and frequency_penalty
REPETITION_PENALTY_RANGE = (0.01, 10.0)
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's: -100 bans a token, 100 all but forces it
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
# vLLM's structured_outputs kinds (grammar: llguidance's Lark), and its older guided_<kind> fields
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# compact JSON: no whitespace between tokens, so a reply cannot drift into endless blank space
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "coerce_one_of": True}  # oneOf read as anyOf


@dataclass
class SamplingParams:
    max_tokens: int = 16  # 0: the prompt is fed (and scored, with prompt_logprobs) and nothing is generated
    # vLLM's: until this many tokens are out, EOS and stop_token_ids cannot be sampled and stop strings do not stop
    min_tokens: int = 0
    temperature: float = 1.0  # 0: greedy; a positive value below MIN_TEMPERATURE is raised to it
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False  # vLLM's: the text ends with the stop string that ended it
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k logprobs per generated token (the chosen token is always included)
    # top-k logprobs per prompt token (its own token always included; the first token has none), as vLLM's
    # `prompt_logprobs`: from the logits of the forward that prefills the prompt
    prompt_logprobs: int | None = None
    # OpenAI's: None or {"type": "text"}; {"type": "json_object"}; {"type": "json_schema", "json_schema":
    # {"name": ..., "schema": {...}, "strict": ...}}. A JSON reply ends (finish_reason "stop") when the value closes.
    response_format: dict[str, Any] | None = None
    # vLLM's: exactly one of {"json": schema, "regex": str, "choice": [str, ...], "grammar": Lark text}
    structured_outputs: dict[str, Any] | None = None
    # OpenAI's logit_bias: token id -> a number added to its logit before penalties and sampling (logprobs stay the
    # model's own, as the other processing leaves them)
    logit_bias: dict[int, float] | None = None
    # vLLM's: only these tokens may be sampled (None: any)
    allowed_token_ids: list[int] | None = None
    # vLLM's: words the output never contains, each as its tokens with and without a leading space (the last token of
    # one is banned while the output ends with the ones before it)
    bad_words: list[str] = field(default_factory=list)
    # vLLM's: the text leaves out the tokenizer's special tokens (`Tokenizer.special_ids`); token ids, logprobs and
    # stop_token_ids still see them
    skip_special_tokens: bool = True
    # the grammar (response_format, structured_outputs) holds from where the output has written this text, a thinking
    # model's reasoning end (`</think>`); before it the reply is free (vLLM's structured outputs with a reasoning
    # parser). None: from the first token
    grammar_after: str | None = None
    # vLLM's: at most this many tokens inside a think block (one the prompt opened, or the reply's own opening
    # `<think>`), then `</think>` is forced and the reply goes on as its answer (engine/thinking.py). None: no budget
    thinking_token_budget: int | None = None
    # llama.cpp's --reasoning-budget-message: text forced before `</think>` when the budget runs out, so the reasoning
    # reads as closed rather than cut (e.g. "\nTime to answer.\n")
    thinking_budget_message: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        # the types first: stop=[1] had failed on len(), stop_token_ids=5 on list(), and ignore_eos="no" read as true
        _check(_is_list(self.stop, str), "stop", "a string or a list of strings")
        _check(_is_list(self.stop_token_ids, int), "stop_token_ids", "a list of non-negative integer token ids")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            _check(isinstance(getattr(self, name), bool), name, "true or false")
        ok = self.grammar_after is None or (isinstance(self.grammar_after, str) and 0 < len(self.grammar_after) <= 64)
        _check(ok, "grammar_after", "null or a text of 1-64 characters")
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if _is_int(self.seed) and self.seed == -1:  # vLLM's: -1 draws a new seed (it had been one fixed seed)
            self.seed = None
        ok = self.thinking_token_budget is None or (_is_int(self.thinking_token_budget) and
                                                     0 <= self.thinking_token_budget < 2**63)  # fmt: skip
        _check(ok, "thinking_token_budget", "null or an integer >= 0 (the most tokens of reasoning before </think>)")
        ok = isinstance(self.thinking_budget_message, str) and len(self.thinking_budget_message) <= MAX_WORD_CHARS
        _check(ok, "thinking_budget_message", f"a text of at most {MAX_WORD_CHARS} characters")
        ok = _is_int(self.max_tokens) and self.max_tokens >= 0
        _check(ok, "max_tokens", "an integer >= 0 (0: feed the prompt and generate nothing, e.g. to score it)")
        ok = _is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens
        _check(ok, "min_tokens", f"an integer in 0..max_tokens ({self.max_tokens})")
        _check_number("temperature", self.temperature, TEMPERATURE_RANGE)
        _check_number("top_p", self.top_p, TOP_P_RANGE, open_lo=True)
        # bounded: the sampler's kernel takes a 64-bit integer, and 2^63 had failed the whole engine step (every
        # other request sampled in it: a 500); a top_k at or past the vocabulary keeps every token, as off
        ok = _is_int(self.top_k) and 0 <= self.top_k <= MAX_TOP_K
        _check(ok, "top_k", f"an integer in -1..{MAX_TOP_K} (0 or -1 disables it)")
        ok = self.seed is None or (_is_int(self.seed) and -(2**63) <= self.seed <= 2**64 - 1)
        _check(ok, "seed", "an integer in -2^63..2^64-1 (the HTTP API's range)")
        _check_number("min_p", self.min_p, MIN_P_RANGE)
        _check_number("presence_penalty", self.presence_penalty, PENALTY_RANGE)
        _check_number("frequency_penalty", self.frequency_penalty, PENALTY_RANGE)
        _check_number("repetition_penalty", self.repetition_penalty, REPETITION_PENALTY_RANGE)
        ids_ok = all(t >= 0 for t in self.stop_token_ids)  # integers: checked above
        _check(ids_ok, "stop_token_ids", "a list of non-negative integer token ids")
        _check(len(self.stop) <= MAX_STOP_STRINGS, "stop", f"at most {MAX_STOP_STRINGS} strings")
        _check(all(self.stop), "stop", "non-empty strings")
        _check(all(len(s) <= MAX_WORD_CHARS for s in self.stop), "stop",
               f"strings of at most {MAX_WORD_CHARS} characters")  # fmt: skip
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            _check(k is None or (_is_int(k) and 0 <= k <= MAX_LOGPROBS), name, f"an integer in 0..{MAX_LOGPROBS}")
        lo, hi = LOGIT_BIAS_RANGE
        for tok, bias in (self.logit_bias or {}).items():
            ok = _is_int(tok) and tok >= 0 and _in_range(bias, LOGIT_BIAS_RANGE)
            _check(ok, "logit_bias", f"a map from token ids to numbers in [{lo:g}, {hi:g}] (got {tok!r}: {bias!r})")
        allowed = self.allowed_token_ids  # a set too; a numpy array had failed on its truth value (a ValueError)
        if isinstance(allowed, set | frozenset | range | KeysView):
            allowed = self.allowed_token_ids = sorted(allowed)
        ok = allowed is None or (_is_list(allowed, int) and len(allowed) > 0 and all(t >= 0 for t in allowed))
        _check(ok, "allowed_token_ids", "a non-empty list of non-negative integer token ids")
        if isinstance(self.bad_words, str):  # one word, as `stop` takes one string (its letters had each been banned;
            self.bad_words = [self.bad_words]  # offline API hunt, session 49)
        self.bad_words = list(self.bad_words or [])
        ok = len(self.bad_words) <= MAX_BAD_WORDS and all(isinstance(w, str) and w.strip() and len(w) <= MAX_WORD_CHARS
                                                          for w in self.bad_words)  # fmt: skip
        _check(ok, "bad_words", f"at most {MAX_BAD_WORDS} words, each with a character other than whitespace and at "
                                f"most {MAX_WORD_CHARS} characters")  # fmt: skip
        if 0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE
        self.grammar()  # raises InvalidParam("response_format", ...) for a format or schema it cannot enforce

    def json_schema(self) -> dict[str, Any] | None:
        """The JSON schema the reply must match (json_object: any object); None for free text."""
        fmt = self.response_format
        if fmt is None:
            return None
        ok = isinstance(fmt, dict) and fmt.get("type") in RESPONSE_FORMATS
        _check(ok, "response_format", f'an object whose "type" is one of {", ".join(RESPONSE_FORMATS)}')
        if fmt["type"] == "text":
            return None
        if fmt["type"] == "json_object":
            return {"type": "object"}
        spec = fmt.get("json_schema")
        if not (isinstance(spec, dict) and isinstance(spec.get("schema"), dict)):
            need = '"json_schema": {"name": ..., "schema": {...}}, the schema a JSON schema object'
            raise InvalidParam("response_format", f'response_format: type "json_schema" needs {need}')
        return cast(dict[str, Any], spec["schema"])

    def check_vocabulary(self, vocab_size: int) -> None:
        """Every token id a parameter names is one of the model's (InvalidParam naming the parameter): an id beyond
        the vocabulary had been ignored (stop_token_ids, logit_bias) or had failed the engine's step
        (allowed_token_ids)."""
        named = {"stop_token_ids": self.stop_token_ids, "allowed_token_ids": self.allowed_token_ids or [],
                 "logit_bias": list(self.logit_bias or {})}  # fmt: skip
        for param, ids in named.items():
            bad = next((t for t in ids if not (_is_int(t) and 0 <= t < vocab_size)), None)
            if bad is not None:
                raise InvalidParam(param, f"{param}: {bad!r} is not a token id of this model (0..{vocab_size - 1})")

    def grammar(self) -> str | None:
        """llguidance grammar text for the response format or structured_outputs (None: free text). Built and checked
        once per distinct format (an LRU): it is asked for at creation, at admission and by the engine for each row,
        and checking a large grammar takes long (llguidance's check of a choice list grows with its square)."""
        if self.response_format is None and self.structured_outputs is None:
            return None
        try:
            # keys in the order given: a schema's properties come out in its order
            key = json.dumps([self.response_format, self.structured_outputs], ensure_ascii=False)
        except (TypeError, ValueError):  # not plain JSON: built here, and refused with its reason
            return self._grammar_of()
        if len(key) > GRAMMAR_CACHE_KEY_CHARS:
            return self._grammar_of()
        return _cached_grammar(key)

    def _grammar_of(self) -> str | None:
        if self.structured_outputs is not None:
            if self.response_format is not None and self.response_format.get("type") != "text":
                raise InvalidParam("structured_outputs", "give response_format or structured_outputs, not both")
            return self._structured_grammar()
        schema = self.json_schema()
        return None if schema is None else schema_grammar(schema, "response_format")

    def _structured_grammar(self) -> str:
        name, so = "structured_outputs", self.structured_outputs
        given = [k for k in STRUCTURED_KINDS if isinstance(so, dict) and so.get(k) is not None]
        _check(len(given) == 1, name, f"an object with exactly one of {', '.join(STRUCTURED_KINDS)}")
        assert isinstance(so, dict)
        kind, value = given[0], so[given[0]]
        M = llguidance.LLMatcher
        try:
            if kind == "json":
                schema = json.loads(value) if isinstance(value, str) else value
                _check(isinstance(schema, dict), name, "json: a JSON schema (an object, or a string holding one)")
                return schema_grammar(schema, name)
            if kind == "json_object":
                _check(value is True, name, "json_object: true (any JSON object), or left out")
                return schema_grammar({"type": "object"}, name)
            if kind == "choice":
                ok = isinstance(value, list) and 0 < len(value) <= MAX_CHOICES and all(isinstance(c, str) and c
                                                                                      for c in value)  # fmt: skip
                _check(bool(ok), name, f"choice: a list of 1..{MAX_CHOICES} non-empty strings (llguidance takes no "
                       "more; a longer one took seconds to be refused)")  # fmt: skip
                grammar = M.grammar_from_lark("start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value))
            else:
                ok = isinstance(value, str) and 0 < len(value) <= MAX_GRAMMAR_CHARS
                _check(ok, name, f"{kind}: a non-empty string of at most {MAX_GRAMMAR_CHARS:,} characters")
                grammar = M.grammar_from_regex(value) if kind == "regex" else M.grammar_from_lark(lark_of(value))
        except InvalidParam:
            raise
        except (TypeError, ValueError) as e:
            raise InvalidParam(name, f"{name}: the {kind} does not read: {e}") from None
        is_error, messages = M.validate_grammar_with_warnings(grammar)
        if is_error:
            raise InvalidParam(name, f"{name}: the {kind} cannot be enforced: {messages[0]}")
        return grammar

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def uses_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


def lark_of(grammar: str) -> str:
    """A grammar as llguidance's Lark: a GBNF one (llama.cpp's, and what vLLM's default xgrammar backend reads: rules
    `name ::= ...` from `root`) is converted with llguidance's own converter; Lark passes as it is."""
    if "::=" not in grammar or is_lark_syntax(grammar):
        return grammar
    try:
        return gbnf_to_lark(grammar)
    except RecursionError:
        raise InvalidParam("structured_outputs", "structured_outputs: the GBNF grammar nests too deep") from None
    except Exception as e:  # the converter raises plain Exceptions ("No 'root' rule found", "Rule 'x' not found")
        raise InvalidParam("structured_outputs", f"structured_outputs: the GBNF grammar does not read: {e}") from None


# where a JSON schema holds subschemas: maps of them, lists of them, or one (or, for items, a list)
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_ONE = ("additionalProperties", "items", "additionalItems", "not", "if", "then", "else", "contains",
               "propertyNames", "unevaluatedProperties", "unevaluatedItems")  # fmt: skip
_OPENS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def closed_objects(schema: Any) -> Any:
    """`schema` with every object that lists `properties` and says nothing of other keys closed to them
    (`additionalProperties: false`), as vLLM's default grammar engine (xgrammar's strict mode) and llama.cpp's
    converter read such a schema, and as OpenAI's strict mode requires it written: open, a small model filled
    replies with keys nobody asked for (a forced tool call with an invented, repeated key ran to max_tokens). A
    schema that intersects object schemas anywhere is kept as written: `allOf`, or `properties` beside `anyOf`,
    `oneOf` or `$ref` (each branch or target is intersected with them; closing both shut out each other's keys, and
    valid schemas were refused as unsatisfiable). Its members may be reached through shared `$defs` too."""
    return schema if _intersects(schema) else _close(schema)


def _close(schema: Any) -> Any:
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _close(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_close(sub) for sub in out[key]]
    for key in _SCHEMA_ONE:
        if isinstance(out.get(key), dict):
            out[key] = _close(out[key])
        elif key == "items" and isinstance(out.get(key), list):
            out[key] = [_close(sub) for sub in out[key]]
    if isinstance(out.get("properties"), dict) and not any(key in out for key in _OPENS):
        out["additionalProperties"] = False
    return out


def _intersects(schema: Any) -> bool:
    """Whether `allOf`, or `properties` beside `anyOf` / `oneOf` / `$ref`, appears anywhere in `schema` (as keys: a
    property named so counts too, which only keeps the schema as written)."""
    if isinstance(schema, dict):
        beside = "properties" in schema and any(key in schema for key in ("anyOf", "oneOf", "$ref"))
        return beside or "allOf" in schema or any(_intersects(v) for v in schema.values())
    return isinstance(schema, list) and any(_intersects(v) for v in schema)


def schema_grammar(schema: dict[str, Any], param: str) -> str:
    schema = closed_objects(schema)
    try:
        canonical = json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        grammar = llguidance.LLMatcher.grammar_from_json_schema(canonical, defaults=JSON_OPTIONS)
    except (TypeError, ValueError) as e:
        raise InvalidParam(param, f"{param}: the schema is not plain JSON: {e}") from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise InvalidParam(param, f"{param}: the schema cannot be enforced: {messages[0]}")
    return grammar


# The sampling fields a model's generation_config.json sets for requests that leave them out (vLLM's
# `--generation-config auto`, its default: `get_diff_sampling_param`). Every value the file sets is a setting, as
# transformers 5's `to_diff_dict` keeps them (under transformers 4 it dropped values equal to GenerationConfig's
# defaults, a file's "top_k": 50 among them); a top_k of 0 or -1 is off.
GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def model_sampling_defaults(model_path: str | os.PathLike[str]) -> dict[str, Any]:
    """The sampling values a model's generation_config.json sets (see GENERATION_DEFAULTS); one SamplingParams
    refuses is left out with a warning (the model still loads, as with no file). A file that is not JSON is a
    ValueError naming it. A model without the file (a GGUF, a .pth) sets none."""
    from wkvm.tokenizer import companion_path, read_json

    if Path(model_path).suffix == ".pth":  # a .pth has no place for one (convert leaves it out)
        return {}
    path = companion_path(model_path, "generation_config.json")
    data = read_json(path)
    found: dict[str, Any] = {}
    for name in GENERATION_DEFAULTS:
        value = data.get(name)
        if value is None:
            continue
        if name == "top_k" and _is_int(value) and value in (0, -1):  # transformers' and vLLM's "no top-k"
            continue
        try:
            SamplingParams(**{name: value})
        except (InvalidParam, TypeError) as e:
            log.warning("%s: %s %r left out (%s)", path, name, value, e)
            continue
        found[name] = value
    return found


class InvalidParam(ValueError):
    """A request parameter out of range; `param` names the field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _check(ok: bool, name: str, allowed: str) -> None:
    if not ok:
        raise InvalidParam(name, f"{name} must be {allowed}")


def _check_number(name: str, x: object, bounds: tuple[float, float], open_lo: bool = False) -> None:
    lo, hi = bounds
    _check(_in_range(x, bounds, open_lo), name, f"a finite number in {'(' if open_lo else '['}{lo:g}, {hi:g}]")


def _in_range(x: object, bounds: tuple[float, float], open_lo: bool = False) -> bool:
    """A finite real number within bounds; each comparison is written so that NaN fails it."""
    lo, hi = bounds
    ok = isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)
    # read only when `ok`: then a numbers.Real, which compares with floats (typeshed's float admits only float)
    v = cast(float, x)
    return ok and (lo < v if open_lo else lo <= v) and v <= hi


def _is_int(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_list(x: object, kind: type) -> bool:
    """None, or a list or tuple of `kind` (int: integers, not booleans)."""
    ok = _is_int if kind is int else lambda v: isinstance(v, kind)
    return x is None or (isinstance(x, list | tuple) and all(ok(v) for v in x))


GRAMMAR_CACHE_KEY_CHARS = 1 << 20  # formats up to this long (as JSON) are kept in the LRU


@functools.lru_cache(maxsize=32)
def _cached_grammar(key: str) -> str | None:
    """`SamplingParams.grammar` of a format given as its JSON (raises, and keeps nothing, for one it refuses)."""
    params = object.__new__(SamplingParams)  # the two fields only: __post_init__ would ask for this grammar again
    params.response_format, params.structured_outputs = json.loads(key)
    return params._grammar_of()

