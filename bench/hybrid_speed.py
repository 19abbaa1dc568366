"""Hybrids at a 0.1B (LFM2: 0.35B) shape with random weights, fp32 CPU, against transformers in one process, and
shared-prefix reuse.

`--kind qwen3_5`: Qwen3.5 text, 12 layers of width 768, GDN (4 key / 8 value heads of 128) with gated full
attention every 4th layer (8 query / 2 key-value heads of 64, RoPE on 16 dims). `--kind bamba`: Bamba, 12 layers
of width 768, Mamba2 (24 heads of 64, d_state 128) with attention at layers 3, 7 and 11 (12 / 4 heads of 64).
Both: SwiGLU MLP 2,048 (Bamba) / 2,304 (Qwen3.5), vocab 65,536 tied. `--kind lfm2`: LFM2-350M's shape (0.35B:
16 layers of width 1,024, short convolutions with attention at 6, SwiGLU 4,608). Cases: decode B=1 (`generate`), a
1,024-token prefill (one forward), engine decode B=32 (vs transformers B=1); then the shared-system-prompt workload
through a live server (20 requests sharing a 300-token prefix then 16 tokens of their own, 8 generated each), with and
without reuse: tokens prefilled per request and wall time, against a lower bound (the same requests with only their
own tokens to prefill); and state memory per sequence vs a pure transformer of the same shape (every layer
attention) at 1k / 8k / 32k tokens. Weights cache in bench/out/.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import OUT, cpu_name, engine_decode_tok_s, print_table, timeit_pair, write_json  # noqa: E402
from gdn_speed import ByteTokenizer  # noqa: E402

from wkvm.weights.loader import load_model  # noqa: E402

L, F, C = "linear_attention", "full_attention", "conv"
SHAPES = {
    "qwen3_5": dict(vocab_size=65536, hidden_size=768, intermediate_size=2304, num_hidden_layers=12,
                    num_attention_heads=8, num_key_value_heads=2, head_dim=64, linear_conv_kernel_dim=4,
                    linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=4,
                    linear_num_value_heads=8, tie_word_embeddings=True, layer_types=[L, L, L, F] * 3),
    "bamba": dict(vocab_size=65536, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                  num_attention_heads=12, num_key_value_heads=4, attn_layer_indices=[3, 7, 11], mamba_n_heads=24,
                  mamba_d_head=64, mamba_n_groups=1, mamba_d_state=128, mamba_d_conv=4, mamba_expand=2,
                  tie_word_embeddings=True, pad_token_id=None, bos_token_id=None, eos_token_id=None),
    # LFM2-350M's own shape (Liquid AI's config.json): 16 layers of width 1,024, short convolutions of 3 taps with
    # attention at 6 of them (16 query / 8 key-value heads of 64), SwiGLU 4,608, vocab 65,536 tied
    "lfm2": dict(vocab_size=65536, hidden_size=1024, intermediate_size=6656, block_multiple_of=256,
                 block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=True, num_hidden_layers=16,
                 num_attention_heads=16, num_key_value_heads=8, conv_L_cache=3, tie_word_embeddings=True,
                 layer_types=[C, C, F, C, C, F, C, C, F, C, F, C, F, C, F, C], pad_token_id=None, bos_token_id=None,
                 eos_token_id=None),
    # a 0.35B Granite 4.0 H shape (granite-4.0-h-350m's layout is not at hand here: this is its size, not its config):
    # 32 layers of width 768, Mamba2 (48 heads of 32, d_state 128) with attention at 4 (12 / 4 heads of 64, no
    # positions), shared MLP 2,048, vocab 100,352 tied, Granite's multipliers; the released configs' layer names
    # (llama.cpp's converter reads those) and no experts
    "granite": dict(vocab_size=100352, hidden_size=768, shared_intermediate_size=2048, intermediate_size=2048,
                    num_local_experts=0, num_experts_per_tok=0, num_hidden_layers=32, num_attention_heads=12,
                    num_key_value_heads=4, layer_types=["attention" if i in (9, 17, 25, 31) else "mamba"
                                                        for i in range(32)],
                    position_embedding_type="nope", mamba_n_heads=48, mamba_d_head=32, mamba_n_groups=1,
                    mamba_d_state=128, mamba_d_conv=4, mamba_expand=2, embedding_multiplier=12.0,
                    residual_multiplier=0.246, attention_multiplier=0.015625, logits_scaling=3.0,
                    tie_word_embeddings=True, pad_token_id=None, bos_token_id=None, eos_token_id=None),
}  # fmt: skip
SIZE = {"qwen3_5": "0.1B", "bamba": "0.1B", "lfm2": "0.35B", "granite": "0.35B"}


def hf_classes(kind: str):
    import transformers as t

    return {"qwen3_5": (t.Qwen3_5TextConfig, t.Qwen3_5ForCausalLM), "bamba": (t.BambaConfig, t.BambaForCausalLM),
            "lfm2": (t.Lfm2Config, t.Lfm2ForCausalLM),
            "granite": (t.GraniteMoeHybridConfig, t.GraniteMoeHybridForCausalLM)}[kind]  # fmt: skip


def checkpoint(kind: str) -> Path:
    path = OUT / f"{kind}-hybrid-{SIZE[kind].lower()}-random"
    if not (path / "config.json").exists():
        config, causal_lm = hf_classes(kind)
        torch.manual_seed(0)
        causal_lm(config(**SHAPES[kind])).save_pretrained(path)
        if kind == "granite":  # the released configs' layer names, which llama.cpp's converter reads
            cfg = json.loads((path / "config.json").read_text())
            cfg["layer_types"] = SHAPES[kind]["layer_types"]
            (path / "config.json").write_text(json.dumps(cfg, indent=2))
        byte_tokenizer(path)
    return path


def byte_tokenizer(path: Path) -> None:
    """A tokenizer.json of 256 byte tokens and one merge (two spaces: llama.cpp loads no byte-level vocabulary without
    merges), so `wkvm serve` can run the random model (prompts go as token ids) and llama.cpp can convert it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # once: its order is a set's (asked per token, some bytes
    vocab = {c: i for i, c in enumerate(alphabet)}  # had been dropped and others given two ids)
    vocab["ĠĠ"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("Ġ", "Ġ")]))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.save(str(path / "tokenizer.json"))


