"""Mamba2 (state space duality): the model, its HF and state-spaces checkpoint formats."""

from wkvm.models.mamba2.family import FAMILY

__all__ = ["FAMILY"]
