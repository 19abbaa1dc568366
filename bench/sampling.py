"""Cost of sampling: engine decode tok/s with chat-style sampling parameters over greedy's, at 1 and 8 requests, in
the same process (rounds alternate greedy and sampled, so machine noise hits both alike; ratio = median of the
rounds' own ratios). Models: SmolLM2-135M-Instruct int8 (vocabulary 49,152; when `make smollm2` has fetched it) and
the RWKV-7 0.1B random shape fp32 (World vocabulary 65,536). Writes bench/out/sampling.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import checkpoint, cpu_name, engine_decode_tok_s, print_table, write_json  # noqa: E402

from wkvm.config import weight_dtype  # noqa: E402
from wkvm.weights.loader import load_model, load_text_tools  # noqa: E402

SMOLLM2 = Path(__file__).resolve().parent.parent / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
SETTINGS = {  # what chat clients send (Open WebUI, the OpenAI SDK's examples, Ollama-style repeat penalty)
    "temperature 0.7": {"temperature": 0.7},
    "temperature 0.7, top_p 0.9": {"temperature": 0.7, "top_p": 0.9},
    "temperature 0.8, top_k 40, top_p 0.95, min_p 0.05": {"temperature": 0.8, "top_k": 40, "top_p": 0.95,
                                                           "min_p": 0.05},
    "temperature 0.7, frequency 0.5, repetition 1.1": {"temperature": 0.7, "frequency_penalty": 0.5,
                                                        "repetition_penalty": 1.1},
}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed per run")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    models = []
    if SMOLLM2.is_file():
        models.append(("SmolLM2-135M int8", load_model(SMOLLM2, dtype=weight_dtype("int8")),
                       load_text_tools(SMOLLM2, "llama")[0]))  # fmt: skip
    else:
        print(f"{SMOLLM2} is missing (`make smollm2`): RWKV-7 only")
    path = checkpoint()
    models.append(("RWKV-7 0.1B fp32", load_model(path), load_text_tools(path, "rwkv7")[0]))
    rows, out = [], {}
    for name, model, tokenizer in models:
        ids = torch.randint(0, model.vocab_size, (64,), generator=torch.Generator().manual_seed(0)).tolist()

        def prompt(i: int, ids: list[int] = ids) -> list[int]:
            return ids[i : i + 32]

        for setting, fields in SETTINGS.items():
            for batch in (1, 8):
                ratios, rates = [], []
                for r in range(args.rounds):
                    pair = {}
                    for kind in ("greedy", "sampled") if r % 2 == 0 else ("sampled", "greedy"):
                        pair[kind] = engine_decode_tok_s(model, tokenizer, batch, args.steps,
                                                         prompt,
                                                         sampling=fields if kind == "sampled" else None)  # fmt: skip
                    ratios.append(pair["sampled"] / pair["greedy"])
                    rates.append(pair["sampled"])
                ratio = statistics.median(ratios)
                spread = f"{min(ratios):.2f}-{max(ratios):.2f}"
                rows.append([name, setting, batch, statistics.median(rates), ratio, spread])
                out[f"{name} | {setting} | B={batch}"] = {"sampled_tok_s": statistics.median(rates),
                                                          "ratio_to_greedy": ratio, "round_ratios": ratios}  # fmt: skip
    print(f"CPU: {cpu_name()}; torch ISA {torch.backends.cpu.get_cpu_capability()}; {torch.get_num_threads()} threads")
    print_table("Sampled decode over greedy (engine, same process, alternating rounds)",
                ["model", "sampling", "requests", "sampled tok/s", "x greedy", "rounds' range"], rows)  # fmt: skip
    write_json("sampling", {"cpu": cpu_name(), "rows": out})


if __name__ == "__main__":
    main()
