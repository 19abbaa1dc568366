"""The model-family protocol: what a family (a recurrent, attention or hybrid architecture) gives the rest of wkvm.

A family is a package `wkvm/models/<family>/` whose `FAMILY` object implements `ModelFamily`, listed once in
`wkvm/models/registry.py`. Everything else (loader, weight packs, blocked copies, streaming, the engine, the state
store, the server, the CLI) reaches the family only through this protocol and the model it builds
(`LanguageModel`), so a new family touches nothing outside its package.

Checkpoints are read into `RawTensors`: the family's canonical tensor names (one naming for all its formats) in
the file's shapes and dtype. A layer's tensors share the prefix `layer_prefix(i)`; the rest are globals. The same
raw tensors feed a resident model (`prepare_layer`/`prepare_globals` -> `build`), a weight pack (stored raw, one
file per layer) and a streamed model (raw layer read -> `prepare_layer` per read, or a blocked copy).
"""

from __future__ import annotations

import functools
import io
import json
import math
import os
import warnings
import zipfile
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open

from wkvm.chat_template import ChatTemplate
from wkvm.models.fused import attention_groups_rows
from wkvm.models.kv import Attn, DenseKV, KVBatch
from wkvm.models.linear import embedding, native_kernel, pack_linear, rows_independent, stored_outer
from wkvm.models.provider import Tensors, WeightProvider
from wkvm.models.rope import angles
from wkvm.models.spec import State, StateSpec
from wkvm.tokenizer import Tokenizer

RawTensors = dict[str, torch.Tensor]


class LazyTensors(dict[str, torch.Tensor]):
    """Raw tensors made when asked for, each time, and not kept: a checkpoint whose tensors must be computed (a GGUF's
    dequantized to fp32) is then held in memory one tensor at a time while a model is built from it, not whole (an 8B
    GGUF was ~32 GB of fp32 before its first layer was converted). Reading, membership and iteration work as a dict's;
    the tensors cannot be changed. `items()` and `values()` make every tensor in turn."""

    def __init__(self, makers: dict[str, Callable[[], torch.Tensor]], shapes: dict[str, tuple[int, ...]] | None = None,
                 file_names: dict[str, str] | None = None):  # fmt: skip
        super().__init__()  # nothing stored: every read goes through the makers
        self._makers = makers
        self.shapes = shapes or {}  # the shapes known without making a tensor (a GGUF header's)
        self.file_names = file_names or {}  # each tensor's name in its file where that differs (a GGUF's blk.0...)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._makers[name]()

    def get(self, name: str, default: Any = None) -> Any:
        return self._makers[name]() if name in self._makers else default

    def __contains__(self, name: object) -> bool:
        return name in self._makers

    def __iter__(self) -> Iterator[str]:
        return iter(self._makers)

    def __len__(self) -> int:
        return len(self._makers)

    def keys(self) -> Any:
        return self._makers.keys()

    def items(self) -> Any:
        return ((name, make()) for name, make in self._makers.items())

    def values(self) -> Any:
        return (make() for make in self._makers.values())

    def only(self, names: Collection[str]) -> LazyTensors:
        return LazyTensors({k: f for k, f in self._makers.items() if k in names}, self.shapes, self.file_names)

    def copy(self) -> LazyTensors:  # dict's own would copy the (empty) storage
        return LazyTensors(dict(self._makers), self.shapes, self.file_names)

    def _refuse(self, *args: object, **kwargs: object) -> None:
        raise TypeError("LazyTensors are read-only")

    __setitem__ = __delitem__ = pop = popitem = update = setdefault = clear = _refuse  # type: ignore[assignment]


def only(raw: RawTensors, names: Collection[str]) -> RawTensors:
    """The tensors of `raw` named in `names` (lazily, where `raw` is lazy)."""
    return raw.only(names) if isinstance(raw, LazyTensors) else {k: v for k, v in raw.items() if k in names}


class CheckpointError(ValueError):
    """A checkpoint that cannot be read; the message says why."""


def finite(name: str, t: torch.Tensor, where: str | os.PathLike[str]) -> torch.Tensor:
    """`t`, or a CheckpointError naming it where it holds NaN or infinities. The first forward pass at load checks
    the logits too, but a NaN can vanish on the way (a norm's NaN weight in one channel had given finite, wrong text:
    kernels' max and ReLU drop NaN; crash-safety hunt, session 47)."""
    # aminmax: one pass and no mask (NaN propagates to both; isfinite's mask took ~30x longer, 0.35 s a SmolLM2 load)
    if t.is_floating_point() and t.numel() and not all(bool(torch.isfinite(m)) for m in t.aminmax()):
        raise CheckpointError(f"{where}: tensor {name!r} holds NaN or infinite values")
    return t


