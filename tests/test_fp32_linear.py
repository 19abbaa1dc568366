"""fp32 decode matmuls on oneDNN's packed weights (wkvm/models/fp32gemv.py): the kernel's products equal F.linear's
to fp32 rounding on odd shapes and strided x, a row's result does not depend on its batch mates, and without the
kernel (`WKVM_FUSED=off`) everything runs on oneDNN as before."""

import pytest
import torch
import torch.nn.functional as F

from wkvm.models import fp32gemv
from wkvm.models.linear import linear, onednn_available, pack_linear

# whole 64-row panels; a partial last panel with K not a multiple of 16; a single partial panel; deep K
SHAPES = [(256, 128), (100, 70), (17, 5), (130, 1030)]

needs_kernel = pytest.mark.skipif(
    not (onednn_available() and fp32gemv.available() and fp32gemv.layout(256, 128) is not None),
    reason="no fp32 kernel here (no compiler, or oneDNN packs in a layout the kernel does not know)",
)


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x.double(), w.double()).float()


@needs_kernel
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_equals_f_linear_for_every_decode_size(shape):
    torch.manual_seed(0)
    w = torch.randn(shape)
    packed = pack_linear(w)
    for m in range(1, fp32gemv.rows() + 1):
        x = torch.randn(m, shape[1])
        assert fp32gemv.takes(x, packed)
        torch.testing.assert_close(linear(x, packed), reference(x, w), rtol=1e-4, atol=1e-4)
    assert not fp32gemv.takes(torch.randn(fp32gemv.rows() + 1, shape[1]), packed)  # more rows: oneDNN's GEMM


@needs_kernel
def test_a_row_gives_the_same_bits_alone_and_in_any_batch():
    torch.manual_seed(1)
    w = torch.randn(130, 1030)
    packed = pack_linear(w)
    x = torch.randn(fp32gemv.rows(), 1030)
    alone = torch.cat([linear(x[i : i + 1], packed) for i in range(len(x))])
    for m in range(2, fp32gemv.rows() + 1):
        assert torch.equal(linear(x[:m], packed), alone[:m]), m
    assert torch.equal(linear(x[3:7], packed), alone[3:7])


@needs_kernel
def test_strided_and_batched_x():
    torch.manual_seed(2)
    w = torch.randn(100, 70)
    packed = pack_linear(w)
    rows = torch.randn(5, 77)[:, :70]  # rows 77 floats apart
    columns = torch.randn(70, 3).t()  # column stride 3: copied first
    batched = torch.randn(2, 3, 70)  # [B, T, K]
    for x in (rows, columns, batched):
        assert fp32gemv.takes(x, packed)
        torch.testing.assert_close(linear(x, packed), reference(x, w), rtol=1e-4, atol=1e-4)
    assert torch.equal(linear(batched, packed)[1], linear(batched[1], packed))


@needs_kernel
def test_the_layout_probe_finds_onednn_panels():
    width, depth = fp32gemv.layout(100, 70) or (0, 0)
    assert width % 8 == 0 and depth >= 70
    assert fp32gemv.layout(1, 70) is None  # too small to tell a layout: oneDNN multiplies it
    w, x = torch.randn(1, 70), torch.randn(2, 70)
    assert not fp32gemv.takes(x, packed := pack_linear(w))
    torch.testing.assert_close(linear(x, packed), reference(x, w), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not onednn_available(), reason="no oneDNN in this torch")
def test_off_runs_every_size_on_onednn(monkeypatch):
    torch.manual_seed(3)
    w = torch.randn(100, 70)
    packed = pack_linear(w)
    x = torch.randn(3, 70)
    want = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    fp32gemv.available.cache_clear()
    try:
        monkeypatch.setenv("WKVM_FUSED", "off")
        assert not fp32gemv.takes(x, packed)
        assert torch.equal(linear(x, packed), want)
    finally:
        fp32gemv.available.cache_clear()


@needs_kernel
def test_a_weight_keeps_the_layout_it_was_packed_in_whatever_the_threads_later():
    """oneDNN's packed layout can depend on torch's thread count when it packs (limited to AVX2, as on an AVX2-only
    CPU, [160, 64] packs in panels of 64 rows on one thread and of 16 on two), so the layout the kernel reads is the
    packed weight's own, not its shape's: packed under one count and multiplied under another, both are right."""
    torch.manual_seed(4)
    threads = torch.get_num_threads()
    w, x = torch.randn(160, 64), torch.randn(3, 64)
    try:
        torch.set_num_threads(1)
        one = pack_linear(w)
        torch.set_num_threads(max(2, threads))
        two = pack_linear(w)
        for t in (1, max(2, threads)):
            torch.set_num_threads(t)
            for packed in (one, two):
                assert fp32gemv.takes(x, packed)
                torch.testing.assert_close(linear(x, packed), reference(x, w), rtol=1e-4, atol=1e-4)
    finally:
        torch.set_num_threads(threads)
