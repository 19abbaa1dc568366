"""The sampler: logit bias, allowed tokens and bad words, min_tokens, grammar masks, penalties,
greedy/temperature/top-k/top-p/min-p, per-request seeds, top-k logprobs.

Logprobs are those of the model's raw distribution (before logit bias, penalties and temperature), as vLLM's default
(`raw_logprobs`); a constrained row's are those of its grammar-masked distribution, as vLLM's (its model runner masks
the logits before its sampler reads them): tokens the grammar rules out have none, and a token it forces has 0.
Rows are independent: a row whose logits or distribution are not finite gets an error instead of a token, and
every other row samples exactly as it would have without it (`draw` never sees an invalid distribution).
A constrained row (one with a `GrammarState`) masks its own logits to the tokens its grammar allows; the batch's
logits are never changed in place, so free rows in the same batch sample exactly as without it.

Cost per row and token is O(vocabulary) with small constants, whatever the output's length: top-p sorts only the
top tokens that reach p (`torch.topk` of a growing size, not a sort of the vocabulary), a token is drawn by one
uniform number against the distribution's cumulative sum (not `torch.multinomial`, which draws an exponential per
vocabulary entry), and penalties keep their counts as the output grows. Measured before (SmolLM2's 49,152 tokens, AMD
EPYC avx512, 2 threads): a row at temperature 0.7 took 1.4 ms, with top_p 0.9 5.5 ms (the sort 3.5 ms, multinomial
1.0 ms); penalties 0.3 ms at 32 output tokens, 1.6 ms at 2,000 (a bincount and set union of all tokens each step).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from wkvm.engine.grammar import GrammarState
from wkvm.engine.thinking import ThinkingBudget
from wkvm.models import fused
from wkvm.models.family import first_line
from wkvm.outputs import ErrorCode
from wkvm.sampling_params import SamplingParams

NON_FINITE_LOGITS = (
    "the model produced non-finite logits (NaN or infinity) for this request; its state holds values out of range"
)
INVALID_DISTRIBUTION = (
    "sampling this request produced an invalid distribution (NaN, infinity or all zero); "
    "its logits or sampling parameters are out of range"
)
NO_TOKEN_LEFT = (
    "this request's token masks leave no token to choose: allowed_token_ids, bad_words and "
    "min_tokens (which holds back the end of sequence and stop_token_ids until that many are out) exclude them all"
)
NO_ALLOWED_TOKEN = "the reply's grammar (response_format, structured_outputs, a forced tool call) allows no token here"


@dataclass
class GrammarGate:
    """Holds a row's grammar back until its output has written `end` (`SamplingParams.grammar_after`, a thinking
    model's `</think>`): the tokens before are free; the text after `end` inside the token that writes its last
    character goes to the grammar as its tokens (`encode`), as if the model had written them after it (leading
    whitespace left out)."""

    end: bytes
    token_bytes: Callable[[int], bytes]
    encode: Callable[[str], list[int]]
    tail: bytes = b""  # the output's last bytes, a partial `end`
    open: bool = False

    def passes(self, token: int) -> list[int] | None:
        """While closed: None, or (the token opens it) the tokens of its text after `end` for the grammar."""
        data = self.tail + self.token_bytes(token)
        at = data.find(self.end)
        if at < 0:
            self.tail = data[len(data) - len(self.end) + 1 :] if len(data) >= len(self.end) else data
            return None
        self.open, self.tail = True, b""
        # whitespace there is the model's spacing after its reasoning, which a grammar without leading space refuses
        rest = data[at + len(self.end) :].decode("utf-8", "ignore").lstrip()
        return self.encode(rest) if rest else []


@dataclass
class SamplerRow:
    params: SamplingParams
    generator: torch.Generator | None = None
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    base_ids: list[int] = field(default_factory=list)  # tokens already inside a resumed state: context too
    grammar: GrammarState | None = None  # the response_format's parse so far (None: free text)
    gate: GrammarGate | None = None  # holds the grammar back until the output has written its end (None: no wait)
    stop_ids: list[int] = field(default_factory=list)  # tokens that end the output: masked until min_tokens are out
    thinking: ThinkingBudget | None = None  # thinking_token_budget's count (None: no budget)
    _counts: torch.Tensor | None = field(default=None, init=False, repr=False)  # [V] output_ids[:_counted]
    _seen: torch.Tensor | None = field(default=None, init=False, repr=False)  # [V] state, prompt, output[:_seen_upto]
    _counted: int = field(default=0, init=False, repr=False)
    _seen_upto: int = field(default=0, init=False, repr=False)
    _bias: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, init=False, repr=False)  # ids, values
    _stops: torch.Tensor | None = field(default=None, init=False, repr=False)  # stop_ids < V, as a tensor
    bad_words: list[list[int]] = field(default_factory=list)  # token sequences the output must not end with
    _allowed: torch.Tensor | None = field(default=None, init=False, repr=False)  # [V] bool: allowed_token_ids

    @property
    def constrained(self) -> bool:
        """The grammar decides the next token (it has one, and its gate, if any, is open)."""
        return self.grammar is not None and (self.gate is None or self.gate.open)

    def feed(self, token: int) -> None:
        """A token the row put out, to its thinking budget and its grammar."""
        if self.thinking is not None:
            self.thinking.feed(token)
        self.feed_grammar(token)

    def feed_grammar(self, token: int) -> None:
        """A token the row put out, to its grammar: through the gate while that is closed (`GrammarGate.passes`)."""
        if self.grammar is None:
            return
        if self.gate is not None and not self.gate.open:
            for t in self.gate.passes(token) or []:
                self.grammar.accept(t)
            return
        self.grammar.accept(token)

    def biased(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] plus the request's logit_bias, as a new tensor (ids >= V do not exist in this model: skipped;
        the server answers 400 for them)."""
        if self._bias is None:
            pairs = [(t, b) for t, b in (self.params.logit_bias or {}).items() if t < logits.shape[-1]]
            ids = torch.tensor([t for t, _ in pairs], dtype=torch.long)
            self._bias = ids, torch.tensor([b for _, b in pairs], dtype=logits.dtype)
        return logits.index_add(0, *self._bias)

    def without_stops(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] with the tokens that would end the output masked (-inf), as a new tensor: before min_tokens."""
        if self._stops is None:
            self._stops = torch.tensor([t for t in self.stop_ids if t < logits.shape[-1]], dtype=torch.long)
        return logits.index_fill(0, self._stops, float("-inf"))

    def restricted(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] with what `allowed_token_ids` and `bad_words` rule out masked (-inf), as a new tensor: tokens
        not allowed, and each bad word's last token where the output ends with the tokens before it."""
        vocab = logits.shape[-1]
        if self.params.allowed_token_ids is not None:
            if self._allowed is None:
                self._allowed = torch.zeros(vocab, dtype=torch.bool)
                allowed = [t for t in self.params.allowed_token_ids if t < vocab]
                self._allowed[torch.tensor(allowed, dtype=torch.long)] = True
            logits = logits.masked_fill(~self._allowed, float("-inf"))
        out, n = self.output_ids, len(self.output_ids)
        banned = [w[-1] for w in self.bad_words if w[-1] < vocab and (len(w) == 1 or out[n - len(w) + 1 :] == w[:-1])]
        return logits.index_fill(0, torch.tensor(banned, dtype=torch.long), float("-inf")) if banned else logits

    def output_counts(self, vocab: int) -> torch.Tensor:
        """How often each token came out so far [vocab] (float; ids >= vocab are not counted), for the frequency and
        presence penalties; kept up to date a token at a time."""
        if self._counts is None or self._counted > len(self.output_ids):
            self._counts, self._counted = torch.zeros(vocab), 0
        new = [t for t in self.output_ids[self._counted :] if t < vocab]
        if new:
            self._counts.index_put_((torch.tensor(new),), torch.ones(len(new)), accumulate=True)
        self._counted = len(self.output_ids)
        return self._counts

    def seen(self, vocab: int) -> torch.Tensor:
        """Whether each token is in the state, the prompt or the output so far [vocab] (bool), for the repetition
        penalty; the state and prompt part built on first use, the output added a token at a time."""
        if self._seen is None or self._seen_upto > len(self.output_ids):
            self._seen, self._seen_upto = torch.zeros(vocab, dtype=torch.bool), 0
            self._mark([*self.base_ids, *self.prompt_ids], vocab)
        self._mark(self.output_ids[self._seen_upto :], vocab)
        self._seen_upto = len(self.output_ids)
        return self._seen

    def _mark(self, ids: list[int], vocab: int) -> None:
        assert self._seen is not None
        if ids := [t for t in ids if t < vocab]:
            self._seen[torch.tensor(ids)] = True


