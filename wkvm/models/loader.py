"""Open a model by path: detect the family and the format (checkpoint or weight pack)."""

from __future__ import annotations

import os

import torch

from wkvm.models.rwkv7 import RWKV7, build_rwkv7, load_rwkv7
from wkvm.models.rwkv7_checkpoint import detect_format


def load_model(
    path: str | os.PathLike, device: str = "cpu", dtype: torch.dtype | str = torch.float32,
    weight_cache_layers: int = 0, read_ahead: bool = True,
) -> RWKV7:  # fmt: skip
    """A pack with weight_cache_layers > 0 streams its layers from disk; everything else is loaded resident.
    `dtype` stores the large matrices, embedding and head in float32 or bfloat16; arithmetic is fp32 either way."""
    from wkvm.config import weight_dtype
    from wkvm.weights.pack import Pack, is_pack

    dtype = dtype if isinstance(dtype, torch.dtype) else weight_dtype(dtype)

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
    detect_format(path)  # raises a CheckpointError naming what is wrong
    return load_rwkv7(path, device=device, dtype=dtype)
