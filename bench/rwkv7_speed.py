"""RWKV-7 0.1B shape, fp32 CPU: decode (B=1) and 1,024-token prefill, wkvm vs BlinkDL's `rwkv` package.

Prints tok/s for both, the ratios, the decode floor (weight bytes per token over the read rate, measured in
alternation with wkvm's decode: `common.decode_and_read`) and the prefill ceiling (2 x layer parameters FLOPs per
token over the fastest fp32 matmul rate measured).
With --int8 (the default) also wkvm with `--dtype int8` weights, timed alternately with fp32 in the same run; its
decode floor counts int8 bytes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import (  # noqa: E402
    checkpoint,
    copy_bandwidth,
    cpu_name,
    decode_and_read,
    matmul_rate,
    print_table,
    read_bandwidth,
    rerun_with_avx2_paths,
    rwkv_reference,
    timeit_pair,
    write_json,
)

from wkvm.models.linear import weight_numel  # noqa: E402
from wkvm.weights.loader import load_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--decode-tokens", type=int, default=32, help="at most --prefill-tokens (decoded from that prompt)")
    ap.add_argument("--prefill-tokens", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--no-int8", dest="int8", action="store_false", help="skip the int8 rows")
    ap.add_argument("--avx2", action="store_true",
                    help="both sides on AVX2 code paths only (common.AVX2_ENV), as on an AVX2-only CPU")  # fmt: skip
    args = ap.parse_args()
    if args.decode_tokens > args.prefill_tokens:  # decode walks the prompt: no more tokens than it holds
        ap.error(f"--decode-tokens {args.decode_tokens} exceeds --prefill-tokens {args.prefill_tokens}")
    RWKV = rwkv_reference()
    if args.avx2:
        rerun_with_avx2_paths()
    torch.manual_seed(0)
    path = checkpoint()
    model = load_model(path)
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
    decode_bytes = 4 * (layer_params + head_params + cfg.n_embd)
    t_dec_paired, t_read = decode_and_read(wkvm_decode, n, decode_bytes, args.repeat)
    copy_bw, once_bw, rates = copy_bandwidth(), read_bandwidth(), matmul_rate()
    bw = decode_bytes * n / t_read
    flops = max(rates.values())  # the ceiling uses the fastest fp32 matmul this process can run
    floor = n / t_read
    ceiling = flops / (2 * layer_params)
    dec, ref_dec = n / t_dec, n / r_dec
    pre, ref_pre = len(prompt) / t_pre, len(prompt) / r_pre
    # the issue's definitions: bytes copied per second (one way) and the default (BLAS) fp32 matmul rate
    issue_floor = (copy_bw / 2) / decode_bytes
    issue_ceiling = rates["blas"] / (2 * layer_params)
    rows = [
        ["decode B=1", dec, ref_dec, dec / ref_dec, floor, t_read / t_dec_paired, dec / issue_floor],
        [f"prefill {len(prompt)}", pre, ref_pre, pre / ref_pre, ceiling, pre / ceiling, pre / issue_ceiling],
    ]
    q8: dict[str, float] = {}
    if args.int8:
        q8 = int8_rows(path, model, prompt, n, args.repeat)
        floor8 = q8["decode_floor_tok_s"]
        rows += [["decode B=1 int8", q8["decode_tok_s"], ref_dec, q8["decode_tok_s"] / ref_dec, floor8,
                  q8["decode_of_floor"], float("nan")],
                 [f"prefill {len(prompt)} int8", q8["prefill_tok_s"], ref_pre, q8["prefill_tok_s"] / ref_pre,
                  float("nan"), float("nan"), float("nan")]]  # fmt: skip
    print_table(
        f"RWKV-7 {cfg.n_layer}L C{cfg.n_embd} V{cfg.vocab_size} fp32, {torch.get_num_threads()} threads "
        f"(read {bw / 1e9:.1f} GB/s beside the decode, {once_bw / 1e9:.1f} once; copy {copy_bw / 1e9:.1f} GB/s; "
        f"matmul BLAS {rates['blas'] / 1e9:.0f}, packed {rates['packed'] / 1e9:.0f} GFLOP/s); {cpu_name()}, "
        f"torch {torch.backends.cpu.get_cpu_capability()}",
        ["case", "wkvm tok/s", "rwkv tok/s", "x rwkv", "bound tok/s", "of bound", "of copy/BLAS bound"],
        rows,
    )
    print("bound: decode = read rate / weight bytes per token, the read timed in alternation with the decode\n"
          "  (of bound: the paired times' ratio); prefill = best matmul rate / (2 x layer params)")
    print("copy/BLAS bound (the issue's definition): copy bandwidth (bytes copied per second) and BLAS matmul rate")
    if q8:
        print(f"int8 x fp32 (alternating in this run): decode {q8['decode_x_fp32']:.2f}x, "
              f"prefill {q8['prefill_x_fp32']:.2f}x; int8 kernel {q8['kernel']}")  # fmt: skip
    write_json(
        "rwkv7_speed",
        {
            "decode_tok_s": dec, "rwkv_decode_tok_s": ref_dec, "decode_floor_tok_s": floor,
            "decode_of_copy_floor": dec / issue_floor, "prefill_of_blas_ceiling": pre / issue_ceiling,
            "prefill_tok_s": pre, "rwkv_prefill_tok_s": ref_pre, "prefill_ceiling_tok_s": ceiling,
            "read_bandwidth_gb_s": bw / 1e9, "decode_of_floor": t_read / t_dec_paired,
            "read_bandwidth_once_gb_s": once_bw / 1e9, "copy_bandwidth_gb_s": copy_bw / 1e9,
            "matmul_blas_gflop_s": rates["blas"] / 1e9, "matmul_packed_gflop_s": rates["packed"] / 1e9,
            "threads": torch.get_num_threads(), "int8": q8, "cpu": cpu_name(),
        },
    )  # fmt: skip


def int8_rows(path: Path, fp32, prompt: list[int], n: int, repeat: int) -> dict:
    """`--dtype int8` against fp32, alternating: tok/s, ratios, and the decode floor for int8 weight bytes (its read
    timed in alternation with the int8 decode)."""
    from wkvm.models import int8

    q8 = load_model(path, dtype="int8")

    def decode(model):
        def run():
            state = model.new_state()
            for t in prompt[:n]:
                model.decode([t], state)

        return run

    t8, t32 = timeit_pair(decode(q8), decode(fp32), repeat)
    p8, p32 = timeit_pair(lambda: q8.prefill(prompt), lambda: fp32.prefill(prompt), repeat)
    w = q8.weights
    tensors = [t for i in range(q8.config.n_layer) for t in w.layer(i).values()] + [w.globals()["head.weight"]]
    nbytes = sum(torch.ops.mkldnn._nbytes(t) if t.is_mkldnn else t.numel() * t.element_size() for t in tensors)
    t8_paired, t_read = decode_and_read(decode(q8), n, nbytes + 4 * q8.config.n_embd, repeat)
    return {"decode_tok_s": n / t8, "prefill_tok_s": len(prompt) / p8, "decode_x_fp32": t32 / t8,
            "prefill_x_fp32": p32 / p8, "decode_floor_tok_s": n / t_read, "decode_of_floor": t_read / t8_paired,
            "kernel": int8.kernel_path()}  # fmt: skip


if __name__ == "__main__":
    main()
