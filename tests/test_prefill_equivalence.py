"""Invariant 2: prefill of T tokens (any piece size, any WKV chunk length) == T single-token steps."""

import pytest
import torch

from wkvm.weights.loader import load_model

TOL = 1e-5


@pytest.fixture(scope="module")
def model(tiny_pth):
    return load_model(tiny_pth)


@pytest.fixture(scope="module")
def stepwise(model):
    tokens = torch.randint(0, model.vocab_size, (100,), generator=torch.Generator().manual_seed(11)).tolist()
    state = model.new_state()
    logits = torch.stack([model.decode([t], state)[0] for t in tokens])
    return tokens, logits, state


def assert_states_close(a, b, tol=TOL):
    for k in a:
        assert (a[k] - b[k]).abs().max().item() < tol, k


@pytest.mark.parametrize("piece", [1, 3, 16, 64, 100, None])
def test_prefill_pieces_equal_steps(model, stepwise, piece):
    tokens, step_logits, step_state = stepwise
    logits, state = model.prefill(tokens, all_logits=True, chunk_size=piece)
    assert logits.shape == step_logits.shape
    assert (logits - step_logits).abs().max().item() < TOL
    assert_states_close(state, step_state)


@pytest.mark.parametrize("wkv_chunk", [1, 7, 32, 64])
def test_wkv_chunk_lengths_equal_steps(model, stepwise, wkv_chunk):
    tokens, step_logits, step_state = stepwise
    old = model.wkv_chunk
    model.wkv_chunk = wkv_chunk
    try:
        logits, state = model.prefill(tokens, all_logits=True)
    finally:
        model.wkv_chunk = old
    assert (logits - step_logits).abs().max().item() < TOL
    assert_states_close(state, step_state)


def test_prefill_continues_from_a_state(model, stepwise):
    tokens, step_logits, step_state = stepwise
    _, state = model.prefill(tokens[:40])
    logits, state = model.prefill(tokens[40:], state)
    assert (logits - step_logits[-1]).abs().max().item() < TOL
    assert_states_close(state, step_state)


def test_batched_decode_equals_single(model):
    prompts = [[1, 2, 3], [9, 8, 7, 6, 5], [42]]
    singles = [model.prefill(p)[1] for p in prompts]
    batch = {k: torch.cat([s[k] for s in singles]) for k in singles[0]}
    batch_logits = model.decode([10, 20, 30], batch)
    for i, s in enumerate(singles):
        assert (model.decode([[10, 20, 30][i]], s)[0] - batch_logits[i]).abs().max().item() < TOL


def test_empty_prefill_is_refused(model):
    with pytest.raises(ValueError, match="at least one token"):
        model.prefill([])
