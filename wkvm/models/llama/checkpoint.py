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
from wkvm.models.family import SHARD_INDEX, CheckpointError, RawTensors, read_safetensors_dir, untie_head
from wkvm.models.llama import gguf_file
from wkvm.models.llama.model import EMBED, HEAD

HF_FORMAT = "hf"
GGUF_FORMAT = "gguf"
HF_MODEL_TYPES: tuple[str, ...] = ("llama", "mistral")  # Mistral: a Llama whose sliding window never applies


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
    return untie_head(raw, HEAD, EMBED, bool(config.get("tie_word_embeddings")), p), config


def read(path: Path, fmt: str) -> tuple[RawTensors, dict[str, Any]]:
    return gguf_file.read_gguf(path) if fmt == GGUF_FORMAT else read_hf(path)


SHARD_BYTES = 2 << 30  # fp32 bytes of whole layers per safetensors file `convert` writes


def convert(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> str:
    """A GGUF file as an HF directory: config.json, the dequantized fp32 weights (Q and K back in HF's RoPE layout) and,
    when the file has them, tokenizer.json and chat_template.jinja (+ .json with the stop string). The weights are one
    model.safetensors up to `SHARD_BYTES`, else HF's shards of whole layers (model-00001-of-0000N.safetensors and
    model.safetensors.index.json), each made, written and dropped in turn: an 8B file needs one shard's fp32 in
    memory, not ~32 GB. A directory that already holds weights is refused (they could be another model's, and a mix
    of two conversions would load); config.json comes last, so a conversion cut short leaves no loadable directory.
    Returns the target's format."""
    if detect(Path(src)) != GGUF_FORMAT:
        raise CheckpointError(f"{src}: wkvm converts Llama GGUF files to HF directories only (not HF to GGUF)")
    out = Path(dst)
    held = sorted(p.name for p in out.glob("*") if p.suffix == ".safetensors" or p.name.endswith(".index.json"))
    if held:
        raise CheckpointError(f"{out} already holds weights ({', '.join(held[:3])}{', ...' if len(held) > 3 else ''}): "
                              "convert into a new or empty directory")  # fmt: skip
    raw, config = gguf_file.read_gguf(Path(src))
    sizes = {name: 4 * int(t.n_elements) for name, t in gguf_file.hf_tensors(gguf_file.open_reader(src)).items()
             if name in raw}  # fmt: skip
    shards = shard_plan(sizes)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").unlink(missing_ok=True)  # written last: no weights without it until all are there
    files = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]  # fmt: skip
    for names, file in zip(shards, files, strict=True):
        with atomic_path(out / file) as tmp:
            save_file({k: raw[k].to(torch.float32).contiguous() for k in names}, str(tmp), metadata={"format": "pt"})
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())},
                 "weight_map": {k: file for names, file in zip(shards, files, strict=True) for k in names}}  # fmt: skip
        with atomic_path(out / SHARD_INDEX) as tmp:
            Path(tmp).write_text(json.dumps(index, indent=2))
    write_text_tools(Path(src), out)
    with atomic_path(out / "config.json") as tmp:
        Path(tmp).write_text(json.dumps(config, indent=2))
    return HF_FORMAT


def shard_plan(sizes: dict[str, int]) -> list[list[str]]:
    """Tensor names in files of up to `SHARD_BYTES` (a layer larger than that alone): the tensors outside the layers
    first, then each layer's whole, in order."""
    groups: dict[str, list[str]] = {}
    for name in sizes:
        key = ".".join(name.split(".")[:3]) if name.startswith("model.layers.") else ""
        groups.setdefault(key, []).append(name)
    shards: list[list[str]] = []
    used = SHARD_BYTES
    for names in groups.values():
        size = sum(sizes[n] for n in names)
        if used + size > SHARD_BYTES:
            shards.append([])
            used = 0
        shards[-1] += names
        used += size
    return shards or [[]]


def write_text_tools(src: Path, out: Path) -> None:
    from wkvm.models.llama.gguf_text import gguf_chat_template, gguf_tokenizer
    from wkvm.tokenizer import save_text_tools

    has_vocab = gguf_file.field(gguf_file.open_reader(src), "tokenizer.ggml.tokens") is not None
    save_text_tools(gguf_tokenizer(src) if has_vocab else None, gguf_chat_template(src), out)
