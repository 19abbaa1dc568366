"""RWKV-7 in the conformance suite: a random HF/fla directory in BlinkDL shapes."""

from pathlib import Path

from wkvm.models.rwkv7.random_weights import RWKV7Shape, save_random_rwkv7

NAME = "rwkv7"


def write_checkpoint(path: Path, vocab_size: int, seed: int = 0) -> Path:
    save_random_rwkv7(path, RWKV7Shape(2, 32, 16, vocab_size, None, 8, 8, 4, 8), seed=seed, fmt="hf")
    return path
