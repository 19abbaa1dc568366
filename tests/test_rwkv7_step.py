"""RWKV-7's decode-step kernel (wkvm/models/rwkv7/step.cpp): each op equals its torch fallback up to rounding on
random inputs, and a whole model decodes the same with the kernel as with `WKVM_FUSED=off` (greedy tokens equal,
logits within 1e-4 in fp32)."""

from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
import torch
from conftest import SHAPES

from wkvm.models.family import STEP_CHUNK
from wkvm.models.rwkv7 import step
from wkvm.models.rwkv7.random_weights import save_random_rwkv7
from wkvm.weights.loader import load_model

needs_kernel = pytest.mark.skipif(not step.available(), reason="the RWKV-7 step kernel cannot be built here")
TOL = {"rtol": 1e-5, "atol": 1e-5}


def both(monkeypatch: pytest.MonkeyPatch, f: Callable[[int], Any]) -> tuple[Any, Any]:
    """f(0) on the kernel, then f(1) on the torch fallback (what WKVM_FUSED=off runs)."""
    kernel = f(0)
    with monkeypatch.context() as m:
        m.setattr(step, "available", lambda: False)
        return kernel, f(1)


@needs_kernel
@pytest.mark.parametrize("B", [1, 3, 8])
@pytest.mark.parametrize("C,M,with_add", [(768, 6, False), (64, 1, True), (100, 3, True)])
def test_norm_shift_mix_equals_torch(monkeypatch, B, C, M, with_add):
    g = torch.Generator().manual_seed(B * C + M)
    x, add = torch.randn(B, C, generator=g) * 3, torch.randn(B, C, generator=g) if with_add else None
    ln_w, ln_b, mix = torch.randn(C, generator=g), torch.randn(C, generator=g), torch.rand(M, 1, 1, C, generator=g)
    shift0 = torch.randn(B, C, generator=g)
    shifts = [shift0.clone(), shift0.clone()]
    (s1, m1), (s2, m2) = both(monkeypatch, lambda run: step.norm_shift_mix(x, add, ln_w, ln_b, 1e-5, shifts[run], mix))
    torch.testing.assert_close(s1, s2, rtol=0, atol=0)
    torch.testing.assert_close(m1, m2, **TOL)
    assert m1.shape == (M, B, C)
    torch.testing.assert_close(shifts[0], shifts[1], **TOL)


@needs_kernel
@pytest.mark.parametrize("B", [1, 3, 8])
@pytest.mark.parametrize("C,ranks", [(768, (64, 64, 128, 32)), (96, (8, 12, 16)), (40, (3,))])
def test_loras_equal_torch(monkeypatch, B, C, ranks):
    g = torch.Generator().manual_seed(B + C)
    J = len(ranks)
    xs = [torch.randn(B, C, generator=g) for _ in ranks]
    firsts = [torch.randn(C, R, generator=g) * 0.3 for R in ranks]
    seconds = [torch.randn(R, C, generator=g) * 0.3 for R in ranks]
    biases = [torch.randn(C, generator=g) if j != 2 else None for j in range(J)]
    inner = [step.TANH, step.NONE, step.SIGMOID, step.NONE][:J]
    outer = [step.SIGMOID, step.SIGMOID, step.NONE, step.SIGMOID][:J]
    got, want = both(monkeypatch, lambda _: step.loras(xs, firsts, seconds, biases, inner, outer))
    for y1, y2 in zip(got, want, strict=True):
        torch.testing.assert_close(y1, y2, rtol=1e-5, atol=1e-4)


@needs_kernel
@pytest.mark.parametrize("C,ranks", [(768, (64, 64, 32, 128)), (200, (72, 40, 24))])
def test_a_lora_row_has_the_same_bits_alone_and_in_a_batch(C, ranks):
    """The chains run in register tiles of several rows (and wider ones for a single row): an element's sum is the
    same sequence of fused multiply-adds in every tile, so batch mates change no bit of a row."""
    g = torch.Generator().manual_seed(C)
    B = 13  # whole tiles of rows and a remainder, on AVX2 and AVX-512
    xs = [torch.randn(B, C, generator=g) for _ in ranks]
    firsts = [torch.randn(C, R, generator=g) * 0.2 for R in ranks]
    seconds = [torch.randn(R, C, generator=g) * 0.2 for R in ranks]
    biases = [torch.randn(C, generator=g) if j % 2 == 0 else None for j in range(len(ranks))]
    acts = [step.TANH, step.NONE, step.SIGMOID, step.NONE][: len(ranks)]
    batch = step.loras(xs, firsts, seconds, biases, acts, acts[::-1])
    for i in range(B):
        alone = step.loras([x[i : i + 1] for x in xs], firsts, seconds, biases, acts, acts[::-1])
        assert all(torch.equal(y[i : i + 1], a) for y, a in zip(batch, alone, strict=True))