def shared_prefix(path: Path, requests: int, prefix: int, own: int, gen: int) -> dict[str, float]:
    """Wall time and prompt tokens prefilled per request, with reuse, without, and the lower bound."""
    from live_server import LiveServer

    g = torch.Generator().manual_seed(1)
    shared = torch.randint(0, 65536, (prefix,), generator=g).tolist()
    tails = [torch.randint(0, 65536, (own,), generator=g).tolist() for _ in range(requests)]
    out: dict[str, float] = {}
    runs = (("reuse", True, shared), ("no reuse", False, shared), ("lower bound", False, []))
    for name, reuse, head in runs:
        with LiveServer(model=str(path), slots=4, prefix_reuse=reuse) as s:
            c = httpx.Client(base_url=s.url, timeout=600)
            body = {"max_tokens": gen, "temperature": 0, "ignore_eos": True}
            c.post("/v1/completions", json={"prompt": [1, 2, 3], **body})  # warm up
            fed, start = 0, time.perf_counter()
            for tail in tails:
                r = c.post("/v1/completions", json={"prompt": head + tail, **body}).json()
                fed += r["usage"]["prompt_tokens"] - r["wkvm"]["reused_tokens"]
            out[f"{name} s"] = time.perf_counter() - start
            out[f"{name} prefilled/request"] = fed / requests
    return out


