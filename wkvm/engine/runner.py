"""ModelRunner: the only part of the engine that touches tensors.

It owns the model, the `SlotArena` of states and each request's sampler row. `run` feeds every scheduled request
its tokens in one sweep of the weights (requests fed the same number of tokens share a batch), captures prompt
states, scores the prompt tokens of requests asking for prompt logprobs (every position's logits, in that same
sweep), and for each request now caught up returns a sampled token, or an error that fails that request alone.
The engine above it keeps to bookkeeping (scheduling, stop conditions, events), so another device layout or a
tensor-parallel model changes this file only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from wkvm.config import EngineConfig
from wkvm.engine.arena import SlotArena
from wkvm.engine.grammar import GrammarCompiler
from wkvm.engine.kv_pages import PagedKV
from wkvm.engine.request import Request
from wkvm.engine.sampler import (
    NON_FINITE_LOGITS,
    GrammarGate,
    Sampled,
    SamplerRow,
    make_generator,
    prompt_token_logprobs,
    sample,
)
from wkvm.engine.thinking import END, SCAN, ThinkingBudget, ends_inside
from wkvm.models.family import LanguageModel
from wkvm.models.spec import State, StateSpec
from wkvm.tokenizer import Tokenizer


@dataclass
class StepOutput:
    """Per request caught up this step: its token and logprobs (none for prefill-only), or the error that ended it."""

    caught_up: list[tuple[Request, Sampled]]


def scores_prompt(r: Request) -> bool:
    """Whether this step's tokens score prompt tokens: position j's logits give token j + 1's prompt logprob."""
    return r.prompt_logprobs is not None and r.num_computed_tokens + 1 < len(r.prompt_ids)


def score_prompt(r: Request, logits: torch.Tensor) -> None:
    """Record the prompt logprobs the logits [n, V] of the tokens fed from `r.num_computed_tokens` on give."""
    assert r.prompt_logprobs is not None  # scores_prompt(r) held
    start = r.num_computed_tokens
    del r.prompt_logprobs[start + 1 :]  # a recomputed piece replaces what it scored before
    targets = r.prompt_ids[start + 1 : start + 1 + logits.shape[0]]
    r.prompt_logprobs += prompt_token_logprobs(logits, targets, r.params.prompt_logprobs or 0)


