"""Granite 4.0 H (Mamba2 + attention, dense) against transformers' `GraniteMoeHybridForCausalLM` torch path in fp32:
whole-prompt and decode logits, greedy tokens against `generate`, chunked prefill, no positions and RoPE, Granite's
multipliers, a tied head and grouped-query heads; refusals. Engine-level operations run in the conformance suite
(tests/families/granite_hybrid.py)."""

from __future__ import annotations

import json

import hf_oracle
import pytest
import torch
from conftest import ids_for
from families.bamba import randomize
from families.granite_hybrid import tiny_config
from transformers import GraniteMoeHybridForCausalLM

from wkvm.models.family import CheckpointError
from wkvm.weights.loader import load_model

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


@pytest.fixture(scope="module", params=sorted(SHAPES))
def pair(request, tmp_path_factory):
    return hf_oracle.saved_pair(GraniteMoeHybridForCausalLM, tiny_config(**SHAPES[request.param]), randomize,
                                tmp_path_factory.mktemp(request.param))


def test_full_prompt_logits(pair):
    _, hf, m = pair
    hf_oracle.full_prompt_logits(hf, m)
    assert m.config.rope == (hf.config.position_embedding_type == "rope")


def test_greedy_matches_generate_and_decode_logits(pair):
    _, hf, m = pair
    hf_oracle.greedy_and_decode_logits(hf, m)


def test_chunked_prefill_state_and_streamed_pack(pair, tmp_path):
    path, hf, m = pair
    attention = {i for i, kind in enumerate(hf.config.layer_types) if kind == "full_attention"}
    hf_oracle.chunked_prefill_and_streamed_pack(path, m, attention, tmp_path)


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


# --- GGUF (llama.cpp's granitehybrid architecture) ------------------------------------------------------------------
@pytest.mark.parametrize(("qtype", "auto"), [("F32", "float32"), ("Q8_0", "int8"), ("Q4_0", "int4")])
def test_gguf_logits_equal_hf_on_the_files_values(qtype, auto, tmp_path):
    """A file as llama.cpp's converter writes it reads back to the HF model's tensors (F32: wkvm gives the HF
    directory's logits bit for bit) and, quantized, to transformers' logits on the values the file holds."""
    from families.granite_hybrid import write_gguf

    from wkvm.models import registry
    from wkvm.weights.loader import auto_dtype

    torch.manual_seed(7)
    hf = GraniteMoeHybridForCausalLM(tiny_config(**{**SHAPES["nope"], "hidden_size": 64})).eval()
    randomize(hf)
    stored = write_gguf(tmp_path / "g.gguf", hf, qtype)
    assert registry.detect(tmp_path / "g.gguf")[0].name == "granite_hybrid"
    assert auto_dtype(tmp_path / "g.gguf") == auto
    got = load_model(tmp_path / "g.gguf")
    ids = ids_for(hf.config.vocab_size, 1, 30, seed=9)
    copy = GraniteMoeHybridForCausalLM(hf.config).eval()
    copy.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in stored.items()}, strict=False)
    with torch.no_grad():
        want = copy(ids, use_cache=False).logits[0]
    assert (got.prefill(ids[0], all_logits=True)[0] - want).abs().max() < hf_oracle.ATOL
    if qtype == "F32":
        hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
        assert torch.equal(got.prefill(ids[0])[0], load_model(tmp_path / "hf").prefill(ids[0])[0])


def test_a_gguf_with_rope_is_refused(tmp_path):
    """llama.cpp's converter writes Bamba as granitehybrid too, with RoPE switched on: refused, not run without it."""
    from families.granite_hybrid import write_gguf

    hf = GraniteMoeHybridForCausalLM(tiny_config(50, num_hidden_layers=2, layer_types=["mamba", "attention"])).eval()
    write_gguf(tmp_path / "r.gguf", hf, "F32", rope=True)
    with pytest.raises(CheckpointError, match="RoPE"):
        load_model(tmp_path / "r.gguf")
