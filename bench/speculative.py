"""Speculative decoding by prompt lookup (`--speculative-tokens`): decode speed with drafts against without, in one
process, on tasks that copy from their prompt, one that does not, and the three at once (a batch).

Two engines on the same loaded model (drafts off, drafts on) answer each task alternately, round after round, so the
machine's noise hits both alike; a round's ratio is its two decode rates' (tokens after the first over the time
from the first token to the last: the prompt's prefill is the same for both and left out). Prints the median of the
rounds' ratios, the drafts accepted, and whether the two answers were the same (they must be: drafts never change
an answer). Models: SmolLM2-135M-Instruct's Q4_1 GGUF (`make smollm2`; skipped without it) in int8, and the embedded
RWKV-7 model (float32, trained on Shakespeare: the quote task only, as it does not follow instructions).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, machine_line, print_table, write_json  # noqa: E402

from wkvm import LLM, SamplingParams  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
GGUF = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT = (ROOT / "data" / "tinyshakespeare.txt").read_text()
CODE = (ROOT / "wkvm" / "engine" / "drafts.py").read_text()


def chat_tasks() -> dict[str, str]:
    """Chat questions: two that copy from the prompt (editing code, quoting a passage), one that does not."""
    return {
        "edit code": "Rewrite this Python code, renaming the class NgramDrafter to LookupDrafter. Output the whole "
                     "code.\n\n" + CODE,
        "quote a passage": "Here is a passage:\n\n" + TEXT[3000:4200] + "\n\nCopy the passage's first speech word "
                           "for word.",
        "free writing": "Write a short story about a lighthouse keeper.",
    }  # fmt: skip


def decode_rate(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, list[list[int]]]:
    """(tokens after each one's first a second, all of them; the tokens) for requests run together on `llm`'s engine,
    timed from when each has its first token."""
    engine = llm.engine
    handles = [engine.submit(ids, params) for ids in prompts]
    while not all(h.output.token_ids or h.output.finished for h in handles):
        engine.step()
    first, t0 = sum(len(h.output.token_ids) for h in handles), time.perf_counter()
    while not all(h.output.finished for h in handles):
        engine.step()
    dt = time.perf_counter() - t0
    return (sum(len(h.output.token_ids) for h in handles) - first) / dt, [list(h.output.token_ids) for h in handles]


def compare(name: str, plain: LLM, fast: LLM, prompts: dict[str, list[list[int]]], params: SamplingParams,
            rounds: int) -> list[list[object]]:  # fmt: skip
    """A row per task (one prompt, or several run together) of the two engines' decode rates."""
    rows = []
    for task, ids in prompts.items():
        rates: dict[str, list[float]] = {"off": [], "on": []}
        ratios, same = [], True
        runner = fast.engine.runner
        drafted, accepted = runner.drafted, runner.accepted
        for _ in range(rounds):
            off, want = decode_rate(plain, ids, params)
            on, got = decode_rate(fast, ids, params)
            rates["off"].append(off)
            rates["on"].append(on)
            ratios.append(on / off)
            same = same and got == want
        n_drafted, n_accepted = runner.drafted - drafted, runner.accepted - accepted
        rows.append([name, task, sum(map(len, ids)), sum(map(len, want)), statistics.median(rates["off"]),
                     statistics.median(rates["on"]),
                     statistics.median(ratios), f"{min(ratios):.2f}-{max(ratios):.2f}",
                     f"{n_accepted / rounds:.0f} of {n_drafted / rounds:.0f}", "yes" if same else "NO"])  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=200, help="tokens generated per answer (greedy)")
    ap.add_argument("--speculative-tokens", type=int, default=7)
    ap.add_argument("--prompt-lookup-min", type=int, default=2)
    args = ap.parse_args()
    spec = {"speculative_tokens": args.speculative_tokens, "prompt_lookup_min": args.prompt_lookup_min}
    params = SamplingParams(max_tokens=args.tokens, temperature=0)
    rows: list[list[object]] = []
    if GGUF.exists():
        plain = LLM(str(GGUF), dtype="int8", speculative_tokens=0)
        fast = LLM(str(GGUF), dtype="int8", **spec)
        template = plain.template
        prompts = {task: [plain.tokenizer.encode(template.render([{"role": "user", "content": q}], True))]
                   for task, q in chat_tasks().items()}  # fmt: skip
        prompts["all three at once"] = [p for ps in prompts.values() for p in ps]  # batched: each its own drafts
        rows += compare("SmolLM2-135M int8", plain, fast, prompts, params, args.rounds)
    else:
        print(f"SmolLM2 skipped: {GGUF} is missing (make smollm2)")
    plain, fast = LLM(speculative_tokens=0), LLM(**spec)
    quote = TEXT[5000:5900] + "\n\n" + TEXT[5000:5060]  # the passage again from its start: the model goes on copying
    rows += compare("embedded RWKV-7 fp32", plain, fast, {"quote a passage": [plain.tokenizer.encode(quote)]},
                    SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True), args.rounds)  # fmt: skip
    print(machine_line())
    print_table(f"Decode with prompt-lookup drafts (--speculative-tokens {args.speculative_tokens}, "
                f"n-grams {args.prompt_lookup_min}-4) vs without, greedy, {args.rounds} alternating rounds",
                ["model", "task", "prompt tokens", "answer tokens", "off tok/s", "on tok/s", "ratio (median)",
                 "range", "accepted of drafted", "same answer"], rows)  # fmt: skip
    path = write_json("speculative", {"machine": machine(), "args": vars(args), "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
