"""The `wkvm-state-v1` file: one safetensors file, tensors named by the StateSpec, metadata validated on read.

Convention: a state holds the recurrent state after all but the last of its `token_ids`; the last token is
*pending* and is fed first when generation resumes. So every state can produce the next-token distribution
without storing logits, and a turn's final state (whose last sampled token was never fed) needs no extra step.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from wkvm.models.spec import State, StateSpec

FORMAT = "wkvm-state-v1"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-]{0,127}$")
MAX_TOKENS = 10_000_000


class StateFileError(ValueError):
    """A state file refused on import; the message says why."""


def resume_inputs(history: list[int], new_ids: list[int]) -> tuple[list[int], list[int]]:
    """For a state with this token history: (tokens to feed: the pending one and the new ones, tokens inside)."""
    if not history and not new_ids:
        raise ValueError("this state has no token history: give a prompt to continue from it")
    return history[-1:] + list(new_ids), history[:-1]


def token_digest(token_ids: list[int]) -> str:
    return hashlib.sha256(np.asarray(token_ids, dtype="<i8").tobytes()).hexdigest()


def tensor_digest(spec: StateSpec, tensors: State) -> str:
    """sha256 over the tensors' raw bytes in spec order (tensors without the batch dim)."""
    h = hashlib.sha256()
    for t in spec.tensors:
        h.update(tensors[t.name].contiguous().view(torch.uint8).numpy().data)
    return h.hexdigest()


@dataclass
class StateMeta:
    fingerprint: str
    spec_hash: str
    token_ids: list[int]
    name: str = ""
    version: int = 0
    parent: str | None = None
    op: str = "create"
    op_params: dict = field(default_factory=dict)
    created_at: float = 0.0

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)


def valid_name(name: str) -> str:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise StateFileError(
            f"invalid state name {name!r}: use 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return name


def unbatch(state: State) -> State:
    """[1, ...] batch tensors -> contiguous CPU tensors without the batch dim."""
    return {k: v[0].detach().to("cpu").contiguous() for k, v in state.items()}


def encode(spec: StateSpec, tensors: State, meta: StateMeta, digest: str | None = None) -> bytes:
    """Serialize unbatched tensors and metadata to wkvm-state-v1 bytes (`digest`: their tensor_digest, if known)."""
    md = {
        "format": FORMAT,
        "family": spec.family,
        "fingerprint": meta.fingerprint,
        "spec_hash": meta.spec_hash,
        "n_tokens": str(meta.n_tokens),
        "token_ids": json.dumps(meta.token_ids),
        "token_digest": token_digest(meta.token_ids),
        "name": meta.name,
        "version": str(meta.version),
        "parent": meta.parent or "",
        "op": meta.op,
        "op_params": json.dumps(meta.op_params),
        "created_at": repr(meta.created_at),
        "tensor_sha256": digest or tensor_digest(spec, tensors),
    }
    return st_save({t.name: tensors[t.name] for t in spec.tensors}, metadata=md)


def decode(data: bytes, spec: StateSpec, fingerprint: str, vocab_size: int | None = None) -> tuple[State, StateMeta]:
    """Parse and validate wkvm-state-v1 bytes against this model; raises StateFileError naming the problem."""
    try:
        tensors = st_load(data)
    except (SafetensorError, ValueError, RuntimeError) as e:
        raise StateFileError(f"not a readable safetensors file (truncated or corrupt?): {e}") from None
    md = _metadata(data)
    if md.get("format") != FORMAT:
        raise StateFileError(f"format is {md.get('format')!r}, expected {FORMAT!r}")
    if md.get("fingerprint") != fingerprint:
        raise StateFileError(
            f"the state was made by another model (fingerprint {str(md.get('fingerprint'))[:12]}..., "
            f"this server's model is {fingerprint[:12]}...); a state resumes only on its own model"
        )
    if md.get("spec_hash") != spec.spec_hash:
        raise StateFileError("state spec hash does not match this model's state layout")
    if set(tensors) != set(spec.names):
        missing, extra = sorted(set(spec.names) - set(tensors)), sorted(set(tensors) - set(spec.names))
        raise StateFileError(f"tensor names differ from the spec: missing {missing[:3]}, unexpected {extra[:3]}")
    for t in spec.tensors:
        x = tensors[t.name]
        if tuple(x.shape) != t.shape or x.dtype != t.torch_dtype:
            raise StateFileError(f"tensor {t.name}: {list(x.shape)} {x.dtype}, expected {list(t.shape)} {t.dtype}")
        if not torch.isfinite(x).all():
            raise StateFileError(f"tensor {t.name} holds NaN or infinite values")
    if md.get("tensor_sha256") != tensor_digest(spec, tensors):
        raise StateFileError("tensor checksum mismatch: the file was modified or corrupted")
    token_ids = _token_ids(md, vocab_size)
    if md.get("token_digest") != token_digest(token_ids):
        raise StateFileError("token digest does not match token_ids")
    try:
        meta = StateMeta(
            fingerprint=fingerprint, spec_hash=spec.spec_hash, token_ids=token_ids,
            name=md.get("name", ""), version=int(md.get("version", "0")), parent=md.get("parent") or None,
            op=md.get("op", "import"), op_params=json.loads(md.get("op_params", "{}")),
            created_at=float(md.get("created_at", "0")),
        )  # fmt: skip
    except (ValueError, TypeError) as e:
        raise StateFileError(f"bad metadata field: {e}") from None
    if not isinstance(meta.op_params, dict) or not math.isfinite(meta.created_at):
        raise StateFileError("bad metadata: op_params must be an object and created_at a number")
    return tensors, meta


_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def read_tensors(path, spec: StateSpec) -> State:
    """Fast read of a trusted local state file: one read, tensors are views into it (no checksum)."""
    raw = torch.from_numpy(np.fromfile(path, dtype=np.uint8))
    n = int.from_bytes(raw[:8].numpy().tobytes(), "little")
    header = json.loads(raw[8 : 8 + n].numpy().tobytes())
    out: State = {}
    for t in spec.tensors:
        entry = header.get(t.name)
        if entry is None or _ST_DTYPES.get(entry["dtype"]) != t.torch_dtype or tuple(entry["shape"]) != t.shape:
            raise StateFileError(f"{path}: tensor {t.name} missing or of the wrong shape/dtype")
        start, end = entry["data_offsets"]
        out[t.name] = raw[8 + n + start : 8 + n + end].view(t.torch_dtype).view(t.shape)
    return out


def _metadata(data: bytes) -> dict[str, str]:
    n = int.from_bytes(data[:8], "little")
    try:
        header = json.loads(data[8 : 8 + n])
    except (ValueError, UnicodeDecodeError):
        raise StateFileError("unreadable safetensors header") from None
    md = header.get("__metadata__") or {}
    if not isinstance(md, dict):
        raise StateFileError("safetensors metadata is not an object")
    return md


def _token_ids(md: dict[str, str], vocab_size: int | None) -> list[int]:
    try:
        ids = json.loads(md.get("token_ids", "null"))
        n = int(md.get("n_tokens", "-1"))
    except ValueError:
        raise StateFileError("token_ids / n_tokens are not valid JSON / integer") from None
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise StateFileError("token_ids must be a list of integers")
    if len(ids) != n or n > MAX_TOKENS:
        raise StateFileError(f"n_tokens {n} does not match {len(ids)} token ids")
    limit = vocab_size if vocab_size is not None else 1 << 62
    if any(not 0 <= t < limit for t in ids):
        raise StateFileError(f"token ids out of the vocabulary range 0..{limit - 1}")
    return ids
