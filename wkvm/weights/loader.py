"""Open a model by path: find its family (registry) and format (checkpoint or weight pack), build it."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from wkvm.chat_template import ChatTemplate, load_chat_template
from wkvm.models import int4, linear, registry
from wkvm.models.family import (
    Checkpoint,
    CheckpointError,
    LanguageModel,
    LazyTensors,
    ModelFamily,
    RawTensors,
    finite_tensors,
    first_line,
)
from wkvm.models.fingerprint import fingerprint
from wkvm.models.provider import ResidentWeights, Tensors
from wkvm.progress import progress
from wkvm.tokenizer import Tokenizer, load_tokenizer, read_json
from wkvm.weights.arena import gather_small

log = logging.getLogger(__name__)

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
FILE_SUFFIXES = (".gguf", ".pth", ".pt", ".bin", ".safetensors", ".json")  # a path with one names a file, not a repo
PACK_MANIFEST = "manifest.json"  # a weight pack (wkvm.weights.pack) is a directory with this file


def is_pack(path: str | os.PathLike[str]) -> bool:
    return (Path(path) / PACK_MANIFEST).is_file()


def check_model_path(path: str | os.PathLike[str], weight_cache_layers: int = 0) -> None:
    """Fail early with one line a user can act on: a missing path, a hub id (wkvm never downloads), a file or
    directory that is no model wkvm reads, or streaming asked of what is no weight pack (before `wkvm serve` binds
    its port; it had failed after). Raises CheckpointError (a ValueError)."""
    p = Path(path)
    if not p.exists() and not Path(f"{p}.pth").is_file():
        if HUB_ID.fullmatch(str(path)) and not str(path).lower().endswith(FILE_SUFFIXES):
            raise CheckpointError(f"model {str(path)!r} does not exist here; it looks like a Hugging Face hub id, and "
                                  "wkvm never downloads: download the checkpoint first and pass its local path")
        if str(path) == "smollm2":  # `WKVM_MODEL=smollm2 make serve`'s alias, given to wkvm itself (CLI hunt, 48)
            raise CheckpointError("model path 'smollm2' does not exist: 'smollm2' is a `make serve` alias; give wkvm "
                                  "the file, models/SmolLM2-135M-Instruct.Q4_1.gguf (`make smollm2` fetches it)")
        raise CheckpointError(f"model path {str(path)!r} does not exist")
    if weight_cache_layers > 0 and not is_pack(p):  # (`foo` for foo.pth too)
        raise CheckpointError(f"{path}: --weight-cache-layers needs a weight pack (make one with `wkvm convert SRC DST "
                              "--pack`)")  # fmt: skip
    if not is_pack(p):
        registry.detect(p)


def auto_dtype(path: str | os.PathLike[str], device: str = "cpu") -> str:
    """What `--dtype auto` (an option of `wkvm serve`, `wkvm chat` and `LLM`, whose default stays float32: exact, and
    SmolLM2's int4 answers the capital of France "L'Étoile", fp32 "Paris") stores `path`'s model as: on the CPU, its
    family's `native_dtype` (a GGUF with Q4_0 / Q4_1 layer matrices: int4, their values kept; with other quantized
    types: int8; float files: float32), as llama.cpp runs a GGUF at its own quantization; float32 for every other
    checkpoint, for a weight pack (it holds float32 layers) and on a GPU (wkvm's int8 and int4 kernels are CPU code).
    Raises CheckpointError where load_model would (a missing path, no model wkvm reads)."""
    check_model_path(path)
    if torch.device(device).type != "cpu" or is_pack(path):
        return "float32"
    family, fmt = registry.detect(path)
    return family.native_dtype(Path(path), fmt)


def resolved_dtype(dtype: str | torch.dtype, path: str | os.PathLike[str], device: str = "cpu") -> str:
    """`dtype`'s canonical name (`config.dtype_name`: any case, or a torch dtype) with auto resolved for the model at
    `path` (`auto_dtype`)."""
    from wkvm.config import AUTO_DTYPE, dtype_name

    name = dtype_name(dtype)
    return auto_dtype(path, device) if name == AUTO_DTYPE else name


def read_checkpoint(path: str | os.PathLike[str]) -> tuple[ModelFamily, Checkpoint]:
    family, fmt = registry.detect(path)
    with named(path), config_errors(path, family, "config or tensors"), \
            unreadable(path, f"a {family.name} checkpoint ({fmt})"):
        ckpt = family.read_checkpoint(Path(path), fmt)
    refuse_quantized(path, family, ckpt)
    return family, ckpt


FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def refuse_quantized(path: str | os.PathLike[str], family: ModelFamily, ckpt: Checkpoint) -> None:
    """A checkpoint quantized for another engine (a config.json `quantization_config`: FP8, int8 w8a8, GPTQ, AWQ;
    integer or float8 weight tensors) is refused: its values had been cast to floats without their scales, a model
    that loaded and answered nonsense. wkvm quantizes at load itself (--dtype int8 / int4), or reads GGUF."""
    config = Path(path) / "config.json"
    if config.is_file():
        try:
            quant = read_json(config).get("quantization_config")
        except (ValueError, OSError):
            quant = None  # the family's own reading says what is wrong with it
        if quant:
            method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
            raise CheckpointError(f"{path}: a quantized checkpoint ({method!s:.40}) is not read: give its "
                                  "unquantized weights (wkvm quantizes them itself: --dtype int8 or int4) or a GGUF "
                                  "file")  # fmt: skip
    if isinstance(ckpt.raw, LazyTensors):  # made when read (a GGUF's, dequantized to floats): nothing to check
        return
    for name, t in family.used_tensors(ckpt.raw).items():
        if t.dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"{path}: tensor {name} is {str(t.dtype).removeprefix('torch.')}, not floating point "
                                  "(a quantized checkpoint is not read: give unquantized weights, or a GGUF file)")


def checkpoint_config(path: str | os.PathLike[str], family: ModelFamily, ckpt: Checkpoint) -> Any:
    """The family's config of a checkpoint; a config field of the wrong type or value (null heads, a zero head count,
    "six") is a CheckpointError naming the file instead of a TypeError or ZeroDivisionError traceback."""
    with named(path), config_errors(path, family):
        return family.config_from_checkpoint(ckpt)


@contextlib.contextmanager
def config_errors(path: str | os.PathLike[str], family: ModelFamily, what: str = "config") -> Iterator[None]:
    """A config value of the wrong type or value that a family's reading trips over (a TypeError, ValueError,
    ZeroDivisionError, AttributeError or KeyError: `"num_hidden_layers": [2]`, `"linear_num_key_heads": 0`) is one
    CheckpointError naming the model; a CheckpointError stays as it is. Around `read_checkpoint` too, where the
    families read config.json (a traceback or an unnamed line there before; loading hunt, session 49)."""
    try:
        yield
    except CheckpointError:
        raise
    except (TypeError, ValueError, ZeroDivisionError, AttributeError, KeyError) as e:
        raise CheckpointError(f"{path}: its {what} do{'es' if what == 'config' else ''} not read as a {family.name} "
                              f"model's ({type(e).__name__}: {first_line(str(e), 200)})") from None  # fmt: skip


@contextlib.contextmanager
def named(path: str | os.PathLike[str]) -> Iterator[None]:
    """A CheckpointError that names no file ("head_dim 1 is odd: RoPE rotates pairs", raised where a family checks
    its config) gets the model's path in front: one place instead of every raise (loading hunt, session 49)."""
    try:
        yield
    except CheckpointError as e:
        if str(e).startswith((str(path), str(Path(path)))):  # (a relative path's name is in most messages)
            raise
        raise type(e)(f"{path}: {e}") from None  # a PackError stays one


