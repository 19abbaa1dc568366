"""Rotary position embeddings in HF's half-split layout, shared by the attention families.

`angles` gives cos/sin for each row's positions start[b] .. start[b] + T - 1 over the rotary dimensions
(2 x len(inv_freq)); `rotate` applies them to the first rotary dimensions of each head and passes the rest through
(partial rotary embeddings, as Qwen3.5 / Qwen3-Next use).
"""

from __future__ import annotations

import torch


def frequencies(theta: float, dim: int) -> torch.Tensor:
    """RoPE's per-pair angular frequencies [dim/2] for `dim` rotary dimensions (transformers' default init)."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def angles(inv_freq: torch.Tensor, start: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, T, 1, 2 * len(inv_freq)] for positions start[b] + t (start [B] long)."""
    pos = start.to(inv_freq.device)[:, None] + torch.arange(T, device=inv_freq.device)
    a = pos[..., None].float() * inv_freq
    a = torch.cat([a, a], -1)  # not .repeat: 16 vs 3 us for [8, 1, 32] (AMD EPYC)
    return a.cos().unsqueeze(2), a.sin().unsqueeze(2)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D]: pair j of the first R = cos.shape[-1] dims is (x[j], x[j + R/2]); dims from R on pass."""
    R = cos.shape[-1]
    rot, rest = (x, None) if x.shape[-1] == R else (x[..., :R], x[..., R:])
    x1, x2 = rot.chunk(2, -1)
    out = rot * cos + torch.cat([-x2, x1], -1) * sin
    return out if rest is None else torch.cat([out, rest], -1)
