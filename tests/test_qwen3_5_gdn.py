"""Qwen3.5 Gated DeltaNet against transformers (its torch code paths) in fp32, on odd tiny shapes: Hk != Hv, head
dims not powers of two, vocab not a multiple of 8, a tied head; plus Qwen3-Next's fused layout, the multimodal
layout, chunking, batching, bf16 and streamed weights."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import ids_for
from families.qwen3_5 import randomize, tiny_config
from transformers import DynamicCache, Qwen3_5ForCausalLM

from wkvm.models.qwen3_5 import gated_delta
from wkvm.models.qwen3_5.gated_delta import gated_delta_chunked, gated_delta_step
from wkvm.weights.loader import load_model
from wkvm.weights.pack import write_pack

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny matrices: threads only wait on each other

SHAPES = {
    "gqa": dict(vocab_size=101, hidden_size=72, intermediate_size=88, linear_num_key_heads=2, linear_num_value_heads=6,
                linear_key_head_dim=12, linear_value_head_dim=20, num_hidden_layers=2),
    "tied": dict(vocab_size=77, hidden_size=40, intermediate_size=56, linear_num_key_heads=3, linear_num_value_heads=3,
                 linear_key_head_dim=10, linear_value_head_dim=6, linear_conv_kernel_dim=3, num_hidden_layers=3,
                 tie_word_embeddings=True),
}  # fmt: skip
ATOL = 1e-4


class LinearCache(DynamicCache):
    """transformers 5.24 asks a cache for its length through attention layers only, which a model of linear
    attention layers lacks: this one counts the tokens fed (see `count_tokens`); nothing else changes."""

    seen = 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.seen + query_length, 0


def count_tokens(module, args, kwargs, output) -> None:
    ids = kwargs.get("input_ids", args[0] if args else None)
    cache = kwargs.get("cache")
    if isinstance(cache, LinearCache):
        cache.seen += ids.shape[1]


def save_hf(model: torch.nn.Module, path) -> torch.nn.Module:
    randomize(model)
    model.save_pretrained(path, safe_serialization=True)
    model.register_forward_hook(count_tokens, with_kwargs=True)
    return model.eval()


@pytest.fixture(scope="module", params=sorted(SHAPES))
def pair(request, tmp_path_factory):
    """(checkpoint dir, transformers model, wkvm model) for one shape."""
    torch.manual_seed(1)
    path = tmp_path_factory.mktemp(request.param) / "ckpt"
    hf = save_hf(Qwen3_5ForCausalLM(tiny_config(**SHAPES[request.param])), path)
    return path, hf, load_model(path)


@torch.no_grad()
def test_full_prompt_logits(pair):
    _, hf, m = pair
    ids = ids_for(m.vocab_size, 2, 83)  # more than one kernel chunk
    want = hf(ids, use_cache=False).logits
    got = m.forward(ids, m.new_state(2), all_logits=True)
    assert (got - want).abs().max() < ATOL
    assert want[0, :, :].std(0).mean() > 0.1  # outputs vary by token


@torch.no_grad()
def test_decode_after_prefill(pair):
    _, hf, m = pair
    ids = ids_for(m.vocab_size, 1, 24, seed=2)
    cache = LinearCache(config=hf.config)
    want = [hf(ids[:, :13], cache=cache, use_cache=True).logits[0, -1]]
    want += [hf(ids[:, t : t + 1], cache=cache, use_cache=True).logits[0, -1] for t in range(13, 24)]
    logits, state = m.prefill(ids[0, :13], all_logits=False)
    got = [logits] + [m.decode(ids[:, t], state)[0] for t in range(13, 24)]
    assert (torch.stack(got) - torch.stack(want)).abs().max() < ATOL


@torch.no_grad()
def test_greedy_matches_generate(pair):
    _, hf, m = pair
    for seed, length in ((3, 1), (4, 7), (5, 19)):
        prompt = ids_for(m.vocab_size, 1, length, seed=seed)
        want = hf.generate(prompt, max_new_tokens=32, do_sample=False, cache=LinearCache(config=hf.config))
        logits, state = m.prefill(prompt[0])
        got = []
        for _ in range(32):
            got.append(int(logits.argmax()))
            logits = m.decode([got[-1]], state)[0]
        assert got == want[0, length:].tolist()


@torch.no_grad()
def test_chunked_prefill_equals_token_by_token(pair):
    _, _, m = pair
    ids = ids_for(m.vocab_size, 1, 70, seed=6)[0]
    step_state = m.new_state(1)
    want = torch.stack([m.decode(ids[t : t + 1], step_state)[0] for t in range(70)])
    for chunk in (1, 5, 64, None):
        got, state = m.prefill(ids, all_logits=True, chunk_size=chunk)
        assert (got - want).abs().max() < ATOL
        for k in state:
            assert torch.allclose(state[k], step_state[k], atol=1e-4), (chunk, k)
    for kernel_chunk in (1, 7, 32):  # the WY chunk: sizes not dividing T
        m.delta_chunk = kernel_chunk
        try:
            got, _ = m.prefill(ids, all_logits=True)
        finally:
            m.delta_chunk = 64
        assert (got - want).abs().max() < ATOL
    head, state = m.prefill(ids[:29], all_logits=True)  # continuing from a non-zero state
    tail, state = m.prefill(ids[29:], state, all_logits=True, chunk_size=17)
    assert (torch.cat([head, tail]) - want).abs().max() < ATOL


@torch.no_grad()
def test_batched_decode_equals_each_alone(pair):
    _, _, m = pair
    prompts = [ids_for(m.vocab_size, 1, n, seed=n)[0] for n in (3, 11, 6)]
    states = [m.prefill(p)[1] for p in prompts]
    batch = {k: torch.cat([s[k] for s in states]) for k in states[0]}
    nxt = torch.tensor([5, 9, 2])
    got = m.decode(nxt, batch)
    for j, s in enumerate(states):
        alone = m.decode(nxt[j : j + 1], s)
        assert (got[j] - alone[0]).abs().max() < 1e-5
        for k in s:
            assert torch.allclose(batch[k][j], s[k][0], atol=1e-6)


@torch.no_grad()
def test_fused_decode_step_equals_torch_ops(pair, monkeypatch):
    """The decode step's one kernel call per GDN layer (conv, norms, gates, delta rule, gated norm) against the
    model's torch ops, its reference: a batch of two continuing different prompts, logits and every state tensor."""
    _, _, m = pair
    if not gated_delta.kernel_available():
        pytest.skip("no C++ compiler here: decode runs its torch ops")
    from wkvm.models.qwen3_5 import model as qwen_model

    ran = []  # the kernel's answers: its guard handing every step to the torch ops would compare them with themselves

    def spy(*args, **kwargs):
        ran.append(gated_delta.layer_steps(*args, **kwargs))
        return ran[-1]

    monkeypatch.setattr(qwen_model, "layer_steps", spy)
    prompts = [ids_for(m.vocab_size, 1, n, seed=n)[0] for n in (5, 9)]
    states = [m.prefill(p)[1] for p in prompts]
    fused = {k: torch.cat([s[k] for s in states]) for k in states[0]}
    plain = {k: t.clone() for k, t in fused.items()}
    try:
        for step in range(4):
            nxt = torch.tensor([3 + step, 11 - step])
            m.fused_decode = True
            got = m.decode(nxt, fused)
            m.fused_decode = False
            want = m.decode(nxt, plain)
            assert (got - want).abs().max() < 1e-5
            for k in fused:
                assert torch.allclose(fused[k], plain[k], rtol=1e-5, atol=1e-5), k
        assert ran and all(o is not None for o in ran)
    finally:
        m.fused_decode = True


