"""Per-token cost of response_format masking: engine decode step time at B=1 and B=8, constrained vs free, in the
same process (RWKV-7 0.1B random shape, World vocab 65,536, fp32 CPU). Every request samples at temperature 1 with a
seed, so the two runs differ only in the grammar mask. A random model mostly writes one endless JSON string, the
common case of a long constrained reply. Writes bench/out/constrained.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import checkpoint, cpu_name, print_table, write_json  # noqa: E402

from wkvm.config import EngineConfig  # noqa: E402
from wkvm.engine.engine import Engine  # noqa: E402
from wkvm.models.family import LanguageModel  # noqa: E402
from wkvm.models.rwkv7.tokenizer import WorldTokenizer  # noqa: E402
from wkvm.sampling_params import SamplingParams  # noqa: E402
from wkvm.weights.loader import load_model  # noqa: E402

SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "bench", "schema": SCHEMA}}


def step_ms(model: LanguageModel, tok: WorldTokenizer, batch: int, constrained: int, steps: int) -> float:
    """Median ms per decode step with `batch` requests, the first `constrained` of them under JSON_SCHEMA."""
    engine = Engine(model, tok, EngineConfig(n_slots=batch, token_budget=max(batch, 64)))
    for i in range(batch):
        fmt = JSON_SCHEMA if i < constrained else None
        params = SamplingParams(max_tokens=steps + 4, temperature=1.0, seed=i, ignore_eos=True, response_format=fmt)
        engine.submit([1 + i], params)
    engine.step()  # prefill and first token; the first constrained request also builds the grammar's vocabulary
    engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    running = len(engine.scheduler.running)
    engine.run_until_done()
    if running != batch:
        raise RuntimeError(f"only {running} of {batch} requests were still running: raise --steps' headroom")
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    model, tok = load_model(checkpoint()), WorldTokenizer()
    cases = [(1, 0), (1, 1), (8, 0), (8, 1), (8, 8)]
    ms: dict[tuple[int, int], list[float]] = {c: [] for c in cases}
    # untimed: the process's first engine runs cold (with --repeat 1 the free B=1 case came out slower than the
    # constrained one), and the first grammar builds its vocabulary; each batch size once, constrained
    for batch in (1, 8):
        step_ms(model, tok, batch, batch, args.steps)
    for _ in range(args.repeat):  # alternate the cases so machine noise hits them alike
        for batch, constrained in cases:
            ms[(batch, constrained)].append(step_ms(model, tok, batch, constrained, args.steps))
    med = {c: statistics.median(v) for c, v in ms.items()}
    rows = []
    for batch, constrained in cases:
        free = med[(batch, 0)]
        extra_per_row = (med[(batch, constrained)] - free) / constrained if constrained else 0.0
        rows.append([batch, constrained, med[(batch, constrained)], med[(batch, constrained)] / free, extra_per_row])
    isa = torch.backends.cpu.get_cpu_capability()
    print_table(
        f"Decode step, RWKV-7 0.1B shape fp32, vocab 65,536, {cpu_name()} ({isa}), {torch.get_num_threads()} threads",
        ["batch", "constrained", "ms/step", "x free", "extra ms per constrained row"],
        rows,
    )
    per_step = {f"B{b}-constrained{c}": v for (b, c), v in med.items()}
    write_json("constrained", {"cpu": cpu_name(), "isa": isa, "threads": torch.get_num_threads(), "ms": per_step})


if __name__ == "__main__":
    main()
