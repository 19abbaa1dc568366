"""Group-wise int4 matrices (`--dtype int4`): 5 bits a weight (a sixth of fp32's bytes), multiplied by a native kernel.

Format (Q4_1-like): each row's K weights in groups of 32, weight = q * d + m with q in 0..15 and, per group, an fp16
step d = (max - min) / 15 and an fp16 offset m = min; one uint8 tensor [N, K / 32 * 20]. Rows come in blocks of 16:
a block's group is 256 bytes of nibbles laid out so that one 64-byte load holds 4 consecutive weights of each of the
16 rows (low nibbles) and the next 4 (high nibbles), then the 16 rows' d and their m; rows after the last whole
block are plain (per group 16 bytes: weight j in the low nibble, 16 + j in the high one; then d, m). The tensor's
first dimension is N, so prepared layers, owned storage and tied embeddings move it like any matrix. Matrices whose
K is not a multiple of 32 are stored as int8 instead (`stored` in wkvm/models/linear.py): no padding to track.

Measured (bench/int8_quality.py --int4-variants, mean KL(fp32 || int4) over 512 tokens): asymmetric groups beat
Q4_0-style symmetric ones (`quantize(symmetric=True)`, same format with m = -8 d) on every model: 1.2e-2 vs 1.4e-2
on the default model, 0.068 vs 0.37 on SmolLM2, 0.17 vs 0.20 on the random RWKV-7 0.1B shape. Most of the loss is in
the embedding and head: with those two in int8 the KL falls to 1.2e-3, 3.0e-3 and 0.11 (llama.cpp's Q4 files keep
them at 8 bits too), but `stored` does not know which matrix it stores, so `--dtype int4` quantizes them in int4.

Decode-sized batches go to int4_linear.cpp (built on first use like the int8 kernel; shared `int8.load_kernel`):
each row of x is rounded to int8 per group of 32 (llama.cpp's q8 activations), so the products are exact integer
dot products (vpdpbusd with AVX512-VNNI), the same bits on every ISA. Rounding x costs little: with x kept in fp32
(the matrices dequantized) the KL moved by at most 4% (SmolLM2: 0.0665 vs 0.069), so int16 x (twice the integer
instructions) was not built. With VNNI the kernel takes every size (it beat dequantize + oneDNN from 1 to 1,024
rows), and with AVX2 (on an AVX2-only AMD EPYC Zen 3: 1.2-9.4x dequantize + oneDNN from 64 to 1,024 rows, 1.06-1.32x
at 2,048 and 4,096; session 52); the AVX-512BW path without VNNI dequantizes more than `KERNEL_ROWS` rows to fp32
per call for oneDNN's GEMM. Without a
compiler every call dequantizes in torch after a one-line warning; importing never fails.
WKVM_INT4_KERNEL=amx|avx512_vnni|avx512|avx2|scalar|torch forces a path.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

from wkvm.models.int8 import ALL_SIZES, ISAS, built_isa, choose_path, kernel_op, load_kernel, run_kernel

log = logging.getLogger("wkvm.int4")

# rows of x up to which the AVX-512BW kernel (no VNNI) is kept against dequantize + oneDNN (measured as AVX2 code on an
# AVX-512 machine: 0.55-0.62x fp32 at 128 rows against 0.36-0.50x for dequantize + oneDNN, 0.53-0.61x at 1,024 against
# 0.83-0.86x); with VNNI the kernel ran 0.71-1.22x fp32 oneDNN from 32 to 1,024 rows (3-4x at 1), above dequantize +
# oneDNN (0.05-0.86x) at every size, and on a real AVX2-only CPU the AVX2 kernel beat dequantize + oneDNN at every
# size (session 52), so those two take all (int8.ALL_SIZES)
KERNEL_ROWS = 128
SOURCE = Path(__file__).with_name("int4_linear.cpp")
GROUP, ROWS, ROW_BYTES = 32, 16, 20  # weights a group, rows a block, bytes a row and group
CFLAGS = ("-O3", "-ffp-contract=off")  # no FMA contraction: every ISA computes the same float expression
DTYPE: torch.dtype = torch.int4  # type: ignore[attr-defined]  # the config's name for int4 storage (holds no data)


def quantize(w: torch.Tensor, symmetric: bool = False) -> torch.Tensor:
    """[N, K] float, K a multiple of 32 -> uint8 [N, K / 32 * 20] in the format above."""
    w = w.detach().to(torch.float32)
    N, K = w.shape
    if K % GROUP:
        raise ValueError(f"int4 needs K (here {K}) to be a multiple of {GROUP}")
    G = K // GROUP
    g = w.view(N, G, GROUP)
    if symmetric:  # Q4_0: the value of largest magnitude maps to q = 0 (-8 d)
        big = g.gather(-1, g.abs().argmax(-1, keepdim=True)).squeeze(-1)
        d = (big / -8).half()
        m = (d.float() * -8).half()
    else:
        m = g.amin(-1).half()
        d = ((g.amax(-1) - m.float()) / 15).half()
    d32 = d.float()
    safe = torch.where(d32 == 0, torch.ones_like(d32), d32)
    q = torch.round((g - m.float()[..., None]) / safe[..., None]).clamp_(0, 15).to(torch.uint8)
    q[d32 == 0] = 0  # a constant group: its fp16 offset alone
    nb = N // ROWS
    # block rows: (nb, 16 rows, G, chunk 4, nibble 2, 4) -> (nb, G, chunk, rows, 4, nibble)
    qb = q[: nb * ROWS].view(nb, ROWS, G, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)
    nibbles = (qb[..., 0] | (qb[..., 1] << 4)).reshape(nb, G, 256)
    per_block = [nibbles] + [_halves(t[: nb * ROWS].view(nb, ROWS, G).transpose(1, 2)) for t in (d, m)]
    blocks = torch.cat(per_block, -1).reshape(nb * ROWS, G * ROW_BYTES)
    qp, dp, mp = q[nb * ROWS :], d[nb * ROWS :, :, None], m[nb * ROWS :, :, None]
    plain = torch.cat([qp[..., :16] | (qp[..., 16:] << 4), _halves(dp), _halves(mp)], -1)
    return torch.cat([blocks, plain.reshape(N - nb * ROWS, G * ROW_BYTES)])


def quantize_keeping_grid(w: torch.Tensor) -> torch.Tensor:
    """`quantize` for `--dtype int4`: asymmetric groups (the better default, above), unless `w`'s values already lie
    on Q4_0's symmetric grid and only there, as a dequantized Q4_0 GGUF's do: then that grid, so the file's values
    are kept as they are (asymmetric groups had moved them by up to half a step). A Q4_1 file's values lie on the
    asymmetric grid and round-trip through it (all 210 layer matrices of SmolLM2's GGUF). Values from anything else
    (an HF checkpoint's) lie on neither: eight rows spread over the matrix say so before any whole-matrix check."""
    w = w.detach().to(torch.float32)
    rows = w[:: max(1, len(w) // 8)][:8]
    on_grid = [torch.equal(dequantize(quantize(rows, symmetric=sym)), rows) for sym in (False, True)]
    if on_grid[0] or not on_grid[1]:
        return quantize(w)
    s = quantize(w, symmetric=True)
    return s if torch.equal(dequantize(s), w) else quantize(w)


def _halves(t: torch.Tensor) -> torch.Tensor:
    """fp16 [..., n] -> its bytes [..., 2n] (native byte order)."""
    return torch.empty(t.shape, dtype=torch.float16, device=t.device).copy_(t).view(torch.uint8)  # fresh strides


def in_features(w: torch.Tensor) -> int:
    return int(w.shape[1]) // ROW_BYTES * GROUP


def unpack(w: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows `rows` (1-D) of a quantized matrix: q uint8 [n, G, 32], d and m fp32 [n, G]."""
    G = in_features(w) // GROUP
    nb = w.shape[0] // ROWS
    blocks = w[: nb * ROWS].reshape(nb, G, ROWS * ROW_BYTES)
    plain = w[nb * ROWS :].reshape(w.shape[0] - nb * ROWS, G, ROW_BYTES)
    rows, n = rows.to(w.device), rows.numel()
    q = torch.empty(n, G, GROUP, dtype=torch.uint8, device=w.device)
    d, m = torch.empty(n, G, device=w.device), torch.empty(n, G, device=w.device)
    inside = rows < nb * ROWS
    if inside.any():
        b, r = rows[inside] // ROWS, rows[inside] % ROWS
        bytes_ = blocks[:, :, :256].reshape(nb, G, 4, ROWS, 4)[b, :, :, r, :]  # [n, G, chunk, 4]
        q[inside] = torch.stack([bytes_ & 15, bytes_ >> 4], -2).reshape(-1, G, GROUP)
        scales = blocks[b, :, 256:].contiguous().view(torch.float16).view(-1, G, 2, ROWS)  # only the rows' blocks
        at = torch.arange(len(b), device=w.device)
        d[inside], m[inside] = scales[at, :, 0, r].float(), scales[at, :, 1, r].float()
    if not inside.all():
        p = plain[rows[~inside] - nb * ROWS]
        q[~inside] = torch.cat([p[..., :16] & 15, p[..., :16] >> 4], -1)
        scales = p[..., 16:].contiguous().view(torch.float16)
        d[~inside], m[~inside] = scales[..., 0].float(), scales[..., 1].float()
    return q, d, m


def _values(w: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    q, d, m = unpack(w, rows)
    return (q.to(torch.float32) * d[..., None] + m[..., None]).reshape(rows.numel(), -1)


def dequantize(w: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 [N, G * 20] -> [N, K] in `dtype` (torch ops; the kernel's own `dequantize` is one parallel pass)."""
    return _values(w, torch.arange(w.shape[0], device=w.device)).to(dtype)


def embedding(ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of a quantized embedding, dequantized to fp32 (only the rows looked up)."""
    return _values(w, ids.reshape(-1)).view(*ids.shape, in_features(w))


def kernel_for(w: torch.Tensor, rows: int) -> tuple[str, int] | None:
    """(namespace, isa) of the native kernel `linear` runs for `rows` rows of x on `w`; None where it would not."""
    path = kernel_path() if w.is_cpu else "torch"
    if native_isa() is None or not _kernel_takes(path, rows):
        return None
    return "wkvm_int4", ISAS.index(path)


def _kernel_takes(path: str, rows: int) -> bool:
    return path in ALL_SIZES or (path != "torch" and rows <= KERNEL_ROWS)  # AVX2, VNNI, AMX: every size


def linear(x: torch.Tensor, w: torch.Tensor, path: str | None = None) -> torch.Tensor:
    """x [..., K] fp32 @ dequantize(w)^T -> [..., N] fp32; `path` (an ISA name or "torch") overrides the choice."""
    path = (path or kernel_path()) if w.is_cpu else "torch"
    if path != "torch" and native_isa() is None:
        raise RuntimeError(f"int4 kernel path {path!r} asked for, but the kernel could not be built")
    if _kernel_takes(path, x.numel() // max(1, x.shape[-1])):
        op, isa = kernel_op("wkvm_int4", path)
        return run_kernel(op, x, w, isa)
    from wkvm.models.linear import linear as float_linear

    x2 = x.reshape(-1, in_features(w)).to(torch.float32)
    y = float_linear(x2, torch.ops.wkvm_int4.dequantize(w) if path != "torch" else dequantize(w))
    return y.view(*x.shape[:-1], w.shape[0])


@functools.cache
def kernel_path() -> str:
    """What int4 matmuls of decode size run on here: an ISA of the native kernel, or "torch" (dequantize per call)."""
    return choose_path("WKVM_INT4_KERNEL", native_isa)


@functools.cache
def native_isa() -> str | None:
    """The best ISA of the native kernel on this CPU, building it on first use; None when it cannot be built."""
    return built_isa("int4", build, "wkvm_int4", log)


def build() -> None:
    """Compile (once per source, torch and CPU) and load int4_linear.cpp as torch.ops.wkvm_int4."""
    load_kernel(SOURCE, "wkvm_int4", CFLAGS)
