"""Granite 4.0 H as a wkvm model family: HF `GraniteMoeHybridForCausalLM` directories without experts (model_type
`granitemoehybrid`)."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Any

from wkvm.models.bamba import model as bamba
from wkvm.models.family import Checkpoint, CheckpointError, read_safetensors_dir, untie_head
from wkvm.models.granite_hybrid import gguf, model
from wkvm.models.granite_hybrid.model import GraniteHybrid, GraniteHybridConfig
from wkvm.models.llama.gguf_text import GGUFFamilyParts
from wkvm.models.mamba2.model import Mamba2Config
from wkvm.models.provider import WeightProvider


class GraniteHybridFamily(GGUFFamilyParts):
    name = model.FAMILY
    gguf_architecture, gguf_matrices = gguf.ARCHITECTURE, gguf.MATRICES  # its llama.cpp files
    model_types = ("granitemoehybrid",)
    formats = ("Granite 4.0 H (Mamba2 + attention, dense) as an HF directory (GraniteMoeHybridForCausalLM, "
               "*.safetensors) or a llama.cpp .gguf file (architecture granitehybrid)")

    def read_checkpoint(self, path: Path, fmt: str) -> Checkpoint:
        if fmt == "gguf":
            raw, config = gguf.read(path)
            return Checkpoint(raw, config, fmt)
        config = json.loads((path / "config.json").read_text())
        raw = read_safetensors_dir(path, lambda k: k if k.startswith("model.") or k == bamba.HEAD else None)
        untie_head(raw, bamba.HEAD, model.EMBED, bool(config.get("tie_word_embeddings")), path)
        return Checkpoint(raw, config, "hf")

    def config_from_checkpoint(self, ckpt: Checkpoint) -> GraniteHybridConfig:
        return GraniteHybridConfig.from_checkpoint(ckpt.raw, ckpt.config)

    def config_from_dict(self, d: dict[str, Any]) -> GraniteHybridConfig:
        names = {f.name for f in fields(GraniteHybridConfig)}
        d = {k: v for k, v in d.items() if k in names}
        return GraniteHybridConfig(**{**d, "layer_types": tuple(d["layer_types"]), "mamba": Mamba2Config(**d["mamba"])})

    used_tensors = staticmethod(model.used_tensors)
    global_keys = staticmethod(model.global_keys)
    linear_keys = staticmethod(bamba.linear_keys)  # the same compute tensors as Bamba's
    prepare_layer = staticmethod(model.prepare_layer)
    prepare_globals = staticmethod(model.prepare_globals)

    def layer_prefix(self, i: int) -> str:
        return f"{bamba.PREFIX}{i}."

    def build(self, cfg: GraniteHybridConfig, weights: WeightProvider, fingerprint: str,
              device: Any) -> GraniteHybrid:  # fmt: skip
        return GraniteHybrid(cfg, weights, fingerprint, device)

    def describe(self, cfg: GraniteHybridConfig) -> str:
        m = cfg.mamba
        return (f"Granite 4.0 H, {cfg.n_layer} layers ({len(cfg.attention_layers)} attention), width {cfg.n_embd}, "
                f"Mamba2 {m.n_heads} heads x {m.head_dim}, d_state {m.d_state}; attention {cfg.n_heads} query / "
                f"{cfg.n_kv_heads} key-value heads of {cfg.head_dim} ({'RoPE' if cfg.rope else 'no positions'}), "
                f"vocab {cfg.vocab_size}")  # fmt: skip

    def convert(self, src: Path, dst: Path) -> str:
        raise CheckpointError("wkvm does not convert Granite 4.0 H checkpoints: serve the HF directory or GGUF file "
                              "as it is")  # fmt: skip


FAMILY = GraniteHybridFamily()
