"""Build wkvm's C++ kernels for this CPU into ~/.cache/wkvm (each is otherwise built on first use), one line each.

`make test` runs this before the suite: the suite runs in two processes, and a kernel built on first use inside a
test holds the other process's test that needs it (an flock on the build directory) for the build's 10-60 s, which a
test with a short timeout would see as a hang. A kernel that cannot be built is reported, not fatal: its users fall
back to torch ops and say so, as they do in `wkvm serve`. The kernels build side by side, one process each per CPU
(each compile is one compiler process: 94 s one after another on a 2-core AMD EPYC Zen 3).
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor

from wkvm.models import fp32gemv, fused, int4, int8
from wkvm.models.mamba2 import ssd
from wkvm.models.qwen3_5 import gated_delta
from wkvm.models.rwkv7 import step

KERNELS: dict[str, Callable[[], object]] = {
    "int8": int8.native_isa,
    "int4": int4.native_isa,
    "fused": fused.available,
    "fp32 gemv": fp32gemv.available,
    "rwkv7 step": step.available,
    "mamba2 step": ssd.kernel_available,
    "gated deltanet": gated_delta.kernel_available,
}


def build(name: str) -> str:
    start = time.perf_counter()
    return f"kernel {name}: {KERNELS[name]()} ({time.perf_counter() - start:.1f} s)"


def main() -> None:
    # spawned, not forked: a fork of a process that has run torch ops can hang in OpenMP
    workers = ProcessPoolExecutor(os.cpu_count() or 1, mp_context=multiprocessing.get_context("spawn"))
    with workers:
        for line in workers.map(build, KERNELS):
            print(line, flush=True)


if __name__ == "__main__":
    main()
