"""LFM2 (short convolutions + attention) against transformers' `Lfm2ForCausalLM` torch path in fp32: whole-prompt
and decode logits, greedy tokens against `generate`, chunked prefill, a tied head and grouped-query heads; the state
is each conv layer's last inputs plus keys and values. Engine-level operations run in the conformance suite
(tests/families/lfm2.py)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import ids_for
from families.lfm2 import randomize, tiny_config
from transformers import Lfm2ForCausalLM

from wkvm.models.family import CheckpointError
from wkvm.models.lfm2.model import short_conv
from wkvm.weights.loader import load_model
from wkvm.weights.pack import write_pack

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny matrices: threads only wait on each other

SHAPES = {
    "gqa": dict(vocab_size=101, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                layer_types=["conv", "full_attention", "conv", "full_attention"]),
    # transformers' own FFN sizing (2/3, a multiplier, rounded up to a multiple), 4 taps, a tied head, no GQA
    "tied": dict(vocab_size=77, hidden_size=48, num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=3,
                 layer_types=["full_attention", "conv", "conv"], conv_L_cache=4, tie_word_embeddings=True,
                 intermediate_size=160, block_auto_adjust_ff_dim=True, block_ffn_dim_multiplier=1.5,
                 block_multiple_of=32),
}  # fmt: skip
ATOL = 1e-4


@pytest.fixture(scope="module", params=sorted(SHAPES))
def pair(request, tmp_path_factory):
    torch.manual_seed(3)
    hf = Lfm2ForCausalLM(tiny_config(**SHAPES[request.param])).eval()
    randomize(hf)
    path = tmp_path_factory.mktemp(request.param) / "ckpt"
    hf.save_pretrained(path, safe_serialization=True)
    return path, hf, load_model(path)


@torch.no_grad()
def test_full_prompt_logits(pair):
    _, hf, m = pair
    ids = ids_for(m.vocab_size, 2, 45)
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
    for chunk in (1, 2, 7, 16):
        got, state = m.prefill(ids, all_logits=True, chunk_size=chunk)
        assert (got - want).abs().max() < ATOL
        for k in state:
            assert torch.allclose(state[k], want_state[k], atol=1e-4), (chunk, k)
    attention = {i for i, kind in enumerate(hf.config.layer_types) if kind == "full_attention"}
    assert m.kv_layers == tuple(sorted(attention))
    for t in m.spec.tensors:
        assert (t.kind == "kv") == (int(t.name.split(".")[1]) in attention), t
        if t.kind == "conv":
            assert t.shape == (hf.config.hidden_size, hf.config.conv_L_cache - 1)
    write_pack(path, tmp_path / "pack")
    streamed = load_model(tmp_path / "pack", weight_cache_layers=1)
    assert streamed.fingerprint == m.fingerprint
    assert (streamed.prefill(ids, all_logits=True)[0] - want).abs().max() < 1e-5


def test_short_conv_chunks_have_steppings_bits():
    """The conv alone: any split of a sequence gives every output and the window the bits of one token at a time
    (what lets a prompt's chunks, and a checked draft, equal stepping exactly)."""
    torch.manual_seed(0)
    x, taps = torch.randn(2, 23, 40), torch.randn(40, 3)
    start = torch.randn(2, 40, 2)
    window = start.clone()
    stepped = torch.cat([short_conv(x[:, t : t + 1], window, taps) for t in range(23)], 1)
    for split in ((23,), (1, 22), (5, 9, 9), (2, 2, 19)):
        w, pieces, s = start.clone(), [], 0
        for n in split:
            pieces.append(short_conv(x[:, s : s + n], w, taps))
            s += n
        assert torch.equal(torch.cat(pieces, 1), stepped), split
        assert torch.equal(w, window), split
    want = torch.nn.functional.conv1d(torch.cat([start, x.transpose(1, 2)], -1), taps[:, None], groups=40)
    assert torch.allclose(stepped.transpose(1, 2), want, atol=1e-5)


def test_declared_layer_kinds_and_biases_must_match(tmp_path):
    torch.manual_seed(4)
    Lfm2ForCausalLM(tiny_config(50, num_hidden_layers=2, layer_types=["conv", "full_attention"])).save_pretrained(
        tmp_path / "b")  # fmt: skip
    cfg = tmp_path / "b" / "config.json"
    good = json.loads(cfg.read_text())
    cfg.write_text(json.dumps({**good, "layer_types": ["full_attention", "conv"]}))
    with pytest.raises(CheckpointError, match="layer kinds"):
        load_model(tmp_path / "b")
    cfg.write_text(json.dumps({**good, "conv_bias": True}))
    with pytest.raises(CheckpointError, match="conv_bias"):
        load_model(tmp_path / "b")
    cfg.write_text(json.dumps({**good, "rope_parameters": {"rope_type": "yarn", "factor": 2.0}}))
    with pytest.raises(CheckpointError, match="yarn"):
        load_model(tmp_path / "b")
