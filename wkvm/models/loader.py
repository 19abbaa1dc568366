"""Open a model by path: detect the family and the checkpoint format."""

from __future__ import annotations

import os

import torch

from wkvm.models.rwkv7 import RWKV7, load_rwkv7
from wkvm.models.rwkv7_checkpoint import detect_format


def load_model(path: str | os.PathLike, device: str = "cpu", dtype: torch.dtype = torch.float32) -> RWKV7:
    detect_format(path)  # raises a CheckpointError naming what is wrong
    return load_rwkv7(path, device=device, dtype=dtype)
