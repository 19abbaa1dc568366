"""Llama in the conformance suite: a tiny random HF `LlamaForCausalLM` directory (transformers writes it), with
grouped-query attention and llama3 RoPE scaling. Its state is all paged keys and values: the suite runs every state
operation on a state that grows with the context."""

from __future__ import annotations

from pathlib import Path

import torch

NAME = "llama"
TINY = {"hidden_size": 48, "intermediate_size": 64, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 8,
        "num_hidden_layers": 2, "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500.0, "factor": 4.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 2.0, "original_max_position_embeddings": 16}}  # fmt: skip


def write_checkpoint(path: Path, vocab_size: int, seed: int = 0, **shape: object) -> Path:
    """`shape`: config fields other than TINY's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=None,
                      pad_token_id=None, **{**TINY, **shape})  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # wider than the init, so that attention is far from uniform and every token shows
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + 1.0 if p.ndim == 1 else torch.randn_like(p) * 0.15)
    model.save_pretrained(path)
    return path