@dataclass
class Sampled:
    """One row's outcome: a token (with its logprobs when asked), or the error that kept it from sampling."""

    token: int | None
    logprobs: dict[int, float] | None = None
    error: str | None = None
    error_code: str = ErrorCode.NON_FINITE  # with `error`: which kind
    grammar_done: bool = False  # this token completed the response_format's value: the reply ends here


def make_generator(seed: int | None) -> torch.Generator | None:
    """A generator for a 64-bit `seed` (negative: modulo 2^64). torch's CPU generator (mt19937) keeps only a seed's low
    32 bits, so 0, 2^32 and 2^33 drew alike: a seed from 2^32 up is hashed to 32 bits (splitmix64's finalizer,
    the halves xor-ed), one below keeps its draws."""
    if seed is None:
        return None
    s = seed % (1 << 64)
    if s >> 32:
        s = (s ^ (s >> 30)) * 0xBF58476D1CE4E5B9 % (1 << 64)
        s = (s ^ (s >> 27)) * 0x94D049BB133111EB % (1 << 64)
        s ^= s >> 31
        s = (s ^ (s >> 32)) & 0xFFFFFFFF
    return torch.Generator().manual_seed(s)


def apply_penalties(logits: torch.Tensor, row: SamplerRow) -> torch.Tensor:
    """vLLM's order: the repetition penalty (tokens of the state, prompt or output), then the frequency and presence
    penalties (the output's). They had run the other way round, and the repetition penalty scales a logit, so a
    request setting both could pick another token than vLLM's (sampling hunt, session 48)."""
    p, vocab = row.params, logits.shape[-1]
    if p.repetition_penalty != 1.0:
        rp = p.repetition_penalty
        logits = torch.where(row.seen(vocab), torch.where(logits > 0, logits / rp, logits * rp), logits)
    if p.frequency_penalty or p.presence_penalty:
        counts = row.output_counts(vocab).to(logits.dtype)
        logits = logits - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, then the top-k and min-p filters, then top-p on what they leave (renormalized), as vLLM orders them;
    returns a normalized distribution. (min-p had come after top-p, which then counted tokens min-p drops: it kept
    more than vLLM's; sampling hunt, session 48.)"""
    x = logits / p.temperature
    if 0 < p.top_k < x.shape[-1]:
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, -1)
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    if p.top_p < 1.0:
        probs = top_p_filter(probs, p.top_p)
    return probs / probs.sum()


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probabilities reach top_p (a token is kept when the tokens
    before it, most likely first, sum to less than top_p, as vLLM cuts: "at most" had kept one more at an exact tie).
    Sorts only the top k tokens, k growing 4x from 64 until they reach top_p (the tokens after them are all dropped
    then), not the whole vocabulary. Equal probabilities go
    lowest token id first, as in the fused kernel (topk's order among ties is its own: with bf16-rounded logits the
    two paths had kept different tokens at the cut), and every token tied with the k-th is a candidate.
    `probs` need not be normalized: the sums run in float64 against top_p times their total, as the fused kernel's
    (a float32 cumsum of renormalized values had kept one more of ten tied tokens than the kernel; review, session
    48)."""
    V, k = probs.shape[-1], 64
    limit = top_p * float(probs.double().sum())
    while True:
        k = min(k, V)
        top = torch.topk(probs, k).values
        if k == V or float(top.double().sum()) >= limit:
            break
        k *= 4
    order = torch.nonzero((probs >= top[-1]) & (probs > 0)).view(-1)  # ascending ids; not every 0 of a cut vocabulary
    top, by_value = probs[order].sort(descending=True, stable=True)
    order = order[by_value]
    before = top.double().cumsum(-1) - top.double()
    return torch.zeros_like(probs).scatter(-1, order, top.masked_fill(~(before < limit), 0.0))


def uniform(generator: torch.Generator | None) -> float:
    """The one number in [0, 1) a sampled token takes from its row's generator."""
    return float(torch.rand((), dtype=torch.float64, generator=generator))


