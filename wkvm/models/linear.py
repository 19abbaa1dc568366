"""Linear layers on prepacked weights: oneDNN on CPU when available, plain `F.linear` elsewhere.

On the CPUs we measured, oneDNN's packed fp32 matmul runs 1.4x (gemv) to 2.4x (prefill) faster than the default
BLAS path, still in IEEE fp32. Set WKVM_ONEDNN=0 to use `F.linear` everywhere. Decode-sized fp32 matmuls (up to
`fp32gemv.rows()` rows of x) run on wkvm's own kernel over the same packed bytes (wkvm/models/fp32gemv.py: 1.3-1.6x
oneDNN's M=1 gemv, read-bound; `WKVM_FUSED=off` leaves every size on oneDNN).

bf16 weights pay off only where the CPU multiplies bf16 natively (AVX512-BF16 or AMX). Elsewhere the bf16 matmul
is emulated: single-stream decode still gains from reading half the bytes, but prefill and batched decode run
slower than fp32 (`bench/bf16_speed.py`: the figures below, runs in docs/performance.md).

int8 weights (`--dtype int8`, weight-only with per-channel scales) are int8 tensors [out, in + 4] that `linear`
hands to wkvm/models/int8.py: a native kernel for decode-sized batches, dequantize + oneDNN for prefill. int4
weights (`--dtype int4`, groups of 32 with an fp16 step and offset) are uint8 tensors [out, in / 32 * 20] that go to
wkvm/models/int4.py the same way; the config names them torch.int4, storage is uint8 (torch.int4 holds no data).
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from wkvm.models import fp32gemv, fused, int4, int8

PACK_BATCH_HINT = 64
# rows of x from which a bf16 weight oneDNN cannot pack (no bf16 kernel on this CPU: AVX2) is widened to fp32 for the
# call and multiplied by oneDNN's fp32 GEMM: ATen's own bf16 GEMM was 2-5x slower from 32 rows on AVX2 code paths
# (AMD EPYC, 2 threads: 1,024 x 768 x 768 38 ms vs 7.5 ms), faster below (it reads half the bytes)
BF16_WIDEN_ROWS = 32
# bf16 over fp32 tok/s, bench/bf16_speed.py on AMD EPYC (2 threads): natively, and with oneDNN limited to
# AVX512_CORE (bf16 emulated) via ONEDNN_MAX_CPU_ISA
# (RWKV-7 0.1B; SmolLM2-135M decodes level with float32: paired in one process, session 34)
BF16_NATIVE_SPEED = "1.3-1.5x float32's tok/s in prefill and decode for RWKV-7; level with it for SmolLM2"
BF16_EMULATED_SPEED = "0.2-0.5x float32's tok/s in prefill, 0.3-1.0x in batch-8 decode, 1.3-2.5x single-stream"
# without any oneDNN bf16 kernel (AVX2 code paths on that CPU, `bench/rwkv7_llamacpp.py --avx2`, RWKV-7 0.1B shape)
BF16_NO_KERNEL_SPEED = "0.9x float32's tok/s in prefill (widened to fp32), 0.6-0.7x at 8-32 sequences, 1.5x one stream"
# int8 over fp32 tok/s, `bench/int8_speed.py --e2e` (SmolLM2-135M, RWKV-7 0.1B) on AMD EPYC, AVX512-VNNI kernel
INT8_SPEED = "2.4-4.0x float32's tok/s in single-stream decode, 1.9-2.4x at batch 8, 0.9-1.4x in prefill"
# int4 over fp32 tok/s, same command and machine (1 thread, 1,024-token prefill; two runs, load 0.8 and 3.0)
INT4_SPEED = "3.7-4.6x float32's tok/s in single-stream decode, 1.8-2.3x at batch 8, 1.4-1.6x in prefill"


@functools.cache
def onednn_available() -> bool:
    # torch leaves mkldnn.is_available unannotated (it returns torch._C.has_mkldnn, a bool)
    if os.environ.get("WKVM_ONEDNN", "1") == "0" or not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise") or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    try:  # a private op: prove it computes the same product before trusting it
        w, x = torch.randn(48, 32, dtype=torch.float64).float(), torch.randn(5, 32)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT)
        got = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        dense = torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
        want = F.linear(x, w)
        return bool(
            torch.allclose(got, want, rtol=1e-5, atol=1e-5) and torch.allclose(dense, want, rtol=1e-5, atol=1e-5)
        )
    except RuntimeError:
        return False


@functools.cache
def onednn_bf16_available() -> bool:
    """oneDNN bf16 matmuls: native on CPUs with AVX512-BF16/AMX, emulated (slower than fp32) on plain AVX-512."""
    if not onednn_available() or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    try:
        w, x = torch.randn(48, 32).bfloat16(), torch.randn(5, 32).bfloat16()
        got = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT),
                                                 None, "none", [], "")  # fmt: skip
        return bool(torch.allclose(got.float(), F.linear(x.float(), w.float()), rtol=2e-2, atol=2e-2))
    except RuntimeError:
        return False


@functools.cache
def bf16_native() -> bool:
    """oneDNN multiplies bf16 with the CPU's own bf16 instructions: AVX512-BF16 (AMX CPUs have it too)."""
    if not onednn_bf16_available() or not hasattr(torch.cpu, "_is_avx512_bf16_supported"):
        return False
    return torch.cpu._is_avx512_bf16_supported()


