"""LFM2 in the conformance suite: a tiny random HF `Lfm2ForCausalLM` (short-convolution layers with an attention
layer among them), written by transformers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
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


def write_gguf(path: Path, model, qtype: str, extra=None) -> dict:
    """A GGUF of `model` as llama.cpp's converter writes one (`conversion/lfm2.py`: gguf's own LFM2 tensor names, the
    conv's [C, 1, K] squeezed to [C, K], a key-value head count per layer with 0 for conv layers), every matrix in
    `qtype` (norms and the conv's taps F32, as llama-quantize leaves them); returns the arrays as a reader
    dequantizes them. `extra(writer)` adds metadata (a tokenizer)."""
    import gguf
    from gguf.quants import dequantize, quantize

    c = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LFM2, c.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), "lfm2")
    if extra is not None:
        extra(w)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(model.model.layers[0].feed_forward.w1.out_features)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv([c.num_key_value_heads if k == "full_attention" else 0 for k in c.layer_types])
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_shortconv_l_cache(c.conv_L_cache)
    stored = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue  # tied: the converter writes no output.weight
        a = (t.squeeze(1) if name.endswith("conv.conv.weight") else t).numpy().astype(np.float32)
        gguf_name = names.get_name(name.removesuffix(".weight")) + ".weight"
        q = gguf.GGMLQuantizationType.F32 if a.ndim == 1 or "shortconv.conv" in gguf_name else \
            gguf.GGMLQuantizationType[qtype]  # fmt: skip
        data = quantize(a, q)
        w.add_tensor(gguf_name, data, raw_dtype=q)
        stored[name] = dequantize(data, q).reshape(a.shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored
