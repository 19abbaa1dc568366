"""int4 weights (`dtype="int4"`): group-wise (32) asymmetric int4 matrices, the native decode kernel on every ISA this
CPU runs (AVX2 and portable C++ forced on AVX-512 machines), the fallbacks (no compiler; K not a multiple of 32), and
int4 models of every family in the engine."""

import json
import logging
import random

import pytest
import torch
from conftest import CHAR_VOCAB, greedy_reference
from families import all_families

from wkvm import SamplingParams
from wkvm.cli import EMBEDDED_MODEL, main
from wkvm.config import EngineConfig
from wkvm.engine.engine import Engine
from wkvm.models import int4, int8
from wkvm.models.linear import embedding, linear, stored
from wkvm.tokenizer import load_tokenizer
from wkvm.weights.loader import load_model

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = "ROMEO:\nBut soft, what light through yonder window breaks?\nIt is the east, and Juliet is the sun.\n\nJULIET:\n"
# plain rows only (N under a block), one block, blocks then plain rows, many groups
SHAPES = [(5, 32), (16, 64), (37, 96), (50, 1056)]
# the test-only toy family casts its matrices with .to(dtype) instead of `stored`: float dtypes only
FAMILIES = [f for f in all_families() if not f.__name__.endswith(".toy")]


def native_paths() -> list[str]:
    best = int4.native_isa()
    return [] if best is None else list(int4.ISAS[: int4.ISAS.index(best) + 1])


