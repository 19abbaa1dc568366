"""Mamba2 130m shape, fp32 CPU: decode (B=1), 1,024-token prefill and engine decode at B=32, wkvm vs transformers.

transformers runs `Mamba2ForCausalLM` on its torch path (no CUDA kernels on CPU): `generate` for B=1 decode and one
forward for prefill. Prints tok/s, the ratios, the CPU and its ISA, the decode floor (weight bytes per token over
measured read bandwidth) and the prefill ceiling (2 x layer parameters FLOPs per token over the best matmul rate).
The random checkpoint is written once under bench/out/.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from batch_decode import engine_tok_s  # noqa: E402
from common import (  # noqa: E402
    OUT,
    cpu_name,
    decode_and_read,
    matmul_rate,
    print_table,
    timeit_pair,
    write_json,
)

from wkvm.models.linear import weight_numel  # noqa: E402
from wkvm.weights.loader import load_model  # noqa: E402

SHAPE_130M = {"hidden_size": 768, "num_hidden_layers": 24, "expand": 2, "head_dim": 64, "num_heads": 24,
              "state_size": 128, "n_groups": 1, "conv_kernel": 4, "vocab_size": 50288,
              "tie_word_embeddings": True}  # fmt: skip


def checkpoint() -> Path:
    path = OUT / "mamba2-130m-random"
    if not (path / "config.json").exists():
        from transformers import Mamba2Config, Mamba2ForCausalLM

        torch.manual_seed(0)
        Mamba2ForCausalLM(Mamba2Config(**SHAPE_130M)).save_pretrained(path)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--decode-tokens", type=int, default=32, help="at most --prefill-tokens - 8 (decoded from "
                    "that prompt after its first 8)")  # fmt: skip
    ap.add_argument("--prefill-tokens", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--batch-steps", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default); on a shared machine "
                    "1 avoids OpenMP threads waiting on each other")  # fmt: skip
    args = ap.parse_args()
    if args.decode_tokens > args.prefill_tokens - 8:  # wkvm's decode walks the prompt after 8: no more than it holds
        ap.error(f"--decode-tokens {args.decode_tokens} exceeds --prefill-tokens {args.prefill_tokens} - 8")
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import Mamba2ForCausalLM

    path = checkpoint()
    model = load_model(path)
    ref = Mamba2ForCausalLM.from_pretrained(path).eval()
    cfg = model.config
    prompt = torch.randint(0, cfg.vocab_size, (args.prefill_tokens,), generator=torch.Generator().manual_seed(0))
    n = args.decode_tokens

    def wkvm_decode():
        state = model.prefill(prompt[:8])[1]
        for t in prompt[8 : 8 + n].tolist():
            model.decode([t], state)

    @torch.no_grad()
    def ref_generate():
        ref.generate(prompt[:8].reshape(1, -1), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)

    @torch.no_grad()
    def ref_prefill():
        ref(prompt.reshape(1, -1), use_cache=False, logits_to_keep=1)  # the last position, as wkvm (bench review)

    t_dec, r_dec = timeit_pair(wkvm_decode, ref_generate, args.repeat)
    t_pre, r_pre = timeit_pair(lambda: model.prefill(prompt), ref_prefill, args.repeat)
    t0 = time.perf_counter()
    batch_tok_s = engine_tok_s(model, args.batch, args.batch_steps)
    t_batch = time.perf_counter() - t0

    layer_params = sum(weight_numel(t) for i in range(cfg.n_layer) for t in model.weights.layer(i).values())
    head_params = cfg.vocab_size * cfg.d_model
    t_dec_paired, t_read = decode_and_read(wkvm_decode, n, 4 * (layer_params + head_params), args.repeat)
    rates = matmul_rate()
    bw = 4 * (layer_params + head_params) * n / t_read
    floor = n / t_read  # the read timed in alternation with the decode (whose run starts with a short
    # prefill, so the paired ratio below is a little low)
    ceiling = max(rates.values()) / (2 * layer_params)
    dec, ref_dec = n / t_dec, n / r_dec
    pre, ref_pre = len(prompt) / t_pre, len(prompt) / r_pre
    rows = [
        ["decode B=1", dec, ref_dec, dec / ref_dec, 3.0, floor, t_read / t_dec_paired],
        [f"prefill {len(prompt)}", pre, ref_pre, pre / ref_pre, 1.5, ceiling, pre / ceiling],
        [f"engine decode B={args.batch}", batch_tok_s, ref_dec, batch_tok_s / ref_dec, 10.0, "", ""],
    ]
    print(f"CPU: {cpu_name()}; torch ISA {torch.backends.cpu.get_cpu_capability()}; {torch.get_num_threads()} threads")
    print_table(
        f"Mamba2 {cfg.n_layer}L d{cfg.d_model} H{cfg.n_heads}x{cfg.head_dim} N{cfg.d_state} V{cfg.vocab_size} fp32 "
        f"(read {bw / 1e9:.1f} GB/s; matmul BLAS {rates['blas'] / 1e9:.0f}, "
        f"packed {rates['packed'] / 1e9:.0f} GFLOP/s)",
        ["case", "wkvm tok/s", "transformers tok/s", "x transformers", "target x", "bound tok/s", "of bound"],
        rows,
    )
    print("transformers: generate (B=1) for decode rows, one forward for prefill; torch path, fp32")
    print("bound: decode = read rate (timed beside the decode) / weight bytes per token; "
          f"prefill = best matmul rate / (2 x layer params); "
          f"engine run {t_batch:.1f} s")  # fmt: skip
    write_json(
        "mamba2_speed",
        {"decode_tok_s": dec, "transformers_decode_tok_s": ref_dec, "prefill_tok_s": pre,
         "transformers_prefill_tok_s": ref_pre, f"engine_b{args.batch}_tok_s": batch_tok_s,
         "decode_floor_tok_s": floor, "prefill_ceiling_tok_s": ceiling, "read_bandwidth_gb_s": bw / 1e9,
         "cpu": cpu_name(), "isa": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads()},
    )  # fmt: skip


if __name__ == "__main__":
    main()
