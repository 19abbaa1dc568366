"""Nemotron-H as a wkvm model family: HF `NemotronHForCausalLM` directories without experts (model_type
`nemotron_h`)."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Any

from wkvm.models.bamba.model import MAMBA, PREFIX
from wkvm.models.family import Checkpoint, CheckpointError, read_safetensors_dir, untie_head
from wkvm.models.llama.gguf_text import GGUFFamilyParts
from wkvm.models.mamba2.model import Mamba2Config
from wkvm.models.nemotron_h import gguf, model
from wkvm.models.nemotron_h.model import NemotronH, NemotronHConfig
from wkvm.models.provider import WeightProvider


def hf_name(name: str) -> str | None:
    """transformers 5's name of a checkpoint tensor (the released checkpoints' `backbone.` is its `model.`)."""
    name = "model." + name.removeprefix("backbone.") if name.startswith("backbone.") else name
    return name if name.startswith("model.") or name == model.HEAD else None


class NemotronHFamily(GGUFFamilyParts):
    name = model.FAMILY
    gguf_architecture, gguf_matrices = gguf.ARCHITECTURE, gguf.MATRICES  # its llama.cpp files
    model_types = ("nemotron_h",)
    formats = ("Nemotron-H (Mamba2 + attention + MLP layers) as an HF directory (NemotronHForCausalLM, "
               "*.safetensors) or a llama.cpp .gguf file (architecture nemotron_h)")

    def read_checkpoint(self, path: Path, fmt: str) -> Checkpoint:
        if fmt == "gguf":
            raw, config = gguf.read(path)
            return Checkpoint(raw, config, fmt)
        config = json.loads((path / "config.json").read_text())
        raw = read_safetensors_dir(path, hf_name)
        untie_head(raw, model.HEAD, model.EMBED, bool(config.get("tie_word_embeddings")), path)
        return Checkpoint(raw, config, "hf")

    def config_from_checkpoint(self, ckpt: Checkpoint) -> NemotronHConfig:
        return NemotronHConfig.from_checkpoint(ckpt.raw, ckpt.config)

    def config_from_dict(self, d: dict[str, Any]) -> NemotronHConfig:
        names = {f.name for f in fields(NemotronHConfig)}
        d = {k: v for k, v in d.items() if k in names}
        return NemotronHConfig(**{**d, "layer_types": tuple(d["layer_types"]), "mamba": Mamba2Config(**d["mamba"])})

    used_tensors = staticmethod(model.used_tensors)
    global_keys = staticmethod(model.global_keys)
    linear_keys = staticmethod(model.linear_keys)
    prepare_layer = staticmethod(model.prepare_layer)
    prepare_globals = staticmethod(model.prepare_globals)

    def layer_prefix(self, i: int) -> str:
        return f"{PREFIX}{i}."

    def build(self, cfg: NemotronHConfig, weights: WeightProvider, fingerprint: str, device: Any) -> NemotronH:
        return NemotronH(cfg, weights, fingerprint, device)

    def describe(self, cfg: NemotronHConfig) -> str:
        m, kinds = cfg.mamba, cfg.layer_types
        return (f"Nemotron-H, {cfg.n_layer} layers ({kinds.count(MAMBA)} Mamba2, {len(cfg.attention_layers)} "
                f"attention, {kinds.count(model.MLP)} MLP), width {cfg.n_embd}, Mamba2 {m.n_heads} heads x "
                f"{m.head_dim}, d_state {m.d_state}; attention {cfg.n_heads} query / {cfg.n_kv_heads} key-value heads "
                f"of {cfg.head_dim}, vocab {cfg.vocab_size}")  # fmt: skip

    def convert(self, src: Path, dst: Path) -> str:
        raise CheckpointError("wkvm does not convert Nemotron-H checkpoints: serve the HF directory or GGUF file as "
                              "it is")  # fmt: skip


FAMILY = NemotronHFamily()