@contextlib.contextmanager
def unreadable(path: str | os.PathLike[str], what: str) -> Iterator[None]:
    """A file that looks like `what` but whose bytes do not read as it (garbage named .pth, a cut safetensors file,
    a zip that is no torch archive) raises a CheckpointError naming it: one line a user can act on, not torch's or
    safetensors' traceback."""
    import pickle
    import zipfile

    from safetensors import SafetensorError

    try:
        yield
    except (RuntimeError, SafetensorError, pickle.UnpicklingError, EOFError, zipfile.BadZipFile) as e:
        reason = first_line(str(e) or type(e).__name__, 200)
        if str(e).startswith("Weights only load failed"):  # torch's first paragraph advises the unsafe load: not
            # that; the reason is a later one ("WeightsUnpickler error: ..." or "Trying to load unsupported GLOBAL
            # posix.system ...", by torch version), before its pointer to the documentation
            paragraphs = [t.strip() for t in re.split(r"\n\s*\n", str(e))[1:] if t.strip()]
            found = [t for t in paragraphs if not t.startswith(("Check the documentation", "Please file an issue"))]
            unpickler = found[0].split("\n", 1)[0].removeprefix("WeightsUnpickler error:").strip() if found else ""
            reason = f"not a file of tensors alone ({unpickler or 'its pickle holds more'}; wkvm never unpickles code)"
        raise CheckpointError(f"{path} does not read as {what}: {reason}") from None


