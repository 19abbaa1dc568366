"""The sampler: grammar masks, penalties, greedy/temperature/top-k/top-p/min-p, per-request seeds, top-k logprobs.

Logprobs are those of the model's raw distribution (before grammar mask, penalties and temperature), as in vLLM.
Rows are independent: a row whose logits or distribution are not finite gets an error instead of a token, and
every other row samples exactly as it would have without it (multinomial never sees an invalid distribution).
A constrained row (one with a `GrammarState`) masks its own logits to the tokens its grammar allows; the batch's
logits are never changed in place, so free rows in the same batch sample exactly as without it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from wkvm.engine.grammar import GrammarState
from wkvm.models import fused
from wkvm.outputs import ErrorCode
from wkvm.sampling_params import SamplingParams

NON_FINITE_LOGITS = (
    "the model produced non-finite logits (NaN or infinity) for this request; its state holds values out of range"
)
INVALID_DISTRIBUTION = (
    "sampling this request produced an invalid distribution (NaN, infinity or all zero); "
    "its logits or sampling parameters are out of range"
)
NO_ALLOWED_TOKEN = "the response_format grammar allows no token here"


@dataclass
class SamplerRow:
    params: SamplingParams
    generator: torch.Generator | None = None
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    base_ids: list[int] = field(default_factory=list)  # tokens already inside a resumed state: context too
    grammar: GrammarState | None = None  # the response_format's parse so far (None: free text)
    _context: set[int] | None = field(default=None, init=False, repr=False)

    def context_seen(self) -> set[int]:
        """Distinct tokens before the output (state and prompt), for the repetition penalty; built on first use."""
        if self._context is None:
            self._context = set(self.base_ids).union(self.prompt_ids)
        return self._context


@dataclass
class Sampled:
    """One row's outcome: a token (with its logprobs when asked), or the error that kept it from sampling."""

    token: int | None
    logprobs: dict[int, float] | None = None
    error: str | None = None
    error_code: str = ErrorCode.NON_FINITE  # with `error`: which kind
    grammar_done: bool = False  # this token completed the response_format's value: the reply ends here


def make_generator(seed: int | None) -> torch.Generator | None:
    return None if seed is None else torch.Generator().manual_seed(seed)


def apply_penalties(logits: torch.Tensor, row: SamplerRow) -> torch.Tensor:
    p = row.params
    if p.frequency_penalty or p.presence_penalty:
        out = torch.as_tensor(row.output_ids, dtype=torch.long)
        counts = torch.bincount(out, minlength=logits.shape[-1])[: logits.shape[-1]].to(logits.dtype)
        logits = logits - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(logits.dtype)
    if p.repetition_penalty != 1.0:
        seen = torch.as_tensor(sorted(row.context_seen().union(row.output_ids)), dtype=torch.long)
        seen = seen[seen < logits.shape[-1]]
        vals = logits[seen]
        logits = logits.clone()
        logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    return logits


def filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p filters; returns a normalized distribution."""
    x = logits / p.temperature
    if 0 < p.top_k < x.shape[-1]:
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, -1)
    if p.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        drop = (sorted_p.cumsum(-1) - sorted_p) > p.top_p  # keep the smallest set reaching top_p
        probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs / probs.sum()


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


def valid_distribution(probs: torch.Tensor) -> bool:
    """Finite, non-negative and not all zero: what torch.multinomial needs."""
    total = probs.sum()
    return bool(torch.isfinite(total) & (total > 0) & (probs >= 0).all())  # one device sync, not three


def choose(logits: torch.Tensor, row: SamplerRow, greedy_id: int) -> int | None:
    """One row's token from its finite logits [V]; None when penalties or temperature push them out of range."""
    p = row.params
    if p.greedy and not p.uses_penalties:
        return greedy_id
    x = apply_penalties(logits, row) if p.uses_penalties else logits
    if p.greedy:  # a NaN or infinite maximum means no usable logit (grammar-masked ones are -inf)
        return int(torch.argmax(x)) if bool(torch.isfinite(x.max())) else None
    probs = filtered_probs(x, p)
    if not valid_distribution(probs):
        return None
    return int(torch.multinomial(probs, 1, generator=row.generator))


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
        x, greedy_id = logits[i], greedy_ids[i]
        if row.grammar is not None:
            allowed = row.grammar.allowed(x.shape[-1])
            if row.grammar.error is not None or not bool(allowed.any()):
                why = f"{NO_ALLOWED_TOKEN}: {row.grammar.error or 'no token fits'}"
                out.append(Sampled(None, error=why, error_code=ErrorCode.GRAMMAR_DEAD_END))
                continue
            x = x.masked_fill(~allowed, float("-inf"))  # a new tensor: the batch's logits stay as they were
            greedy_id = int(torch.argmax(x))
        tok = choose(x, row, greedy_id)
        if tok is None:
            out.append(Sampled(None, error=INVALID_DISTRIBUTION))
            continue
        done = False
        if row.grammar is not None:
            row.grammar.accept(tok)
            if row.grammar.error is not None:  # the grammar has no way on from here: fail, never a "stop"
                why = f"{NO_ALLOWED_TOKEN}: {row.grammar.error}"
                out.append(Sampled(None, error=why, error_code=ErrorCode.GRAMMAR_DEAD_END))
                continue
            done = row.grammar.done
        k = row.params.logprobs
        lp = top_logprobs(raw_lp[i], tok, k) if raw_lp is not None and k is not None else None
        out.append(Sampled(tok, lp, grammar_done=done))
    return out
