"""LFM2 (short convolutions + attention) against transformers' `Lfm2ForCausalLM` torch path in fp32: whole-prompt
and decode logits, greedy tokens against `generate`, chunked prefill, a tied head and grouped-query heads; the state
is each conv layer's last inputs plus keys and values. Engine-level operations run in the conformance suite
(tests/families/lfm2.py)."""

from __future__ import annotations

import json

import hf_oracle
import pytest
import torch
from conftest import greedy_reference, ids_for
from families.lfm2 import randomize, tiny_config
from transformers import Lfm2ForCausalLM

from wkvm.models.family import CheckpointError
from wkvm.models.lfm2.model import short_conv
from wkvm.weights.loader import load_model

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


@pytest.fixture(scope="module", params=sorted(SHAPES))
def pair(request, tmp_path_factory):
    return hf_oracle.saved_pair(Lfm2ForCausalLM, tiny_config(**SHAPES[request.param]), randomize,
                                tmp_path_factory.mktemp(request.param))


def test_full_prompt_logits(pair):
    _, hf, m = pair
    hf_oracle.full_prompt_logits(hf, m)


def test_greedy_matches_generate_and_decode_logits(pair):
    _, hf, m = pair
    hf_oracle.greedy_and_decode_logits(hf, m)


def test_chunked_prefill_state_and_streamed_pack(pair, tmp_path):
    path, hf, m = pair
    attention = {i for i, kind in enumerate(hf.config.layer_types) if kind == "full_attention"}
    hf_oracle.chunked_prefill_and_streamed_pack(path, m, attention, tmp_path, chunks=(1, 2, 7, 16))
    for t in m.spec.tensors:
        if t.kind == "conv":
            assert t.shape == (hf.config.hidden_size, hf.config.conv_L_cache - 1)


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
    # heads left out: transformers' defaults (32 over 8), refused by this model's k projection; read as one head (the
    # default had been 1), a model of 4 query and 4 key-value heads passed every shape check and ran one head of 64
    Lfm2ForCausalLM(tiny_config(50, num_hidden_layers=2, layer_types=["conv", "full_attention"], num_attention_heads=4,
                                num_key_value_heads=4)).save_pretrained(tmp_path / "mha")  # fmt: skip
    cfg = tmp_path / "mha" / "config.json"
    silent = {k: v for k, v in json.loads(cfg.read_text()).items() if "_heads" not in k}
    cfg.write_text(json.dumps(silent))
    with pytest.raises(CheckpointError, match="k_proj"):
        load_model(tmp_path / "mha")


# --- GGUF (llama.cpp's lfm2 architecture) ---------------------------------------------------------------------------
def hf_with(model: Lfm2ForCausalLM, stored: dict) -> Lfm2ForCausalLM:
    """`model` with the weights a GGUF reader sees (dequantized; the conv's taps given back their middle axis)."""
    copy = Lfm2ForCausalLM(model.config).eval()
    sd = {k: torch.from_numpy(a.copy()).reshape(model.state_dict()[k].shape) for k, a in stored.items()}
    copy.load_state_dict(sd, strict=False)
    if model.config.tie_word_embeddings:
        copy.tie_weights()
    return copy


@pytest.mark.parametrize(("qtype", "tied", "auto"), [("F32", False, "float32"), ("Q8_0", True, "int8"),
                                                     ("Q4_0", False, "int4")])  # fmt: skip
def test_gguf_logits_equal_hf_on_the_files_values(qtype, tied, auto, tmp_path):
    from families.lfm2 import write_gguf

    from wkvm.models import registry
    from wkvm.weights.loader import auto_dtype

    torch.manual_seed(7)
    hf = Lfm2ForCausalLM(tiny_config(**{**SHAPES["gqa"], "tie_word_embeddings": tied})).eval()
    randomize(hf)
    stored = write_gguf(tmp_path / "m.gguf", hf, qtype)
    assert registry.detect(tmp_path / "m.gguf")[0].name == "lfm2"
    assert auto_dtype(tmp_path / "m.gguf") == auto
    got = load_model(tmp_path / "m.gguf")
    assert got.config.layer_types == tuple(hf.config.layer_types) and got.config.tied_head == tied
    ids = ids_for(hf.config.vocab_size, 1, 30, seed=9)
    want = hf_with(hf, stored)(ids, use_cache=False).logits[0]
    assert (got.prefill(ids[0], all_logits=True)[0] - want).abs().max() < hf_oracle.ATOL
    if qtype == "F32":
        hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
        assert torch.equal(got.prefill(ids[0])[0], load_model(tmp_path / "hf").prefill(ids[0])[0])


def test_a_gguf_lfm2_chats_with_its_own_vocabulary_and_refuses_what_it_cannot_run(tmp_path):
    """The file's byte-level vocabulary under llama.cpp's `lfm2` pre-tokenizer (Llama 3's split) and its chat
    template drive a chat; an LFM2 file wkvm cannot run says why."""
    import gguf
    from families.lfm2 import write_gguf

    from wkvm.llm import LLM
    from wkvm.sampling_params import SamplingParams

    vocab = [chr(c) for c in range(ord("!"), ord("~") + 1)] + ["<|im_start|>", "<|im_end|>", "Ġ", "Ċ"]
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")  # fmt: skip

    def tokenizer(w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("lfm2")
        w.add_token_list(vocab)
        w.add_token_types([gguf.TokenType.CONTROL if t.startswith("<|") else gguf.TokenType.NORMAL for t in vocab])
        w.add_token_merges([])
        w.add_eos_token_id(vocab.index("<|im_end|>"))
        w.add_add_bos_token(False)
        w.add_chat_template(template)

    torch.manual_seed(5)
    hf = Lfm2ForCausalLM(tiny_config(len(vocab))).eval()
    randomize(hf)
    write_gguf(tmp_path / "chat.gguf", hf, "F32", tokenizer)
    llm = LLM(tmp_path / "chat.gguf")
    out = llm.chat([{"role": "user", "content": "Hi there"}], SamplingParams(max_tokens=6, temperature=0))
    prompt = llm.tokenizer.encode("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    assert out[0].prompt_token_ids == prompt and prompt[0] == vocab.index("<|im_start|>")
    assert out[0].token_ids == greedy_reference(llm.model, prompt, len(out[0].token_ids))

    def refused(name: str, says: str, **kv) -> None:
        def meta(w: gguf.GGUFWriter) -> None:
            for key, value in kv.items():
                getattr(w, key)(value)

        write_gguf(tmp_path / name, hf, "F32", meta)
        with pytest.raises(CheckpointError, match=says):
            load_model(tmp_path / name)

    refused("swa.gguf", "sliding-window", add_sliding_window=8)
