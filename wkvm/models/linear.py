"""Linear layers on prepacked weights: oneDNN on CPU when available, plain `F.linear` elsewhere.

On the CPUs we measured, oneDNN's packed fp32 matmul runs 1.4x (gemv) to 2.4x (prefill) faster than the default
BLAS path, still in IEEE fp32. Set WKVM_ONEDNN=0 to use `F.linear` everywhere.

bf16 weights pay off only where the CPU multiplies bf16 natively (AVX512-BF16 or AMX). Elsewhere the bf16 matmul
is emulated: single-stream decode still gains from reading half the bytes, but prefill and batched decode run
slower than fp32 (`bench/bf16_speed.py`: the figures below, runs in docs/performance.md).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

PACK_BATCH_HINT = 64
# bf16 over fp32 tok/s, bench/bf16_speed.py on AMD EPYC (2 threads): natively, and with oneDNN limited to AVX2
# (no bf16 kernel at all) or to AVX512_CORE (bf16 emulated) via ONEDNN_MAX_CPU_ISA
BF16_NATIVE_SPEED = "1.3-1.5x float32's tok/s in prefill and decode"
BF16_EMULATED_SPEED = "0.2-0.5x float32's tok/s in prefill, 0.3-1.0x in batch-8 decode, 1.3-2.5x single-stream"


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
        return f"native bf16 kernel (AVX512-BF16): half the weight memory, and faster (measured {BF16_NATIVE_SPEED})"
    kernel = "oneDNN emulates bf16 on this CPU" if onednn_bf16_available() else "oneDNN has no bf16 kernel here"
    return (
        f"no native bf16 kernel ({kernel}): half the weight memory, but prefill and batched decode run slower than "
        f"float32 (measured {BF16_EMULATED_SPEED}); use --dtype float32 unless weight memory is the limit"
    )


def pack_linear(weight: torch.Tensor) -> torch.Tensor:
    """`weight` is [out, in] (nn.Linear layout), fp32 or bf16; returns the form `linear` expects."""
    weight = weight.contiguous()
    if weight.device.type == "cpu" and (
        (weight.dtype == torch.float32 and onednn_available())
        or (weight.dtype == torch.bfloat16 and onednn_bf16_available())
    ):
        packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
        return packed
    return weight


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ weight^T -> [..., out]; plain fp32 CPU weights (e.g. streamed, unpacked) also use oneDNN.
    bf16 weights take x rounded to bf16 (accumulating in fp32) and give fp32 back."""
    if weight.dtype != x.dtype:
        return linear(x.to(weight.dtype), weight).to(x.dtype)
    if weight.is_mkldnn or (weight.device.type == "cpu" and weight.dtype == torch.float32 and onednn_available()):
        y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, None, "none", [], "")
        return y
    return F.linear(x, weight)


def weight_numel(weight: torch.Tensor) -> int:
    return weight.shape.numel()
