"""Nemotron-H (NVIDIA's hybrid of Mamba2, attention and MLP layers); see docs/families/nemotron_h.md."""

from wkvm.models.nemotron_h.family import FAMILY

__all__ = ["FAMILY"]
