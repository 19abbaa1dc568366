"""The offline Python API: `LLM(model=path).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from wkvm.engine.detokenizer import Detokenizer
from wkvm.engine.sampler import SamplerRow, make_generator, sample
from wkvm.models.loader import load_model
from wkvm.models.spec import cat_states
from wkvm.outputs import GenerationOutput
from wkvm.sampling_params import SamplingParams
from wkvm.tokenizer import Tokenizer, load_tokenizer

Prompt = str | Sequence[int]


class LLM:
    def __init__(self, model: str | os.PathLike, tokenizer: str | os.PathLike | None = None, device: str = "cpu"):
        self.model = load_model(model, device=device)
        self.tokenizer: Tokenizer = load_tokenizer(tokenizer or model)

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise ValueError("empty prompt: give at least one token")
        bad = [t for t in ids if not 0 <= t < self.model.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the model's vocabulary (0..{self.model.vocab_size - 1})")
        return ids

    def generate(
        self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | None = None
    ) -> list[GenerationOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = sampling_params or SamplingParams()
        return self._generate_batch([self.encode_prompt(p) for p in prompts], params)

    @torch.inference_mode()
    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams) -> list[GenerationOutput]:
        outs = [GenerationOutput(prompt_token_ids=p, logprobs=[] if params.logprobs is not None else None)
                for p in prompts]  # fmt: skip
        rows = [SamplerRow(params, make_generator(params.seed), p) for p in prompts]
        detoks = [Detokenizer(self.tokenizer, params.stop) for _ in prompts]
        states, logits = [], []
        for p in prompts:
            lg, st = self.model.prefill(p)
            states.append(st)
            logits.append(lg)
        state, batch_logits = cat_states(states), torch.stack(logits)
        live = list(range(len(prompts)))
        while live:
            toks, lps = sample(batch_logits, [rows[i] for i in live])
            still = []
            for j, i in enumerate(live):
                if self._append(outs[i], rows[i], detoks[i], toks[j], lps[j], params):
                    still.append(j)
            if not still:
                break
            keep = torch.tensor(still)
            state = {k: v[keep] for k, v in state.items()}
            live = [live[j] for j in still]
            batch_logits = self.model.decode([toks[j] for j in still], state)
        for o, d in zip(outs, detoks, strict=True):
            d.flush()
            o.text = d.text
        return outs

    def _append(self, out, row, detok, tok, lp, params) -> bool:
        """Record one token; returns True while the sequence goes on."""
        out.token_ids.append(tok)
        row.output_ids.append(tok)
        if out.logprobs is not None and lp is not None:
            out.logprobs.append(lp)
        eos = self.tokenizer.eos_token_id
        if tok in params.stop_token_ids or (tok == eos and not params.ignore_eos) or detok.add(tok):
            out.finish_reason = "stop"
        elif len(out.token_ids) >= params.max_tokens:
            out.finish_reason = "length"
        return out.finish_reason is None
