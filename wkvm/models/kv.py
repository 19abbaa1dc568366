"""What an attention layer sees of its key/value cache during a forward pass (issue #16; see docs/design-paged-kv.md).

A model's attention layer never touches pages or slots: it asks the group's `KVBatch` where the new tokens start
(`positions`, for RoPE), appends the new keys and values, and attends over everything cached. The engine will
hand the model a paged implementation (pages from a shared pool, copy-on-write forks); `DenseKV` is the
reference implementation over contiguous per-layer tensors kept in a plain state dict, used by `prefill`/`decode`
outside the engine and by tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from wkvm.models.spec import State


class KVBatch(Protocol):
    """One group's caches: B sequences, each with its own cached length."""

    def positions(self) -> torch.Tensor:
        """[B] long: how many tokens each row has cached (the position of its first new token)."""
        ...

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Add the new tokens' keys and values, [B, T, Hkv, D] each, after each row's cached ones."""
        ...

    def attend(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """Causal attention of the new tokens' queries q [B, T, Hq, D] (Hq a multiple of Hkv: grouped-query) over
        each row's cache including the tokens just appended; returns [B, T, Hq, D]."""
        ...


@dataclass
class Attn:
    """What an attention layer gets for one group: its cache and the RoPE angles of the group's new tokens
    (computed once per forward, for every attention layer)."""

    kv: KVBatch
    cos: torch.Tensor
    sin: torch.Tensor


def key_name(layer: int) -> str:
    return f"layers.{layer}.k"


def value_name(layer: int) -> str:
    return f"layers.{layer}.v"


class DenseKV:
    """KV caches as contiguous tensors inside a state dict: `layers.{i}.k` / `.v` of shape [B, n, Hkv, D] (every row
    holds the same n tokens, as `prefill`/`decode` on one batch do). Appending replaces the dict's tensors."""

    def __init__(self, state: State, layers: list[int]):
        self.state = state
        self.layers = layers
        lengths = {state[key_name(i)].shape[1] for i in layers}
        if len(lengths) > 1:
            raise ValueError(f"attention layers hold different token counts: {sorted(lengths)}")
        self.length = lengths.pop() if lengths else 0
        self.batch = state[key_name(layers[0])].shape[0] if layers else 0

    def positions(self) -> torch.Tensor:
        return torch.full((self.batch,), self.length, dtype=torch.long)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        kn, vn = key_name(layer), value_name(layer)
        self.state[kn] = torch.cat([self.state[kn], k.to(self.state[kn].dtype)], 1)
        self.state[vn] = torch.cat([self.state[vn], v.to(self.state[vn].dtype)], 1)

    def attend(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        k, v = self.state[key_name(layer)], self.state[value_name(layer)]
        return attention(q, k, v, self.length, scale)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """q [B, T, Hq, D] for positions start..start+T-1 over k, v [B, start+T, Hkv, D]: causal, grouped-query."""
    T, Hq, Hkv = q.shape[1], q.shape[2], k.shape[2]
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2).float(), v.transpose(1, 2).float()
    if Hq != Hkv:
        kh, vh = kh.repeat_interleave(Hq // Hkv, 1), vh.repeat_interleave(Hq // Hkv, 1)
    L = kh.shape[2]
    mask = torch.ones(T, L, dtype=torch.bool, device=q.device).tril_(L - T)  # row t sees keys 0..start+t
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    return out.transpose(1, 2)
