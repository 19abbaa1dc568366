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


def write_gguf(path: Path, model, qtype: str, rope: bool = False) -> dict:
    """A GGUF of `model` as llama.cpp's converter writes one (`conversion/granite.py` `GraniteHybridModel`: the
    tensors as `write_mamba2_hybrid_gguf` writes them, input_linear split into ffn_gate and ffn_up; the multipliers as
    scales; a key-value head count per layer, 0 for Mamba2 layers; RoPE switched off unless `rope`), every matrix in
    `qtype` (the rest F32); returns {HF name: the values a reader dequantizes, in HF's layout}."""
    import gguf

    c = model.config

    def metadata(w: gguf.GGUFWriter) -> None:
        w.add_context_length(2**20)
        w.add_feed_forward_length(c.shared_intermediate_size)
        w.add_head_count_kv([c.num_key_value_heads if k == "full_attention" else 0 for k in c.layer_types])
        w.add_layer_norm_rms_eps(c.rms_norm_eps)
        w.add_attention_scale(c.attention_multiplier)
        w.add_embedding_scale(c.embedding_multiplier)
        w.add_residual_scale(c.residual_multiplier)
        w.add_logit_scale(c.logits_scaling)
        w.add_ssm_conv_kernel(c.mamba_d_conv)
        w.add_ssm_state_size(c.mamba_d_state)
        w.add_ssm_group_count(c.mamba_n_groups)
        w.add_ssm_inner_size(c.mamba_expand * c.hidden_size)
        w.add_ssm_time_step_rank(c.mamba_n_heads)
        w.add_rope_scaling_finetuned(rope)  # llama.cpp's switch for RoPE (Bamba's conversion sets it)

    return write_mamba2_hybrid_gguf(path, model, qtype, gguf.MODEL_ARCH.GRANITE_HYBRID, metadata, c.mamba_n_groups)


def write_mamba2_hybrid_gguf(path: Path, model, qtype: str, arch, metadata, groups: int) -> dict:
    """`model`'s tensors as llama.cpp's converter writes a Mamba2 hybrid's (`Mamba2Model` and `GraniteHybridModel`:
    gguf's names for `arch`; A as -exp(A_log) and D as [H, 1]; the conv squeezed; the gated norm as [groups,
    d_inner / groups]; q and k rows permuted for llama.cpp's RoPE; a dense shared MLP's input_linear as ffn_gate and
    ffn_up), every matrix in `qtype` (the rest F32), with `metadata(writer)`'s keys; returns {HF name: the values a
    reader dequantizes, in HF's layout}."""
    import gguf
    import numpy as np
    from gguf.quants import dequantize, quantize

    from families.llama import permute

    c = model.config
    layers = len(c.layer_types)
    names = gguf.get_tensor_name_map(arch, layers)
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    w.add_block_count(layers)
    w.add_embedding_length(c.hidden_size)
    w.add_head_count(c.num_attention_heads)
    metadata(w)
    stored: dict[str, list] = {}

    def add(gguf_name: str, a: np.ndarray, hf: str, back) -> None:
        q = gguf.GGMLQuantizationType[qtype] if gguf_name.split(".")[-2] in (
            "ssm_in", "ssm_out", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
            "output", "token_embd") else gguf.GGMLQuantizationType.F32  # fmt: skip
        data = quantize(a.astype(np.float32), q)
        w.add_tensor(gguf_name, data, raw_dtype=q)
        stored.setdefault(hf, []).append(back(dequantize(data, q).reshape(a.shape)))

    def mapped(hf: str) -> str:  # the converter renames Nemotron-H's model.layers.*.mixer.* to backbone.layers.
        found = names.get_name(hf) or names.get_name(hf.replace("model.", "backbone.", 1))
        assert found is not None, hf
        return found

    for name, t in model.state_dict().items():
        a = t.numpy()
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        if name.endswith("shared_mlp.input_linear.weight"):
            i = name.split(".")[2]
            gate, up = np.split(a, 2)
            add(f"blk.{i}.ffn_gate.weight", gate, name, lambda x: x)
            add(f"blk.{i}.ffn_up.weight", up, name, lambda x: x)
            continue
        base = name.removesuffix(".weight").removesuffix(".bias")
        if name.endswith("shared_mlp.output_linear.weight"):  # dense: the converter's plain ffn_down
            gname = f"blk.{name.split('.')[2]}.ffn_down.weight"
        elif name.endswith(".dt_bias"):
            gname = mapped(base.removesuffix(".dt_bias") + ".dt_proj") + ".bias"
        elif name.endswith(("A_log", ".D")):
            gname = mapped(name)
        else:
            gname = mapped(base) + name[len(base) :]
        back = lambda x: x  # noqa: E731
        if name.endswith("A_log"):
            a = (-torch.exp(t)).numpy().reshape(-1, 1)  # as the converter computes it (torch, not numpy)
            back = lambda x: torch.log(-torch.from_numpy(x.copy())).numpy().reshape(-1)  # noqa: E731
        elif name.endswith(".D"):
            a, back = a.reshape(-1, 1), lambda x: x.reshape(-1)  # noqa: E731
        elif name.endswith("conv1d.weight"):
            a, back = a.squeeze(1), lambda x: x[:, None, :]  # noqa: E731
        elif name.endswith(("mamba.norm.weight", "mixer.norm.weight")):
            a, back = a.reshape(groups, -1), lambda x: x.reshape(-1)  # noqa: E731
        elif name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = c.num_attention_heads if "q_proj" in name else c.num_key_value_heads
            a, back = permute(a, heads), lambda x, h=heads: permute_back(x, h)  # noqa: E731
        add(gname, a, name, back)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {k: np.concatenate(v) if len(v) > 1 else v[0] for k, v in stored.items()}


def permute_back(w, n_head: int):
    """llama.cpp's q / k row order back to HF's (wkvm's `gguf_file.unpermute` on numpy)."""
    from wkvm.models.llama.gguf_file import unpermute

    return unpermute(torch.from_numpy(w.copy()), n_head).numpy()
