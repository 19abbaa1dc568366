"""A deliberately tiny test-only family: proof that a family plugs into wkvm through the protocol alone.

Per layer: u = W_in x; a depthwise causal convolution over the last K inputs (state kind `conv`); a per-channel
leaky accumulator h = d * h + conv(u) (kind `recurrent`); x += W_out tanh(h). Tied embedding head. Checkpoints are
directories with config.json (`model_type: wkvm_toy`) and model.safetensors. Registered when this module is
imported; nothing under wkvm/ names it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from wkvm.models import registry
from wkvm.models.family import Checkpoint, CheckpointError, ModelBase, RawTensors, layer_count, owned, require
from wkvm.models.linear import linear, pack_linear
from wkvm.models.provider import Tensors, WeightProvider
from wkvm.models.spec import State, StateSpec, TensorSpec

NAME = "toy"
INT8 = False  # float32 weights only (prepare_layer casts; no int8 / int4 forms)
LAYER_KEYS = ("w_in", "conv", "decay", "w_out")
LINEAR_KEYS = ("w_in", "w_out")


@dataclass(frozen=True)
class ToyConfig:
    n_layer: int
    vocab_size: int
    width: int
    kernel: int


class ToyModel(ModelBase):
    family = NAME
    config: ToyConfig

    def __init__(self, cfg: ToyConfig, weights: WeightProvider, fingerprint: str, device: torch.device | str):
        tensors = []
        for i in range(cfg.n_layer):
            tensors += [TensorSpec(f"layers.{i}.conv", (cfg.width, cfg.kernel - 1), kind="conv"),
                        TensorSpec(f"layers.{i}.h", (cfg.width,), kind="recurrent")]  # fmt: skip
        super().__init__(cfg, StateSpec(NAME, tuple(tensors)), weights, fingerprint, device)

    def embed(self, tokens: torch.Tensor, g: Tensors) -> torch.Tensor:
        return g["emb"][tokens].float()

    def block(self, i: int, w: Tensors, x: torch.Tensor, state: State, attn=None) -> torch.Tensor:
        return x + self._layer(w, x, state[f"layers.{i}.conv"], state[f"layers.{i}.h"])

    def logits(self, x: torch.Tensor, g: Tensors) -> torch.Tensor:
        return linear(x, g["head"])

    def _layer(self, w: Tensors, x: torch.Tensor, window: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        T = x.shape[1]
        u = linear(x, w["w_in"])  # [B, T, C]
        seq = torch.cat([window, u.transpose(1, 2)], 2)  # [B, C, K-1+T]
        conv = seq.unfold(2, self.config.kernel, 1).mul(w["conv"][:, None, :]).sum(-1)  # [B, C, T]
        window.copy_(seq[:, :, T:])
        out = []
        for t in range(T):  # a toy: step by step (the engine still prefills it in chunks)
            h.mul_(w["decay"]).add_(conv[:, :, t])
            out.append(torch.tanh(h))
        return linear(torch.stack(out, 1), w["w_out"])

class ToyFamily:
    name = NAME
    model_types = ("wkvm_toy",)
    formats = "a wkvm toy directory (tests only)"

    def detect(self, path: Path) -> str | None:
        return None

    def read_checkpoint(self, path: Path, fmt: str) -> Checkpoint:
        return Checkpoint(load_file(path / "model.safetensors"), json.loads((path / "config.json").read_text()), fmt)

    def config_from_checkpoint(self, ckpt: Checkpoint) -> ToyConfig:
        require(ckpt.raw, ["emb", "layers.0.conv"], "toy")
        vocab, width = ckpt.raw["emb"].shape
        return ToyConfig(layer_count(ckpt.raw, "layers."), vocab, width, ckpt.raw["layers.0.conv"].shape[1])

    def config_from_dict(self, d: dict) -> ToyConfig:
        return ToyConfig(**d)

    def used_tensors(self, raw: RawTensors) -> RawTensors:
        return raw

    def global_keys(self, cfg: ToyConfig) -> tuple[str, ...]:
        return ("emb",)

    def layer_prefix(self, i: int) -> str:
        return f"layers.{i}."

    def linear_keys(self, cfg: ToyConfig, i: int) -> tuple[str, ...]:
        return LINEAR_KEYS

    def prepare_layer(self, raw: RawTensors, i: int, cfg: ToyConfig, dtype: torch.dtype, device,
                      pack: bool = True) -> Tensors:  # fmt: skip
        p = self.layer_prefix(i)
        require(raw, [p + k for k in LAYER_KEYS], "toy")
        t = {k: raw[p + k].to(device=device, dtype=dtype if k in LINEAR_KEYS else torch.float32) for k in LAYER_KEYS}
        t["decay"] = torch.sigmoid(t["decay"])
        if pack:
            t.update({k: pack_linear(t[k]) for k in LINEAR_KEYS})
        return {k: v if v.is_mkldnn else owned(v) for k, v in t.items()}

    def prepare_globals(self, raw: RawTensors, cfg: ToyConfig, dtype: torch.dtype, device) -> Tensors:
        emb = raw["emb"].to(device=device, dtype=torch.float32)
        return {"emb": owned(emb), "head": pack_linear(emb.to(dtype))}

    def build(self, cfg: ToyConfig, weights: WeightProvider, fingerprint: str, device) -> ToyModel:
        return ToyModel(cfg, weights, fingerprint, device)

    def describe(self, cfg: ToyConfig) -> str:
        return f"toy, {cfg.n_layer} layers, width {cfg.width}, vocab {cfg.vocab_size}"

    def convert(self, src: Path, dst: Path) -> str:
        raise CheckpointError("the toy family has one format")

    def default_tokenizer(self, path):
        return None

    def default_chat_template(self, path):
        return None


FAMILY = ToyFamily()
registry.register(FAMILY)


def write_checkpoint(path: Path, vocab_size: int, seed: int = 0, n_layer: int = 2, width: int = 24) -> Path:
    gen = torch.Generator().manual_seed(seed)
    raw = {"emb": torch.randn(vocab_size, width, generator=gen)}
    for i in range(n_layer):
        raw[f"layers.{i}.w_in"] = torch.randn(width, width, generator=gen) * width**-0.5
        raw[f"layers.{i}.conv"] = torch.randn(width, 3, generator=gen) * 0.5
        raw[f"layers.{i}.decay"] = torch.randn(width, generator=gen) + 1.0
        raw[f"layers.{i}.w_out"] = torch.randn(width, width, generator=gen) * width**-0.5
    path.mkdir(parents=True, exist_ok=True)
    save_file(raw, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"model_type": "wkvm_toy"}))
    return path
