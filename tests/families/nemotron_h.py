"""Nemotron-H in the conformance suite: a tiny random HF `NemotronHForCausalLM` without experts (Mamba2, attention
and MLP layers), written by transformers."""

from __future__ import annotations

from pathlib import Path

import torch

from families.bamba import randomize

NAME = "nemotron_h"


def tiny_config(vocab_size: int, **overrides):
    from transformers import NemotronHConfig

    shape = dict(vocab_size=vocab_size, hidden_size=64, layers_block_type=["mamba", "mlp", "attention", "mamba"],
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96, mamba_num_heads=8,
                 mamba_head_dim=16, n_groups=2, ssm_state_size=16, conv_kernel=4, chunk_size=16,
                 tie_word_embeddings=False, pad_token_id=None, bos_token_id=None, eos_token_id=None)  # fmt: skip
    shape.update(overrides)
    return NemotronHConfig(**shape)


def write_checkpoint(path: Path, vocab_size: int, seed: int = 0) -> Path:
    from transformers import NemotronHForCausalLM

    torch.manual_seed(seed)
    model = NemotronHForCausalLM(tiny_config(vocab_size)).eval()
    randomize(model)
    model.save_pretrained(path, safe_serialization=True)
    return path
