"""Torch's thread count, per thread.

torch keeps one process-wide count, which `torch.set_num_threads` sets together with the calling thread's own (its
OpenMP count and its MKL count), and which a thread takes at its first parallel op: once for torch's own library and
once more for the C++ extensions (their inline `at::internal::lazy_init_num_threads` keeps a flag of theirs). A
server wants its step loop on N threads and every other thread on one (`ServerContext.load`): the loop's counts are
put back here with OpenMP's and MKL's per-thread setters, which leave the process-wide count as it is.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)


@functools.cache
def _setters() -> list[Callable[[int], Any]]:
    """OpenMP's per-thread setter in the runtime torch loaded (its libgomp, global through torch's global deps), and
    MKL's where torch links it in; empty where OpenMP's is not reachable."""
    try:
        setters: list[Callable[[int], Any]] = [ctypes.CDLL(None).omp_set_num_threads]
    except AttributeError:
        return []
    with contextlib.suppress(OSError, AttributeError):  # no MKL in this build: nothing of it to set
        torch_cpu = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        setters.append(torch_cpu.MKL_Set_Num_Threads_Local)  # C's (the lowercase names take pointers)
    return setters


def keep_thread_count(n: int) -> None:
    """Set this thread's counts to `n`, or put them back (the extensions' first op on a thread takes the process-wide
    count), leaving the process-wide count as it is where OpenMP's setter is reachable."""
    global _warned
    torch.get_num_threads()  # torch's own first take on a new thread comes now, not after the setters below
    for set_count in _setters():
        set_count(n)
    if torch.get_num_threads() != n:  # no OpenMP setter, or another runtime than torch's: torch's own setter
        if not _warned:
            _warned = True
            log.warning("cannot set one thread's OpenMP thread count here: torch.set_num_threads(%d) sets it for the "
                        "whole process (a server's other threads may then slow its decoding)", n)
        torch.set_num_threads(n)


_warned = False
