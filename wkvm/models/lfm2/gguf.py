"""llama.cpp GGUF files of architecture `lfm2`, read into the HF names and an HF-style config dict.

llama.cpp's converter (`conversion/lfm2.py`) writes HF's tensors under gguf's LFM2 names (`model.embedding_norm`, the
final norm, as `token_embd_norm`; `operator_norm` as `attn_norm`; w1 / w3 / w2 as ffn_gate / up / down), the conv's
[C, 1, K] squeezed to [C, K], no row reordering (LFM2's RoPE is the half-split one in both), and
`attention.head_count_kv` per layer, 0 for a conv layer. Tensors are dequantized to fp32 when read, as for Llama
(`llama/gguf_file.py`, whose reading, checks and dequantization this uses); the tokenizer and chat template come
from the metadata (`llama/gguf_text.py`; llama.cpp's `lfm2` pre-tokenizer is Llama 3's split).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from wkvm.models.family import CheckpointError, RawTensors
from wkvm.models.lfm2.model import ATTENTION, CONV, EMBED, FINAL_NORM, HEAD, PREFIX
from wkvm.models.llama import gguf_file
from wkvm.models.llama.gguf_file import meta_number

ARCHITECTURE = "lfm2"
GLOBAL_NAMES = {"token_embd.weight": EMBED, "token_embd_norm.weight": FINAL_NORM, "output.weight": HEAD}
LAYER_NAMES = {
    "shortconv.conv": "conv.conv", "shortconv.in_proj": "conv.in_proj", "shortconv.out_proj": "conv.out_proj",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.out_proj", "attn_q_norm": "self_attn.q_layernorm", "attn_k_norm": "self_attn.k_layernorm",
    "ffn_gate": "feed_forward.w1", "ffn_up": "feed_forward.w3", "ffn_down": "feed_forward.w2",
    "attn_norm": "operator_norm", "ffn_norm": "ffn_norm",
}  # fmt: skip
MATRICES = tuple(k for k in LAYER_NAMES if not k.endswith("norm") and k != "shortconv.conv")


def hf_name(name: str) -> str:
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    parts = name.split(".")
    kind = ".".join(parts[2:-1])
    if len(parts) >= 4 and parts[0] == "blk" and parts[-1] == "weight" and kind in LAYER_NAMES:
        return f"{PREFIX}{parts[1]}.{LAYER_NAMES[kind]}.weight"
    raise CheckpointError(f"GGUF tensor {name!r} is not part of an LFM2 wkvm reads (LFM2-MoE, fused q/k/v, biases "
                          "and extras are not read)")  # fmt: skip


def hf_config(meta: dict[str, Any], vocab: int, tied: bool) -> dict[str, Any]:
    """The config.json an HF `Lfm2ForCausalLM` of these dimensions would have: the layer kinds from the per-layer
    key-value head counts (0: a conv layer, as llama.cpp reads them)."""
    a = ARCHITECTURE + "."
    layers, width = meta_number(meta, a + "block_count"), meta_number(meta, a + "embedding_length")
    heads = meta_number(meta, a + "attention.head_count")
    kv = gguf_file.per_layer(meta, a + "attention.head_count_kv", layers, heads)
    kv_heads = sorted({n for n in kv if n})
    if heads <= 0 or width <= 0 or len(kv_heads) > 1 or min(kv, default=0) < 0:
        raise CheckpointError(f"GGUF metadata {a}attention.head_count {heads}, head_count_kv {kv} and embedding_length "
                              f"{width}: not an LFM2 wkvm runs (one key-value head count for every attention layer)")
    head_dim = meta_number(meta, a + "attention.key_length", width // heads)
    for key in ("attention.value_length", "rope.dimension_count"):
        if meta_number(meta, a + key, head_dim) != head_dim:
            raise CheckpointError(f"GGUF metadata {a}{key} is not the head size {head_dim}: not an LFM2 wkvm runs")
    if meta_number(meta, a + "attention.sliding_window", 0) > 0:
        raise CheckpointError("GGUF LFM2 with sliding-window attention is not supported")
    if meta.get(a + "rope.scaling.type", "none") not in ("none", "linear") or meta.get(a + "rope.scaling.factor",
                                                                                      1.0) not in (0.0, 1.0):
        raise CheckpointError("GGUF LFM2 with RoPE scaling is not supported")  # fmt: skip
    cfg: dict[str, Any] = {
        "model_type": "lfm2", "architectures": ["Lfm2ForCausalLM"], "hidden_size": width,
        "intermediate_size": meta_number(meta, a + "feed_forward_length"), "block_auto_adjust_ff_dim": False,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads[0] if kv_heads else
        heads, "head_dim": head_dim, "layer_types": [ATTENTION if n else CONV for n in kv],
        "conv_L_cache": meta_number(meta, a + "shortconv.l_cache", 3), "conv_bias": False,
        "norm_eps": meta_number(meta, a + "attention.layer_norm_rms_epsilon", kind=float), "vocab_size": vocab,
        "max_position_embeddings": meta_number(meta, a + "context_length", 128000), "tie_word_embeddings": tied,
        # llama.cpp's default base where the file names none
        "rope_parameters": {"rope_type": "default", "rope_theta": meta_number(meta, a + "rope.freq_base", 10000.0,
                                                                              float)},
    }  # fmt: skip
    for key in ("bos", "eos"):
        if f"tokenizer.ggml.{key}_token_id" in meta:
            cfg[f"{key}_token_id"] = meta_number(meta, f"tokenizer.ggml.{key}_token_id")
    return cfg


def read(path: Path) -> tuple[RawTensors, dict[str, Any]]:
    """Raw tensors under HF names (made when read: each dequantized to fp32 then, the conv's taps given back their
    middle axis) and an HF-style config dict."""
    reader, meta = gguf_file.open_architecture(path, ARCHITECTURE)
    try:
        tensors = {hf_name(t.name): t for t in reader.tensors}
        config = hf_config(meta, gguf_file.vocab_size(path, reader, tensors.get(EMBED)), tied=HEAD not in tensors)
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None
    gguf_file.check_block_count(path, reader, ARCHITECTURE, config["num_hidden_layers"])
    return gguf_file.lazy_tensors(path, {name: [t] for name, t in tensors.items()}, {}), config
