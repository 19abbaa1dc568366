"""Small random RWKV-7 checkpoints in BlinkDL shapes, for tests, benchmarks and a model-less server."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from wkvm.models.family import RawTensors
from wkvm.models.rwkv7.checkpoint import write_hf, write_pth


@dataclass(frozen=True)
class RWKV7Shape:
    n_layer: int = 2
    n_embd: int = 64
    head_size: int = 16
    vocab_size: int = 256
    ffn_size: int | None = None
    decay_rank: int = 8
    a_rank: int = 8
    v_rank: int = 4
    gate_rank: int = 16


SHAPE_0_1B = RWKV7Shape(12, 768, 64, 65536, 3072, 64, 64, 32, 128)


def random_rwkv7(shape: RWKV7Shape, seed: int = 0, dtype: torch.dtype = torch.float32) -> RawTensors:
    """Weights scaled like a trained model's (unit-ish activations, logits of a few units)."""
    gen = torch.Generator().manual_seed(seed)
    C, L, N, V = shape.n_embd, shape.n_layer, shape.head_size, shape.vocab_size
    H, F = C // N, shape.ffn_size or 4 * shape.n_embd

    def randn(*size: int, std: float = 1.0, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(*size, generator=gen) * std + mean

    def rand(*size: int, lo: float = 0.0, hi: float = 1.0) -> torch.Tensor:
        return torch.rand(*size, generator=gen) * (hi - lo) + lo

    t: RawTensors = {"emb.weight": randn(V, C, std=0.5)}
    for i in range(L):
        b = f"blocks.{i}."
        if i == 0:
            t[b + "ln0.weight"], t[b + "ln0.bias"] = randn(C, std=0.1, mean=1.0), randn(C, std=0.1)
        for ln in ("ln1", "ln2"):
            t[f"{b}{ln}.weight"], t[f"{b}{ln}.bias"] = randn(C, std=0.1, mean=1.0), randn(C, std=0.1)
        for m in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g"):
            t[b + "att." + m] = rand(1, 1, C)
        ranks = {"w": shape.decay_rank, "a": shape.a_rank, "v": shape.v_rank, "g": shape.gate_rank}
        for p, rank in ranks.items():
            if p == "v" and i == 0:
                continue
            if p != "g":
                t[f"{b}att.{p}0"] = randn(1, 1, C, std=1.0, mean=-1.0 if p == "w" else 0.0)
            t[f"{b}att.{p}1"] = randn(C, rank, std=C**-0.5)
            t[f"{b}att.{p}2"] = randn(rank, C, std=rank**-0.5 * (0.5 if p != "g" else 1.0))
        t[b + "att.k_k"] = randn(1, 1, C, std=0.1, mean=0.85)
        t[b + "att.k_a"] = randn(1, 1, C, std=0.1, mean=1.0)
        t[b + "att.r_k"] = randn(H, N, std=0.3)
        for name in ("receptance", "key", "value"):
            t[f"{b}att.{name}.weight"] = randn(C, C, std=C**-0.5)
        t[b + "att.output.weight"] = randn(C, C, std=0.5 * C**-0.5)
        t[b + "att.ln_x.weight"], t[b + "att.ln_x.bias"] = randn(C, std=0.1, mean=1.0), randn(C, std=0.1)
        t[b + "ffn.x_k"] = rand(1, 1, C)
        t[b + "ffn.key.weight"] = randn(F, C, std=C**-0.5)
        t[b + "ffn.value.weight"] = randn(C, F, std=0.5 * F**-0.5)
    t["ln_out.weight"], t["ln_out.bias"] = randn(C, std=0.1, mean=1.0), randn(C, std=0.1)
    t["head.weight"] = randn(V, C, std=2.0 * C**-0.5)
    return {k: v.to(dtype) for k, v in t.items()}


def save_random_rwkv7(
    path: str | os.PathLike[str], shape: RWKV7Shape, seed: int = 0, fmt: str = "pth", dtype: torch.dtype = torch.float32
) -> RawTensors:
    """Write a random checkpoint as BlinkDL `.pth` (fmt='pth') or an HF/fla directory (fmt='hf')."""
    raw = random_rwkv7(shape, seed, dtype)
    if fmt == "pth":
        write_pth(raw, path)
    else:
        write_hf(raw, path)
    return raw
