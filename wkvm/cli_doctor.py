"""`wkvm doctor`: check this machine and a model; each problem comes with its fix; exit 0 only if all pass."""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
from pathlib import Path

MIN_FREE_DISK = 1 << 30
MIN_MEMORY = 2 << 30


def checks(args: argparse.Namespace) -> list[tuple[str, bool, str, str]]:
    """(what, ok, detail, fix) for each check."""
    out = []
    v = sys.version_info
    out.append(("python", v >= (3, 11), f"{v.major}.{v.minor}.{v.micro}", "install Python 3.11 or newer"))
    try:
        import torch

        tv = torch.__version__.split("+")[0]
        out.append(("torch", tv == "2.13.0", torch.__version__,
                    "pip install torch==2.13.0 (the version wkvm is tested with)"))  # fmt: skip
        threads = torch.get_num_threads()
        out.append(("threads", threads >= 1, f"{threads} torch threads, {os.cpu_count()} CPUs",
                    "set OMP_NUM_THREADS to the number of physical cores"))  # fmt: skip
        from wkvm.models.linear import bf16_speed, cpu_isa, kernels, onednn_available

        detail = (
            "oneDNN prepacked fp32 (self-checked)"
            if onednn_available()
            else "plain F.linear: up to 2x slower on CPU (WKVM_ONEDNN=0 is set, or this torch has no oneDNN)"
        )
        out.append(("matmul", True, detail, ""))  # information: either path computes the same model
        out.append(("bf16", True, f"--dtype bfloat16: {bf16_speed()}", ""))  # information: float32 always works
        out.append(("cpu", True, f"ISA: {' '.join(cpu_isa()) or 'none of avx2/avx512/amx'}", ""))
        for dtype, kernel in kernels().items():  # information: each dtype works everywhere, at its speed
            out.append(("kernel", True, f"--dtype {dtype}: {kernel}", ""))
        from wkvm.models import fused

        ops = (f"wkvm fused kernel (norms, SiLU gate, RoPE + paged attention; a decode step's whole layer in one "
               f"call on fp32, int8 or int4 weights; {fused.build()}: part of system_fingerprint)" if fused.available()
               else "separate torch ops (WKVM_FUSED=off, or no C++ compiler): slower decode")  # fmt: skip
        out.append(("kernel", True, f"per-layer ops: {ops}", ""))
        out.append(("pages", True, huge_pages(), ""))  # information: 4 KiB pages are slower, not wrong
    except ImportError:
        out.append(("torch", False, "not installed", "pip install torch==2.13.0"))
    compiler, found = cxx_compiler()
    out.append(("compiler", found is not None, f"{compiler}: {found or 'not found'}",
                "install a C++ compiler (apt install g++, or set CXX): wkvm builds its int8, int4 and fused kernels "
                "with it on first use; without one they dequantize per call and decode is several times slower"))
    mem = _memory_bytes()
    out.append(("memory", mem is None or mem >= MIN_MEMORY, f"{(mem or 0) / 2**30:.1f} GiB available",
                "free memory or use a smaller model / --weight-cache-layers"))  # fmt: skip
    state_dir = Path(args.state_dir or Path.home() / ".cache" / "wkvm")
    probe = state_dir if state_dir.exists() else next((p for p in state_dir.parents if p.exists()), Path("/"))
    free = shutil.disk_usage(probe).free
    out.append(("disk", free >= MIN_FREE_DISK, f"{free / 2**30:.1f} GiB free at {probe}",
                "free disk space or point --state-dir elsewhere"))  # fmt: skip
    out.append(_model_check(args.model))
    out.append(_port_check(args.host, args.port))
    return out


def cxx_compiler() -> tuple[str, str | None]:
    """The C++ compiler torch's extension builder runs (CXX, else c++) and its path, or None where there is none."""
    compiler = os.environ.get("CXX") or "c++"
    return compiler, shutil.which(compiler)


