"""fp32 matmuls of decode size on oneDNN's own prepacked weights (fp32_linear.cpp, torch op namespace `wkvm_fp32`).

A B=1 decode step of an fp32 model is bound by reading its weights, and oneDNN's M=1 gemv on its packed layout
read them at 17-23 GB/s on the AMD EPYC measured, where a plain broadcast-and-FMA loop over the same panels reads
them faster (docs/performance.md, issue #21). The kernel reads the packed copy `linear.pack_linear` already keeps,
so weights are stored once and prefill (many rows, compute-bound, oneDNN's GEMM ahead) is unchanged.

The packed layout is oneDNN's choice per CPU, shape and thread count at packing time (limited to AVX2, [160, 64]
packs in 64-row panels on one thread and 16-row ones on two). When `linear.pack_linear` packs a weight, `remember`
finds its layout with `layout`, which packs a probe matrix of that shape under the same thread count (distinct
values, the weight's size once more for a moment, once per shape and thread count per process) and checks every
value's place, and keeps it on the packed tensor itself: threads changed later do not change what the kernel
reads. Weights without a layout it knows (or packed elsewhere) stay on oneDNN.

Rows of x up to `rows()` (32 with AVX-512, 12 with AVX2: where it beat oneDNN's GEMM) go to the kernel; each
output element is computed by the same sequence of fused multiply-adds whatever the number of rows, so a row's
result does not depend on its batch mates. `WKVM_FUSED=off`, no compiler, or a tensor the kernel does not take:
oneDNN, as before.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from wkvm.models.fused import kernel_available

SOURCE = Path(__file__).with_name("fp32_linear.cpp")
PROBE_BASE = 0x30000000  # probe values are these int32 bit patterns plus n * K + k: distinct, finite, normal floats
LAYOUT = "_wkvm_gemv_layout"  # the attribute a packed weight carries its layout in (`remember`)


@functools.cache
def available() -> bool:
    """Whether the kernel runs here (built now if needed); False under WKVM_FUSED=off or without a compiler."""
    return kernel_available(SOURCE, "wkvm_fp32", "linear", "fp32 gemv kernel", "fp32 decode matmuls run on oneDNN")


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear(x, weight)` runs on the kernel: a oneDNN-packed fp32 weight of a known layout, fp32 x with at
    most `rows()` rows."""
    return (
        weight.is_mkldnn
        and weight.dtype == torch.float32
        and x.dtype == torch.float32
        and available()
        and x.numel() <= rows() * weight.shape[1]
        and getattr(weight, LAYOUT, None) is not None
    )


@functools.cache
def rows() -> int:
    """Rows of x up to which the kernel beat oneDNN's packed GEMM on this build's ISA, weights read from memory (32
    with AVX-512, 12 with AVX2; fp32_linear.cpp `max_rows`); 0 without the kernel."""
    return int(torch.ops.wkvm_fp32.max_rows()) if available() else 0


def remember(packed: torch.Tensor) -> None:
    """Keep on a weight oneDNN has just packed (fp32) the layout it was packed in, when the kernel knows it."""
    if available():
        setattr(packed, LAYOUT, layout(*packed.shape))


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ W^T -> [..., N] for a weight `takes` accepts."""
    N, K = weight.shape
    shape: tuple[int, int] | None = getattr(weight, LAYOUT)
    assert shape is not None
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y: torch.Tensor = torch.ops.wkvm_fp32.linear(x2, weight, *shape)
    return y.view(*x.shape[:-1], N)


def layout(n: int, k: int) -> tuple[int, int] | None:
    """(panel width, padded depth) of oneDNN's packed layout for [n, k] fp32 weights packed here now (with torch's
    current thread count), if the kernel knows it."""
    return _layout(n, k, torch.get_num_threads())


@functools.cache
def _layout(n: int, k: int, threads: int) -> tuple[int, int] | None:
    """`layout`, probed once per shape and thread count (`threads` is torch's, the one the probe packs under)."""
    if not available() or n * k >= 2**31 - PROBE_BASE:
        return None
    from wkvm.models.linear import PACK_BATCH_HINT

    bits = torch.arange(n * k, dtype=torch.int32).add_(PROBE_BASE)
    packed = torch.ops.mkldnn._reorder_linear_weight(bits.view(torch.float32).view(n, k), PACK_BATCH_HINT)
    del bits
    if not packed.is_mkldnn:
        return None
    width, depth = torch.ops.wkvm_fp32.probe(packed, PROBE_BASE, torch.ops.mkldnn._nbytes(packed))
    return (width, depth) if width and torch.ops.wkvm_fp32.supports(width) else None
