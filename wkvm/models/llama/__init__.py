"""Llama (grouped-query attention, RoPE): HF directories and llama.cpp GGUF files; see docs/families/llama.md."""

from wkvm.models.llama.family import FAMILY
from wkvm.models.llama.gguf_text import gguf_chat_template, gguf_tokenizer

__all__ = ["FAMILY", "gguf_chat_template", "gguf_tokenizer"]