def draw(probs: torch.Tensor, u: float) -> int | None:
    """One token from a distribution [V] (not necessarily normalized) and a uniform u in [0, 1): the first token whose
    cumulative sum (float64) passes u times the total; a token of probability 0 is never drawn. None when the
    distribution is not valid (its total NaN, infinite or 0: the sampler's own filters never make a probability
    negative)."""
    cdf = probs.double().cumsum(-1)
    total = float(cdf[-1])
    if not math.isfinite(total) or total <= 0:
        return None
    i = int(torch.searchsorted(cdf, torch.tensor([u * total], dtype=torch.float64), right=True))
    if i >= cdf.shape[-1]:  # u rounded up to the total: the last token that has any probability
        i = int(torch.nonzero(probs)[-1])
    return i


def top_logprobs(logprobs: torch.Tensor, chosen: int, k: int) -> dict[int, float]:
    out = {chosen: float(logprobs[chosen])}
    if k > 0:
        vals, ids = torch.topk(logprobs, k)
        out.update({int(i): float(v) for i, v in zip(ids, vals, strict=True)})
    return out


def prompt_token_logprobs(logits: torch.Tensor, targets: list[int], k: int) -> list[dict[int, float]]:
    """Row i of logits [T, V] scored against targets[i] (len(targets) <= T rows are used): the target's logprob and
    the top k, as `top_logprobs` gives a sampled token."""
    lp = torch.log_softmax(logits[: len(targets)].float(), -1)
    chosen = lp.gather(-1, torch.tensor(targets).unsqueeze(-1))[:, 0].tolist()
    out = [{t: v} for t, v in zip(targets, chosen, strict=True)]
    if k > 0:
        vals, ids = torch.topk(lp, min(k, lp.shape[-1]))
        for d, row_ids, row_vals in zip(out, ids.tolist(), vals.tolist(), strict=True):
            d.update(zip(row_ids, row_vals, strict=True))
    return out


