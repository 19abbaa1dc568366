"""Engine decode with the resident weights' small tensors gathered into one huge-page block (how wkvm loads them,
`wkvm/weights/arena.py`) against each in an allocation of its own (how it loaded them before), in one process.

Each model is loaded twice, the second time with the gathering switched off; the two copies' engines then decode
alternately (one stream, and 8 streams batched), so the machine's noise hits both alike. Prints tok/s, the paired
ratios and the machine. Models: SmolLM2-135M-Instruct's Q4_1 GGUF (`make smollm2`; skipped without it) in int8 and
int4, and the RWKV-7 0.1B shape (random weights) in int8.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import checkpoint, decode_engine, engine_decode_tok_s, machine, machine_line, print_table, write_json  # noqa: E402,I001

import wkvm.weights.loader as loader  # noqa: E402
from wkvm.config import kv_dtype_for  # noqa: E402
from wkvm.weights.loader import load_model, load_text_tools  # noqa: E402

GGUF = Path(__file__).resolve().parent.parent / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def load_apart(path: Path, dtype: str):
    """The model as loaded before the gathering: every tensor in an allocation of its own."""
    gather = loader.gather_small
    loader.gather_small = lambda parts: 0
    try:
        return load_model(path, dtype=dtype)
    finally:
        loader.gather_small = gather


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=7, help="alternating rounds (each runs every case on both copies)")
    ap.add_argument("--steps", type=int, default=48, help="decode steps timed a run")
    args = ap.parse_args()
    cases = [(GGUF, "int8"), (GGUF, "int4")] if GGUF.is_file() else []
    if not cases:
        print(f"{GGUF} is missing (`make smollm2`): SmolLM2 skipped")
    cases.append((checkpoint(), "int8"))
    prompt = torch.randint(0, 30000, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    rows, out = [], {}
    print(machine_line())
    for path, dtype in cases:
        copies = {"one block": load_model(path, dtype=dtype), "apart": load_apart(path, dtype)}
        tokenizer = load_text_tools(path, copies["one block"].family)[0]
        kv = kv_dtype_for("auto", dtype)
        engines = {(name, b): decode_engine(m, tokenizer, b, kv) for name, m in copies.items() for b in (1, 8)}
        rates: dict[tuple[str, int], list[float]] = {key: [] for key in engines}
        for _ in range(args.rounds + 1):  # the first round warms every engine's pages up, untimed
            for (name, b), engine in engines.items():
                rate = engine_decode_tok_s(copies[name], tokenizer, b, args.steps, lambda i: prompt[i : i + 32],
                                           engine=engine)  # fmt: skip
                rates[(name, b)].append(rate)
        label = f"{path.name} {dtype}"
        for b in (1, 8):
            one, apart = rates[("one block", b)][1:], rates[("apart", b)][1:]
            ratio = statistics.median(x / y for x, y in zip(one, apart, strict=True))
            rows.append([label, b, statistics.median(apart), statistics.median(one), ratio])
            out[f"{label} B={b}"] = {"apart": statistics.median(apart), "one_block": statistics.median(one),
                                     "paired_ratio": ratio}  # fmt: skip
        del copies, engines
    print_table(f"engine decode, tok/s (median of {args.rounds} alternating rounds)",
                ["model", "rows", "apart", "one block", "paired ratio"], rows)  # fmt: skip
    write_json("weight_arena", {**machine(), "cases": out})


if __name__ == "__main__":
    main()
