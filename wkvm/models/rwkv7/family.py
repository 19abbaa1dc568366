"""RWKV-7 as a wkvm model family: BlinkDL `.pth` and HF/fla checkpoints, World tokenizer and chat format."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from wkvm.chat_template import ChatTemplate
from wkvm.models.family import Checkpoint, ModelFamily, RawTensors
from wkvm.models.provider import Tensors, WeightProvider
from wkvm.models.rwkv7 import checkpoint, model
from wkvm.models.rwkv7.model import RWKV7, RWKV7Config
from wkvm.tokenizer import Tokenizer


class RWKV7Family:
    name = model.FAMILY
    model_types: tuple[str, ...] = checkpoint.HF_MODEL_TYPES
    formats = "RWKV-7 as a BlinkDL .pth file or an HF/fla directory"

    def detect(self, path: Path) -> str | None:
        return checkpoint.detect_pth(path)

    def read_checkpoint(self, path: Path, fmt: str) -> Checkpoint:
        raw, config, fmt = checkpoint.read_checkpoint(path, fmt)
        return Checkpoint(raw, config, fmt)

    def config_from_checkpoint(self, ckpt: Checkpoint) -> RWKV7Config:
        return RWKV7Config.from_tensors(ckpt.raw, ckpt.config if ckpt.format != checkpoint.PTH_FORMAT else None)

    def config_from_dict(self, d: dict[str, Any]) -> RWKV7Config:
        return RWKV7Config(**d)

    used_tensors = staticmethod(model.used_tensors)

    def global_keys(self, cfg: RWKV7Config) -> tuple[str, ...]:
        return model.GLOBAL_KEYS

    def layer_prefix(self, i: int) -> str:
        return f"blocks.{i}."

    def linear_keys(self, cfg: RWKV7Config, i: int) -> tuple[str, ...]:
        return model.LINEAR_KEYS

    prepare_layer = staticmethod(model.prepare_layer)

    def prepare_globals(
        self, raw: RawTensors, cfg: RWKV7Config, dtype: torch.dtype, device: torch.device | str
    ) -> Tensors:
        return model.prepare_globals(raw, dtype, device)

    def build(self, cfg: RWKV7Config, weights: WeightProvider, fingerprint: str, device: torch.device | str) -> RWKV7:
        return RWKV7(cfg, weights, fingerprint, device)

    def describe(self, cfg: RWKV7Config) -> str:
        return f"RWKV-7, {cfg.n_layer} layers, width {cfg.n_embd}, {cfg.n_head} heads, vocab {cfg.vocab_size}"

    def convert(self, src: Path, dst: Path) -> str:
        return checkpoint.convert(src, dst)

    def default_tokenizer(self, path: Path) -> Tokenizer | None:
        from wkvm.models.rwkv7.tokenizer import WorldTokenizer

        return WorldTokenizer()

    def default_chat_template(self, path: Path) -> ChatTemplate | None:
        from wkvm.models.rwkv7.chat_format import WorldTemplate

        return WorldTemplate()

    def native_dtype(self, path: Path, fmt: str) -> str:
        return "float32"  # float checkpoints only


FAMILY = RWKV7Family()
_check: ModelFamily = FAMILY  # mypy proves RWKV7Family satisfies the protocol
