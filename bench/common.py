"""Shared bench helpers: a cached random 0.1B-shape checkpoint, timers, machine rates, the CPU's name, engine decode
throughput, table output."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

os.environ.setdefault("RWKV_V7_ON", "1")
os.environ.setdefault("RWKV_CUDA_ON", "0")

from wkvm.models.rwkv7.random_weights import SHAPE_0_1B, RWKV7Shape, save_random_rwkv7  # noqa: E402

OUT = Path(__file__).parent / "out"


def checkpoint(shape: RWKV7Shape = SHAPE_0_1B, name: str = "rwkv7-0.1b-random") -> Path:
    path = OUT / f"{name}.pth"
    if not path.exists():
        save_random_rwkv7(path, shape, seed=0)
    return path


# What an AVX2-only x86 CPU runs, on any newer one: torch's own kernels, oneDNN, wkvm's int8 / int4 kernels and its
# fused kernels built for Haswell. Each is read when its library loads, so `rerun_with_avx2_paths` starts the
# benchmark again with them set. The memory system stays this machine's: a stand-in for an AVX2-only CPU's code
# paths, not for its bandwidth.
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "WKVM_INT8_KERNEL": "avx2",
            "WKVM_INT4_KERNEL": "avx2", "WKVM_FUSED_MARCH": "haswell"}  # fmt: skip


def avx2_paths() -> bool:
    return all(os.environ.get(k) == v for k, v in AVX2_ENV.items())


def rerun_with_avx2_paths() -> None:
    """Run this benchmark again (same arguments) in a process restricted to AVX2 code paths (`AVX2_ENV`)."""
    if not avx2_paths():
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **AVX2_ENV})


def cpu_name() -> str:
    """The CPU's model name, and "AVX2 code paths" when this process runs only those (`AVX2_ENV`)."""
    name = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name}, AVX2 code paths only (AVX2_ENV)" if avx2_paths() else name


def machine() -> dict[str, object]:
    """What every figure is named with (for a bench's JSON): the CPU, torch's ISA, and torch's thread count."""
    return {"cpu": cpu_name(), "isa": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads()}


def machine_line() -> str:
    """`machine()` as a bench's header line."""
    m = machine()
    return f"CPU: {m['cpu']}; torch ISA {m['isa']}; {m['threads']} threads"


def rwkv_reference():
    """BlinkDL's `rwkv` package's RWKV class (the reference these benches run against), or exit with one line
    saying how to install it: it ships in the `dev` extra only."""
    try:
        from rwkv.model import RWKV
    except ModuleNotFoundError:
        sys.exit("the `rwkv` package (BlinkDL's reference) is missing: pip install -e '.[dev]' (or rwkv==0.8.32)")
    return RWKV


def decode_engine(model, tokenizer, batch: int, kv_dtype: str = "float32"):
    """An Engine with `batch` slots as engine_decode_tok_s sets one up."""
    from wkvm.config import EngineConfig
    from wkvm.engine.engine import Engine

    return Engine(model, tokenizer, EngineConfig(n_slots=batch, token_budget=max(batch, 512), prefill_chunk=512,
                                                 kv_dtype=kv_dtype))  # fmt: skip


def engine_decode_tok_s(model, tokenizer, batch: int, steps: int, prompt: Callable[[int], list[int]],
                        kv_dtype: str = "float32", sampling: dict | None = None, engine=None) -> float:  # fmt: skip
    """Aggregate decode tok/s of the engine running `batch` requests (request i starts from `prompt(i)`; greedy, or
    `sampling`'s SamplingParams fields with seed i), timed over `steps` steps after every request has its first
    token (each step then decodes one token per request). `engine`: one to reuse (decode_engine; its `batch` slots
    free), else a new one. A new engine's key/value pages are fresh memory: the OS maps each on its first write, in
    the timed steps (SmolLM2 at B=8: ~75 page faults a step, 10.6 against 9.0 ms on a reused engine, AMD EPYC VM)."""
    from wkvm.sampling_params import SamplingParams

    engine = engine or decode_engine(model, tokenizer, batch, kv_dtype)
    fields = {"temperature": 0, **(sampling or {})}
    handles = [engine.submit(prompt(i), SamplingParams(max_tokens=steps + 2, ignore_eos=True, seed=i, **fields))
               for i in range(batch)]  # fmt: skip
    while not all(h.output.token_ids for h in handles):  # prefill (several steps for a long prompt)
        engine.step()
    engine.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    dt = time.perf_counter() - t0
    engine.run_until_done()
    return batch * steps / dt


