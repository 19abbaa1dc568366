"""A chat reply's reasoning apart from its answer, as vLLM's reasoning parsers (`--reasoning-parser qwen3` /
`deepseek_r1`) and llama-server give it: what a thinking model writes inside `<think>...</think>` goes to
`message.reasoning_content` (streamed: `delta.reasoning_content`), the rest to `content`, tools read only the rest.

On with `--reasoning-parser auto` (the default) where the model's chat template knows `</think>` (Qwen3 / Qwen3.5,
DeepSeek-R1 and their kind). A reply a grammar shapes (`response_format`, `structured_outputs`, a forced tool call)
reasons first where the template opened the think block (the grammar holds from `</think>` on: `thinking`), and is
all answer otherwise. A template that opens the block itself (the prompt ends inside `<think>`, as
DeepSeek-R1's and Qwen's thinking templates write it) starts the reply as reasoning, until `</think>`; otherwise a
reply is reasoning only if it opens with `<think>` (after whitespace). Where tools may be called from the text, a
`<tool_call>` ends the reasoning too and begins the answer (Qwen3.5 opens calls inside its think block without
closing it first; vLLM's Qwen3 reasoning parser ends the reasoning there likewise). A reply that ends before
`</think>` is all reasoning, its content null, as vLLM answers. The texts are the model's as written, nothing
stripped (vLLM's too). See docs/http-api.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from wkvm.engine.thinking import CALL, END, START

__all__ = ["END", "START", "Thinking", "parts", "split", "thinking"]


@dataclass(frozen=True)
class Thinking:
    """How one request's replies are read: `inside`, the prompt ends inside a think block (the reply starts as
    reasoning); `include`, vLLM's `include_reasoning` (false: the reasoning is left out, the answer is still apart);
    `calls`, tools may be called from the text (tool_choice auto): a `<tool_call>` ends the reasoning as well."""

    inside: bool
    include: bool = True
    calls: bool = False


def thinking(setting: str, templates: list[str | None], prompt: str, shaped: bool,
             include: bool = True, calls: bool = False) -> Thinking | None:  # fmt: skip
    """The reading of a chat request's replies; None where replies are read as they are: the parser is off, or
    (`auto`) no template of the model's knows `</think>`, or a grammar shapes the reply (`shaped`: response_format,
    structured_outputs, a forced call) from its first token. Where the prompt ends inside a think block the grammar
    waits for `</think>` instead (`SamplingParams.grammar_after`), as vLLM's structured outputs wait for a reasoning
    parser's end: the reply reasons freely, then answers in the grammar's form."""
    if setting == "none":
        return None
    if setting == "auto" and not any(END in t for t in templates if t):
        return None
    inside = prompt.rfind(START) > prompt.rfind(END)
    return Thinking(inside, include, calls) if inside or not shaped else None


def split(text: str, t: Thinking, done: bool) -> tuple[int, int, int | None]:
    """(start, end, answer): `text[start:end]` is the reasoning that can go out now (a finished reply: all of it)
    and the answer is `text[answer:]`; `answer` None while it has not begun (the reply is still reasoning, or, not
    done, its first characters may yet open a think block: they wait). The end of unfinished reasoning that may be
    the start of `</think>` waits too. Depends only on the text: a stream moved to another server goes on from the
    same point."""
    start = 0
    if not t.inside:
        lead = len(text) - len(text.lstrip())
        if text.startswith(START, lead):
            start = lead + len(START)
        elif not done and START.startswith(text[lead:]):  # nothing yet, or the tag's first characters
            return 0, 0, None
        else:
            return 0, 0, 0
    close = text.find(END, start)
    call = text.find(CALL, start) if t.calls else -1
    if call >= 0 and (close < 0 or call < close):  # a call opened inside the block: the answer begins with it
        return start, call, call
    if close >= 0:
        return start, close, close + len(END)
    if done:
        return start, len(text), None
    end = len(text)
    tags = (END, CALL) if t.calls else (END,)
    for k in range(min(max(map(len, tags)) - 1, len(text) - start), 0, -1):
        if any(text.endswith(tag[:k]) for tag in tags):
            end -= k
            break
    return start, end, None


def parts(text: str, t: Thinking | None) -> tuple[str | None, str | None]:
    """A finished reply as (reasoning, answer): reasoning None where there is none (or it is not included), the
    answer None where the reply ended before its reasoning did."""
    if t is None:
        return None, text
    start, end, answer = split(text, t, True)
    reasoning = text[start:end] if t.include and (end > start or answer != 0) else None
    return reasoning, None if answer is None else text[answer:]
