"""Fused per-layer ops (fused.cpp, torch op namespace `wkvm_fused`) for steps where dispatch, not arithmetic, is the
cost: a one-token decode step of a small model runs ~45 tiny torch ops per layer (issues #16, #21).

Each function here is one op of the kernel when it is available (built on first use like the int8/int4 kernels,
cached per source and CPU) and the torch expression it replaces otherwise: no compiler, a tensor off the CPU or not
float32, or `WKVM_FUSED=off` (the torch path, e.g. to compare). The kernel computes in fp32 like the torch path; its
results differ from it by rounding only (tests/test_fused.py bounds the difference), which int8 / int4 weights
magnify (`build`).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shlex
import subprocess
from pathlib import Path

import torch
import torch.nn.functional as F

from wkvm.models.int8 import cpu_flags, load_kernel

log = logging.getLogger("wkvm.fused")

SOURCE = Path(__file__).with_name("fused.cpp")
# -march=native is safe: the build is cached per CPU (load_kernel keys it on /proc/cpuinfo's flags).
# WKVM_FUSED_MARCH=haswell (or x86-64-v3, any -march GCC takes) builds them for another CPU kind instead: with
# WKVM_INT8_KERNEL=avx2, WKVM_INT4_KERNEL=avx2, ATEN_CPU_CAPABILITY=avx2 and ONEDNN_MAX_CPU_ISA=AVX2 an AVX-512
# machine runs what an AVX2-only one runs (tests and benchmarks of the AVX2 paths; docs/performance.md).
MARCH = os.environ.get("WKVM_FUSED_MARCH", "native")
CFLAGS = ("-O3", f"-march={MARCH}", "-fopenmp-simd", "-fno-trapping-math")  # the last lets exp's clamps vectorize
# These kernels promise the same bits on every path (a row alone or batched, a chunk or its steps, the fused layer
# or its ops), so a multiply-add must be one fused multiply-add wherever the compiler contracts it. GCC tuning for
# AMD Zen (-march=native on Zen 1-3; GCC 12.2's avoid-fma-max-bits: znver1 128, znver2 / znver3 256, Intel tunings 0)
# keeps loop-carried multiply-add chains up to that width as a multiply and an add in some loops and not others
# ("avoid FMA chains"); on a Zen 3 a LoRA row's bits then depended
# on its batch mates and a short chunk's on the path (session 50, the first real AVX2-only machine). The param
# turns that off; clang contracts within one expression only and has no such tuning.
GCC_CFLAGS = ("--param=avoid-fma-max-bits=0",)


@functools.cache
def cflags() -> tuple[str, ...]:
    """The kernels' compiler flags: CFLAGS, and GCC_CFLAGS where the C++ compiler torch builds with is GCC."""
    from torch.utils import cpp_extension

    try:
        gcc = cpp_extension.check_compiler_is_gcc(cpp_extension.get_cxx_compiler())  # type: ignore[no-untyped-call]
    except Exception:  # no compiler: the build fails anyway, and says so
        gcc = False
    return CFLAGS + GCC_CFLAGS if gcc else CFLAGS


BUILT: dict[str, bool] = {}  # source file name -> whether it built and loaded here (`kernel_available` fills it)


def build() -> str:
    """What decides the fused kernels' arithmetic besides their source (which `linear.code_digest` covers): whether
    they run (`WKVM_FUSED`, a C++ compiler), the compiler and its flags, and for `-march=native` the CPU it tunes
    for. Their results differ from the torch path's, and between builds, by float rounding only (~4e-6 in a
    logprob on SmolLM2 fp32), but int8 / int4 round every matmul input to 8 bits, and a rounding that flips there
    grows through the layers: the same SmolLM2 prompt's int8 logprobs differed by 0.06 nats a token (0.3-0.4 at
    most) between the fused kernels and the torch path, between a native and a haswell build, or with RMSNorm's
    eps moved by 1e-6 (session 60). So a chat checkpoint's key and `system_fingerprint` name this (via
    `linear.compute_paths`), and a kernel that failed to build here (a compiler without Python's headers, say) is
    named too: a server computes its key after its warm-up request has built or loaded each kernel its model runs."""
    if switched_off():
        return "fused kernels off (WKVM_FUSED=off)"
    from torch.utils import cpp_extension

    compiler = cpp_extension.get_cxx_compiler()  # type: ignore[no-untyped-call]
    version = compiler_version(compiler)
    if version is None:
        return f"fused kernels off (no C++ compiler: {compiler})"
    target = f" for {native_target(compiler) or cpu_model()}" if MARCH == "native" else ""
    failed = sorted(name for name, ok in BUILT.items() if not ok)
    failures = f", {' '.join(failed)} failed to build (torch ops instead)" if failed else ""
    return f"fused kernels by {version}, {' '.join(cflags())}{target}{failures}"