def finite_tensors(raw: RawTensors, where: str | os.PathLike[str]) -> LazyTensors:
    """`raw` with each tensor checked by `finite` as it is read (once per read: lazy tensors stay lazy)."""
    makers: dict[str, Callable[[], torch.Tensor]] = {
        name: functools.partial(lambda n: finite(n, raw[n], where), name) for name in raw
    }
    if isinstance(raw, LazyTensors):
        return LazyTensors(makers, raw.shapes, raw.file_names)
    return LazyTensors(makers, {k: tuple(t.shape) for k, t in raw.items()})


def shape_of(raw: RawTensors, name: str) -> tuple[int, ...]:
    """Tensor `name`'s shape; a lazy tensor's from its known shapes, without making (dequantizing) it."""
    if isinstance(raw, LazyTensors) and name in raw.shapes:
        return raw.shapes[name]
    return tuple(raw[name].shape)


def first_line(text: str, limit: int = 300) -> str:
    """A library's message as one line a user reads: its first line (torch, numpy and llguidance add dumps after it),
    at most `limit` characters."""
    return (text.strip().splitlines() or [""])[0][:limit]


@dataclass
class Checkpoint:
    """A checkpoint read from disk: raw tensors, the HF-style config dict (empty when the format has none) and
    the format's name (e.g. "pth", "hf")."""

    raw: RawTensors
    config: dict[str, Any] = field(default_factory=dict)
    format: str = ""


class FamilyConfig(Protocol):
    """A family's model configuration: a frozen dataclass (stored in pack manifests via `asdict`)."""

    n_layer: int
    vocab_size: int


def each_group(all_logits: bool | Sequence[bool], n: int) -> list[bool]:
    """`forward_groups`' `all_logits` per group: one flag for all, or one per group."""
    every = [all_logits] * n if isinstance(all_logits, bool) else list(all_logits)
    if len(every) != n:
        raise ValueError(f"{n} groups but {len(every)} all_logits flags")
    return every


# A chunk of at most this many tokens of one sequence that a model runs with the bits of stepping through them
# (`chunks_equal_steps`): the engine feeds a moved stream's catch-up in such chunks (`Engine.precopy`).
STEP_CHUNK = 8


class LanguageModel(Protocol):
    """A built model: what the engine, the runner and the state layer use."""

    family: str
    config: Any  # the family's FamilyConfig dataclass
    spec: StateSpec
    fingerprint: str
    device: torch.device
    weights: WeightProvider

    @property
    def vocab_size(self) -> int: ...

    def new_state(self, batch: int = 1) -> State: ...

    def forward(self, tokens: torch.Tensor, state: State, all_logits: bool = False) -> torch.Tensor:
        """tokens [B, T] -> logits [B, V] (last position) or [B, T, V]; `state` advances in place."""
        ...

    def forward_groups(
        self, groups: Sequence[tuple[torch.Tensor, State]], all_logits: bool | Sequence[bool] = False,
        caches: Sequence[KVBatch] | None = None,
    ) -> list[torch.Tensor]:  # fmt: skip
        """Several independent batches in one sweep of the weights; each result equals `forward` on it alone.
        `all_logits`: every position's logits [B, T, V] rather than the last's [B, V], for all groups or per group.

        `caches` (models with attention layers): group j's keys and values, e.g. the engine's paged caches;
        without it they are the kv tensors of the group's state dict, [B, n, ...] (`DenseKV`)."""
        ...

    @property
    def context_length(self) -> int | None:
        """The most tokens one sequence may hold (the model's trained context), None when unbounded."""
        ...

    @property
    def chunks_equal_steps(self) -> bool:
        """Whether a chunk of up to STEP_CHUNK tokens of one sequence gives the same bits as stepping through them
        (else it agrees to rounding, which int8 / int4 kernels, rounding their inputs, can amplify)."""
        ...

    def prefill(
        self, tokens: Sequence[int] | torch.Tensor, state: State | None = None,
        all_logits: bool = False, chunk_size: int | None = None,
    ) -> tuple[torch.Tensor, State]: ...  # fmt: skip

    def decode(self, tokens: Sequence[int] | torch.Tensor, state: State) -> torch.Tensor: ...