def checkpoint_fingerprint(family: ModelFamily, cfg: Any, raw: RawTensors) -> str:
    return fingerprint(family.name, asdict(cfg), family.used_tensors(raw))


def build_resident(
    family: ModelFamily, cfg: Any, raw: RawTensors, fp: str, device: torch.device | str, dtype: torch.dtype,
    where: str | os.PathLike[str] | None,
) -> LanguageModel:  # fmt: skip
    """Every layer prepared (matrices prepacked) and held in memory; with `where` (the file), a tensor holding NaN or
    infinities is a CheckpointError naming it (a pack's are checked as `Pack.read` reads them: None)."""
    checked = raw if where is None else finite_tensors(raw, where)
    layers = [family.prepare_layer(checked, i, cfg, dtype, device)
              for i in progress(range(cfg.n_layer), "loading layers")]  # fmt: skip
    global_tensors = family.prepare_globals(checked, cfg, dtype, device)
    own_memory(raw, [*layers, global_tensors])
    gather_small([*layers, global_tensors])
    return family.build(cfg, ResidentWeights(layers, global_tensors), fp, device)


@contextlib.contextmanager
def misfit(path: str | os.PathLike[str], family: str) -> Iterator[None]:
    """Tensors that read but do not fit the config (a matrix a few columns short, a wrong head count) fail inside
    torch while the layers are prepared or on the first forward pass: one CheckpointError naming the file instead of a
    traceback at load, or a server that loaded and then answered 500 to every request (hunt 14)."""
    try:
        with named(path):
            yield
    except torch.OutOfMemoryError:
        raise  # the machine's, not the file's
    except (RuntimeError, IndexError) as e:  # torch's shape errors; a ValueError already says what is wrong itself
        raise CheckpointError(f"{path}: its tensors do not fit its config as a {family} model "
                              f"({first_line(str(e) or type(e).__name__)})") from None  # fmt: skip
    except TypeError as e:  # a pack manifest's config field of the wrong type (ln_eps "x"): it had been a traceback
        raise CheckpointError(f"{path}: its config does not read as a {family} model's (TypeError: "
                              f"{first_line(str(e), 200)})") from None  # fmt: skip


def first_forward(model: LanguageModel, path: str | os.PathLike[str]) -> None:
    """Two tokens prefilled and one decoded from a new state, as the engine will: shapes that do not fit fail here,
    at load, and weights holding NaN or infinities (logits that are not finite) are refused instead of answering every
    request with an error (or `wkvm generate` with nothing)."""
    logits, state = model.prefill([0, 0])
    step = model.decode([0], state)
    if logits.shape[-1] != model.vocab_size:  # a head of other rows than the embedding: every family's check
        raise CheckpointError(f"{path}: its output head gives {logits.shape[-1]} logits for a vocabulary of "
                              f"{model.vocab_size} tokens (the head and the embedding do not match)")  # fmt: skip
    if not (bool(torch.isfinite(logits).all()) and bool(torch.isfinite(step).all())):
        raise CheckpointError(f"{path}: its weights give logits that are not finite: the checkpoint holds NaN or "
                              "infinite values")  # fmt: skip


def own_memory(raw: RawTensors, parts: list[Tensors]) -> None:
    """Copy every tensor of `parts` that still shares memory with a checkpoint tensor (kept as it was: fp32 norms,
    LoRAs, an fp32 embedding): a memory-mapped checkpoint then unmaps once loading ends, instead of staying mapped
    whole (a 0.1B RWKV-7 .pth: 840 MB of its pages counted in the server's resident memory). One copy per tensor,
    so tensors that are one (a tied embedding and head) stay one."""
    if isinstance(raw, LazyTensors):  # each read makes a new tensor: nothing can share a checkpoint's memory
        return
    shared = {t.untyped_storage().data_ptr() for t in raw.values() if strided_on_cpu(t)}
    copies: dict[int, torch.Tensor] = {}
    for part in parts:
        for name, t in part.items():
            if strided_on_cpu(t) and t.untyped_storage().data_ptr() in shared:
                part[name] = copies.setdefault(id(t), t.clone())


