"""The gated delta rule (Gated DeltaNet's recurrence), one step and in exact chunks.

State S is [key, value] per value head (HF/fla's orientation, [Hv, dk, dv]). Per token t, with log-decay g_t <= 0,
0 < beta_t < 1 and unit-norm k_t:
    S_t = exp(g_t) S_{t-1} + k_t delta_t^T,    delta_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t),    o_t = S_t^T q_t
Inputs are per head: q, k [BH, T, dk], v [BH, T, dv], g, beta [BH, T]; S is [BH, dk, dv], updated in place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

DEFAULT_CHUNK = 64  # measured against 32: see docs/families/qwen3_5.md


def gated_delta_step(S: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """One token for a batch of heads, in place on S ([BH, dk, dv]); q, k [BH, dk], v [BH, dv], g, beta [BH];
    returns o [BH, dv]. One read of the decayed state serves both S^T k and S^T q: o = S'^T q + (q.k) delta."""
    S.mul_(torch.exp(g)[:, None, None])
    kq_s = torch.bmm(torch.stack([k, q], 1), S)  # [BH, 2, dv]
    delta = (v - kq_s[:, 0]) * beta[:, None]
    S.baddbmm_(k.unsqueeze(2), delta.unsqueeze(1))
    return torch.addcmul(kq_s[:, 1], delta, (q * k).sum(-1, keepdim=True))


def gated_delta_chunked(S: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                        beta: torch.Tensor, chunk: int = DEFAULT_CHUNK) -> torch.Tensor:  # fmt: skip
    """T tokens in chunks of `chunk` (the WY form, exact up to fp32 rounding), in place on S; returns o [BH, T, dv].

    Within a chunk, with G the cumulative log-decay from the chunk's start and S0 the state before it:
        (I + A) Delta = beta (V - exp(G) K S0),   A_tj = beta_t exp(G_t - G_j) k_t.k_j  (j < t)
        O = exp(G) Q S0 + (exp(G_t - G_j) q_t.k_j)_{j <= t} Delta,   S = exp(G_L) S0 + (exp(G_L - G) K)^T Delta
    Decays enter only as exp of differences G_t - G_j <= 0 (never exp(-G)), so any decay is safe in fp32. The
    parts that do not depend on S0 are computed for all chunks at once; T is padded with tokens that change
    nothing (k = v = 0, g = 0, beta = 0).
    """
    BH, T, dk = k.shape
    dv = v.shape[-1]
    L = min(chunk, T)
    pad = (-T) % L
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (T + pad) // L
    q, k, v = q.reshape(BH, n, L, dk), k.reshape(BH, n, L, dk), v.reshape(BH, n, L, dv)
    G = g.reshape(BH, n, L).cumsum(-1)
    beta = beta.reshape(BH, n, L, 1)
    causal = torch.ones(L, L, dtype=torch.bool, device=S.device).tril_()
    decay = (G.unsqueeze(-1) - G.unsqueeze(-2)).masked_fill_(~causal, float("-inf")).exp_()  # [BH, n, L, L]
    A = (k @ k.transpose(-1, -2)).mul_(decay).mul_(beta)  # strictly lower part used (unitriangular solve)
    eG = G.exp().unsqueeze(-1)
    rhs = torch.cat([v * beta, k * (beta * eG)], -1)
    UW = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)
    U, W = UW[..., :dv], UW[..., dv:]  # Delta = U - W S0
    P = (q @ k.transpose(-1, -2)).mul_(decay)  # [BH, n, L, L], lower incl. diagonal
    q_dec = q * eG
    to_end = (G[..., -1:] - G).exp().unsqueeze(-1)
    k_end = (k * to_end).transpose(-1, -2)  # [BH, n, dk, L]
    chunk_decay = G[..., -1].exp()[..., None, None]  # [BH, n, 1, 1]
    out = torch.empty(BH, n, L, dv, dtype=v.dtype, device=v.device)
    for c in range(n):
        delta = torch.baddbmm(U[:, c], W[:, c], S, alpha=-1)
        o = torch.bmm(q_dec[:, c], S)
        out[:, c] = o.baddbmm_(P[:, c], delta)
        S.mul_(chunk_decay[:, c]).baddbmm_(k_end[:, c], delta)
    return out.reshape(BH, n * L, dv)[:, :T]
