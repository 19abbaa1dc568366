"""Invariant 1: fp32 logits within 1e-4 of BlinkDL's `rwkv` package; greedy tokens identical."""

import pytest
import torch
from conftest import SHAPES, reference_model

from wkvm.models.rwkv7.random_weights import save_random_rwkv7
from wkvm.weights.loader import load_model

TOL = 1e-4


@pytest.fixture(scope="module", params=sorted(SHAPES))
def pair(request, ckpt_dir):
    path = ckpt_dir / f"ref-{request.param}.pth"
    save_random_rwkv7(path, SHAPES[request.param], seed=sorted(SHAPES).index(request.param))
    return load_model(path), reference_model(path)


def test_logits_each_token_greedy_and_state(pair):
    model, ref = pair
    V = model.vocab_size
    tokens = torch.randint(0, V, (64,), generator=torch.Generator().manual_seed(3)).tolist()
    ref_state, state = None, model.new_state()
    for t in tokens:
        ref_logits, ref_state = ref.forward([t], ref_state)
        logits = model.decode([t], state)[0]
        assert (logits - ref_logits).abs().max().item() < TOL
    assert ref_logits.std() > 0.5, "random model too flat to test anything"

    ours, theirs = [], []
    ref_tok = our_tok = int(torch.argmax(ref_logits))
    for _ in range(32):
        ours.append(our_tok)
        theirs.append(ref_tok)
        ref_logits, ref_state = ref.forward([ref_tok], ref_state)
        ref_tok = int(torch.argmax(ref_logits))
        our_tok = int(torch.argmax(model.decode([our_tok], state)[0]))
    assert ours == theirs
    assert len(set(ours)) > 1

    for i in range(model.config.n_layer):
        for j, name in enumerate(("att_shift", "wkv", "ffn_shift")):
            diff = (state[f"layers.{i}.{name}"][0] - ref_state[3 * i + j]).abs().max().item()
            assert diff < TOL, f"layer {i} {name}: {diff}"


def test_prefill_matches_reference_sequence_mode(pair):
    model, ref = pair
    tokens = torch.randint(0, model.vocab_size, (70,), generator=torch.Generator().manual_seed(5)).tolist()
    ref_logits, ref_state = ref.forward(tokens, None)
    logits, state = model.prefill(tokens)
    assert (logits - ref_logits).abs().max().item() < TOL
    wkv = torch.stack([ref_state[3 * i + 1] for i in range(model.config.n_layer)])
    ours = torch.stack([state[f"layers.{i}.wkv"][0] for i in range(model.config.n_layer)])
    assert (wkv - ours).abs().max().item() < TOL
