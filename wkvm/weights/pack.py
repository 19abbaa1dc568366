"""The weight pack (`wkvm-pack-v1`): a directory laid out for direct per-layer reads.

    manifest.json            format, family, config, model fingerprint, and for every file: its size, sha256,
                             and each tensor's dtype, shape, byte offset and length
    globals.safetensors      embedding, head, norms (kept resident)
    layer_000.safetensors    one file per layer: one read brings a whole layer in

Every file is an ordinary safetensors file. Tensors are stored in the family's raw names (a layer's without its
`layer_prefix`) and checkpoint shapes, fp32.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from wkvm.atomic import atomic_path, fsync_dir
from wkvm.models import registry
from wkvm.models.family import CheckpointError, RawTensors, finite
from wkvm.progress import progress
from wkvm.weights.loader import PACK_MANIFEST as MANIFEST
from wkvm.weights.loader import checkpoint_config, checkpoint_fingerprint, read_checkpoint

PACK_FORMAT = "wkvm-pack-v1"
DTYPES = {"F32": torch.float32, "U8": torch.uint8, "I8": torch.int8}


class PackError(CheckpointError):
    """A pack that is truncated or does not match its manifest."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _header(path: Path) -> tuple[int, dict[str, Any]]:
    """A layer file's safetensors header, its length bounded by the file (a length edited to 2^62 had been read as
    is: MemoryError) and its JSON checked (a bare JSONDecodeError before)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if not 0 < n <= size - 8:
            raise PackError(f"{path}: a header of {n} bytes in a file of {size} (damaged or replaced)")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:  # not UTF-8, or not JSON
            raise PackError(f"{path}: its header does not read as JSON ({e})") from None
    if not isinstance(header, dict):
        raise PackError(f"{path}: its header is not a JSON object")
    return n, header


def layer_file(i: int) -> str:
    return f"layer_{i:03d}.safetensors"


def write_file(d: Path, name: str, tensors: RawTensors) -> dict[str, Any]:
    path = d / name
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp))
    n, header = _header(path)
    entries: dict[str, dict[str, Any]] = {}
    for key, meta in header.items():
        if key == "__metadata__":
            continue
        start, end = meta["data_offsets"]
        entries[key] = {"dtype": meta["dtype"], "shape": meta["shape"], "offset": 8 + n + start, "length": end - start}
    return {"file": name, "bytes": path.stat().st_size, "sha256": _sha256(path), "tensors": entries}


def write_pack(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> Path:
    """Convert a checkpoint of any family into a pack directory."""
    family, ckpt = read_checkpoint(src)
    cfg = checkpoint_config(src, family, ckpt)
    used = family.used_tensors(ckpt.raw)
    d = Path(dst)
    d.mkdir(parents=True, exist_ok=True)
    # the old manifest goes first: a re-pack cut off over an older pack of the same shapes left that manifest naming
    # the new files, a silent mix of two models served under the old fingerprint (hunt 16); now it is no pack
    (d / MANIFEST).unlink(missing_ok=True)
    fsync_dir(d)
    global_keys = family.global_keys(cfg)

    def f32(names: list[str], prefix: str = "") -> dict[str, torch.Tensor]:  # read here: a lazy checkpoint's one part
        return {k.removeprefix(prefix): used[k].to(torch.float32).contiguous() for k in names}

    manifest: dict[str, Any] = {
        "format": PACK_FORMAT, "family": family.name, "config": asdict(cfg),
        "fingerprint": checkpoint_fingerprint(family, cfg, ckpt.raw),
        "globals": write_file(d, "globals.safetensors", f32(list(global_keys))),
        "layers": [],
    }  # fmt: skip
    for i in progress(range(cfg.n_layer), "packing layers"):
        prefix = family.layer_prefix(i)
        names = [k for k in used if k.startswith(prefix) and k not in global_keys]
        manifest["layers"].append(write_file(d, layer_file(i), f32(names, prefix)))
    with atomic_path(d / MANIFEST) as tmp:
        tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    return d


def check_entry(d: Path, entry: Any, name: str, verify_hashes: bool = False) -> None:
    """`entry` names file `name` in `d`, which exists, has the listed size and exactly the listed tensors at their
    offsets and lengths. A manifest edited by hand (a field missing or of another type, an entry naming another
    layer's file) is a PackError, not a traceback or another layer's weights."""
    try:
        _check_entry(d, entry, name, verify_hashes)
    except (KeyError, TypeError, AttributeError, IndexError, ValueError) as e:
        if isinstance(e, PackError):
            raise
        raise PackError(f"{d / name}: its manifest entry is malformed ({type(e).__name__}: {e})") from None


def _check_entry(d: Path, entry: Any, name: str, verify_hashes: bool) -> None:
    if entry["file"] != name:
        raise PackError(f"{d}: the manifest's entry for {name} names {str(entry['file'])[:80]!r}")
    if not isinstance(entry["bytes"], int) or not isinstance(entry["sha256"], str):
        raise PackError(f"{d / name}: the manifest's bytes or sha256 is not a number or a string")
    path = d / name
    if not path.is_file():
        raise PackError(f"{path}: missing (the pack is incomplete)")
    size = path.stat().st_size
    if size != entry["bytes"]:
        raise PackError(f"{path}: {size} bytes, the manifest says {entry['bytes']} (truncated or replaced)")
    n, header = _header(path)
    for key, t in entry["tensors"].items():
        meta = header.get(key)
        same = meta is not None and (meta["dtype"], meta["shape"]) == (t["dtype"], t["shape"])
        start, end = meta["data_offsets"] if meta is not None else (0, 0)
        at_its_place = t["offset"] == 8 + n + start and t["length"] == end - start
        if meta is None or not same or t["dtype"] not in DTYPES or not at_its_place:
            raise PackError(f"{path}: tensor {key} does not match the manifest")
        shape = t["shape"]  # header and manifest agree; the data must hold the shape too (a tampered pair had been a
        # bare "shape '[32]' is invalid for input of size 31" traceback at load; hunt, session 49)
        if not isinstance(shape, list) or not all(isinstance(x, int) and x >= 0 for x in shape):
            raise PackError(f"{path}: tensor {key}'s shape {str(shape)[:80]} is not a list of sizes")
        if t["length"] != math.prod(shape) * DTYPES[t["dtype"]].itemsize or not 0 <= start <= end <= size - 8 - n:
            raise PackError(f"{path}: tensor {key}'s data ({end - start} bytes at {start}) does not hold its shape "
                            f"{shape} of {t['dtype']} within the file (truncated or edited)")  # fmt: skip
    if len(header) - ("__metadata__" in header) != len(entry["tensors"]):
        raise PackError(f"{path}: holds tensors the manifest does not list")
    if verify_hashes and _sha256(path) != entry["sha256"]:
        raise PackError(f"{path}: sha256 differs from the manifest (modified or corrupt)")


class Pack:
    """An opened pack; `open` checks that every file exists, has the manifest's size and the same tensors."""

    def __init__(self, path: str | os.PathLike[str], verify_hashes: bool = False):
        self.path = Path(path)
        try:
            self.manifest: dict[str, Any] = json.loads((self.path / MANIFEST).read_text())
        except (OSError, ValueError) as e:
            raise PackError(f"{self.path}: unreadable {MANIFEST}: {e}") from None
        m = self.manifest
        if not isinstance(m, dict) or m.get("format") != PACK_FORMAT:
            got = m.get("format") if isinstance(m, dict) else type(m).__name__
            raise PackError(f"{self.path}: format {got!r}, expected {PACK_FORMAT!r}")
        self.family = registry.family(str(m.get("family", "")))
        try:
            self.config = self.family.config_from_dict(m["config"])
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise PackError(f"{self.path}: manifest config does not fit family {self.family.name!r}: {e}") from None
        if not isinstance(m.get("fingerprint"), str) or not isinstance(m.get("layers"), list):
            raise PackError(f"{self.path}: {MANIFEST} lacks its fingerprint or its list of layers")
        self.fingerprint: str = m["fingerprint"]
        n_layer = self.config.n_layer  # an edited manifest's 0 had loaded a model of no layers; "2" or null is no count
        if isinstance(n_layer, bool) or not isinstance(n_layer, int) or n_layer < 1:
            raise PackError(f"{self.path}: manifest config says {self.config.n_layer} layers")
        if len(m["layers"]) != self.config.n_layer:
            raise PackError(f"{self.path}: manifest lists {len(m['layers'])} layers, config says "
                            f"{self.config.n_layer}")  # fmt: skip
        check_entry(self.path, m.get("globals"), "globals.safetensors", verify_hashes)
        for i, entry in enumerate(m["layers"]):
            check_entry(self.path, entry, layer_file(i), verify_hashes)

    def layer_bytes(self, i: int) -> int:
        n: int = self.manifest["layers"][i]["bytes"]
        return n

    def file(self, i: int | None) -> Path:
        name: str = (self.manifest["globals"] if i is None else self.manifest["layers"][i])["file"]
        return self.path / name

    def read(self, i: int | None) -> RawTensors:
        """A layer's tensors (None: the globals), named as the family's raw tensors (layer prefix added), as views
        into the file read in one go."""
        entry = self.manifest["globals"] if i is None else self.manifest["layers"][i]
        buf = torch.from_numpy(np.fromfile(self.file(i), dtype=np.uint8))
        if buf.numel() != entry["bytes"]:
            raise PackError(f"{self.file(i)}: changed size while the server runs")
        prefix = "" if i is None else self.family.layer_prefix(i)
        return {  # NaN or infinities: a CheckpointError naming the file (a pack's layer is read whole here)
            prefix + name: finite(name, buf[t["offset"] : t["offset"] + t["length"]].view(DTYPES[t["dtype"]])
                                  .view(t["shape"]), self.file(i))  # fmt: skip
            for name, t in entry["tensors"].items()
        }
