"""The `wkvm-state-v1` file: one safetensors file, tensors named by the StateSpec, metadata validated on read.

Convention: a state holds the recurrent state after all but the last of its `token_ids`; the last token is
*pending* and is fed first when generation resumes. So every state can produce the next-token distribution
without storing logits, and a turn's final state (whose last sampled token was never fed) needs no extra step.

Import is the trust boundary: `decode` refuses whatever this server could not have produced itself — another model,
a history longer than MAX_HISTORY_TOKENS, values beyond MAX_STATE_ABS (the trained default model's states stay
below 1.1e4 even after 32k repeats of one token; docs/state-file.md has the measurement), metadata nested or
sized beyond the bounds below.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from wkvm.models.spec import State, StateSpec

FORMAT = "wkvm-state-v1"
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-]{0,127}")  # used with fullmatch: '$' would accept a trailing '\n'
MAX_HISTORY_TOKENS = 1 << 20  # 8x the server's longest prompt; keeps a history's index row and JSON bounded (4 MiB)
MAX_TOKEN_ID = (1 << 31) - 1  # the index stores ids as int32
FLOAT16_MAX = 65504.0  # the largest key or value float16 pages (--kv-dtype float16) hold
MAX_STATE_ABS = 1e6  # ~100x the largest value the trained model reaches; far from fp32 overflow (docs/state-file.md)
MAX_OP_PARAMS_BYTES = 16 << 20  # `wkvm chat` keeps its transcript here; the depth limit guards the parser
MAX_OP_PARAMS_DEPTH = 4
MAX_OP_PARAMS_KEYS = 64
MAX_VERSION = (1 << 63) - 1  # SQLite INTEGER
OP_RE = re.compile(r"[a-z][a-z_]{0,31}")
UINT_RE = re.compile(r"[0-9]{1,19}")  # as encode writes n_tokens and version (int() also read " 7 " and "٧")
FLOAT_RE = re.compile(r"[0-9]+(\.[0-9]+)?(e[-+][0-9]+)?")  # repr() of a non-negative finite float, as created_at


class StateFileError(ValueError):
    """A state file or state refused (import, or a name/history the store does not accept); the message says why."""


class HistoryTooLong(StateFileError):
    """A token history longer than MAX_HISTORY_TOKENS (HTTP 400)."""


def check_history(token_ids: list[int], vocab_size: int | None = None) -> None:
    """Refuse an empty, over-long or out-of-vocabulary token history."""
    if not token_ids:
        raise StateFileError("a state needs at least one token in its history")
    if len(token_ids) > MAX_HISTORY_TOKENS:
        raise HistoryTooLong(
            f"a state's token history is capped at {MAX_HISTORY_TOKENS} tokens and this one has {len(token_ids)}: "
            "start a new state from a shorter prompt"
        )
    limit = min(vocab_size, MAX_TOKEN_ID + 1) if vocab_size is not None else MAX_TOKEN_ID + 1
    try:
        ids = np.asarray(token_ids, dtype=np.int64)
    except (OverflowError, ValueError, TypeError):  # e.g. an id beyond int64
        ids = None
    if ids is None or ids.ndim != 1 or int(ids.min()) < 0 or int(ids.max()) >= limit:
        raise StateFileError(f"token ids out of the vocabulary range 0..{limit - 1}")


def resume_inputs(history: list[int], new_ids: list[int]) -> tuple[list[int], list[int]]:
    """For a state with this token history: (tokens to feed: the pending one and the new ones, tokens inside)."""
    if not history and not new_ids:
        raise ValueError("this state has no token history: give a prompt to continue from it")
    return history[-1:] + list(new_ids), history[:-1]


def token_digest(token_ids: list[int]) -> str:
    return hashlib.sha256(np.asarray(token_ids, dtype="<i8").tobytes()).hexdigest()


def tensor_digest(spec: StateSpec, tensors: State) -> str:
    """sha256 over the tensors' raw bytes in spec order (tensors without the batch dim); a spec with kv tensors
    also hashes their token count, so the byte boundaries are part of the content."""
    h = hashlib.sha256()
    if spec.has_kv:
        h.update(next(tensors[t.name].shape[0] for t in spec.tensors if t.paged).to_bytes(8, "little"))
    for t in spec.tensors:
        h.update(tensors[t.name].contiguous().view(torch.uint8).numpy().data)
    return h.hexdigest()


LINEAGE_FIELDS = ("name", "version", "parent", "op", "op_params", "created_at")  # what the other digests leave out


def lineage_digest(md: dict[str, str]) -> str:
    """sha256 over the lineage metadata as written (fields in LINEAGE_FIELDS order, each absent one as null): with the
    tensor and token digests, and the fields checked against the model, every byte of metadata is covered, so a flipped
    bit in `op_params` (where `wkvm chat` keeps its transcript) is refused instead of imported as another history."""
    return hashlib.sha256(json.dumps([md.get(k) for k in LINEAGE_FIELDS]).encode()).hexdigest()


@dataclass
class StateMeta:
    fingerprint: str
    spec_hash: str
    token_ids: list[int]
    name: str = ""
    version: int = 0
    parent: str | None = None
    op: str = "create"
    op_params: dict[str, Any] = field(default_factory=dict)
    created_at: float = 0.0

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)


def valid_name(name: str) -> str:
    if not isinstance(name, str):
        raise StateFileError(f"invalid state name: expected a string, got {type(name).__name__}")
    if not NAME_RE.fullmatch(name):
        raise StateFileError(
            f"invalid state name {name[:140]!r}: use 1-128 letters, digits, '.', '_' or '-', starting with a letter or "
            "digit"
        )
    return name


def parse_handle(handle: str) -> tuple[str, int | None]:
    """'name@3' -> ('name', 3); 'name' -> ('name', None) meaning the latest version."""
    name, sep, version = handle.partition("@")
    if not sep:
        return name, None
    # ASCII digits only: str.isdigit also accepts e.g. Arabic-Indic digits, which int() reads as numbers; leading
    # zeros read as the number (only its digits are range-checked: '0009223372036854775808' had passed as 922...)
    digits = version.lstrip("0")
    if not (version.isascii() and version.isdigit()) or len(digits) > 19 or not 1 <= int(digits or 0) <= MAX_VERSION:
        raise ValueError(f"invalid handle {handle[:160]!r}: the version after '@' must be an integer 1..{MAX_VERSION}")
    return name, int(version)


def valid_handle(handle: str) -> str:
    """A handle whose name and version are both valid (ValueError naming what is not)."""
    valid_name(parse_handle(handle)[0])
    return handle


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
    md["lineage_sha256"] = lineage_digest(md)
    return metadata_in_order(st_save({t.name: tensors[t.name] for t in spec.tensors}, metadata=md))


def metadata_in_order(data: bytes) -> bytes:
    """safetensors writes `__metadata__` in no fixed order (a Rust HashMap): sorted here, so one state exports as the
    same bytes every time (a client may compare or cache exports by their hash)."""
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    return data[:8] + raw.ljust(n) + data[8 + n :] if len(raw) <= n else data  # padded as safetensors pads


# every metadata field `encode` writes (files before lineage_sha256 lack that one): an import refuses any other
META_KEYS = frozenset({"format", "family", "fingerprint", "spec_hash", "n_tokens", "token_ids", "token_digest", "name",
                       "version", "parent", "op", "op_params", "created_at", "tensor_sha256", "lineage_sha256"})


def decode(
    data: bytes, spec: StateSpec, fingerprint: str, vocab_size: int | None = None, imported: bool = True
) -> tuple[State, StateMeta]:
    """Parse and validate wkvm-state-v1 bytes against this model; raises StateFileError naming the problem.

    imported=False is for the store's own files (recovery): it skips the import bounds (history cap, value bound,
    op_params size), which protect the server from files it did not write and could refuse a state it made.
    """
    tensors = load_tensors(data)
    md = metadata(data)
    if md.get("format") != FORMAT:
        raise StateFileError(f"format is {md.get('format')!r}, expected {FORMAT!r}")
    if imported and (unknown := sorted(set(md) - META_KEYS)):  # no checksum covers them (hunt, session 47)
        raise StateFileError(f"bad metadata: unknown field {unknown[0][:40]!r} (a state file carries only "
                             f"{', '.join(sorted(META_KEYS))})")  # fmt: skip
    if md.get("family") != spec.family:
        raise StateFileError(f"the state is of model family {str(md.get('family'))[:40]!r}; the model here is "
                             f"{spec.family!r}")  # fmt: skip
    if md.get("fingerprint") != fingerprint:
        raise StateFileError(
            f"the state was made by another model (fingerprint {str(md.get('fingerprint'))[:12]}..., "
            f"the model here is {fingerprint[:12]}...); a state resumes only on its own model"
        )
    if md.get("spec_hash") != spec.spec_hash:
        raise StateFileError("state spec hash does not match this model's state layout")
    n_kv = _check_tensors(spec, tensors)
    if md.get("tensor_sha256") != tensor_digest(spec, tensors):
        raise StateFileError("tensor checksum mismatch: the file was modified or corrupted")
    if imported:  # after the checksum: a corrupted file is reported as such
        check_magnitude(spec, tensors, MAX_STATE_ABS)
    token_ids = _token_ids(md, vocab_size, imported)
    if md.get("token_digest") != token_digest(token_ids):
        raise StateFileError("token digest does not match token_ids")
    check_kv_count(spec, n_kv, len(token_ids))
    # files written before the lineage digest existed have none, and import as before
    if "lineage_sha256" in md and md["lineage_sha256"] != lineage_digest(md):
        raise StateFileError("lineage checksum mismatch (name, version, parent, op, op_params or created_at): the file "
                             "was modified or corrupted")  # fmt: skip
    op_params = _op_params(md.get("op_params", "{}"), imported)
    created_at = md.get("created_at", "0")
    if not isinstance(created_at, str) or not FLOAT_RE.fullmatch(created_at) or not math.isfinite(float(created_at)):
        raise StateFileError("bad metadata: created_at must be a finite non-negative number (seconds since the epoch)")
    try:
        meta = StateMeta(
            fingerprint=fingerprint, spec_hash=spec.spec_hash, token_ids=token_ids,
            name=md.get("name", ""), version=_uint(md, "version", "0"), parent=md.get("parent") or None,
            op=md.get("op", "import"), op_params=op_params, created_at=float(created_at),
        )  # fmt: skip
    except StateFileError:  # _uint's own message ("bad metadata field: bad metadata: version ..." before)
        raise
    except (ValueError, TypeError) as e:
        raise StateFileError(f"bad metadata field: {e}") from None
    if imported:  # the lineage an import records (and a later export carries): checked as the store's own
        _check_lineage(meta)
    return tensors, meta


def _check_lineage(meta: StateMeta) -> None:
    """A file's name, version, parent and op, as the store would have written them (a 17 MB name had been recorded as
    the import's origin, and the re-export of that state did not import). An empty name stays allowed: a chat
    session's mirror copy (sessions.py) is written without one."""
    if meta.name:
        valid_name(meta.name)
    if not 0 <= meta.version <= MAX_VERSION:
        raise StateFileError(f"bad metadata: version must be an integer 0..{MAX_VERSION}")
    if meta.parent is not None:
        try:
            valid_handle(meta.parent)
        except ValueError as e:
            raise StateFileError(f"bad metadata: parent: {e}") from None
    if not OP_RE.fullmatch(meta.op):
        raise StateFileError(f"bad metadata: op {meta.op[:40]!r} is not an operation's name")


