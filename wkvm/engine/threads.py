"""Torch's thread count, per thread.

torch keeps one process-wide count, which `torch.set_num_threads` sets together with the calling thread's own
(OpenMP's per-thread count), and which every thread takes at its first parallel op, once for torch's library and once
more for each C++ extension (its inline `at::internal::lazy_init_num_threads` keeps its own flag). A server wants its
step loop on N threads and every other thread on one (`ServerContext.load`): the loop's count is then put back here,
on OpenMP's own per-thread setter, without moving the process-wide one.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch


@functools.cache
def _omp_set_num_threads() -> Callable[[int], None] | None:
    """OpenMP's setter in the runtime torch loaded (libgomp, found by its soname: one per process), or None."""
    try:
        return ctypes.CDLL("libgomp.so.1").omp_set_num_threads
    except (OSError, AttributeError):
        return None


def keep_thread_count(n: int) -> None:
    """Put this thread's count back to `n` if something reset it (an extension's first parallel op here takes the
    process-wide count), leaving the process-wide count as it is where OpenMP's setter is reachable."""
    if torch.get_num_threads() == n:
        return
    setter = _omp_set_num_threads()
    if setter is not None:
        setter(n)
    if torch.get_num_threads() != n:  # no such runtime, or another one than torch's: torch's own setter
        torch.set_num_threads(n)
