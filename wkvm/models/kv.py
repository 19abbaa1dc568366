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

from wkvm.models import fused
from wkvm.models.rope import rotate
from wkvm.models.spec import State, TensorSpec


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

    def rope_attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, scale: float, token_rows: bool = False) -> torch.Tensor:  # fmt: skip
        """What every attention layer does with its new tokens: RoPE (`rope.rotate` with cos, sin) on q and k, append
        k and v, attend with q; the same as `rope_append_attend`, which a one-token step may run as one kernel.
        `token_rows`: several new tokens a row each get a one-token step's arithmetic where the kernel runs (the
        model's layers are row-independent, so a chunk then has stepping's bits)."""
        ...

    def fused_pages(self, layer: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> fused.Pages | None:
        """Where attention runs on the fused kernel, each new token a row (`fused.rope_attend`, and layers that call
        it themselves on a one-token step: `fused.llama_layer`): `layer`'s caches as its pages; None where it does
        not."""
        ...


@dataclass
class Attn:
    """What an attention layer gets for one group: its cache and the RoPE angles of the group's new tokens
    (computed once per forward, for every attention layer)."""

    kv: KVBatch
    cos: torch.Tensor
    sin: torch.Tensor
    token_rows: bool = False  # `KVBatch.rope_attend`'s: the model's layers compute each token's row alone

    def rope_attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q [B, T, Hq, D], k, v [B, T, Hkv, D] of the new tokens, before RoPE -> attention output [B, T, Hq, D]."""
        return self.kv.rope_attend(layer, q, k, v, self.cos, self.sin, scale, self.token_rows)


def rope_append_attend(kv: KVBatch, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor, scale: float) -> torch.Tensor:  # fmt: skip
    """`KVBatch.rope_attend` as separate torch ops: any number of new tokens, any device and dtype."""
    kv.append(layer, rotate(k, cos, sin), v)
    return kv.attend(layer, rotate(q, cos, sin), scale)


def kv_tensors(layer: int, kv_heads: int, head_dim: int) -> list[TensorSpec]:
    """An attention layer's state: its keys and values, one [kv_heads, head_dim] entry per token."""
    return [TensorSpec(name(layer), (kv_heads, head_dim), kind="kv") for name in (key_name, value_name)]


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

    def fused_pages(self, layer: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> fused.Pages | None:
        return None  # its caches grow by a copy each step (`rope_attend`), not in pages

    def rope_attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, scale: float, token_rows: bool = False) -> torch.Tensor:  # fmt: skip
        """One new token on fp32 CPU caches: the fused kernel, each row's grown cache as one page (the engine's paged
        caches run the same kernel, so both give the same bits); else `rope_append_attend` (`token_rows` is the
        engine's: this reference keeps several new tokens on the torch path)."""
        kn, vn = key_name(layer), value_name(layer)
        if not fused.rope_attend_fits(q, k, v, cos, sin, self.state[kn], self.state[vn]):
            return rope_append_attend(self, layer, q, k, v, cos, sin, scale)
        B, n, (Hkv, D) = self.batch, self.length, k.shape[2:]
        for name in (kn, vn):
            grown = self.state[name].new_empty(B, n + 1, Hkv, D)
            grown[:, :n] = self.state[name]
            self.state[name] = grown
        kflat, vflat = (self.state[name].view(B * (n + 1), Hkv, D) for name in (kn, vn))
        table, lengths = torch.arange(B).view(B, 1), torch.full((B,), n)
        return fused.rope_attend(q, k, v, cos, sin, kflat, vflat, table, lengths, n + 1, scale)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """q [B, T, Hq, D] for positions start..start+T-1 over k, v [B, start+T, Hkv, D]: causal, grouped-query."""
    T, L = q.shape[1], k.shape[1]
    mask = None if T == 1 else torch.ones(T, L, dtype=torch.bool, device=q.device).tril_(L - T)  # t sees 0..start+t
    return grouped_attention(q, k, v, mask, scale)


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      scale: float) -> torch.Tensor:  # fmt: skip
    """Grouped-query attention without copying keys and values per query head: the G = Hq / Hkv query heads that
    share a key/value head (HF's `repeat_kv` order: query head j*G + g uses kv head j) attend as G x T rows of that
    head. q [B, T, Hq, D], k, v [B, L, Hkv, D], mask (True = attend) broadcastable to [B, 1, T, L] or None (every
    query sees every key); returns [B, T, Hq, D]."""
    B, T, Hq, D = q.shape
    L, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    qh = q.reshape(B, T, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * T, D)  # rows ordered (g, t)
    kh, vh = k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype)
    if mask is not None and G > 1:
        mask = mask.expand(mask.shape[0] if mask.dim() == 4 else 1, 1, T, L).repeat(1, 1, G, 1)
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    return out.reshape(B, Hkv, G, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, Hq, D)
