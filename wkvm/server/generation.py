"""Shared generation plumbing for the HTTP routes: prompts, n-way forks, waiting, streaming, logprobs."""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import copy
import dataclasses
import datetime
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any, Protocol, TypeVar

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from wkvm.config import MAX_PROMPT_TOKENS
from wkvm.engine.engine import Event, RequestHandle
from wkvm.outputs import ErrorCode, GenerationOutput
from wkvm.sampling_params import (
    GENERATION_DEFAULTS,
    MAX_STOP_STRINGS,
    MAX_WORD_CHARS,
    STRUCTURED_KINDS,
    InvalidParam,
    SamplingParams,
)
from wkvm.server.asgi import ARRIVED
from wkvm.server.context import ServerContext
from wkvm.server.errors import APIError
from wkvm.server.handover import MARKER_HEAD
from wkvm.server.schemas import SamplingFields

T = TypeVar("T")

DEFAULT_CHAT_MAX_TOKENS = 1024


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def iso_time(t: float) -> str:
    """A Unix time as ISO 8601 in UTC with a Z, as Anthropic's and Ollama's APIs write times."""
    return datetime.datetime.fromtimestamp(t, datetime.UTC).isoformat().replace("+00:00", "Z")


def encode_prompt(ctx: ServerContext, prompt: str | list[int], param: str = "prompt",
                  keep: int | None = None, starts: bool = True) -> list[int]:  # fmt: skip
    """The prompt's token ids, checked. `keep` (vLLM's truncate_prompt_tokens): only its last `keep` tokens (-1: as
    many as the model's context holds with room for one generated token). A text that `starts` a sequence begins
    with BOS where the tokenizer adds one (vLLM's completions); a chat's rendered messages (their template writes
    BOS) and a text that continues a stored state do not."""
    if isinstance(prompt, str):
        check_text(prompt, param)
        # truncation too: the whole text is tokenized before its end is kept (a 15 MB prompt with
        # truncate_prompt_tokens had taken 10 s and 2.2 GB; hunt, session 49)
        check_text_size(ctx, prompt, param, keep is not None)
    tok = ctx.tokenizer
    ids = (tok.encode_prompt(prompt) if starts else tok.encode(prompt)) if isinstance(prompt, str) else list(prompt)
    if not ids:
        raise APIError(400, f"{param} is empty: give at least one token", param, "empty_prompt")
    vocab = ctx.model.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"{param}: token id {bad} is outside the vocabulary 0..{vocab - 1}", param, "invalid_token")
    if keep == 0 or (keep == -1 and not ctx.model.context_limit):
        why = "0 keeps nothing" if keep == 0 else "-1 needs a model with a context limit; this one has none"
        raise APIError(400, f"truncate_prompt_tokens: {why} (give a count >= 1)", "truncate_prompt_tokens",
                       "invalid_value")  # fmt: skip
    if keep == -1:  # the context less one token (the least a request must leave to generate), within
        # --max-prompt-tokens (it had kept more, then refused them with a 413; hunt, session 49)
        keep = min(max(1, (ctx.model.context_limit or 0) - 1), ctx.config.max_prompt_tokens)
    if keep is not None:
        ids = ids[-keep:]
    if len(ids) > ctx.config.max_prompt_tokens:
        raise APIError(413, f"{param} has {len(ids)} tokens; the limit is {ctx.config.max_prompt_tokens} "
                       "(--max-prompt-tokens)", param, "prompt_too_large")  # fmt: skip
    return ids


def check_text_size(ctx: ServerContext, text: str, param: str, truncated: bool = False) -> None:
    """Refuse, before tokenizing it, a text that surely has more tokens than --max-prompt-tokens allows: no token
    covers more than the vocabulary's longest token in bytes (twice that, for normalizers that shorten text). A 20 MB
    prompt took 19 s of a core to tokenize before its 413 (hunt 15). `truncated`: a text whose end
    truncate_prompt_tokens keeps is held to the same size (it is tokenized whole first)."""
    # truncate_prompt_tokens cuts a text of at most what a server with the default limit tokenizes (vLLM truncates
    # any; wkvm's guard with a small --max-prompt-tokens had refused a 1 MB document to be cut; regression hunt, 49)
    limit = max(ctx.config.max_prompt_tokens, MAX_PROMPT_TOKENS) if truncated else ctx.config.max_prompt_tokens
    if len(text) > limit and len(text.encode("utf-8")) > 2 * ctx.longest_token_bytes * limit:
        if truncated:
            raise APIError(413, f"{param} has more than {limit} tokens ({len(text)} characters): too long to truncate "
                           "(the whole text is tokenized before its end is kept); send its end", param,
                           "prompt_too_large")  # fmt: skip
        raise APIError(413, f"{param} has more than {limit} tokens ({len(text)} characters); the limit is {limit} "
                       "(--max-prompt-tokens)", param, "prompt_too_large")  # fmt: skip


