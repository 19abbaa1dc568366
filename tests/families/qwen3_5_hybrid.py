"""A Qwen3.5 hybrid in the conformance suite: Gated DeltaNet and gated full-attention layers (3:1, the released
models' ratio) in one state: fixed slots for the GDN layers, paged keys and values for the attention layer."""

from pathlib import Path

import torch

from families.qwen3_5 import randomize, tiny_config

NAME = "qwen3_5"  # the registry's family: a hybrid is a Qwen3.5 checkpoint whose layer_types mix both kinds


def write_checkpoint(path: Path, vocab_size: int, seed: int = 0) -> Path:
    from transformers import Qwen3_5ForCausalLM

    torch.manual_seed(seed)
    kinds = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
    cfg = tiny_config(vocab_size, num_hidden_layers=4, layer_types=kinds, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16)  # fmt: skip
    model = Qwen3_5ForCausalLM(cfg).eval()
    randomize(model)
    model.save_pretrained(path, safe_serialization=True)
    return path