def choose(logits: torch.Tensor, row: SamplerRow, greedy_id: int) -> int | None:
    """One row's token from its finite logits [V]; None when penalties or temperature push them out of range."""
    p, vocab = row.params, logits.shape[-1]
    if p.greedy and not p.uses_penalties:
        return greedy_id
    if p.greedy:  # a NaN or infinite maximum means no usable logit (grammar-masked ones are -inf)
        x = apply_penalties(logits, row)
        return int(torch.argmax(x)) if bool(torch.isfinite(x.max())) else None
    u = uniform(row.generator)
    counts = row.output_counts(vocab) if p.frequency_penalty or p.presence_penalty else None
    seen = row.seen(vocab) if p.repetition_penalty != 1.0 else None
    tok = fused.sample(logits, p.temperature, p.top_k, p.top_p, p.min_p, u, counts, seen, p.frequency_penalty,
                       p.presence_penalty, p.repetition_penalty)  # fmt: skip
    if tok is None:  # no kernel here
        x = apply_penalties(logits, row) if p.uses_penalties else logits
        return draw(filtered_probs(x, p), u)
    return tok if tok >= 0 else None


def sample(logits: torch.Tensor, rows: list[SamplerRow]) -> list[Sampled]:
    """logits [B, V] -> one Sampled per row: its token and, where asked, its logprobs dict; or its error."""
    logits = logits.float()
    greedy_ids, finite = fused.greedy(logits)  # one pass for the whole batch
    need_lp = any(r.params.logprobs is not None for r in rows)
    raw_lp = torch.log_softmax(logits, -1) if need_lp else None  # a finite row gives no NaN here (-inf may be)
    out: list[Sampled] = []
    for i, row in enumerate(rows):
        if not finite[i]:
            out.append(Sampled(None, error=NON_FINITE_LOGITS))
            continue
        x, greedy_id, masked = logits[i], greedy_ids[i], False  # masked: x is no longer the batch's (finite) row
        row_lp = raw_lp[i] if raw_lp is not None else None
        forced = row.thinking.next_forced() if row.thinking is not None else None
        if forced is not None:  # the thinking budget is spent: `</think>`'s tokens, whatever the logits say
            out.append(fed(row, forced, row_lp))
            continue
        if row.params.logit_bias:
            x, masked = row.biased(x), True
            greedy_id = int(torch.argmax(x))
        if row.params.allowed_token_ids is not None or row.bad_words:
            x, masked = row.restricted(x), True
            greedy_id = int(torch.argmax(x))
        if row.stop_ids and len(row.output_ids) < row.params.min_tokens:
            x, masked = row.without_stops(x), True
            greedy_id = int(torch.argmax(x))
        if row.grammar is not None and row.constrained:
            allowed = row.grammar.allowed(x.shape[-1])
            if row.grammar.error is not None or not bool(allowed.any()):
                why = f"{NO_ALLOWED_TOKEN}: {first_line(row.grammar.error or 'no token fits')}"
                out.append(Sampled(None, error=why, error_code=ErrorCode.GRAMMAR_DEAD_END))
                continue
            x, masked = x.masked_fill(~allowed, float("-inf")), True  # a new tensor: the batch's logits stay
            greedy_id = int(torch.argmax(x))
            if row_lp is not None and row.params.logprobs is not None:
                row_lp = torch.log_softmax(logits[i].masked_fill(~allowed, float("-inf")), -1)
        # every token masked (allowed_token_ids that min_tokens bans, say): greedy's argmax of -inf would be token 0,
        # a token the request did not allow
        if masked and not bool(torch.isfinite(x[greedy_id])):
            out.append(Sampled(None, error=NO_TOKEN_LEFT, error_code=ErrorCode.NO_TOKEN_LEFT))
            continue
        tok = choose(x, row, greedy_id)
        if tok is None:
            out.append(Sampled(None, error=INVALID_DISTRIBUTION))
            continue
        out.append(fed(row, tok, row_lp))
    return out


def fed(row: SamplerRow, tok: int, row_lp: torch.Tensor | None) -> Sampled:
    """A chosen token, fed to the row's thinking budget and grammar: the Sampled with its logprobs, or the grammar's
    dead end."""
    row.feed(tok)
    done = False
    if row.grammar is not None:
        if row.grammar.error is not None:  # the grammar has no way on from here: fail, never a "stop"
            why = f"{NO_ALLOWED_TOKEN}: {first_line(row.grammar.error)}"
            return Sampled(None, error=why, error_code=ErrorCode.GRAMMAR_DEAD_END)
        done = row.constrained and row.grammar.done
    k = row.params.logprobs
    lp = top_logprobs(row_lp, tok, k) if row_lp is not None and k is not None else None
    return Sampled(tok, lp, grammar_done=done)
