"""Qwen3.5 text models (Gated DeltaNet layers): see docs/families/qwen3_5.md."""

from wkvm.models.qwen3_5.family import FAMILY

__all__ = ["FAMILY"]
