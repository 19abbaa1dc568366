"""Granite 4.0 H (Mamba2 + attention, dense) against transformers' `GraniteMoeHybridForCausalLM` torch path in fp32:
whole-prompt and decode logits, greedy tokens against `generate`, chunked prefill, no positions and RoPE, Granite's
multipliers, a tied head and grouped-query heads; refusals. Engine-level operations run in the conformance suite
(tests/families/granite_hybrid.py)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import ids_for
from families.bamba import randomize
from families.granite_hybrid import tiny_config
from transformers import GraniteMoeHybridForCausalLM

from wkvm.models.family import CheckpointError
from wkvm.weights.loader import load_model
from wkvm.weights.pack import write_pack

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny matrices: threads only wait on each other

SHAPES = {
    "nope": dict(vocab_size=101, hidden_size=64, num_hidden_layers=4, layer_types=["mamba", "attention", "mamba",
                 "attention"], num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=8, mamba_d_head=16,
                 mamba_n_groups=2, mamba_d_state=12),
    "rope": dict(vocab_size=77, hidden_size=48, num_hidden_layers=3, layer_types=["attention", "mamba", "mamba"],
                 num_attention_heads=3, num_key_value_heads=3, mamba_n_heads=6, mamba_d_head=16, mamba_n_groups=1,
                 mamba_d_state=10, mamba_d_conv=3, tie_word_embeddings=True, position_embedding_type="rope",
                 rope_parameters={"rope_type": "default", "rope_theta": 500.0}, embedding_multiplier=12.0,
                 residual_multiplier=0.22, attention_multiplier=0.0625, logits_scaling=4.0),
}  # fmt: skip
ATOL = 1e-4


@pytest.fixture(scope="module", params=sorted(SHAPES))
def pair(request, tmp_path_factory):
    torch.manual_seed(3)
    hf = GraniteMoeHybridForCausalLM(tiny_config(**SHAPES[request.param])).eval()
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
    assert m.config.rope == (hf.config.position_embedding_type == "rope")


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
    attention = {i for i, kind in enumerate(hf.config.layer_types) if kind == "full_attention"}
    assert m.kv_layers == tuple(sorted(attention))
    for t in m.spec.tensors:
        assert (t.kind == "kv") == (int(t.name.split(".")[1]) in attention), t
    write_pack(path, tmp_path / "pack")
    streamed = load_model(tmp_path / "pack", weight_cache_layers=1)
    assert streamed.fingerprint == m.fingerprint
    assert (streamed.prefill(ids, all_logits=True)[0] - want).abs().max() < 1e-5


def test_what_wkvm_cannot_run_is_refused(tmp_path):
    """Experts (Granite 4.0 H Tiny / Small), layer kinds the tensors contradict, other positions or RoPE types, and a
    logits scaling of 0 are refused, each naming what; the legacy "mamba" / "attention" kinds read as the new ones."""
    torch.manual_seed(4)
    GraniteMoeHybridForCausalLM(tiny_config(50, num_hidden_layers=2, layer_types=["mamba", "attention"])
                                ).save_pretrained(tmp_path / "g")  # fmt: skip
    cfg = tmp_path / "g" / "config.json"
    good = json.loads(cfg.read_text())
    want = load_model(tmp_path / "g").prefill([1, 2, 3])[0]
    cfg.write_text(json.dumps({**good, "layer_types": ["mamba", "attention"]}))
    assert torch.equal(load_model(tmp_path / "g").prefill([1, 2, 3])[0], want)
    refused = {"layer kinds": {"layer_types": ["attention", "mamba"]}, "experts": {"num_local_experts": 4},
               "position_embedding_type 'alibi'": {"position_embedding_type": "alibi"},
               "RoPE type 'yarn'": {"position_embedding_type": "rope", "rope_parameters": {"rope_type": "yarn"}},
               "logits_scaling 0 is not a finite number other than 0": {"logits_scaling": 0},
               "residual_multiplier 'x'": {"residual_multiplier": "x"}}  # fmt: skip
    for says, changes in refused.items():
        cfg.write_text(json.dumps({**good, **changes}))
        with pytest.raises(CheckpointError, match=says):
            load_model(tmp_path / "g")
    cfg.write_text(json.dumps({k: v for k, v in good.items() if k != "num_local_experts"}))  # 8 experts by default
    with pytest.raises(CheckpointError, match="experts"):
        load_model(tmp_path / "g")
