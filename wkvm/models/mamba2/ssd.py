"""The Mamba2 SSM recurrence (state space duality): one step, and a chunked form equal to T steps.

Per head h (group g = h // (H / G) shares B and C), with a = dt * A < 0 and the state S [P, N]:

    S_t = exp(a_t) S_{t-1} + dt_t x_t B_t^T        y_t = S_t C_t + D x_t

The chunked form runs L tokens at once as matrix products (the "SSD" of the Mamba2 paper): inside a chunk,
y = ((C B^T) * decay) (dt x) plus the carried state read through C; the state leaves the chunk decayed by the
chunk's total a. Chunks run one after another (memory stays O(L^2) per head, not O(T^2)); both forms are fp32 and
agree within rounding. States are [B, H, P, N] (head, head_dim, state), updated in place.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from wkvm.models import fused

DEFAULT_CHUNK = 64  # 130m shape, 1,024-token prefill on the kernel: 32 / 64 / 128 / 256 -> 1.25 / 1.29 / 1.35 / 1.54 s
SOURCE = Path(__file__).with_name("ssd.cpp")


@functools.cache
def kernel_available() -> bool:
    """Whether the mixer's kernels (ssd.cpp) run here (built now if needed; off under `WKVM_FUSED=off` like every
    fused kernel); False, with one warning, when they cannot be built."""
    return fused.kernel_available(SOURCE, "wkvm_mamba2", "steps", "Mamba2 mixer kernel",
                                  "the mixer runs its torch ops (slower; a prompt's chunks agree with stepping only to "
                                  "rounding)")  # fmt: skip


def mixer_steps(proj: torch.Tensor, window: torch.Tensor, conv: torch.Tensor, conv_bias: torch.Tensor,
                S: torch.Tensor, dt_bias: torch.Tensor, A: torch.Tensor, D: torch.Tensor, G: int, dt_min: float,
                dt_max: float | None) -> torch.Tensor | None:  # fmt: skip
    """The mixer between its projections for proj [b, T, in_proj outputs] in one kernel call (ssd.cpp's `steps`:
    for each token the conv step, SiLU, dt, the SSM step and D's skip): y [b, T, H * P] before the gated norm, each
    token with a one-token step's arithmetic (so T tokens in one chunk have the bits of T steps); or None where the
    kernel does not take these tensors (the caller runs its torch ops, the kernel's reference in tests)."""
    if not (fused.conv_step_fits(proj, window, conv, conv_bias, S, dt_bias, A, D) and kernel_available()):
        return None
    clamp = dt_min > 0.0 or dt_max is not None
    y: torch.Tensor = torch.ops.wkvm_mamba2.steps(proj, window, conv, conv_bias, S, dt_bias, A, D, G, clamp, dt_min,
                                                  float("inf") if dt_max is None else dt_max)  # fmt: skip
    return y


def ssd_step(S: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             D: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """One token for a batch: S [b, H, P, N] (in place), x [b, H, P], dt [b, H] (after softplus), A and D [H],
    B and C [b, G, N] -> y [b, H, P]."""
    b, H, P, N = S.shape
    G = B.shape[1]
    heads = S.view(b * H, P, N)
    B_heads = B.unsqueeze(2).expand(b, G, H // G, N).reshape(b * H, 1, N)
    # three passes over S (scale, rank-1 add, read out): at B=32 the state, not the weights, is what decode streams
    S.mul_(torch.exp(dt * A).view(b, H, 1, 1))
    heads.baddbmm_((dt.unsqueeze(-1) * x).reshape(b * H, P, 1), B_heads)
    y = torch.linalg.vecdot(S.view(b, G, H // G, P, N), C.view(b, G, 1, 1, N))  # measured 1.5x bmm's speed here
    out: torch.Tensor = y.view(b, H, P) + x * D.view(H, 1)
    return out


def ssd_chunked(S: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                C: torch.Tensor, D: torch.Tensor, chunk: int = DEFAULT_CHUNK) -> torch.Tensor:  # fmt: skip
    """T tokens: S [b, H, P, N] (in place), x [b, T, H, P], dt [b, T, H], B and C [b, T, G, N] -> y [b, T, H, P].
    On CPU in fp32 ssd.cpp's `chunked` runs the same form (C B^T once per group and chunk, a thread per head through
    the chunks); elsewhere, and without a compiler, the torch ops of `ssd_chunked_torch`."""
    rows = all(t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] for t in (x, B, C))
    if (fused.cpu_fp32(S, x, dt, A, B, C, D) and rows and S.is_contiguous() and A.is_contiguous()
            and D.is_contiguous() and kernel_available()):  # fmt: skip
        y: torch.Tensor = torch.ops.wkvm_mamba2.chunked(S, x, dt.contiguous(), A, B, C, D, chunk)
        return y
    return ssd_chunked_torch(S, x, dt, A, B, C, D, chunk)


def ssd_chunked_torch(S: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                      C: torch.Tensor, D: torch.Tensor, chunk: int = DEFAULT_CHUNK) -> torch.Tensor:  # fmt: skip
    """`ssd_chunked` in torch ops: the fallback and the kernel's reference in tests."""
    b, T, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    hpg = H // G
    xh = x.transpose(1, 2)  # [b, H, T, P]
    a = (dt * A).transpose(1, 2)  # [b, H, T]
    dtx = xh * dt.transpose(1, 2).unsqueeze(-1)
    Bg, Cg = B.transpose(1, 2), C.transpose(1, 2)  # [b, G, T, N]
    Sg = S.view(b, G, hpg, P, N)
    ys = []
    for s in range(0, T, chunk):
        e = min(s + chunk, T)
        L = e - s
        cum = torch.cumsum(a[:, :, s:e], dim=-1)  # [b, H, L]
        causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
        decay = torch.exp((cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~causal, float("-inf")))
        cb = torch.matmul(Cg[:, :, s:e], Bg[:, :, s:e].transpose(-1, -2))  # [b, G, L, L]
        scores = (decay.view(b, G, hpg, L, L) * cb.unsqueeze(2)).view(b, H, L, L)
        y = torch.matmul(scores, dtx[:, :, s:e])  # within the chunk
        y_state = torch.matmul(Cg[:, :, s:e].unsqueeze(2), Sg.transpose(-1, -2))  # [b, G, hpg, L, P]
        y = y + y_state.view(b, H, L, P) * torch.exp(cum).unsqueeze(-1)
        ys.append(y)
        to_end = torch.exp(cum[:, :, -1:] - cum)  # [b, H, L]: decay from each token to the chunk's end
        weighted = (dtx[:, :, s:e] * to_end.unsqueeze(-1)).view(b, G, hpg, L, P)
        S.mul_(torch.exp(cum[:, :, -1]).view(b, H, 1, 1))
        Sg.add_(torch.matmul(weighted.transpose(-1, -2), Bg[:, :, s:e].unsqueeze(2)))
    y = torch.cat(ys, dim=2) if len(ys) > 1 else ys[0]
    return (y + xh * D.view(H, 1, 1)).transpose(1, 2)