class ModelBase:
    """The entry points every family's model shares; a family's model subclasses this and implements `embed`,
    `block` and `logits` (or its own `forward_groups`, when layers pass more than the residual stream)."""

    family: str
    config: Any
    spec: StateSpec
    fingerprint: str
    device: torch.device
    weights: WeightProvider

    def __init__(self, config: Any, spec: StateSpec, weights: WeightProvider, fingerprint: str,
                 device: torch.device | str) -> None:  # fmt: skip
        self.config, self.spec, self.weights, self.fingerprint = config, spec, weights, fingerprint
        self.device = torch.device(device)
        self._kernels: dict[tuple[int, int], tuple[str, list[int]] | None] = {}
        self._alone: dict[int, bool] = {}

    def layer_kernel(self, i: int, mats: list[torch.Tensor], rows: int) -> tuple[str, list[int]] | None:
        """`linear.native_kernel(mats, rows)` for layer i's matrices, remembered per (layer, rows): it depends only on
        the formats of the layer's weights, fixed for a model (streamed layers come back as they were), and on the
        row count. Asked afresh inside a decode step it cost ~8 us a layer (its Python runs cache-cold after the
        previous layer's weights streamed through), ~0.15 ms of a ~6 ms one-row SmolLM2 step."""
        key = (i, rows)
        if key not in self._kernels:
            self._kernels[key] = native_kernel(mats, rows)
        return self._kernels[key]

    @property
    def vocab_size(self) -> int:
        vocab: int = self.config.vocab_size
        return vocab

    def new_state(self, batch: int = 1) -> State:
        return self.spec.zeros(batch, self.device)

    @property
    def chunks_equal_steps(self) -> bool:
        """Where its rows are alone at STEP_CHUNK tokens (`rows_alone`)."""
        return self.rows_alone(STEP_CHUNK)

    embed_key: str = ""  # the embedding's name in `weights.globals()`, for the default `embed`
    kv_layers: tuple[int, ...] = ()  # the attention layers, whose state is keys and values (kind "kv")
    inv_freq: torch.Tensor  # RoPE frequencies, set by models with attention layers

    def embed(self, tokens: torch.Tensor, g: Tensors) -> torch.Tensor:
        """tokens [B, T] -> the first residual stream [B, T, C] (fp32): by default a lookup in `g[embed_key]`."""
        return embedding(tokens, g[self.embed_key])

    def block(self, i: int, w: Tensors, x: torch.Tensor, state: State, attn: Attn | None) -> torch.Tensor:
        """Layer i on residual stream x [B, T, C] with layer weights `w`, advancing `state` in place; an attention
        layer (one of `kv_layers`) appends to and attends over `attn.kv` (None for models without attention)."""
        raise NotImplementedError

    def rope(self, start: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of the RoPE angles for positions start[b] .. start[b] + T - 1 (models with attention layers set
        `inv_freq`, their per-pair frequencies)."""
        return angles(self.inv_freq, start, T)

    def logits(self, x: torch.Tensor, g: Tensors) -> torch.Tensor:
        """Final norm and head: [..., C] -> [..., V]."""
        raise NotImplementedError

    @property
    def context_length(self) -> int | None:
        """The config's `max_context` (a trained context length) where it has one."""
        context: int | None = getattr(self.config, "max_context", None)
        return context

    @torch.inference_mode()
    def forward_groups(
        self, groups: Sequence[tuple[torch.Tensor, State]], all_logits: bool | Sequence[bool] = False,
        caches: Sequence[KVBatch] | None = None,
    ) -> list[torch.Tensor]:  # fmt: skip
        """Several independent batches (e.g. the decode batch and prefill pieces of other lengths) in one sweep of
        the weights: layer i runs for every group before layer i + 1 is asked for, so streamed weights are read
        once per step. Each group's result is exactly what `forward` gives it alone. Attention layers use
        `caches` (one per group) or, without it, the kv tensors of each group's state dict (`DenseKV`)."""
        attns = self._attention_inputs(groups, caches)
        g = self.weights.globals()
        xs = [self.embed(tokens.to(self.device), g) for tokens, _ in groups]
        rest = []  # the groups whose layers do not all run in one call (`decode_groups`) go layer by layer
        for j, y in enumerate(self.decode_groups(xs, [state for _, state in groups], attns)):
            if y is None:
                rest.append(j)
            else:
                xs[j] = y
        for i in range(self.config.n_layer if rest else 0):
            w = self.weights.layer(i)
            for j in rest:
                xs[j] = self.block(i, w, xs[j], groups[j][1], attns[j])
        every = each_group(all_logits, len(groups))
        return [self.logits(x if e else x[:, -1], g) for x, e in zip(xs, every, strict=True)]

    def decode_groups(self, xs: list[torch.Tensor], states: list[State],
                      attns: list[Attn | None]) -> list[torch.Tensor | None]:  # fmt: skip
        """Every layer of groups at once (group j's xs[j] [B, T, C] -> its last layer's output, its state advanced),
        exactly as `block` layer by layer, where a family has such a call (groups may share one); None for each group
        it has none for (here: every group)."""
        return [None] * len(xs)

    def _attention_inputs(self, groups: Sequence[tuple[torch.Tensor, State]],
                          caches: Sequence[KVBatch] | None) -> list[Attn | None]:  # fmt: skip
        """Per group: its cache and RoPE angles (computed once for every attention layer); None without attention."""
        if not self.kv_layers:
            no_attention(self, caches)
            return [None] * len(groups)
        if caches is None:
            caches = [DenseKV(state, list(self.kv_layers)) for _, state in groups]
        if len(caches) != len(groups):
            raise ValueError(f"{len(groups)} groups but {len(caches)} caches")
        pairs = zip(groups, caches, strict=True)
        # by the chunk's length alone (not the group's rows): a row's attention must not depend on its batch
        return [Attn(kv, *self.rope(kv.positions(), tokens.shape[1]), tokens.shape[1] > 1 and
                     self.rows_alone(tokens.shape[1])) for (tokens, _), kv in pairs]  # fmt: skip

    row_keys: tuple[str, ...] = ()  # a layer's matrices, in a family whose other ops give each row its own bits
    head_key: str = "lm_head.weight"  # the head's name in `weights.globals()`

    def checks_drafts(self, rows: int) -> bool:
        """Whether one sequence's chunk of 2 .. `rows` tokens gives every position the logits stepping gives it, to
        the bit: its layers' rows alone (`rows_alone`) and the head's (speculative decoding checks a draft so)."""
        head = self.weights.globals().get(self.head_key)
        return head is not None and all(self.rows_alone(t) and rows_independent(head, t) for t in range(2, rows + 1))

    def steps_kernel(self) -> bool:
        """Whether the family's recurrent layers run a chunk of T tokens with T steps' arithmetic here (their kernel
        built); families without recurrent layers need none."""
        return True

    def rows_alone(self, rows: int) -> bool:
        """Whether every layer computes each of `rows` rows (a chunk's tokens) with the bits it gives that row alone,
        so that attention takes a chunk's tokens one at a time (`Attn.token_rows`), recurrent layers step through
        them (`steps_kernel`) and the chunk has stepping's bits. A family whose other ops work row by row names its
        layers' matrices (`row_keys`); they decide, as layer 0 and the first attention layer hold them (a model's
        layers share one format): each on a native kernel at that many rows (`linear.rows_independent`). Where the
        fused attention cannot group a chunk's rows (`fused.attention_groups_rows`), longer chunks attend through
        torch, to rounding."""
        if not self.row_keys or not self.steps_kernel() or (self.kv_layers and not attention_groups_rows(rows)):
            return False
        if rows not in self._alone:  # asked every step: the weights (perhaps streamed) read only the first time
            layers = [self.weights.layer(i) for i in sorted({0, *self.kv_layers[:1]})]
            self._alone[rows] = all(rows_independent(w[k], rows) for w in layers for k in self.row_keys if k in w)
        return self._alone[rows]

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, state: State, all_logits: bool = False) -> torch.Tensor:
        """tokens [B, T] -> logits [B, V] (last position) or [B, T, V]; `state` ([B, ...]) advances in place."""
        return self.forward_groups([(tokens, state)], all_logits)[0]

    def prefill(
        self, tokens: Sequence[int] | torch.Tensor, state: State | None = None,
        all_logits: bool = False, chunk_size: int | None = None,
    ) -> tuple[torch.Tensor, State]:  # fmt: skip
        """One sequence: feed T tokens (in pieces of `chunk_size`); returns logits [V] or [T, V] and the state."""
        ids = torch.as_tensor(tokens, dtype=torch.long).reshape(1, -1)
        if ids.shape[1] == 0:
            raise ValueError("prefill needs at least one token")
        state = self.new_state(1) if state is None else state
        step = chunk_size or ids.shape[1]
        pieces = [self.forward(ids[:, s : s + step], state, all_logits) for s in range(0, ids.shape[1], step)]
        return (torch.cat(pieces, 1)[0] if all_logits else pieces[-1][0]), state

    def decode(self, tokens: Sequence[int] | torch.Tensor, state: State) -> torch.Tensor:
        """One step for B sequences: tokens [B] -> logits [B, V]; state advances in place."""
        return self.forward(torch.as_tensor(tokens, dtype=torch.long).reshape(-1, 1), state)