def check_kv_count(spec: StateSpec, n_kv: int, n_ids: int) -> None:
    """A state's kv tensors cache every token of its history but the pending last one."""
    if spec.has_kv and n_kv != n_ids - 1:
        raise StateFileError(f"the kv tensors hold {n_kv} tokens; a state of {n_ids} tokens (the last one pending) "
                             f"holds {n_ids - 1}")  # fmt: skip


def _check_tensors(spec: StateSpec, tensors: State) -> int:
    """Names, shapes, dtypes and finiteness against the spec; returns the kv tensors' token count (0 if none)."""
    if set(tensors) != set(spec.names):
        missing, extra = sorted(set(spec.names) - set(tensors)), sorted(set(tensors) - set(spec.names))
        raise StateFileError(f"tensor names differ from the spec: missing {missing[:3]}, unexpected {extra[:3]}")
    n_kv = next((tensors[t.name].shape[0] if tensors[t.name].dim() else 0 for t in spec.tensors if t.paged), 0)
    for t in spec.tensors:
        x, want = tensors[t.name], t.shape_for(n_kv)
        if tuple(x.shape) != want or x.dtype != t.torch_dtype:  # a kv tensor's token count is the file's own
            shape = f"[tokens, {', '.join(map(str, want[1:]))}]" if t.paged else str(list(want))
            raise StateFileError(f"tensor {t.name}: {list(x.shape)} {x.dtype}, expected {shape} {t.dtype}")
        if not torch.isfinite(x).all():
            raise StateFileError(f"tensor {t.name} holds NaN or infinite values")
    return n_kv


