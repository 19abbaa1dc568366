"""Nemotron-H (Mamba2, attention and MLP layers, no experts) against transformers' `NemotronHForCausalLM` torch path
in fp32: whole-prompt and decode logits, greedy tokens against `generate`, chunked prefill, a streamed pack, a tied
head and grouped-query heads; the released checkpoints' `backbone.` names and `hybrid_override_pattern`; refusals.
Engine-level operations run in the conformance suite (tests/families/nemotron_h.py)."""

from __future__ import annotations

import json

import hf_oracle
import pytest
import torch
from families.bamba import randomize
from families.nemotron_h import tiny_config
from safetensors.torch import load_file, save_file
from transformers import NemotronHForCausalLM

from wkvm.models.family import CheckpointError
from wkvm.weights.loader import load_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny matrices: threads only wait on each other

SHAPES = {
    "gqa": dict(vocab_size=101, hidden_size=64, layers_block_type=["mamba", "attention", "mlp", "mamba", "attention",
                "mlp"], num_attention_heads=4, num_key_value_heads=2, head_dim=16, mamba_num_heads=8,
                mamba_head_dim=16, n_groups=2, ssm_state_size=12),
    "tied": dict(vocab_size=77, hidden_size=48, layers_block_type=["attention", "mamba", "mlp"],
                 num_attention_heads=3, num_key_value_heads=3, head_dim=16, mamba_num_heads=6, mamba_head_dim=16,
                 n_groups=1, ssm_state_size=10, conv_kernel=3, tie_word_embeddings=True),
}  # fmt: skip


@pytest.fixture(scope="module", params=sorted(SHAPES))
def pair(request, tmp_path_factory):
    return hf_oracle.saved_pair(NemotronHForCausalLM, tiny_config(**SHAPES[request.param]), randomize,
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
    mlp = {i for i, kind in enumerate(hf.config.layers_block_type) if kind == "mlp"}
    assert not any(int(t.name.split(".")[1]) in mlp for t in m.spec.tensors)  # MLP layers keep no state


def test_a_released_checkpoints_names_and_pattern_read_as_transformers_reads_them(pair, tmp_path):
    """The released checkpoints name tensors `backbone.` and their layers by `hybrid_override_pattern` ("M", "*",
    "-"): the same model."""
    path, hf, m = pair
    old = tmp_path / "old"
    old.mkdir()
    weights = load_file(path / "model.safetensors")
    save_file({k.replace("model.", "backbone.", 1): v for k, v in weights.items()}, old / "model.safetensors")
    cfg = json.loads((path / "config.json").read_text())
    kinds = cfg.pop("layers_block_type", None) or cfg.pop("layer_types")
    cfg["hybrid_override_pattern"] = "".join({"linear_attention": "M", "full_attention": "*", "mlp": "-"}[k]
                                             for k in kinds)  # fmt: skip
    (old / "config.json").write_text(json.dumps(cfg))
    ids = list(range(1, 30))
    assert torch.equal(load_model(old).prefill(ids)[0], m.prefill(ids)[0])


def test_what_wkvm_cannot_run_is_refused(tmp_path):
    torch.manual_seed(4)
    NemotronHForCausalLM(tiny_config(50, layers_block_type=["mamba", "attention"], head_dim=8)).save_pretrained(
        tmp_path / "n")  # fmt: skip
    cfg = tmp_path / "n" / "config.json"
    good = json.loads(cfg.read_text())
    key = "layers_block_type" if "layers_block_type" in good else "layer_types"
    refused = {"do not match the tensors": {key: ["attention", "mamba"]},
               "experts": {key: ["mamba", "moe"]},
               "do not name the weights' 2 layers": {key: ["mamba"]},
               "mlp_hidden_act 'gelu'": {"mlp_hidden_act": "gelu"},
               "sliding-window": {"sliding_window": 64}}  # fmt: skip
    for says, changes in refused.items():
        cfg.write_text(json.dumps({**good, **changes}))
        with pytest.raises(CheckpointError, match=says):
            load_model(tmp_path / "n")
    # no head_dim (transformers' default is 128, not the width over the heads): the q projection's rows say it
    cfg.write_text(json.dumps({k: v for k, v in good.items() if k != "head_dim"}))
    assert load_model(tmp_path / "n").config.head_dim == good["head_dim"] == 8  # not 64 / 4


@pytest.mark.parametrize(("qtype", "auto"), [("F32", "float32"), ("Q8_0", "int8"), ("Q4_0", "int4")])
def test_gguf_logits_equal_hf_on_the_files_values(qtype, auto, tmp_path):
    """A file as llama.cpp's converter writes it reads back to the HF model's tensors (F32: wkvm gives the HF
    directory's logits bit for bit) and, quantized, to transformers' logits on the values the file holds."""
    from conftest import ids_for
    from families.nemotron_h import write_gguf

    from wkvm.models import registry
    from wkvm.weights.loader import auto_dtype

    torch.manual_seed(7)
    hf = NemotronHForCausalLM(tiny_config(**SHAPES["gqa"])).eval()
    randomize(hf)
    stored = write_gguf(tmp_path / "n.gguf", hf, qtype)
    assert registry.detect(tmp_path / "n.gguf")[0].name == "nemotron_h"
    assert auto_dtype(tmp_path / "n.gguf") == auto
    got = load_model(tmp_path / "n.gguf")
    assert got.config.layer_types == tuple(hf.config.layers_block_type)
    ids = ids_for(hf.config.vocab_size, 1, 30, seed=9)
    copy = NemotronHForCausalLM(hf.config).eval()
    copy.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in stored.items()}, strict=False)
    with torch.no_grad():
        want = copy(ids, use_cache=False).logits[0]
    assert (got.prefill(ids[0], all_logits=True)[0] - want).abs().max() < hf_oracle.ATOL
    if qtype == "F32":
        hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
        assert torch.equal(got.prefill(ids[0])[0], load_model(tmp_path / "hf").prefill(ids[0])[0])
