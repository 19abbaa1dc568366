"""Model fingerprint: sha256 over family, config and the weight bytes in canonical (sorted-name) order."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch


def fingerprint(family: str, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    h.update(json.dumps({"family": family, "config": config}, sort_keys=True).encode())
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(json.dumps([name, str(t.dtype), list(t.shape)]).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()
