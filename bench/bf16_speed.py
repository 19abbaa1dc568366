"""bf16 weights vs fp32 weights on the 0.1B shape (CPU): decode B=1 and B=8, 512-token prefill, weight memory,
and how far bf16's next-token distributions move from fp32 (KL). fp32 runs in the same process, alternating with
bf16, as the baseline; BlinkDL's `rwkv` package with strategy `cpu bf16` is a second baseline for decode B=1.
Accuracy on a trained model is asserted in tests/test_bf16.py (the random weights here make KL less telling).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import checkpoint, machine, machine_line, print_table, rwkv_reference, timeit_pair, write_json  # noqa: E402

from wkvm.weights.loader import load_model  # noqa: E402


def weight_bytes(model) -> int:
    w = model.weights
    tensors = [*w.globals().values(), *(t for i in range(model.config.n_layer) for t in w.layer(i).values())]
    return sum(torch.ops.mkldnn._nbytes(t) if t.is_mkldnn else t.numel() * t.element_size() for t in tensors)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--decode-tokens", type=int, default=24, help="at most --prefill-tokens (decoded from that prompt)")
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    if args.decode_tokens > args.prefill_tokens:  # decode walks the prompt: no more tokens than it holds
        ap.error(f"--decode-tokens {args.decode_tokens} exceeds --prefill-tokens {args.prefill_tokens}")
    RWKV = rwkv_reference()
    torch.manual_seed(0)
    path = checkpoint()
    fp32, bf16 = load_model(path), load_model(path, dtype=torch.bfloat16)
    prompt = torch.randint(0, fp32.config.vocab_size, (args.prefill_tokens,)).tolist()
    n = args.decode_tokens

    def decode(model, batch):
        def run():
            state = model.new_state(batch)
            for t in prompt[:n]:
                model.decode([t] * batch, state)

        return run

    rows, out = [], {}
    for name, a, b, tokens in (
        ("decode B=1", decode(bf16, 1), decode(fp32, 1), n),
        ("decode B=8", decode(bf16, 8), decode(fp32, 8), 8 * n),
        (f"prefill {len(prompt)}", lambda: bf16.prefill(prompt), lambda: fp32.prefill(prompt), len(prompt)),
    ):
        t16, t32 = timeit_pair(a, b, args.repeat)
        rows.append([name, tokens / t16, tokens / t32, t32 / t16])
        out[name] = {"bf16_tok_s": tokens / t16, "fp32_tok_s": tokens / t32}
    ref = RWKV(str(path).removesuffix(".pth"), "cpu bf16")

    def ref_decode():
        state = None
        for t in prompt[:n]:
            _, state = ref.forward([t], state)

    t16, tref = timeit_pair(decode(bf16, 1), ref_decode, max(1, args.repeat // 2))
    rows.append(["decode B=1 vs rwkv cpu bf16", n / t16, n / tref, tref / t16])
    print(machine_line())
    print_table("bf16 weights, RWKV-7 0.1B shape",
                ["case", "bf16 tok/s", "baseline tok/s", "speedup"], rows)  # fmt: skip
    mem16, mem32 = weight_bytes(bf16), weight_bytes(fp32)
    p = fp32.prefill(prompt[:128], all_logits=True)[0].log_softmax(-1)
    q = bf16.prefill(prompt[:128], all_logits=True)[0].log_softmax(-1)
    kl = (p.exp() * (p - q)).sum(-1)
    agree = (p.argmax(-1) == q.argmax(-1)).float().mean()
    print(f"weights: bf16 {mem16 / 2**20:.0f} MiB, fp32 {mem32 / 2**20:.0f} MiB ({mem16 / mem32:.2f}x)")
    print(f"KL(fp32 || bf16) over 128 positions: mean {kl.mean():.2e}, max {kl.max():.2e}; argmax agree {agree:.1%}")
    write_json("bf16_speed", {**machine(), **out, "rwkv_cpu_bf16_decode_tok_s": n / tref,
                              "weights_mib_bf16": mem16 / 2**20, "weights_mib_fp32": mem32 / 2**20,
                              "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
                              "argmax_agree": float(agree)})  # fmt: skip


if __name__ == "__main__":
    main()
