"""llama.cpp GGUF files of architecture `llama`, read into the HF names and an HF-style config dict.

Tensors are dequantized to fp32 at load with `gguf.quants.dequantize` (llama.cpp's own Python reference; tested
here for F32, F16, BF16, Q8_0, Q4_0, Q4_1 and the K-quants Q2_K-Q6_K). llama.cpp's converter (`convert_hf_to_gguf.py`,
`LlamaModel.permute`) reorders the rows of each head of `attn_q` and `attn_k` from HF's half-split RoPE layout
(pair j is rows j and j + D/2) to interleaved pairs (rows 2j, 2j + 1); `unpermute` undoes it, so the model runs
one RoPE for both formats. Quantization blocks run along rows, so the row order commutes with dequantizing.
"""

from __future__ import annotations

import functools
import math
import os
import struct
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, ReaderTensor
from gguf.quants import dequantize

from wkvm.models.family import CheckpointError, LazyTensors, RawTensors, first_line
from wkvm.models.llama.model import EMBED, FINAL_NORM, HEAD

ARCHITECTURE = "llama"
GLOBAL_NAMES = {"token_embd.weight": EMBED, "output_norm.weight": FINAL_NORM, "output.weight": HEAD}
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}  # fmt: skip
STRING = 8  # GGUFValueType.STRING


MAGIC = b"GGUF"


