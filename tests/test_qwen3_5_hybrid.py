"""Qwen3.5 hybrids (Gated DeltaNet + gated full attention) against transformers' torch path in fp32: GDN and
attention layers interleaved, grouped-query heads, partial rotary dims, a tied head, Qwen3-Next with dense MLPs.
Logits of a whole prompt and of decode steps, greedy tokens against `generate`, chunked prefill,
and the state: fixed tensors for GDN layers, keys and values for attention layers. The engine-level operations
(batched rows of different lengths, fork, tiers, export/import, chat reuse) run in the conformance suite
(tests/families/qwen3_5_hybrid.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import ids_for
from families.qwen3_5 import randomize, tiny_config
from transformers import DynamicCache, Qwen3_5ForCausalLM

from wkvm.models.family import CheckpointError
from wkvm.weights.loader import load_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny matrices: threads only wait on each other

L, F = "linear_attention", "full_attention"
SHAPES = {
    "3to1_gqa": dict(vocab_size=101, hidden_size=72, intermediate_size=88, linear_num_key_heads=2,
                     linear_num_value_heads=6, linear_key_head_dim=12, linear_value_head_dim=20, num_attention_heads=6,
                     num_key_value_heads=2, head_dim=16, layer_types=[L, L, L, F, L, F]),
    "tied_half_rotary": dict(vocab_size=77, hidden_size=40, intermediate_size=56, linear_num_key_heads=3,
                             linear_num_value_heads=3, linear_key_head_dim=10, linear_value_head_dim=6,
                             linear_conv_kernel_dim=3, num_attention_heads=3, num_key_value_heads=3, head_dim=12,
                             tie_word_embeddings=True, layer_types=[F, L, F],
                             rope_parameters={"rope_type": "default", "rope_theta": 500.0,
                                              "partial_rotary_factor": 0.5}),
}  # fmt: skip
ATOL = 1e-4


@pytest.fixture(scope="module", params=sorted(SHAPES))
def pair(request, tmp_path_factory):
    shape = dict(SHAPES[request.param])
    shape["num_hidden_layers"] = len(shape["layer_types"])
    torch.manual_seed(7)
    hf = Qwen3_5ForCausalLM(tiny_config(**shape)).eval()
    randomize(hf)
    path = tmp_path_factory.mktemp(request.param) / "ckpt"
    hf.save_pretrained(path, safe_serialization=True)
    return hf, load_model(path)


def test_state_is_slots_for_gdn_and_kv_for_attention(pair):
    hf, m = pair
    kinds = {t.name.split(".")[1]: set() for t in m.spec.tensors}
    for t in m.spec.tensors:
        kinds[t.name.split(".")[1]].add(t.kind)
    for i, kind in enumerate(hf.config.layer_types):
        assert kinds[str(i)] == ({"kv"} if kind == F else {"conv", "recurrent"}), i
    assert m.kv_layers == tuple(i for i, k in enumerate(hf.config.layer_types) if k == F)
    assert m.spec.has_kv and not m.spec.cuttable and m.context_length == hf.config.max_position_embeddings


@torch.no_grad()
def test_full_prompt_logits(pair):
    hf, m = pair
    ids = ids_for(m.vocab_size, 2, 83)
    want = hf(ids, use_cache=False).logits
    got = m.forward(ids, m.new_state(2), all_logits=True)
    assert (got - want).abs().max() < ATOL
    assert want[0].std(0).mean() > 0.1  # outputs vary by token


@torch.no_grad()
def test_decode_after_prefill(pair):
    hf, m = pair
    ids = ids_for(m.vocab_size, 1, 30, seed=2)
    cache = DynamicCache(config=hf.config)
    want = [hf(ids[:, :13], cache=cache, use_cache=True).logits[0, -1]]
    want += [hf(ids[:, t : t + 1], cache=cache, use_cache=True).logits[0, -1] for t in range(13, 30)]
    logits, state = m.prefill(ids[0, :13])
    got = [logits] + [m.decode(ids[:, t], state)[0] for t in range(13, 30)]
    assert (torch.stack(got) - torch.stack(want)).abs().max() < ATOL
    assert m.spec.kv_length(state) == 30  # every token fed


@torch.no_grad()
def test_greedy_matches_generate(pair):
    hf, m = pair
    for seed, length in ((3, 1), (4, 9)):
        prompt = ids_for(m.vocab_size, 1, length, seed=seed)
        want = hf.generate(prompt, max_new_tokens=24, do_sample=False)[0, length:].tolist()
        logits, state = m.prefill(prompt[0])
        got = []
        for _ in range(24):
            got.append(int(logits.argmax()))
            logits = m.decode([got[-1]], state)[0]
        assert got == want


@torch.no_grad()
def test_chunked_prefill_equals_one_shot(pair):
    _, m = pair
    ids = ids_for(m.vocab_size, 1, 50, seed=6)[0]
    want, want_state = m.prefill(ids, all_logits=True)
    for chunk in (1, 7, 32):
        got, state = m.prefill(ids, all_logits=True, chunk_size=chunk)
        assert (got - want).abs().max() < ATOL
        for k in state:
            assert torch.allclose(state[k], want_state[k], atol=1e-4), (chunk, k)
    head, state = m.prefill(ids[:21], all_logits=True)  # continuing a state that holds GDN slots and KV
    tail, state = m.prefill(ids[21:], state, all_logits=True, chunk_size=9)
    assert (torch.cat([head, tail]) - want).abs().max() < ATOL
    rows = [ids_for(m.vocab_size, 1, n, seed=n)[0] for n in (3, 17)]  # batched rows of different lengths: the
    states = [m.prefill(r)[1] for r in rows]  # engine's paged caches (the conformance suite runs them batched)
    assert [m.spec.kv_length(s) for s in states] == [3, 17]


@torch.no_grad()
def test_qwen3_next_hybrid_with_dense_mlp(tmp_path):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    kinds = [L, F, L, F]
    cfg = Qwen3NextConfig(vocab_size=93, hidden_size=48, intermediate_size=40, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4,
                          linear_key_head_dim=10, linear_value_head_dim=14, linear_num_key_heads=2,
                          linear_num_value_heads=4, mlp_only_layers=list(range(4)), num_experts=0,
                          layer_types=kinds)  # fmt: skip
    torch.manual_seed(2)
    hf = Qwen3NextForCausalLM(cfg).eval()
    randomize(hf)
    hf.save_pretrained(tmp_path / "next", safe_serialization=True)
    ids = ids_for(93, 2, 40, seed=10)
    want = hf(ids, use_cache=False).logits
    m = load_model(tmp_path / "next")
    assert (m.forward(ids, m.new_state(2), all_logits=True) - want).abs().max() < ATOL


def test_layer_types_must_match_the_tensors(tmp_path):
    torch.manual_seed(4)
    model = Qwen3_5ForCausalLM(tiny_config(101, num_hidden_layers=2, layer_types=[L, F]))
    model.save_pretrained(tmp_path / "h", safe_serialization=True)
    cfg_path = tmp_path / "h" / "config.json"
    cfg_path.write_text(cfg_path.read_text().replace('"full_attention"', '"linear_attention"'))
    with pytest.raises(CheckpointError, match="layer_types"):
        load_model(tmp_path / "h")


def test_100_chats_sharing_a_300_token_system_prompt(tmp_path):
    """The issue's proof: 100 requests share a 300-token system prompt, then ask different questions. From the
    second on, each reuses at least the whole system prompt (the first kept a checkpoint at its end: GDN state and
    keys/values together), and every answer equals the same request on a server without reuse."""
    import random

    import httpx
    from conftest import CHAR_VOCAB, write_char_tokenizer
    from families import qwen3_5_hybrid
    from live_server import LiveServer

    path = qwen3_5_hybrid.write_checkpoint(tmp_path / "hybrid", len(CHAR_VOCAB), seed=9)
    write_char_tokenizer(path)
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    system = {"role": "system", "content": "".join(rng.choice(letters) for _ in range(300))}
    with LiveServer(model=str(path), slots=4) as reuse, \
            LiveServer(model=str(path), slots=4, prefix_reuse=False) as fresh:  # fmt: skip
        a, b = httpx.Client(base_url=reuse.url, timeout=120), httpx.Client(base_url=fresh.url, timeout=120)
        reused = []
        for i in range(100):
            question = "".join(rng.choice(letters) for _ in range(rng.randint(5, 20))) + "?"
            req = {"messages": [system, {"role": "user", "content": question}], "max_tokens": 4, "temperature": 0,
                   "ignore_eos": True}  # fmt: skip
            got, want = a.post("/v1/chat/completions", json=req).json(), b.post("/v1/chat/completions", json=req).json()
            assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"], i
            reused.append(got["wkvm"]["reused_tokens"])
    assert reused[0] == 0 and min(reused[1:]) >= 300, reused


def test_config_values_of_the_wrong_type_are_refused_by_name(tmp_path):
    """Loading hunt (session 49): Qwen3-Next's linear_num_key_heads 0 or "x" had escaped as a ZeroDivisionError /
    ValueError traceback, a multimodal config's text_config [1, 2] or "abc" as a TypeError / ValueError."""
    import json

    from families.qwen3_5 import write_checkpoint
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    cfg = Qwen3NextConfig(vocab_size=50, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_conv_kernel_dim=4,
                          linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                          linear_num_value_heads=2, mlp_only_layers=[0, 1], num_experts=0,
                          layer_types=[L, F])  # fmt: skip
    Qwen3NextForCausalLM(cfg).save_pretrained(tmp_path / "next", safe_serialization=True)
    text = write_checkpoint(tmp_path / "text", 50)

    def edited(src, name, **changes):
        d = tmp_path / name
        d.mkdir()
        for f in src.iterdir():
            (d / f.name).write_bytes(f.read_bytes())
        config = json.loads((src / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**config, **changes}))
        return d

    load_model(tmp_path / "next")
    for value in (0, "x", 1.5):
        with pytest.raises(CheckpointError, match=f"linear_num_key_heads {value!r} is not a positive integer") as e:
            load_model(edited(tmp_path / "next", f"next{value}", linear_num_key_heads=value))
        assert str(tmp_path / f"next{value}") in str(e.value)
    for value in ([1, 2], "abc"):
        with pytest.raises(CheckpointError, match=f"text_config is {type(value).__name__}, not an object") as e:
            load_model(edited(text, f"tc{type(value).__name__}", model_type="qwen3_5", text_config=value))
        assert str(tmp_path / f"tc{type(value).__name__}") in str(e.value)
