"""Bamba in the conformance suite: a tiny random HF `BambaForCausalLM` (Mamba2 layers with an attention layer
among them), written by transformers."""

from __future__ import annotations

import math
from pathlib import Path

import torch

NAME = "bamba"


def tiny_config(vocab_size: int, **overrides):
    from transformers import BambaConfig

    shape = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=8,
                 mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
                 mamba_chunk_size=16, tie_word_embeddings=False, pad_token_id=None, bos_token_id=None,
                 eos_token_id=None)  # fmt: skip
    shape.update(overrides)
    return BambaConfig(**shape)


def randomize(model: torch.nn.Module) -> None:
    """Decays from fast to slow, D and norms away from their constants: every term shows in the logits."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(math.log(0.5), math.log(8.0)))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn_like(p) - 1.0)
            elif name.endswith(".D"):
                p.copy_(torch.randn_like(p))
            elif p.ndim == 1:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif "conv1d" in name:
                p.copy_(torch.randn_like(p) * 0.5)
            else:
                p.copy_(torch.randn_like(p) * 0.1)


def write_checkpoint(path: Path, vocab_size: int, seed: int = 0) -> Path:
    from transformers import BambaForCausalLM

    torch.manual_seed(seed)
    model = BambaForCausalLM(tiny_config(vocab_size)).eval()
    randomize(model)
    model.save_pretrained(path, safe_serialization=True)
    return path
