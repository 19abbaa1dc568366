"""Qwen3.5 (Gated DeltaNet) in the conformance suite: a tiny random Qwen3_5ForCausalLM directory, every layer
linear attention, written by transformers."""

from pathlib import Path

import torch

NAME = "qwen3_5"


def tiny_config(vocab_size: int, **overrides):
    from transformers import Qwen3_5TextConfig

    shape = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, linear_conv_kernel_dim=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, tie_word_embeddings=False,
    )  # fmt: skip
    shape.update(overrides)
    shape.setdefault("layer_types", ["linear_attention"] * shape["num_hidden_layers"])
    return Qwen3_5TextConfig(**shape)


def randomize(model: torch.nn.Module) -> None:
    """Weights large enough that outputs vary by token: norms and biases away from their init, decays spread."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(-2.0, 1.5))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn_like(p))
            elif p.ndim == 1:
                p.copy_(torch.randn_like(p) * 0.2 + (1.0 if name.endswith("linear_attn.norm.weight") else 0.0))
            elif "conv1d" in name:
                p.copy_(torch.randn_like(p) * 0.5)
            else:
                p.copy_(torch.randn_like(p) * 0.08)


def write_checkpoint(path: Path, vocab_size: int, seed: int = 0) -> Path:
    from transformers import Qwen3_5ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(tiny_config(vocab_size)).eval()
    randomize(model)
    model.save_pretrained(path, safe_serialization=True)
    return path