def no_attention(model: Any, caches: Sequence[KVBatch] | None) -> None:
    """Refuse KV caches for a model without attention layers (a caller's bug, not a request's)."""
    if caches is not None:
        raise TypeError(f"{model.family} has no attention layers: forward_groups takes no caches")


SHARD_INDEX = "model.safetensors.index.json"


def safetensors_files(path: Path) -> list[Path]:
    """The weight files of directory `path`: those its shard index (`model.safetensors.index.json`) names where it has
    one, as transformers reads them (a stale shard left beside a re-sharded download is not read), else every
    `*.safetensors` file."""
    index = path / SHARD_INDEX
    if not index.is_file():
        return sorted(path.glob("*.safetensors"))
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{index}: not a shard index with a weight_map ({first_line(str(e))})") from None
    if not all(isinstance(n, str) and n == Path(n).name for n in names):
        raise CheckpointError(f"{index}: its weight_map names files outside the directory")
    missing = [n for n in names if not (path / n).is_file()]
    if missing:
        raise CheckpointError(f"{index} names {', '.join(missing[:3])}, missing from {path}")
    return [path / n for n in names]


def load_torch_file(path: str | os.PathLike[str]) -> Any:
    """A `torch.save` file's object, tensors only (weights_only: a checkpoint is untrusted bytes), memory-mapped where
    its format allows it (not copied into RAM twice); a legacy (non-zip) file, which cannot be mapped, is read whole
    (it had been refused with torch's message about mmap). A storage record cut short or compressed, and a tensor that
    needs more bytes than its storage holds (a stride-0 / expanded view), are refused (`check_torch_records`,
    `check_views`)."""
    # mapped only where the records were checked: torch's own reading, unmapped, checks each record's size (a zip
    # whose pickle the check cannot read, or whose CRCs torch.save left out, is read so; review, session 49)
    mapped = zipfile.is_zipfile(path) and check_torch_records(path)
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=mapped)
    except RuntimeError:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    check_views(obj, path)
    return obj