LONG_TEXT = 16_384  # characters: a prompt longer than this is tokenized off the event loop


async def encode_prompt_off_loop(ctx: ServerContext, prompt: str | list[int], param: str = "prompt",
                                 keep: int | None = None, starts: bool = True) -> list[int]:  # fmt: skip
    """`encode_prompt`, on a worker thread for a long text: a 5 MB prompt took ~5 s to tokenize, and every other
    request (and /health) waited for it."""
    if isinstance(prompt, str) and len(prompt) > LONG_TEXT:
        return await run_in_threadpool(encode_prompt, ctx, prompt, param, keep, starts)
    return encode_prompt(ctx, prompt, param, keep, starts)


def check_text(text: str, param: str) -> None:
    """JSON can carry lone UTF-16 surrogates ("\\ud800") that no tokenizer can encode: refuse them clearly."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"{param}: invalid Unicode at character {e.start} (an unpaired surrogate); send valid "
                       "UTF-8 text",
                       param, "invalid_text") from None


def with_response_format(sp: SamplingParams, fmt: dict[str, Any], param: str) -> SamplingParams:
    """`sp` whose reply must match `fmt` (compiled and checked now: an unenforceable schema is a 400 on `param`)."""
    try:
        return dataclasses.replace(sp, response_format=fmt)
    except InvalidParam as e:
        raise APIError(400, str(e).replace("response_format", param, 1), param, "invalid_value") from None


def sampling_params(
    ctx: ServerContext, body: SamplingFields, max_tokens: int | None, logprobs: int | None,
    default_max: int = 16, extra_stop: list[str] | None = None, prompt_logprobs: int | None = None,
    max_tokens_field: str = "max_tokens",
) -> SamplingParams:  # fmt: skip
    if body.prompt_logprobs is not None:
        raise APIError(400, "prompt_logprobs is not supported over HTTP yet: use /v1/completions with echo: true and "
                       "logprobs (the prompt tokens' logprobs, OpenAI's shape), or the Python API's "
                       "SamplingParams(prompt_logprobs=...)", "prompt_logprobs", "unsupported")  # fmt: skip
    if body.stream_options is not None and not body.stream:  # OpenAI's and vLLM's 400 (it would be ignored)
        raise APIError(400, "stream_options is only allowed with stream: true", "stream_options", "invalid_value")
    stop = request_stops(body)
    if len(stop) > MAX_STOP_STRINGS:
        raise APIError(400, f"stop: at most {MAX_STOP_STRINGS} stop strings", "stop", "invalid_value")
    if any(len(s) > MAX_WORD_CHARS for s in stop):  # before `special` below tokenizes them
        raise APIError(400, f"stop: strings of at most {MAX_WORD_CHARS} characters", "stop", "invalid_value")
    for s in stop:
        check_text(s, "stop")
    stop_ids = list(body.stop_token_ids or [])
    vocab = ctx.model.vocab_size

    def special(s: str) -> int | None:
        """The token of a stop string that is one special token (a template's end of turn), where it never shows in
        the text (skip_special_tokens): that token stops instead. One beyond the model's rows (a tokenizer larger
        than its model) is never generated: None (it had been refused as a stop_token_ids the client never sent)."""
        ids = ctx.tokenizer.encode(s) if body.skip_special_tokens else []
        return ids[0] if len(ids) == 1 and ids[0] in ctx.tokenizer.special_ids and ids[0] < vocab else None

    for s in stop:
        if (t := special(s)) is not None and t not in stop_ids:
            stop_ids.append(t)
    # the template's end of turn is the model's end of sequence (vLLM stops on the generation config's EOS ids):
    # ignore_eos ignores it too, and as a token it takes none of the request's stop strings' places (it had been
    # dropped when the request gave 4, and kept under ignore_eos)
    for s in [] if body.ignore_eos else extra_stop or []:
        if (t := special(s)) is not None:
            if t not in stop_ids:
                stop_ids.append(t)
        elif len(stop) < MAX_STOP_STRINGS and s not in stop:
            stop.append(s)
    bad = next((t for t in body.stop_token_ids or [] if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"stop_token_ids: {bad} is outside the vocabulary 0..{vocab - 1}", "stop_token_ids",
                       "invalid_token")
    bad = next((t for t in body.allowed_token_ids or [] if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"allowed_token_ids: {bad} is outside the vocabulary 0..{vocab - 1}", "allowed_token_ids",
                       "invalid_token")  # fmt: skip
    for word in body.bad_words or []:
        check_text(word, "bad_words")
    logit_bias = token_biases(body.logit_bias, vocab)
    structured = structured_outputs(body)
    limit = ctx.config.max_tokens_limit
    # a request that sets no max_tokens gets the default, raised to its min_tokens and held to this server's limit:
    # a chat without max_tokens had been refused on a server whose --max-tokens-limit is below the chat default
    n = max_tokens if max_tokens is not None else min(max(default_max, body.min_tokens or 0), limit)
    if n > limit:
        raise APIError(400, f"{max_tokens_field} {n} exceeds this server's limit {ctx.config.max_tokens_limit} "
                       "(--max-tokens-limit)", max_tokens_field, "invalid_value")  # fmt: skip
    try:
        return SamplingParams(
            max_tokens=n, min_tokens=body.min_tokens, **sampling_values(ctx, body), seed=body.seed,
            presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty, stop=stop,
            stop_token_ids=stop_ids, include_stop_str_in_output=body.include_stop_str_in_output,
            ignore_eos=body.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            response_format=body.response_format.as_dict() if body.response_format else None, logit_bias=logit_bias,
            structured_outputs=structured, allowed_token_ids=body.allowed_token_ids, bad_words=body.bad_words or [],
            skip_special_tokens=body.skip_special_tokens,
            thinking_token_budget=thinking_budget(body.thinking_token_budget),
        )  # fmt: skip
    except InvalidParam as e:  # in the request's own words: it may have sent max_completion_tokens (hunt, session 49)
        message = str(e).replace("max_tokens", max_tokens_field) if e.param == "min_tokens" else str(e)
        raise APIError(400, message, e.param, "invalid_value") from None


def thinking_budget(budget: int | None) -> int | None:
    """A request's (or --reasoning-budget's) thinking budget as SamplingParams takes it: -1 (no budget) as None."""
    return None if budget is None or budget < 0 else budget


def request_stops(body: SamplingFields) -> list[str]:
    """The request's own stop strings as a list (`stop` is a string, a list or null)."""
    return [body.stop] if isinstance(body.stop, str) else list(body.stop or [])


