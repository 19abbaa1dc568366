"""The fused per-layer kernel (wkvm/models/fused.cpp): each op equals the torch ops it replaces up to rounding, the
decode attention reads and writes pages in place like `PagedKV.append` + `attend`, and without a compiler every op
falls back to torch after one warning."""

import logging
import random
import re
import subprocess

import pytest
import torch
import torch.nn.functional as F

from wkvm.engine.kv_pages import PagedKV, PagePool, SeqKV
from wkvm.models import fused
from wkvm.models.kv import DenseKV, key_name, rope_append_attend, value_name
from wkvm.models.rope import angles, frequencies
from wkvm.models.spec import StateSpec, TensorSpec

needs_kernel = pytest.mark.skipif(not fused.available(), reason="the fused kernel cannot be built here (no compiler)")


def torch_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * w


@needs_kernel
@pytest.mark.parametrize("shape", [(1, 1, 576), (3, 5, 64), (2, 7), (200, 96)])
def test_norms_and_silu_equal_torch(shape):
    g = torch.Generator().manual_seed(len(shape))
    x, a = torch.randn(*shape, generator=g) * 3, torch.randn(*shape, generator=g)
    w = torch.randn(shape[-1], generator=g)
    torch.testing.assert_close(fused.rms_norm(x, w, 1e-6), torch_rms_norm(x, w, 1e-6), rtol=1e-5, atol=1e-5)
    s, y = fused.add_rms_norm(x, a, w, 1e-5)
    torch.testing.assert_close(s, x + a, rtol=0, atol=0)
    torch.testing.assert_close(y, torch_rms_norm(x + a, w, 1e-5), rtol=1e-5, atol=1e-5)
    gu = torch.randn(*shape[:-1], 2 * shape[-1], generator=g) * 8  # silu's tails: large negative and positive
    gate, up = gu.chunk(2, -1)
    torch.testing.assert_close(fused.silu_mul(gu), F.silu(gate) * up, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_non_contiguous_inputs_and_views_are_read_correctly():
    base = torch.randn(4, 10, 32)
    x = base[:, 2:5, :16]  # rows with a stride
    w = torch.randn(16)
    torch.testing.assert_close(fused.rms_norm(x, w, 1e-6), torch_rms_norm(x, w, 1e-6), rtol=1e-5, atol=1e-5)
    gu = base[:, :, :]
    torch.testing.assert_close(fused.silu_mul(gu.transpose(0, 1)), F.silu(gu.transpose(0, 1)[..., :16])
                               * gu.transpose(0, 1)[..., 16:], rtol=1e-5, atol=1e-5)  # fmt: skip


def kv_spec(hkv: int, d: int) -> StateSpec:
    return StateSpec("test", tuple(TensorSpec(f"layers.0.{x}", (hkv, d), kind="kv") for x in "kv"))


@needs_kernel
@pytest.mark.parametrize("hq,hkv,d,rotary,page", [(9, 3, 64, 64, 16), (4, 4, 6, 6, 1), (8, 2, 10, 4, 3),
                                                  (3, 1, 8, 8, 5)])  # fmt: skip
def test_decode_attention_equals_append_and_attend(hq, hkv, d, rotary, page):
    """Rows of different lengths whose pages are scattered over the pool (one forked, sharing pages): the kernel's
    output and the keys/values it writes equal the torch path's, which runs on a copy of the pool."""
    spec = kv_spec(hkv, d)
    pools = [PagePool(spec, n_pages=80, page_tokens=page) for _ in range(2)]
    g = torch.Generator().manual_seed(hq * 100 + d)
    lengths = (0, 7, 23)
    seqs_per_pool = []
    for pool in pools:
        pool.alloc()  # page 0 taken: no row starts at the pool's start
        seqs = []
        for n in lengths:
            s = SeqKV()
            s.reserve(pool, n)
            s.length = n
            seqs.append(s)
        twin = seqs[2].fork(pool)  # shares the third row's pages
        seqs.append(twin)
        seqs_per_pool.append(seqs)
    for name in pools[0].pages:  # the same random history in both pools
        pools[0].pages[name].normal_(generator=g)
        pools[1].pages[name].copy_(pools[0].pages[name])
    inv = frequencies(10000.0, rotary)
    B = len(lengths) + 1
    q, k, v = torch.randn(B, 1, hq, d, generator=g), torch.randn(B, 1, hkv, d, generator=g), torch.randn(
        B, 1, hkv, d, generator=g)  # fmt: skip
    outs = []
    for pool, seqs, run in ((pools[0], seqs_per_pool[0], "kernel"), (pools[1], seqs_per_pool[1], "torch")):
        for s in seqs:
            s.reserve(pool, 1)
        kv = PagedKV(pool, seqs, 1)
        cos, sin = angles(inv, kv.positions(), 1)
        if run == "kernel":
            outs.append(kv.rope_attend(0, q, k, v, cos, sin, d**-0.5))
        else:
            outs.append(rope_append_attend(kv, 0, q, k, v, cos, sin, d**-0.5))
        kv.commit()
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    for s0, s1 in zip(*seqs_per_pool, strict=True):
        a, b = s0.to_dense(pools[0]), s1.to_dense(pools[1])
        for name in a:
            torch.testing.assert_close(a[name], b[name], rtol=1e-6, atol=1e-6)


@needs_kernel
def test_dense_cache_decode_runs_the_kernel_and_equals_torch(monkeypatch):
    hq, hkv, d = 6, 2, 8
    g = torch.Generator().manual_seed(3)
    states = [{name(0): torch.randn(2, 5, hkv, d, generator=g) for name in (key_name, value_name)}]
    states.append({name: t.clone() for name, t in states[0].items()})
    q, k, v = torch.randn(2, 1, hq, d, generator=g), torch.randn(2, 1, hkv, d, generator=g), torch.randn(
        2, 1, hkv, d, generator=g)  # fmt: skip
    cos, sin = angles(frequencies(500.0, d), torch.full((2,), 5), 1)
    calls = []
    real = fused.rope_attend
    monkeypatch.setattr(fused, "rope_attend", lambda *a: calls.append(1) or real(*a))
    got = DenseKV(states[0], [0]).rope_attend(0, q, k, v, cos, sin, 0.3)
    want = rope_append_attend(DenseKV(states[1], [0]), 0, q, k, v, cos, sin, 0.3)
    assert calls == [1]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for name in states[0]:
        torch.testing.assert_close(states[0][name], states[1][name], rtol=1e-6, atol=1e-6)


@needs_kernel
def test_a_page_table_that_does_not_fit_is_refused():
    pool = PagePool(kv_spec(1, 4), n_pages=2, page_tokens=2)
    kf, vf = pool.flat("layers.0.k"), pool.flat("layers.0.v")
    q, k = torch.randn(1, 1, 4), torch.randn(1, 1, 4)
    cs = torch.ones(1, 4)
    with pytest.raises(RuntimeError, match="outside the pool"):
        fused.rope_attend(q, k, k, cs, cs, kf, vf, torch.tensor([[5]]), torch.tensor([0]), 2, 1.0)
    with pytest.raises(RuntimeError, match="do not fit its page table"):
        fused.rope_attend(q, k, k, cs, cs, kf, vf, torch.tensor([[0]]), torch.tensor([2]), 2, 1.0)
    with pytest.raises(RuntimeError, match="the same slots"):  # a value pool shorter than the key pool
        fused.rope_attend(q, k, k, cs, cs, kf, vf[:2], torch.tensor([[1]]), torch.tensor([0]), 2, 1.0)


@needs_kernel
def test_every_layers_pools_must_be_alike_in_one_call():
    """`llama_layers` on int8 weights checks the page table against layer 0's pools once: every other layer's pools
    must then be the same shape and type, or the call is refused before anything is read."""
    from wkvm.models import int8

    c, hq, hkv, d, f = 8, 2, 1, 4, 8
    g = torch.Generator().manual_seed(0)
    layer = [int8.quantize(torch.randn(n, k, generator=g)) for n, k in (((hq + 2 * hkv) * d, c), (c, hq * d),
                                                                        (2 * f, c), (c, f))]  # fmt: skip
    norms, mats, args = [torch.ones(c)] * 4, layer * 2, [0] * 16  # two layers, the portable kernel path
    cos, sin = angles(frequencies(500.0, d), torch.zeros(1, dtype=torch.long), 1)
    table, lengths = torch.tensor([[0]]), torch.tensor([0])

    def call(pools: list[torch.Tensor]) -> torch.Tensor:
        return torch.ops.wkvm_fused.llama_layers(torch.randn(1, 1, c, generator=g), norms, mats, "wkvm_int8", args,
                                                 1e-6, cos, sin, pools[::2], pools[1::2], table, lengths, 4, 0.5,
                                                 hq, hkv)  # fmt: skip

    assert call([torch.zeros(8, hkv, d) for _ in range(4)]).shape == (1, 1, c)
    with pytest.raises(RuntimeError, match="every layer's key and value pools must be alike"):
        call([torch.zeros(8, hkv, d)] * 3 + [torch.zeros(4, hkv, d)])  # layer 1's values: fewer slots
    with pytest.raises(RuntimeError, match="every layer's key and value pools must be alike"):
        call([torch.zeros(8, hkv, d)] * 2 + [torch.zeros(8, hkv, d, dtype=torch.float16)] * 2)


def test_without_a_compiler_every_op_falls_back_after_one_warning(monkeypatch, caplog):
    def no_compiler(*args, **kwargs) -> None:
        raise RuntimeError("Error building extension: c++: command not found")

    fused.available.cache_clear()
    monkeypatch.setattr(fused, "load_kernel", no_compiler)
    monkeypatch.setattr(fused, "BUILT", {})  # this process's record of real builds stays as it was
    monkeypatch.setattr(torch.ops.wkvm_fused, "rms_norm", None, raising=False)  # would fail if called
    try:
        with caplog.at_level(logging.WARNING, logger="wkvm.fused"):
            x, w = torch.randn(2, 8), torch.randn(8)
            torch.testing.assert_close(fused.rms_norm(x, w, 1e-6), torch_rms_norm(x, w, 1e-6))
            assert not fused.rope_attend_fits(x[:, None, None], x[:, None, None], x[:, None, None], x, x)
        (message,) = [r.getMessage() for r in caplog.records if r.name == "wkvm.fused"]
        assert "fused kernel unavailable" in message and "command not found" in message
    finally:
        fused.available.cache_clear()


def avoided_fma_bits(flags: tuple[str, ...]) -> int | None:
    """How wide a loop-carried multiply-add chain GCC keeps as a multiply and an add under `flags` (its
    avoid-fma-max-bits param); None where the compiler is no GCC that says."""
    from torch.utils import cpp_extension

    compiler = cpp_extension.get_cxx_compiler()
    if not cpp_extension.check_compiler_is_gcc(compiler):
        return None
    run = subprocess.run([compiler, "-Q", "--help=params", *flags], capture_output=True, text=True)
    found = re.search(r"avoid-fma-max-bits=\S*\s+(\d+)", run.stdout)
    return int(found.group(1)) if run.returncode == 0 and found else None


def test_gcc_keeps_every_multiply_add_fused_under_amd_zen_tuning():
    """-march=native on a Zen 3 tunes for znver3, whose "avoid FMA chains" left some loops' multiply-adds unfused
    and others not: a LoRA row's bits followed its batch mates (the first real AVX2-only machine, session 50).
    The kernels' flags turn that tuning off; checked here with the tuning asked for on any CPU."""
    zen = ("-mtune=znver3",)
    if avoided_fma_bits(fused.CFLAGS + zen) in (None, 0):
        pytest.skip("this C++ compiler is no GCC that avoids FMA chains for znver3 (nothing to turn off)")
    assert fused.cflags() == fused.CFLAGS + fused.GCC_CFLAGS
    assert avoided_fma_bits(fused.cflags() + zen) == 0


def test_off_forces_the_torch_path_and_a_bad_setting_is_a_clear_error(monkeypatch):
    fused.available.cache_clear()
    try:
        monkeypatch.setenv("WKVM_FUSED", "off")
        assert not fused.available()
        fused.available.cache_clear()
        monkeypatch.setenv("WKVM_FUSED", "fast")
        with pytest.raises(ValueError, match="use auto or off"):
            fused.available()
    finally:
        fused.available.cache_clear()


def test_the_compute_key_names_how_the_fused_kernels_are_built(monkeypatch):
    """A chat checkpoint's key and system_fingerprint (`compute_paths`) change with the fused kernels' build: on or
    off, the compiler, its flags and the CPU that -march=native tunes for. They compute the same model as the torch
    path up to rounding, but int8 weights magnify it: SmolLM2's int8 logprobs moved 0.06 nats a token between the
    fused kernels and the torch path, or a native and a haswell build, so a checkpoint of one had been reused on the
    other (session 60)."""
    from wkvm.models.linear import compute_paths

    def key() -> str:
        return compute_paths("int8", "cpu")

    here = key()
    assert key() == here and "fused kernels" in here and compute_paths("int8", "cuda").count("fused") == 0
    with monkeypatch.context() as m:
        m.setenv("WKVM_FUSED", "off")
        assert key() != here and "fused kernels off (WKVM_FUSED=off)" in key()
    with monkeypatch.context() as m:  # oneDNN held to fewer instructions (bench/common.py AVX2_ENV) sums otherwise
        m.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
        m.delenv("DNNL_MAX_CPU_ISA", raising=False)
        unheld = key()
        m.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
        assert key() != unheld and "oneDNN ISA at most AVX2" in key()
    with monkeypatch.context() as m:
        m.setenv("CXX", "/nonexistent/c++")
        assert "fused kernels off (no C++ compiler" in key()
    if "fused kernels off" in here:
        pytest.skip("no C++ compiler here: the kernels' builds are not part of this machine's key")
    with monkeypatch.context() as m:
        m.setattr(fused, "cflags", lambda: ("-O3", "-march=haswell"))
        assert key() != here and "-march=haswell" in key()
    native = fused.MARCH == "native"  # else WKVM_FUSED_MARCH names the target itself
    with monkeypatch.context() as m:  # the same flags on another CPU: native builds for it
        m.setattr(fused, "native_target", lambda compiler: "-march=icelake-server (90 target options, digest 0)")
        assert (key() != here) == native
        m.setattr(fused, "native_target", lambda compiler: None)  # a compiler that does not say: the CPU model
        m.setattr(fused, "cpu_model", lambda: "vendor_id GenuineIntel cpu family 6 model 106, flags 0")
        assert (key() != here) == native
    if native and fused.cflags() == fused.CFLAGS + fused.GCC_CFLAGS:  # GCC says what -march=native means here
        assert re.search(r"for -march=\S+ \(\d+ target options, digest [0-9a-f]{8}\)", here), here
    with monkeypatch.context() as m:  # a kernel that failed to build (its model runs torch ops instead)
        m.setattr(fused, "BUILT", {**fused.BUILT, "step.cpp": False})
        assert key() != here and "step.cpp failed to build (torch ops instead)" in key()


@needs_kernel
def test_greedy_equals_argmax_and_flags_every_kind_of_non_finite_row():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(7, 1001, generator=g)
    logits[1, 17] = logits[1, 900] = 50.0  # a tie: the first index wins, as torch.argmax answers
    logits[2, 3] = float("nan")
    logits[3, 1000] = float("inf")
    logits[4, 0] = float("-inf")
    logits[5] = -3.0  # every value the same
    ids, finite = fused.greedy(logits)
    assert finite == [True, True, False, False, False, True, True]
    want = torch.argmax(logits, -1).tolist()
    assert [i for i, ok in zip(ids, finite, strict=True) if ok] == [w for w, ok in zip(want, finite, strict=True) if ok]
    assert ids[1] == 17 and ids[5] == 0
    view = torch.randn(3, 2, 50, generator=g)[:, 1]  # rows with a stride
    assert fused.greedy(view)[0] == torch.argmax(view, -1).tolist()


@needs_kernel
@pytest.mark.parametrize("d,dtype", [(16, torch.float32), (64, torch.float32), (64, torch.float16),
                                     (24, torch.float16)])  # fmt: skip
def test_a_rows_attention_does_not_depend_on_its_batch(d, dtype):
    """The same row (300 cached tokens) alone and next to rows of other lengths gives the same bits: its chunks are
    fixed, not sized by the batch or the threads (float16 pages and head sizes that take the grouped loops too)."""
    hq, hkv, page = 6, 2, 16
    outs = []
    for lengths in ((300,), (300, 40, 1000, 7)):
        pool = PagePool(kv_spec(hkv, d), n_pages=200, page_tokens=page, dtype=dtype)
        pool.pages["layers.0.k"].normal_(generator=torch.Generator().manual_seed(1))
        pool.pages["layers.0.v"].normal_(generator=torch.Generator().manual_seed(2))
        seqs = []
        for n in lengths:
            s = SeqKV()
            s.reserve(pool, n + 1)
            s.length = n
            seqs.append(s)
        kv = PagedKV(pool, seqs, 1)
        B = len(lengths)
        q = torch.randn(1, 1, hq, d, generator=torch.Generator().manual_seed(3)).expand(B, 1, hq, d).contiguous()
        k = torch.randn(1, 1, hkv, d, generator=torch.Generator().manual_seed(4)).expand(B, 1, hkv, d).contiguous()
        cos, sin = angles(frequencies(10000.0, d), kv.positions(), 1)
        outs.append(kv.rope_attend(0, q, k, k, cos, sin, d**-0.5)[0])
    assert torch.equal(outs[0], outs[1])


@needs_kernel
@pytest.mark.parametrize("d", [16, 64])
def test_a_dense_cache_and_pages_give_the_same_bits(d):
    """`model.decode` (DenseKV, one page per row) and the engine (PagedKV, 16-token pages) run the same kernel with the
    same chunks, so their outputs are equal, not just close."""
    hq, hkv, n = 6, 2, 300
    g = torch.Generator().manual_seed(11)
    keys, values = torch.randn(1, n, hkv, d, generator=g), torch.randn(1, n, hkv, d, generator=g)
    q, k, v = (torch.randn(1, 1, h, d, generator=g) for h in (hq, hkv, hkv))
    cos, sin = angles(frequencies(10000.0, d), torch.tensor([n]), 1)
    dense = DenseKV({key_name(0): keys.clone(), value_name(0): values.clone()}, [0]).rope_attend(0, q, k, v, cos, sin,
                                                                                                  0.25)  # fmt: skip
    pool = PagePool(kv_spec(hkv, d), n_pages=40, page_tokens=16)
    seq = SeqKV.from_dense(pool, {key_name(0): keys[0], value_name(0): values[0]})
    seq.reserve(pool, 1)
    paged = PagedKV(pool, [seq], 1).rope_attend(0, q, k, v, cos, sin, 0.25)
    assert torch.equal(dense, paged)


@needs_kernel
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (6, 3, 32), (4, 4, 16), (8, 2, 64), (8, 1, 16)])
def test_float16_pages_give_the_same_bits_eight_or_four_tokens_at_a_time(hq, hkv, d):
    """With float16 pages the kernel scores eight tokens a pass where a page holds them (scores8h: groups of 1-3 query
    heads) and four at a time otherwise; both add each score in the same order, so pages of 16 tokens and pages of 4
    (never eight in one) give equal outputs, for rows whose lengths leave every kind of tail."""
    g = torch.Generator().manual_seed(hq * 10 + d)
    lengths = (5, 8, 23, 44, 130)
    history = [{name: torch.randn(n, hkv, d, generator=g).half().float() for name in (key_name(0), value_name(0))}
               for n in lengths]  # fmt: skip
    q, k, v = (torch.randn(len(lengths), 1, h, d, generator=g) for h in (hq, hkv, hkv))
    outs = []
    for page in (16, 4):
        pool = PagePool(kv_spec(hkv, d), n_pages=200, page_tokens=page, dtype=torch.float16)
        seqs = [SeqKV.from_dense(pool, dense) for dense in history]
        for s in seqs:
            s.reserve(pool, 1)
        kv = PagedKV(pool, seqs, 1)
        cos, sin = angles(frequencies(10000.0, d), kv.positions(), 1)
        outs.append(kv.rope_attend(0, q, k, v, cos, sin, d**-0.5))
    assert torch.equal(outs[0], outs[1])


