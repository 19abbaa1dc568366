"""The gated delta rule (Gated DeltaNet's recurrence), one step and in exact chunks.

State S is [key, value] per value head (HF/fla's orientation, [Hv, dk, dv]). Per token t, with log-decay g_t <= 0,
0 < beta_t < 1 and unit-norm k_t:
    S_t = exp(g_t) S_{t-1} + k_t delta_t^T,    delta_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t),    o_t = S_t^T q_t
S is [BH, dk, dv], updated in place; the step takes one token per head, the chunked form T tokens token-major.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from wkvm.models import fused

DEFAULT_CHUNK = 16  # measured against 8, 24, 32 and 64 (kernel and torch forms): see docs/families/qwen3_5.md
SOURCE = Path(__file__).with_name("gated_delta.cpp")


@functools.cache
def kernel_available() -> bool:
    """Whether the layer's C++ kernels (gated_delta.cpp: the chunked rule, the layer's steps) run here (built now if
    needed; off under `WKVM_FUSED=off` like every fused kernel); False, with one warning, when they cannot be built."""
    return fused.kernel_available(SOURCE, "wkvm_gdn", "steps", "Gated DeltaNet kernel",
                                  "the layer runs its torch ops (slower, and a prompt's chunks agree with stepping "
                                  "only to rounding)")  # fmt: skip


def _kernel_takes(S: torch.Tensor, heads: tuple[torch.Tensor, ...], gates: tuple[torch.Tensor, ...]) -> bool:
    """CPU float32 throughout, a contiguous state, each token's heads contiguous rows (any batch and token strides)."""
    rows = all(x.stride(-1) == 1 and x.stride(-2) == x.shape[-1] for x in heads)
    return fused.cpu_fp32(S, *heads, *gates) and S.is_contiguous() and rows and kernel_available()


def layer_steps(proj: torch.Tensor, window: torch.Tensor, conv: torch.Tensor, S: torch.Tensor, neg_A: torch.Tensor,
                dt_bias: torch.Tensor, norm: torch.Tensor, Hk: int, dk: int, l2_eps: float,
                rms_eps: float) -> torch.Tensor | None:  # fmt: skip
    """A GDN layer between its projections for proj [B, T, in_proj outputs] in one kernel call (gated_delta.cpp's
    `steps`: for each token the conv, L2 norms, gates, delta-rule step and gated RMSNorm): o [B, T, Hv * dv], each
    token with a one-token step's arithmetic (so T tokens in one chunk have the bits of T steps); or None where the
    kernel does not take these tensors (the caller runs its torch ops, the kernel's reference)."""
    if not (fused.conv_step_fits(proj, window, conv, S, neg_A, dt_bias, norm) and kernel_available()):
        return None
    o: torch.Tensor = torch.ops.wkvm_gdn.steps(proj, window, conv, S, neg_A, dt_bias, norm, Hk, dk, l2_eps, rms_eps)
    return o