def kv_pages(spec: StateSpec, config: EngineConfig) -> int:
    """Pages of the KV pool `config.kv_cache_bytes` buys (0 for a model without attention layers)."""
    if not spec.has_kv:
        return 0
    values = sum(t.nbytes // t.torch_dtype.itemsize for t in spec.tensors if t.paged)  # a token's, all kv tensors
    per_token = values * config.kv_torch_dtype.itemsize
    pages = config.kv_cache_bytes // (config.kv_page_tokens * per_token)
    if pages < 1:
        need = config.kv_page_tokens * per_token
        raise ValueError(f"--kv-cache-bytes {config.kv_cache_bytes} is less than one KV page ({need} bytes)")
    return pages


class ModelRunner:
    def __init__(self, model: LanguageModel, config: EngineConfig, tokenizer: Tokenizer | None = None):
        self.model = model
        self.arena = SlotArena(model.spec, config.n_slots, config.device, kv_pages(model.spec, config),
                               config.kv_page_tokens, config.kv_torch_dtype)  # fmt: skip
        self._rows: dict[str, SamplerRow] = {}
        pool = self.arena.pool
        limits = [n for n in (model.context_length, pool.n_pages * pool.page_tokens if pool else None) if n]
        self.context_limit: int | None = min(limits) if limits else None  # tokens one sequence may hold
        self.grammars = GrammarCompiler(tokenizer) if tokenizer is not None else None
        self.eos_token_ids = sorted(tokenizer.eos_token_ids) if tokenizer is not None else []
        self.tokenizer = tokenizer
        # speculative decoding: draft tokens checked, accepted, and requests put back to where they stopped
        self.drafted = self.accepted = self.rewound = 0

    def add(self, req: Request) -> None:
        """Give a new request its sampler row (seeded generator, token context for penalties, grammar state).

        The row lives until the request finishes, across preemption and parking, so its grammar's parse does too.
        """
        p = req.params
        row = SamplerRow(p, make_generator(p.seed), req.prompt_ids, req.output_ids, req.base_ids)
        if p.min_tokens:
            eos = [] if p.ignore_eos else self.eos_token_ids
            row.stop_ids = [*eos, *p.stop_token_ids]
        if p.bad_words:
            if self.tokenizer is None:
                raise ValueError("bad_words needs the engine's tokenizer (ModelRunner was given none)")
            row.bad_words = bad_word_ids(self.tokenizer, p.bad_words)
        if p.thinking_token_budget is not None and not req.prefill_only:
            if self.tokenizer is None:
                raise ValueError("thinking_token_budget needs the engine's tokenizer (ModelRunner was given none)")
            tb = self.tokenizer.token_bytes
            end_ids = self.tokenizer.encode(p.thinking_budget_message + END)
            if any(t >= self.model.vocab_size for t in end_ids):  # a tokenizer larger than its model: never forced
                end_ids = []
            tail = req.prompt_ids[-SCAN:]  # the history's last tokens, without copying a long one whole
            if len(tail) < SCAN and req.base_ids:
                tail = req.base_ids[len(tail) - SCAN :] + tail
            inside = ends_inside(tail, tb)  # a thinking template opened the block
            row.thinking = ThinkingBudget.start(p.thinking_token_budget, end_ids, tb, inside)
        grammar = None if req.prefill_only else p.grammar()
        if grammar is not None:
            if self.grammars is None:
                raise ValueError("response_format needs the engine's tokenizer (ModelRunner was given none)")
            row.grammar = self.grammars.state(grammar)
            if p.grammar_after is not None:  # a thinking model's reasoning first (reasoning.py)
                assert self.tokenizer is not None  # the grammars need it too
                row.gate = GrammarGate(p.grammar_after.encode(), self.tokenizer.token_bytes, self.tokenizer.encode)
        self._rows[req.request_id] = row

    def generator_state(self, request_id: str) -> torch.Tensor | None:
        """Where a seeded request's generator is (to go on elsewhere); None for an unseeded one."""
        row = self._rows.get(request_id)
        return row.generator.get_state() if row is not None and row.generator is not None else None

    def resume(self, req: Request, generator: torch.Tensor | None) -> None:
        """A request begun in another engine (after `add`): its generator where it was, its grammar past its output."""
        row = self._rows[req.request_id]
        if generator is not None:
            if row.generator is None:
                raise ValueError("a generator state was given for a request without a seed")
            row.generator.set_state(generator)
        for t in req.output_ids if row.grammar is not None or row.thinking is not None else []:
            row.feed(t)

    def release(self, request_id: str) -> None:
        self._rows.pop(request_id, None)

    def run(self, work: list[tuple[Request, int]]) -> StepOutput:
        """Feed each (request, n) its next n tokens in one weight sweep; sample for the requests now caught up.

        A request with a draft (`Request.draft`: speculative decoding) is fed its pending token and the draft, and
        samples position by position while the draft agrees (`_check_draft`): one or more tokens."""
        for r, _ in work:
            r.speculated = r.before_draft = None
            if r.draft and r.slot is not None:
                r.speculated = r.num_computed_tokens
                r.before_draft = self.arena.fixed(r.slot) if self.arena.tensors else None
        reqs, logits, every = self._forward(work)
        checked: list[tuple[Request, Sampled]] = []
        for r, n in work:
            if r.draft:
                checked += self._check_draft(r, every[r.request_id])
                continue
            if r.request_id in every:
                score_prompt(r, every[r.request_id])
            r.num_computed_tokens += n
            r.check_invariant()
            slot = r.slot  # None when abort_all finished it while the model ran
            at_prompt_end = r.num_computed_tokens == len(r.prompt_ids) - 1
            if r.capture_prompt_state and r.prompt_state is None and at_prompt_end and slot is not None:
                r.prompt_state = self.arena.read(slot)  # all of the prompt but its last (pending) token
            if r.capture_at == r.num_computed_tokens and r.branch_state is None and slot is not None:
                r.branch_state = self.arena.read(slot)
        done = [i for i, r in enumerate(reqs) if r.gap == 0 and not r.draft]
        for r, _ in work:
            r.draft = []
        if not done:
            return StepOutput(checked)
        if len(done) < len(reqs):
            logits = logits[torch.tensor(done)]
        return StepOutput(self._sample([reqs[i] for i in done], logits) + checked)

    def _check_draft(self, r: Request, logits: torch.Tensor) -> list[tuple[Request, Sampled]]:
        """Sample `r` at each fed position (logits [1 + k, V]: after its pending token, then after each draft token)
        while the sample equals the draft's next token: the tokens it would have sampled one step at a time, as the
        row's generator, penalties and grammar go token by token. Then its state holds what it fed up to the first
        refused draft token: keys and values past it are dropped; a recurrent state that took a refused token goes
        back to before the step, and the accepted tokens are fed again next step (they are known: a catch-up)."""
        row, slot, k = self._rows.get(r.request_id), r.slot, len(r.draft)
        if row is None or slot is None or r.speculated is None:  # finished from another thread while the model ran
            r.num_computed_tokens += 1
            return []
        out: list[Sampled] = []
        accepted = 0
        try:
            for j in range(k + 1):
                s = sample(logits[j : j + 1], [row])[0]
                out.append(s)
                if j == k or s.token != r.draft[j] or s.grammar_done:
                    break
                r.output_ids.append(s.token)  # the next position's penalties, bad words and min_tokens see it
                accepted += 1
        finally:
            del r.output_ids[len(r.output_ids) - accepted :]
        self.drafted += k
        self.accepted += accepted
        # a draft accepted whole: the next may be longer; one refused: the next as long as what was accepted, plus one
        r.draft_room = k + 1 if accepted == k else accepted + 1
        if accepted < k and r.before_draft is not None:  # a recurrent state took refused tokens: back to before
            self.arena.restore_fixed(slot, r.before_draft)
            self.arena.drop_last(slot, 1 + k)
            r.before_draft = None  # the accepted tokens are fed again next step
        else:
            self.arena.drop_last(slot, k - accepted)
            r.num_computed_tokens += 1 + accepted  # past the tokens known until the engine appends these
        return [(r, s) for s in out]

    def rewind(self, r: Request) -> None:
        """A request that stopped inside its checked draft (a stop string, a completed grammar) holds tokens after its
        last one, or (a recurrent state put back after a refused draft, its accepted tokens not yet fed again) not
        all before it: make its state hold exactly its history but the pending last token, as a step-by-step run's.
        Raises OutOfPages where the tokens to feed find no KV page."""
        slot, keep = r.slot, r.num_tokens - 1
        if slot is None or r.num_computed_tokens == keep:
            return
        self.rewound += 1
        if r.num_computed_tokens > keep:
            if r.before_draft is None:  # keys and values only: forget the ones after
                self.arena.drop_last(slot, r.num_computed_tokens - keep)
                r.num_computed_tokens = keep
                return
            assert r.speculated is not None  # set with before_draft
            self.arena.restore_fixed(slot, r.before_draft)
            self.arena.drop_last(slot, r.num_computed_tokens - r.speculated)
            r.num_computed_tokens = r.speculated
        n = keep - r.num_computed_tokens  # fed as the steps would have fed them: the same bits
        self.arena.reserve(slot, n)  # pages just given back (or reserved for the step it missed): raises if none
        self._forward([(r, n)])
        r.num_computed_tokens = keep

    def _forward(self, work: list[tuple[Request, int]]) -> tuple[list[Request], torch.Tensor, dict[str, torch.Tensor]]:
        """One model call for the whole step; returns the requests in batch order, their last logits [B, V] and, by
        request id, the logits of every token fed [n, V] to the requests scoring their prompt or checking a draft."""
        by_length: dict[tuple[int, bool], list[Request]] = {}  # requests fed the same number of tokens batch
        for r, n in work:  # together: every decode (n = 1), and prompt pieces of equal length (e.g. full chunks)
            by_length.setdefault((n, scores_prompt(r) or bool(r.draft)), []).append(r)
        groups: list[tuple[torch.Tensor, State]] = []
        gathered: list[tuple[list[int], State]] = []
        caches: list[PagedKV] = []
        for (n, _), rs in by_length.items():
            slots = [r.slot for r in rs if r.slot is not None]  # every request fed this step holds a slot
            state, is_view = self.arena.view(slots)
            groups.append((torch.tensor([r.next_tokens(n) for r in rs]), state))
            if not is_view:
                gathered.append((slots, state))
            kv = self.arena.kv_batch(slots, n)  # pages reserved by the scheduler
            if kv is not None:
                caches.append(kv)
        # one sweep of the weights for the whole step; every position's logits for the groups that score or check
        every = [whole for _, whole in by_length]
        if caches:
            rows = self.model.forward_groups(groups, every, caches=caches)
        else:
            rows = self.model.forward_groups(groups, every)
        for slots, state in gathered:
            self.arena.scatter(slots, state)
        for kv in caches:
            kv.commit()
        reqs = [r for rs in by_length.values() for r in rs]
        scored: dict[str, torch.Tensor] = {}
        for ((_, whole), rs), x in zip(by_length.items(), rows, strict=True):
            if whole:
                scored.update((r.request_id, x[b]) for b, r in enumerate(rs))
        last = [x[:, -1] if whole else x for (_, whole), x in zip(by_length, rows, strict=True)]
        return reqs, last[0] if len(last) == 1 else torch.cat(last), scored

    def _sample(self, reqs: list[Request], logits: torch.Tensor) -> list[tuple[Request, Sampled]]:
        """A prefill-only request samples nothing but fails on non-finite logits; the rest go through the sampler."""
        out: list[tuple[Request, Sampled]] = []
        keep: list[tuple[int, SamplerRow]] = []
        for i, r in enumerate(reqs):
            row = self._rows.get(r.request_id)  # gone when abort_all finished the request while the model ran
            if r.prefill_only:
                finite = bool(torch.isfinite(logits[i]).all())
                out.append((r, Sampled(None, error=None if finite else NON_FINITE_LOGITS)))
            elif row is not None:
                keep.append((i, row))
        if keep:
            idx = [i for i, _ in keep]
            sub = logits if len(keep) == len(reqs) else logits[torch.tensor(idx)]
            out += zip([reqs[i] for i in idx], sample(sub, [row for _, row in keep]), strict=True)
        return out

    def read_state(self, slot: int) -> State:
        """A host copy of one slot's state (batch dim 1)."""
        return self.arena.read(slot)

    def write_state(self, slot: int, state: State) -> None:
        self.arena.write(slot, state)

    def request_state(self, req: Request) -> State:
        """A host copy of a request's current state, wherever it is: its slot, parked, its start state, or zeros."""
        if req.slot is not None:
            return self.arena.read(req.slot)
        if req.parked_state is not None:
            return {k: v.clone() for k, v in req.parked_state.items()}
        if req.initial_state is not None:
            return {k: v.clone() for k, v in req.initial_state.items()}
        return self.model.spec.zeros(1)


def bad_word_ids(tokenizer: Tokenizer, words: list[str]) -> list[list[int]]:
    """Each word's tokens as it would come after a space and at the start of a text (vLLM's two forms), distinct."""
    out: list[list[int]] = []
    for word in words:
        for form in (word.lstrip(), " " + word.lstrip()):
            ids = tokenizer.encode(form)
            if ids and ids not in out:
                out.append(ids)
    return out
