"""Llama checkpoints: HF `LlamaForCausalLM` directories (read as is) and llama.cpp GGUF files (see gguf_file.py),
both read into the HF names. `convert` writes a GGUF file as an HF directory of its dequantized weights."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from wkvm.atomic import atomic_path
from wkvm.models.family import CheckpointError, RawTensors, read_safetensors_dir
from wkvm.models.llama import gguf_file
from wkvm.models.llama.model import HEAD

HF_FORMAT = "hf"
GGUF_FORMAT = "gguf"
HF_MODEL_TYPES: tuple[str, ...] = ("llama",)


def detect(path: Path) -> str | None:
    """"gguf" for a GGUF file (by its magic bytes, whatever its name) of architecture llama, or one whose header does
    not parse (reading it then says why); a GGUF of another architecture is left to its family."""
    if not (path.is_file() and gguf_file.is_gguf(path)):
        return None
    try:
        return GGUF_FORMAT if gguf_file.architecture(path) == gguf_file.ARCHITECTURE else None
    except CheckpointError:
        return GGUF_FORMAT  # truncated or corrupt: read_gguf names the file and the reason
    except (OSError, ValueError):
        return None


def read_hf(path: str | os.PathLike[str]) -> tuple[RawTensors, dict[str, Any]]:
    p = Path(path)
    config = json.loads((p / "config.json").read_text())
    if config.get("model_type") not in HF_MODEL_TYPES:
        raise CheckpointError(f"{p}: model_type {config.get('model_type')!r} is not one of {HF_MODEL_TYPES}")
    raw = read_safetensors_dir(p, lambda k: k if k.startswith("model.") or k == HEAD else None)
    if config.get("tie_word_embeddings") and HEAD in raw:
        del raw[HEAD]  # tied: the embedding is the head
    if not config.get("tie_word_embeddings") and HEAD not in raw:
        raise CheckpointError(f"{p}: no {HEAD} and tie_word_embeddings is not set")
    return raw, config


def read(path: Path, fmt: str) -> tuple[RawTensors, dict[str, Any]]:
    return gguf_file.read_gguf(path) if fmt == GGUF_FORMAT else read_hf(path)


def convert(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> str:
    """A GGUF file as an HF directory: config.json, one model.safetensors of the dequantized fp32 weights (Q and K
    back in HF's RoPE layout) and, when the file has them, tokenizer.json and chat_template.jinja (+ .json with
    the stop string). Returns the target's format."""
    if detect(Path(src)) != GGUF_FORMAT:
        raise CheckpointError(f"{src}: wkvm converts Llama GGUF files to HF directories only (not HF to GGUF)")
    raw, config = gguf_file.read_gguf(Path(src))
    out = Path(dst)
    out.mkdir(parents=True, exist_ok=True)
    with atomic_path(out / "model.safetensors") as tmp:
        save_file({k: v.to(torch.float32).contiguous() for k, v in raw.items()}, str(tmp), metadata={"format": "pt"})
    with atomic_path(out / "config.json") as tmp:
        Path(tmp).write_text(json.dumps(config, indent=2))
    write_text_tools(Path(src), out)
    return HF_FORMAT


def write_text_tools(src: Path, out: Path) -> None:
    from wkvm.models.llama.gguf_text import gguf_chat_template, gguf_tokenizer
    from wkvm.tokenizer import save_text_tools

    has_vocab = gguf_file.field(gguf_file.open_reader(src), "tokenizer.ggml.tokens") is not None
    save_text_tools(gguf_tokenizer(src) if has_vocab else None, gguf_chat_template(src), out)