def check_magnitude(spec: StateSpec, tensors: State, max_abs: float, paged_only: bool = False,
                    why: str = "no state of a model reaches that (a crafted or corrupted file)") -> None:
    """No value of the state's tensors (`paged_only`: its keys and values) beyond `max_abs`; `why` the message's end."""
    for t in spec.tensors:
        x = tensors[t.name]
        largest = 0.0
        if x.numel() and (t.paged or not paged_only):  # one pass, no |x| copy (a request's load checks its pages)
            lo, hi = torch.aminmax(x)
            largest = max(-float(lo), float(hi))
        if largest > max_abs:
            raise StateFileError(f"tensor {t.name} holds a value of magnitude {largest:.3g}, beyond {max_abs:g}: {why}")


_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def read_tensors(path: str | os.PathLike[str], spec: StateSpec) -> State:
    """Fast read of a trusted local state file: one read, tensors are views into it (no checksum)."""
    raw = torch.from_numpy(np.fromfile(path, dtype=np.uint8))
    n = int.from_bytes(raw[:8].numpy().tobytes(), "little")
    header = json.loads(raw[8 : 8 + n].numpy().tobytes())
    out: State = {}
    for t in spec.tensors:
        entry = header.get(t.name)
        shape = tuple(entry["shape"]) if entry is not None else ()
        n_kv = shape[0] if t.paged and shape else 0
        if entry is None or _ST_DTYPES.get(entry["dtype"]) != t.torch_dtype or shape != t.shape_for(n_kv):
            raise StateFileError(f"{path}: tensor {t.name} missing or of the wrong shape/dtype")
        start, end = entry["data_offsets"]
        out[t.name] = raw[8 + n + start : 8 + n + end].view(t.torch_dtype).view(shape)
    return out


