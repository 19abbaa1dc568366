"""Mamba2 in the conformance suite: a tiny random HF `Mamba2ForCausalLM` directory (transformers writes it)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

NAME = "mamba2"
TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_heads": 8, "head_dim": 16, "state_size": 16, "n_groups": 2,
        "expand": 2, "conv_kernel": 4}  # fmt: skip


def random_model(seed: int = 0, **config):
    """A transformers Mamba2ForCausalLM with random weights spread wider than its init (decays from fast to slow,
    D, dt and norm weights away from their constants), so that every term of the recurrence shows in the logits."""
    from transformers import Mamba2Config, Mamba2ForCausalLM

    torch.manual_seed(seed)
    model = Mamba2ForCausalLM(Mamba2Config(**config)).eval()
    with torch.no_grad():
        for layer in model.backbone.layers:
            m = layer.mixer
            m.A_log.copy_(torch.empty_like(m.A_log).uniform_(math.log(0.5), math.log(8.0)))
            m.dt_bias.copy_(torch.randn_like(m.dt_bias) - 1.0)
            m.D.copy_(torch.randn_like(m.D))
            m.norm.weight.copy_(1 + 0.2 * torch.randn_like(m.norm.weight))
            m.conv1d.weight.mul_(2.0)
            for proj in (m.in_proj, m.out_proj):
                if proj.bias is not None:
                    proj.bias.copy_(0.1 * torch.randn_like(proj.bias))
            layer.norm.weight.copy_(1 + 0.2 * torch.randn_like(layer.norm.weight))
    return model


def write_checkpoint(path: Path, vocab_size: int, seed: int = 0) -> Path:
    random_model(seed, vocab_size=vocab_size, **TINY).save_pretrained(path)
    return path