def sampling_values(ctx: ServerContext, body: SamplingFields) -> dict[str, Any]:
    """The request's temperature, top_p, top_k, min_p and repetition_penalty; one it leaves out (or sends as null)
    takes the model's generation_config.json value where it sets one (`--generation-config auto`, as vLLM)."""
    given = body.model_fields_set
    values = {name: getattr(body, name) if name in given or name not in ctx.sampling_defaults
              else ctx.sampling_defaults[name] for name in GENERATION_DEFAULTS}  # fmt: skip
    values["top_k"] = max(values["top_k"], 0)
    return values


async def check_grammar(ctx: ServerContext, sp: SamplingParams, param: str | None = None) -> None:
    """A 400 on `param` when the reply's grammar cannot start with this model's vocabulary (GrammarCompiler.problem),
    found before admission rather than at the first token (a 200 and an error event when streamed: hunt 15). The
    grammar is compiled here, on a worker thread (the first one also describes the vocabulary to llguidance: 0.1-0.3
    s), and stays cached for the engine's step."""
    grammar = sp.grammar()
    if grammar is None:
        return
    problem = await run_in_threadpool(ctx.client.grammar_problem, grammar)
    if problem is not None:
        param = param or ("structured_outputs" if sp.structured_outputs is not None else "response_format")
        raise APIError(400, f"{param}: it cannot be enforced with this model's vocabulary: {problem}", param,
                       "invalid_value")  # fmt: skip


