"""The offline Python API: `LLM(model=path).generate(prompts, SamplingParams(...))`, batched by the engine.

It follows vLLM's offline API where wkvm has the feature: `generate` takes a str, token ids, `{"prompt": str}` or
`{"prompt_token_ids": [...]}` (one or a list), `chat` renders messages with the model's chat template, and
`get_tokenizer` returns the tokenizer. What differs is listed in README.md ("Python API").
"""

from __future__ import annotations

import dataclasses
import operator
import os
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from wkvm.chat_template import ChatTemplate, plain_messages
from wkvm.config import GENERATION_CONFIGS, EngineConfig, default_model, kv_dtype_for, kv_dtype_name
from wkvm.engine.engine import Engine
from wkvm.engine.handle import RequestHandle
from wkvm.outputs import GenerationOutput
from wkvm.sampling_params import MAX_STOP_STRINGS, SamplingParams, model_sampling_defaults
from wkvm.tokenizer import Tokenizer
from wkvm.weights.loader import load_model, load_text_tools, resolved_dtype

if TYPE_CHECKING:
    import torch

Prompt = str | Sequence[int] | Mapping[str, Any]
Messages = list[dict[str, Any]]


class LLM:
    def __init__(
        self,
        model: str | os.PathLike[str] | None = None,
        tokenizer: str | os.PathLike[str] | None = None,
        config: EngineConfig | None = None,
        weight_cache_layers: int = 0,
        read_ahead: bool = True,
        dtype: str | torch.dtype = "float32",
        generation_config: str = "auto",
        **config_kwargs: Any,
    ):
        """`model`: a path (a BlinkDL .pth, an HF/fla directory, a GGUF file, a weight pack), by default the embedded
        model. `weight_cache_layers` > 0 streams a weight pack's layers from disk through a cache of that many;
        `dtype` (a name in any case, or a torch dtype): "float32" is exact against the reference; "bfloat16" stores
        the large matrices in bf16 (half the memory; arithmetic stays fp32); "int8", "int4" (wkvm's kernels); "auto"
        keeps a GGUF file's own precision (Q4_0 / Q4_1 layers: int4, other quantized types: int8) and is float32 for
        every other checkpoint and for weight packs (`loader.auto_dtype`; until session 46 it meant float32).
        `generation_config` "auto": `generate` / `chat` without sampling_params sample with the model's
        generation_config.json values (vLLM's default; `get_default_sampling_params`); "none" or "vllm": with
        SamplingParams' own. Other keyword arguments are EngineConfig's fields; `kv_dtype` also takes "auto" (the
        default without `config`, as `wkvm serve`): float32 pages for float32 weights, float16 for rounded ones."""
        if generation_config not in GENERATION_CONFIGS:
            raise ValueError(f"generation_config must be one of {GENERATION_CONFIGS}, not {generation_config!r}")
        fields = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(config_kwargs) - fields)
        if unknown:
            raise TypeError(f"LLM() got an unexpected keyword argument {unknown[0]!r}: it takes model, tokenizer, "
                            "config, weight_cache_layers, read_ahead, dtype, generation_config and EngineConfig's "
                            "fields "
                            f"({', '.join(sorted(fields))})")  # fmt: skip
        model = default_model() if model is None else model
        dtype = resolved_dtype(dtype, model, config_kwargs.get("device", (config or EngineConfig()).device))
        kv = kv_dtype_name(config_kwargs.get("kv_dtype", "auto" if config is None else config.kv_dtype))
        config = replace(config or EngineConfig(), **{**config_kwargs, "kv_dtype": kv_dtype_for(kv, dtype)})
        if tokenizer is not None and not (Path(tokenizer).is_file() or (Path(tokenizer) / "tokenizer.json").is_file()):
            # the model family's default had stood in silently (an RWKV-7 model's World vocabulary: garbage text)
            raise ValueError(f"tokenizer {str(tokenizer)!r}: no such file, nor a directory with a tokenizer.json "
                             "(wkvm reads tokenizers from disk only; it never downloads)")  # fmt: skip
        self.model = load_model(model, device=config.device, dtype=dtype,
                                weight_cache_layers=weight_cache_layers, read_ahead=read_ahead)  # fmt: skip
        tools = load_text_tools(tokenizer or model, self.model.family)
        self.tokenizer: Tokenizer = tools[0]
        self.template: ChatTemplate = tools[1]
        self.engine = Engine(self.model, self.tokenizer, replace(config, max_queue=1 << 30))
        self.sampling_defaults = model_sampling_defaults(model) if generation_config == "auto" else {}

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` sample with when given no sampling_params: SamplingParams' defaults with the
        model's generation_config.json values (temperature, top_p, top_k, min_p, repetition_penalty), as vLLM's."""
        return SamplingParams(**self.sampling_defaults)

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, Mapping):  # vLLM's TextPrompt / TokensPrompt
            other = sorted(set(prompt) - {"prompt", "prompt_token_ids", "cache_salt"})  # cache_salt: no shared cache
            if other:  # multi_modal_data had been dropped without a word, the text run alone
                raise ValueError(f"a prompt dict's {other[0]!r} is not supported (only 'prompt', 'prompt_token_ids' "
                                 "and 'cache_salt'; wkvm serves text)")  # fmt: skip
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
                if isinstance(prompt, str | bytes | Mapping):  # a text there had been run as the text prompt
                    raise TypeError("a prompt dict's 'prompt_token_ids' is a list of ints, not "
                                    f"{type(prompt).__name__}")  # fmt: skip
            elif isinstance(prompt.get("prompt"), str):
                prompt = prompt["prompt"]
            else:
                raise TypeError("a prompt dict has 'prompt' (a str) or 'prompt_token_ids' (a list of ints)")
        token_ids = None if isinstance(prompt, str | bytes | Mapping) else token_list(prompt)
        if isinstance(prompt, str):
            ids = self.tokenizer.encode_prompt(prompt)
        elif token_ids is not None:
            ids = token_ids
        else:
            raise TypeError("a prompt is a str, a list of token ids, {'prompt': str} or {'prompt_token_ids': [...]}, "
                            f"not {type(prompt).__name__}")  # fmt: skip
        if not ids:
            raise ValueError("empty prompt: give at least one token")
        bad = [t for t in ids if not 0 <= t < self.model.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the model's vocabulary (0..{self.model.vocab_size - 1})")
        return ids

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        priority: int | Sequence[int] = 0,
    ) -> list[GenerationOutput]:
        """Run every prompt through the engine's continuous batching; outputs in prompt order. `use_tqdm` is accepted
        for vLLM's code and shows nothing; `priority` (one, or one per prompt): lower runs first, as vLLM's."""
        if prompts is None or not (isinstance(prompts, str | Mapping) or hasattr(prompts, "__iter__")):
            raise TypeError("prompts are a str, a list of token ids, {'prompt': str} or {'prompt_token_ids': [...]}, "
                            f"or a list of those; not {type(prompts).__name__}")  # fmt: skip
        one = isinstance(prompts, str | Mapping) or (hasattr(prompts, "__len__") and len(prompts) > 0
                                                      and token_id(prompts[0]) is not None)  # fmt: skip
        batch: list[Prompt] = [prompts] if one else list(prompts)  # type: ignore[list-item,arg-type]
        encoded = [self.encode_prompt(p) for p in batch]
        params = self._per_prompt(sampling_params, len(encoded))
        priorities = [priority] * len(encoded) if isinstance(priority, int) else list(priority)
        if not all(isinstance(p, int) and not isinstance(p, bool) for p in priorities):  # "x" had been ['x']
            raise TypeError(f"priority is an int or a list of ints (one per prompt), not {priority!r}")
        if len(priorities) != len(encoded):
            raise ValueError(f"{len(priorities)} priorities for {len(encoded)} prompts")
        grammars = self.engine.runner.grammars
        for p in params:  # a grammar this vocabulary cannot start is refused here, not answered "error" later
            grammar = p.grammar()
            problem = grammars.problem(grammar) if grammar is not None and grammars is not None else None
            if problem is not None:
                raise ValueError(f"structured_outputs cannot be enforced with this model's vocabulary: {problem}")
        for p in params:  # every prompt's ids before any is queued (Engine.submit checks them too)
            p.check_vocabulary(self.model.vocab_size)
        handles: list[RequestHandle] = []
        try:
            for ids, p, pr in zip(encoded, params, priorities, strict=True):
                handles.append(self.engine.submit(ids, p, priority=pr))
            self.engine.run_until_done()
        except BaseException:  # none of this call's prompts is left queued to run inside the next call (Ctrl-C while
            for h in handles:  # they ran had left them all to run first in the next call)
                h.cancel()
            self.engine.run_until_done()
            raise
        outputs = []
        for prompt, h in zip(batch, handles, strict=True):
            text = prompt if isinstance(prompt, str) else prompt.get("prompt") if isinstance(prompt, Mapping) else None
            outputs.append(replace(h.output, prompt=text if isinstance(text, str) else None, request_id=h.request_id))
        return outputs

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[GenerationOutput]:
        """vLLM's LLM.chat: each conversation rendered with the model's chat template (or `chat_template`, Jinja
        source; `chat_template_kwargs`: more variables for it, e.g. `enable_thinking`), answered as by
        /v1/chat/completions: the template's stop strings end the answer (unless `ignore_eos`)."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        # a str had failed on .get deep in the template
        if not all(isinstance(c, Sequence) and not isinstance(c, str) and all(isinstance(m, Mapping) for m in c)
                   for c in conversations):  # fmt: skip
            raise TypeError("messages is a list of {'role': ..., 'content': ...} dicts, or a list of such lists (one "
                            "conversation each)")  # fmt: skip
        template = (self.template if chat_template is None
                    else replace(self.template, source=chat_template, tool_source=None))  # fmt: skip
        texts = [template.render(plain_messages(list(c)), add_generation_prompt,  # type: ignore[arg-type]
                                 variables=chat_template_kwargs) for c in conversations]  # fmt: skip
        prompts = [self.tokenizer.encode(t) for t in texts]  # a template writes its own BOS, as the server's
        given = self._per_prompt(sampling_params, len(prompts))
        outputs = self.generate(prompts, [self._with_template_stops(p, template) for p in given], use_tqdm=use_tqdm)
        # stop_reason names only the caller's own stops: the template's end of turn is vLLM's EOS (None), as the
        # server answers
        return [replace(o, prompt=t, stop_reason=o.stop_reason if o.stop_reason in [*p.stop, *p.stop_token_ids]
                        else None) for o, t, p in zip(outputs, texts, given, strict=True)]  # fmt: skip

    def _per_prompt(self, sampling_params: object, n: int) -> list[SamplingParams]:
        """One SamplingParams per prompt, each checked again: a field set after it was made (`sp.max_tokens = None`,
        `sp.temperature = -1`) had failed the whole batch deep in the engine, or a `stop` string run letter by letter
        (offline API hunt, session 49)."""
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.get_default_sampling_params()] * n
        elif not isinstance(sampling_params, Sequence) or not all(isinstance(p, SamplingParams)
                                                                  for p in sampling_params):  # fmt: skip
            raise TypeError("sampling_params is a SamplingParams or a list of them (one per prompt), not "
                            f"{type(sampling_params).__name__}")  # fmt: skip
        elif len(sampling_params) != n:
            raise ValueError(f"{len(sampling_params)} sampling params for {n} prompts")
        else:
            params = list(sampling_params)
        for p in {id(p): p for p in params}.values():
            p.__post_init__()  # InvalidParam (a ValueError) naming the field
        return params

    def _with_template_stops(self, params: SamplingParams, template: ChatTemplate) -> SamplingParams:
        """The template's stop strings, as the server adds them: a special token's as a stop token id."""
        if params.ignore_eos or not template.stop:
            return params
        stop, stop_ids = list(params.stop), list(params.stop_token_ids)
        for s in template.stop:
            ids = self.tokenizer.encode(s)
            if len(ids) == 1 and ids[0] in self.tokenizer.special_ids and ids[0] >= self.model.vocab_size:
                continue  # a token beyond the model's rows is never generated (a tokenizer larger than its model)
            if len(ids) == 1 and ids[0] in self.tokenizer.special_ids:
                stop_ids += [] if ids[0] in stop_ids else ids
            elif len(stop) < MAX_STOP_STRINGS and s not in stop:  # as the server: 4 given had been an InvalidParam
                stop.append(s)
        return replace(params, stop=stop, stop_token_ids=stop_ids)


def token_id(x: object) -> int | None:
    """`x` as a token id: an int, or an integer scalar of numpy or torch (their __index__); else None."""
    if isinstance(x, str | bytes | float):
        return None
    try:
        return operator.index(x)  # type: ignore[arg-type]
    except TypeError:
        return None


def token_list(prompt: object) -> list[int] | None:
    """A prompt of token ids (a list, tuple, 1-D numpy array or torch tensor of integers) as ints; else None. numpy
    ids had been refused with "a prompt is a str, a list of token ids ...", which a list of them reads as."""
    try:
        items = list(prompt)  # type: ignore[call-overload]
    except TypeError:
        return None
    ids = [token_id(t) for t in items]
    return None if any(t is None for t in ids) else ids  # type: ignore[return-value]
