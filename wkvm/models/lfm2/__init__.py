"""LFM2 (Liquid AI's short-convolution + attention hybrid); see docs/families/lfm2.md."""

from wkvm.models.lfm2.family import FAMILY

__all__ = ["FAMILY"]