def bf16_speed() -> str:
    """What `--dtype bfloat16` does to speed on this CPU, in one line."""
    if bf16_native():
        return f"native bf16 kernel (AVX512-BF16): half the weight memory, often faster (measured {BF16_NATIVE_SPEED})"
    if onednn_bf16_available():
        kernel, measured = "oneDNN emulates bf16 on this CPU", BF16_EMULATED_SPEED
        slow = "prefill and batched decode run"
    else:
        kernel, measured, slow = "oneDNN has no bf16 kernel here", BF16_NO_KERNEL_SPEED, "batched decode runs"
    return (
        f"no native bf16 kernel ({kernel}): half the weight memory, but {slow} slower than "
        f"float32 (measured {measured}); use --dtype float32 unless weight memory is the limit"
    )


def stored(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A large matrix [out, in] in its storage `dtype`: float32, bfloat16, int8 (quantized per output channel) or
    int4 (groups of 32 along `in`; a matrix whose `in` is not a multiple of 32 is stored as int8)."""
    if dtype == int4.DTYPE:
        return int4.quantize_keeping_grid(weight) if weight.shape[1] % int4.GROUP == 0 else int8.quantize(weight)
    return int8.quantize(weight) if dtype == torch.int8 else weight.to(dtype)


def stored_outer(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The embedding or the head in its storage: as `stored`, except that under int4 they are int8. In 4 bits
    they cost most of the quality (mean KL from fp32 on SmolLM2: 0.068 with them int4, 0.003 int8; 0.012 -> 0.001 on
    the default model); llama.cpp's Q4 files keep their head at 6 bits too."""
    return stored(weight, torch.int8 if dtype == int4.DTYPE else dtype)


ISA_FLAGS = {"avx2": "avx2", "avx512f": "avx512f", "avx512_bf16": "avx512_bf16", "avx512_vnni": "avx512_vnni",
             "amx": "amx_tile"}  # fmt: skip


def cpu_isa() -> list[str]:
    """The instruction sets the matmul kernels care about that this CPU has (Linux flags; else torch's view)."""
    flags = set(int8.cpu_flags().split())
    if not flags:
        return [str(torch.backends.cpu.get_cpu_capability()).lower()]
    return [name for name, flag in ISA_FLAGS.items() if flag in flags]


def kernels() -> dict[str, str]:
    """Which linear kernel each weight dtype runs on this CPU (builds the int8 and int4 kernels on first use)."""
    return {name: kernel(name) for name in ("float32", "bfloat16", "int8", "int4")}


def kernel(dtype: str) -> str:
    """Which linear kernel weights of `dtype` run on this CPU, building only that dtype's kernel (a server's
    `system_fingerprint` and checkpoint key name it: a float32 server had built the int8 and int4 kernels too)."""
    prefill = "oneDNN" if onednn_available() else "F.linear"
    if dtype == "float32":
        fp32 = "oneDNN prepacked fp32" if onednn_available() else "F.linear (WKVM_ONEDNN=0, or no oneDNN in this torch)"
        if onednn_available() and fp32gemv.available():
            fp32 = f"wkvm fp32 kernel on oneDNN's packed weights up to {fp32gemv.rows()} rows, then {fp32}"
        return fp32
    if dtype == "bfloat16":
        return ("oneDNN native bf16" if bf16_native() else "oneDNN bf16, emulated (slower than fp32)"
                if onednn_bf16_available() else f"ATen bf16 up to {BF16_WIDEN_ROWS - 1} rows (no oneDNN bf16 kernel), "
                f"then widened to fp32 for {prefill}")  # fmt: skip
    if dtype not in ("int8", "int4"):
        return ""
    module, rows = (int8, int8.KERNEL_ROWS) if dtype == "int8" else (int4, int4.KERNEL_ROWS)
    path = module.kernel_path()
    if path == "torch":
        return "dequantize per call (no native kernel)"
    name = f"wkvm {dtype} kernel ({described(path)})"  # with VNNI both kernels take every size (int8/int4.linear)
    return f"{name} at every size" if path in int8.ALL_SIZES else f"{name} up to {rows} rows, then fp32 {prefill}"


def compute_paths(dtype: str, device: str) -> str:
    """What decides a model's numbers besides its weights and dtypes: wkvm's own arithmetic (`code_digest`), torch's
    version and, on the CPU, its vector ISA, the kernel `dtype` runs (the native int8 kernel and its dequantizing
    fallback differ by ~0.015 in a logprob) and how the fused kernels are built (`fused.build`: on another CPU model,
    compiler or `WKVM_FUSED` setting int8 logprobs differ by ~0.06 nats a token; session 60). A server's
    `system_fingerprint` and its chat checkpoints' key (a checkpoint made on another path, or by an older wkvm
    computing otherwise, had been reused, moving an answer's logprobs; dtype and upgrade hunts, session 49)."""
    cpu = (f", {torch.backends.cpu.get_cpu_capability()}, {kernel(dtype)}, {fused.build()}"
           if device.split(":")[0] == "cpu" else "")  # fmt: skip
    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")  # its kernels sum otherwise
    cpu += f", oneDNN ISA at most {onednn}" if cpu and onednn else ""
    return f"wkvm code {code_digest()}, torch {torch.__version__}{cpu}"


CODE = ("models", "engine", "weights", "state/service.py")  # wkvm's sources that compute a state's numbers


@functools.lru_cache(maxsize=1)
def code_digest() -> str:
    """12 hex digits of sha256 over the sources that compute a model's numbers (`CODE`: Python, C++ and headers):
    any change to them, a comment's included, is another arithmetic as far as a stored checkpoint can tell (the
    version string stays 0.1.0 across releases; a hybrid's checkpoints from a release ~280 commits older were
    reused, 1e-6 off a fresh run's logprobs; upgrade hunt, session 49). Files that read only: an editor's lock file
    (a dangling `.#name.py` link) had stopped the server (review, session 49)."""
    root = Path(__file__).resolve().parent.parent
    files = [p for c in CODE for p in ([root / c] if c.endswith(".py") else (root / c).rglob("*"))
             if p.suffix in (".py", ".cpp", ".h") and not p.name.startswith(".") and p.is_file()]  # fmt: skip
    h = hashlib.sha256()
    for path in sorted(files):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:12]


