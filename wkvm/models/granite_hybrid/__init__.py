"""Granite 4.0 H (IBM's Mamba2 + attention hybrid, dense); see docs/families/granite_hybrid.md."""

from wkvm.models.granite_hybrid.family import FAMILY

__all__ = ["FAMILY"]