def structured_outputs(body: SamplingFields) -> dict[str, Any] | None:
    """vLLM's structured_outputs, or its older guided_json / guided_regex / guided_choice / guided_grammar /
    guided_json_object, or llama-server's grammar."""
    legacy = {kind: v for kind in STRUCTURED_KINDS if (v := getattr(body, f"guided_{kind}")) is not None}
    if body.grammar is not None:  # llama-server's field
        if legacy:
            raise APIError(400, "give grammar or the guided_* fields, not both", "grammar", "invalid_value")
        legacy = {"grammar": body.grammar}
    if legacy and body.structured_outputs is not None:
        raise APIError(400, "give structured_outputs, the guided_* fields or grammar, not two of them",
                       "structured_outputs", "invalid_value")  # fmt: skip
    return body.structured_outputs.as_dict() if body.structured_outputs is not None else legacy or None


def token_biases(logit_bias: dict[str, float] | None, vocab: int) -> dict[int, float] | None:
    """OpenAI's logit_bias (JSON keys are token ids written as decimal strings) as {token id: bias}; 400 for a key
    that is not a token id of this model (the values' range is SamplingParams' check)."""
    if not logit_bias:
        return None
    out: dict[int, float] = {}
    for key, bias in logit_bias.items():
        tok = int(key) if key.isascii() and key.isdigit() and len(key) <= 12 else -1
        if not 0 <= tok < vocab:
            raise APIError(400, f"logit_bias: the key {key[:32]!r} is not a token id of this model (0..{vocab - 1}, "
                           'written as a string: {"50256": -100})', "logit_bias", "invalid_token")  # fmt: skip
        out[tok] = bias
    return out


def per_choice(params: SamplingParams, n: int) -> list[SamplingParams]:
    """n copies; a seeded request gives choice i the seed + i, so choices differ but stay reproducible."""
    if n == 1 or params.seed is None:
        return [params] * n
    out = []
    for i in range(n):  # copies, not new params: checking them again (a large grammar or allowed_token_ids) took
        p = copy.copy(params)  # seconds on the event loop for each of n choices
        p.seed = (params.seed + i) % (2**64)
        out.append(p)
    return out


async def unless_gone(request: Request, started: Awaitable[T], poll: float = 0.2) -> T:
    """`started`, cancelled if the client leaves first (a 499): an n > 1 request waits for its shared prefill (queued,
    then the whole prompt) before its handles exist for `Watch`, and a client gone meanwhile had left it to run to
    the end (7 s of a 3,000-token prompt; streaming hunt, session 47). The prefill's own `finally` frees its slot."""
    task = asyncio.ensure_future(started)
    while not (await asyncio.wait({task}, timeout=poll))[0]:
        if await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise APIError(499, "the client closed the connection before its request started", None,
                           "client_closed_request")  # fmt: skip
    return task.result()


