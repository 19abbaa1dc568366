"""llama.cpp GGUF files of architecture `nemotron_h` (Nemotron-H without experts), read into the HF names and an
HF-style config dict.

llama.cpp's converter (`conversion/nemotron.py`, `NemotronHModel`, a `GraniteHybridModel`) writes the Mamba2 mixers
as Granite 4.0 H's (`ssm_*`, A as -exp(A_log), D and the gated norm reshaped, the conv squeezed), attention as
`attn_*` with q and k rows in llama.cpp's RoPE order, the MLP layers as `ffn_up` / `ffn_down`, each layer's norm as
`attn_norm`, and per layer both a key-value head count and a feed-forward length: attention layers have heads, MLP
layers a length, Mamba2 layers neither. Tensors are made as Granite's reader makes them (`granite_hybrid/gguf.py`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gguf import ReaderTensor

from wkvm.models.bamba.model import ATTENTION, HEAD, MAMBA, PREFIX
from wkvm.models.family import CheckpointError, RawTensors
from wkvm.models.llama import gguf_file
from wkvm.models.llama.gguf_file import meta_number
from wkvm.models.nemotron_h.model import EMBED, FINAL_NORM, MLP

ARCHITECTURE = "nemotron_h"
GLOBAL_NAMES = {"token_embd.weight": EMBED, "output_norm.weight": FINAL_NORM, "output.weight": HEAD}
LAYER_NAMES = {
    "ssm_in.weight": "mixer.in_proj.weight", "ssm_conv1d.weight": "mixer.conv1d.weight",
    "ssm_conv1d.bias": "mixer.conv1d.bias", "ssm_dt.bias": "mixer.dt_bias", "ssm_a": "mixer.A_log", "ssm_d": "mixer.D",
    "ssm_norm.weight": "mixer.norm.weight", "ssm_out.weight": "mixer.out_proj.weight",
    "attn_q.weight": "mixer.q_proj.weight", "attn_k.weight": "mixer.k_proj.weight",
    "attn_v.weight": "mixer.v_proj.weight", "attn_output.weight": "mixer.o_proj.weight",
    "ffn_up.weight": "mixer.up_proj.weight", "ffn_down.weight": "mixer.down_proj.weight",
    "attn_norm.weight": "norm.weight",
}  # fmt: skip
MATRICES = ("ssm_in", "ssm_out", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_up", "ffn_down")


def hf_config(meta: dict[str, Any], vocab: int, tied: bool, conv_bias: bool) -> dict[str, Any]:
    """The config.json an HF `NemotronHForCausalLM` of these dimensions would have."""
    a = ARCHITECTURE + "."
    layers, width = meta_number(meta, a + "block_count"), meta_number(meta, a + "embedding_length")
    heads = meta_number(meta, a + "attention.head_count")
    kv = gguf_file.per_layer(meta, a + "attention.head_count_kv", layers)
    ffn = gguf_file.per_layer(meta, a + "feed_forward_length", layers)
    kinds = [ATTENTION if h else MLP if f else MAMBA for h, f in zip(kv, ffn, strict=True)]
    kv_heads, ffns = sorted({n for n in kv if n}), sorted({n for n in ffn if n})
    if heads <= 0 or width <= 0 or len(kv_heads) > 1 or len(ffns) > 1 or min(kv + ffn, default=0) < 0 or any(
            h and f for h, f in zip(kv, ffn, strict=True)):  # fmt: skip
        raise CheckpointError(f"GGUF metadata {a}attention.head_count {heads}, head_count_kv {kv} and "
                              f"feed_forward_length {ffn}: not a Nemotron-H wkvm runs (one key-value head count and "
                              "one MLP size for all their layers)")  # fmt: skip
    if meta_number(meta, a + "expert_count", 0):
        raise CheckpointError("GGUF Nemotron-H with experts (Nemotron 3 Nano) is not supported")
    head_dim = meta_number(meta, a + "attention.key_length", width // heads)
    if meta_number(meta, a + "attention.value_length", head_dim) != head_dim:
        raise CheckpointError("GGUF Nemotron-H key and value head sizes differ: not a Nemotron-H wkvm runs")
    return {
        "model_type": "nemotron_h", "architectures": ["NemotronHForCausalLM"], "hidden_size": width,
        "layers_block_type": kinds, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads[0] if kv_heads else heads, "head_dim": head_dim,
        "intermediate_size": ffns[0] if ffns else 0, "mlp_hidden_act": "relu2",
        # llama.cpp's reading: the RMS eps where the file has one, else the layer-norm eps the converter writes
        "layer_norm_epsilon": meta_number(meta, a + "attention.layer_norm_rms_epsilon",
                                          meta.get(a + "attention.layer_norm_epsilon"), float),
        "n_groups": meta_number(meta, a + "ssm.group_count", 1),
        "ssm_state_size": meta_number(meta, a + "ssm.state_size"),
        "use_conv_bias": conv_bias, "vocab_size": vocab, "tie_word_embeddings": tied,
        "max_position_embeddings": meta_number(meta, a + "context_length", 4096),
    }  # fmt: skip


def read(path: Path) -> tuple[RawTensors, dict[str, Any]]:
    """Raw tensors under HF names (made when read, as Granite 4.0 H's) and an HF-style config dict."""
    reader, meta = gguf_file.open_architecture(path, ARCHITECTURE)
    parts: dict[str, list[ReaderTensor]] = {}
    for t in reader.tensors:
        at = gguf_file.layer_part(t.name)
        if t.name in GLOBAL_NAMES:
            parts[GLOBAL_NAMES[t.name]] = [t]
        elif at is not None and at[1] in LAYER_NAMES:
            parts[f"{PREFIX}{at[0]}.{LAYER_NAMES[at[1]]}"] = [t]
        else:
            raise CheckpointError(f"{path}: GGUF tensor {t.name!r} is not part of a Nemotron-H wkvm reads (experts, "
                                  "biases and extras are not read)")  # fmt: skip
    embed = parts.get(EMBED)
    try:
        conv_bias = any(n.endswith("mixer.conv1d.bias") for n in parts)
        config = hf_config(meta, gguf_file.vocab_size(path, reader, embed[0] if embed else None), HEAD not in parts,
                           conv_bias)  # fmt: skip
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None
    gguf_file.check_block_count(path, reader, ARCHITECTURE, len(config["layers_block_type"]))
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    return gguf_file.lazy_tensors(path, parts, heads), config
