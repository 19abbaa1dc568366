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


def write_gguf(path: Path, model, qtype: str) -> dict:
    """A GGUF of `model` as llama.cpp's converter writes one (`conversion/nemotron.py` `NemotronHModel`, a
    `GraniteHybridModel`: its Mamba2 and attention tensors; per layer a key-value head count and a feed-forward length,
    0 where a layer has none; key and value lengths; the layer-norm eps)."""
    import gguf

    from families.granite_hybrid import write_mamba2_hybrid_gguf

    c = model.config

    def metadata(w: gguf.GGUFWriter) -> None:
        kinds = c.layers_block_type
        w.add_context_length(2**20)
        w.add_head_count_kv([c.num_key_value_heads if k == "full_attention" else 0 for k in kinds])
        w.add_feed_forward_length([c.intermediate_size if k == "mlp" else 0 for k in kinds])
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
        w.add_layer_norm_eps(c.layer_norm_epsilon)
        w.add_ssm_conv_kernel(c.conv_kernel)
        w.add_ssm_state_size(c.ssm_state_size)
        w.add_ssm_group_count(c.n_groups)
        w.add_ssm_inner_size(c.mamba_num_heads * c.mamba_head_dim)
        w.add_ssm_time_step_rank(c.mamba_num_heads)
        w.add_rope_scaling_finetuned(False)

    return write_mamba2_hybrid_gguf(path, model, qtype, gguf.MODEL_ARCH.NEMOTRON_H, metadata, c.n_groups)
