"""RWKV-7 checkpoint formats: BlinkDL `.pth` (x070 keys) and HF/fla directories; lossless conversion.

Internally a checkpoint is a dict of BlinkDL names -> tensors in BlinkDL shapes and the file's dtype.
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
    check_layer_count,
    layer_count,
    load_torch_file,
    read_safetensors_dir,
)
from wkvm.progress import progress

PTH_FORMAT = "pth"
HF_FORMAT = "hf"
HF_MODEL_TYPES = ("rwkv7", "rwkv7_fla")
# BlinkDL keeps these as [1, 1, C]; fla stores them as [C].
_FLA_FLAT = re.compile(r"att\.(k_k|k_a|[wav]0)$|ffn\.x_k$")
_LORA = re.compile(r"att\.([wvag])([012])$")
_PROJ = {"receptance": "r_proj", "key": "k_proj", "value": "v_proj", "output": "o_proj", "ln_x": "g_norm"}
_BLOCK_PART = {"att": "attn", "ffn": "ffn", "ln0": "pre_norm", "ln1": "attn_norm", "ln2": "ffn_norm"}
_GLOBAL = {
    "emb.weight": "model.embeddings.weight",
    "ln_out.weight": "model.norm.weight",
    "ln_out.bias": "model.norm.bias",
    "head.weight": "lm_head.weight",
}


def detect_pth(path: str | os.PathLike[str]) -> str | None:
    """PTH_FORMAT for a `.pth` file (or NAME given for NAME.pth); HF directories are matched by model_type."""
    p = Path(path)
    if p.suffix == ".pth" and p.is_file():
        return PTH_FORMAT
    if not p.exists() and Path(str(p) + ".pth").is_file():
        return PTH_FORMAT
    return None


def _pth_file(path: str | os.PathLike[str]) -> Path:
    p = Path(path)
    return p if p.is_file() else Path(str(p) + ".pth")


def read_pth(path: str | os.PathLike[str]) -> RawTensors:
    obj = load_torch_file(_pth_file(path))
    if not isinstance(obj, dict) or "emb.weight" not in obj:
        raise CheckpointError(f"{path}: not an RWKV-7 state dict (no 'emb.weight')")
    if bad := next((k for k, v in obj.items() if not isinstance(v, torch.Tensor)), None):  # had been AttributeError
        raise CheckpointError(f"{path}: {bad!r} is not a tensor ({type(obj[bad]).__name__})")
    return dict(obj)


def _fla_name(name: str) -> str:
    if name in _GLOBAL:
        return _GLOBAL[name]
    parts = name.split(".")
    if parts[0] != "blocks" or len(parts) < 4 or parts[2] not in _BLOCK_PART:
        raise CheckpointError(f"unexpected BlinkDL tensor name {name!r}")
    rest = ".".join(parts[3:])
    m = _LORA.match(f"{parts[2]}.{rest}")
    if m:
        rest = f"{m[1]}_lora.lora." + {"0": "2.bias", "1": "0.weight", "2": "2.weight"}[m[2]]
    elif parts[2] == "att" and parts[3] in _PROJ:
        rest = ".".join([_PROJ[parts[3]], *parts[4:]])
    return f"model.layers.{parts[1]}.{_BLOCK_PART[parts[2]]}.{rest}"


def _to_fla(name: str, t: torch.Tensor) -> torch.Tensor:
    if _LORA.search(name) and name[-1] in "12":
        return t.t().contiguous()
    if _FLA_FLAT.search(name):
        return t.reshape(-1)
    return t


def _from_fla(name: str, t: torch.Tensor) -> torch.Tensor:
    if _LORA.search(name) and name[-1] in "12":
        return t.t().contiguous()
    if _FLA_FLAT.search(name):
        return t.reshape(1, 1, -1)
    return t


def _blink_names(fla_names: list[str]) -> dict[str, str]:
    """Map each fla name to its BlinkDL name by inverting the forward mapping."""
    forward: dict[str, str] = {}
    layers = {int(m[1]) for n in fla_names if (m := re.match(r"model\.layers\.(\d+)\.", n))}
    for i in layers:
        for part in ("ln0", "ln1", "ln2"):
            for wb in ("weight", "bias"):
                forward[_fla_name(f"blocks.{i}.{part}.{wb}")] = f"blocks.{i}.{part}.{wb}"
        for leaf in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g", "k_k", "k_a", "r_k"):
            forward[_fla_name(f"blocks.{i}.att.{leaf}")] = f"blocks.{i}.att.{leaf}"
        for lora in "wavg":
            for j in "012":
                forward[_fla_name(f"blocks.{i}.att.{lora}{j}")] = f"blocks.{i}.att.{lora}{j}"
        for proj in _PROJ:
            for wb in ("weight", "bias"):
                forward[_fla_name(f"blocks.{i}.att.{proj}.{wb}")] = f"blocks.{i}.att.{proj}.{wb}"
        for leaf in ("x_k", "key.weight", "value.weight"):
            forward[_fla_name(f"blocks.{i}.ffn.{leaf}")] = f"blocks.{i}.ffn.{leaf}"
    forward.update({v: k for k, v in _GLOBAL.items()})
    unknown = [n for n in fla_names if n not in forward]
    if unknown:
        raise CheckpointError(f"unexpected tensors in HF/fla checkpoint: {unknown[:5]}")
    return {n: forward[n] for n in fla_names}


def read_hf(path: str | os.PathLike[str]) -> tuple[RawTensors, dict[str, Any]]:
    """Read an HF/fla directory; returns BlinkDL-named tensors and the config dict."""
    p = Path(path)
    config: dict[str, Any] = json.loads((p / "config.json").read_text())
    fla = read_safetensors_dir(p)
    if "lm_head.weight" not in fla and config.get("tie_word_embeddings"):
        fla["lm_head.weight"] = fla["model.embeddings.weight"]
    names = _blink_names(list(fla))
    raw = {names[k]: _from_fla(names[k], v) for k, v in fla.items()}
    check_layer_count(config, layer_count(raw, "blocks."), "RWKV-7")
    return raw, config


def read_checkpoint(path: str | os.PathLike[str], fmt: str | None = None) -> tuple[RawTensors, dict[str, Any], str]:
    """BlinkDL-named tensors, the HF config (empty for .pth) and the format (detected when not given)."""
    fmt = fmt or detect_pth(path) or HF_FORMAT
    if fmt == PTH_FORMAT:
        return read_pth(path), {}, fmt
    raw, config = read_hf(path)
    return raw, config, fmt


def hf_config(raw: RawTensors, group_norm_eps: float = 64e-5) -> dict[str, Any]:
    """An fla-compatible config.json for BlinkDL tensors, every dimension read from them."""
    vocab, hidden = raw["emb.weight"].shape
    heads, head_dim = raw["blocks.0.att.r_k"].shape
    n_layer = 1 + max(int(k.split(".")[1]) for k in raw if k.startswith("blocks."))
    ffn = raw["blocks.0.ffn.key.weight"].shape[0]
    v_rank = raw["blocks.1.att.v1"].shape[1] if "blocks.1.att.v1" in raw else 32
    cfg: dict[str, Any] = {
        "model_type": "rwkv7",
        "architectures": ["RWKV7ForCausalLM"],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": n_layer,
        "head_dim": head_dim,
        "num_heads": heads,
        "intermediate_size": ffn,
        "hidden_ratio": ffn / hidden,
        "decay_low_rank_dim": raw["blocks.0.att.w1"].shape[1],
        "a_low_rank_dim": raw["blocks.0.att.a1"].shape[1],
        "v_low_rank_dim": v_rank,
        "gate_low_rank_dim": raw["blocks.0.att.g1"].shape[1],
        "value_dim": [hidden] * n_layer,
        "norm_first": True,
        "norm_bias": True,
        "norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "torch_dtype": str(raw["emb.weight"].dtype).removeprefix("torch."),
    }
    # fla derives the group-norm eps as head_dim * norm_eps; BlinkDL fixes it at 64e-5.
    if abs(head_dim * 1e-5 - group_norm_eps) > 1e-12:
        cfg["wkvm_group_norm_eps"] = group_norm_eps
    return cfg


def write_hf(raw: RawTensors, dst: str | os.PathLike[str], config: dict[str, Any] | None = None) -> None:
    d = Path(dst)
    d.mkdir(parents=True, exist_ok=True)
    tensors = {_fla_name(k): _to_fla(k, v).contiguous() for k, v in progress(raw.items(), "converting", len(raw))}
    with atomic_path(d / "model.safetensors") as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    with atomic_path(d / "config.json") as tmp:
        tmp.write_text(json.dumps(config or hf_config(raw), indent=2) + "\n")


def write_pth(raw: RawTensors, dst: str | os.PathLike[str]) -> None:
    with atomic_path(Path(dst)) as tmp:
        torch.save({k: v.contiguous() for k, v in progress(raw.items(), "converting", len(raw))}, tmp)


def convert(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> str:
    """Convert between .pth and HF/fla directory (direction from the source); returns the target format."""
    to_pth = Path(src).is_dir()  # a .pth converts to a directory, a directory to a .pth (companions: NAME.*.json)
    if to_pth != (Path(dst).suffix == ".pth"):  # checked before writing: a directory's .pth had been written under
        raise ValueError(f"{src} converts to {'a .pth file' if to_pth else 'an HF directory'}: name the destination "
                         f"{'NAME.pth' if to_pth else 'without .pth'} (got {dst})")  # any name, then its files failed
    raw, config, fmt = read_checkpoint(src)
    if fmt == PTH_FORMAT:
        write_hf(raw, dst)
        return HF_FORMAT
    from wkvm.models.rwkv7.model import RWKV7Config

    cfg = RWKV7Config.from_tensors(raw, config)
    if (cfg.ln_eps, cfg.gn_eps) != (1e-5, 64e-5):  # BlinkDL's .pth has no config: its epsilons are these
        raise CheckpointError(f"{src}: its norm_eps {cfg.ln_eps:g} / group-norm eps {cfg.gn_eps:g} cannot be carried "
                              "by a .pth, whose readers fix them at 1e-5 / 64e-5 (it would compute another model): "
                              "keep the HF directory")  # fmt: skip
    write_pth(raw, dst)
    return PTH_FORMAT
