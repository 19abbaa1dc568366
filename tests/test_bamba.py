"""Bamba (Mamba2 + attention) against transformers' `BambaForCausalLM` torch path in fp32: whole-prompt and
decode logits, greedy tokens against `generate`, chunked prefill, a tied head and grouped-query heads; the state is
Mamba2 slots plus keys and values. Engine-level operations run in the conformance suite (tests/families/bamba.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import ids_for
from families.bamba import randomize, tiny_config
from transformers import BambaForCausalLM

from wkvm.models.family import CheckpointError
from wkvm.weights.loader import load_model
from wkvm.weights.pack import write_pack

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny matrices: threads only wait on each other

SHAPES = {
    "gqa": dict(vocab_size=101, hidden_size=64, num_hidden_layers=4, attn_layer_indices=[1, 3], num_attention_heads=4,
                num_key_value_heads=2, mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=12),
    "tied": dict(vocab_size=77, hidden_size=48, num_hidden_layers=3, attn_layer_indices=[0], num_attention_heads=3,
                 num_key_value_heads=3, mamba_n_heads=6, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=10,
                 mamba_d_conv=3, tie_word_embeddings=True),
}  # fmt: skip
ATOL = 1e-4


@pytest.fixture(scope="module", params=sorted(SHAPES))
def pair(request, tmp_path_factory):
    torch.manual_seed(3)
    hf = BambaForCausalLM(tiny_config(**SHAPES[request.param])).eval()
    randomize(hf)
    path = tmp_path_factory.mktemp(request.param) / "ckpt"
    hf.save_pretrained(path, safe_serialization=True)
    return path, hf, load_model(path)


@torch.no_grad()
def test_full_prompt_logits(pair):
    _, hf, m = pair
    ids = ids_for(m.vocab_size, 2, 45)  # more than two SSD chunks
    want = hf(ids, use_cache=False).logits
    assert (m.forward(ids, m.new_state(2), all_logits=True) - want).abs().max() < ATOL
    assert want[0].std(0).mean() > 0.1


@torch.no_grad()
def test_greedy_matches_generate_and_decode_logits(pair):
    _, hf, m = pair
    for seed, length in ((3, 1), (4, 11)):
        prompt = ids_for(m.vocab_size, 1, length, seed=seed)
        out = hf.generate(prompt, max_new_tokens=20, do_sample=False, output_logits=True, return_dict_in_generate=True)
        logits, state = m.prefill(prompt[0])
        got, got_logits = [], []
        for _ in range(20):
            got_logits.append(logits)
            got.append(int(logits.argmax()))
            logits = m.decode([got[-1]], state)[0]
        assert got == out.sequences[0, length:].tolist()
        assert (torch.stack(got_logits) - torch.cat(out.logits)).abs().max() < ATOL


@torch.no_grad()
def test_chunked_prefill_state_and_streamed_pack(pair, tmp_path):
    path, hf, m = pair
    ids = ids_for(m.vocab_size, 1, 40, seed=6)[0]
    want, want_state = m.prefill(ids, all_logits=True)
    for chunk in (1, 7, 16):
        got, state = m.prefill(ids, all_logits=True, chunk_size=chunk)
        assert (got - want).abs().max() < ATOL
        for k in state:
            assert torch.allclose(state[k], want_state[k], atol=1e-4), (chunk, k)
    attention = {i for i, kind in enumerate(hf.config.layers_block_type) if kind == "full_attention"}
    assert m.kv_layers == tuple(sorted(attention))
    for t in m.spec.tensors:
        assert (t.kind == "kv") == (int(t.name.split(".")[1]) in attention), t
    write_pack(path, tmp_path / "pack")
    streamed = load_model(tmp_path / "pack", weight_cache_layers=1)
    assert streamed.fingerprint == m.fingerprint
    assert (streamed.prefill(ids, all_logits=True)[0] - want).abs().max() < 1e-5


def test_declared_layer_kinds_must_match_the_tensors(tmp_path):
    torch.manual_seed(4)
    BambaForCausalLM(tiny_config(50, num_hidden_layers=2, attn_layer_indices=[1])).save_pretrained(tmp_path / "b")
    cfg = tmp_path / "b" / "config.json"
    cfg.write_text(cfg.read_text().replace('"attn_layer_indices": [\n    1\n  ]', '"attn_layer_indices": [0]'))
    with pytest.raises(CheckpointError, match="layer kinds"):
        load_model(tmp_path / "b")
