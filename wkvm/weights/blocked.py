"""A copy of a pack's layers in compute form, beside the pack, which streaming reads instead of the plain files.

float32 and bfloat16: the matrices in oneDNN's blocked layout. Streamed layers are read straight into the form
the fast matmul kernel uses: no reorder per read, and at batch 8 the blocked kernel runs about 2x faster than the
same fp32 weights in plain row-major layout. The blocked layout depends on the CPU and the oneDNN build, so the pack
itself stays portable (plain safetensors) and the copy lives beside it in `onednn-<layout>/`, keyed by a probe: the
blocked bytes of fixed matrices of each shape. Another machine or torch build computes another key and builds its
own copy on first use.

int8 and int4 (`--dtype`): the layers quantized once (`int8-v1/`, `int4-v1/`: the same bytes on every machine), so
a streamed layer is a quarter (int8) or under a sixth (int4) of fp32's bytes to read and needs no work per read.

    <copy>/manifest.json     format, layout key (blocked) or dtype (quantized), sha256 of every source layer
                             file, and per layer the same file entry as the pack manifest (size, sha256, offsets)
    <copy>/layer_000.safetensors   the layer in compute form (the family's `prepare_layer`); in a blocked copy each
                             of its `linear_keys` matrices as `<name>.onednn`, uint8 bytes of the blocked layout

A copy whose source hashes differ from the pack (the pack was rewritten) is rebuilt. Files are written
atomically and the manifest last, so a crash mid-build leaves no copy that would be used.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from wkvm.atomic import atomic_path, fsync_dir
from wkvm.models.linear import onednn_available, onednn_bf16_available, pack_linear
from wkvm.progress import progress
from wkvm.weights.loader import PACK_MANIFEST as MANIFEST
from wkvm.weights.pack import Pack, PackError, check_entry, layer_file, write_file

FORMAT = "wkvm-pack-onednn-v2"
QUANTIZED_FORMAT = "wkvm-pack-quantized-v1"
SUFFIX = ".onednn"
log = logging.getLogger(__name__)


def memory(packed: torch.Tensor) -> ctypes.Array[ctypes.c_char]:
    """The bytes of a oneDNN tensor as a writable buffer (it stays valid while `packed` lives)."""
    n: int = torch.ops.mkldnn._nbytes(packed)
    address: int = torch.ops.mkldnn.data_ptr(packed)
    return (ctypes.c_char * n).from_address(address)


def template(shape: list[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A blocked matrix of `shape` whose bytes a read then overwrites."""
    return pack_linear(torch.zeros(shape, dtype=dtype))


@dataclass
class BlockedCopy:
    path: Path
    layers: list[dict[str, Any]]  # per layer: its file entry (size, sha256, tensor offsets)
    shapes: dict[str, list[int]]  # each blocked matrix's [out, in] by name (a buffer holds one of each)


def matrix_shapes(pack: Pack) -> dict[str, list[int]]:
    """The [out, in] shape of every matrix the family's layers pass to `linear`, by name: read from one prepared
    layer per distinct set of `linear_keys` (one layer for a family whose layers are all alike)."""
    family, cfg = pack.family, pack.config
    last_of_kind = {family.linear_keys(cfg, i): i for i in range(cfg.n_layer)}
    shapes: dict[str, list[int]] = {}
    for keys, i in last_of_kind.items():
        layer = family.prepare_layer(pack.read(i), i, cfg, torch.float32, "cpu", pack=False)
        for k in keys:
            shape = list(layer[k].shape)
            if shapes.setdefault(k, shape) != shape:
                raise PackError(f"{pack.path}: matrix {k} has shape {shape} in layer {i}, {shapes[k]} elsewhere")
    return shapes


def layout_key(shapes: dict[str, list[int]], dtype: torch.dtype = torch.float32) -> str | None:
    """Names this machine's blocked layout for matrices of these shapes in `dtype` (float32 or bfloat16); None
    when oneDNN does not pack that dtype here."""
    if not (onednn_bf16_available() if dtype == torch.bfloat16 else dtype == torch.float32 and onednn_available()):
        return None
    h = hashlib.sha256(torch.__version__.encode())
    for shape in sorted({tuple(s) for s in shapes.values()}):
        n = shape[0] * shape[1]
        probe = (torch.arange(n, dtype=torch.float64) % 251 - 125).to(dtype).reshape(shape)
        packed = pack_linear(probe)  # keep a reference while its memory is read
        h.update(repr(shape).encode() + bytes(memory(packed)))
    return h.hexdigest()[:16]


