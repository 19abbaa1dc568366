"""LFM2 as a wkvm model family: HF `Lfm2ForCausalLM` directories (model_type `lfm2`)."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Any

from wkvm.models.family import Checkpoint, CheckpointError, read_safetensors_dir, untie_head
from wkvm.models.lfm2 import gguf, model
from wkvm.models.lfm2.model import Lfm2, Lfm2Config
from wkvm.models.llama.gguf_text import GGUFFamilyParts
from wkvm.models.provider import WeightProvider


class Lfm2Family(GGUFFamilyParts):
    name = model.FAMILY
    gguf_architecture, gguf_matrices = gguf.ARCHITECTURE, gguf.MATRICES  # its llama.cpp files
    model_types = ("lfm2",)
    formats = ("LFM2 (short convolutions + attention) as an HF directory (Lfm2ForCausalLM, *.safetensors) or a "
               "llama.cpp .gguf file (architecture lfm2)")

    def read_checkpoint(self, path: Path, fmt: str) -> Checkpoint:
        if fmt == "gguf":
            raw, config = gguf.read(path)
            return Checkpoint(raw, config, fmt)
        config = json.loads((path / "config.json").read_text())
        raw = read_safetensors_dir(path, lambda k: k if k.startswith("model.") or k == model.HEAD else None)
        # transformers' default ties the head; LiquidAI's own configs spell it `tie_embedding`
        tied = config.get("tie_word_embeddings", config.get("tie_embedding", True))
        untie_head(raw, model.HEAD, model.EMBED, bool(tied), path)
        return Checkpoint(raw, config, "hf")

    def config_from_checkpoint(self, ckpt: Checkpoint) -> Lfm2Config:
        return Lfm2Config.from_checkpoint(ckpt.raw, ckpt.config)

    def config_from_dict(self, d: dict[str, Any]) -> Lfm2Config:
        names = {f.name for f in fields(Lfm2Config)}
        d = {k: v for k, v in d.items() if k in names}
        return Lfm2Config(**{**d, "layer_types": tuple(d["layer_types"])})

    used_tensors = staticmethod(model.used_tensors)
    global_keys = staticmethod(model.global_keys)
    linear_keys = staticmethod(model.linear_keys)
    prepare_layer = staticmethod(model.prepare_layer)
    prepare_globals = staticmethod(model.prepare_globals)

    def layer_prefix(self, i: int) -> str:
        return f"{model.PREFIX}{i}."

    def build(self, cfg: Lfm2Config, weights: WeightProvider, fingerprint: str, device: Any) -> Lfm2:
        return Lfm2(cfg, weights, fingerprint, device)

    def describe(self, cfg: Lfm2Config) -> str:
        return (f"LFM2, {cfg.n_layer} layers ({len(cfg.attention_layers)} attention), width {cfg.n_embd}, short "
                f"convolutions of {cfg.conv_size} taps; attention {cfg.n_heads} query / {cfg.n_kv_heads} key-value "
                f"heads of {cfg.head_dim}, vocab {cfg.vocab_size}")  # fmt: skip

    def convert(self, src: Path, dst: Path) -> str:
        raise CheckpointError("wkvm does not convert LFM2 checkpoints: serve the HF directory or GGUF file as it is")


FAMILY = Lfm2Family()