class _Placeholder:
    """Any object a torch pickle builds, as `storage_records` reads it: its arguments and items kept, nothing run."""

    args: tuple[Any, ...] = ()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setitem__(self, key: Any, value: Any) -> None:
        self.__dict__.setdefault("items", {})[key] = value

    def __setstate__(self, state: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass


@dataclass(frozen=True)
class _Storage:
    key: str
    nbytes: int


class _StorageKind(_Placeholder):
    """A torch storage class (torch.FloatStorage) as `storage_records` reads it: its element size; calling it makes
    nothing (the class itself would allocate what a pickle asks)."""

    def __init__(self, itemsize: int) -> None:
        super().__init__()
        self.itemsize = itemsize

    def __call__(self, *args: Any, **kwargs: Any) -> _Placeholder:
        return _Placeholder()


def storage_records(path: str | os.PathLike[str]) -> tuple[str, dict[str, _Storage], dict[str, str]] | None:
    """A torch zip archive's storages as its pickle names them: (the archive's folder, key -> storage, key -> the first
    tensor using it), read without importing anything (no class of the pickle is built). None where the archive has
    no data.pkl or its pickle does not read so (torch's own load then says what is wrong)."""
    import pickle

    with zipfile.ZipFile(path) as zf:
        pkl = next((n for n in zf.namelist() if n.endswith("/data.pkl") and n.count("/") == 1), None)
        if pkl is None:
            return None
        try:
            data = zf.read(pkl)
        except zipfile.BadZipFile:  # CRCs left out (torch.serialization.set_crc32_options(False)): torch reads it
            return None
    storages: dict[str, _Storage] = {}

    class Records(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            # torch's own names only (its __dict__: a lazy attribute would import a submodule), never a module's
            found = torch.__dict__.get(name) if module == "torch" else None
            if isinstance(found, torch.dtype):
                return found
            if name.endswith("Storage") and module.split(".")[0] == "torch":  # torch.cuda.FloatStorage too (older
                found = torch.__dict__.get(name)  # GPU saves): the CPU class of that name has its element size
            if name.endswith("Storage") and isinstance(found, type):
                with warnings.catch_warnings():  # a TypedStorage class's dtype warns that TypedStorage is deprecated
                    warnings.simplefilter("ignore")
                    dtype = getattr(found, "dtype", None)
                return _StorageKind(dtype.itemsize if isinstance(dtype, torch.dtype) else 1)  # untyped: bytes
            return _Placeholder

        def persistent_load(self, pid: Any) -> Any:
            if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] in ("storage", b"storage")):
                raise pickle.UnpicklingError(f"unknown persistent id {pid!r:.80}")
            kind, key, numel = pid[1], pid[2], pid[4]
            key = key.decode("ascii") if isinstance(key, bytes) else str(key)
            size = kind.itemsize if isinstance(kind, torch.dtype | _StorageKind) else 1
            # a key named again is the storage its first naming made, as torch's load takes it
            return storages.setdefault(key, _Storage(key, int(numel) * size))

    try:
        obj = Records(io.BytesIO(data)).load()
    except Exception:  # noqa: BLE001 (any pickle torch's load refuses: it says why)
        return None
    users: dict[str, str] = {}
    items = obj.items() if isinstance(obj, dict) else getattr(obj, "__dict__", {}).get("items", {}).items()
    for name, t in items:
        if isinstance(t, _Placeholder) and t.args and isinstance(t.args[0], _Storage):
            users.setdefault(t.args[0].key, str(name))
    return pkl.removesuffix("/data.pkl"), storages, users


