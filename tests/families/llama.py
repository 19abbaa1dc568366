"""Llama in the conformance suite: a tiny random HF `LlamaForCausalLM` directory (transformers writes it), with
grouped-query attention and llama3 RoPE scaling. Its state is all paged keys and values: the suite runs every state
operation on a state that grows with the context. Also a model written as llama.cpp's converter writes a GGUF
(`write_gguf`), for the GGUF tests."""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import TYPE_CHECKING

import gguf
import numpy as np
import torch
from gguf.quants import dequantize, quantize

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM

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


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute (HF half-split RoPE rows -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}  # fmt: skip


def gguf_tensors(model: LlamaForCausalLM) -> dict[str, np.ndarray]:
    """The GGUF names and fp32 arrays (Q and K permuted) llama.cpp's converter writes for `model`."""
    c = model.config
    out = {}
    for name, t in model.state_dict().items():
        a = t.float().numpy()
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = a
        elif name == "model.norm.weight":
            out["output_norm.weight"] = a
        elif name == "lm_head.weight":
            if not c.tie_word_embeddings:  # tied: the converter writes no output.weight
                out["output.weight"] = a
        else:
            _, _, i, *rest = name.split(".")
            key = ".".join(rest[:-1])
            if key == "self_attn.q_proj":
                a = permute(a, c.num_attention_heads)
            elif key == "self_attn.k_proj":
                a = permute(a, c.num_key_value_heads)
            out[f"blk.{i}.{GGUF_NAMES[key]}.weight"] = a
    return out


# K-quants (256-value super-blocks): where each block's float16 scales sit (d, and dmin where there is one), and a
# value for them that keeps the weights at ~0.1 (the blocks' own scales and values are random). The `gguf` package
# reads these (its numpy reference of llama.cpp's) but cannot write them
K_SCALES = {"Q2_K": ((80, 82), 2e-3), "Q3_K": ((108,), 1e-3), "Q4_K": ((0, 2), 1e-4), "Q5_K": ((0, 2), 1e-4),
            "Q6_K": ((208,), 1e-4)}  # fmt: skip


def k_quant_blocks(shape: tuple[int, ...], q: gguf.GGMLQuantizationType, seed: int = 0) -> np.ndarray:
    """Random K-quant blocks for a [rows, cols] matrix (cols a multiple of 256): random bytes from `seed` (one per
    tensor: matrices of one shape must differ, or a swapped mapping could not show), each block's float16 scales set
    as K_SCALES says. Not a quantization of anything: the tests compare against the values a reader dequantizes."""
    block, size = gguf.GGML_QUANT_SIZES[q]
    rows, cols = shape
    data = np.random.default_rng(seed).integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    offsets, scale = K_SCALES[q.name]
    for at in offsets:
        data[:, :, at : at + 2] = np.frombuffer(np.float16(scale).tobytes(), np.uint8)
    return data.reshape(rows, cols // block * size)


def write_gguf(path: Path, model: LlamaForCausalLM, qtype: str, extra=None, types=None) -> dict[str, np.ndarray]:
    """A GGUF of `model` with every matrix in `qtype` (norms F32) but those `types` names ({tensor name: type});
    returns the arrays as a reader dequantizes them. `extra(writer)` adds more metadata."""
    c = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    if extra is not None:
        extra(w)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(256)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_dimension_count(c.head_dim)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    stored = {}
    for name, a in gguf_tensors(model).items():
        q = gguf.GGMLQuantizationType.F32 if a.ndim == 1 else gguf.GGMLQuantizationType[(types or {}).get(name, qtype)]
        data = k_quant_blocks(a.shape, q, zlib.crc32(name.encode())) if q.name in K_SCALES else quantize(a, q)
        w.add_tensor(name, data, raw_dtype=q)
        stored[name] = dequantize(data, q).reshape(a.shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored
