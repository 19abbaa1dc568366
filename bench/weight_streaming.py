"""Weight streaming on the 0.1B shape: decode tok/s for resident weights, a partial cache (50% of layers) and
streaming with a 25% cache, with and without read-ahead, at B=1 and B=8, plus weight bytes read per token.
Files are read through the OS page cache (warm after the first sweep). The "cold" cases evict each streamed
layer's file pages from the OS cache right after reading it, as when the model does not fit in RAM, so every
sweep reads the disk. Writes bench/out/weight_streaming.{json,png}.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import OUT, checkpoint, plot, print_table, write_json  # noqa: E402

from wkvm.config import EngineConfig  # noqa: E402
from wkvm.engine.engine import Engine  # noqa: E402
from wkvm.models.loader import load_model  # noqa: E402
from wkvm.progress import progress  # noqa: E402
from wkvm.sampling_params import SamplingParams  # noqa: E402
from wkvm.tokenizer import WorldTokenizer  # noqa: E402
from wkvm.weights.pack import is_pack, write_pack  # noqa: E402


def decode_rate(model, batch: int, steps: int) -> tuple[float, float]:
    """(aggregate tok/s, weight bytes read per generated token) over `steps` decode steps."""
    engine = Engine(model, WorldTokenizer(), EngineConfig(n_slots=batch, token_budget=max(batch, 64)))
    for i in range(batch):
        engine.submit([1 + i], SamplingParams(max_tokens=steps + 3, temperature=0, ignore_eos=True))
    for _ in range(2):
        engine.step()
    stats = getattr(model.weights, "stats", None)
    read0 = stats.bytes_read if stats else 0
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    dt = time.perf_counter() - t0
    engine.run_until_done()
    read = (stats.bytes_read - read0) if stats else 0
    return batch * steps / dt, read / (batch * steps)


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
    results: dict[str, dict[int, tuple[float, float]]] = {}
    for name, kw in progress(cases.items(), "cases", len(cases)):
        model = load_model(pack, **kw)
        if name.startswith("cold"):
            evict_after_use(model.weights)
        batches = (8,) if name.startswith("cold") else (1, 8)
        results[name] = {b: decode_rate(model, b, args.steps // 2 if name.startswith("cold") else args.steps)
                         for b in batches}  # fmt: skip
        if hasattr(model.weights, "close"):
            model.weights.close()
    rows = []
    for name, r in results.items():
        for b, (tok_s, bpt) in r.items():
            rows.append([name, b, tok_s, tok_s / results["resident"][b][0], bpt / 2**20])
    print_table("Weight streaming, RWKV-7 0.1B shape fp32 (pack read through the page cache)",
                ["case", "batch", "tok/s", "of resident", "MiB read/token"], rows)  # fmt: skip
    ratio = results["stream 25% + read-ahead"][8][0] / results["resident"][8][0]
    print(f"streaming (25% cache, read-ahead) at B=8: {ratio:.0%} of resident (target >= 50%)")
    write_json("weight_streaming", {n: {str(b): {"tok_s": v[0], "bytes_per_token": v[1]} for b, v in r.items()}
                                     for n, r in results.items()})  # fmt: skip
    cold = results["cold 25% + read-ahead"][8]
    print(f"cold (every sweep from disk) at B=8: {cold[0]:.1f} tok/s, {cold[0] * cold[1] / 2**20:.0f} MiB/s from disk")
    warm = {n: r for n, r in results.items() if not n.startswith("cold")}
    plot("weight_streaming", [1, 8], {n: [r[b][0] for b in (1, 8)] for n, r in warm.items()}, "batch", "tok/s",
         "Weight streaming, 0.1B shape")  # fmt: skip


if __name__ == "__main__":
    main()