def strided_on_cpu(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_mkldnn and t.device.type == "cpu"


def release_free_memory() -> None:
    """Hand the C allocator's free memory back to the OS (glibc `malloc_trim`): loading frees the dequantized and
    converted temporaries, which glibc keeps for reuse (SmolLM2 int8: 918 -> 454 MB anonymous memory after load).
    Elsewhere (musl, macOS) nothing happens."""
    with contextlib.suppress(AttributeError, OSError):
        ctypes.CDLL(None).malloc_trim(0)


def load_model(
    path: str | os.PathLike[str], device: str = "cpu", dtype: torch.dtype | str = torch.float32,
    weight_cache_layers: int = 0, read_ahead: bool = True,
) -> LanguageModel:  # fmt: skip
    """A pack with weight_cache_layers > 0 streams its layers from disk; everything else is loaded resident.
    `dtype` stores the large matrices, embedding and head in float32, bfloat16, int8 or int4 (auto: `auto_dtype`);
    arithmetic is fp32 (int8 and int4 decode round x to int8 per group of 32 inside their kernels)."""
    from wkvm.config import weight_dtype

    check_model_path(path)
    if isinstance(dtype, str):  # auto: the checkpoint's own precision, as the commands take it
        dtype = resolved_dtype(dtype, path, device)
    # it had loaded resident for < 0, as 0 does; 1.5 and "2" failed deep in the cache
    if isinstance(weight_cache_layers, bool) or not isinstance(weight_cache_layers, int) or weight_cache_layers < 0:
        raise ValueError(f"weight_cache_layers must be an integer >= 0 (0: resident), not {weight_cache_layers!r}")
    dtype = dtype if isinstance(dtype, torch.dtype) else weight_dtype(dtype)
    if dtype == torch.bfloat16 and torch.device(device).type == "cpu" and not linear.bf16_native():
        log.warning("--dtype bfloat16: %s", linear.bf16_speed())
    if dtype == torch.int8 and torch.device(device).type == "cpu":
        log.info("--dtype int8: %s", linear.int8_speed())  # builds the kernel on first use (warns if it cannot)
    if dtype == int4.DTYPE and torch.device(device).type == "cpu":
        log.info("--dtype int4: %s", linear.int4_speed())

    if is_pack(path):
        from wkvm.weights.pack import Pack

        pack = Pack(path)
        if weight_cache_layers > 0:
            from wkvm.weights.stream import StreamingWeights

            with misfit(path, pack.family.name):  # a manifest's config that its tensors do not fit: as resident
                weights = StreamingWeights(pack, weight_cache_layers, read_ahead, device, dtype)
                model = pack.family.build(pack.config, weights, pack.fingerprint, device)
                loaded = replace(weights.stats)
                first_forward(model, path)
            weights.stats = loaded  # the counters count the load's reads and then what requests read
            return model
        raw = pack.read(None)
        for i in range(pack.config.n_layer):
            raw.update(pack.read(i))
        with misfit(path, pack.family.name):
            model = build_resident(pack.family, pack.config, raw, pack.fingerprint, device, dtype, None)
            first_forward(model, path)
        del raw
        release_free_memory()
        return model
    if weight_cache_layers > 0:
        raise ValueError(
            f"{path}: --weight-cache-layers needs a weight pack (make one with `wkvm convert SRC DST --pack`)"
        )
    family, ckpt = read_checkpoint(path)
    cfg = checkpoint_config(path, family, ckpt)
    with misfit(path, family.name):
        fp = checkpoint_fingerprint(family, cfg, ckpt.raw)
        model = build_resident(family, cfg, ckpt.raw, fp, device, dtype, path)
        first_forward(model, path)
    del ckpt  # the checkpoint's tensors (dequantized, converted, or a file mapping) go before the trim
    release_free_memory()
    return model


def load_text_tools(path: str | os.PathLike[str], family: str) -> tuple[Tokenizer, ChatTemplate]:
    """The tokenizer and chat template for the model at `path`: its own files, else its family's defaults."""
    f = registry.family(family)
    tokenizer = load_tokenizer(path, lambda: f.default_tokenizer(Path(path)))
    template = load_chat_template(path, f.default_chat_template(Path(path)))
    specials = {"bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token}
    # a copy: a family's default template is one object for every model of it
    return tokenizer, replace(template, special_tokens={k: v for k, v in specials.items() if v is not None})
