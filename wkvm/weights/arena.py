"""Resident weights' small tensors gathered into one allocation, in the order a forward pass reads them.

torch's CPU allocator puts an allocation of 2 MiB or more on transparent huge pages (`THP_MEM_ALLOC_ENABLE=1`, which
`import wkvm` sets), a smaller one on 4 KiB pages from the C heap. A quantized model's layer matrices are mostly
smaller than that (SmolLM2-135M int8: 120 matrices of 0.33-1.8 MB, 107 MB together), so a decode step, which reads
every weight once, took a TLB miss every 4 KiB and restarted the hardware prefetcher at every matrix. Gathered,
they are one 2 MiB-aligned block on huge pages that a step reads front to back (`bench/weight_arena.py`).
"""

from __future__ import annotations

import torch

from wkvm.models.provider import Tensors

HUGE_PAGE = 2 << 20  # torch's threshold for huge pages (c10's alloc_cpu) and their size on x86-64
ALIGN = 64  # every tensor starts on a cache line (the kernels' vector loads, any element size)


def gatherable(t: object) -> bool:
    """A plain contiguous CPU tensor smaller than a huge page that is the whole of its storage (a view into a larger
    buffer, or a tensor sharing its storage with another, stays where it is)."""
    return (isinstance(t, torch.Tensor) and t.layout == torch.strided and t.device.type == "cpu" and not t.is_mkldnn
            and not t.requires_grad and t.is_contiguous() and t.storage_offset() == 0
            and 0 < t.untyped_storage().nbytes() == t.nbytes < HUGE_PAGE)  # fmt: skip


def gather_small(parts: list[Tensors]) -> int:
    """Move every `gatherable` tensor of `parts` (in their order: layer 0's first) into one allocation, each a view
    of it, replacing the dict entries; bytes moved. The same values, so the same results. A tensor that is one
    object in several places (a tied embedding and head) is moved once and stays one; storages two tensor objects
    share are left alone. Below one huge page in all nothing moves (the block would be on 4 KiB pages too). The old
    tensors are freed as they are replaced, so loading needs the block plus one tensor more, not twice the weights."""
    owners: dict[int, set[int]] = {}  # storage address -> ids of the tensor objects on it
    places: dict[int, tuple[int, int, list[tuple[Tensors, str]]]] = {}  # id -> (storage, bytes, where), in order
    for part in parts:
        for name, t in part.items():
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.layout == torch.strided:
                storage = t.untyped_storage().data_ptr()
                owners.setdefault(storage, set()).add(id(t))
                if gatherable(t):
                    places.setdefault(id(t), (storage, t.nbytes, []))[2].append((part, name))
    moved = [(n, where) for storage, n, where in places.values() if len(owners[storage]) == 1]
    if sum(padded(n) for n, _ in moved) < HUGE_PAGE:
        return 0
    block = torch.empty(sum(padded(n) for n, _ in moved), dtype=torch.uint8)
    offset = 0
    for n, where in moved:
        part, name = where[0]
        view = block[offset : offset + n].view(part[name].dtype).view(part[name].shape)
        view.copy_(part[name])
        for part, name in where:  # the old tensor is freed with its last entry
            part[name] = view
        offset += padded(n)
    return sum(n for n, _ in moved)


def padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN
