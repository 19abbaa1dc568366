"""RWKV-7's decode-step ops (step.cpp, torch op namespace `wkvm_rwkv7`): a one-token step ran ~270 torch calls per
layer (~70 of them arithmetic), and on a 2-core AVX-512 EPYC they cost more than the int8 matmuls (issue #21). These
four ops do a layer's work between its matmuls: norm + token shift + mixes, the four LoRA chains, the whole wkv part
(k/v adjustments, the recurrence, group norm, bonus, gate), and relu^2. Measured there (B=1, 2 threads, ms per token,
WKVM_FUSED=off -> on): int8 13.1 -> 8.1-9.2, int4 12.0 -> 7.0-7.6, fp32 33.6-36.4 -> 30.0-33.2 (oneDNN's gemv is
most of fp32's token).

The model calls them only where the kernel is built (else, and under `WKVM_FUSED=off`, it runs its own torch time and
channel mix, the code these ops were checked against). Each function is one op of the kernel (built on first use like
the int8/int4 kernels, cached per source and CPU) and, for tensors the kernel does not take (off the CPU, not
float32), the torch expression it replaces; tests/test_rwkv7_step.py also uses those as each op's reference. The ops
take rows [B, C] with contiguous rows (any row stride) and the state with contiguous heads, as the model holds them;
the kernel refuses other layouts with a message. It computes in fp32 like the torch path; results differ by rounding
only (tests/test_rwkv7_step.py bounds that).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from wkvm.models import fused

SOURCE = Path(__file__).with_name("step.cpp")
DECAY_SCALE = 0.606531  # exp(-0.5), as in BlinkDL's reference
NONE, TANH, SIGMOID = 0, 1, 2
ACTIVATIONS = {NONE: lambda t: t, TANH: torch.tanh, SIGMOID: torch.sigmoid}


@functools.cache
def available() -> bool:
    """Whether the step kernel runs here (built now if needed; `WKVM_FUSED=off` turns it off like every fused kernel);
    False, with one warning, when it cannot be built."""
    return fused.kernel_available(SOURCE, "wkvm_rwkv7", "wkv", "RWKV-7 step kernel",
                                  "decode runs its per-layer ops in torch (slower)")  # fmt: skip


def _runs(*xs: torch.Tensor | None) -> bool:
    """The kernel takes these (CPU float32 or absent; it checks their layout itself and says what it expects)."""
    return fused.cpu_fp32(*xs) and available()


def norm_shift_mix(x: torch.Tensor, add: torch.Tensor | None, ln_w: torch.Tensor, ln_b: torch.Tensor, eps: float,
                   shift: torch.Tensor, mix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """For one token per row (x, add, shift [B, C]; mix [M, C]): s = x + add, xx = layer_norm(s), the M token-shift
    mixes xx + (shift - xx) * mix[m] as [M, B, C]; shift becomes xx. Returns (s, mixes)."""
    mix = mix.reshape(-1, x.shape[-1])
    if _runs(x, add, ln_w, ln_b, shift, mix):
        s, mixed = torch.ops.wkvm_rwkv7.norm_shift_mix(x, add, ln_w, ln_b, eps, shift, mix)
        return s, mixed
    s = x if add is None else x + add
    xx = F.layer_norm(s, (s.shape[-1],), ln_w, ln_b, eps)
    mixed = torch.addcmul(xx, shift - xx, mix.unsqueeze(1))
    shift.copy_(xx)
    return s, mixed


def loras(xs: list[torch.Tensor], firsts: list[torch.Tensor], seconds: list[torch.Tensor],
          biases: list[torch.Tensor | None], inner: list[int], outer: list[int]) -> list[torch.Tensor]:  # fmt: skip
    """Low-rank chains ys[j] = outer_j(biases[j] + inner_j(xs[j] @ firsts[j]) @ seconds[j]) (xs [B, C], firsts
    [C, R], seconds [R, C]; activations NONE, TANH or SIGMOID), run side by side."""
    if _runs(*xs, *firsts, *seconds, *biases):
        ys: list[torch.Tensor] = torch.ops.wkvm_rwkv7.loras(xs, firsts, seconds, biases, inner, outer)
        return ys
    out = []
    for x, first, second, bias, act_in, act_out in zip(xs, firsts, seconds, biases, inner, outer, strict=True):
        h = ACTIVATIONS[act_in](x @ first) @ second
        out.append(ACTIVATIONS[act_out](h if bias is None else bias + h))
    return out


def wkv(S: torch.Tensor, r: torch.Tensor, decay: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        v_first: torch.Tensor, v_mix: torch.Tensor | None, a: torch.Tensor, g: torch.Tensor, w: dict[str, torch.Tensor],
        gn_eps: float, tokens: int = 1) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """A time mix's work between its matmuls for `tokens` tokens of each row of S (rows [B * tokens, C], row b's
    tokens in order; S [B, H, N, N] advances in place): k, v adjusted (v toward v_first by v_mix unless v_mix is
    None), the wkv recurrence with decay exp(-0.606531 * decay), group norm, the r.k bonus, times the gate g. `w`
    holds the layer's att.k_k, att.k_a, att.r_k, att.ln_x.weight and att.ln_x.bias. Returns (the output
    projection's input, the v used). Several tokens run the one-token arithmetic in order (the kernel's prefill; for
    head sizes 32, 64 and 128 on the head's transpose, so the state's sums are taken in another order)."""
    vecs = [w["att.k_k"], w["att.k_a"], w["att.r_k"], w["att.ln_x.weight"], w["att.ln_x.bias"]]
    rows = (r, decay, k, v, v_first, v_mix, a, g)
    if _runs(S, *rows, *vecs):
        out, v_used = torch.ops.wkvm_rwkv7.wkv(S, r, decay, k, v, v_first, v_mix, a, g, *vecs, gn_eps, tokens)
        return out, v_used
    if tokens == 1:
        return _torch_wkv(S, r, decay, k, v, v_first, v_mix, a, g, vecs, gn_eps)
    def token(x: torch.Tensor, j: int) -> torch.Tensor:
        return x.view(S.shape[0], tokens, -1)[:, j]

    outs = [_torch_wkv(S, token(r, j), token(decay, j), token(k, j), token(v, j), token(v_first, j),
                       None if v_mix is None else token(v_mix, j), token(a, j), token(g, j), vecs, gn_eps)
            for j in range(tokens)]  # fmt: skip
    B = S.shape[0]
    out, v_used = (torch.stack([pair[n] for pair in outs], 1).view(B * tokens, -1) for n in (0, 1))
    return out, v_used


def _torch_wkv(S: torch.Tensor, r: torch.Tensor, decay: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               v_first: torch.Tensor, v_mix: torch.Tensor | None, a: torch.Tensor, g: torch.Tensor,
               vecs: list[torch.Tensor], gn_eps: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    from wkvm.models.rwkv7.wkv import wkv_step

    k_k, k_a, r_k, ln_w, ln_b = vecs
    B, H, N, _ = S.shape
    C = H * N
    kk = F.normalize((k * k_k).view(B, H, N), dim=-1, p=2.0).view(B, C)
    k = k * (1 + (a - 1) * k_a)
    if v_mix is not None:
        v = v + (v_first - v) * v_mix
    log_w = decay * -DECAY_SCALE
    heads = S.reshape(B * H, N, N)  # a copy when S's rows are strided (a slice of an arena)
    o = wkv_step(heads, *(t.reshape(B * H, N) for t in (r, log_w, k, v, -kk, kk * a)))
    if heads.data_ptr() != S.data_ptr():
        S.copy_(heads.view(S.shape))
    o = F.group_norm(o.view(B, C), H, ln_w, ln_b, gn_eps)
    bonus = ((r * k).view(B, H, N) * r_k.view(H, N)).sum(-1, keepdim=True) * v.view(B, H, N)
    return (o + bonus.view(B, C)) * g, v


def layer(x: torch.Tensor, v_first: torch.Tensor, att_shift: torch.Tensor, S: torch.Tensor, ffn_shift: torch.Tensor,
          w: list[torch.Tensor | None], kernel: tuple[str, list[int]], ln_eps: float, gn_eps: float,
          tokens: int = 1) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """A whole layer for one token a row (x [B, C]) in one call: model.py's `_decode_layer`, the same ops in the same
    order (its six matrices on the native `kernel`, `linear.native_kernel`), so the same bits. `w`: the layer's
    tensors in `model.STEP_LAYER_KEYS` order. With `tokens` T, x and v_first are [B * T, C] (row b's tokens in
    order) and the bits are those of T one-token calls where the kernel's rows do not mix (`_steps_layer`). Only
    where `available()`."""
    y, v = torch.ops.wkvm_rwkv7.layer(x, v_first, att_shift, S, ffn_shift, w, *kernel, ln_eps, gn_eps, tokens)
    return y, v


def relu_square(x: torch.Tensor) -> torch.Tensor:
    """relu(x)^2 for rows [B, C]."""
    if _runs(x):
        y: torch.Tensor = torch.ops.wkvm_rwkv7.relu_square(x)
        return y
    return torch.relu(x).square_()
