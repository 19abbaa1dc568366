"""Qwen3.5 text (Gated DeltaNet layers) as a wkvm model family: HF directories of Qwen3.5 (text or multimodal)
and Qwen3-Next with dense MLPs. Tokenizer and chat template come from the checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from wkvm.chat_template import ChatTemplate
from wkvm.models.family import Checkpoint, RawTensors, only
from wkvm.models.provider import WeightProvider
from wkvm.models.qwen3_5 import checkpoint, model
from wkvm.models.qwen3_5.model import Qwen35, Qwen35Config
from wkvm.tokenizer import Tokenizer


class Qwen35Family:
    name = model.FAMILY
    model_types = checkpoint.HF_MODEL_TYPES
    formats = "Qwen3.5 (text, or the text part of a multimodal checkpoint) or dense Qwen3-Next as an HF directory"

    def detect(self, path: Path) -> str | None:
        return None  # HF directories only: the registry matches them by model_type

    def read_checkpoint(self, path: Path, fmt: str) -> Checkpoint:
        raw, config = checkpoint.read_hf(path)
        return Checkpoint(raw, config, checkpoint.HF_FORMAT)

    def config_from_checkpoint(self, ckpt: Checkpoint) -> Qwen35Config:
        return Qwen35Config.from_checkpoint(ckpt.raw, ckpt.config)

    def config_from_dict(self, d: dict[str, Any]) -> Qwen35Config:
        return Qwen35Config(**{**d, "layer_types": tuple(d["layer_types"])})

    def used_tensors(self, raw: RawTensors) -> RawTensors:
        n_layer = 1 + max((int(k.split(".")[2]) for k in raw if k.startswith("model.layers.")), default=-1)
        keep = {model.EMBED, model.FINAL_NORM, model.HEAD}
        for i in range(n_layer):
            names = model.GDN_RAW + model.ATTN_RAW + model.MLP_RAW + model.NORM_RAW
            keep.update(f"model.layers.{i}.{k}" for k in names)
        return only(raw, keep)

    global_keys = staticmethod(model.global_keys)

    def layer_prefix(self, i: int) -> str:
        return f"model.layers.{i}."

    def linear_keys(self, cfg: Qwen35Config, i: int) -> tuple[str, ...]:
        return model.linear_keys(cfg, i)

    prepare_layer = staticmethod(model.prepare_layer)
    prepare_globals = staticmethod(model.prepare_globals)

    def build(self, cfg: Qwen35Config, weights: WeightProvider, fingerprint: str, device: torch.device | str) -> Qwen35:
        return Qwen35(cfg, weights, fingerprint, device)

    def describe(self, cfg: Qwen35Config) -> str:
        n_attn = len(cfg.attention_layers)
        attn = (f", {n_attn} gated attention layers ({cfg.n_heads} query / {cfg.n_kv_heads} key-value heads of "
                f"{cfg.head_dim}, RoPE on {cfg.rotary_dim})" if n_attn else "")  # fmt: skip
        return (
            f"Qwen3.5 ({'hybrid' if n_attn else 'Gated DeltaNet'}), {cfg.n_layer} layers, width {cfg.n_embd}, "
            f"{cfg.n_k_heads} key / {cfg.n_v_heads} value heads of {cfg.k_head_dim}/{cfg.v_head_dim}{attn}, "
            f"vocab {cfg.vocab_size}"
        )

    def convert(self, src: Path, dst: Path) -> str:
        return checkpoint.convert(src, dst)

    def default_tokenizer(self, path: Path) -> Tokenizer | None:
        return None

    def default_chat_template(self, path: Path) -> ChatTemplate | None:
        return None

    def native_dtype(self, path: Path, fmt: str) -> str:
        return "float32"  # float checkpoints only


FAMILY = Qwen35Family()
