"""Qwen3.5 checkpoints: HF directories of safetensors, read into Qwen3.5 text names (`model.layers.{i}.*`,
`model.embed_tokens.weight`, `model.norm.weight`, `lm_head.weight` unless tied).

    qwen3_5_text  Qwen3_5ForCausalLM: read as is.
    qwen3_5       Qwen3_5ForConditionalGeneration: the language model (`model.language_model.*` -> `model.*`) and
                  `lm_head.weight`; the vision tower (`model.visual.*`) is not read.
    qwen3_next    Qwen3NextForCausalLM with dense MLPs: the fused, per-key-head interleaved `in_proj_qkvz` and
                  `in_proj_ba` are split into Qwen3.5's `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`.
Multi-token-prediction tensors (`mtp.*`) are never read. `convert` writes any of them as a qwen3_5_text directory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from wkvm.atomic import atomic_path
from wkvm.models.family import CheckpointError, RawTensors, positive_int, read_safetensors_dir, untie_head

HF_FORMAT = "hf"
TEXT_MODEL_TYPE = "qwen3_5_text"
FULL_MODEL_TYPE = "qwen3_5"
NEXT_MODEL_TYPE = "qwen3_next"
HF_MODEL_TYPES = (TEXT_MODEL_TYPE, FULL_MODEL_TYPE, NEXT_MODEL_TYPE)
LANGUAGE_MODEL = "model.language_model."
# Qwen3-Next config keys that describe its MoE blocks: dropped when writing a Qwen3.5 text config
MOE_KEYS = (
    "decoder_sparse_step", "moe_intermediate_size", "shared_expert_intermediate_size", "num_experts_per_tok",
    "num_experts", "norm_topk_prob", "output_router_logits", "router_aux_loss_coef", "mlp_only_layers",
)  # fmt: skip


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of config.json (the nested `text_config` of a multimodal checkpoint)."""
    nested = config.get("text_config")
    if nested is not None and not isinstance(nested, dict):  # [1, 2] or "abc" had escaped as a TypeError or
        # ValueError (loading hunt, session 49)
        raise CheckpointError(f"config.json's text_config is {type(nested).__name__}, not an object")
    text = dict(nested or config)
    if "text_config" in config and "tie_word_embeddings" in config:  # the outer model ties (or not) its head
        text["tie_word_embeddings"] = config["tie_word_embeddings"]
    return text


def read_hf(path: str | os.PathLike[str]) -> tuple[RawTensors, dict[str, Any]]:
    p = Path(path)
    config = json.loads((p / "config.json").read_text())
    model_type = config.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise CheckpointError(f"{p}: model_type {model_type!r} is not one of {HF_MODEL_TYPES}")

    def rename(k: str) -> str | None:
        if model_type == FULL_MODEL_TYPE:
            if not (k.startswith(LANGUAGE_MODEL) or k == "lm_head.weight"):
                return None  # the vision tower, multi-token prediction
            return "model." + k[len(LANGUAGE_MODEL) :] if k.startswith(LANGUAGE_MODEL) else k
        return k if k.startswith("model.") or k == "lm_head.weight" else None  # not mtp.*

    raw = read_safetensors_dir(p, rename)
    text = text_config(config)
    untie_head(raw, "lm_head.weight", "model.embed_tokens.weight", bool(text.get("tie_word_embeddings")), p)
    if model_type == NEXT_MODEL_TYPE:
        split_fused_projections(raw, text)
    return raw, config


def split_fused_projections(raw: RawTensors, text: dict[str, Any]) -> None:
    """Qwen3-Next's fused projections, in place, into Qwen3.5's four. Their rows are grouped per key head:
    in_proj_qkvz [Hk x (q dk | k dk | v r*dv | z r*dv)], in_proj_ba [Hk x (b r | a r)], r = Hv / Hk."""
    keys = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
    if missing := [k for k in keys if k not in text]:  # a bare KeyError before
        raise CheckpointError(f"Qwen3-Next config.json lacks {missing[0]!r}")
    # 0 and "x" had escaped as a ZeroDivisionError / ValueError (loading hunt, session 49)
    hk, hv, dk, dv = (positive_int(text, k, "Qwen3-Next") for k in keys)
    r = hv // hk
    for name in [k for k in raw if k.endswith(".linear_attn.in_proj_qkvz.weight")]:
        p = name[: -len("in_proj_qkvz.weight")]
        qkvz = raw.pop(name)
        ba = raw.pop(p + "in_proj_ba.weight", None)
        if ba is None or qkvz.shape[0] != hk * (2 * dk + 2 * r * dv) or ba.shape[0] != 2 * hv:
            raise CheckpointError(f"{name}: shapes do not fit the config's heads ({hk} key x {dk}, {hv} value x {dv})")
        q, k, v, z = torch.split(qkvz.view(hk, 2 * dk + 2 * r * dv, -1), [dk, dk, r * dv, r * dv], 1)
        b, a = torch.split(ba.view(hk, 2 * r, -1), [r, r], 1)
        c = qkvz.shape[1]
        raw[p + "in_proj_qkv.weight"] = torch.cat([q.reshape(-1, c), k.reshape(-1, c), v.reshape(-1, c)])
        raw[p + "in_proj_z.weight"] = z.reshape(-1, c).contiguous()
        raw[p + "in_proj_b.weight"] = b.reshape(-1, c).contiguous()
        raw[p + "in_proj_a.weight"] = a.reshape(-1, c).contiguous()


def convert(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> str:
    """A qwen3_5 (multimodal) or qwen3_next checkpoint as a qwen3_5_text directory (config.json and one
    model.safetensors); the text model's weights are copied exactly. Returns the target's format name."""
    raw, config = read_hf(src)
    if config.get("model_type") == TEXT_MODEL_TYPE:
        raise CheckpointError(f"{src}: already a {TEXT_MODEL_TYPE} checkpoint (the one layout wkvm converts to)")
    text = {k: v for k, v in text_config(config).items() if k not in MOE_KEYS and k not in ("architectures", "dtype")}
    text.update(model_type=TEXT_MODEL_TYPE, architectures=["Qwen3_5ForCausalLM"])
    out = Path(dst)
    out.mkdir(parents=True, exist_ok=True)
    with atomic_path(out / "model.safetensors") as tmp:
        save_file({k: v.contiguous() for k, v in raw.items()}, str(tmp), metadata={"format": "pt"})
    with atomic_path(out / "config.json") as tmp:
        Path(tmp).write_text(json.dumps(text, indent=2))
    return HF_FORMAT
