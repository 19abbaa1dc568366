"""RWKV-7 "Goose" (x070): the model, its checkpoint formats, the World tokenizer and chat format."""

from wkvm.models.rwkv7.family import FAMILY

__all__ = ["FAMILY"]
