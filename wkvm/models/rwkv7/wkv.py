"""The RWKV-7 recurrence (generalized delta rule), one step and in chunks.

State S is [value, key] per head (BlinkDL's orientation). Per token t:
    S_t = S_{t-1} diag(w_t) + (S_{t-1} a_t) b_t^T + v_t k_t^T,    o_t = S_t r_t
with a = -kk and b = kk * alpha. Inputs are [BH, T, N] (w given as log-decay); S is [BH, N, N].
"""

from __future__ import annotations

import torch

DEFAULT_CHUNK = 32


def wkv_step(
    S: torch.Tensor, r: torch.Tensor, log_w: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
    b: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """One token for a batch of heads, in place on S ([BH, N, N]); inputs [BH, N]; returns o [BH, N].

    o = S_t r = S_{t-1} (w*r) + (S_{t-1} a)(b.r) + v (k.r), so one read of S serves both S a and the output,
    and the update is two in-place passes (decay, then both rank-1 terms in one batched matmul).
    """
    w = torch.exp(log_w)
    s_aw = torch.bmm(S, torch.stack([a, w * r], -1))  # [BH, N, 2]
    sa = s_aw[..., :1]
    o = torch.addcmul(s_aw[..., 1], sa.squeeze(-1), (b * r).sum(-1, keepdim=True))
    o.addcmul_(v, (k * r).sum(-1, keepdim=True))
    S.mul_(w.unsqueeze(-2))
    S.baddbmm_(torch.cat([sa, v.unsqueeze(-1)], -1), torch.stack([b, k], -2))
    return o


def wkv_chunked(
    S: torch.Tensor, r: torch.Tensor, log_w: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
    b: torch.Tensor, chunk: int = DEFAULT_CHUNK,
) -> torch.Tensor:  # fmt: skip
    """T tokens in chunks of `chunk`, in place on S; inputs [BH, T, N]; returns o [BH, T, N].

    Within a chunk the diagonal decays factor as exp(g_t - g_j) with g the cumulative log-decay.
    Since log w >= -exp(-0.5), these factors stay within exp(+-0.61 * chunk): safe in fp32 for chunk <= 64.
    """
    T = r.shape[1]
    out = torch.empty_like(v)
    L = min(chunk, T)
    eye = torch.eye(L, dtype=S.dtype, device=S.device)
    strict = torch.ones(L, L, dtype=torch.bool, device=S.device).tril_(-1).unsqueeze(1)
    causal = torch.ones(L, L, dtype=torch.bool, device=S.device).tril_(0).unsqueeze(1)
    for s in range(0, T, chunk):
        e = min(s + chunk, T)
        n = e - s
        rc, lw, kc, vc, ac, bc = (x[:, s:e] for x in (r, log_w, k, v, a, b))
        g = lw.cumsum(1)
        a_dec = ac * torch.exp(g - lw)
        r_dec = rc * torch.exp(g)
        inv = torch.exp(-g)
        bk_inv = torch.cat([bc * inv, kc * inv], 1).transpose(1, 2)
        # [BH, n, 2n]: decayed dot products with b (left half) and k (right half), masked per half
        A_a = torch.bmm(a_dec, bk_inv).view(-1, n, 2, n).mul_(strict[:n, :, :n]).view(-1, n, 2 * n)
        A_r = torch.bmm(r_dec, bk_inv).view(-1, n, 2, n).mul_(causal[:n, :, :n]).view(-1, n, 2 * n)
        ST = S.transpose(1, 2)
        rhs = torch.baddbmm(torch.bmm(a_dec, ST), A_a[:, :, n:], vc)
        U = torch.linalg.solve_triangular(eye[:n, :n] - A_a[:, :, :n], rhs, upper=False, unitriangular=True)
        o = torch.bmm(r_dec, ST)
        o.baddbmm_(A_r[:, :, :n], U).baddbmm_(A_r[:, :, n:], vc)
        out[:, s:e] = o
        g_last = g[:, -1:]
        to_end = torch.exp(g_last - g)
        S.mul_(torch.exp(g_last))
        S.baddbmm_(U.transpose(1, 2), bc * to_end).baddbmm_(vc.transpose(1, 2), kc * to_end)
    return out
