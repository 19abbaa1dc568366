"""int8 and int4 weights vs fp32 and bf16, in one process with interleaved repetitions (medians; ratios over fp32).

Kernels: shapes of SmolLM2-135M (576 wide, 1,536 MLP, tied 49,152 head) and RWKV-7 0.1B (768 wide, 3,072 FFN,
65,536 head) at M = 1 and 8 rows (--rows); fp32 and bf16 are wkvm's prepacked oneDNN linears ("fp32 wkvm": what
wkvm's fp32 linear runs, its fp32 kernel on the same packed weights up to fp32gemv.ROWS rows), int8 and int4 the
native kernels on this CPU's best ISA and on AVX2, and int4 dequantized + oneDNN (what prefill without VNNI runs).
`--e2e`: whole models (SmolLM2 from `make smollm2` when present, the random RWKV-7 0.1B shape), decode B=1 and B=8
(model steps, no engine) and a prefill (--prefill-tokens), each dtype loaded once and the four run in turn. The
machine's load average (`uptime`) is printed next to the figures: on a shared machine absolute times move a lot, the
same-round ratios much less.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import checkpoint, cpu_name, print_table, write_json  # noqa: E402

from wkvm.models import int4, int8  # noqa: E402
from wkvm.models.linear import cpu_isa, linear, pack_linear  # noqa: E402
from wkvm.weights.loader import load_model  # noqa: E402

GGUF = Path(__file__).resolve().parent.parent / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = ("float32", "bfloat16", "int8", "int4")

SHAPES = {
    "smollm2 qkv 960x576": (960, 576), "smollm2 o 576x576": (576, 576), "smollm2 gate_up 3072x576": (3072, 576),
    "smollm2 down 576x1536": (576, 1536), "smollm2 head 49152x576": (49152, 576),
    "rwkv7 768x768": (768, 768), "rwkv7 ffn key 3072x768": (3072, 768), "rwkv7 ffn value 768x3072": (768, 3072),
    "rwkv7 head 65536x768": (65536, 768),
}  # fmt: skip


def load() -> str:
    return os.getloadavg()[0].__format__(".2f")


def interleaved(fns: dict[str, Callable[[], object]], repeat: int, budget: float) -> dict[str, float]:
    """Median seconds per call of each fn; a round runs every fn (each for ~`budget` s), rounds repeat."""
    calls = {}
    for name, fn in fns.items():
        fn()
        t0 = time.perf_counter()
        fn()
        calls[name] = max(1, int(budget / max(time.perf_counter() - t0, 1e-7)))  # budget 0: one call a sample
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(calls[name]):
                fn()
            times[name].append((time.perf_counter() - t0) / calls[name])
    return {name: statistics.median(t) for name, t in times.items()}


def end_to_end(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """tok/s per model, case and dtype."""
    models = ([("SmolLM2-135M", GGUF)] if GGUF.exists() else []) + [("RWKV-7 0.1B shape", checkpoint())]
    rows, out = [], {}
    for name, path in models:
        loaded = {d: load_model(path, dtype=d) for d in DTYPES}
        vocab = loaded["float32"].vocab_size
        prompt = torch.randint(0, vocab, (args.prefill_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
        n = args.decode_tokens

        def decode(model, batch, prompt=prompt, n=n):
            def run():
                state = model.prefill(prompt[:16])[1] if batch == 1 else model.new_state(batch)
                for t in prompt[16 : 16 + n]:
                    model.decode([t] * batch, state)

            return run

        cases = {"decode B=1": (decode, 1, n), "decode B=8": (decode, 8, 8 * n),
                 f"prefill {len(prompt)}": (None, 0, len(prompt))}  # fmt: skip
        for case, (make, batch, tokens) in cases.items():
            fns: dict[str, Callable[[], object]] = {
                d: make(m, batch) if make else (lambda m=m, p=prompt: m.prefill(p)) for d, m in loaded.items()
            }
            t = interleaved(fns, args.e2e_repeat, 0.0)
            tok_s = {d: tokens / t[d] for d in DTYPES}
            out[f"{name} {case}"] = tok_s
            rows.append([name, case] + [f"{tok_s[d]:.1f}" for d in DTYPES]
                        + [f"{tok_s[d] / tok_s['float32']:.2f}" for d in DTYPES[1:]]
                        + [f"{tok_s['int4'] / tok_s['int8']:.2f}", load()])  # fmt: skip
        del loaded
    header = ["model", "case"] + [f"{d} tok/s" for d in DTYPES] + [f"{d} x fp32" for d in DTYPES[1:]]
    header += ["int4 x int8", "load"]
    print_table("End to end (model steps; dtypes interleaved in one process)", header, rows)
    return out


def onednn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """oneDNN's packed fp32 matmul at every size (what wkvm ran before its fp32 kernel; the ratios' base)."""
    y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    return y


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", default="1,8", help="M values (comma-separated)")
    ap.add_argument("--shapes", default="", help="substring filter on the shape names")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--budget", type=float, default=0.02, help="seconds per timed sample")
    ap.add_argument("--e2e", action="store_true", help="also whole models: decode B=1, B=8 and a prefill")
    ap.add_argument("--e2e-only", action="store_true", help="only the whole models")
    ap.add_argument("--e2e-repeat", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=16, help="at most --prefill-tokens - 16 (decoded from "
                    "that prompt after its first 16)")  # fmt: skip
    ap.add_argument("--prefill-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.decode_tokens > args.prefill_tokens - 16:  # decode walks the prompt after 16: no more than it holds
        ap.error(f"--decode-tokens {args.decode_tokens} exceeds --prefill-tokens {args.prefill_tokens} - 16")
    if not args.e2e_only and not any(args.shapes in s for s in SHAPES):
        ap.error(f"--shapes {args.shapes!r} matches none of: {', '.join(SHAPES)}")
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.e2e_only:
        print(f"CPU {cpu_name()}, ISA {', '.join(cpu_isa())}, int8 kernel {int8.kernel_path()}, int4 kernel "
              f"{int4.kernel_path()}, {torch.get_num_threads()} threads, load {load()}")  # fmt: skip
        write_json("int8_speed_e2e", {"cpu": cpu_name(), "isa": cpu_isa(), "threads": torch.get_num_threads(),
                                      "int8_kernel": int8.kernel_path(), "int4_kernel": int4.kernel_path(),
                                      "tok_s": end_to_end(args)})  # fmt: skip
        return
    best = int8.kernel_path()
    paths = [p for p in (best, "avx2") if p != "torch"] + (["torch"] if best == "torch" else [])
    paths = list(dict.fromkeys(paths))
    rows, out = [], {}
    best4 = int4.kernel_path()
    paths4 = list(dict.fromkeys([p for p in (best4, "avx2") if p != "torch"]))
    print(f"CPU {cpu_name()}, ISA {', '.join(cpu_isa())}, int8 kernel {best}, int4 kernel {best4}, "
          f"{torch.get_num_threads()} threads, load {load()}")  # fmt: skip
    for shape_name, (n, k) in SHAPES.items():
        if args.shapes not in shape_name:
            continue
        w = torch.randn(n, k) / k**0.5
        w32, w16, q, q4 = pack_linear(w), pack_linear(w.bfloat16()), int8.quantize(w), int4.quantize(w)
        for m in (int(v) for v in args.rows.split(",")):
            x = torch.randn(m, k)
            fns: dict[str, Callable[[], object]] = {  # fp32: oneDNN; fp32 wkvm: the fp32 kernel up to its rows
                "fp32": lambda x=x, w=w32: onednn(x, w),
                "fp32 wkvm": lambda x=x, w=w32: linear(x, w),
                "bf16": lambda x=x, w=w16: linear(x, w),
            }
            for p in paths:
                fns[f"int8 {p}"] = lambda p=p, x=x, q=q: int8.linear(x, q, p)
            for p in paths4:
                fns[f"int4 {p}"] = lambda p=p, x=x, q=q4: torch.ops.wkvm_int4.linear(x, q, int4.ISAS.index(p))
            if paths4:
                fns["int4 dequant"] = lambda x=x, q=q4: linear(x, torch.ops.wkvm_int4.dequantize(q))
            t = interleaved(fns, args.repeat, args.budget)
            row = [shape_name, m, f"{t['fp32'] * 1e6:.0f}"] + [f"{t['fp32'] / t[f]:.2f}" for f in fns if f != "fp32"]
            rows.append(row + [load()])
            out[f"{shape_name} M={m}"] = {f: t[f] for f in fns}
    header = ["shape", "M", "fp32 us"] + [f"x fp32: {f}" for f in fns if f != "fp32"] + ["load"]
    print_table("int8 / int4 kernels vs fp32 / bf16 oneDNN (above 1: faster than fp32)", header, rows)
    e2e = end_to_end(args) if args.e2e else {}
    write_json("int8_speed", {"cpu": cpu_name(), "isa": cpu_isa(), "threads": torch.get_num_threads(),
                              "int8_kernel": best, "int4_kernel": best4,
                              "seconds_per_call": out, "e2e_tok_s": e2e})  # fmt: skip


if __name__ == "__main__":
    main()
