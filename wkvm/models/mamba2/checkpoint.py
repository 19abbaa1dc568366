"""Mamba2 checkpoint formats: HF `Mamba2ForCausalLM` directories and the original state-spaces (mamba_ssm) layout.

Internally a checkpoint is a dict of HF names (`backbone.embeddings.weight`, `backbone.layers.{i}.mixer.*`, ...)
in the file's shapes and dtype. A tied head (HF `tie_word_embeddings`, mamba_ssm `tie_embeddings`) has no
`lm_head.weight` entry: the model uses the embedding. The state-spaces layout (config.json with `d_model`,
`ssm_cfg`, no `model_type`; weights in `pytorch_model.bin`, read with `torch.load(weights_only=True)`) differs
only in `backbone.embedding.weight` and its config; its config is read into the HF field names.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from wkvm.atomic import atomic_path
from wkvm.models.family import (
    CheckpointError,
    RawTensors,
    layer_count,
    load_torch_file,
    positive_int,
    read_safetensors_dir,
    untie_head,
)
from wkvm.models.mamba2.model import EMBEDDING, HEAD, NORM_F, time_step_limit

HF_FORMAT = "hf"
STATE_SPACES_FORMAT = "state-spaces"
HF_MODEL_TYPES = ("mamba2",)
SS_WEIGHTS = "pytorch_model.bin"
SS_EMBEDDING = "backbone.embedding.weight"
_LAYER_NAME = re.compile(
    r"backbone\.layers\.\d+\.(norm\.weight|mixer\.(in_proj\.(weight|bias)|conv1d\.(weight|bias)|dt_bias|A_log|D"
    r"|norm\.weight|out_proj\.(weight|bias)))"
)
# mamba_ssm's Mamba2 defaults (mamba_ssm/modules/mamba2.py) for ssm_cfg fields a config.json leaves out
SS_DEFAULTS = {"d_state": 128, "d_conv": 4, "expand": 2, "headdim": 64, "ngroups": 1, "chunk_size": 256,
               "bias": False, "conv_bias": True, "rmsnorm": True, "norm_before_gate": False, "D_has_hdim": False,
               "dt_limit": (0.0, float("inf"))}  # fmt: skip


def _read_json(path: Path) -> dict[str, Any]:
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable ({e})") from None
    if not isinstance(d, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    return d


def detect_state_spaces(path: str | os.PathLike[str]) -> str | None:
    """STATE_SPACES_FORMAT for a directory in mamba_ssm's layout with a Mamba2 mixer, else None."""
    p = Path(path)
    try:
        if not (p / "config.json").is_file() or not (p / SS_WEIGHTS).is_file():
            return None
        cfg = json.loads((p / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict) or "model_type" in cfg or "d_model" not in cfg or "n_layer" not in cfg:
        return None
    ssm = cfg.get("ssm_cfg") or {}
    return STATE_SPACES_FORMAT if isinstance(ssm, dict) and ssm.get("layer") == "Mamba2" else None


def _check_names(raw: RawTensors, path: Path) -> None:
    unknown = [k for k in raw if k not in (EMBEDDING, NORM_F, HEAD) and not _LAYER_NAME.fullmatch(k)]
    if unknown:
        raise CheckpointError(f"{path}: unexpected tensors for Mamba2: {unknown[:5]}")


def _untie_state_spaces(raw: RawTensors, tied: bool) -> RawTensors:
    """mamba_ssm ties by using the embedding: a stored head is dropped (the fingerprint counts the embedding once)."""
    if tied:
        raw.pop(HEAD, None)
    elif HEAD not in raw:
        raise CheckpointError("Mamba2 checkpoint has no lm_head.weight and does not tie it to the embedding")
    return raw


def read_hf(path: Path) -> tuple[RawTensors, dict[str, Any]]:
    config = _read_json(path / "config.json")
    raw = read_safetensors_dir(path)
    _check_names(raw, path)
    return untie_head(raw, HEAD, EMBEDDING, bool(config.get("tie_word_embeddings", False)), path), config


def hf_config_from_state_spaces(ss: dict[str, Any], vocab_rows: int) -> dict[str, Any]:
    """The HF Mamba2Config fields for a mamba_ssm MambaConfig (CheckpointError for what HF Mamba2 cannot run)."""
    ssm = {**SS_DEFAULTS, **(ss.get("ssm_cfg") or {})}
    # sizes of the wrong type or value (headdim 0, d_model null, d_state "six") had escaped as a ZeroDivisionError or
    # TypeError, or been taken (loading hunt, session 49)
    positive_int(ss, "d_model", "state-spaces Mamba2")
    for key in ("d_state", "d_conv", "expand", "headdim", "ngroups", "chunk_size"):
        positive_int(ssm, key, "state-spaces Mamba2", label=f"ssm_cfg.{key}")
    time_step_limit({"time_step_limit": ssm["dt_limit"]})
    unsupported = [
        ("attn_layer_idx", bool(ss.get("attn_layer_idx"))), ("d_intermediate", bool(ss.get("d_intermediate", 0))),
        ("rms_norm", not ss.get("rms_norm", True)), ("ssm_cfg.rmsnorm", not ssm["rmsnorm"]),
        ("ssm_cfg.norm_before_gate", bool(ssm["norm_before_gate"])), ("ssm_cfg.D_has_hdim", bool(ssm["D_has_hdim"])),
        ("ssm_cfg.d_ssm", ssm.get("d_ssm") not in (None, ssm["expand"] * ss["d_model"])),
    ]  # fmt: skip
    bad = [name for name, is_bad in unsupported if is_bad]
    if bad:
        raise CheckpointError(f"state-spaces Mamba2 config uses {bad}, which wkvm's Mamba2 does not run")
    d_inner = ssm["expand"] * ss["d_model"]
    return {
        "model_type": "mamba2", "architectures": ["Mamba2ForCausalLM"],
        "hidden_size": ss["d_model"], "num_hidden_layers": ss["n_layer"], "vocab_size": vocab_rows,
        "state_size": ssm["d_state"], "conv_kernel": ssm["d_conv"], "expand": ssm["expand"],
        "head_dim": ssm["headdim"], "num_heads": d_inner // ssm["headdim"], "n_groups": ssm["ngroups"],
        "chunk_size": ssm["chunk_size"], "use_bias": ssm["bias"], "use_conv_bias": ssm["conv_bias"],
        "time_step_limit": list(ssm["dt_limit"]), "layer_norm_epsilon": 1e-5, "hidden_act": "silu",
        "residual_in_fp32": ss.get("residual_in_fp32", True), "tie_word_embeddings": ss.get("tie_embeddings", True),
    }  # fmt: skip


def read_state_spaces(path: Path) -> tuple[RawTensors, dict[str, Any]]:
    ss = _read_json(path / "config.json")
    f = path / SS_WEIGHTS
    obj = load_torch_file(f)
    if not isinstance(obj, dict) or SS_EMBEDDING not in obj:
        raise CheckpointError(f"{f}: not a mamba_ssm state dict (no {SS_EMBEDDING!r})")
    raw = {EMBEDDING if k == SS_EMBEDDING else k: v for k, v in obj.items()}
    _check_names(raw, path)
    config = hf_config_from_state_spaces(ss, raw[EMBEDDING].shape[0])
    return _untie_state_spaces(raw, config["tie_word_embeddings"]), config


def read_checkpoint(path: Path, fmt: str) -> tuple[RawTensors, dict[str, Any]]:
    return read_state_spaces(path) if fmt == STATE_SPACES_FORMAT else read_hf(path)


def state_spaces_config(hf: dict[str, Any], raw: RawTensors) -> dict[str, Any]:
    """A mamba_ssm MambaConfig for an HF checkpoint (vocab already padded: pad multiple 1)."""
    rows, d_model = raw[EMBEDDING].shape
    d_inner = raw["backbone.layers.0.mixer.out_proj.weight"].shape[1]
    if d_inner % d_model:
        raise CheckpointError(f"Mamba2: d_inner {d_inner} is not a multiple of d_model {d_model} (mamba_ssm's expand)")
    conv_dim, _, d_conv = raw["backbone.layers.0.mixer.conv1d.weight"].shape
    n_groups = positive_int(hf, "n_groups", "Mamba2", 8)
    n_heads = raw["backbone.layers.0.mixer.A_log"].shape[0]
    ssm = {"layer": "Mamba2", "d_state": (conv_dim - d_inner) // (2 * n_groups), "d_conv": d_conv,
           "expand": d_inner // d_model, "headdim": d_inner // n_heads, "ngroups": n_groups,
           "chunk_size": int(hf.get("chunk_size", 256)), "bias": "backbone.layers.0.mixer.in_proj.bias" in raw,
           "conv_bias": "backbone.layers.0.mixer.conv1d.bias" in raw}  # fmt: skip
    dt_limit = list(time_step_limit(hf))
    if dt_limit != [0.0, float("inf")]:
        ssm["dt_limit"] = dt_limit
    return {
        "d_model": d_model, "d_intermediate": 0, "n_layer": layer_count(raw, "backbone.layers."), "vocab_size": rows,
        "ssm_cfg": ssm, "attn_layer_idx": [], "attn_cfg": {}, "rms_norm": True,
        "residual_in_fp32": bool(hf.get("residual_in_fp32", True)), "fused_add_norm": True,
        "pad_vocab_size_multiple": 1, "tie_embeddings": HEAD not in raw,
    }  # fmt: skip


def convert(src: Path, dst: Path, fmt: str) -> str:
    """state-spaces -> HF directory (config.json + model.safetensors), HF -> state-spaces (config.json +
    pytorch_model.bin); tensors unchanged, so both sides have the same fingerprint. Returns the target format."""
    raw, config = read_checkpoint(src, fmt)
    dst.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.contiguous() for k, v in raw.items()}
    if fmt == STATE_SPACES_FORMAT:
        with atomic_path(dst / "model.safetensors") as tmp:
            save_file(tensors, str(tmp), metadata={"format": "pt"})
        target, out_config = HF_FORMAT, config
    else:
        tensors = {(SS_EMBEDDING if k == EMBEDDING else k): v for k, v in tensors.items()}
        with atomic_path(dst / SS_WEIGHTS) as tmp:
            torch.save(tensors, tmp)
        target, out_config = STATE_SPACES_FORMAT, state_spaces_config(config, raw)
    with atomic_path(dst / "config.json") as tmp:
        tmp.write_text(json.dumps(out_config, indent=2) + "\n")
    return target
