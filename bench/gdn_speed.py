"""Qwen3.5 Gated DeltaNet, a 0.1B shape with random weights, fp32 CPU: wkvm against transformers in one process.

Shape: 12 layers of width 768, 4 key / 8 value heads of 128, conv kernel 4, SwiGLU MLP 2304, vocab 65,536 tied
(about 101M layer parameters plus a 50M embedding; Qwen3.5's own vocab, 248,320, would make the head dominate a
model this small). Cases: decode B=1 (a short prompt then 32 greedy tokens, vs `generate`), a 1,024-token prefill
(vs one transformers forward) and aggregate decode through the engine at B=32 (vs transformers B=1). Prints
tok/s, ratios, the CPU and its ISA, the decode floor (weight bytes per token over read bandwidth) and the prefill
ceiling (2 x layer parameters FLOPs per token over the fastest fp32 matmul rate). Weights cache in bench/out/.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import (  # noqa: E402
    OUT,
    cpu_name,
    decode_and_read,
    engine_decode_tok_s,
    matmul_rate,
    print_table,
    timeit_pair,
    write_json,
)

from wkvm.models.linear import weight_numel  # noqa: E402
from wkvm.weights.loader import load_model  # noqa: E402

SHAPE_0_1B = dict(
    vocab_size=65536, hidden_size=768, intermediate_size=2304, num_hidden_layers=12, num_attention_heads=8,
    num_key_value_heads=2, head_dim=64, linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_num_key_heads=4, linear_num_value_heads=8, tie_word_embeddings=True, layer_types=["linear_attention"] * 12,
)  # fmt: skip


def checkpoint() -> Path:
    path = OUT / "qwen3_5-gdn-0.1b-random"
    if not (path / "config.json").exists():
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        torch.manual_seed(0)
        Qwen3_5ForCausalLM(Qwen3_5TextConfig(**SHAPE_0_1B)).save_pretrained(path)
    return path


class ByteTokenizer:
    """Enough of a tokenizer for the engine to detokenize random ids."""

    vocab_size = SHAPE_0_1B["vocab_size"]
    eos_token_id = None
    eos_token_ids: frozenset[int] = frozenset()  # the engine reads the set (the bench had failed at its engine rows)
    special_ids: frozenset[int] = frozenset()
    exact_bytes = True

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(33 + i % 94) for i in ids)

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([33 + token_id % 94])


def hf_linear_cache(hf):
    """transformers 5.24 asks a cache for its length through attention layers only, which a model of linear
    attention layers lacks (its generate raises): a cache that counts the tokens fed instead."""
    from transformers import DynamicCache

    class LinearCache(DynamicCache):
        seen = 0

        def get_seq_length(self, layer_idx: int = 0) -> int:
            return self.seen

        def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
            return self.seen + query_length, 0

    def count_tokens(module, args, kwargs, output) -> None:
        cache = kwargs.get("cache")
        if isinstance(cache, LinearCache):
            cache.seen += kwargs.get("input_ids", args[0] if args else None).shape[1]

    hf.register_forward_hook(count_tokens, with_kwargs=True)
    return lambda: LinearCache(config=hf.config)


def engine_tok_s(model, batch: int, steps: int) -> float:
    return engine_decode_tok_s(model, ByteTokenizer(), batch, steps, lambda i: [1 + i, 7, 3])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--prefill-tokens", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--batch-steps", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads for both (0: torch's default); on a "
                    "machine shared with other work, 1 avoids OpenMP threads waiting on descheduled peers")  # fmt: skip
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import Qwen3_5ForCausalLM

    path = checkpoint()
    model = load_model(path)
    hf = Qwen3_5ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    new_cache = hf_linear_cache(hf)
    cfg, n = model.config, args.decode_tokens
    torch.manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size, (args.prefill_tokens,))
    short = prompt[:8]

    def wkvm_decode():
        logits, state = model.prefill(short)
        for _ in range(n):
            logits = model.decode([int(logits.argmax())], state)[0]

    @torch.inference_mode()
    def hf_generate():
        hf.generate(short[None], max_new_tokens=n, min_new_tokens=n, do_sample=False, cache=new_cache())

    @torch.inference_mode()
    def hf_prefill():
        hf(prompt[None], use_cache=False, logits_to_keep=1)  # the last position, as wkvm (bench review)

    t_dec, r_dec = timeit_pair(wkvm_decode, hf_generate, args.repeat)
    t_pre, r_pre = timeit_pair(lambda: model.prefill(prompt), hf_prefill, args.repeat)
    agg = engine_tok_s(model, args.batch, args.batch_steps)

    layer_params = sum(weight_numel(t) for i in range(cfg.n_layer) for t in model.weights.layer(i).values())
    head_params = cfg.vocab_size * cfg.n_embd
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
        [f"engine decode B={args.batch} (agg.)", agg, ref_dec, agg / ref_dec, 10.0, "", ""],
    ]
    print(f"CPU: {cpu_name()}; torch ISA {torch.backends.cpu.get_cpu_capability()}; {torch.get_num_threads()} threads")
    print_table(
        f"Qwen3.5 GDN {cfg.n_layer}L C{cfg.n_embd} {cfg.n_k_heads}k/{cfg.n_v_heads}v heads of {cfg.k_head_dim} "
        f"V{cfg.vocab_size} fp32 (read {bw / 1e9:.1f} GB/s; matmul BLAS {rates['blas'] / 1e9:.0f}, packed "
        f"{rates['packed'] / 1e9:.0f} GFLOP/s)",
        ["case", "wkvm tok/s", "transformers B=1 tok/s", "x transformers", "target x", "bound tok/s", "of bound"],
        rows,
    )
    print("bound: decode = read rate (timed beside the decode) / weight bytes per token; "
          "prefill = best matmul rate / (2 x layer params)")
    write_json(
        "gdn_speed",
        {
            "decode_tok_s": dec, "hf_decode_tok_s": ref_dec, "prefill_tok_s": pre, "hf_prefill_tok_s": ref_pre,
            f"engine_b{args.batch}_tok_s": agg, "decode_floor_tok_s": floor, "prefill_ceiling_tok_s": ceiling,
            "read_bandwidth_gb_s": bw / 1e9, "matmul_blas_gflop_s": rates["blas"] / 1e9,
            "matmul_packed_gflop_s": rates["packed"] / 1e9, "cpu": cpu_name(),
            "isa": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
        },
    )  # fmt: skip


if __name__ == "__main__":
    main()