@needs_kernel
@pytest.mark.parametrize("hq,hkv,d,page,dtype", [
    (9, 3, 64, 16, torch.float16), (9, 3, 64, 5, torch.float16), (6, 3, 32, 4, torch.float16),
    (8, 2, 64, 16, torch.float32), (4, 1, 128, 7, torch.float32), (2, 2, 16, 16, torch.float16),
    (5, 1, 32, 16, torch.float16), (6, 2, 24, 16, torch.float16)])  # fmt: skip
def test_a_prompt_chunks_rows_give_the_bits_of_one_token_steps(hq, hkv, d, page, dtype):
    """A prompt chunk's tokens as rows of one call (`token_rows`: rows reading the same pages, whose chunks of keys
    the kernel transposes once for all of them, and whose float16 values it sums two rows at a time) give the bits
    that stepping the same tokens one at a time gives: 1-5 query heads per kv head, pages that do and do not divide the
    kernel's 128-token chunks (every kind of page-run tail), 48 new tokens after a history of 250 (rows whose last
    chunk is short; enough rows on each of two threads for the transposed path)."""
    g = torch.Generator().manual_seed(hq * 1000 + d * 10 + page)
    history, T = 250, 48
    dense = {name: torch.randn(history, hkv, d, generator=g).to(dtype).float() for name in (key_name(0), value_name(0))}
    q, k, v = (torch.randn(1, T, h, d, generator=g) for h in (hq, hkv, hkv))
    inv = frequencies(10000.0, d)
    outs = []
    for run in ("chunk", "steps"):
        pool = PagePool(kv_spec(hkv, d), n_pages=120, page_tokens=page, dtype=dtype)
        seq = SeqKV.from_dense(pool, dense)
        seq.reserve(pool, T)
        if run == "chunk":
            kv = PagedKV(pool, [seq], T)
            cos, sin = angles(inv, kv.positions(), T)
            outs.append(kv.rope_attend(0, q, k, v, cos, sin, d**-0.5, token_rows=True))
            continue
        steps = []
        for t in range(T):
            kv = PagedKV(pool, [seq], 1)
            cos, sin = angles(inv, kv.positions(), 1)
            steps.append(kv.rope_attend(0, q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], cos, sin, d**-0.5))
            kv.commit()
        outs.append(torch.cat(steps, 1))
    assert torch.equal(outs[0], outs[1])


