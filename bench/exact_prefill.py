"""What stepping's bits cost in prefill: the engine's 1,024-token prefill with a prompt's chunks computed as steps
(`rows_alone`: the recurrent layers' `steps` kernels, attention a token at a time) against the faster forms that agree
with stepping only to rounding (the chunked scans, SDPA over the chunk), in the same process, alternating.

Random checkpoints of the other benches' shapes (Mamba2 130m, GDN 0.1B, the Qwen3.5 and Bamba hybrids 0.1B) and
SmolLM2-135M where models/ holds its GGUF; int8 weights by default (where the exact path matters: int8 amplifies a
last-bit difference into ~0.06 nats a token). Prints seconds to the first token, the ratio, and the CPU and its ISA.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import machine_line, print_table, write_json  # noqa: E402

from wkvm.config import EngineConfig  # noqa: E402
from wkvm.engine.engine import Engine  # noqa: E402
from wkvm.models.rwkv7.tokenizer import WorldTokenizer  # noqa: E402
from wkvm.sampling_params import SamplingParams  # noqa: E402
from wkvm.weights.loader import load_model  # noqa: E402

SMOLLM2 = Path(__file__).parent.parent / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def checkpoints() -> dict[str, Path]:
    import gdn_speed
    import hybrid_speed
    import mamba2_speed

    found = {"Mamba2 130m": mamba2_speed.checkpoint(), "GDN 0.1B": gdn_speed.checkpoint(),
             "Qwen3.5 hybrid 0.1B": hybrid_speed.checkpoint("qwen3_5"), "Bamba 0.1B": hybrid_speed.checkpoint("bamba")}
    if SMOLLM2.exists():
        found["SmolLM2-135M"] = SMOLLM2
    return found  # fmt: skip


def prefill_seconds(model, ids: list[int], chunk: int) -> float:
    """Seconds from submitting `ids` to the first token, on a fresh engine (the server's step budget and chunk)."""
    eng = Engine(model, WorldTokenizer(), EngineConfig(n_slots=1, token_budget=chunk, prefill_chunk=chunk))
    started = time.perf_counter()
    handle = eng.submit(ids, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    eng.run_until_done()
    assert handle.output.token_ids
    return time.perf_counter() - started


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dtype", default="int8", choices=["int8", "int4", "float32"])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=EngineConfig.prefill_chunk, help="prefill chunk and step budget")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    rows, results = [], {}
    for name, path in checkpoints().items():
        model = load_model(path, dtype=args.dtype)
        ids = torch.randint(3, min(model.vocab_size, 49152), (args.tokens,)).tolist()
        exact = model.rows_alone(min(args.chunk, args.tokens))
        if not exact:
            print(f"{name}: no stepping's bits for {args.chunk}-token chunks here ({args.dtype}): skipped")
            continue
        steps, other = [], []
        prefill_seconds(model, ids[:64], args.chunk)  # untimed: builds and warms the kernels
        for _ in range(args.rounds):
            steps.append(prefill_seconds(model, ids, args.chunk))
            model.rows_alone = lambda rows: False  # the instance's answer shadows the method: the faster forms
            other.append(prefill_seconds(model, ids, args.chunk))
            del model.rows_alone
        s, o = min(steps), min(other)
        rows.append([name, s, o, s / o])
        results[name] = {"steps_s": steps, "faster_forms_s": other}
    print(machine_line())
    print_table(f"Prefill of {args.tokens} tokens to the first token, {args.dtype}, chunks of {args.chunk} "
                f"(best of {args.rounds}, alternating)", ["model", "stepping's bits s", "faster forms s", "ratio"],
                rows)  # fmt: skip
    write_json(f"exact_prefill_{args.dtype}", {"machine": machine_line(), "results": results})


if __name__ == "__main__":
    main()