def compute_copy(pack: Pack, dtype: torch.dtype = torch.float32) -> BlockedCopy | None:
    """The copy streaming reads for `dtype` (the quantized layers for int8/int4, else the blocked copy), built if
    missing or stale; None when there is none for this dtype here or it cannot be written (then layers stream
    from the plain files and are converted per read)."""
    name = quantized_name(dtype)
    if name is None:
        return blocked_copy(pack, dtype)
    head = {"format": QUANTIZED_FORMAT, "dtype": name, "source": _sources(pack)}
    return _copy(pack, pack.path / f"{name}-v1", head, tuple(head), {}, dtype)


def quantized_name(dtype: torch.dtype) -> str | None:
    from wkvm.models import int4

    return {torch.int8: "int8", int4.DTYPE: "int4"}.get(dtype)


def blocked_copy(pack: Pack, dtype: torch.dtype = torch.float32) -> BlockedCopy | None:
    """The pack's blocked copy with matrices in `dtype`, built if missing or stale; None when oneDNN does not
    pack that dtype here or the copy cannot be written (then layers stream from the plain files)."""
    if not (onednn_bf16_available() if dtype == torch.bfloat16 else dtype == torch.float32 and onednn_available()):
        return None
    shapes = matrix_shapes(pack)
    key = layout_key(shapes, dtype)
    if key is None:
        return None
    head = {"format": FORMAT, "layout": key, "torch": torch.__version__, "source": _sources(pack)}
    return _copy(pack, pack.path / f"onednn-{key}", head, ("format", "source"), shapes, dtype)


def _sources(pack: Pack) -> list[str]:
    """What a copy is made from: the pack's family and config (`prepare_layer` reads them too: a manifest's config
    edited with the files kept had the old copy served) and the sha256 of every layer file."""
    made_of = json.dumps([pack.family.name, pack.manifest["config"]], sort_keys=True)
    return [hashlib.sha256(made_of.encode()).hexdigest(), *(e["sha256"] for e in pack.manifest["layers"])]


def _copy(pack: Pack, d: Path, head: dict[str, Any], checked: tuple[str, ...], shapes: dict[str, list[int]],
          dtype: torch.dtype) -> BlockedCopy | None:  # fmt: skip
    """The copy in `d` when its manifest agrees with `head` on the `checked` keys and its files check out, else
    built again (a blocked copy when `shapes` names its matrices, else a quantized one)."""
    try:
        manifest: dict[str, Any] = json.loads((d / MANIFEST).read_text())
        layers = manifest["layers"]
        if all(manifest.get(k) == head[k] for k in checked) and len(layers) == pack.config.n_layer:
            for i, entry in enumerate(layers):  # an entry naming another layer's file: PackError
                check_entry(d, entry, layer_file(i))
            return BlockedCopy(d, layers, shapes)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, PackError):
        pass  # absent, stale or damaged: build it again
    try:
        # the old manifest goes first, as write_pack's does: a rebuild cut off halfway kept it naming files now
        # partly of another pack, trusted again once the pack it was made from came back (its hashes matched)
        (d / MANIFEST).unlink(missing_ok=True)
        if d.is_dir():
            fsync_dir(d)
        return BlockedCopy(d, _build(pack, d, head, dtype, bool(shapes)), shapes)
    except OSError as e:  # read-only, or out of space: leave no half-built copy taking disk
        shutil.rmtree(d, ignore_errors=True)
        what = "blocked copy" if shapes else f"{head['dtype']} copy"
        log.warning("cannot write the %s of %s (%s); streaming the plain layers, converted per read (slower)", what,
                    pack.path, e)  # fmt: skip
        return None


def _build(pack: Pack, d: Path, head: dict[str, Any], dtype: torch.dtype, blocked: bool) -> list[dict[str, Any]]:
    size = sum(pack.layer_bytes(i) for i in range(pack.config.n_layer))
    what = "laid out for this CPU" if blocked else f"in {dtype}"
    log.info("writing %s: the pack's layers %s (once; %.1f GB before)", d, what, size / 1e9)
    entries = []
    family, cfg = pack.family, pack.config
    for i in progress(range(cfg.n_layer), "blocking layers for this CPU" if blocked else "quantizing layers"):
        layer = family.prepare_layer(pack.read(i), i, cfg, dtype, "cpu", pack=False)
        matrices = family.linear_keys(cfg, i) if blocked else ()
        out = {k: v.contiguous().clone() for k, v in layer.items() if k not in matrices}
        for k in matrices:
            packed = pack_linear(layer[k])  # keep a reference while its memory is copied
            out[k + SUFFIX] = torch.frombuffer(bytearray(memory(packed)), dtype=torch.uint8)
        entries.append(write_file(d, layer_file(i), out))
    manifest = {**head, "layers": entries}
    with atomic_path(d / MANIFEST) as tmp:
        tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    return entries
