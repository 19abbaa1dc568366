"""The model families wkvm knows: by name (StateSpec.family, pack manifests) and by HF `model_type`.

A family package is imported only when a lookup first needs it. Tests register families of their own.
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

from wkvm.models.family import CheckpointError, ModelFamily

# name -> module whose FAMILY implements ModelFamily; a new family adds its line here and nothing else
MODULES = {
    "bamba": "wkvm.models.bamba",
    "granite_hybrid": "wkvm.models.granite_hybrid",
    "lfm2": "wkvm.models.lfm2",
    "llama": "wkvm.models.llama",
    "mamba2": "wkvm.models.mamba2",
    "nemotron_h": "wkvm.models.nemotron_h",
    "qwen3_5": "wkvm.models.qwen3_5",
    "rwkv7": "wkvm.models.rwkv7",
}
_loaded: dict[str, ModelFamily] = {}


def register(family: ModelFamily) -> None:
    """Add a family defined outside wkvm/models (e.g. a test-only one)."""
    _loaded[family.name] = family


def family(name: str) -> ModelFamily:
    if name not in _loaded:
        if name not in MODULES:
            raise CheckpointError(f"unknown model family {name!r}; known: {', '.join(sorted({*MODULES, *_loaded}))}")
        _loaded[name] = importlib.import_module(MODULES[name]).FAMILY
    return _loaded[name]


def families() -> list[ModelFamily]:
    return [family(n) for n in sorted({*MODULES, *_loaded})]


def known_formats() -> str:
    return "; ".join(f"{f.name}: {f.formats}" for f in families())


def detect(path: str | os.PathLike[str]) -> tuple[ModelFamily, str]:
    """The family and format of the checkpoint at `path`: what a family's `detect` recognises, else an HF
    directory by its config.json's `model_type` (format "hf")."""
    p = Path(path)
    for f in families():  # formats a family recognises itself (a .pth; a directory in a non-HF layout)
        fmt = f.detect(p)
        if fmt is not None:
            return f, fmt
    if not p.is_dir():
        raise CheckpointError(f"{p}: not a checkpoint wkvm reads ({known_formats()})")
    cfg = p / "config.json"
    if not cfg.is_file():
        raise CheckpointError(f"{p} is a directory without config.json (and no weight pack manifest.json); "
                              f"wkvm reads {known_formats()}")  # fmt: skip
    try:
        model_type = json.loads(cfg.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{cfg}: unreadable ({e})") from None
    for f in families():
        if model_type in f.model_types:
            return f, "hf"
    if (cfg.parent / "modules.json").is_file():  # a sentence-transformers directory given as the generative model
        raise CheckpointError(f"{cfg.parent} is a sentence-embedding model (model_type {model_type!r}), not a "
                              f"generative one: serve it with --model none --embeddings {cfg.parent}")  # fmt: skip
    types = sorted(t for f in families() for t in f.model_types)
    raise CheckpointError(f"{cfg}: model_type {model_type!r} is not a family wkvm runs (known: {types})")
