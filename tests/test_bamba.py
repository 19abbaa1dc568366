"""Bamba (Mamba2 + attention) against transformers' `BambaForCausalLM` torch path in fp32: whole-prompt and
decode logits, greedy tokens against `generate`, chunked prefill, a tied head and grouped-query heads; the state is
Mamba2 slots plus keys and values. Engine-level operations run in the conformance suite (tests/families/bamba.py)."""

from __future__ import annotations

import hf_oracle
import pytest
import torch
from families.bamba import randomize, tiny_config
from transformers import BambaForCausalLM

from wkvm.models.family import CheckpointError
from wkvm.weights.loader import load_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny matrices: threads only wait on each other

SHAPES = {
    "gqa": dict(vocab_size=101, hidden_size=64, num_hidden_layers=4, attn_layer_indices=[1, 3], num_attention_heads=4,
                num_key_value_heads=2, mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=12),
    "tied": dict(vocab_size=77, hidden_size=48, num_hidden_layers=3, attn_layer_indices=[0], num_attention_heads=3,
                 num_key_value_heads=3, mamba_n_heads=6, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=10,
                 mamba_d_conv=3, tie_word_embeddings=True),
}  # fmt: skip


@pytest.fixture(scope="module", params=sorted(SHAPES))
def pair(request, tmp_path_factory):
    return hf_oracle.saved_pair(BambaForCausalLM, tiny_config(**SHAPES[request.param]), randomize,
                                tmp_path_factory.mktemp(request.param))


def test_full_prompt_logits(pair):
    _, hf, m = pair
    hf_oracle.full_prompt_logits(hf, m)


def test_greedy_matches_generate_and_decode_logits(pair):
    _, hf, m = pair
    hf_oracle.greedy_and_decode_logits(hf, m)


def test_chunked_prefill_state_and_streamed_pack(pair, tmp_path):
    path, hf, m = pair
    attention = {i for i, kind in enumerate(hf.config.layers_block_type) if kind == "full_attention"}
    hf_oracle.chunked_prefill_and_streamed_pack(path, m, attention, tmp_path)


def test_declared_layer_kinds_must_match_the_tensors(tmp_path):
    torch.manual_seed(4)
    BambaForCausalLM(tiny_config(50, num_hidden_layers=2, attn_layer_indices=[1])).save_pretrained(tmp_path / "b")
    cfg = tmp_path / "b" / "config.json"
    cfg.write_text(cfg.read_text().replace('"attn_layer_indices": [\n    1\n  ]', '"attn_layer_indices": [0]'))
    with pytest.raises(CheckpointError, match="layer kinds"):
        load_model(tmp_path / "b")
