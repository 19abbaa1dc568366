"""Tiered KV: resuming a parked attention state from host RAM and from disk vs recomputing its prompt.

For SmolLM2-135M (`make smollm2`; all 30 layers attention) and the Qwen3.5 hybrid 0.1B shape of
bench/hybrid_speed.py (3 attention layers of 12), at 2k and 8k tokens: recompute = prefill the tokens (chunks of
512, as the engine would); host = a stored state (in RAM) to an engine slot (its keys and values into pages);
disk = the same after hibernating it to disk with the OS page cache for its file dropped (posix_fadvise
DONTNEED after fsync), so the bytes come from the device. KVMem's anchor on llama.cpp: restore 25-27 s vs 173 s
cold for 4.8 GiB sessions (~6.6x). Writes bench/out/kv_resume.json.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, machine_line, print_table, write_json  # noqa: E402
from hybrid_speed import checkpoint as hybrid_checkpoint  # noqa: E402

from wkvm.engine.arena import SlotArena  # noqa: E402
from wkvm.state.store import StateStore, StoreLimits  # noqa: E402
from wkvm.weights.loader import load_model  # noqa: E402

SMOLLM2 = Path(__file__).resolve().parent.parent / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def measure(name: str, model, n: int, root: Path) -> list[object]:
    ids = torch.randint(0, model.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    t0 = time.perf_counter()
    _, state = model.prefill(ids[:-1], chunk_size=512)  # the state after all but the pending token
    recompute = time.perf_counter() - t0
    spec = model.spec
    store = StateStore(root / name / str(n), spec, model.fingerprint, model.vocab_size,
                       limits=StoreLimits(8 << 30, 8 << 30), )  # fmt: skip
    h = store.put("u", "s", state, ids).handle
    pool_pages = 2 * (-(-n // 16)) + 2 if spec.has_kv else 0  # a write takes new pages before freeing the old
    arena = SlotArena(spec, 1, kv_pages=pool_pages)
    slot = arena.alloc()
    assert slot is not None
    store.hibernate("u", h, "host")
    host = min(timed(lambda: arena.write(slot, store.load("u", h)[1])) for _ in range(3))
    disks = []
    for _ in range(3):
        store.hibernate("u", h, "disk")
        drop_cache(store._blob_path(store.get("u", h).blob))
        disks.append(timed(lambda: arena.write(slot, store.load("u", h)[1])))
    restored = arena.read(slot)
    assert all(torch.equal(restored[k], state[k]) for k in state)  # exact: the same bytes come back
    size = (spec.nbytes + spec.token_nbytes * (n - 1)) / 2**20
    disk = min(disks)
    store.close()
    return [f"{name} {n}", size, recompute, host, disk, recompute / disk]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", default="2048,8192")
    args = ap.parse_args()
    models = [("qwen3_5 hybrid", load_model(hybrid_checkpoint("qwen3_5")))]
    if SMOLLM2.is_file():
        models.insert(0, ("SmolLM2-135M", load_model(SMOLLM2)))
    else:
        print(f"{SMOLLM2} missing (make smollm2): SmolLM2 rows skipped")
    root = Path(tempfile.mkdtemp(prefix="wkvm-kv-resume-"))
    try:
        rows = [measure(name, m, int(n), root) for name, m in models for n in args.tokens.split(",")]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(machine_line())
    print_table("Resume a parked state vs recompute its prompt (fp32 state)",
                ["model, tokens", "state MiB", "recompute s", "resume host s", "resume disk s", "x faster (disk)"],
                rows)  # fmt: skip
    write_json("kv_resume", {**machine(), "rows": rows})


if __name__ == "__main__":
    main()
