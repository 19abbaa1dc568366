"""Open a model by path: detect the family and the format (checkpoint or weight pack)."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import torch

from wkvm.models.rwkv7 import RWKV7, build_rwkv7, load_rwkv7
from wkvm.models.rwkv7_checkpoint import CheckpointError, detect_format
from wkvm.weights import linear

log = logging.getLogger(__name__)


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def check_model_path(path: str | os.PathLike) -> None:
    """Fail early with one line a user can act on: a missing path, a hub id (wkvm never downloads), or a file
    or directory that is no model wkvm reads. Raises CheckpointError (a ValueError)."""
    from wkvm.weights.pack import is_pack

    p = Path(path)
    if not p.exists() and not Path(f"{p}.pth").is_file():
        if HUB_ID.fullmatch(str(path)):
            raise CheckpointError(f"model {str(path)!r} does not exist here; it looks like a Hugging Face hub id, and "
                                  "wkvm never downloads: download the checkpoint first and pass its local path")
        raise CheckpointError(f"model path {str(path)!r} does not exist")
    if not is_pack(p):
        detect_format(p)


def load_model(
    path: str | os.PathLike, device: str = "cpu", dtype: torch.dtype | str = torch.float32,
    weight_cache_layers: int = 0, read_ahead: bool = True,
) -> RWKV7:  # fmt: skip
    """A pack with weight_cache_layers > 0 streams its layers from disk; everything else is loaded resident.
    `dtype` stores the large matrices, embedding and head in float32 or bfloat16; arithmetic is fp32 either way."""
    from wkvm.config import weight_dtype
    from wkvm.weights.pack import Pack, is_pack

    check_model_path(path)
    dtype = dtype if isinstance(dtype, torch.dtype) else weight_dtype(dtype)
    if dtype == torch.bfloat16 and torch.device(device).type == "cpu" and not linear.bf16_native():
        log.warning("--dtype bfloat16: %s", linear.bf16_speed())

    if is_pack(path):
        pack = Pack(path)
        if weight_cache_layers > 0:
            from wkvm.weights.stream import StreamingWeights

            weights = StreamingWeights(pack, weight_cache_layers, read_ahead, device, dtype)
            return RWKV7(pack.config, weights, pack.fingerprint, device)
        raw = pack.read(None)
        for i in range(pack.config.n_layer):
            raw.update(pack.read(i))
        return build_rwkv7(raw, None, device, dtype, config=pack.config, model_fingerprint=pack.fingerprint)
    if weight_cache_layers > 0:
        raise ValueError(
            f"{path}: --weight-cache-layers needs a weight pack (make one with `wkvm convert SRC DST --pack`)"
        )
    return load_rwkv7(path, device=device, dtype=dtype)  # check_model_path above checked the format