def check_torch_records(path: str | os.PathLike[str]) -> bool:
    """Each storage of a torch zip archive is a stored (uncompressed) record holding at least the storage's bytes: a
    memory-mapped load takes a storage's bytes from the record's offset on, so a record cut short had loaded the next
    zip header's bytes as weights, and a re-zipped (deflated) archive its compressed bytes as floats (loading hunt,
    session 49). True once checked (then a mapped load is safe); False where the pickle did not read so."""
    found = storage_records(path)
    if found is None:
        return False  # not checked: read unmapped
    folder, storages, users = found
    with zipfile.ZipFile(path) as zf:
        for key, storage in storages.items():
            try:
                info = zf.getinfo(f"{folder}/data/{key}")
            except KeyError:
                continue  # torch's load names the missing record
            tensor = f"tensor {users[key]}" if key in users else "a tensor"
            if info.compress_type != zipfile.ZIP_STORED:
                raise CheckpointError(f"{path}: {tensor}'s storage data/{key} is compressed (zip method "
                                      f"{info.compress_type}): torch stores tensors uncompressed; re-save it with "
                                      "torch.save")  # fmt: skip
            if info.file_size < storage.nbytes:
                raise CheckpointError(f"{path}: {tensor}'s storage data/{key} holds {info.file_size} bytes of its "
                                      f"{storage.nbytes} (a record cut short)")  # fmt: skip
    return True


def check_views(obj: Any, path: str | os.PathLike[str]) -> None:
    """Every tensor of a loaded file needs at most the bytes its storage holds from its offset: a view that repeats
    its storage (x[:1].expand(16777216, 64), stride 0) had loaded as a small file, then been copied to GiBs (loading
    hunt, session 49). Views of a storage within it (a transposed matrix, a slice, tied tensors) are fine."""
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list | tuple) else ()
    for name, t in items:
        if isinstance(t, dict | list | tuple):
            check_views(t, path)
        elif isinstance(t, torch.Tensor) and t.layout == torch.strided:
            need = t.numel() * t.element_size()
            held = t.untyped_storage().nbytes() - t.storage_offset() * t.element_size()
            if need > held:
                raise CheckpointError(f"{path}: tensor {name} of shape {list(t.shape)} needs {need} bytes, its "
                                      f"storage holds {held} (a view repeating its storage, e.g. an expanded one, "
                                      "is not read)")  # fmt: skip


def read_safetensors_dir(path: Path, rename: Callable[[str], str | None] | None = None) -> RawTensors:
    """Every tensor of the `*.safetensors` files in directory `path` (`safetensors_files`), named by `rename` (None
    drops a tensor). A name in two files is refused (which one a model would run is not knowable). Never reads
    `*.bin`/`*.pt` pickles."""
    files = safetensors_files(path)
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files (pytorch_model.bin is not read: unsafe to unpickle)")
    raw: RawTensors = {}
    seen: dict[str, str] = {}
    for f in files:
        with safe_open(f, framework="pt") as sf:
            for k in sf.keys():  # noqa: SIM118 (safe_open is not a dict)
                if k in seen:
                    raise CheckpointError(f"{path}: tensor {k} is in both {seen[k]} and {f.name}")
                seen[k] = f.name
                name = rename(k) if rename else k
                if name is not None:
                    raw[name] = sf.get_tensor(k)
    return raw