@needs_kernel
@pytest.mark.parametrize("B", [1, 3, 8])
@pytest.mark.parametrize("H,N,first_layer", [(12, 64, False), (3, 32, True), (4, 16, False), (2, 128, False)])
def test_wkv_equals_torch(monkeypatch, B, H, N, first_layer):
    """Several steps in a row on a state whose rows are strided (every other slot of an arena)."""
    g = torch.Generator().manual_seed(B * H + N)
    C = H * N
    w = {k: torch.randn(C, generator=g) for k in ("att.k_k", "att.k_a", "att.ln_x.weight", "att.ln_x.bias")}
    w["att.r_k"] = torch.randn(H, N, generator=g)
    arena = torch.randn(2 * B, H, N, N, generator=g) * 0.3
    arenas = [arena.clone(), arena.clone()]
    for _ in range(3):
        r, k, v, v_first, a_raw, gate = (torch.randn(B, C, generator=g) for _ in range(6))
        decay, a = torch.rand(B, C, generator=g), torch.sigmoid(a_raw)
        v_mix = None if first_layer else torch.rand(B, C, generator=g)
        ins = (r, decay, k, v, v_first, v_mix, a, gate)
        (o1, v1), (o2, v2) = both(monkeypatch, partial(run_wkv, arenas, ins, w))
        torch.testing.assert_close(o1, o2, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(v1, v2, **TOL)
        torch.testing.assert_close(arenas[0], arenas[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(arenas[0][1::2], arenas[1][1::2], rtol=0, atol=0)  # other slots untouched


def run_wkv(arenas: list[torch.Tensor], ins: tuple[Any, ...], w: dict[str, torch.Tensor],
            run: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    return step.wkv(arenas[run][::2], *ins, w, 64e-5)


@needs_kernel
@pytest.mark.parametrize("first_layer", [True, False])
@pytest.mark.parametrize("N", [16, 32, 64, 128])
def test_wkv_over_several_tokens_is_the_one_token_step_in_order(monkeypatch, first_layer, N):
    """Prefill's form (rows [B * T, C], row b's tokens in order) is T one-token calls (the same bits where the head
    size keeps the row-wise update; N = 32, 64, 128 run on the head's transpose, in register-sized groups of rows, their
    sums in another order), and the torch
    fallback (what WKVM_FUSED=off runs) the same recurrence."""
    B, T, H = 2, 5, 3
    g = torch.Generator().manual_seed(7)
    C = H * N
    w = {k: torch.randn(C, generator=g) for k in ("att.k_k", "att.k_a", "att.ln_x.weight", "att.ln_x.bias")}
    w["att.r_k"] = torch.randn(H, N, generator=g)
    r, k, v, v_first, a_raw, gate = (torch.randn(B * T, C, generator=g) for _ in range(6))
    decay, a = torch.rand(B * T, C, generator=g), torch.sigmoid(a_raw)
    v_mix = None if first_layer else torch.rand(B * T, C, generator=g)
    ins = (r, decay, k, v, v_first, v_mix, a, gate)
    S0 = torch.randn(B, H, N, N, generator=g) * 0.3
    S_all, S_one = S0.clone(), S0.clone()
    out, v_used = step.wkv(S_all, *ins, w, 64e-5, tokens=T)
    steps = [step.wkv(S_one, *(x if x is None else x.view(B, T, C)[:, t] for x in ins), w, 64e-5) for t in range(T)]
    out_steps = torch.stack([o for o, _ in steps], 1)
    if N == 16:  # the row-wise update: the same arithmetic
        assert torch.equal(out.view(B, T, C), out_steps) and torch.equal(S_all, S_one)
    else:  # the transposed update: the state's sums in another order
        torch.testing.assert_close(out.view(B, T, C), out_steps, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(S_all, S_one, rtol=1e-5, atol=1e-5)
    assert torch.equal(v_used.view(B, T, C), torch.stack([u for _, u in steps], 1))
    monkeypatch.setattr(step, "available", lambda: False)
    S_torch = S0.clone()
    out_torch, _ = step.wkv(S_torch, *ins, w, 64e-5, tokens=T)
    torch.testing.assert_close(out_torch, out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(S_torch, S_all, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_a_layout_the_kernel_cannot_read_is_refused_with_a_message():
    H, N = 2, 8
    w = {k: torch.randn(H * N) for k in ("att.k_k", "att.k_a", "att.r_k", "att.ln_x.weight", "att.ln_x.bias")}
    rows = [torch.randn(1, H * N) for _ in range(7)]
    with pytest.raises(RuntimeError, match="contiguous heads"):
        step.wkv(torch.randn(1, H, N, N).transpose(2, 3), *rows[:5], None, *rows[5:], w, 64e-5)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        step.relu_square(torch.randn(16, 2).t())


@needs_kernel
@pytest.mark.parametrize("B", [1, 3, 8])
def test_relu_square_equals_torch(monkeypatch, B):
    x = torch.randn(B, 300)
    got, want = both(monkeypatch, lambda _: step.relu_square(x))
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@needs_kernel
@pytest.mark.parametrize("dtype", ["float32", "int8"])
@pytest.mark.parametrize("shape", ["L3-C96-H3-V300", "L3-C192-H3-N64-V1000"])
def test_decode_with_kernel_equals_without(tmp_path, monkeypatch, shape, dtype):
    """Greedy decode of 3 rows for 16 steps: the same tokens, logits within 1e-4 of the torch path's (int8: 0.1, as
    its kernel rounds each input to int8 per group of 32, so an upstream difference of one float rounding can move
    an input by a step of 1/127 of its group's largest, and the recurrence carries that on; the logits reach ~8)."""
    path = tmp_path / "m.pth"
    save_random_rwkv7(path, SHAPES[shape], seed=11)
    model = load_model(path, dtype=dtype)

    def decode(_: int) -> tuple[list[list[int]], torch.Tensor]:
        state = model.new_state(3)
        tokens, logits = [[1, 2, 3]], []
        for _ in range(16):
            logits.append(model.decode(tokens[-1], state))
            tokens.append(logits[-1].argmax(-1).tolist())
        return tokens, torch.stack(logits)

    (tok1, lg1), (tok2, lg2) = both(monkeypatch, decode)
    assert tok1 == tok2
    torch.testing.assert_close(lg1, lg2, rtol=0, atol=1e-4 if dtype == "float32" else 0.1)


@needs_kernel
def test_prefill_with_kernel_equals_without(tmp_path, monkeypatch):
    """A prefill (one chunk and two) runs the wkv recurrence token by token in the kernel: its logits and state are
    the torch chunked path's within float rounding."""
    path = tmp_path / "m.pth"
    save_random_rwkv7(path, SHAPES["L3-C192-H3-N64-V1000"], seed=12)
    model = load_model(path, dtype="float32")
    ids = torch.randint(0, 1000, (40,), generator=torch.Generator().manual_seed(3))

    def prefill(_: int) -> tuple[torch.Tensor, torch.Tensor]:
        state = model.new_state(1)
        first, _ = model.prefill(ids[:25], state, all_logits=True)
        second, _ = model.prefill(ids[25:], state, all_logits=True)
        return torch.cat([first, second], -2), state["layers.2.wkv"].clone()

    (lg1, s1), (lg2, s2) = both(monkeypatch, prefill)
    torch.testing.assert_close(lg1, lg2, rtol=0, atol=1e-4)
    torch.testing.assert_close(s1, s2, rtol=1e-4, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("dtype", ["float32", "int8", "int4", "bfloat16"])
def test_a_short_chunk_has_the_bits_of_stepping_through_it(tmp_path, monkeypatch, dtype):
    """Up to STEP_CHUNK tokens a row run the step's own ops token by token for the token shift and wkv, the rest over
    all rows (`_steps_layer`: one `step.layer` call for the T tokens where the layer's matrices are on one native
    kernel, else op by op): logits and every state tensor equal stepping bit for bit, for 1 and 2 rows, both ways,
    where the matmuls give each row the same bits whatever rows come with it (fp32 on wkvm's gemv kernel, int8,
    int4); bf16 (oneDNN) does not promise that, and says so. A moved stream catches up on this path
    (Engine.precopy). Longer chunks take the one call where it reaches (20-96 tokens here; int8 / int4 with
    AVX2, AVX512-VNNI or AMX any length): the same, so a prompt resumed from a stored prefix answers as an
    uninterrupted one."""
    path = tmp_path / "m.pth"
    save_random_rwkv7(path, SHAPES["L3-C192-H3-N64-V1000"], seed=13)
    model = load_model(path, dtype=dtype)
    assert model.chunks_equal_steps == (dtype != "bfloat16")
    if dtype == "bfloat16":
        return
    from wkvm.models.linear import native_kernel
    from wkvm.models.rwkv7 import model as rwkv7_model

    one_call, tokens = step.layer, []
    monkeypatch.setattr(step, "layer", lambda *a: tokens.append(a[-1]) or one_call(*a))
    g = torch.Generator().manual_seed(4)
    mats = [model.weights.layer(1)[k] for k in rwkv7_model.LINEAR_KEYS]
    assert native_kernel(mats, STEP_CHUNK) is not None  # so the one-call path runs (for more rows, where it reaches)
    for rows, T in ((1, STEP_CHUNK), (2, STEP_CHUNK), (1, 20), (3, 20), (1, 96), (2, 40)):
        one_call_reaches = native_kernel(mats, rows * T) is not None  # fp32 on AVX2: 12 rows
        if T > STEP_CHUNK and not one_call_reaches:
            continue  # the chunked path (`_time_mix`): no promise of stepping's bits
        start = model.new_state(rows)
        model.forward(torch.randint(0, 1000, (rows, 70), generator=g), start)  # a state that is not zeros
        ids = torch.randint(0, 1000, (rows, T), generator=g)
        stepped = {k: v.clone() for k, v in start.items()}
        for t in range(T):
            last = model.forward(ids[:, t : t + 1], stepped)
        for fused_layer in (True, False) if T <= STEP_CHUNK else (True,):
            tokens.clear()
            chunked = {k: v.clone() for k, v in start.items()}
            with monkeypatch.context() as m:
                if not fused_layer:
                    m.setattr(model, "layer_kernel", lambda *a: None)
                whole = model.forward(ids, chunked)
            assert tokens == ([T] * model.config.n_layer if fused_layer and one_call_reaches else [])
            assert torch.equal(whole, last)
            assert all(torch.equal(chunked[k], stepped[k]) for k in start)


@needs_kernel
@pytest.mark.parametrize("dtype", ["float32", "int8", "int4"])
def test_a_decode_layer_in_one_call_has_the_bits_of_its_ops(tmp_path, monkeypatch, dtype):
    """`step.layer` (a decode step's whole layer in one call, where its six matrices run on one native kernel) against
    the same layer as separate ops (`_decode_layer`'s Python): logits and every state tensor equal, bit for bit, over
    several steps of 1 and 3 rows."""
    from wkvm.models.linear import native_kernel
    from wkvm.models.rwkv7 import model as rwkv7_model

    path = tmp_path / "m.pth"
    save_random_rwkv7(path, SHAPES["L3-C192-H3-N64-V1000"], seed=14)
    model = load_model(path, dtype=dtype)
    w = model.weights.layer(1)
    if native_kernel([w[k] for k in rwkv7_model.LINEAR_KEYS], 3) is None:
        pytest.skip(f"no native {dtype} kernel here")
    calls = []
    one_call = step.layer
    monkeypatch.setattr(step, "layer", lambda *a: calls.append(1) or one_call(*a))
    g = torch.Generator().manual_seed(5)
    for rows in (1, 3):
        start, counted = model.new_state(rows), len(calls)
        model.forward(torch.randint(0, 1000, (rows, 12), generator=g), start)
        del calls[counted:]  # only the steps below count
        ids = torch.randint(0, 1000, (rows, 5), generator=g)
        runs = []
        for fused_layer in (True, False):
            if not fused_layer:
                monkeypatch.setattr(model, "layer_kernel", lambda *a: None)
            state = {k: v.clone() for k, v in start.items()}
            logits = [model.forward(ids[:, t : t + 1], state) for t in range(ids.shape[1])]
            runs.append((torch.stack(logits), state))
        monkeypatch.undo()
        monkeypatch.setattr(step, "layer", lambda *a: calls.append(1) or one_call(*a))
        (lg1, s1), (lg2, s2) = runs
        assert torch.equal(lg1, lg2) and all(torch.equal(s1[k], s2[k]) for k in s1)
    assert len(calls) == 2 * 5 * model.config.n_layer  # every step of every layer, with rows 1 and 3