def huge_pages() -> str:
    """Whether torch's large CPU tensors land on transparent huge pages here (wkvm/__init__.py asks torch's
    allocator for them): a 64 MiB probe tensor's mapping is looked up in /proc/self/smaps."""
    import torch

    setting = f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', 'unset')}"
    mode = thp_mode()
    if mode == "never":
        return "4 KiB pages (this system's transparent huge pages are off or absent)"
    # 64 MiB: above glibc's largest mmap threshold (32 MiB), so a fresh mapping (a smaller block can be reused heap
    # already faulted in 4 KiB pages, as in a process that has run for a while); one float touched per 2 MiB faults
    # each page in; held while its mapping is looked up (freed, it would be unmapped)
    probe = torch.empty(16 << 20)
    probe[:: 1 << 19] = 1.0
    if anon_huge_kb(probe.data_ptr()):
        return f"torch's large tensors on 2 MiB pages (THP {mode}, {setting})"
    return (f"4 KiB pages for torch's tensors (THP {mode}, {setting}): fp32 decode measured 1.09-1.22x faster on "
            "2 MiB ones; set THP to madvise or always, and THP_MEM_ALLOC_ENABLE=1 before torch allocates (import wkvm "
            "does)")


def thp_mode() -> str:
    """The kernel's transparent huge page mode: always, madvise or never ("never" where it has none)."""
    try:
        return Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "never"


def anon_huge_kb(address: int) -> int:
    """AnonHugePages (kB) of this process's mapping that holds `address` (0 when none does)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and ":" not in head:  # a mapping's first line: start-end perms offset ...
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return 0


def _memory_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _model_check(model: str | None) -> tuple[str, bool, str, str]:
    from wkvm.config import default_model

    path = model or str(default_model())
    try:
        from wkvm.models import registry
        from wkvm.weights.loader import load_model

        m = load_model(path)
        return ("model", True, f"{path}: {registry.family(m.family).describe(m.config)}", "")
    except ImportError as e:  # torch missing: the torch line says so; the model cannot be read without it
        return ("model", False, f"{path}: cannot be read: {e.name or e} is not installed", "install torch first")
    except Exception as e:  # any failure to read the model is the finding itself
        from wkvm.models import registry

        return ("model", False, f"{path}: {e}", f"point --model at a checkpoint: {registry.known_formats()}")


def _port_check(host: str, port: int) -> tuple[str, bool, str, str]:
    with socket.socket() as s:
        try:
            s.bind((host, port))
            return ("port", True, f"{host}:{port} is free", "")
        except socket.gaierror as e:  # a host name that does not resolve: nothing to stop
            return ("port", False, f"{host}:{port}: {e.strerror}", "pass a host this machine has (--host / WKVM_HOST)")
        except OSError as e:
            return ("port", False, f"{host}:{port}: {e.strerror}", "stop what uses it or pass --port / WKVM_PORT")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("doctor", help="check python, torch, memory, disk, model and port")
    p.add_argument("--model", default=os.environ.get("WKVM_MODEL"),
                   help="model to try loading (default: the embedded model) [env WKVM_MODEL]")
    p.add_argument("--state-dir", default=os.environ.get("WKVM_STATE_DIR"),
                   help="directory whose free disk space to check (default: ~/.cache/wkvm) [env WKVM_STATE_DIR]")
    p.add_argument("--host", default=os.environ.get("WKVM_HOST", "127.0.0.1"),
                   help="address to check is free to bind (default: %(default)s) [env WKVM_HOST]")
    # a string default: argparse converts it only when `doctor` runs (int() here had made WKVM_PORT=abc a traceback
    # for every command, `--version` too)
    p.add_argument("--port", type=int, default=os.environ.get("WKVM_PORT", "8000"),
                   help="port to check is free (default: %(default)s) [env WKVM_PORT]")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    results = checks(args)
    for what, ok, detail, fix in results:
        print(f"[{'ok' if ok else 'FAIL':>4}] {what:8} {detail}" + ("" if ok else f"\n       fix: {fix}"))
    failed = sum(not ok for _, ok, _, _ in results)
    print("all checks passed" if not failed else f"{failed} problem(s) found")
    return 0 if not failed else 1