class ModelFamily(Protocol):
    name: str  # StateSpec.family and the pack manifest's "family"
    model_types: tuple[str, ...]  # HF config.json `model_type` values this family reads
    formats: str  # for messages: the checkpoint formats it reads, e.g. "X as a .pth file or an HF directory"

    def detect(self, path: Path) -> str | None:
        """The format name when `path` is a checkpoint of this family in a layout other than an HF directory with
        a `model_type` (those the registry matches by `model_types` as format "hf"), else None. Never raises."""
        ...

    def read_checkpoint(self, path: Path, fmt: str) -> Checkpoint: ...

    def config_from_checkpoint(self, ckpt: Checkpoint) -> Any:
        """The family config (a frozen dataclass) for checkpoint tensors; CheckpointError if they do not fit."""
        ...

    def config_from_dict(self, d: dict[str, Any]) -> Any:
        """The config stored in a pack manifest (`asdict` of the dataclass) back as the dataclass."""
        ...

    def used_tensors(self, raw: RawTensors) -> RawTensors:
        """The tensors the model uses: what a fingerprint hashes and a pack stores."""
        ...

    def global_keys(self, cfg: Any) -> tuple[str, ...]: ...

    def layer_prefix(self, i: int) -> str: ...

    def linear_keys(self, cfg: Any, i: int) -> tuple[str, ...]:
        """Names in `prepare_layer(..., i)`'s result of the [out, in] matrices that go through `linear`: a blocked
        copy stores these in oneDNN's layout."""
        ...

    def prepare_layer(self, raw: RawTensors, i: int, cfg: Any, dtype: torch.dtype, device: torch.device | str,
                      pack: bool = True) -> Tensors:  # fmt: skip
        """Layer i's raw tensors in compute form; `pack` prepacks matrices (resident weights)."""
        ...

    def prepare_globals(self, raw: RawTensors, cfg: Any, dtype: torch.dtype, device: torch.device | str) -> Tensors: ...

    def build(self, cfg: Any, weights: WeightProvider, fingerprint: str, device: torch.device | str) -> LanguageModel:
        ...

    def describe(self, cfg: Any) -> str:
        """One line for `wkvm doctor` and logs, e.g. '12 layers, width 768, vocab 65536'."""
        ...

    def convert(self, src: Path, dst: Path) -> str:
        """Convert a checkpoint between this family's formats (direction from the source); the target's format
        name. CheckpointError when the family has one format only."""
        ...

    def default_tokenizer(self, path: Path) -> Tokenizer | None:
        """The tokenizer for the checkpoint at `path` when no tokenizer.json comes with it: one the file itself
        carries (GGUF metadata) or the family's own (None: a tokenizer.json is required)."""
        ...

    def default_chat_template(self, path: Path) -> ChatTemplate | None:
        """The chat format for the checkpoint at `path` when no template file comes with it: the file's own (GGUF
        metadata) or the family's (None: chat answers 400 without a template)."""
        ...

    def native_dtype(self, path: Path, fmt: str) -> str:
        """What `--dtype auto` stores the weights of the checkpoint at `path` (format `fmt`) as: the wkvm weight kind
        that keeps a quantized file's own precision (a GGUF's), float32 for a float checkpoint."""
        ...


def owned(t: torch.Tensor) -> torch.Tensor:
    """`t` in storage of its own: a view into a larger buffer (a file read in one go) would keep all of it alive."""
    t = t.contiguous()
    return t if t.untyped_storage().nbytes() == t.numel() * t.element_size() else t.clone()


def compute_form(t: Tensors, linear_keys: Sequence[str], pack: bool) -> Tensors:
    """Prepared tensors as a model keeps them: with `pack`, the `linear_keys` matrices prepacked for oneDNN and the
    rest in storage of their own; without, all plain and contiguous (a streamed layer, used once and dropped)."""
    if not pack:
        return {k: v.contiguous() for k, v in t.items()}
    for k in linear_keys:
        t[k] = pack_linear(t[k])
    return resident(t)


def resident(t: Tensors) -> Tensors:
    """Every tensor not prepacked in storage of its own (see `owned`)."""
    return {k: v if v.is_mkldnn else owned(v) for k, v in t.items()}