def memory(model, kind: str) -> list[list[object]]:
    cfg = SHAPES[kind]
    heads = cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    dense_per_token = cfg["num_hidden_layers"] * 2 * heads * head_dim * 4  # every layer attention, fp32
    rows = []
    for n in (1024, 8192, 32768):
        hybrid = model.spec.nbytes + model.spec.token_nbytes * n
        rows.append([n, hybrid / 2**20, dense_per_token * n / 2**20, dense_per_token * n / hybrid])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--kind", choices=sorted(SHAPES), default="qwen3_5")
    ap.add_argument("--decode-tokens", type=int, default=32, help="at most --prefill-tokens - 8 (decoded from "
                    "that prompt after its first 8)")  # fmt: skip
    ap.add_argument("--prefill-tokens", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--batch-steps", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--requests", type=int, default=20)
    args = ap.parse_args()
    if args.decode_tokens > args.prefill_tokens - 8:  # wkvm's decode walks the prompt after 8: no more than it holds
        ap.error(f"--decode-tokens {args.decode_tokens} exceeds --prefill-tokens {args.prefill_tokens} - 8")
    sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
    path = checkpoint(args.kind)
    model = load_model(path)
    hf = hf_classes(args.kind)[1].from_pretrained(path).eval()
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 65536, (args.prefill_tokens,), generator=g)
    short, n = prompt[:8], args.decode_tokens

    def wkvm_decode():
        logits, state = model.prefill(short)
        for t in prompt[8 : 8 + n].tolist():
            model.decode([t], state)

    @torch.no_grad()
    def hf_generate():
        hf.generate(short[None], max_new_tokens=n, min_new_tokens=n, do_sample=False)

    @torch.no_grad()
    def hf_prefill():
        hf(prompt[None], use_cache=False, logits_to_keep=1)  # the last position, as wkvm (bench review)

    t_dec, r_dec = timeit_pair(wkvm_decode, hf_generate, args.repeat)
    t_pre, r_pre = timeit_pair(lambda: model.prefill(prompt), hf_prefill, args.repeat)
    agg = engine_decode_tok_s(model, ByteTokenizer(), args.batch, args.batch_steps, lambda i: [1 + i, 7, 3])
    dec, ref_dec, pre, ref_pre = n / t_dec, n / r_dec, len(prompt) / t_pre, len(prompt) / r_pre
    isa = torch.backends.cpu.get_cpu_capability()
    print(f"CPU: {cpu_name()}; torch ISA {isa}; {torch.get_num_threads()} threads")
    print_table(f"{args.kind} hybrid {SIZE[args.kind]} shape, fp32 ({model.family}: {len(model.kv_layers)} attention "
                f"layers of {model.config.n_layer})", ["case", "wkvm tok/s", "transformers tok/s", "x transformers"],
                [["decode B=1", dec, ref_dec, dec / ref_dec], [f"prefill {len(prompt)}", pre, ref_pre, pre / ref_pre],
                 [f"engine decode B={args.batch}", agg, ref_dec, agg / ref_dec]])  # fmt: skip
    shared = shared_prefix(path, args.requests, 300, 16, 8)
    print_table(f"{args.requests} requests sharing a 300-token prefix + 16 own tokens, 8 generated each",
                ["run", "wall s", "prompt tokens prefilled / request"],
                [[k, shared[f"{k} s"], shared[f"{k} prefilled/request"]]
                 for k in ("reuse", "no reuse", "lower bound")])  # fmt: skip
    mem = memory(model, args.kind)
    print_table("State per sequence (fp32): this hybrid vs the same shape with every layer attention",
                ["tokens", "hybrid MiB", "transformer MiB", "x smaller"], mem)  # fmt: skip
    write_json(f"hybrid_speed_{args.kind}", {
        "cpu": cpu_name(), "isa": isa, "threads": torch.get_num_threads(), "decode_tok_s": dec,
        "transformers_decode_tok_s": ref_dec, "prefill_tok_s": pre, "transformers_prefill_tok_s": ref_pre,
        f"engine_b{args.batch}_tok_s": agg, "shared_prefix": shared,
        "memory_mib": {str(r[0]): {"hybrid": r[1], "transformer": r[2]} for r in mem},
    })  # fmt: skip


if __name__ == "__main__":
    main()