class Watch:
    """Records TTFT / inter-token latency and cancels the requests if the client goes away."""

    def __init__(self, ctx: ServerContext, request: Request, handles: list[RequestHandle]):
        self.ctx, self.request, self.handles = ctx, request, handles
        # from the request's arrival: its tokenizing, queueing and (n > 1) shared prefill are part of the first token's
        # wait (the clock had started after the shared prefill, so n > 1 recorded ~0 s)
        self.t0 = request.scope.get(ARRIVED, time.monotonic())
        self.last: dict[int, float] = {}
        self.counted: set[int] = set()  # choices whose end the metrics have
        self._task: asyncio.Task[None] | None = None

    def saw(self, i: int, ev: Event) -> None:
        now = time.monotonic()
        m = self.ctx.metrics
        if ev.token_ids:
            if i in self.last:  # one sample a token, as vLLM's inter_token_latency (k tokens had been one sample)
                gap = (now - self.last[i]) / len(ev.token_ids)
                for _ in ev.token_ids:
                    m.itl.observe(gap)
            else:
                m.ttft.observe(now - self.t0)
            self.last[i] = now
            m.generated_tokens.inc(len(ev.token_ids))
        if ev.finish_reason is not None:
            self._count(i, ev.finish_reason, ev.error_code)

    def _count(self, i: int, finish_reason: str, error_code: str | None) -> None:
        if i in self.counted or error_code == ErrorCode.MIGRATED:  # a moved choice ends elsewhere
            return
        self.counted.add(i)
        req = getattr(self.handles[i], "request", None)  # the engine's: when it was queued and got a slot
        queued = req.admitted - req.arrival if req is not None and req.admitted is not None else None
        self.ctx.metrics.finished(finish_reason, time.monotonic() - self.t0, queued)

    async def __aenter__(self) -> Watch:
        self._task = asyncio.create_task(self._watch())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task:
            self._task.cancel()
        self.cancel_unfinished()
        for i, h in enumerate(self.handles):  # choices whose last event nobody read (the client went away): as ended
            self._count(i, h.output.finish_reason or "abort", h.output.error_code)

    def cancel_unfinished(self) -> None:
        for h in self.handles:
            if not h.done.is_set():
                h.cancel()

    async def _watch(self) -> None:
        while not all(h.done.is_set() for h in self.handles):
            if await self.request.is_disconnected():
                self.cancel_unfinished()
                return
            await asyncio.sleep(0.2)


async def wait_all(ctx: ServerContext, request: Request, handles: list[RequestHandle]) -> None:
    async for _ in merged(ctx, request, handles):  # every choice's tokens timed as they come (read one choice after
        pass  # another, the later ones' waited in their queues and were timed in a burst)
    for h in handles:
        raise_if_failed(h)


def raise_if_failed(h: RequestHandle) -> None:
    """A request the engine failed: non-finite numbers and masks or a grammar with no token left come from this
    request's own input (its state, parameters or schema), so they are a 400; anything else is the server's fault."""
    if h.output.finish_reason != "error":
        return
    code = h.output.error_code or ErrorCode.ENGINE_ERROR
    status = 400 if code in ErrorCode.OWN_FAULTS else 500
    raise APIError(status, h.output.error or "generation failed", None, code)


async def merged(
    ctx: ServerContext, request: Request, handles: list[RequestHandle]
) -> AsyncIterator[tuple[int, Event]]:
    """Events of all handles as they come, tagged with the handle's index."""
    queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()

    async def pump(i: int, h: RequestHandle) -> None:
        async for ev in h:
            await queue.put((i, ev))

    tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
    async with Watch(ctx, request, handles) as w:
        try:
            left = len(handles)
            while left:
                i, ev = await queue.get()
                w.saw(i, ev)
                left -= ev.finished
                yield i, ev
        finally:
            for t in tasks:
                t.cancel()


def sse(obj: dict[str, Any] | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


async def sse_objects(lines: AsyncIterator[str]) -> AsyncIterator[dict[str, Any] | str]:
    """The objects a stream's `sse` lines carry, up to `[DONE]` (the Responses, Messages and Ollama APIs re-shape the
    chat's stream from them); a moved stream's handover event as its text, last (to be passed on as it is)."""
    async for line in lines:
        if line.startswith(MARKER_HEAD):
            yield line
            return
        data = line.removeprefix("data: ").strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


class Answer(Protocol):
    """What an answer is built from: a request's handle, or a choice that finished on a server it moved from."""

    @property
    def output(self) -> GenerationOutput: ...


def usage(prompt_tokens: int, handles: Sequence[Answer], done_tokens: int = 0,
          extra: dict[str, Any] | None = None, reasoning_tokens: int | None = None) -> dict[str, Any]:  # fmt: skip
    """`done_tokens`: completion tokens of choices that finished on a server the stream moved from. `extra`: the
    request's extras, whose `wkvm` reuse info gives `prompt_tokens_details.cached_tokens` (OpenAI's field; vLLM's with
    --enable-prompt-tokens-details): the prompt tokens a stored state saved computing. `reasoning_tokens`: a thinking
    model's, as OpenAI's `completion_tokens_details` counts them (only where replies are read for reasoning)."""
    completion = done_tokens + sum(len(h.output.token_ids) for h in handles)
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion,
           "prompt_tokens_details": {"cached_tokens": cached_tokens(extra)}}  # fmt: skip
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


