"""Bamba-style hybrids: Mamba2 mixers and attention layers in one model; see docs/families/bamba.md."""

from wkvm.models.bamba.family import FAMILY

__all__ = ["FAMILY"]