def timeit(fn: Callable[[], object], repeat: int = 5, warmup: int = 1) -> float:
    """Median seconds of `repeat` runs after `warmup` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def timeit_pair(a: Callable[[], object], b: Callable[[], object], repeat: int = 5) -> tuple[float, float]:
    """Median seconds of a and b, run alternately so that machine noise hits both alike."""
    a()
    b()
    ta, tb = [], []
    for _ in range(repeat):
        for fn, out in ((a, ta), (b, tb)):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return statistics.median(ta), statistics.median(tb)


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Bytes per second of a large tensor copy (read + write)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    t = timeit(lambda: dst.copy_(src), repeat=5)
    return 2 * nbytes / t


def read_bandwidth(nbytes: int = 1 << 30) -> float:
    """Bytes per second of streaming a large tensor from memory once (a sum reads every byte once)."""
    src = torch.ones(nbytes // 4)
    return nbytes / timeit(src.sum, repeat=5)


def decode_and_read(decode: Callable[[], object], tokens: int, nbytes: int, repeat: int = 5) -> tuple[float, float]:
    """Median seconds of `decode` (`tokens` decode steps) and of reading `nbytes` from memory `tokens` times (a sum
    over a buffer of that size, too large for any cache), run alternately.

    The decode floor is weight bytes per token over the read rate. This machine's read rate moves between ~25 and
    ~58 GB/s from one second to the next (other tenants), so a rate measured once, apart from the decode, can land
    in a burst or a trough; read in alternation with the decode, both see the same minutes."""
    buf = torch.ones(nbytes // 4)

    def read() -> None:
        for _ in range(tokens):
            buf.sum()

    return timeit_pair(decode, read, repeat)


def int8_rows_rate(rows: int = 8, n: int = 1536, k: int = 576, repeat: int = 200, threads: int | None = None) -> float:
    """MAC/s of wkvm's int8 kernel at `rows` rows of x on one [n, k] matrix held in cache (SmolLM2's gate-up shape):
    how fast this machine computes a batched decode step's matmuls just now, where `read_bandwidth` says how fast it
    streams a one-row step's weights. `threads`: on that many of torch's threads (then restored), else all of them.
    On one thread and on all, it also says whether the CPUs compute side by side: this 2-vCPU VM (AMD EPYC Zen 4) ran
    145-156 GMAC/s on either vCPU alone in both of its host states, and 234-257 (~1.65x) together in one but 172-187
    (1.13-1.23x, as two hyperthreads of one core) in the other, where its memory read 55-69 GB/s in most probes
    instead of 26-38 (docs/performance.md, session 43)."""
    from wkvm.models import int8

    x, w = torch.randn(rows, k), int8.quantize(torch.randn(n, k))

    def run() -> None:
        for _ in range(repeat):
            int8.linear(x, w)

    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        return repeat * rows * n * k / timeit(run, repeat=3)
    finally:
        torch.set_num_threads(before)


def matmul_rate(m: int = 1024, k: int = 768, n: int = 3072) -> dict[str, float]:
    """fp32 FLOP/s of a prefill-sized matmul: default BLAS (`F.linear`) and wkvm's packed `linear`."""
    from wkvm.models.linear import linear, pack_linear

    a, b = torch.randn(m, k), torch.randn(n, k)
    packed = pack_linear(b)
    flop = 2 * m * k * n
    return {
        "blas": flop / timeit(lambda: torch.nn.functional.linear(a, b), repeat=10, warmup=3),
        "packed": flop / timeit(lambda: linear(a, packed), repeat=10, warmup=3),
    }


def fmt(x: float) -> str:
    """Two decimals, or three significant digits below 1 so that a sub-millisecond figure does not print as 0.00."""
    return f"{x:.2f}" if x == 0 or abs(x) >= 1 else f"{x:.3g}"


def print_table(title: str, header: list[str], rows: list[list[object]]) -> None:
    cells = [header] + [[fmt(c) if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    print(f"\n{title}")
    for j, r in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))
        if j == 0:
            print("  ".join("-" * w for w in widths))


def write_json(name: str, data: dict) -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{name}.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def plot(name: str, xs: list, series: dict[str, list[float]], xlabel: str, ylabel: str, title: str) -> Path | None:
    """A line plot written as OUT/name.png (skipped with a note if matplotlib is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot written")
        return None
    OUT.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, ys in series.items():
        ax.plot(xs, ys, marker="o", label=label)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    path = OUT / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