def cached_tokens(extra: dict[str, Any] | None) -> int:
    """The prompt tokens reused from stored states: a request's `wkvm.reused_tokens`, summed over a completion's
    prompts (`wkvm.prompts`). A request that goes on from a named state (mode "state") reused that state's tokens,
    none of its prompt's: 0, so that cached_tokens stays a part of prompt_tokens, as OpenAI's is."""
    info = (extra or {}).get("wkvm") or {}
    return sum(int(p.get("reused_tokens") or 0) for p in info.get("prompts", [info]) if p.get("mode") != "state")


MIN_LOGPROB = -9999.0  # JSON has no -Infinity; vLLM reports impossible tokens with this value too


def json_logprob(v: float) -> float:
    return v if v > MIN_LOGPROB else MIN_LOGPROB  # also maps NaN, which compares False


def stop_reason(ctx: ServerContext, body: SamplingFields, reason: int | str | None) -> int | str | None:
    """vLLM's `stop_reason` for a choice the engine ended with `reason`: the request's own stop_token_ids id or stop
    string (a stop string that is one special token stops as that token: the string); None for the model's end of
    sequence and for the stops the server adds itself (a chat template's end of turn, which vLLM reads as EOS)."""
    if reason is None:
        return None
    stop = request_stops(body)
    if isinstance(reason, str):
        return reason if reason in stop else None
    if reason in (body.stop_token_ids or []):
        return reason
    return next((s for s in stop if ctx.tokenizer.encode(s) == [reason]), None)


def with_stop_reason(ctx: ServerContext, body: SamplingFields, choice: dict[str, Any],
                     reason: int | str | None) -> dict[str, Any]:  # fmt: skip
    """`choice` with vLLM's stop_reason beside its finish_reason, once it has one."""
    if choice.get("finish_reason") is not None:
        choice["stop_reason"] = stop_reason(ctx, body, reason)
    return choice


def skipped(ctx: ServerContext, body: SamplingFields) -> frozenset[int]:
    """The tokens a request's generated text leaves out (its `skip_special_tokens`)."""
    return ctx.tokenizer.special_ids if body.skip_special_tokens else frozenset()


def token_str(ctx: ServerContext, token_id: int, as_id: bool = False) -> str:
    """A token as the legacy logprobs name it: its text; a token holding part of a character `bytes:\\xe4\\xbd` (its
    bytes, as OpenAI's completions name them: as U+FFFD, several such tokens had been one key of `top_logprobs`, which
    then had fewer entries than asked, the least likely one's value; hunt, session 49); or `token_id:N` (vLLM's
    return_tokens_as_token_ids)."""
    if as_id:
        return f"token_id:{token_id}"
    raw = ctx.tokenizer.token_bytes(token_id)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class TokenOffsets:
    """Where each token of a completion starts in its text (the legacy `text_offset`), token by token over the
    tokens' own bytes, not the text sent: a stop string that spans tokens holds text back, and a stream counting what
    it had sent gave the tokens after the held text other offsets than the whole answer did (hunt 8). A stream keeps
    one per choice across its chunks. `skip`: tokens that add nothing to the text (`skipped`)."""

    def __init__(self, start: int = 0, skip: frozenset[int] = frozenset()):
        self.pos, self.skip = start, skip
        # a token holding part of a character points where it starts; the characters it completes count from the next
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def of(self, ctx: ServerContext, token_ids: list[int]) -> list[int]:
        out = []
        for t in token_ids:
            out.append(self.pos)
            if t not in self.skip:
                self.pos += len(self.utf8.decode(ctx.tokenizer.token_bytes(t)))
        return out