@functools.cache
def compiler_version(compiler: str) -> str | None:
    """The first line of `compiler --version`; None where it does not run."""
    try:  # CXX may be "ccache g++": a command line, as torch's ninja file takes it
        out = subprocess.run([*shlex.split(compiler), "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.splitlines()[0].strip() if out.strip() else None


@functools.cache
def native_target(compiler: str) -> str | None:
    """What GCC makes of `-march=native` here: the architecture it names and a digest of every -m option and cache
    size it passes on (its code depends on those, not on the rest of /proc/cpuinfo's flags, which differ between
    hypervisors); None for another compiler or where it does not say."""
    try:
        run = subprocess.run([*shlex.split(compiler), "-march=native", "-E", "-v", "-"], stdin=subprocess.DEVNULL,
                             capture_output=True, text=True, timeout=30)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    line = next((x for x in run.stderr.splitlines() if "cc1" in x and " -march=" in x), None)
    if line is None:
        return None
    words = line.split()
    chosen = [w for i, w in enumerate(words) if w.startswith("-m") or (i and words[i - 1] == "--param")]
    arch = next(w for w in chosen if w.startswith("-march="))
    return f"{arch} ({len(chosen)} target options, digest {hashlib.sha256(' '.join(chosen).encode()).hexdigest()[:8]})"


def cpu_model() -> str:
    """The CPU `-march=native` builds for where the compiler does not say (`native_target`): its vendor, family and
    model (GCC's tuning) and a digest of its flags."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("vendor_id", "cpu family", "model", "CPU implementer", "CPU part"):
                    fields.setdefault(key.strip(), value.strip())
                if not line.strip():  # the first processor's block is enough
                    break
    except OSError:
        pass
    flags = hashlib.sha256(cpu_flags().encode()).hexdigest()[:8]
    return " ".join(f"{k} {v}" for k, v in fields.items()) + f", flags {flags}"


@functools.cache
def available() -> bool:
    """Whether the fused kernel runs here (built now if needed); False, with one warning, when it cannot be built."""
    return kernel_available(SOURCE, "wkvm_fused", "rope_attend", "fused kernel",
                            "per-layer ops run as separate torch ops (slower)")  # fmt: skip


@functools.cache
def narrow_attention() -> bool:
    """Whether the fused attention is built here without `Attention::group` (it needs AVX-512, or AVX2 with FMA:
    `ROW_GROUPS`), which takes a prompt chunk's rows a chunk of keys at a time: each row then reads the keys alone,
    and a long chunk attends several times slower than through torch (`attention_groups_rows`)."""
    return available() and not torch.ops.wkvm_fused.wide_attention()


# the longest chunk that attends a token at a time where the fused attention cannot group a chunk's rows (built
# without AVX2 + FMA or AVX-512): the int8 kernel's row limit on AVX2 before session 52
UNGROUPED_ROWS = 32


def attention_groups_rows(rows: int) -> bool:
    """Whether a chunk of `rows` tokens attends a token at a time (each with a one-token step's bits) at a speed
    worth it: always where the fused attention groups a chunk's rows over shared keys; else up to UNGROUPED_ROWS
    (each row reading the keys alone, SmolLM2 int8's engine prefill of 1,024 tokens had run 0.72x; AMD EPYC Zen 3
    before its AVX2 groups, session 52)."""
    return rows <= UNGROUPED_ROWS or not narrow_attention()


def switched_off() -> bool:
    """`WKVM_FUSED=off` (the torch ops everywhere); ValueError for a value that is neither auto nor off."""
    setting = os.environ.get("WKVM_FUSED", "auto").lower()
    if setting not in ("auto", "off"):
        raise ValueError(f"WKVM_FUSED={setting!r}: use auto or off")
    return setting == "off"


def kernel_available(source: Path, namespace: str, op: str, what: str, fallback: str) -> bool:
    """The switch of every fused kernel (this one, a family's step kernel): False under `WKVM_FUSED=off`, else
    whether `source` builds and loads here (once per source and CPU); without a compiler one warning naming `what`
    and its `fallback`."""
    if switched_off():
        return False
    try:
        load_kernel(source, namespace, cflags(), op=op)
        BUILT[source.name] = True
        return True
    except Exception as e:  # no compiler, failed build or load: the torch path computes the same, slower (`build`)
        log.warning("%s unavailable (%s); %s", what, str(e).splitlines()[0], fallback)
        BUILT[source.name] = False
        return False


def cpu_fp32(*xs: torch.Tensor | None) -> bool:
    """Whether every tensor given (None: absent) is a CPU float32 one, as the fused kernels take them. `is_cpu`, not
    `device.type`: this runs tens of times a decode step, and the latter costs 3x as much."""
    return all(x is None or (x.is_cpu and x.dtype == torch.float32) for x in xs)


def conv_step_fits(proj: torch.Tensor, window: torch.Tensor, conv: torch.Tensor, *rest: torch.Tensor) -> bool:
    """Whether a recurrent layer's one-token kernel (models/recurrent_parts.h's checks: Mamba2's and Gated
    DeltaNet's `decode`) takes these tensors: CPU float32, proj's rows contiguous, every other tensor whole, and a
    conv at least 2 wide (the kernels keep a window of at least one input; a width-1 conv runs the torch ops)."""
    return (cpu_fp32(proj, window, conv, *rest) and proj.stride(-1) == 1 and conv.shape[-1] >= 2
            and all(t.is_contiguous() for t in (window, conv, *rest)))  # fmt: skip


def _runs(*xs: torch.Tensor) -> bool:
    return cpu_fp32(*xs) and available()


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [N, C] with contiguous rows (a view when possible)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last axis, times `scale` (fp32, as HF's Llama/Qwen RMSNorm computes it)."""
    if _runs(x, scale) and x.numel():
        y: torch.Tensor = torch.ops.wkvm_fused.rms_norm(_rows(x), scale.contiguous(), eps)
        return y.view(x.shape)
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * scale


def add_rms_norm(x: torch.Tensor, a: torch.Tensor, scale: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(x + a, rms_norm(x + a)): a residual add and the next sublayer's pre-norm in one pass."""
    if _runs(x, a, scale) and x.numel() and x.shape == a.shape:
        s, y = torch.ops.wkvm_fused.add_rms_norm(_rows(x), _rows(a), scale.contiguous(), eps)
        return s.view(x.shape), y.view(x.shape)
    s = x + a
    return s, rms_norm(s, scale, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last axis (a fused gate/up projection's output)."""
    if _runs(gate_up) and gate_up.numel():
        y: torch.Tensor = torch.ops.wkvm_fused.silu_mul(_rows(gate_up))
        return y.view(*gate_up.shape[:-1], gate_up.shape[-1] // 2)
    gate, up = gate_up.chunk(2, -1)
    return F.silu(gate) * up


def greedy(logits: torch.Tensor) -> tuple[list[int], list[bool]]:
    """Per row of logits [B, V]: the first index of its maximum (torch.argmax) and whether every value is finite."""
    if _runs(logits) and logits.numel():
        ids, finite = torch.ops.wkvm_fused.greedy(_rows(logits))
    else:
        ids, finite = torch.argmax(logits, -1), torch.isfinite(logits).all(-1)
    return ids.tolist(), finite.tolist()


def sample(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float, u: float,
           counts: torch.Tensor | None = None, seen: torch.Tensor | None = None, frequency: float = 0.0,
           presence: float = 0.0, repetition: float = 1.0) -> int | None:  # fmt: skip
    """One row's token from logits [V] with uniform u in [0, 1) (-1: no valid distribution), as the sampler's torch
    path (`apply_penalties` with the output's token `counts` and the `seen` tokens when given, `filtered_probs`, then
    `draw`) picks it, to rounding; None where the kernel does not run (the sampler then takes that path)."""
    if _runs(logits):
        return int(torch.ops.wkvm_fused.sample(logits.contiguous(), temperature, top_k, top_p, min_p, u, counts, seen,
                                               frequency, presence, repetition))  # fmt: skip
    return None


def pages_fit(tokens: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor, *caches: torch.Tensor) -> bool:
    """Whether `rope_attend` runs a step of `tokens` new tokens a row with heads of `head_dim` on these angles and KV
    pools (else the caller rotates, appends and attends with torch): one token, CPU float32 angles, and pools all
    float32 or all float16 (`--kv-dtype`); q, k and v must be CPU float32 too (`cpu_fp32`)."""
    dtype = caches[0].dtype if caches else torch.float32
    pools = all(c.is_cpu and c.dtype == dtype for c in caches) and (
        dtype == torch.float32 or (dtype == torch.float16 and head_dim % 8 == 0))  # float16: whole 8-lane vectors
    return tokens == 1 and cos.is_contiguous() and sin.is_contiguous() and pools and _runs(cos, sin)


def rope_attend_fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     *caches: torch.Tensor) -> bool:  # fmt: skip
    """Whether `rope_attend` runs on these tensors (`pages_fit`, q, k and v CPU float32)."""
    return cpu_fp32(q, k, v) and pages_fit(q.shape[1], q.shape[-1], cos, sin, *caches)


def llama_layer(x: torch.Tensor, norms: tuple[torch.Tensor, torch.Tensor], mats: list[torch.Tensor],
                kernel: tuple[str, list[int]], eps: float, cos: torch.Tensor, sin: torch.Tensor, pages: Pages,
                scale: float, heads: tuple[int, int]) -> torch.Tensor:  # fmt: skip
    """One decode step (x [B, 1, C] CPU float32) of a pre-norm attention + SiLU-MLP layer in one call: `norms` (input,
    post-attention), `mats` (qkv, o, gate_up, down) all on the native `kernel` (`linear.native_kernel`), the pages
    where `pages_fit` (`PagedKV.fused_pages`), `heads` (query, key/value). The same ops in the same order as the
    layer's torch path, so the same bits."""
    y: torch.Tensor = torch.ops.wkvm_fused.llama_layer(x, *norms, *mats, *kernel, eps, cos, sin, *pages, scale, *heads)
    return y


Pages = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]  # kflat, vflat, table, lengths, page_tokens


def llama_layers(x: torch.Tensor, norms: list[torch.Tensor], mats: list[torch.Tensor], kernel: tuple[str, list[int]],
                 eps: float, cos: torch.Tensor, sin: torch.Tensor, pools: tuple[list[torch.Tensor], list[torch.Tensor]],
                 pages: tuple[torch.Tensor, torch.Tensor, int], scale: float,
                 heads: tuple[int, int]) -> torch.Tensor:  # fmt: skip
    """`llama_layer` for every layer in one call (the same calls in order, so the same bits): `norms` two a layer,
    `mats` four a layer, `kernel` one namespace and eight arguments a layer, `pools` the layers' key and value
    pools, `pages` the step's table, lengths and page size."""
    y: torch.Tensor = torch.ops.wkvm_fused.llama_layers(x, norms, mats, *kernel, eps, cos, sin, *pools, *pages, scale,
                                                        *heads)  # fmt: skip
    return y


def rope_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kflat: torch.Tensor, vflat: torch.Tensor, table: torch.Tensor, lengths: torch.Tensor,
                page_tokens: int, scale: float) -> torch.Tensor:  # fmt: skip
    """One new token per row (q [B, 1, Hq, D], k, v [B, 1, Hkv, D]; cos, sin [B, 1, 1, R], as `rope.angles` gives
    them): RoPE on q and k, k and v written at position lengths[b] of row b's pages (`table` [B, pages] of
    `page_tokens` token slots in kflat / vflat [slots, Hkv, D]), then grouped-query attention over the row's
    lengths[b] + 1 tokens; returns [B, 1, Hq, D]. Only where `rope_attend_fits`."""
    q, k, v = (x if x.stride(-1) == 1 and x.stride(-2) == x.shape[-1] else x.contiguous() for x in (q, k, v))
    out: torch.Tensor = torch.ops.wkvm_fused.rope_attend(q, k, v, cos, sin, kflat, vflat, table, lengths,
                                                        page_tokens, scale)  # fmt: skip
    return out
