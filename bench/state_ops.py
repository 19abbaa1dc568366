"""State operations on the 0.1B shape (2.3 MiB state): resume latency from host and from disk next to the raw
time to read the same bytes, fork latency, and 2,000 hibernated sessions with peak RSS.

Resume = from a handle to the state sitting in an engine slot, ready to run. Writes bench/out/state_ops.json.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, machine_line, print_table, write_json  # noqa: E402

from wkvm.engine.arena import SlotArena  # noqa: E402
from wkvm.models.rwkv7.model import RWKV7Config, rwkv7_state_spec  # noqa: E402
from wkvm.state.index import StateIndex  # noqa: E402
from wkvm.state.store import StateStore, StoreLimits  # noqa: E402

CFG = RWKV7Config(12, 768, 12, 64, 65536, 3072, 64, 64, 32, 128)


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100)[q - 1] if len(xs) > 1 else xs[0]


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--sessions", type=int, default=2000)
    args = ap.parse_args()
    spec = rwkv7_state_spec(CFG)
    root = Path(tempfile.mkdtemp(prefix="wkvm-bench-"))
    try:
        store = StateStore(root, spec, "f" * 64, CFG.vocab_size, limits=StoreLimits(64 << 20, 512 << 20))
        arena = SlotArena(spec, 1)
        slot = arena.alloc()
        gen = torch.Generator().manual_seed(0)
        handles = []
        for i in range(args.samples):
            state = {t.name: torch.randn((1, *t.shape), generator=gen) for t in spec.tensors}
            handles.append(store.put("u", f"s{i}", state, [1, 2, i + 3]).handle)

        def resume(h: str) -> None:
            arena.write(slot, store.load("u", h)[1])

        host, disk, disk_ram, raw, fork = [], [], [], [], []
        for h in handles:
            store.hibernate("u", h, "host")
            host.append(timed(lambda h=h: resume(h)))
        for h in handles:
            store.hibernate("u", h, "disk")
            blob = store._blob_path(store.get("u", h).blob)
            raw.append(timed(blob.read_bytes))
            disk.append(timed(lambda h=h: resume(h)))
            store.hibernate("u", h, "disk")
            disk_ram.append(timed(lambda h=h: store.load("u", h)))
        for i, h in enumerate(handles):
            fork.append(timed(lambda h=h, i=i: store.fork("u", h, f"f{i}")))

        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t0 = time.perf_counter()
        base = {t.name: torch.randn((1, *t.shape), generator=gen) for t in spec.tensors}
        for i in range(args.sessions):
            base["layers.0.att_shift"][0, 0] = float(i)  # distinct content, so each session is its own file
            store.put("u", f"session{i}", base, [i + 1])
            store.hibernate("u", f"session{i}", "disk")
        hib_s = time.perf_counter() - t0
        rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        store.close()
        # restart: every state file checked by reading and hashing it (the baseline: a fresh index would do
        # this), then with the size/mtime/inode recorded at write time (what a restart does)
        index = StateIndex(root / "index.sqlite")
        index.forget_checked(set(index.checked_files()))
        index.close()
        restart_full = timed(lambda: StateStore(root, spec, "f" * 64, CFG.vocab_size).close())
        restart = timed(lambda: StateStore(root, spec, "f" * 64, CFG.vocab_size).close())
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(machine_line())
    ms = 1e3
    rows = [
        ["resume from host", pct(host, 50) * ms, pct(host, 99) * ms, "p99 <= 1 ms"],
        [
            "resume from disk",
            pct(disk, 50) * ms,
            pct(disk, 99) * ms,
            f"p99 <= 2 x raw = {2 * pct(raw, 99) * ms:.2f} ms",
        ],
        ["load from disk to RAM only", pct(disk_ram, 50) * ms, pct(disk_ram, 99) * ms, ""],
        ["raw read of the file", pct(raw, 50) * ms, pct(raw, 99) * ms, ""],
        ["fork (copy-on-write)", pct(fork, 50) * ms, pct(fork, 99) * ms, ""],
    ]
    print_table(
        f"State ops, {spec.nbytes / 2**20:.2f} MiB state, {args.samples} samples",
        ["op", "p50 ms", "p99 ms", "target"],
        rows,
    )
    print(f"\n{args.sessions} hibernated sessions written in {hib_s:.1f} s; peak RSS {rss1 / 1024:.0f} MiB "
          f"(before: {rss0 / 1024:.0f} MiB); disk {args.sessions * spec.nbytes / 2**30:.2f} GiB")  # fmt: skip
    n_states = args.samples * 2 + args.sessions
    print(f"restart with {n_states} states: {restart:.3g} s (hashing every file: {restart_full:.3g} s, "
          f"{restart_full / restart:.0f}x)")  # fmt: skip
    write_json("state_ops", {
        **machine(),
        "state_mib": spec.nbytes / 2**20,
        "host_resume_ms": {"p50": pct(host, 50) * ms, "p99": pct(host, 99) * ms},
        "disk_resume_ms": {"p50": pct(disk, 50) * ms, "p99": pct(disk, 99) * ms},
        "disk_load_to_ram_ms": {"p50": pct(disk_ram, 50) * ms, "p99": pct(disk_ram, 99) * ms},
        "raw_read_ms": {"p50": pct(raw, 50) * ms, "p99": pct(raw, 99) * ms},
        "fork_ms": {"p50": pct(fork, 50) * ms, "p99": pct(fork, 99) * ms},
        "sessions": args.sessions, "sessions_write_s": hib_s, "peak_rss_mib": rss1 / 1024,
        "restart_s": restart, "restart_hashing_all_s": restart_full,
    })  # fmt: skip


if __name__ == "__main__":
    main()