def reference(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return x.double() @ int4.dequantize(q).double().T


def activation_bound(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """|kernel - reference| can reach sum_k |W[n, k]| * (half an int8 step of x's group), plus float rounding."""
    step = x.double().view(x.shape[0], -1, 32).abs().amax(-1, keepdim=True) / 127
    half = (step / 2).expand(-1, -1, 32).reshape(x.shape)
    return half @ int4.dequantize(q).double().abs().T + 1e-5 * reference(x, q).abs().max()


def kl(ref_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    p, q = ref_logits.double().log_softmax(-1), logits.double().log_softmax(-1)
    return (p.exp() * (p - q)).sum(-1)


@pytest.fixture
def fresh_choice(monkeypatch):
    """Forget the cached kernel choice before and after a test that changes the environment."""
    int4.kernel_path.cache_clear()
    yield monkeypatch
    int4.kernel_path.cache_clear()


def test_blocks_hold_16_rows_nibbles_then_their_steps_and_offsets():
    q = torch.randint(0, 16, (17, 32))
    q[:, 0], q[:, 1] = 0, 15  # each group spans 0..15: step 1, offset 0, the nibbles are the weights themselves
    w = int4.quantize(q.float())
    assert w.dtype == torch.uint8 and w.shape == (17, 20) and int4.in_features(w) == 32
    block = w[:16].reshape(320)
    for r, k in [(0, 0), (3, 5), (15, 31), (7, 12)]:
        byte = block[64 * (k // 8) + 4 * r + k % 4]
        assert (byte & 15 if k % 8 < 4 else byte >> 4) == q[r, k]
    assert torch.equal(block[256:].view(torch.float16), torch.tensor([1.0] * 16 + [0.0] * 16, dtype=torch.float16))
    plain = w[16]
    assert torch.equal(torch.cat([plain[:16] & 15, plain[:16] >> 4]), q[16].to(torch.uint8))
    assert torch.equal(int4.dequantize(w), q.float())


@pytest.mark.parametrize("symmetric", [False, True])
def test_quantize_round_trips_within_half_a_step_or_a_step_when_symmetric(symmetric):
    w = torch.randn(37, 96) * torch.logspace(-3, 1, 37)[:, None]  # rows of very different sizes
    w[5] = 0  # an all-zero row stays zero
    w[6, :32] = 0.3  # a constant group is its offset
    q = int4.quantize(w, symmetric=symmetric)
    _, d, _ = int4.unpack(q, torch.arange(37))
    err = (int4.dequantize(q) - w).view(37, 3, 32).abs().amax(-1)
    steps = 1.0 if symmetric else 0.5  # Q4_0 spans -8..7 steps: the far side of the largest value clips by a step
    assert (err <= d.abs() * steps * 1.01 + 1e-3 * w.view(37, 3, 32).abs().amax(-1)).all()  # fp16 step and offset
    assert not int4.dequantize(q)[5].any()
    assert torch.allclose(int4.dequantize(q)[6, :32], torch.full((32,), 0.3), rtol=1e-3)
    ids = torch.tensor([[3, 5, 36], [0, 16, 1]])
    assert torch.equal(embedding(ids, q), int4.dequantize(q)[ids])


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_int4_keeps_a_4_bit_gguf_files_values(qtype):
    """`--dtype int4` stores a Q4_0 or Q4_1 file's dequantized matrices on their own grid: every value as the file
    has it (asymmetric groups had moved a Q4_0 file's by up to half a step); values on no such grid (an HF
    checkpoint's) get the asymmetric groups as before."""
    import gguf
    import numpy as np

    q = gguf.GGMLQuantizationType[qtype]
    w = np.random.default_rng(3).standard_normal((40, 128)).astype(np.float32) * np.logspace(-2, 0.5, 40)[:, None]
    w[7] = 0  # a zero row lies on both grids
    values = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w.astype(np.float32), q), q).copy())
    assert torch.equal(int4.dequantize(stored(values, int4.DTYPE)), values)
    if qtype == "Q4_0":
        assert not torch.equal(int4.dequantize(int4.quantize(values)), values)  # what asymmetric groups did
    plain = torch.from_numpy(w)
    assert torch.equal(stored(plain, int4.DTYPE), int4.quantize(plain))


def test_k_not_a_multiple_of_32_is_stored_as_int8():
    with pytest.raises(ValueError, match="multiple of 32"):
        int4.quantize(torch.randn(4, 48))
    w = torch.randn(20, 48)
    assert stored(w, torch.int4).dtype == torch.int8 and stored(torch.randn(20, 64), torch.int4).dtype == torch.uint8
    x = torch.randn(2, 48)
    assert torch.equal(linear(x, stored(w, torch.int4)), int8.linear(x, int8.quantize(w)))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("m", [1, 2, 3, 8, 32, 33, 70])  # AMX from 32 rows; AVX2 32 rows a pass (70: 3 passes)
def test_kernel_equals_the_dequantized_product_on_every_isa(shape, m):
    paths = native_paths()
    if not paths:
        pytest.skip("no C++ compiler: the native kernel cannot be built here")
    n, k = shape
    torch.manual_seed(n * k + m)
    q, x = int4.quantize(torch.randn(n, k)), torch.randn(m, k)
    want, bound = reference(x, q), activation_bound(x, q)
    outs = {p: int4.linear(x, q, p) for p in paths}
    for p, y in outs.items():
        assert y.shape == (m, n) and y.dtype == torch.float32
        assert ((y.double() - want).abs() <= bound).all(), p  # x rounded to int8 per group of 32 in the kernel
    # integer dot products, then one float expression per group in one order: every path gives the same bits
    assert all(torch.equal(outs["scalar"], y) for y in outs.values())


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_int16_group_sums_at_their_bound_stay_exact(sign):
    """The AVX2 and AVX-512BW paths add a group's vpmaddubsw pair sums in int16 lanes before widening: each lane then
    holds 16 products of a nibble (at most 15) and an x value (at most 127 in magnitude), 30,480 at most. Weights at
    15 (one zero a group keeps the offset at 0) and x at +-127 reach that bound; a lane that saturated or wrapped would
    leave the scalar reference's bits."""
    paths = native_paths()
    if not paths:
        pytest.skip("no C++ compiler: the native kernel cannot be built here")
    w = torch.ones(48, 96)
    w[:, ::32] = 0.0
    q = int4.quantize(w)
    assert int((int4.dequantize(q) > 0.99).sum()) == 48 * 93  # nibbles of 15 everywhere but the zeros
    for m in (1, 2, 3, 8, 33):
        x = torch.full((m, 96), sign)
        outs = {p: int4.linear(x, q, p) for p in paths}
        want = reference(x, q)
        for p, y in outs.items():
            assert ((y.double() - want).abs() <= activation_bound(x, q)).all(), (p, m)
            assert torch.equal(outs["scalar"], y), (p, m)


@pytest.mark.parametrize("path", ["auto", "avx2", "torch"])
def test_prefill_sized_batches(path):
    """Past KERNEL_ROWS rows the AVX-512BW path (no VNNI) dequantizes for oneDNN; AVX2, VNNI and AMX keep the kernel
    (measured faster)."""
    if path not in ("auto", "torch") and path not in native_paths():
        pytest.skip(f"this CPU does not run {path}")
    torch.manual_seed(1)
    q, x = int4.quantize(torch.randn(40, 64)), torch.randn(2, int4.KERNEL_ROWS, 64)
    y = int4.linear(x, q, None if path == "auto" else path)
    x2 = x.reshape(-1, 64)
    want, bound = reference(x2, q).view(y.shape), activation_bound(x2, q).view(y.shape)
    assert y.shape == (2, int4.KERNEL_ROWS, 40) and ((y.double() - want).abs() <= bound).all()


def test_a_forced_kernel_is_used_and_an_unknown_one_is_a_clear_error(fresh_choice):
    if "avx2" in native_paths():
        fresh_choice.setenv("WKVM_INT4_KERNEL", "avx2")
        assert int4.kernel_path() == "avx2"
        q, x = int4.quantize(torch.randn(9, 64)), torch.randn(3, 64)
        assert torch.equal(linear(x, q), int4.linear(x, q, "scalar"))
        int4.kernel_path.cache_clear()
    fresh_choice.setenv("WKVM_INT4_KERNEL", "neon")
    with pytest.raises(ValueError, match="use auto, scalar, avx2"):
        int4.kernel_path()


def test_without_a_compiler_int4_still_works_after_one_warning(fresh_choice, caplog):
    def no_compiler() -> None:
        raise RuntimeError("Error building extension: c++: command not found")

    int4.native_isa.cache_clear()
    fresh_choice.setattr(int4, "build", no_compiler)
    try:
        with caplog.at_level(logging.WARNING, logger="wkvm.int4"):
            assert int4.kernel_path() == "torch"
        (message,) = [r.getMessage() for r in caplog.records if r.name == "wkvm.int4"]
        assert "int4 kernel unavailable" in message and "command not found" in message
        q, x = int4.quantize(torch.randn(11, 32)), torch.randn(1, 32)
        assert torch.allclose(linear(x, q).double(), reference(x, q), atol=1e-5)
        with pytest.raises(RuntimeError, match="could not be built"):
            int4.linear(x, q, "avx2")
    finally:
        int4.native_isa.cache_clear()


@pytest.fixture(scope="module")
def ids():
    return load_tokenizer(EMBEDDED_MODEL).encode(TEXT)


def test_int4_default_model_stays_within_the_bound(ids):
    """The trained default model: mean KL well under llama.cpp's Q4_1 on Llama-3-8B (0.072 nats, see
    docs/performance.md); decode (kernel, x in int8 per group) agrees with the whole prefill."""
    fp32, q4 = load_model(EMBEDDED_MODEL), load_model(EMBEDDED_MODEL, dtype="int4")
    assert q4.weights.globals()["head.weight"].dtype == torch.int8  # embedding and head stay int8 (stored_outer)
    assert any(t.dtype == torch.uint8 for t in q4.weights.layer(0).values())  # the layers' matrices are int4
    ref = fp32.prefill(ids, all_logits=True)[0]
    state = q4.new_state()
    steps = torch.stack([q4.decode([t], state)[0] for t in ids])
    whole = q4.prefill(ids, all_logits=True)[0]
    for logits in (steps, whole):
        assert kl(ref, logits).mean() < 0.03
        assert (logits.argmax(-1) == ref.argmax(-1)).double().mean() >= 0.85


@pytest.mark.parametrize("family", FAMILIES, ids=[f.__name__.rsplit(".", 1)[-1] for f in FAMILIES])
def test_every_family_generates_in_int4_and_batched_equals_alone(family, tmp_path):
    from conftest import write_char_tokenizer

    from wkvm.weights.loader import load_text_tools

    path = family.write_checkpoint(tmp_path / "model", len(CHAR_VOCAB), 5)
    write_char_tokenizer(path)
    model = load_model(path, dtype="int4")
    kinds = {t.dtype for i in range(model.config.n_layer) for t in model.weights.layer(i).values()}
    assert kinds & {torch.uint8, torch.int8}  # int4, or int8 where a matrix's K is not a multiple of 32
    rng = random.Random(0)
    eng = Engine(model, load_text_tools(path, model.family)[0], EngineConfig(n_slots=4, token_budget=24,
                                                                            prefill_chunk=8))  # fmt: skip
    specs = [([rng.randrange(0, len(CHAR_VOCAB)) for _ in range(rng.randint(1, 20))], rng.randint(1, 8))
             for _ in range(5)]  # fmt: skip
    handles = [eng.submit(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)) for p, n in specs]
    eng.run_until_done()
    for (prompt, n), h in zip(specs, handles, strict=True):
        assert h.output.token_ids == greedy_reference(model, prompt, n)


def test_int4_through_the_cli(ids, capsys):
    want = greedy_reference(load_model(EMBEDDED_MODEL, dtype="int4"), ids, 4)
    args = ["generate", "--dtype", "int4", "--prompt-ids", ",".join(map(str, ids)), "--max-tokens", "4", "--json",
            "--temperature", "0"]  # fmt: skip
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == want