def described(path: str) -> str:
    """A quantized kernel's path as `wkvm doctor` says it (AMX takes only prefill-sized products)."""
    return "amx from 32 rows of x, avx512_vnni below" if path == "amx" else path


def int8_speed() -> str:
    """What `--dtype int8` runs on this CPU, in one line (builds the int8 kernel on first use)."""
    return quantized_speed("int8", int8.kernel_path(), "a quarter of float32's weight memory", INT8_SPEED)


def int4_speed() -> str:
    """What `--dtype int4` runs on this CPU, in one line (builds the int4 kernel on first use)."""
    return quantized_speed("int4", int4.kernel_path(), "5 bits a weight (a sixth of float32's bytes)", INT4_SPEED)


def quantized_speed(kind: str, path: str, size: str, measured: str) -> str:
    if path == "torch" and os.environ.get(f"WKVM_{kind.upper()}_KERNEL") == "torch":  # asked for, not a failure
        return f"no native {kind} kernel (WKVM_{kind.upper()}_KERNEL=torch): {size}, but every matmul dequantizes " \
               "first, slower than float32"  # fmt: skip
    if path == "torch":
        return f"no native {kind} kernel (no C++ compiler, or its build failed): {size}, but every matmul " \
               "dequantizes first, slower than float32; install g++ or use --dtype float32"  # fmt: skip
    # the figures are the VNNI kernel's (AVX2 takes every size too since session 52, but gains less)
    vnni = path in ("avx512_vnni", "amx")
    note = "" if vnni else " (with AVX512-VNNI; without it batched decode and prefill gain less)"
    return f"native {kind} kernel ({path}): {size}; measured {measured}{note}"


