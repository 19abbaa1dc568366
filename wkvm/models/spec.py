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
    def paged(self) -> bool:
        """A `kv` tensor: one entry of `shape` per cached token (a state's first axis after the batch)."""
        return self.kind == "kv"

    def shape_for(self, n_kv: int) -> tuple[int, ...]:
        """This tensor's shape (without the batch axis) in a state holding `n_kv` cached tokens."""
        return (n_kv, *self.shape) if self.paged else self.shape

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
        """Bytes of one sequence's fixed-size state (kv tensors add `token_nbytes` per cached token)."""
        return sum(t.nbytes for t in self.tensors if not t.paged)

    @property
    def token_nbytes(self) -> int:
        """Bytes one cached token adds to the kv tensors (0 for a purely recurrent model)."""
        return sum(t.nbytes for t in self.tensors if t.paged)

    @property
    def has_kv(self) -> bool:
        return any(t.paged for t in self.tensors)

    @property
    def cuttable(self) -> bool:
        """Whether the state after tokens[:n] can be cut out of the state after a longer history: true when every
        tensor is kv (attention only), whose first n entries depend on the first n tokens alone."""
        return bool(self.tensors) and all(t.paged for t in self.tensors)

    def cut(self, state: State, n: int) -> State:
        """The state after the first `n` of the tokens in `state` (a `cuttable` spec only)."""
        if not self.cuttable:
            raise ValueError(f"a {self.family} state holds fixed-size tensors: it cannot be cut to a shorter history")
        if not 0 <= n <= self.kv_length(state):
            raise ValueError(f"cannot cut a state of {self.kv_length(state)} tokens to {n}")
        return {k: v[:, :n].clone() for k, v in state.items()}

    @property
    def spec_hash(self) -> str:
        doc = {"family": self.family, "tensors": [[t.name, list(t.shape), t.dtype, t.kind] for t in self.tensors]}
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()

    def zeros(self, batch: int = 1, device: torch.device | str = "cpu") -> State:
        """The state before any token: fixed tensors zero, kv tensors empty."""
        return {t.name: torch.zeros((batch, *t.shape_for(0)), dtype=t.torch_dtype, device=device) for t in self.tensors}

    def kv_length(self, state: State) -> int:
        """Cached tokens in a batched state's kv tensors (0 without kv tensors)."""
        return next((state[t.name].shape[1] for t in self.tensors if t.paged), 0)

    def check(self, state: State) -> int:
        """Validate a batched state against the spec; returns the batch size."""
        if set(state) != set(self.names):
            missing = sorted(set(self.names) - set(state))
            extra = sorted(set(state) - set(self.names))
            raise ValueError(f"state does not match spec: missing {missing[:3]}, unexpected {extra[:3]}")
        batch = None
        n_kv = self.kv_length(state)
        for t in self.tensors:
            x = state[t.name]
            if tuple(x.shape[1:]) != t.shape_for(n_kv) or x.dtype != t.torch_dtype:
                raise ValueError(f"state tensor {t.name}: expected [B, {list(t.shape_for(n_kv))}] {t.dtype}, got "
                                 f"{list(x.shape)} {x.dtype}")  # fmt: skip
            if batch is None:
                batch = x.shape[0]
            elif x.shape[0] != batch:
                raise ValueError(f"state tensor {t.name}: batch {x.shape[0]} != {batch}")
        return batch or 0
