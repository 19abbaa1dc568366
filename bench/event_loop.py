"""Event-loop latency under state I/O: `/health` p50/p99 while idle, then during a storm of state writes
(hibernate to disk, import, generate with save_as: each fsyncs) from 4 clients, against a server in its own
process on the 0.1B shape (2.3 MiB states). The idle run is the baseline; a route that blocked the event loop
on disk I/O would show in the storm's p99. Writes bench/out/event_loop.json.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from common import checkpoint, machine, machine_line, print_table, write_json  # noqa: E402

from wkvm.server.background import free_port, wait_healthy  # noqa: E402


def probe(url: str, seconds: float) -> list[float]:
    """/health latencies (ms), one request every 10 ms."""
    out = []
    with httpx.Client() as c:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            t0 = time.perf_counter()
            c.get(f"{url}/health")
            out.append((time.perf_counter() - t0) * 1000)
            time.sleep(0.01)
    return out


def storm(url: str, worker: int, stop: threading.Event, counts: list[int]) -> None:
    with httpx.Client(base_url=url, timeout=120) as c:
        name = f"w{worker}"
        c.post("/v1/states", json={"name": name, "prompt_ids": list(range(1, 65))}).raise_for_status()
        exported = c.get(f"/v1/states/{name}/export").content
        while not stop.is_set():
            c.post(f"/v1/states/{name}/hibernate", json={"tier": "disk"}).raise_for_status()
            c.post(f"/v1/states/import?name={name}-imp", content=exported).raise_for_status()
            body = {"prompt_ids": [7], "max_tokens": 1, "save_as": f"{name}-gen"}
            c.post(f"/v1/states/{name}/generate", json=body).raise_for_status()
            counts[worker] += 3


def pcts(xs: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(xs, n=100)
    return q[49], q[98]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--workers", type=int, default=4)
    args = ap.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "wkvm.cli", "serve", "--model", str(checkpoint()), "--port", str(port),
           "--no-access-log", "--log-level", "warning"]  # fmt: skip
    server = subprocess.Popen(cmd)
    try:
        wait_healthy(url, timeout=600, alive=lambda: server.poll() is None)
        idle = probe(url, args.seconds)
        stop, counts = threading.Event(), [0] * args.workers
        workers = [threading.Thread(target=storm, args=(url, i, stop, counts)) for i in range(args.workers)]
        for w in workers:
            w.start()
        time.sleep(2)  # every worker past its setup
        busy = probe(url, args.seconds)
        stop.set()
        for w in workers:
            w.join()
    finally:
        server.terminate()
        server.wait(60)
    (i50, i99), (b50, b99) = pcts(idle), pcts(busy)
    rows = [["idle", len(idle), f"{i50:.2f}", f"{i99:.2f}"],
            ["state-write storm", len(busy), f"{b50:.2f}", f"{b99:.2f}"]]
    print(machine_line())
    print_table("/health latency (ms)", ["phase", "probes", "p50", "p99"], rows)
    print(f"storm: {sum(counts)} state writes in ~{args.seconds + 2:.0f} s; p99 busy/idle {b99 / i99:.2f}x")
    write_json("event_loop", {**machine(), "idle_ms": {"p50": i50, "p99": i99}, "storm_ms": {"p50": b50, "p99": b99},
                              "state_writes": sum(counts), "seconds": args.seconds})  # fmt: skip


if __name__ == "__main__":
    main()
