"""RWKV-7 0.1B shape, fp32 CPU: decode (B=1) and 1,024-token prefill, wkvm vs BlinkDL's `rwkv` package.

Prints tok/s for both, the ratios, the decode floor (weight bytes per token over measured read bandwidth)
and the prefill ceiling (2 x layer parameters FLOPs per token over the fastest fp32 matmul rate measured).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import checkpoint, copy_bandwidth, matmul_rate, print_table, read_bandwidth, timeit_pair, write_json  # noqa: E402

from wkvm.models.linear import weight_numel  # noqa: E402
from wkvm.weights.loader import load_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--prefill-tokens", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    path = checkpoint()
    model = load_model(path)
    from rwkv.model import RWKV

    ref = RWKV(str(path).removesuffix(".pth"), "cpu fp32")
    cfg = model.config
    prompt = torch.randint(0, cfg.vocab_size, (args.prefill_tokens,)).tolist()
    n = args.decode_tokens

    def wkvm_decode():
        state = model.new_state()
        for t in prompt[:n]:
            model.decode([t], state)

    def ref_decode():
        state = None
        for t in prompt[:n]:
            _, state = ref.forward([t], state)

    t_dec, r_dec = timeit_pair(wkvm_decode, ref_decode, args.repeat)
    t_pre, r_pre = timeit_pair(lambda: model.prefill(prompt), lambda: ref.forward(prompt, None), args.repeat)

    layer_params = sum(weight_numel(t) for i in range(cfg.n_layer) for t in model.weights.layer(i).values())
    head_params = model.weights.globals()["head.weight"].shape.numel()
    copy_bw, bw, rates = copy_bandwidth(), read_bandwidth(), matmul_rate()
    flops = max(rates.values())  # the ceiling uses the fastest fp32 matmul this process can run
    decode_bytes = 4 * (layer_params + head_params + cfg.n_embd)
    floor = bw / decode_bytes
    ceiling = flops / (2 * layer_params)
    dec, ref_dec = n / t_dec, n / r_dec
    pre, ref_pre = len(prompt) / t_pre, len(prompt) / r_pre
    # the issue's definitions: bytes copied per second (one way) and the default (BLAS) fp32 matmul rate
    issue_floor = (copy_bw / 2) / decode_bytes
    issue_ceiling = rates["blas"] / (2 * layer_params)
    rows = [
        ["decode B=1", dec, ref_dec, dec / ref_dec, floor, dec / floor, dec / issue_floor],
        [f"prefill {len(prompt)}", pre, ref_pre, pre / ref_pre, ceiling, pre / ceiling, pre / issue_ceiling],
    ]
    print_table(
        f"RWKV-7 {cfg.n_layer}L C{cfg.n_embd} V{cfg.vocab_size} fp32, {torch.get_num_threads()} threads "
        f"(read {bw / 1e9:.1f} GB/s, copy {copy_bw / 1e9:.1f} GB/s; matmul BLAS {rates['blas'] / 1e9:.0f}, "
        f"packed {rates['packed'] / 1e9:.0f} GFLOP/s)",
        ["case", "wkvm tok/s", "rwkv tok/s", "x rwkv", "bound tok/s", "of bound", "of copy/BLAS bound"],
        rows,
    )
    print("bound: decode = read bandwidth / weight bytes per token; prefill = best matmul rate / (2 x layer params)")
    print("copy/BLAS bound (the issue's definition): copy bandwidth (bytes copied per second) and BLAS matmul rate")
    write_json(
        "rwkv7_speed",
        {
            "decode_tok_s": dec, "rwkv_decode_tok_s": ref_dec, "decode_floor_tok_s": floor,
            "decode_of_copy_floor": dec / issue_floor, "prefill_of_blas_ceiling": pre / issue_ceiling,
            "prefill_tok_s": pre, "rwkv_prefill_tok_s": ref_pre, "prefill_ceiling_tok_s": ceiling,
            "read_bandwidth_gb_s": bw / 1e9, "copy_bandwidth_gb_s": copy_bw / 1e9,
            "matmul_blas_gflop_s": rates["blas"] / 1e9, "matmul_packed_gflop_s": rates["packed"] / 1e9,
            "threads": torch.get_num_threads(),
        },
    )  # fmt: skip


if __name__ == "__main__":
    main()