@needs_kernel
@pytest.mark.parametrize("seed", range(4))
def test_rows_of_one_call_give_the_bits_each_row_gives_alone(seed):
    """Random calls whose rows share pages in every way the grouping must handle (a prompt chunk; two sequences sharing
    a prefix, the second's lengths continuing or restarting; runs of equal lengths; shuffled lengths), any page size,
    head size, group and thread count (items split mid-row): each row's output equals the row run alone."""
    rng = random.Random(seed)
    for _ in range(6):
        dtype, d = rng.choice([torch.float16, torch.float32]), rng.choice([16, 32, 64, 128])
        g, hkv, page = rng.choice([1, 2, 3, 4, 5, 6]), rng.choice([1, 2]), rng.choice([1, 3, 4, 5, 7, 16, 100, 256])
        kind, hist, T = rng.choice(["chunk", "fork", "equal", "shuffle"]), rng.randint(0, 420), rng.randint(16, 70)
        hq, n_pages = g * hkv, (hist + T + 656) // page + 8
        kf, vf = (torch.randn(n_pages * page, hkv, d) * 2).to(dtype), torch.randn(n_pages * page, hkv, d).to(dtype)
        need, perm = (hist + T + page) // page + 2, rng.sample(range(n_pages), n_pages)
        lengths, tables = [hist + t for t in range(T)], [perm[:need] for _ in range(T)]
        if kind == "fork":
            cut, shared = rng.randint(1, T - 1), rng.randint(0, need)
            restart = rng.random() < 0.5
            for r in range(cut, T):
                tables[r] = perm[:shared] + perm[need : 2 * need - shared]
                lengths[r] = hist + rng.randint(0, 5) + (r - cut) if restart else lengths[r]
        elif kind == "equal":
            lengths = sorted(hist + rng.randint(0, T) for _ in range(T))
        elif kind == "shuffle":
            rng.shuffle(lengths)
        table, lens = torch.tensor(tables), torch.tensor(lengths)
        q, k, v = torch.randn(T, 1, hq, d), torch.randn(T, 1, hkv, d), torch.randn(T, 1, hkv, d)
        cos, sin = torch.randn(T, d), torch.randn(T, d)
        writer: dict[int, int] = {}  # rows writing one slot write the same key and value (the last one wins)
        for b in range(T):
            a = writer.setdefault(tables[b][lengths[b] // page] * page + lengths[b] % page, b)
            k[b], v[b], cos[b], sin[b] = k[a], v[a], cos[a], sin[a]
        threads = torch.get_num_threads()
        torch.set_num_threads(rng.choice([1, 2, 3]))
        try:
            out = fused.rope_attend(q, k, v, cos, sin, kf, vf, table, lens, page, d**-0.5)
            for b in range(T):
                one = slice(b, b + 1)
                alone = fused.rope_attend(q[one], k[one], v[one], cos[one], sin[one], kf.clone(), vf.clone(),
                                          table[one], lens[one], page, d**-0.5)  # fmt: skip
                assert torch.equal(alone[0], out[b]), (dtype, d, g, hkv, page, kind, hist, T, b)
        finally:
            torch.set_num_threads(threads)


# int4 groups are 32 wide: every matrix's input width a multiple of 32. The odd shape (int8, fp32) has matrices with
# rows past the last 32-row block, inputs ending in a short group and five rows (uneven over two threads).
EVEN = dict(hidden_size=64, intermediate_size=96, num_attention_heads=8, num_key_value_heads=2, head_dim=8)
ODD = dict(hidden_size=40, intermediate_size=72, num_attention_heads=5, num_key_value_heads=1, head_dim=8)


@pytest.mark.parametrize(("dtype", "shape"), [("float32", EVEN), ("int8", EVEN), ("int4", EVEN), ("float32", ODD),
                                              ("int8", ODD)])  # fmt: skip
@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
def test_a_llama_decode_layer_in_one_call_gives_the_bits_of_its_ops(tmp_path, monkeypatch, dtype, shape, kv_dtype):
    """`fused.llama_layers` (a decode step's every Llama layer in one call) and `fused.llama_layer` (one layer on fp32,
    int8 or int4 weights in one call; on int8 in one parallel region) against the same layers as separate ops: every
    token and logprob of a batch of rows equal, to the bit."""
    from conftest import CHAR_VOCAB, write_char_tokenizer
    from families.llama import write_checkpoint

    from wkvm.config import EngineConfig
    from wkvm.engine.engine import Engine
    from wkvm.models.linear import native_kernel
    from wkvm.models.llama.model import LINEAR, Llama
    from wkvm.sampling_params import SamplingParams
    from wkvm.weights.loader import load_model, load_text_tools

    path = write_checkpoint(tmp_path / "llama", len(CHAR_VOCAB), **shape)
    write_char_tokenizer(path)
    model = load_model(path, dtype=dtype)
    layer = model.weights.layer(0)
    if not fused.available() or native_kernel([layer[k] for k in LINEAR], 3) is None:
        pytest.skip(f"no native {dtype} kernel or fused ops here (no compiler, WKVM_FUSED=off)")
    calls, whole = [], []
    one_call, all_layers = fused.llama_layer, fused.llama_layers
    monkeypatch.setattr("wkvm.models.llama.model.llama_layer", lambda *a: calls.append(1) or one_call(*a))
    monkeypatch.setattr("wkvm.models.llama.model.llama_layers", lambda *a: whole.append(1) or all_layers(*a))
    rows = 3 if shape is EVEN else 5
    prompts = [[(7 * i + 3 * j) % len(CHAR_VOCAB) for j in range(4 + 5 * i)] for i in range(rows)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)

    def run() -> list[tuple[list[int], object]]:
        engine = Engine(model, load_text_tools(path, model.family)[0], EngineConfig(n_slots=rows, kv_dtype=kv_dtype))
        handles = [engine.submit(p, params) for p in prompts]
        engine.run_until_done()
        return [(h.output.token_ids, h.output.logprobs) for h in handles]

    together = run()
    assert len(whole) >= 11 and not calls  # every decode step's layers in one call
    with monkeypatch.context() as m:
        m.setattr(Llama, "decode_groups", lambda self, xs, *a: [None] * len(xs))
        assert run() == together
        assert len(calls) >= 11 * model.config.n_layer  # every decode step of every layer, a call each
        m.setattr(Llama, "_fused_block", lambda *a: None)
        assert run() == together


def sample_cases():
    """(logits [V], SamplingParams) pairs: the filter cases of test_units on 4 tokens, and 5,000-token rows from flat to
    peaked under each filter and their mix, some with tokens masked to -inf (a grammar's way)."""
    from wkvm.sampling_params import SamplingParams

    small = torch.log(torch.tensor([0.1, 0.2, 0.3, 0.4]))
    cases = [(small, SamplingParams(**kw)) for kw in (
        {}, dict(temperature=0.5), dict(top_k=2), dict(top_p=0.5), dict(top_p=0.8), dict(min_p=0.6),
        dict(temperature=0.5, top_k=3))]  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    for scale in (0.3, 3.0, 30.0):
        x = torch.randn(5000, generator=gen) * scale
        masked = x.masked_fill(torch.rand(5000, generator=gen) < 0.5, float("-inf"))
        for kw in (dict(temperature=0.7), dict(temperature=0.7, top_p=0.9), dict(temperature=1.3, top_k=40),
                   dict(temperature=0.8, top_p=0.95, min_p=0.05), dict(temperature=0.6, top_k=300, top_p=0.5),
                   dict(temperature=0.9, top_p=0.9, frequency_penalty=0.8, presence_penalty=-0.4),
                   dict(temperature=0.5, repetition_penalty=1.7, frequency_penalty=0.3)):
            cases += [(x, SamplingParams(**kw)), (masked, SamplingParams(**kw))]  # fmt: skip
    # ties at the top-p cut (both paths keep the lowest ids first): flat rows, whole numbers, bf16-rounded logits
    # (what --dtype bfloat16 gives), where topk's own order among ties had kept other tokens than the kernel
    # (flat rows of 11 and 3,001: no cut falls exactly on a sum, where the two paths' rounding decides)
    tied = [torch.zeros(11), torch.randint(0, 4, (300,), generator=gen).float(),
            (torch.randn(5000, generator=gen) * 3).bfloat16().float(), torch.zeros(3001)]  # fmt: skip
    for x in tied:
        cases += [(x, SamplingParams(temperature=0.8, top_p=q)) for q in (0.35, 0.9, 0.95)]
    return cases


@needs_kernel
def test_sample_draws_what_the_torch_path_draws():
    """The kernel's `sample` against the sampler's torch path (apply_penalties, filtered_probs, then the cumulative
    sum): for 199 evenly spaced uniforms, its token has probability > 0 there and u falls within that token's step of
    the torch path's cumulative distribution (to 1e-5: exp and sums round differently); a row with NaN or nothing
    finite gives -1. Penalized rows have an output of 400 tokens and a prompt of 300 drawn from the first 1,000."""
    from wkvm.engine.sampler import SamplerRow, apply_penalties, filtered_probs

    gen = torch.Generator().manual_seed(4)
    for x, p in sample_cases():
        ids = torch.randint(0, min(1000, len(x)), (700,), generator=gen).tolist()
        row = SamplerRow(p, prompt_ids=ids[:300], output_ids=ids[300:])
        counts = row.output_counts(len(x)) if p.frequency_penalty or p.presence_penalty else None
        seen = row.seen(len(x)) if p.repetition_penalty != 1.0 else None
        probs = filtered_probs(apply_penalties(x, row), p).double()
        probs = probs / probs.sum()
        cdf = probs.cumsum(-1)
        for u in torch.linspace(0.005, 0.995, 199).tolist():
            t = fused.sample(x, p.temperature, p.top_k, p.top_p, p.min_p, u, counts, seen, p.frequency_penalty,
                             p.presence_penalty, p.repetition_penalty)  # fmt: skip
            assert t is not None and 0 <= t < len(x) and probs[t] > 0, (p, u, t)
            assert float(cdf[t] - probs[t]) - 1e-5 <= u <= float(cdf[t]) + 1e-5, (p, u, t)
    assert fused.sample(torch.tensor([0.0, float("nan")]), 1.0, 0, 1.0, 0.0, 0.5) == -1
    assert fused.sample(torch.full((3,), float("-inf")), 1.0, 0, 1.0, 0.0, 0.5) == -1
