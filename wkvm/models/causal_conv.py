"""The short depthwise causal conv + SiLU in front of Mamba2's SSM and Gated DeltaNet's delta rule, token-major.

x [B, T, C] continues a window of the last K-1 inputs [B, C, K-1] (the state's layout, updated in place). Prefill
runs the conv on the token-major sequence seen as a channels-last image [B, C, 1, K-1+T] (no transpose of x or of
the result): on CPU in fp32 as oneDNN's depthwise conv with SiLU fused, 1.0-1.3 ms at 1,024 tokens x 2,048 channels
against 14 ms for conv1d over a channel-major copy then SiLU (AMD EPYC Zen 4, 2 threads). Its result is
token-major and contiguous, which the chunked recurrences after it read fast. Results equal the conv1d form up to
fp32 rounding.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from wkvm.models import linear


def _onednn(image: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    C = weight.shape[0]
    out: torch.Tensor = torch.ops.mkldnn._convolution_pointwise(image, weight, bias, [0, 0], [1, 1], [1, 1], C,
                                                                "swish", [], "")  # fmt: skip
    return out


@functools.cache
def onednn_conv_silu() -> bool:
    """oneDNN's conv with SiLU fused runs here (a private op: proven to compute conv2d + SiLU before it is trusted)."""
    if not linear.onednn_available() or not hasattr(torch.ops.mkldnn, "_convolution_pointwise"):
        return False
    try:
        x, w, b = torch.randn(2, 9, 6).permute(0, 2, 1).unsqueeze(2), torch.randn(6, 1, 1, 3), torch.randn(6)
        want = F.silu(F.conv2d(x, w, b, groups=6))
        return bool(torch.allclose(_onednn(x, w, b), want, rtol=1e-5, atol=1e-5))
    except RuntimeError:
        return False


def causal_conv_silu(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """silu(depthwise causal conv of x [B, T, C] after `window` [B, C, K-1]) -> [B, T, C]; weight [C, K], bias [C]
    or None. The window advances in place to the last K-1 inputs."""
    B, T, C = x.shape
    K = weight.shape[1]
    if T == 1:
        full = torch.cat([window, x.transpose(1, 2)], -1)  # [B, C, K]
        window.copy_(full[:, :, 1:])
        out = torch.einsum("bck,ck->bc", full, weight)
        return F.silu(out if bias is None else out.add_(bias)).unsqueeze(1)
    full = torch.cat([window.transpose(1, 2), x], 1)  # [B, K-1+T, C], token-major
    window.copy_(full[:, T:].transpose(1, 2))
    image = full.permute(0, 2, 1).unsqueeze(2)  # [B, C, 1, K-1+T] whose memory is channels-last
    kernel = weight.view(C, 1, 1, K)
    if x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32 and onednn_conv_silu():
        out = _onednn(image, kernel, bias)
    else:
        out = F.silu(F.conv2d(image, kernel, bias, groups=C))
    return out.squeeze(2).transpose(1, 2)  # [B, T, C], contiguous when the conv kept channels-last
