"""Granite 4.0 H in the conformance suite: a tiny random HF `GraniteMoeHybridForCausalLM` without experts (Mamba2
layers with an attention layer among them, no positions, Granite's multipliers), written by transformers."""

from __future__ import annotations

from pathlib import Path

import torch

from families.bamba import randomize

NAME = "granite_hybrid"


def tiny_config(vocab_size: int, **overrides):
    from transformers import GraniteMoeHybridConfig

    shape = dict(vocab_size=vocab_size, hidden_size=64, shared_intermediate_size=96, num_local_experts=0,
                 num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                 layer_types=["mamba", "attention", "mamba"], position_embedding_type="nope", mamba_n_heads=8,
                 mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
                 mamba_chunk_size=16, embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2,
                 logits_scaling=2.0, tie_word_embeddings=False, pad_token_id=None, bos_token_id=None,
                 eos_token_id=None)  # fmt: skip
    shape.update(overrides)
    return GraniteMoeHybridConfig(**shape)


def write_checkpoint(path: Path, vocab_size: int, seed: int = 0) -> Path:
    from transformers import GraniteMoeHybridForCausalLM

    torch.manual_seed(seed)
    model = GraniteMoeHybridForCausalLM(tiny_config(vocab_size)).eval()
    randomize(model)
    model.save_pretrained(path, safe_serialization=True)
    return path
