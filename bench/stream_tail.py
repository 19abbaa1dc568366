"""Gaps between streamed chunks under load, with the loaded heap frozen out of full garbage collections and without.

Starts `wkvm serve` (single process, the embedded model unless `--model`) twice: as it runs (`freeze_startup_heap`
at the end of loading) and with `gc.freeze` made a no-op in the server process (a `sitecustomize` on its
PYTHONPATH: the behaviour before the freeze). Each time, `--rounds` rounds of `--streams` concurrent completion
streams of `--tokens` sampled tokens (`ignore_eos`) through the `openai` SDK; prints the gaps between chunks (p50 /
p99 / p99.9 / max) and the server's own full collections longer than 10 ms while serving (logged by a gc callback in
the same `sitecustomize`). Halfway through, the same `sitecustomize` runs one full collection in the server
(`gc.collect()`, asked for through a file), as CPython does on its own once enough objects have outlived younger
collections (about a quarter as many as the last full one kept): so each run shows what one costs the streams. This
process freezes its own heap too, so its collections do not count as the server's gaps.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import sys
import tempfile
import time
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_name, print_table, write_json  # noqa: E402
from migration import pct, serve, stop  # noqa: E402

from wkvm.cli import default_model  # noqa: E402
from wkvm.models.linear import cpu_isa  # noqa: E402

SITE = """
import gc, os, time
_t = [0.0]
def _log(phase, info):
    if phase == "start":
        _t[0] = time.perf_counter()
    elif info["generation"] == 2 and time.perf_counter() - _t[0] > 0.01:
        with open(os.environ["WKVM_BENCH_GC_LOG"], "a") as f:
            f.write(f"{time.time()} {time.perf_counter() - _t[0]}\\n")
gc.callbacks.append(_log)
if os.environ.get("WKVM_BENCH_THAWED"):
    gc.freeze = lambda: None
def _collect_when_asked():  # one full collection mid-run, where CPython would run one on its own
    while not os.path.exists(os.environ["WKVM_BENCH_COLLECT"]):
        time.sleep(0.01)
    gc.collect()
import threading
threading.Thread(target=_collect_when_asked, daemon=True).start()
"""


async def load(url: str, model: str, rounds: int, streams: int, tokens: int, collect: Path) -> list[float]:
    c = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    gaps: list[float] = []

    async def one(i: int) -> None:
        s = await c.completions.create(model=model, prompt=f"Story {i}:", max_tokens=tokens, stream=True, seed=i,
                                       extra_body={"ignore_eos": True})  # fmt: skip
        last = None
        async for _ in s:
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now

    async def ask_for_a_collection() -> None:
        await asyncio.sleep(1.0)  # the streams are under way
        collect.touch()

    for r in range(rounds):
        extra = [ask_for_a_collection()] if r == rounds // 2 else []
        await asyncio.gather(*(one(r * streams + i) for i in range(streams)), *extra)
    return gaps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the embedded model")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=400)
    args = ap.parse_args()
    model = Path(args.model) if args.model else default_model()
    gc.collect()
    gc.freeze()
    cpu = f"{cpu_name()} ({' '.join(cpu_isa())}, {os.cpu_count()} cores)"
    rows, out = [], {"cpu": cpu}
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "sitecustomize.py").write_text(SITE)
        for name, thawed in (("heap frozen (now)", False), ("not frozen (before)", True)):
            gc_log = Path(tmp, f"gc-{thawed}.log")
            collect = Path(tmp, f"collect-{thawed}")
            env = {"PYTHONPATH": os.pathsep.join([tmp, os.environ.get("PYTHONPATH", "")]),
                   "WKVM_BENCH_GC_LOG": str(gc_log), "WKVM_BENCH_COLLECT": str(collect),
                   **({"WKVM_BENCH_THAWED": "1"} if thawed else {})}  # fmt: skip
            proc, url = serve(model, 0, f"{tmp}/states-{thawed}", Path(tmp, "server.log"), env=env)
            try:
                served = openai.OpenAI(base_url=f"{url}/v1", api_key="unused").models.list().data[0].id
                t0 = time.time()
                gaps = asyncio.run(load(url, served, args.rounds, args.streams, args.tokens, collect))
                t1 = time.time()
            finally:
                stop(proc)  # (a server that stops thaws its heap: the collections after t1 do not count)
            logged = [x.split() for x in gc_log.read_text().split("\n") if x] if gc_log.exists() else []
            pauses = [float(d) for t, d in logged if t0 < float(t) < t1]
            out[name] = {"gaps_s": gaps, "full_collections_s": pauses}
            rows.append([name, len(gaps), *(f"{pct(gaps, q) * 1e3:.1f}" for q in (0.5, 0.99, 0.999, 1.0)),
                         len(pauses), f"{max(pauses, default=0) * 1e3:.0f}"])  # fmt: skip
    print_table(f"Gaps between streamed chunks, {args.rounds} x {args.streams} concurrent streams x {args.tokens} "
                f"tokens, `wkvm serve` single process; {cpu}",
                ["server", "gaps", "p50 ms", "p99 ms", "p99.9 ms", "max ms", "full GCs > 10 ms", "longest ms"],
                rows)  # fmt: skip
    print("wrote", write_json("stream_tail", out))


if __name__ == "__main__":
    main()