def test_a_width_one_conv_decodes_on_the_torch_ops():
    """The decode kernel keeps a conv window of K-1 >= 1 inputs: with K = 1 (a valid config, no window) its guard
    hands the step to the torch ops instead of the kernel refusing it (which failed the model's load)."""
    Hk, Hv, dk, dv, B = 1, 2, 4, 3, 1
    CD = 2 * Hk * dk + Hv * dv
    proj = torch.randn(B, 1, CD + Hv * dv + 2 * Hv)
    args = (torch.zeros(B, CD, 0), torch.randn(CD, 1), torch.zeros(B * Hv, dk, dv), -torch.rand(Hv), torch.randn(Hv),
            torch.ones(dv))  # fmt: skip
    assert gated_delta.layer_steps(proj, *args, Hk, dk, 1e-6, 1e-6) is None


@torch.no_grad()
def test_forward_groups_equals_separate(pair):
    _, _, m = pair
    groups = [(ids_for(m.vocab_size, 2, 9, seed=7), m.new_state(2)), (ids_for(m.vocab_size, 1, 1, seed=8),
              m.new_state(1)), (ids_for(m.vocab_size, 3, 70, seed=9), m.new_state(3))]  # fmt: skip
    alone = [m.forward(t, m.new_state(t.shape[0]), all_logits=True) for t, _ in groups]
    together = m.forward_groups(groups, all_logits=True)
    for a, b in zip(alone, together, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("form", ["kernel", "torch"])
def test_recurrence_chunked_equals_step(form):
    """Strong and weak decays, a non-zero start, chunks that do not divide T, grouped heads (value head j reads key
    head j // 2), a batch of two, v strided as the projection's split gives it; the C++ kernel and the torch form."""
    if form == "kernel" and not gated_delta.kernel_available():
        pytest.skip("no C++ compiler here: the chunked rule runs its torch form")
    chunked = gated_delta_chunked if form == "kernel" else gated_delta.chunked_torch
    torch.manual_seed(0)
    B, T, Hk, Hv, dk, dv = 2, 45, 3, 6, 9, 7
    q, k = (torch.nn.functional.normalize(torch.randn(B, T, Hk, dk), dim=-1) for _ in range(2))
    v = torch.randn(B, T, Hv * dv + 5)[..., 5:].unflatten(-1, (Hv, dv))
    g = -torch.rand(B, T, Hv) * torch.tensor([0.01, 0.5, 3.0, 20.0, 80.0, 1.0])
    beta = torch.rand(B, T, Hv)
    S0 = torch.randn(B * Hv, dk, dv)
    S = S0.double()  # the reference in float64: both fp32 forms sit within ~2e-5 of it at chunk 64
    qs, ks = (x.repeat_interleave(Hv // Hk, 2).double() for x in (q, k))
    want = torch.stack([gated_delta_step(S, qs[:, t].reshape(B * Hv, dk), ks[:, t].reshape(B * Hv, dk),
                                         v[:, t].reshape(B * Hv, dv).double(), g[:, t].reshape(B * Hv).double(),
                                         beta[:, t].reshape(B * Hv).double()) for t in range(T)], 1)  # fmt: skip
    want = want.view(B, Hv, T, dv).transpose(1, 2)
    for chunk in (1, 4, 16, 64):
        Sc = S0.clone()
        got = chunked(Sc, q, k, v, g, beta, chunk=chunk)
        assert got.shape == (B, T, Hv, dv)
        assert (got - want).abs().max() < 5e-5 and (Sc - S).abs().max() < 5e-5


@torch.no_grad()
def test_qwen3_next_fused_layout(tmp_path):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    n = 2
    cfg = Qwen3NextConfig(vocab_size=93, hidden_size=48, intermediate_size=40, num_hidden_layers=n,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_conv_kernel_dim=4,
                          linear_key_head_dim=10, linear_value_head_dim=14, linear_num_key_heads=2,
                          linear_num_value_heads=4, mlp_only_layers=list(range(n)), num_experts=0,
                          layer_types=["linear_attention"] * n)  # fmt: skip
    torch.manual_seed(2)
    hf = save_hf(Qwen3NextForCausalLM(cfg), tmp_path / "next")
    ids = ids_for(93, 2, 40, seed=10)
    want = hf(ids, use_cache=False).logits
    got = load_model(tmp_path / "next").forward(ids, load_model(tmp_path / "next").new_state(2), all_logits=True)
    assert (got - want).abs().max() < ATOL
    from wkvm.models.qwen3_5.checkpoint import convert

    convert(tmp_path / "next", tmp_path / "text")  # to the Qwen3.5 text layout: transformers reads it alike
    assert json.loads((tmp_path / "text" / "config.json").read_text())["model_type"] == "qwen3_5_text"
    again = Qwen3_5ForCausalLM.from_pretrained(tmp_path / "text").eval()
    assert (again(ids, use_cache=False).logits - want).abs().max() < ATOL


@torch.no_grad()
def test_multimodal_checkpoint_reads_the_language_model(tmp_path):
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = tiny_config(**SHAPES["gqa"]).to_dict()
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=72, patch_size=4,
                  num_position_embeddings=16)  # fmt: skip
    torch.manual_seed(3)
    hf = save_hf(Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision)),
                 tmp_path / "mm")  # fmt: skip
    ids = ids_for(101, 1, 30, seed=11)
    want = hf(input_ids=ids, use_cache=False).logits
    m = load_model(tmp_path / "mm")
    assert (m.forward(ids, m.new_state(1), all_logits=True) - want).abs().max() < ATOL


@torch.no_grad()
def test_bf16_runs_close(pair):
    path, _, m = pair
    ids = ids_for(m.vocab_size, 1, 20, seed=12)
    want = m.forward(ids, m.new_state(1), all_logits=True)
    low = load_model(path, dtype="bfloat16")
    got = low.forward(ids, low.new_state(1), all_logits=True)
    assert got.dtype == torch.float32 and (got - want).abs().mean() < 0.05 * want.abs().mean()
    assert torch.corrcoef(torch.stack([got.flatten(), want.flatten()]))[0, 1] > 0.99


@torch.no_grad()
def test_pack_streaming_equals_resident(pair, tmp_path):
    path, _, m = pair
    write_pack(path, tmp_path / "pack")
    streamed = load_model(tmp_path / "pack", weight_cache_layers=1)
    ids = ids_for(m.vocab_size, 2, 15, seed=13)
    want = m.forward(ids, m.new_state(2), all_logits=True)
    assert (streamed.forward(ids, streamed.new_state(2), all_logits=True) - want).abs().max() < 1e-5
    assert streamed.fingerprint == m.fingerprint