def is_gguf(path: Path) -> bool:
    """A file that starts as a GGUF file does (whatever its name: llama.cpp reads any)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


def architecture(path: Path) -> str | None:
    """`general.architecture`, read from the header without parsing the file (the writer puts it first)."""
    with open(path, "rb") as f:
        head = f.read(4096)
    if head[:4] != MAGIC:
        return None
    try:
        n_key = struct.unpack_from("<Q", head, 24)[0]
        key = head[32 : 32 + n_key]
        if key == b"general.architecture" and struct.unpack_from("<I", head, 32 + n_key)[0] == STRING:
            n_value = struct.unpack_from("<Q", head, 36 + n_key)[0]
            if 44 + n_key + n_value <= len(head):
                return head[44 + n_key : 44 + n_key + n_value].decode("utf-8", "replace")
    except struct.error:  # a header cut short: the reader below says what is wrong with the file
        pass
    return str(field(open_reader(path), "general.architecture"))


def of_architecture(path: Path, arch: str) -> str | None:
    """"gguf" for a GGUF file of architecture `arch` (a family's `detect`); None for anything else, a file whose
    header does not parse included (Llama's reader claims those and says what is wrong)."""
    if not (path.is_file() and is_gguf(path)):
        return None
    try:
        return "gguf" if architecture(path) == arch else None
    except (CheckpointError, OSError, ValueError):
        return None


def open_reader(path: str | os.PathLike[str]) -> GGUFReader:
    """A reader of the file (memory-mapped; `ArrayReader`). The last file opened is kept: loading a model and then its
    tokenizer and chat template parse it once. A file that does not parse (truncated, corrupt counts, another
    version) is a CheckpointError naming it."""
    p = Path(path).resolve()
    st = p.stat()
    try:
        return _reader(p, st.st_mtime_ns, st.st_size)
    except (ValueError, IndexError, KeyError, struct.error, OverflowError, MemoryError) as e:
        reason = first_line(str(e) or type(e).__name__, 200)
        raise CheckpointError(f"{path}: not a readable GGUF file (truncated or corrupt?): {reason}") from None


@functools.lru_cache(maxsize=1)
def _reader(path: Path, mtime_ns: int, size: int) -> GGUFReader:
    return ArrayReader(path, "r")


class ArrayReader(GGUFReader):
    """gguf's reader with its array fields read in one pass. GGUFReader makes numpy views for every element (two for
    each string): 8.0 s for Llama 3's 128k tokens and 280k merges, 2.1 s for SmolLM2's 49k and 48k (0.7 and 0.07 s
    here). A numeric array is one view and a string array's elements are slices of one memoryview of the file;
    `contents()` of the whole field (the only reading wkvm does) returns the same values from either, though not
    `contents(i)` of a numeric array. An array whose count cannot fit in the rest of the file is refused at once (gguf
    read a 60-byte file's count of 2^64 - 1 element by element). Arrays of arrays take gguf's code for the outer one."""

    def _get_field_parts(
        self, orig_offs: int, raw_type: int
    ) -> tuple[int, list[Any], list[int], list[GGUFValueType]]:
        if raw_type != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype, count = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        n, itype = int(count[0]), int(raw_itype[0])
        offs, end = orig_offs + 12, len(self.data)
        if n == 0:  # gguf reads no element type for an empty array
            return 12, [raw_itype, count], [], [GGUFValueType.ARRAY]
        types = [GGUFValueType.ARRAY, GGUFValueType(itype)]
        scalar = self.gguf_scalar_to_np.get(types[1])
        if scalar is not None:
            if n > (end - offs) // np.dtype(scalar).itemsize:
                raise ValueError(f"an array of {n} values runs past the end of the file at byte {offs}")
            values = self._get(offs, scalar, n)
            return 12 + int(values.nbytes), [raw_itype, count, values], [2], types
        if itype != GGUFValueType.STRING:  # arrays of arrays: gguf's own reading (each inner array comes back here)
            if n > (end - offs) // 12:
                raise ValueError(f"an array of {n} arrays runs past the end of the file at byte {offs}")
            return super()._get_field_parts(orig_offs, raw_type)
        if n > (end - offs) // 8:
            raise ValueError(f"an array of {n} strings runs past the end of the file at byte {offs}")
        swapped = self.byte_order == "S"
        order = ("big" if sys.byteorder == "little" else "little") if swapped else sys.byteorder
        data = self.data.data  # the file's bytes as a memoryview
        strings: list[Any] = []
        for _ in range(n):
            size = int.from_bytes(data[offs : offs + 8], order)
            if offs + 8 + size > end:
                raise ValueError(f"a string at byte {offs} runs past the end of the file")
            strings.append(data[offs + 8 : offs + 8 + size])
            offs += 8 + size
        return offs - orig_offs, [raw_itype, count, *strings], list(range(2, 2 + n)), types

    def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
        """gguf's, after llama.cpp's check (gguf.cpp): the tensors' data lie in their order, each at the offset the
        ones before it and the alignment give. An offset edited to another tensor's, off its alignment or wrapping
        past 2^64 had loaded other bytes as the weights, and `wkvm convert` had copied them (loading hunt, session
        49)."""
        expected, align = 0, int(self.alignment)  # a file's general.alignment reads as numpy's uint32: a Python int
        for f in fields:
            name = bytes(f.parts[1]).decode("utf-8", "replace")[:80]
            dims, kind, offset = f.parts[3], GGMLQuantizationType(int(f.parts[4][0])), int(f.parts[5][0])
            if offset != expected:
                raise ValueError(f"tensor {name!r} has offset {offset}, expected {expected} (the tensors' data in "
                                 f"order, each aligned to {align} bytes)")  # fmt: skip
            block, size = GGML_QUANT_SIZES[kind]
            expected = offset + math.prod(int(d) for d in dims) * size // block
            expected += -expected % align
        super()._build_tensors(start_offs, fields)


def metadata(reader: GGUFReader) -> dict[str, Any]:
    """Every key-value field but the tokenizer's long arrays (read those with `field`)."""
    long = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores")
    return {k: contents(reader, f) for k, f in reader.fields.items() if k not in long}


def field(reader: GGUFReader, key: str) -> Any:
    f = reader.get_field(key)
    return None if f is None else contents(reader, f)


def contents(reader: GGUFReader, f: Any) -> Any:
    """A field's values; text that is not UTF-8 is a CheckpointError naming the file and the key."""
    try:
        return f.contents()
    except UnicodeDecodeError:
        raise CheckpointError(f"{getattr(reader.data, 'filename', 'GGUF file')}: metadata {f.name} is not UTF-8 "
                              "text (corrupt file?)") from None  # fmt: skip


def unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's RoPE row order on a [n_head * D, in] q or k matrix."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def metadata_number(key: str, value: Any, kind: type = int, accept: tuple[type, ...] = (int, float),
                    what: str = "a number") -> Any:  # fmt: skip
    """A metadata value that must be a number, as `kind`; an array or text (or a type outside `accept`) is a
    CheckpointError naming the key (a head count or a token id stored as an array had been a TypeError traceback)."""
    if isinstance(value, bool) or not isinstance(value, accept):
        raise CheckpointError(f"GGUF metadata {key} is {str(value)[:80]!r}: expected {what}")
    return kind(value)


def meta_number(meta: dict[str, Any], key: str, default: Any = None, kind: type = int) -> Any:
    """Metadata `key` (else `default`) as a number of `kind`; absent without a default is a CheckpointError."""
    value = meta.get(key, default)
    if value is None:
        raise CheckpointError(f"GGUF metadata lacks {key!r}")
    return metadata_number(key, value, kind)


def hf_config(meta: dict[str, Any], vocab: int, tied: bool) -> dict[str, Any]:
    """The config.json an HF `LlamaForCausalLM` of these dimensions would have."""
    a = ARCHITECTURE + "."

    def number(key: str, default: Any = None, kind: type = int) -> Any:
        return meta_number(meta, key, default, kind)

    heads, width = number(a + "attention.head_count"), number(a + "embedding_length")
    if heads <= 0 or width <= 0:  # 0 heads had been a ZeroDivisionError traceback
        raise CheckpointError(f"GGUF metadata {a}attention.head_count ({heads}) and embedding_length ({width}) must "
                              "be positive")  # fmt: skip
    cfg: dict[str, Any] = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": width,
        "intermediate_size": number(a + "feed_forward_length"),
        "num_hidden_layers": number(a + "block_count"),
        "num_attention_heads": heads, "num_key_value_heads": number(a + "attention.head_count_kv", heads),
        "head_dim": number(a + "attention.key_length", width // heads),
        "rms_norm_eps": number(a + "attention.layer_norm_rms_epsilon", kind=float), "vocab_size": vocab,
        "max_position_embeddings": number(a + "context_length", 2048), "tie_word_embeddings": tied,
        "attention_bias": False, "mlp_bias": False,
    }  # fmt: skip
    if number(a + "attention.value_length", cfg["head_dim"]) != cfg["head_dim"]:
        raise CheckpointError("GGUF key and value head sizes differ: not a Llama wkvm runs")
    if number(a + "rope.dimension_count", cfg["head_dim"]) != cfg["head_dim"]:
        raise CheckpointError("GGUF rope.dimension_count != head size: partial rotary embeddings are not supported")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": number(a + "rope.freq_base", 10000.0, float)}
    # llama.cpp's: an absent type is linear (its factor, if any, applies); "none" never scales, whatever the factor
    scaling = meta.get(a + "rope.scaling.type", "linear")
    factor = meta.get(a + "rope.scaling.factor", meta.get(a + "rope.scale_linear"))
    if scaling == "linear" and factor not in (None, 0.0, 1.0):
        rope.update(rope_type="linear", factor=number(a + "rope.scaling.factor", factor, float))
        if not 0 < rope["factor"] < math.inf:  # a negative one scaled positions below zero
            raise CheckpointError(f"GGUF RoPE scaling factor {rope['factor']} must be a positive number")
    elif scaling not in ("linear", "none"):
        raise CheckpointError(f"GGUF RoPE scaling {str(scaling)[:80]!r} is not supported (none and linear are)")
    cfg["rope_parameters"] = rope
    for key in ("bos", "eos"):
        if f"tokenizer.ggml.{key}_token_id" in meta:
            cfg[f"{key}_token_id"] = number(f"tokenizer.ggml.{key}_token_id")
    return cfg


def hf_name(name: str) -> str:
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in LAYER_NAMES and parts[3] == "weight":
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.weight"
    raise CheckpointError(f"GGUF tensor {name!r} is not part of a dense Llama (MoE, biases and extras are not read)")


ROPE_FREQS = "rope_freqs.weight"
# Llama 3.1, 3.2 and 3.3's RoPE scaling, but for the factor (8 or 32): low and high frequency factors, original context
LLAMA3_SCALING = (1.0, 4.0, 8192)


def llama3_rope(factors: np.ndarray, rope: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """HF `rope_parameters` for a GGUF's `rope_freqs` tensor: llama.cpp's converter writes Llama 3's scaling as one
    divisor per frequency (RoPE turns pair i by position x base^(-2i/D) / factors[i]). They are recognized as llama3
    scaling with Llama 3.1's parameters (checked value by value), so the model runs transformers' own llama3 RoPE and
    `convert` writes a config transformers reads; any other factors are refused."""
    if factors.shape != (head_dim // 2,) or not np.all(np.isfinite(factors)) or factors.min() <= 0:
        raise CheckpointError(f"GGUF rope_freqs holds {factors.size} factors; RoPE needs {head_dim // 2} positive ones")
    if rope["rope_type"] != "default":
        raise CheckpointError(f"GGUF has both rope_freqs and {rope['rope_type']} RoPE scaling: not a Llama wkvm runs")
    theta = float(rope["rope_theta"])
    low, high, context = LLAMA3_SCALING
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)  # as the converter takes them
    wavelen = 2 * np.pi / freqs.astype(np.float64)
    smooth = (context / wavelen - low) / (high - low)
    slow, fast = wavelen > context / low, wavelen < context / high
    between = ~slow & ~fast
    if slow.any():  # the low frequencies are divided by the factor itself
        factor = float(factors[slow][0])
    elif between.any():  # none that low (a small head or base): the factor from a smoothed one, 1/f = (1-s)/F + s
        s, f = float(smooth[between][0]), float(factors[between][0])
        factor = (1 - s) / (1 / f - s) if 1 / f != s else 1.0
        factor = float(round(factor)) if abs(factor - round(factor)) < 1e-4 * factor else factor  # 8, not 8.000014
    else:  # every frequency is high: no factor changes anything
        factor = 1.0
    medium = 1 / ((1 - smooth) / factor + smooth)
    want = np.where(fast, 1.0, np.where(slow, factor, medium))
    if not (np.isfinite(factor) and factor > 0 and np.allclose(factors, want, rtol=1e-5, atol=0)):
        raise CheckpointError("GGUF rope_freqs are not Llama 3's RoPE scaling (low_freq_factor 1, high_freq_factor 4, "
                              "original context 8192): per-frequency factors of another kind are not supported")
    return {**rope, "rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
            "original_max_position_embeddings": context}  # fmt: skip


def hf_tensors(reader: GGUFReader) -> dict[str, ReaderTensor]:
    """The file's tensors under their HF names (`rope_freqs` under its own), in the file's order."""
    return {ROPE_FREQS if t.name == ROPE_FREQS else hf_name(t.name): t for t in reader.tensors}


# `--dtype auto` for a GGUF file: the wkvm weight kind that keeps its layer matrices' precision, as llama.cpp runs a
# file at its own quantization. Q4_0 / Q4_1 groups are int4's own structure (their values are kept exactly);
# float types stay float32 (exact against transformers); every other quantized type (Q8_0, Q5, K-quants, IQ) is
# re-rounded per channel to int8, the nearest of wkvm's kinds that is not coarser than the file.
INT4_TYPES = frozenset({GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1})
FLOAT_TYPES = frozenset({GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16})
MATRICES = tuple(k for k in LAYER_NAMES if not k.endswith("_norm"))


def layer_matrix(name: str, matrices: tuple[str, ...] = MATRICES) -> bool:
    """Whether a GGUF tensor name is a layer's matrix (`blk.3.attn_q.weight`: one of `matrices`, the architecture's
    layer matrices), not a norm or a global."""
    parts = name.split(".")
    return len(parts) >= 4 and parts[0] == "blk" and parts[-1] == "weight" and ".".join(parts[2:-1]) in matrices


def native_dtype(path: Path, matrices: tuple[str, ...] = MATRICES) -> str:
    """float32, int8 or int4: what `--dtype auto` stores this file's weights as (see INT4_TYPES)."""
    kinds = {t.tensor_type for t in open_reader(path).tensors if layer_matrix(t.name, matrices)}
    if kinds and kinds <= FLOAT_TYPES:
        return "float32"
    if kinds and kinds <= INT4_TYPES:
        return "int4"
    return "int8" if kinds else "float32"


def read_gguf(path: Path) -> tuple[RawTensors, dict[str, Any]]:
    """Raw tensors under HF names and an HF-style config dict. The tensors are made when read (`LazyTensors`): each
    dequantized to fp32 (q and k put back in HF's row order) then and not kept, so building a model holds one fp32
    tensor at a time, not the whole model."""
    reader, meta = open_architecture(path, ARCHITECTURE)
    tensors = hf_tensors(reader)
    factors = tensors.pop(ROPE_FREQS, None)
    vocab = vocab_size(path, reader, tensors.get(EMBED))
    try:
        config = hf_config(meta, vocab, tied=HEAD not in tensors)
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None
    if factors is not None:
        try:
            rope_freqs = np.array(dequantize(factors.data, factors.tensor_type), dtype=np.float64).reshape(-1)
            config["rope_parameters"] = llama3_rope(rope_freqs, config["rope_parameters"], config["head_dim"])
        except (CheckpointError, NotImplementedError, ValueError) as e:
            raise CheckpointError(f"{path}: {e}") from None
    check_block_count(path, reader, ARCHITECTURE, config["num_hidden_layers"])
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}

    def maker(name: str, t: ReaderTensor) -> Callable[[], torch.Tensor]:
        proj = name.split(".")[-2] if name.startswith("model.layers.") else ""
        return lambda: read_tensor(path, t, heads.get(proj))

    shapes = {name: tuple(int(d) for d in reversed(t.shape)) for name, t in tensors.items()}  # HF's [out, in] order
    own = {name: t.name for name, t in tensors.items()}  # errors name both: users know the file's names
    return LazyTensors({name: maker(name, t) for name, t in tensors.items()}, shapes, own), config


def vocab_size(path: Path, reader: GGUFReader, embed: ReaderTensor | None) -> int:
    """The vocabulary's size: its token list's, which must be the embedding's rows (llama.cpp refuses it too:
    token_embd.weight has the wrong shape; it had loaded, then refused every prompt with a control token past the
    rows, or decoded ids past the vocabulary as ""), else the embedding's rows."""
    tokens = field(reader, "tokenizer.ggml.tokens")
    rows = int(embed.shape[-1]) if embed is not None else None
    if isinstance(tokens, list) and tokens and rows is not None and len(tokens) != rows:
        raise CheckpointError(f"{path}: the vocabulary has {len(tokens)} tokens but token_embd.weight {rows} rows")
    return len(tokens) if isinstance(tokens, list) and tokens else rows or 0


def check_block_count(path: Path, reader: GGUFReader, arch: str, declared: int) -> None:
    """`{arch}.block_count` is the number of layers the tensors hold (llama.cpp refuses a missing tensor, or too
    many, too)."""
    layers = 1 + max((int(t.name.split(".")[1]) for t in reader.tensors if t.name.startswith("blk.")), default=-1)
    if layers != declared:
        raise CheckpointError(f"{path}: {arch}.block_count is {declared} but the file holds tensors of {layers} layers")


DEQUANTIZE_BYTES = 1 << 18  # a quantized tensor's bytes per call of gguf's dequantize


def dequantize_rows(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """gguf's `dequantize` over a quantized tensor's rows laid end to end as one row, 256 KB of them a call: it works
    16 rows a call, and a small model's row is a few blocks (SmolLM2's 576 values: 18 Q4_1 blocks), so per-call costs
    dominated. One pass over SmolLM2's matrices: 0.76-1.02 s -> 0.33-0.40 s (64 KB 0.37-0.38, 1 MB 0.42-0.62: its
    temporaries leave the cache). Blocks are independent and a row holds whole blocks: the same values, flat. F32 and
    F16 (a view, a cast) and 1-d tensors go to it as they are."""
    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16) or data.ndim < 2 or data.size == 0:
        return dequantize(data, qtype)
    rows = data.reshape(-1, data.shape[-1])
    step = max(1, DEQUANTIZE_BYTES // rows.shape[1])
    first = dequantize(rows[:step].reshape(1, -1), qtype).reshape(-1)
    width = len(first) // len(rows[:step])  # values a row
    out = np.empty(len(rows) * width, np.float32)  # filled in place: one tensor's fp32 at a time, not two
    out[: len(first)] = first
    for i in range(step, len(rows), step):
        out[i * width : (i + step) * width] = dequantize(rows[i : i + step].reshape(1, -1), qtype).reshape(-1)
    return out


def read_tensor(path: Path, t: ReaderTensor, unpermute_heads: int | None) -> torch.Tensor:
    """Tensor `t` dequantized to fp32 (any type the gguf package reads), in HF's row order for q and k."""
    try:
        arr = dequantize_rows(t.data, t.tensor_type)  # new values, or (F32) a read-only view of the file: copied then
        out = torch.from_numpy(arr if arr.flags.writeable else np.array(arr, copy=True))
        out = out.reshape([int(d) for d in reversed(t.shape)])
    except NotImplementedError:
        raise CheckpointError(f"{path}: tensor {t.name} has GGML type {t.tensor_type.name}, which the gguf "
                              "package cannot dequantize") from None  # fmt: skip
    except (ValueError, RuntimeError) as e:  # its data cut short: numpy cannot shape what is there
        raise CheckpointError(f"{path}: tensor {t.name} does not read (the file is truncated or corrupt: "
                              f"{first_line(str(e), 120)})") from None  # fmt: skip
    return unpermute(out, unpermute_heads) if unpermute_heads else out


# --- the layout llama.cpp's converters write, undone (the hybrid families' readers) ----------------------------
def layer_part(name: str) -> tuple[int, str] | None:
    """(layer, the name after `blk.{layer}.`) of a layer tensor; None for a global."""
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
        return int(parts[1]), parts[2]
    return None


def per_layer(meta: dict[str, Any], key: str, layers: int, default: int = 0) -> list[int]:
    """A per-layer count (`attention.head_count_kv`, `feed_forward_length`): a list, or one number for every layer
    (`default` where the file has none)."""
    value = meta.get(key, default)
    values = value if isinstance(value, list) else [value] * layers
    if len(values) != layers:
        raise CheckpointError(f"GGUF metadata {key} has {len(values)} entries for {layers} layers")
    return [metadata_number(key, n) for n in values]


def open_architecture(path: Path, arch: str) -> tuple[GGUFReader, dict[str, Any]]:
    """The file's reader and metadata, refusing another architecture's file."""
    reader = open_reader(path)
    meta = metadata(reader)
    if meta.get("general.architecture") != arch:
        raise CheckpointError(f"{path}: GGUF architecture {meta.get('general.architecture')!r} is not {arch}")
    return reader, meta


def hf_shape(name: str, ts: list[ReaderTensor]) -> tuple[int, ...]:
    """The HF shape of the tensor the file's `ts` make (two: gate and up rows joined): a depthwise conv's middle axis
    back; Mamba2's A, D and gated norm weight flat (llama.cpp's converters reshape these)."""
    dims = [tuple(int(d) for d in reversed(t.shape)) for t in ts]  # HF's [out, in] order
    if len(dims) == 2:
        return (dims[0][0] + dims[1][0], *dims[0][1:])
    (s,) = dims
    if name.endswith(("conv1d.weight", "conv.conv.weight")):  # a depthwise conv's [C, K] (Mamba2, LFM2)
        return (s[0], 1, s[-1])
    if len(s) == 2 and name.endswith(("mamba.norm.weight", "mixer.norm.weight")):  # [groups, d_inner / groups]
        return (s[0] * s[1],)
    if len(s) == 2 and name.endswith(("A_log", ".D")):  # [H, 1]
        return (s[0],)
    return s


def lazy_tensors(path: Path, parts: dict[str, list[ReaderTensor]], heads: dict[str, int]) -> LazyTensors:
    """HF name -> a maker of its tensor from the file's `parts` (dequantized to fp32, in HF's shape, q and k rows put
    back for `heads` {"q_proj": query heads, "k_proj": key-value heads}, A as log(-A)), made when read."""

    def maker(name: str, ts: list[ReaderTensor], want: tuple[int, ...]) -> Callable[[], torch.Tensor]:
        def make() -> torch.Tensor:
            parts = [read_tensor(path, t, None) for t in ts]  # one tensor but for a joined gate and up
            out = (parts[0] if len(parts) == 1 else torch.cat(parts)).reshape(want)
            proj = name.split(".")[-2]
            if proj in heads:
                out = unpermute(out, heads[proj])
            return torch.log(-out) if name.endswith("A_log") else out

        return make

    shapes = {name: hf_shape(name, ts) for name, ts in parts.items()}
    own = {name: "+".join(t.name for t in ts) for name, ts in parts.items()}  # errors name the file's names too
    return LazyTensors({n: maker(n, ts, shapes[n]) for n, ts in parts.items()}, shapes, own)
