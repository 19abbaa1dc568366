"""Weight streaming on the 0.1B shape: decode tok/s for resident weights, a partial cache (50% of layers) and
streaming with a 25% cache, with and without read-ahead, at B=1 and B=8, plus weight bytes read per token;
`--dtype int8|int4` streams the pack's quantized copy.
Files are read through the OS page cache (warm after the first sweep). The "cold" cases evict each streamed
layer's file pages from the OS cache right after reading it, as when the model does not fit in RAM, so every
sweep reads the disk. Writes bench/out/weight_streaming.{json,png}.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import OUT, checkpoint, machine, machine_line, plot, print_table, write_json  # noqa: E402

from wkvm.config import EngineConfig  # noqa: E402
from wkvm.engine.engine import Engine  # noqa: E402
from wkvm.models.rwkv7.tokenizer import WorldTokenizer  # noqa: E402
from wkvm.progress import progress  # noqa: E402
from wkvm.sampling_params import SamplingParams  # noqa: E402
from wkvm.weights.loader import (
    is_pack,  # noqa: E402
    load_model,  # noqa: E402
)
from wkvm.weights.pack import write_pack  # noqa: E402


def decode_rate(model, batch: int, steps: int) -> dict:
    """Aggregate tok/s, weight bytes read per generated token and the streaming counters per step, over `steps`
    decode steps."""
    engine = Engine(model, WorldTokenizer(), EngineConfig(n_slots=batch, token_budget=max(batch, 64)))
    for i in range(batch):
        engine.submit([1 + i], SamplingParams(max_tokens=steps + 3, temperature=0, ignore_eos=True))
    for _ in range(2):
        engine.step()
    stats = getattr(model.weights, "stats", None)
    before = asdict(stats) if stats else {}
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    dt = time.perf_counter() - t0
    delta = {k: (v - before[k]) / steps for k, v in asdict(stats).items()} if stats else {}
    engine.run_until_done()
    return {"tok_s": batch * steps / dt, "bytes_per_token": delta.get("bytes_read", 0) * steps / (batch * steps),
            "per_step": delta}  # fmt: skip


def evict_after_use(weights) -> None:
    """Every streamed layer leaves the OS page cache once copied: the next sweep reads it from disk."""
    layer = weights.layer

    def evicting(i):
        out = layer(i)
        weights.drop_from_os_cache(i)
        return out

    weights.layer = evicting


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--dtype", default="float32", help="float32, bfloat16, int8 or int4 (int8/int4 stream their own "
                    "quantized copy of the pack's layers)")  # fmt: skip
    args = ap.parse_args()
    pack = OUT / "rwkv7-0.1b-random.pack"
    if not is_pack(pack):
        write_pack(checkpoint(), pack)
    n_layer = 12
    cases = {
        "resident": dict(weight_cache_layers=0),
        "partial 50%": dict(weight_cache_layers=n_layer // 2, read_ahead=True),
        "stream 25% + read-ahead": dict(weight_cache_layers=n_layer // 4, read_ahead=True),
        "stream 25%, no read-ahead": dict(weight_cache_layers=n_layer // 4, read_ahead=False),
        "cold 25% + read-ahead": dict(weight_cache_layers=n_layer // 4, read_ahead=True),
        "cold 25%, no read-ahead": dict(weight_cache_layers=n_layer // 4, read_ahead=False),
    }
    results: dict[str, dict[int, dict]] = {}
    for name, kw in progress(cases.items(), "cases", len(cases)):
        model = load_model(pack, dtype=args.dtype, **kw)
        if name.startswith("cold"):
            evict_after_use(model.weights)
        batches = (8,) if name.startswith("cold") else (1, 8)
        if name == "resident":  # the process's first engine runs cold (1.49 tok/s at B=1 against ~60 later): one
            for b in batches:  # untimed run at each batch first, so that every case is timed warm
                decode_rate(model, b, args.steps)
        results[name] = {b: decode_rate(model, b, args.steps // 2 if name.startswith("cold") else args.steps)
                         for b in batches}  # fmt: skip
        if hasattr(model.weights, "close"):
            model.weights.close()
    rows = []
    for name, r in results.items():
        for b, m in r.items():
            c = m["per_step"]
            counters = [c.get(k, 0) for k in ("cache_hits", "cache_misses", "readahead_hits", "readahead_misses",
                                              "readahead_requests", "disk_reads")]  # fmt: skip
            rows.append([name, b, m["tok_s"], m["tok_s"] / results["resident"][b]["tok_s"],
                         m["bytes_per_token"] / 2**20, *counters])  # fmt: skip
    print(machine_line())
    print_table(f"Weight streaming, RWKV-7 0.1B shape {args.dtype} (pack read via the page cache); counters per step",
                ["case", "batch", "tok/s", "of resident", "MiB read/token", "hits", "misses", "ra hits", "ra misses",
                 "ra asks", "disk reads"], rows)  # fmt: skip
    ratio = results["stream 25% + read-ahead"][8]["tok_s"] / results["resident"][8]["tok_s"]
    print(f"streaming (25% cache, read-ahead) at B=8: {ratio:.0%} of resident (target >= 50%)")
    suffix = "" if args.dtype == "float32" else f"_{args.dtype}"
    cases_out = {n: {str(b): m for b, m in r.items()} for n, r in results.items()}
    write_json("weight_streaming" + suffix, {"machine": machine(), **cases_out})
    cold = results["cold 25% + read-ahead"][8]
    print(f"cold (every sweep from disk) at B=8: {cold['tok_s']:.1f} tok/s, "
          f"{cold['tok_s'] * cold['bytes_per_token'] / 2**20:.0f} MiB/s from disk")  # fmt: skip
    warm = {n: r for n, r in results.items() if not n.startswith("cold")}
    plot("weight_streaming" + suffix, [1, 8], {n: [r[b]["tok_s"] for b in (1, 8)] for n, r in warm.items()}, "batch",
         "tok/s", "Weight streaming, 0.1B shape")  # fmt: skip


if __name__ == "__main__":
    main()
