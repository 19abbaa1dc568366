"""Aggregate decode tok/s through the engine at B = 1, 4, 16, 32, 64 (0.1B shape, fp32 CPU),
against BlinkDL's `rwkv` package at B=1 in the same run. Writes bench/out/batch_decode.{json,png}.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import (  # noqa: E402
    checkpoint,
    engine_decode_tok_s,
    machine,
    machine_line,
    plot,
    print_table,
    rwkv_reference,
    timeit,
    write_json,
)

from wkvm.models.rwkv7.tokenizer import WorldTokenizer  # noqa: E402
from wkvm.progress import progress  # noqa: E402
from wkvm.weights.loader import load_model  # noqa: E402


def engine_tok_s(model, batch: int, steps: int) -> float:
    return engine_decode_tok_s(model, WorldTokenizer(), batch, steps, lambda i: [1 + i])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batches", default="1,4,16,32,64")
    ap.add_argument("--steps", type=int, default=16)
    args = ap.parse_args()
    RWKV = rwkv_reference()
    path = checkpoint()
    model = load_model(path)
    ref = RWKV(str(path).removesuffix(".pth"), "cpu fp32")
    tokens = torch.randint(0, 65536, (args.steps,)).tolist()

    def ref_decode():
        state = None
        for t in tokens:
            _, state = ref.forward([t], state)

    ref_tok_s = args.steps / timeit(ref_decode, repeat=3)
    batches = [int(b) for b in args.batches.split(",")]
    engine_tok_s(model, batches[0], args.steps)  # untimed: the process's first engine runs cold
    results = {b: engine_tok_s(model, b, args.steps) for b in progress(batches, "batch sizes")}
    rows = [[b, results[b], ref_tok_s, results[b] / ref_tok_s] for b in batches]
    print(machine_line())
    print_table(
        "Aggregate decode tok/s, RWKV-7 0.1B shape fp32",
        ["batch", "wkvm tok/s", "rwkv B=1 tok/s", "x rwkv"],
        rows,
    )
    write_json("batch_decode", {**machine(), "rwkv_b1_tok_s": ref_tok_s,
                                "wkvm_tok_s": {str(b): v for b, v in results.items()}})  # fmt: skip
    series = {"wkvm (engine)": [results[b] for b in batches], "rwkv package B=1": [ref_tok_s] * len(batches)}
    plot("batch_decode", batches, series, "batch size", "aggregate decode tok/s", "RWKV-7 0.1B shape, fp32 CPU")


if __name__ == "__main__":
    main()
