"""llama.cpp GGUF files of architecture `granitehybrid` (Granite 4.0 H), read into the HF names and an HF-style
config dict.

llama.cpp's converter (`conversion/granite.py`, `GraniteHybridModel`, with `Mamba2Model`'s tensors) writes: the
Mamba2 mixers as `ssm_*` (A as -exp(A_log) in `ssm_a` [H, 1], D as [H, 1], `dt_bias` as `ssm_dt.bias`, the conv's
[C, 1, K] squeezed, the gated norm as [groups, d_inner / groups]); the shared MLP's input_linear split into
`ffn_gate` and `ffn_up`; q and k rows in llama.cpp's RoPE order (`undo_permute`; put back here, as for Llama);
Granite's multipliers as `embedding_scale`, `residual_scale`, `attention.scale` and `logit_scale`; a key-value head
count per layer, 0 for a Mamba2 layer; and `rope.scaling.finetuned` as the switch for RoPE, false for Granite 4.0 H
(no positions). Tensors are dequantized to fp32 when read (`llama/gguf_file.py`); A goes back to A_log as log(-A).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gguf import ReaderTensor

from wkvm.models.bamba.model import HEAD, PREFIX
from wkvm.models.family import CheckpointError, RawTensors
from wkvm.models.granite_hybrid.model import EMBED, FINAL_NORM
from wkvm.models.llama import gguf_file
from wkvm.models.llama.gguf_file import meta_number

ARCHITECTURE = "granitehybrid"
GLOBAL_NAMES = {"token_embd.weight": EMBED, "output_norm.weight": FINAL_NORM, "output.weight": HEAD}
LAYER_NAMES = {
    "ssm_in.weight": "mamba.in_proj.weight", "ssm_conv1d.weight": "mamba.conv1d.weight",
    "ssm_conv1d.bias": "mamba.conv1d.bias", "ssm_dt.bias": "mamba.dt_bias", "ssm_a": "mamba.A_log", "ssm_d": "mamba.D",
    "ssm_norm.weight": "mamba.norm.weight", "ssm_out.weight": "mamba.out_proj.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_down.weight": "shared_mlp.output_linear.weight", "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}  # fmt: skip
GATE_UP = ("ffn_gate.weight", "ffn_up.weight")  # one HF matrix: shared_mlp.input_linear, gate rows then up rows
MATRICES = ("ssm_in", "ssm_out", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def hf_config(meta: dict[str, Any], vocab: int, tied: bool, conv_bias: bool) -> dict[str, Any]:
    """The config.json an HF `GraniteMoeHybridForCausalLM` of these dimensions would have."""
    a = ARCHITECTURE + "."
    layers, width = meta_number(meta, a + "block_count"), meta_number(meta, a + "embedding_length")
    heads = meta_number(meta, a + "attention.head_count")
    kv = gguf_file.per_layer(meta, a + "attention.head_count_kv", layers, heads)
    kv_heads = sorted({n for n in kv if n})
    if heads <= 0 or width <= 0 or len(kv_heads) > 1 or min(kv, default=0) < 0:
        raise CheckpointError(f"GGUF metadata {a}attention.head_count {heads}, head_count_kv {kv} and embedding_length "
                              f"{width} for {layers} layers: not a Granite 4.0 H wkvm runs (one key-value head count "
                              "for every attention layer)")  # fmt: skip
    if meta.get(a + "rope.scaling.finetuned", True) is not False:  # llama.cpp's switch for RoPE, default on
        raise CheckpointError("GGUF granitehybrid with RoPE (Bamba's conversion) is not supported: wkvm reads Granite "
                              "4.0 H files (no positions); give Bamba as its HF directory")  # fmt: skip
    if meta_number(meta, a + "expert_count", 0):
        raise CheckpointError("GGUF Granite 4.0 H with experts (Tiny / Small) is not supported")
    head_dim = width // heads  # the converter drops head_dim, as llama.cpp derives it
    scales = {"embedding_multiplier": "embedding_scale", "residual_multiplier": "residual_scale",
              "attention_multiplier": "attention.scale", "logits_scaling": "logit_scale"}
    cfg: dict[str, Any] = {
        "model_type": "granitemoehybrid", "architectures": ["GraniteMoeHybridForCausalLM"], "hidden_size": width,
        "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads[0] if kv_heads else heads, "head_dim": head_dim,
        "layer_types": ["attention" if n else "mamba" for n in kv], "position_embedding_type": "nope",
        "num_local_experts": 0, "rms_norm_eps": meta_number(meta, a + "attention.layer_norm_rms_epsilon", kind=float),
        "mamba_n_groups": meta_number(meta, a + "ssm.group_count", 1),
        "mamba_d_state": meta_number(meta, a + "ssm.state_size"), "mamba_conv_bias": conv_bias,
        "vocab_size": vocab, "max_position_embeddings": meta_number(meta, a + "context_length", 4096),
        "tie_word_embeddings": tied,
    }  # fmt: skip
    for key, name in scales.items():
        value = meta_number(meta, a + name, 0.0, float)
        # llama.cpp: a scale of 0 (or none) is no scaling; attention's is then 1/sqrt(head size)
        cfg[key] = value if value else (head_dim**-0.5 if key == "attention_multiplier" else 1.0)
    return cfg


def read(path: Path) -> tuple[RawTensors, dict[str, Any]]:
    """Raw tensors under HF names (each made when read: dequantized to fp32, reshaped to HF's shape, q and k rows put
    back, gate and up joined, A as A_log) and an HF-style config dict."""
    reader, meta = gguf_file.open_architecture(path, ARCHITECTURE)
    parts: dict[str, list[ReaderTensor]] = {}  # HF name -> the file's tensors that make it
    for t in reader.tensors:
        at = gguf_file.layer_part(t.name)
        if t.name in GLOBAL_NAMES:
            parts[GLOBAL_NAMES[t.name]] = [t]
        elif at is not None and at[1] in LAYER_NAMES:
            parts[f"{PREFIX}{at[0]}.{LAYER_NAMES[at[1]]}"] = [t]
        elif at is not None and at[1] in GATE_UP:
            parts.setdefault(f"{PREFIX}{at[0]}.shared_mlp.input_linear.weight", []).append(t)
        else:
            raise CheckpointError(f"{path}: GGUF tensor {t.name!r} is not part of a Granite 4.0 H wkvm reads (experts "
                                  "and extras are not read)")  # fmt: skip
    for name, ts in parts.items():
        if name.endswith("input_linear.weight"):
            order = [next((t for t in ts if t.name.endswith(g)), None) for g in GATE_UP]
            if None in order or len(ts) != 2:
                raise CheckpointError(f"{path}: GGUF layer {name.split('.')[2]} needs both ffn_gate and ffn_up")
            parts[name] = [t for t in order if t is not None]
    embed = parts.get(EMBED)
    try:
        conv_bias = any(n.endswith("mamba.conv1d.bias") for n in parts)
        config = hf_config(meta, gguf_file.vocab_size(path, reader, embed[0] if embed else None), HEAD not in parts,
                           conv_bias)  # fmt: skip
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None
    gguf_file.check_block_count(path, reader, ARCHITECTURE, config["num_hidden_layers"])
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    return gguf_file.lazy_tensors(path, parts, heads), config