def load_tensors(data: bytes) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors; StateFileError when they do not read (truncated, corrupt, or a dtype torch has
    no type for: safetensors' F4 and F8_E8M0 raised a KeyError, a 500 on import)."""
    try:
        tensors: dict[str, torch.Tensor] = st_load(data)
    except (SafetensorError, ValueError, RuntimeError, KeyError) as e:
        raise StateFileError(f"not a readable safetensors file (truncated or corrupt?): {e!r}") from None
    return tensors


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: set[str] = set()
    for twice, _ in pairs:  # one pass: a count per key was quadratic (20,000 keys in a header took 7 s of CPU)
        if twice not in seen:
            seen.add(twice)
            continue
        raise StateFileError(f"key {twice[:80]!r} appears twice in one JSON object: an ambiguous file (readers differ "
                             "on which copy counts)")  # fmt: skip
    return dict(pairs)


def _no_constant(name: str) -> Any:
    raise StateFileError(f"{name} is not JSON (JSON has no NaN or Infinity)")


def _finite_float(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):  # 1e999: Python's reader makes it inf, which the file's next reading refuses
        raise StateFileError(f"the number {text[:40]} is out of a double's range")
    return x


def strict_json(text: str | bytes) -> Any:
    """json.loads that refuses a key repeated in one object, NaN / Infinity and numbers beyond a double's range (all
    of which Python's reader takes: 1e999 as inf)."""
    return json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constant, parse_float=_finite_float)


def metadata(data: bytes) -> dict[str, str]:
    """The safetensors file's metadata (strings); StateFileError when its header is not readable, or names a tensor or
    a metadata field twice."""
    n = int.from_bytes(data[:8], "little")
    try:
        header = strict_json(data[8 : 8 + n])
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        if isinstance(e, StateFileError):
            raise
        raise StateFileError("unreadable safetensors header") from None
    md = (header.get("__metadata__") or {}) if isinstance(header, dict) else None
    if not isinstance(md, dict):
        raise StateFileError("safetensors metadata is not an object")
    return md


