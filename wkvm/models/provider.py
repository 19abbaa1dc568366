"""Weight providers: the model asks for layer i's tensors when it runs layer i.

Resident RAM is the default; streaming from disk, quantized or device copies plug in behind the same calls.
"""

from __future__ import annotations

from typing import Protocol

import torch

Tensors = dict[str, torch.Tensor]


class WeightProvider(Protocol):
    n_layers: int

    def layer(self, i: int) -> Tensors: ...

    def globals(self) -> Tensors: ...


class ResidentWeights:
    """All tensors held in memory on one device."""

    def __init__(self, layers: list[Tensors], global_tensors: Tensors):
        self._layers = layers
        self._globals = global_tensors
        self.n_layers = len(layers)

    def layer(self, i: int) -> Tensors:
        return self._layers[i]

    def globals(self) -> Tensors:
        return self._globals