def gated_delta_step(S: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """One token for a batch of heads, in place on S ([BH, dk, dv]); q, k [BH, dk], v [BH, dv], g, beta [BH];
    returns o [BH, dv]. One read of the decayed state serves both S^T k and S^T q: o = S'^T q + (q.k) delta."""
    S.mul_(torch.exp(g)[:, None, None])
    kq_s = torch.bmm(torch.stack([k, q], 1), S)  # [BH, 2, dv]
    delta = (v - kq_s[:, 0]) * beta[:, None]
    S.baddbmm_(k.unsqueeze(2), delta.unsqueeze(1))
    return torch.addcmul(kq_s[:, 1], delta, (q * k).sum(-1, keepdim=True))


def _chunk_major(x: torch.Tensor, n: int, L: int) -> torch.Tensor:
    """x [B, T, H, d] (any strides) as [n, B, H, L, d], contiguous, T zero-padded to n * L: each chunk's slice is one
    contiguous batch of matrices."""
    B, T, H, d = x.shape
    out = x.new_empty(n, B, H, L, d)
    view = out.permute(1, 0, 3, 2, 4)  # [B, n, L, H, d]
    full = T // L
    if full:
        view[:, :full].copy_(x[:, : full * L].view(B, full, L, H, d))
    if full < n:
        view[:, full, : T - full * L].copy_(x[:, full * L :])
        view[:, full, T - full * L :].zero_()
    return out


def gated_delta_chunked(S: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                        beta: torch.Tensor, chunk: int = DEFAULT_CHUNK) -> torch.Tensor:  # fmt: skip
    """T tokens in chunks of `chunk` (the WY form, exact up to fp32 rounding), in place on S; returns o [B, T, Hv, dv].

    Token-major inputs as the projections give them: q, k [B, T, Hk, dk], v [B, T, Hv, dv], g, beta [B, T, Hv]; S is
    [B * Hv, dk, dv]. Value head j reads key head j // (Hv / Hk) (grouped heads), so products of q and k alone are
    taken once per key head. Within a chunk, with G the cumulative log-decay from the chunk's start and S0 the state
    before it:
        (I + A) Delta = beta (V - exp(G) K S0),   A_tj = beta_t exp(G_t - G_j) k_t.k_j  (j < t)
        O = exp(G) Q S0 + (exp(G_t - G_j) q_t.k_j)_{j <= t} Delta,   S = exp(G_L) S0 + (exp(G_L - G) K)^T Delta
    Decays enter only as exp of differences G_t - G_j <= 0 (never exp(-G)), so any decay is safe in fp32. The
    parts that do not depend on S0 are computed for all chunks at once, (I + A)^-1 by one triangular solve; T is
    padded with tokens that change nothing (k = v = 0, g = 0, beta = 0). On CPU in fp32 the C++ kernel
    (gated_delta.cpp: the same form, one thread per key head's value heads) runs it instead: 0.08 s where the torch
    form takes 0.17 s of a 1,024-token prefill at bench/gdn_speed.py's shape (AMD EPYC Zen 4, 2 threads).
    """
    if _kernel_takes(S, (q, k, v), (g, beta)):
        o: torch.Tensor = torch.ops.wkvm_gdn.chunked(S, q, k, v, g.contiguous(), beta.contiguous(), chunk)
        return o
    return chunked_torch(S, q, k, v, g, beta, chunk)


def chunked_torch(S: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                  beta: torch.Tensor, chunk: int = DEFAULT_CHUNK) -> torch.Tensor:  # fmt: skip
    """`gated_delta_chunked` in torch ops: the fallback off CPU / fp32 and without a compiler, and the kernel's
    reference in tests."""
    B, T, Hk, dk = k.shape
    Hv, dv = v.shape[2], v.shape[3]
    r, BH = Hv // Hk, B * Hv
    L = min(chunk, T)
    n = -(-T // L)
    if n * L > T:
        g, beta = (F.pad(x, (0, 0, 0, n * L - T)) for x in (g, beta))
    qc, kc = _chunk_major(q, n, L), _chunk_major(k, n, L)  # [n, B, Hk, L, dk]
    vc = _chunk_major(v, n, L).view(n, B, Hk, r, L, dv)
    G = g.reshape(B, n, L, Hv).permute(1, 0, 3, 2).cumsum(-1).view(n, B, Hk, r, L)
    beta = beta.reshape(B, n, L, Hv).permute(1, 0, 3, 2).reshape(n, B, Hk, r, L)
    causal = torch.ones(L, L, dtype=torch.bool, device=S.device).tril_()
    decay = (G.unsqueeze(-1) - G.unsqueeze(-2)).masked_fill_(~causal, float("-inf")).exp_()  # [n, B, Hk, r, L, L]
    kt = kc.transpose(-1, -2)
    A = (kc @ kt).unsqueeze(3).mul(decay).mul_(beta.unsqueeze(-1))  # strictly lower part used (unitriangular)
    inv = torch.linalg.solve_triangular(A, torch.eye(L, dtype=S.dtype, device=S.device), upper=False,
                                        unitriangular=True)  # fmt: skip
    eG = G.exp()
    U = (inv * beta.unsqueeze(-2)) @ vc  # Delta = U - W S0
    inv_k = torch.mul(inv, (beta * eG).unsqueeze(-2), out=torch.empty_like(A))  # row-major whatever inv's layout
    W = inv_k.view(n, B, Hk, r * L, L) @ kc  # one product per key head
    q_dec = qc.unsqueeze(3) * eG.unsqueeze(-1)
    P = (qc @ kt).unsqueeze(3).mul(decay)  # lower incl. diagonal
    k_end = kc.unsqueeze(3) * (G[..., -1:] - G).exp().unsqueeze(-1)
    U, W, q_dec, P, k_end = (x.reshape(n, BH, L, -1) for x in (U, W, q_dec, P, k_end))
    chunk_decay = eG[..., -1].reshape(n, BH, 1, 1)
    out = torch.empty(n, BH, L, dv, dtype=v.dtype, device=v.device)
    for c in range(n):
        delta = U[c].baddbmm_(W[c], S, alpha=-1)
        torch.bmm(q_dec[c], S, out=out[c]).baddbmm_(P[c], delta)
        S.mul_(chunk_decay[c]).baddbmm_(k_end[c].transpose(-1, -2), delta)
    return out.view(n, B, Hv, L, dv).permute(1, 0, 3, 2, 4).reshape(B, n * L, Hv, dv)[:, :T]
