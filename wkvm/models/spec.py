"""StateSpec: a model family's per-sequence recurrent state, described as named tensors."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}

State = dict[str, torch.Tensor]
"""A batch of states: spec name -> tensor of shape [B, *TensorSpec.shape]."""


KINDS = {
    "recurrent": "a fixed-size memory updated every token (a linear recurrence's matrix state)",
    "shift": "the last token's input to a layer ([C]): token shift",
    "conv": "the last K-1 inputs of a depthwise causal convolution ([C, K-1], oldest first)",
    "kv": "an attention layer's keys and values: grows with the context, paged (see docs/state-file.md)",
}
FIXED_KINDS = ("recurrent", "shift", "conv")  # fixed size per sequence: a slot in the arena holds them


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    kind: str = "recurrent"  # one of KINDS


    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"state tensor {self.name}: kind {self.kind!r} is not one of {sorted(KINDS)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.torch_dtype.itemsize


@dataclass(frozen=True)
class StateSpec:
    family: str
    tensors: tuple[TensorSpec, ...]

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tensors]

    @property
    def nbytes(self) -> int:
        """Bytes of one sequence's state."""
        return sum(t.nbytes for t in self.tensors)

    @property
    def spec_hash(self) -> str:
        doc = {"family": self.family, "tensors": [[t.name, list(t.shape), t.dtype, t.kind] for t in self.tensors]}
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()

    def zeros(self, batch: int = 1, device: torch.device | str = "cpu") -> State:
        return {t.name: torch.zeros((batch, *t.shape), dtype=t.torch_dtype, device=device) for t in self.tensors}

    def check(self, state: State) -> int:
        """Validate a batched state against the spec; returns the batch size."""
        if set(state) != set(self.names):
            missing = sorted(set(self.names) - set(state))
            extra = sorted(set(state) - set(self.names))
            raise ValueError(f"state does not match spec: missing {missing[:3]}, unexpected {extra[:3]}")
        batch = None
        for t in self.tensors:
            x = state[t.name]
            if tuple(x.shape[1:]) != t.shape or x.dtype != t.torch_dtype:
                raise ValueError(
                    f"state tensor {t.name}: expected [B, {list(t.shape)}] {t.dtype}, got {list(x.shape)} {x.dtype}"
                )
            if batch is None:
                batch = x.shape[0]
            elif x.shape[0] != batch:
                raise ValueError(f"state tensor {t.name}: batch {x.shape[0]} != {batch}")
        return batch or 0
