"""Weight-only int8 matrices (`--dtype int8`): a quarter of fp32's bytes, multiplied by a native kernel.

Format: one int8 tensor [N, K + 4] per matrix, weights q[n, k] = round(W[n, k] / s_n) in -127..127 with
s_n = max|W[n]| / 127 (symmetric, per output channel; fp32, native byte order). With K even, rows come in blocks of
32: a block's 32 * (K + 4) bytes are K/2 pair rows of 64 bytes (q[r, k] and q[r, k + 1] at bytes 2r and 2r + 1 of
pair row k/2), then the 32 scales; the kernel then multiplies 16 rows per register and reads one stream. Rows after
the last whole block, and all rows when K is odd, are plain: K weights, then the scale. One tensor keeps everything
that moves weights (compute form, prepared layers, owned storage) unchanged; a tied embedding shares the head's.

Decode is bound by reading the weights, and torch's own weight-only CPU kernels (`_weight_int8pack_mm`) ran
5-13x slower than wkvm's fp32 oneDNN gemv on these shapes; so decode-sized batches (up to `KERNEL_ROWS` rows of
x) go to `int8_linear.cpp`, built on first use with the machine's C++ compiler into ~/.cache/wkvm/torch_extensions
(a name hashed from the source, torch's version and installation and the CPU flags; 10-25 s once).
It rounds x to int8 per group of 32 values (scale max|x| / 127, as llama.cpp's q8 activation blocks; shared with
the int4 kernel in x_groups.h) and multiplies exactly in integers (AVX512-VNNI's vpdpbusd, 64 products an
instruction; int16 vpmaddwd without VNNI; with AMX-INT8, from 32 rows of x, tdpbssd on tiles, 1.3-1.7x VNNI's
products there), one fused multiply-add per group after, so every ISA gives the same bits.
Rounding x moved the default model's mean KL from fp32 from 9.3e-5 (int16 x) to 1.4e-4 and made M=8-32 products
1.5-2.4x faster (docs/performance.md). The AVX2, VNNI and AMX paths take every size of x (prefill too): on an
AVX2-only AMD EPYC Zen 3 the AVX2 kernel ran 1.1-3.2x dequantize + oneDNN from 64 to 2,048 rows and 0.86-1.05x at
4,096 (session 52, once its batch block widened each group's weights for all rows; before, oneDNN won there; since
session 57 one loop runs every size, 1.00-1.30x that block from 6 to 4,096 rows, int8_blocks.h). Only
the AVX-512BW path without VNNI still dequantizes more rows to fp32 per call for oneDNN.
Without a compiler every call dequantizes in torch (correct, slow) after a one-line warning; importing never fails.

WKVM_INT8_KERNEL=amx|avx512_vnni|avx512|avx2|scalar|torch forces a path (tests run the AVX2 kernel on AVX-512 machines).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("wkvm.int8")

# rows of x up to which the AVX-512BW kernel (no VNNI) beats dequantize + oneDNN: 32, and 128 for a matrix of 8M+
# weights (a head), whose dequantized fp32 copy costs more to make than the kernel's extra arithmetic; the VNNI path
# ran at or above fp32 oneDNN at every size measured (up to 256 rows), and the AVX2 one above dequantize + oneDNN
# (session 52), so they take all sizes
KERNEL_ROWS, KERNEL_ROWS_LARGE, LARGE = 32, 128, 8 << 20
SOURCE = Path(__file__).with_name("int8_linear.cpp")
ISAS = ("scalar", "avx2", "avx512", "avx512_vnni", "amx")  # the kernels' isa argument is the index
ALL_SIZES = ("avx2", "avx512_vnni", "amx")  # the paths that take every size of x (int8's and int4's)
SCALE_BYTES = 4
BLOCK = 32
CFLAGS = ("-O3", "-ffp-contract=off")  # no FMA contraction: every ISA computes the same float expression


def quantize(w: torch.Tensor) -> torch.Tensor:
    """[N, K] float -> int8 [N, K + 4] in the format above."""
    w = w.detach().to(torch.float32)
    K, nb = w.shape[1], n_blocks(*w.shape)
    scale = (w.abs().amax(1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    out = torch.cat([q, _bytes(scale).view(-1, SCALE_BYTES)], 1)
    if nb:
        pairs = q[: nb * BLOCK].view(nb, BLOCK, K // 2, 2).transpose(1, 2).reshape(nb, BLOCK * K)
        out[: nb * BLOCK] = torch.cat([pairs, _bytes(scale[: nb * BLOCK]).view(nb, -1)], 1).view(-1, K + SCALE_BYTES)
    return out


def n_blocks(n: int, k: int) -> int:
    """How many 32-row blocks a quantized [n, k] matrix has (none when k is odd)."""
    return 0 if k % 2 else n // BLOCK


def in_features(w: torch.Tensor) -> int:
    return int(w.shape[1]) - SCALE_BYTES


def scales(w: torch.Tensor) -> torch.Tensor:
    """The per-row fp32 scales [N] of a quantized matrix."""
    _, scale_bytes, plain = _parts(w)
    return torch.cat([_floats(scale_bytes), _plain_scales(plain)])


def dequantize(w: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """int8 [N, K + 4] -> [N, K] in `dtype` (torch ops; the kernel's own `dequantize` is one parallel pass)."""
    pairs, scale_bytes, plain = _parts(w)
    K = in_features(w)
    top = pairs.transpose(1, 2).reshape(-1, K).to(torch.float32) * _floats(scale_bytes)[:, None]
    bottom = plain[:, :K].to(torch.float32) * _plain_scales(plain)[:, None]
    return torch.cat([top, bottom]).to(dtype)


def embedding(ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of a quantized embedding, dequantized to fp32 (only the rows looked up, and only their scales: all
    of a 65k-row embedding's cost ~0.25 ms a token). The native kernel's op where it runs (the same multiply, so the
    same bits: these torch ops took 50-66 us for a decode step's 1-8 rows of SmolLM2, ~3% of a one-stream step)."""
    if w.is_cpu and kernel_path() != "torch":
        out: torch.Tensor = torch.ops.wkvm_int8.embedding(ids.to(torch.long).contiguous(), w)
        return out
    pairs, scale_bytes, plain = _parts(w)
    K, edge = in_features(w), pairs.shape[0] * BLOCK
    flat = ids.reshape(-1)

    def rows_of_blocks(i: torch.Tensor) -> torch.Tensor:
        b, r = i // BLOCK, i % BLOCK
        return pairs[b, :, r, :].reshape(-1, K).to(torch.float32) * _floats(scale_bytes[b, r])[:, None]

    if flat.numel() and int(flat.max()) < edge:  # every row in a block (any vocabulary that is a multiple of 32)
        return rows_of_blocks(flat).view(*ids.shape, K)
    out = torch.empty(flat.numel(), K)
    blocked = flat < edge
    if blocked.any():
        out[blocked] = rows_of_blocks(flat[blocked])
    if not blocked.all():
        rows = plain[flat[~blocked] - edge]
        out[~blocked] = rows[:, :K].to(torch.float32) * _plain_scales(rows)[:, None]
    return out.view(*ids.shape, K)


def _parts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Blocks' weights [nb, K/2, 32, 2], blocks' scale bytes [nb, 32, 4] (`_floats` reads them), plain rows
    [N - 32 nb, K + 4] (views of w)."""
    K = in_features(w)
    nb = n_blocks(w.shape[0], K)
    blocks = w[: nb * BLOCK].reshape(nb, BLOCK * (K + SCALE_BYTES))
    pairs = blocks[:, : BLOCK * K].view(nb, K // 2, BLOCK, 2)
    return pairs, blocks[:, BLOCK * K :].view(nb, BLOCK, SCALE_BYTES), w[nb * BLOCK :]


def _plain_scales(rows: torch.Tensor) -> torch.Tensor:
    return _floats(rows[:, -SCALE_BYTES:])


def _floats(b: torch.Tensor) -> torch.Tensor:
    """int8 bytes (any view) -> the fp32 values they hold, in a fresh aligned tensor."""
    return torch.empty(b.numel(), dtype=torch.int8).copy_(b.reshape(-1)).view(torch.float32)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int8)


def linear(x: torch.Tensor, w: torch.Tensor, path: str | None = None) -> torch.Tensor:
    """x [..., K] fp32 @ dequantize(w)^T -> [..., N] fp32; `path` (an ISA name or "torch") overrides the choice."""
    path = (path or kernel_path()) if w.is_cpu else "torch"
    if path != "torch" and native_isa() is None:
        raise RuntimeError(f"int8 kernel path {path!r} asked for, but the kernel could not be built")
    if _kernel_takes(path, x.numel() // max(1, x.shape[-1]), w):
        op, isa = kernel_op("wkvm_int8", path)
        return run_kernel(op, x, w, isa)
    from wkvm.models.linear import linear as float_linear

    x2 = x.reshape(-1, in_features(w)).to(torch.float32)
    y = float_linear(x2, torch.ops.wkvm_int8.dequantize(w) if path != "torch" else dequantize(w))
    return y.view(*x.shape[:-1], w.shape[0])


def kernel_for(w: torch.Tensor, rows: int) -> tuple[str, int] | None:
    """(namespace, isa) of the native kernel `linear` runs for `rows` rows of x on `w`; None where it would not."""
    path = kernel_path() if w.is_cpu else "torch"
    if path == "torch" or native_isa() is None or not _kernel_takes(path, rows, w):
        return None
    return "wkvm_int8", ISAS.index(path)


def _kernel_takes(path: str, m: int, w: torch.Tensor) -> bool:
    if path == "torch":
        return False
    return path in ALL_SIZES or m <= KERNEL_ROWS or (m <= KERNEL_ROWS_LARGE and w.numel() >= LARGE)


@functools.cache
def kernel_op(namespace: str, path: str) -> tuple[Any, int]:
    """The `linear` op of kernel `namespace` (wkvm_int8, wkvm_int4) and its isa argument for ISA `path`. Kept:
    looking the op up costs ~0.7 us, and the decode wrappers run ~120 times a step."""
    return getattr(torch.ops, namespace).linear.default, ISAS.index(path)


def run_kernel(op: Any, x: torch.Tensor, w: torch.Tensor, isa: int) -> torch.Tensor:
    """A kernel's `linear` on x [..., K] as it comes (the kernel flattens the leading dimensions itself: a view in
    Python costs ~1.5 us a call)."""
    if x.dtype != torch.float32 or not x.is_contiguous():
        x = x.to(torch.float32).contiguous()
    y: torch.Tensor = op(x, w, isa)
    return y


@functools.cache
def kernel_path() -> str:
    """What int8 matmuls of decode size run on here: an ISA of the native kernel, or "torch" (dequantize per call)."""
    return choose_path("WKVM_INT8_KERNEL", native_isa)


@functools.cache
def native_isa() -> str | None:
    """The best ISA of the native kernel on this CPU, building it on first use; None when it cannot be built."""
    return built_isa("int8", build, "wkvm_int8", log)


def choose_path(env: str, native: Callable[[], str | None]) -> str:
    """The path `env` (auto, an ISA, or torch) asks for, given `native()`, the best ISA the kernel runs here."""
    forced = os.environ.get(env, "auto").lower()
    if forced not in ("auto", "torch", *ISAS):
        raise ValueError(f"{env}={forced!r}: use auto, {', '.join(ISAS)} or torch")
    best = native()
    if forced == "torch" or best is None:
        return "torch"
    if forced != "auto" and ISAS.index(forced) > ISAS.index(best):
        raise ValueError(f"{env}={forced}: this CPU runs at most {best}")
    return best if forced == "auto" else forced


def built_isa(kind: str, build: Callable[[], None], namespace: str, logger: logging.Logger) -> str | None:
    """`build()` the `kind` kernel and ask it for its best ISA here; None (and a warning) when it cannot be built."""
    try:
        build()
        return ISAS[int(getattr(torch.ops, namespace).best_isa())]
    except Exception as e:  # no compiler, failed build or load: the dtype still works, only slower
        logger.warning("%s kernel unavailable (%s); %s matmuls dequantize per call (slow)", kind,
                       str(e).splitlines()[0], kind)  # fmt: skip
        return None


def build() -> None:
    """Compile (once per source, torch and CPU) and load int8_linear.cpp as torch.ops.wkvm_int8."""
    load_kernel(SOURCE, "wkvm_int8", CFLAGS)


def load_kernel(source: Path, namespace: str, cflags: tuple[str, ...] = ("-O3",), op: str = "linear") -> None:
    """Compile `source` (once per its text and its quoted #includes', theirs too, the flags, torch's version and
    installation and the CPU) with the machine's C++ compiler into ~/.cache/wkvm/torch_extensions and load it; its
    ops (`op` one of them) register as torch.ops.<namespace>.

    Built with OpenMP: at::parallel_for runs serially in code compiled without it (ATen's ParallelOpenMP.h), and
    torch's own libgomp is the one loaded, so the kernels share torch's threads. A compiler without OpenMP builds it
    serial (one log line)."""
    from torch.utils import cpp_extension

    if hasattr(getattr(torch.ops, namespace), op):
        return
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "wkvm" / "torch_extensions")
    text = source.read_bytes()
    includes = quoted_includes(source)
    headers = b"".join((source.parent / h).read_bytes() for h in includes)
    for openmp in (("-fopenmp",), ()):
        flags = (*cflags, *openmp)
        # the torch installation too: its include and library paths are in the build's ninja file, so two
        # virtualenvs sharing one directory rebuilt it in turn
        key = hashlib.sha256(text + headers + torch.__version__.encode() + torch.__file__.encode()
                             + cpu_flags().encode() + " ".join(flags).encode())  # fmt: skip
        name = f"{namespace}_{key.hexdigest()[:16]}"
        build_dir = root / name
        build_dir.mkdir(parents=True, exist_ok=True)
        # said when it builds (seconds to a minute); a cached build's load at debug only: every `wkvm` command had
        # printed these lines, amid `wkvm doctor`'s report (CLI hunt, session 48)
        built = (build_dir / f"{name}.so").is_file()
        log.log(logging.DEBUG if built else logging.INFO, "%s: %s %s (built on first use, loaded from there after)",
                source.name, "loading from" if built else "building in", build_dir)  # fmt: skip
        try:
            with exclusive(build_dir):
                copy = stable_copy(source, includes, build_dir)
                cpp_extension.load(name=name, sources=[str(copy)], extra_cflags=list(flags),
                                   extra_ldflags=list(openmp), build_directory=str(build_dir), is_python_module=False,
                                   verbose=False)  # fmt: skip
            return
        except Exception as e:
            if not openmp:
                raise
            log.info("%s did not build with OpenMP (%s); building it single-threaded", source.name,
                     str(e).splitlines()[0])  # fmt: skip


@contextlib.contextmanager
def exclusive(build_dir: Path) -> Iterator[None]:
    """Hold `build_dir` for one process's build and load. torch's own guard there is a plain `lock` file
    (cpp_extension's FileBaton): a process killed mid-build (Ctrl-C on the first `make serve`) leaves it behind and
    every later load waits on it forever. An flock on a file of ours is released when its holder dies, so holding it
    no other process is building here and a `lock` file found now is stale: removed."""
    with open(build_dir / "wkvm-build.flock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        if (build_dir / "lock").exists():
            log.warning("removing %s, left by a build that did not finish", build_dir / "lock")
            (build_dir / "lock").unlink(missing_ok=True)
        yield


def quoted_includes(source: Path) -> list[str]:
    """The headers `source` includes with quotes, and the ones those include, each once (names relative to its
    folder, where they all live)."""
    found: list[str] = []
    todo = [source]
    while todo:
        for h in re.findall(rb'#include "([^"]+)"', todo.pop().read_bytes()):
            if (name := h.decode()) not in found:
                found.append(name)
                todo.append(source.parent / name)
    return found


def stable_copy(source: Path, includes: list[str], build_dir: Path) -> Path:
    """`source` and the headers it includes with quotes, copied under `build_dir` (where the name already pins their
    text) at the same relative places, so that every checkout compiles the same path: with each checkout's own
    path ninja rebuilt the kernel whenever another checkout had built it last. Files are written only when missing
    or different (a new mtime alone makes ninja rebuild)."""
    copy = build_dir / "src" / source.name
    for src, dst in [(source, copy)] + [(source.parent / h, copy.parent / h) for h in includes]:
        data = src.read_bytes()
        if not dst.exists() or dst.read_bytes() != data:
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(data)
    return copy


def cpu_flags() -> str:
    """This CPU's feature flags as /proc/cpuinfo lists them ("" where there is no such file)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""