def _json(text: str, field: str) -> Any:
    try:
        return strict_json(text)
    except StateFileError as e:
        raise StateFileError(f"{field}: {e}") from None
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than Python's stack
        raise StateFileError(f"{field} is not valid JSON (or is nested too deeply)") from None


def _uint(md: dict[str, str], field: str, default: str) -> int:
    """A metadata integer as encode writes it (ASCII digits only)."""
    text = md.get(field, default)
    if not isinstance(text, str) or not UINT_RE.fullmatch(text):
        raise StateFileError(f"bad metadata: {field} must be a non-negative integer in ASCII digits, "
                             f"not {str(text)[:40]!r}")  # fmt: skip
    return int(text)


def _token_ids(md: dict[str, str], vocab_size: int | None, imported: bool) -> list[int]:
    n = _uint(md, "n_tokens", "")
    raw = md.get("token_ids", "null")
    if imported and (n > MAX_HISTORY_TOKENS or len(raw) > 24 * MAX_HISTORY_TOKENS):
        raise HistoryTooLong(f"the file's token history ({n} tokens) exceeds the cap of {MAX_HISTORY_TOKENS} tokens")
    ids = _json(raw, "token_ids")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise StateFileError("token_ids must be a list of integers")
    if len(ids) != n:
        raise StateFileError(f"n_tokens {n} does not match {len(ids)} token ids")
    if imported:
        check_history(ids, vocab_size)
    elif any(not 0 <= t < (vocab_size or 1 << 62) for t in ids):
        raise StateFileError(f"token ids out of the vocabulary range 0..{(vocab_size or 1 << 62) - 1}")
    return ids


def _op_params(raw: str, imported: bool) -> dict[str, Any]:
    """A JSON object; on import at most MAX_OP_PARAMS_BYTES long, MAX_OP_PARAMS_DEPTH deep, MAX_OP_PARAMS_KEYS keys
    per object."""
    if imported and len(raw) > MAX_OP_PARAMS_BYTES:
        raise StateFileError(f"op_params is {len(raw)} bytes; the most a state file may carry is {MAX_OP_PARAMS_BYTES}")
    params = _json(raw, "op_params")
    if not isinstance(params, dict):
        raise StateFileError("bad metadata: op_params must be a JSON object")
    if imported:
        _check_nesting(params, 1)
    return params


def nests_within_limits(params: dict[str, Any]) -> bool:
    """Whether `params` would pass every check of an import's op_params (its size too: a state imported near the
    limits, its lineage wrapped one level deeper, had made an export that no longer imported)."""
    try:
        _check_nesting(params, 1)
    except StateFileError:
        return False
    return len(json.dumps(params)) <= MAX_OP_PARAMS_BYTES  # as `encode` writes it


def _check_nesting(value: object, depth: int) -> None:
    """Depth, keys per object, and text that is UTF-8 (a lone surrogate, which JSON's \\ud800 escape gives, was
    stored, and every listing of its owner's states then failed to serialize: a 500)."""
    for text in (value, *value) if isinstance(value, dict) else (value,):
        if isinstance(text, str) and not _is_utf8(text):
            raise StateFileError("op_params holds a lone surrogate (text that is not UTF-8)")
    if isinstance(value, int) and not -(2**63) <= value < 2**64:  # a 4,000-digit integer had been taken
        raise StateFileError("op_params holds an integer outside -2^63..2^64-1")
    if isinstance(value, dict | list):
        if depth > MAX_OP_PARAMS_DEPTH:
            raise StateFileError(f"op_params is nested deeper than {MAX_OP_PARAMS_DEPTH} levels")
        if isinstance(value, dict) and len(value) > MAX_OP_PARAMS_KEYS:
            raise StateFileError(f"op_params has an object with {len(value)} keys; at most {MAX_OP_PARAMS_KEYS}")
        for v in value.values() if isinstance(value, dict) else value:
            _check_nesting(v, depth + 1)


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True