def completion_logprobs(ctx: ServerContext, token_ids: list[int], lps: Sequence[dict[int, float] | None] | None,
                        k: int, offset: int | TokenOffsets = 0, skip: frozenset[int] = frozenset(),
                        as_ids: bool = False) -> dict[str, Any] | None:  # fmt: skip
    """The legacy completions shape: tokens, token_logprobs, top_logprobs, text_offset (a None entry, an echoed
    prompt's first token, is null in both lists). `offset`: the first token's, or a stream's TokenOffsets to go on
    with; `skip`: tokens that add nothing to the text (`skipped`); `as_ids`: tokens named `token_id:N`."""
    if lps is None:
        return None
    tokens = [token_str(ctx, t, as_ids) for t in token_ids]
    offsets = (offset if isinstance(offset, TokenOffsets) else TokenOffsets(offset, skip)).of(ctx, token_ids)

    def top(t: int, lp: dict[int, float]) -> dict[str, float]:
        """The k most likely, and the chosen token where it is not among them (OpenAI's and vLLM's: up to k + 1)."""
        out: dict[str, float] = {}
        for i, v in sorted(lp.items(), key=lambda kv: -kv[1])[: max(k, 1)]:  # two tokens of one text: the likelier
            out.setdefault(token_str(ctx, i, as_ids), json_logprob(v))
        out.setdefault(token_str(ctx, t, as_ids), json_logprob(lp[t]))
        return out

    pairs = list(zip(token_ids, lps, strict=True))
    return {
        "tokens": tokens,
        "token_logprobs": [None if lp is None else json_logprob(lp[t]) for t, lp in pairs],
        "top_logprobs": [None if lp is None else top(t, lp) for t, lp in pairs],
        "text_offset": offsets,
    }


def echo_text(ctx: ServerContext, prompt: str | list[int]) -> str:
    """The text `echo` returns for a prompt: as sent, or its token ids decoded."""
    return prompt if isinstance(prompt, str) else ctx.tokenizer.decode(prompt)


def echoed(ctx: ServerContext, head: str, prompt_ids: list[int], prompt_lps: list[dict[int, float] | None] | None,
           k: int, text: str, lps: dict[str, Any] | None,
           as_ids: bool = False) -> tuple[str, dict[str, Any] | None]:  # fmt: skip
    """`echo`: the prompt's text `head` before a completion's `text`, and its tokens' logprobs (the first null: nothing
    precedes it) before the completion's `lps` (whose text offsets start after `head`)."""
    tok = ctx.tokenizer  # a BOS the tokenizer put before a text prompt has no text in `head`: no width at offset 0
    bos = tok.bos_token_id
    added = bos is not None and tok.add_bos and prompt_ids[:1] == [bos] and not head.startswith(tok.bos_token or "")
    skip = frozenset({bos}) if added and bos is not None else frozenset()
    # SentencePiece's prefix space ("▁Hello" for "Hello", "▁▁Hello" for " Hello") is in the tokens, not in the text:
    # the offsets after it had run one character ahead (hunt, session 49)
    spoken = b"".join(tok.token_bytes(t) for t in prompt_ids if t not in skip)
    spaced = spoken.startswith(b" ") and spoken[1:].decode("utf-8", errors="replace") == head
    head_lps = completion_logprobs(ctx, prompt_ids, prompt_lps, k, TokenOffsets(-1 if spaced else 0, skip),
                                   as_ids=as_ids)  # fmt: skip
    if head_lps is not None and spaced:
        head_lps["text_offset"] = [max(0, o) for o in head_lps["text_offset"]]
    if head_lps is None or lps is None:
        return head + text, head_lps or lps
    return head + text, {key: head_lps[key] + lps[key] for key in head_lps}


def chat_logprobs(ctx: ServerContext, token_ids: list[int], lps: list[dict[int, float]] | None,
                  k: int, as_ids: bool = False) -> dict[str, Any] | None:  # fmt: skip
    """Chat's logprobs shape; `as_ids` (vLLM's return_tokens_as_token_ids): each token `token_id:N`, its bytes that
    text's, as vLLM gives them."""
    if lps is None:
        return None

    def entry(t: int, v: float) -> dict[str, Any]:
        b = f"token_id:{t}".encode() if as_ids else ctx.tokenizer.token_bytes(t)
        return {"token": b.decode("utf-8", errors="replace"), "logprob": json_logprob(v), "bytes": list(b)}

    content = []
    for t, lp in zip(token_ids, lps, strict=True):
        top = sorted(lp.items(), key=lambda kv: -kv[1])[:k]
        content.append({**entry(t, lp[t]), "top_logprobs": [entry(i, v) for i, v in top]})
    return {"content": content}
