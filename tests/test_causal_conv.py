"""The shared causal conv + SiLU (Mamba2, Gated DeltaNet): oneDNN's fused channels-last conv and the torch fallback
equal conv1d over the channel-major sequence then SiLU, token by token equals all at once, and the window advances."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from wkvm.models import causal_conv
from wkvm.models.causal_conv import causal_conv_silu


def reference(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    full = torch.cat([window, x.transpose(1, 2)], -1)
    out = F.silu(F.conv1d(full, weight.unsqueeze(1), bias, groups=weight.shape[0])).transpose(1, 2)
    return out, full[:, :, -(weight.shape[1] - 1) :]


@pytest.mark.parametrize("onednn", [True, False])
@pytest.mark.parametrize("T", [1, 2, 37])
@pytest.mark.parametrize("with_bias", [True, False])
def test_equals_conv1d_and_advances_the_window(monkeypatch, onednn, T, with_bias):
    if onednn and not causal_conv.onednn_conv_silu():
        pytest.skip("torch here has no oneDNN conv with fused SiLU")
    monkeypatch.setattr(causal_conv, "onednn_conv_silu", lambda: onednn)
    torch.manual_seed(T)
    B, C, K = 2, 24, 4
    x = torch.randn(B, T, 3 * C)[..., C : 2 * C]  # a split of a projection: strided like the models' inputs
    weight, window = torch.randn(C, K), torch.randn(B, C, K - 1)
    bias = torch.randn(C) if with_bias else None
    want, want_window = reference(x, window, weight, bias)
    got = causal_conv_silu(x, window, weight, bias)
    assert got.shape == (B, T, C)
    assert (got - want).abs().max() < 1e-5
    assert torch.equal(window, want_window)


def test_token_by_token_equals_one_call():
    torch.manual_seed(0)
    B, T, C, K = 1, 9, 16, 4
    x, weight, bias = torch.randn(B, T, C), torch.randn(C, K), torch.randn(C)
    w1, w2 = torch.zeros(B, C, K - 1), torch.zeros(B, C, K - 1)
    at_once = causal_conv_silu(x, w1, weight, bias)
    steps = torch.cat([causal_conv_silu(x[:, t : t + 1], w2, weight, bias) for t in range(T)], 1)
    assert (at_once - steps).abs().max() < 1e-5
    assert torch.allclose(w1, w2)
