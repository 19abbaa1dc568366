"""Mamba2 as a wkvm model family: HF `Mamba2ForCausalLM` directories and the original state-spaces layout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from wkvm.chat_template import ChatTemplate
from wkvm.models.family import Checkpoint, CheckpointError, RawTensors
from wkvm.models.mamba2 import checkpoint, model
from wkvm.models.mamba2.model import Mamba2, Mamba2Config
from wkvm.models.provider import WeightProvider
from wkvm.tokenizer import Tokenizer


class Mamba2Family:
    name = model.FAMILY
    model_types = checkpoint.HF_MODEL_TYPES
    formats = "Mamba2 as an HF Mamba2ForCausalLM directory or a state-spaces (mamba_ssm) directory"

    def detect(self, path: Path) -> str | None:
        return checkpoint.detect_state_spaces(path)

    def read_checkpoint(self, path: Path, fmt: str) -> Checkpoint:
        raw, config = checkpoint.read_checkpoint(path, fmt)
        return Checkpoint(raw, config, fmt)

    def config_from_checkpoint(self, ckpt: Checkpoint) -> Mamba2Config:
        return Mamba2Config.from_tensors(ckpt.raw, ckpt.config)

    def config_from_dict(self, d: dict[str, Any]) -> Mamba2Config:
        return Mamba2Config(**d)

    def used_tensors(self, raw: RawTensors) -> RawTensors:
        return dict(raw)  # the readers drop a tied head: the embedding is counted once

    global_keys = staticmethod(model.global_keys)

    def layer_prefix(self, i: int) -> str:
        return f"{model.PREFIX}{i}."

    def linear_keys(self, cfg: Mamba2Config, i: int) -> tuple[str, ...]:
        return model.LINEAR_KEYS

    prepare_layer = staticmethod(model.prepare_layer)
    prepare_globals = staticmethod(model.prepare_globals)

    def build(self, cfg: Mamba2Config, weights: WeightProvider, fingerprint: str, device: torch.device | str) -> Mamba2:
        return Mamba2(cfg, weights, fingerprint, device)

    def describe(self, cfg: Mamba2Config) -> str:
        return (f"Mamba2, {cfg.n_layer} layers, width {cfg.d_model}, {cfg.n_heads} heads x {cfg.head_dim}, "
                f"d_state {cfg.d_state}, {cfg.n_groups} groups, vocab {cfg.vocab_size}")  # fmt: skip

    def convert(self, src: Path, dst: Path) -> str:
        fmt = checkpoint.detect_state_spaces(src) or checkpoint.HF_FORMAT
        if fmt == checkpoint.HF_FORMAT and not (src / "config.json").is_file():
            raise CheckpointError(f"{src}: not a Mamba2 checkpoint directory")
        return checkpoint.convert(src, dst, fmt)

    def default_tokenizer(self, path: Path) -> Tokenizer | None:
        return None  # HF and state-spaces checkpoints ship (or name) a tokenizer.json

    def default_chat_template(self, path: Path) -> ChatTemplate | None:
        return None

    def native_dtype(self, path: Path, fmt: str) -> str:
        return "float32"  # float checkpoints only


FAMILY = Mamba2Family()