def embedding_and_head(raw: RawTensors, embed_key: str, head_key: str, tied: bool, dtype: torch.dtype,
                       device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The embedding in `dtype` and the head prepacked (int8 under int4: `stored_outer`): the embedding matrix itself
    when the head is tied."""
    embed = stored_outer(raw[embed_key].to(device), dtype)
    return embed, pack_linear(embed if tied else stored_outer(raw[head_key].to(device), dtype))


def layer_count(raw: RawTensors, prefix: str, after: str = ".") -> int:
    """1 + the largest i among names `prefix{i}{after}...` (0 when there are none)."""
    idx = [int(k[len(prefix) :].split(after, 1)[0]) for k in raw if k.startswith(prefix)]
    return 1 + max(idx) if idx else 0


def untie_head(raw: RawTensors, head: str, embedding: str, tied: bool, where: object) -> RawTensors:
    """HF's `tie_word_embeddings`: a stored head equal to the embedding is dropped (the embedding is the head, hashed
    once); one that differs is kept and used, as transformers 5 uses it (it had been dropped: logits off by 3-23). An
    untied checkpoint needs its head."""
    if tied and head in raw and embedding in raw and torch.equal(raw[head], raw[embedding]):
        del raw[head]
    if not tied and head not in raw:
        raise CheckpointError(f"{where}: no {head} and tie_word_embeddings is not set")
    return raw


def check_layer_count(config: dict[str, Any], n: int, what: str, key: str = "num_hidden_layers") -> None:
    """config.json's layer count, where it gives one, is the weights' (transformers builds that many and drops or
    randomly fills the rest: running the weights' own count had computed another model)."""
    declared = config.get(key)
    if declared is not None and (isinstance(declared, bool) or not isinstance(declared, int | float)):
        # [2] and "six" had escaped as a TypeError / ValueError (loading hunt, session 49)
        raise CheckpointError(f"{what} config.json's {key} {declared!r:.60} is not a layer count")
    if declared is not None and declared != n:
        raise CheckpointError(f"{what} config.json says {declared} layers; the weights hold {n}")


def positive_int(config: dict[str, Any], key: str, what: str, default: Any = None, label: str = "") -> int:
    """config.json's `key` (else `default`) as an integer >= 1; anything else (1.5, true, "six", 0, null without a
    default) is a CheckpointError naming the key (as `label`, where given: `ssm_cfg.headdim`)."""
    value = config.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CheckpointError(f"{what} config.json's {label or key} {value!r:.60} is not a positive integer")
    return value


def config_eps(config: dict[str, Any], key: str, default: float, what: str) -> float:
    """A norm's epsilon from config.json: a finite number > 0 (0, -1 or "x" had loaded and then been reported as the
    checkpoint's NaN or infinite values; loading hunt, session 49)."""
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not (math.isfinite(value) and value > 0):
        raise CheckpointError(f"{what} config.json's {key} {value!r:.60} is not a number > 0")
    return float(value)


def config_context(config: dict[str, Any], key: str, what: str) -> int | None:
    """A trained context length from config.json (`max_position_embeddings`): None where it is absent or null, else an
    integer >= 1 (-1 had loaded, then every request failed "holds at most -1"; loading hunt, session 49)."""
    return None if config.get(key) is None else positive_int(config, key, what)


def matrix_shape(raw: RawTensors, name: str, what: str) -> tuple[int, int]:
    """The [rows, columns] of a 2-D tensor whose shape a config is read from (an embedding); another number of dims
    had escaped as "too many values to unpack" (loading hunt, session 49)."""
    shape = shape_of(raw, name)
    if len(shape) != 2:
        raise CheckpointError(f"{what} tensor {name} has shape {list(shape)}, expected 2 dims (rows, columns)")
    return shape[0], shape[1]


def check_dims(raw: RawTensors, dims: dict[str, int], what: str) -> None:
    """Each tensor named in `dims` (where `raw` holds it) has that many dims: the ones a config's sizes are read from,
    before `check_shapes` checks every tensor against those sizes."""
    for name, n in dims.items():
        if name in raw and len(shape := shape_of(raw, name)) != n:
            raise CheckpointError(f"{what} tensor {name} has shape {list(shape)}, expected {n} dims")


def check_shapes(raw: RawTensors, expected: dict[str, tuple[int, ...]], what: str) -> None:
    """Each tensor named in `expected` (where `raw` holds it) has that shape: one that does not (an extra leading dim)
    had failed deep in oneDNN ("could not create a primitive descriptor for the reorder primitive") naming neither the
    file nor the tensor (loading hunt, session 49). A GGUF's shapes come from its header (its tensors are dequantized
    only when read)."""
    for name, shape in expected.items():
        if name in raw and (got := shape_of(raw, name)) != shape:
            own = raw.file_names.get(name) if isinstance(raw, LazyTensors) else None
            called = f"{name} (the file's {own})" if own else name
            raise CheckpointError(f"{what} tensor {called} has shape {list(got)}, expected {list(shape)}")


def check_silu(config: dict[str, Any], what: str) -> None:
    """config.json's `hidden_act` is SiLU (transformers' ACT2FN names it silu or swish): the families compute SiLU,
    and another activation had run as SiLU, silently."""
    act = config.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise CheckpointError(f"{what} config.json sets hidden_act {act!r}: only silu is supported")


def check_bias_flags(config: dict[str, Any], raw: RawTensors, flags: dict[str, str], what: str) -> None:
    """Each config flag that says whether a bias exists (`use_conv_bias`: "layers.0.mixer.conv1d.bias"), where the
    config sets it, agrees with the tensors: transformers builds the layer as the flag says and drops or randomly
    fills the tensor (using what the file held had computed another model)."""
    for flag, key in flags.items():
        if flag in config and bool(config[flag]) != (key in raw):
            held = "holds" if key in raw else "lacks"
            raise CheckpointError(f"{what} config.json sets {flag} {config[flag]!r} but the checkpoint {held} {key}")


def require(raw: RawTensors, keys: Sequence[str], what: str) -> None:
    missing = [k for k in keys if k not in raw]
    if missing:
        raise CheckpointError(f"{what} checkpoint lacks tensors {missing[:4]}")


PathLike = str | os.PathLike[str]
