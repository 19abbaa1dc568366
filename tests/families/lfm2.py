"""LFM2 in the conformance suite: a tiny random HF `Lfm2ForCausalLM` (short-convolution layers with an attention
layer among them), written by transformers."""

from __future__ import annotations

from pathlib import Path

import torch

NAME = "lfm2"


def tiny_config(vocab_size: int, **overrides):
    from transformers import Lfm2Config

    shape = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, block_auto_adjust_ff_dim=False,
                 num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                 layer_types=["conv", "full_attention", "conv"], tie_word_embeddings=False, pad_token_id=None,
                 bos_token_id=None, eos_token_id=None)  # fmt: skip
    shape.update(overrides)
    return Lfm2Config(**shape)


def randomize(model: torch.nn.Module) -> None:
    """Norms away from 1 and taps large enough that every term shows in the logits."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("conv.conv.weight"):
                p.copy_(torch.randn_like(p) * 0.5)
            else:
                p.copy_(torch.randn_like(p) * 0.1)


def write_checkpoint(path: Path, vocab_size: int, seed: int = 0) -> Path:
    from transformers import Lfm2ForCausalLM

    torch.manual_seed(seed)
    model = Lfm2ForCausalLM(tiny_config(vocab_size)).eval()
    randomize(model)
    model.save_pretrained(path, safe_serialization=True)
    return path
