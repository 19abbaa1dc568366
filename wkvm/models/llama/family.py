"""Llama as a wkvm model family: HF `LlamaForCausalLM` directories and llama.cpp GGUF files (architecture llama).
An HF directory brings its tokenizer.json; a GGUF file carries its own (`gguf_text`)."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from wkvm.chat_template import ChatTemplate
from wkvm.models.family import Checkpoint
from wkvm.models.llama import checkpoint, gguf_file, model
from wkvm.models.llama.gguf_text import gguf_chat_template, gguf_tokenizer
from wkvm.models.llama.model import Llama, LlamaConfig
from wkvm.models.provider import WeightProvider
from wkvm.tokenizer import Tokenizer


class LlamaFamily:
    name = model.FAMILY
    model_types = checkpoint.HF_MODEL_TYPES
    formats = ("Llama as an HF directory (LlamaForCausalLM) or a llama.cpp .gguf file (F32/F16/BF16/Q8_0/Q4_0/Q4_1/"
               "K-quants)")

    def detect(self, path: Path) -> str | None:
        return checkpoint.detect(path)

    def read_checkpoint(self, path: Path, fmt: str) -> Checkpoint:
        raw, config = checkpoint.read(path, fmt)
        return Checkpoint(raw, config, fmt)

    def config_from_checkpoint(self, ckpt: Checkpoint) -> LlamaConfig:
        return LlamaConfig.from_hf(ckpt.raw, ckpt.config)

    def config_from_dict(self, d: dict[str, Any]) -> LlamaConfig:
        names = {f.name for f in fields(LlamaConfig)}
        return LlamaConfig(**{k: v for k, v in d.items() if k in names})

    used_tensors = staticmethod(model.used_tensors)
    global_keys = staticmethod(model.global_keys)

    def layer_prefix(self, i: int) -> str:
        return f"model.layers.{i}."

    def linear_keys(self, cfg: LlamaConfig, i: int) -> tuple[str, ...]:
        return model.LINEAR

    prepare_layer = staticmethod(model.prepare_layer)
    prepare_globals = staticmethod(model.prepare_globals)

    def build(self, cfg: LlamaConfig, weights: WeightProvider, fingerprint: str, device: torch.device | str) -> Llama:
        return Llama(cfg, weights, fingerprint, device)

    def describe(self, cfg: LlamaConfig) -> str:
        rope = f"RoPE {cfg.rope_type} theta {cfg.rope_theta:g}" + (
            f" x{cfg.rope_factor:g}" if cfg.rope_type != "default" else ""
        )
        return (
            f"Llama, {cfg.n_layer} layers, width {cfg.n_embd}, {cfg.n_heads} query / {cfg.n_kv_heads} key-value "
            f"heads of {cfg.head_dim}, MLP {cfg.ffn_size}, {rope}, vocab {cfg.vocab_size}"
            + (", tied head" if cfg.tied_head else "")
        )

    def convert(self, src: Path, dst: Path) -> str:
        return checkpoint.convert(src, dst)

    def default_tokenizer(self, path: Path) -> Tokenizer | None:
        return gguf_tokenizer(path) if checkpoint.detect(path) == checkpoint.GGUF_FORMAT else None

    def default_chat_template(self, path: Path) -> ChatTemplate | None:
        return gguf_chat_template(path) if checkpoint.detect(path) == checkpoint.GGUF_FORMAT else None

    def native_dtype(self, path: Path, fmt: str) -> str:
        return gguf_file.native_dtype(path) if fmt == checkpoint.GGUF_FORMAT else "float32"


FAMILY = LlamaFamily()
