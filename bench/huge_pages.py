"""fp32 decode B=1 on 4 KiB pages vs 2 MiB (transparent huge) pages, in one process: why `import wkvm` sets
THP_MEM_ALLOC_ENABLE=1 (wkvm/__init__.py).

This process turns the setting off before wkvm loads, loads the RWKV-7 0.1B shape twice, and moves one copy's
weights (oneDNN's packed copies, the int8 ones with --dtype int8) onto huge pages with madvise(MADV_COLLAPSE)
(Linux 6.1+; only whole 2 MiB pages inside each tensor: the 768x768 matrices, 2.25 MiB each, stay on 4 KiB pages,
so this understates what 2 MiB-aligned allocations give). The two
copies then decode alternately, so machine noise hits both alike; prints tok/s and the paired ratio.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time
from pathlib import Path

os.environ["THP_MEM_ALLOC_ENABLE"] = "0"  # before torch allocates: both copies start on 4 KiB pages

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from common import checkpoint, machine, machine_line, print_table, write_json  # noqa: E402

from wkvm.weights.loader import load_model  # noqa: E402

HUGE = 2 << 20
MADV_COLLAPSE = 25
LIBC = ctypes.CDLL(None, use_errno=True)


def span(t: torch.Tensor) -> tuple[int, int]:
    """(address, bytes) of a tensor's data, oneDNN-packed or plain."""
    if t.is_mkldnn:
        return torch.ops.mkldnn.data_ptr(t), torch.ops.mkldnn._nbytes(t)
    return t.data_ptr(), t.untyped_storage().nbytes()


def collapse(t: torch.Tensor) -> int:
    """Bytes of `t` moved onto 2 MiB pages (0 when it spans none, or the kernel refuses: a file-backed mapping)."""
    start, size = span(t)
    lo, hi = -(-start // HUGE) * HUGE, (start + size) // HUGE * HUGE
    if hi <= lo:
        return 0
    return hi - lo if LIBC.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), MADV_COLLAPSE) == 0 else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tokens", type=int, default=16, help="tokens per timed run")
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    small, huge = load_model(checkpoint(), dtype=args.dtype), load_model(checkpoint(), dtype=args.dtype)
    tensors = [t for i in range(huge.config.n_layer) for t in huge.weights.layer(i).values()]
    tensors += [t for name, t in huge.weights.globals().items() if "emb" not in name]  # a token reads one row
    moved = sum(collapse(t) for t in tensors)
    if not moved:
        sys.exit("madvise(MADV_COLLAPSE) moved nothing: it needs Linux 6.1+ with transparent huge pages not 'never'")
    total = sum(span(t)[1] for t in tensors)
    states = {id(m): m.new_state() for m in (small, huge)}

    def run(model) -> float:
        t0 = time.perf_counter()
        for t in range(args.tokens):
            model.decode([t], states[id(model)])
        return (time.perf_counter() - t0) / args.tokens

    run(small), run(huge)
    times: dict[str, list[float]] = {"4 KiB": [], "2 MiB": []}
    for _ in range(args.rounds):
        times["4 KiB"].append(run(small))
        times["2 MiB"].append(run(huge))
    ratio = statistics.median(a / b for a, b in zip(times["4 KiB"], times["2 MiB"], strict=True))
    print(machine_line())
    print(f"--dtype {args.dtype}: {moved / total:.0%} of the "
          f"weights' {total / 2**20:.0f} MiB on 2 MiB pages in the second copy")
    rows = [[pages, 1 / statistics.median(ts), 1 / min(ts)] for pages, ts in times.items()]
    print_table("decode B=1, tok/s (median, best)", ["weights on", "median", "best"], rows)
    print(f"paired ratio (2 MiB over 4 KiB, median of {args.rounds}): {ratio:.3f}x")
    write_json("huge_pages", {**machine(), "dtype": args.dtype, "ratio": ratio,
                              "tok_s": {k: 1 / statistics.median(v) for k, v in times.items()}})  # fmt: skip


if __name__ == "__main__":
    main()