def pack_linear(weight: torch.Tensor) -> torch.Tensor:
    """`weight` is [out, in] (nn.Linear layout), fp32 or bf16, or a `stored` int8 or int4 matrix; returns the form
    `linear` expects."""
    weight = weight.contiguous()
    if weight.device.type == "cpu" and (
        (weight.dtype == torch.float32 and onednn_available())
        or (weight.dtype == torch.bfloat16 and onednn_bf16_available())
    ):
        packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
        if packed.dtype == torch.float32:
            fp32gemv.remember(packed)  # its layout, found now (at load, not on the first token) and kept with it
        return packed
    return weight


def native_kernel(weights: list[torch.Tensor], rows: int) -> tuple[str, list[int]] | None:
    """(kernel, its two arguments a matrix) when `linear` runs every one of `weights` for `rows` rows of x on the same
    native kernel: int8, int4, or fp32 on the gemv kernel (linear_call.h says how a fused layer calls it); None
    otherwise (the layer then leaves its matmuls to `linear`)."""
    dtypes = {w.dtype for w in weights}
    if dtypes in ({torch.int8}, {torch.uint8}):
        choose = int8.kernel_for if torch.int8 in dtypes else int4.kernel_for
        found = {choose(w, rows) for w in weights}
        kernel = found.pop() if len(found) == 1 else None
        return None if kernel is None else (kernel[0], [kernel[1], 0] * len(weights))
    if dtypes != {torch.float32} or not fp32gemv.available() or rows > fp32gemv.rows():
        return None
    args: list[int] = []
    for w in weights:
        layout: tuple[int, int] | None = getattr(w, fp32gemv.LAYOUT, None) if w.is_mkldnn else None
        if layout is None:
            return None
        args += layout
    return "wkvm_fp32", args


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ weight^T -> [..., out]; plain fp32 CPU weights (e.g. streamed, unpacked) also use oneDNN.
    bf16 weights take x rounded to bf16 (accumulating in fp32) and give fp32 back, rounded to bf16 (from
    `BF16_WIDEN_ROWS` rows a plain bf16 weight is widened to fp32 for the call); int8 and int4 ones give fp32."""
    if weight.dtype == torch.int8:
        return int8.linear(x, weight)
    if weight.dtype == torch.uint8:
        return int4.linear(x, weight)
    if weight.dtype != x.dtype:
        widen = weight.dtype == torch.bfloat16 and weight.is_cpu and not weight.is_mkldnn
        if widen and x.numel() >= BF16_WIDEN_ROWS * weight.shape[1]:
            # the same product (x rounded to bf16, bf16 products exact in fp32, the result rounded to bf16)
            return linear(x.to(weight.dtype).float(), weight.float()).to(weight.dtype).float()
        return linear(x.to(weight.dtype), weight).to(x.dtype)
    if weight.is_mkldnn and fp32gemv.takes(x, weight):
        return fp32gemv.linear(x, weight)
    if weight.is_mkldnn or (weight.device.type == "cpu" and weight.dtype == torch.float32 and onednn_available()):
        y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, None, "none", [], "")
        return y
    return F.linear(x, weight)


def rows_independent(weight: torch.Tensor, rows: int) -> bool:
    """Whether `linear` gives each row of x (up to `rows` rows) the same bits whatever rows come with it: where a
    native kernel runs it at that many rows (`native_kernel`: int8 and int4, exact integer products with each row's
    scales its own; packed fp32 weights on wkvm's gemv kernel). Not oneDNN's GEMMs (bf16, plain fp32, int8 past the
    AVX-512BW path's rows): their sums may go another order by row count."""
    return native_kernel([weight], rows) is not None


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of an embedding stored as float32, bfloat16, int8 or int4, in fp32."""
    if weight.dtype == torch.uint8:
        return int4.embedding(ids, weight)
    return int8.embedding(ids, weight) if weight.dtype == torch.int8 else F.embedding(ids, weight).float()


def weight_numel(weight: torch.Tensor) -> int:
    if weight.dtype == torch.uint8:
        return weight.shape[0] * int4.in_features(weight)
    return weight.shape[0] * int8.in_features(weight) if weight.dtype == torch.int8 else weight.shape.numel()
