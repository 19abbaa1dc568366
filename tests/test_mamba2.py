"""Mamba2 against transformers' `Mamba2ForCausalLM` (its torch path, fp32) on odd tiny shapes, and the family's
own contracts: chunked prefill == token steps, batched == alone, groups == separate, both checkpoint layouts,
conversion, bf16, weight packs with streaming."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from families.mamba2 import random_model

from wkvm.cli import main
from wkvm.models import registry
from wkvm.models.family import CheckpointError
from wkvm.models.mamba2.checkpoint import detect_state_spaces
from wkvm.weights.loader import load_model
from wkvm.weights.pack import write_pack

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny matrices: threads only wait on each other

ATOL = 1e-4
# hidden * expand == heads * head_dim; groups > 1, head_dim 12 and 5, vocabs not multiples of 8, kernels 4, 3, 2
SHAPES = {
    "G2-P12-K4-V101": {"hidden_size": 48, "num_hidden_layers": 2, "num_heads": 8, "head_dim": 12, "state_size": 16,
                       "n_groups": 2, "conv_kernel": 4, "vocab_size": 101},
    "G4-P5-K3-V77": {"hidden_size": 40, "num_hidden_layers": 3, "num_heads": 16, "head_dim": 5, "state_size": 8,
                     "n_groups": 4, "conv_kernel": 3, "vocab_size": 77},
    "G1-P16-K2-V67-bias-tied": {"hidden_size": 32, "num_hidden_layers": 2, "num_heads": 4, "head_dim": 16,
                                "state_size": 12, "n_groups": 1, "conv_kernel": 2, "vocab_size": 67, "use_bias": True,
                                "use_conv_bias": False, "tie_word_embeddings": True},
}  # fmt: skip


@pytest.fixture(scope="module", params=list(SHAPES))
def pair(request, tmp_path_factory):
    """(transformers model, wkvm model, checkpoint dir) for one shape; HF's own chunk size is small so that its
    chunked path runs several chunks too."""
    hf = random_model(len(request.param), chunk_size=8, **SHAPES[request.param])
    path = tmp_path_factory.mktemp("mamba2") / request.param
    hf.save_pretrained(path)
    return hf, load_model(path), path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("mamba2-tiny") / "hf"
    hf = random_model(5, chunk_size=8, **SHAPES["G2-P12-K4-V101"])
    hf.save_pretrained(path)
    return hf, load_model(path), path


def prompt(vocab: int, n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


@torch.no_grad()
def test_full_prompt_logits_match_transformers(pair):
    hf, model, _ = pair
    ids = prompt(model.vocab_size, 37, 0)
    want = hf(ids).logits
    got = model.forward(ids, model.new_state(1), all_logits=True)
    assert got.shape == want.shape == (1, 37, hf.config.vocab_size)
    assert max_diff(got, want) < ATOL


@torch.no_grad()
def test_decode_after_prefill_matches_transformers_cache(pair):
    hf, model, _ = pair
    ids = prompt(model.vocab_size, 30, 1)
    cache = hf(ids[:, :19], use_cache=True).cache
    state = model.new_state(1)
    model.prefill(ids[0, :19], state)
    for t in range(19, 30):
        want = hf(ids[:, t : t + 1], cache=cache, use_cache=True).logits[:, -1]
        assert max_diff(model.decode(ids[0, t : t + 1], state), want) < ATOL


@torch.no_grad()
def test_greedy_tokens_match_transformers_generate(pair):
    hf, model, _ = pair
    for seed, n in ((2, 1), (3, 6), (4, 17)):
        ids = prompt(model.vocab_size, n, seed)
        # no eos: the random model may well pick token 2 (its config's eos), and generation must go on past it
        want = hf.generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)[0, n:]
        assert len(want) == 32
        logits, state = model.prefill(ids[0])
        got = []
        for _ in range(32):
            got.append(int(logits.reshape(-1).argmax()))
            logits = model.decode([got[-1]], state)
        assert got == want.tolist()


def steps(model, ids: torch.Tensor, state) -> torch.Tensor:
    return torch.stack([model.decode(ids[t : t + 1], state)[0] for t in range(len(ids))])


@pytest.mark.parametrize("chunk", [1, 3, 7, 64])
@pytest.mark.parametrize("ssd_chunk", [4, 64])
def test_chunked_prefill_equals_token_steps_from_any_state(tiny, chunk, ssd_chunk):
    _, model, _ = tiny
    model.ssd_chunk = ssd_chunk
    try:
        ids = prompt(model.vocab_size, 29, 6)[0]
        want_state = model.new_state(1)
        want = steps(model, ids, want_state)
        got, state = model.prefill(ids, all_logits=True, chunk_size=chunk)
        assert max_diff(got, want) < 1e-5
        for k in state:
            assert max_diff(state[k], want_state[k]) < 1e-5, k
        more = prompt(model.vocab_size, 13, 7)[0]  # continuing from a non-zero state
        got, state = model.prefill(more, state, all_logits=True, chunk_size=chunk)
        assert max_diff(got, steps(model, more, want_state)) < 1e-5
    finally:
        model.ssd_chunk = 64


def test_batched_decode_equals_each_alone(tiny):
    _, model, _ = tiny
    prefixes = [prompt(model.vocab_size, n, 10 + n)[0] for n in (1, 4, 9, 2)]
    alone = [model.prefill(p)[1] for p in prefixes]
    batch = {k: torch.cat([s[k] for s in alone]) for k in alone[0]}
    for step in range(5):
        tokens = [(7 * step + 3 * j) % model.vocab_size for j in range(len(prefixes))]
        got = model.decode(tokens, batch)
        for j, s in enumerate(alone):
            assert max_diff(got[j], model.decode([tokens[j]], s)[0]) < 1e-5
    for j, s in enumerate(alone):
        for k in s:
            assert max_diff(batch[k][j], s[k][0]) < 1e-5


@pytest.mark.parametrize("clamp", [False, True])
def test_fused_decode_step_equals_torch_ops(pair, clamp, monkeypatch):
    """The mixer's one-token step in one kernel call (conv, SiLU, dt, SSM step, D) against the torch ops, its
    reference: a batch of three continuing different prompts, logits and every state tensor, to fp32 rounding; with
    dt clamped to a time-step limit too (both paths read it from the config)."""
    from wkvm.models.mamba2 import ssd

    _, model, _ = pair
    if not ssd.kernel_available():
        pytest.skip("no C++ compiler here: decode runs the mixer's torch ops")
    if clamp:
        monkeypatch.setattr(model, "config", dataclasses.replace(model.config, dt_min=0.05, dt_max=0.3))
    from wkvm.models.mamba2 import model as mamba2_model

    ran = []  # the kernel's answers: its guard handing every step to the torch ops would compare them with themselves

    def spy(*args, **kwargs):
        ran.append(ssd.mixer_steps(*args, **kwargs))
        return ran[-1]

    monkeypatch.setattr(mamba2_model, "mixer_steps", spy)
    states = [model.prefill(prompt(model.vocab_size, n, 30 + n)[0])[1] for n in (2, 7, 5)]
    fused = {k: torch.cat([s[k] for s in states]) for k in states[0]}
    plain = {k: t.clone() for k, t in fused.items()}
    try:
        for step in range(4):
            tokens = [(5 * step + 2 * j) % model.vocab_size for j in range(3)]
            model.fused_decode = True
            got = model.decode(tokens, fused)
            model.fused_decode = False
            want = model.decode(tokens, plain)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            for k in fused:
                torch.testing.assert_close(fused[k], plain[k], rtol=1e-4, atol=1e-5)
        assert ran and all(y is not None for y in ran)
    finally:
        model.fused_decode = True


@pytest.mark.parametrize("form", ["kernel", "torch"])
def test_ssd_chunked_equals_steps(form):
    """The chunked SSD form (ssd.cpp's kernel and the torch ops) against the step recurrence in float64: groups,
    odd head and state sizes, a batch of two, x strided as the projection's split gives it, chunks that do not
    divide T, weak and strong decays, a non-zero start."""
    from wkvm.models.mamba2 import ssd

    if form == "kernel" and not ssd.kernel_available():
        pytest.skip("no C++ compiler here: prefill runs the torch form")
    chunked = ssd.ssd_chunked if form == "kernel" else ssd.ssd_chunked_torch
    torch.manual_seed(0)
    b, T, H, P, N, G = 2, 45, 6, 5, 7, 3
    x = torch.randn(b, T, H * P + 4)[..., 4:].unflatten(-1, (H, P))
    dt = torch.rand(b, T, H) * 0.5
    A = -torch.tensor([0.01, 0.3, 1.0, 4.0, 20.0, 0.5])
    B, C, D = torch.randn(b, T, G, N), torch.randn(b, T, G, N), torch.randn(H)
    S0 = torch.randn(b, H, P, N)
    S = S0.double()
    want = torch.stack([ssd.ssd_step(S, x[:, t].double(), dt[:, t].double(), A.double(), B[:, t].double(),
                                     C[:, t].double(), D.double()) for t in range(T)], 1)  # fmt: skip
    for chunk in (1, 4, 16, 64):
        Sc = S0.clone()
        got = chunked(Sc, x, dt, A, B, C, D, chunk)
        assert got.shape == (b, T, H, P)
        assert (got - want).abs().max() < 5e-5 and (Sc - S).abs().max() < 5e-5


def test_a_width_one_conv_decodes_on_the_torch_ops():
    """The decode kernel keeps a conv window of K-1 >= 1 inputs: with K = 1 its guard hands the step to the torch
    ops (Bamba's config allows it; the kernel's refusal had failed the model's load)."""
    from wkvm.models.mamba2 import ssd

    b, H, P, N, G = 1, 2, 3, 4, 1
    CD = H * P + 2 * G * N
    proj = torch.randn(b, 1, H * P + CD + H)
    got = ssd.mixer_steps(proj, torch.zeros(b, CD, 0), torch.randn(CD, 1), torch.zeros(CD), torch.zeros(b, H, P, N),
                           torch.randn(H), -torch.rand(H), torch.randn(H), G, 0.0, None)  # fmt: skip
    assert got is None


def test_forward_groups_equal_separate_forwards(tiny):
    _, model, _ = tiny
    shapes = ((3, 1), (2, 5), (1, 11))
    groups = [(prompt(model.vocab_size, b * t, 20 + t).reshape(b, t), model.new_state(b)) for b, t in shapes]
    separate = [(tokens, {k: v.clone() for k, v in state.items()}) for tokens, state in groups]
    got = model.forward_groups(groups, all_logits=True)
    for (tokens, state), (_, grouped_state), out in zip(separate, groups, got, strict=True):
        assert max_diff(out, model.forward(tokens, state, all_logits=True)) < 1e-5
        for k in state:
            assert max_diff(grouped_state[k], state[k]) < 1e-5


def write_state_spaces(hf, dst):
    """The original mamba_ssm layout of a transformers model: backbone.embedding, a MambaConfig, a .bin file."""
    c = hf.config
    sd = {k.replace("backbone.embeddings.", "backbone.embedding."): v.clone() for k, v in hf.state_dict().items()}
    dst.mkdir(parents=True)
    torch.save(sd, dst / "pytorch_model.bin")
    ssm = {
        "layer": "Mamba2",
        "d_state": c.state_size,
        "d_conv": c.conv_kernel,
        "expand": c.expand,
        "headdim": c.head_dim,
        "ngroups": c.n_groups,
        "bias": c.use_bias,
        "conv_bias": c.use_conv_bias,
    }
    config = {"d_model": c.hidden_size, "d_intermediate": 0, "n_layer": c.num_hidden_layers,
              "vocab_size": c.vocab_size - 3, "ssm_cfg": ssm, "attn_layer_idx": [], "attn_cfg": {}, "rms_norm": True,
              "residual_in_fp32": True, "fused_add_norm": True, "pad_vocab_size_multiple": 1,
              "tie_embeddings": c.tie_word_embeddings}  # fmt: skip
    (dst / "config.json").write_text(json.dumps(config))  # vocab_size unpadded: the rows come from the embedding
    return dst


def test_state_spaces_layout_loads_and_converts(pair, tmp_path):
    hf, model, hf_path = pair
    ss = write_state_spaces(hf, tmp_path / "ss")
    assert detect_state_spaces(ss) == "state-spaces" and detect_state_spaces(hf_path) is None
    assert registry.detect(ss)[1] == "state-spaces" and registry.detect(hf_path)[1] == "hf"
    ids = prompt(model.vocab_size, 21, 8)
    want = model.forward(ids, model.new_state(1), all_logits=True)
    ss_model = load_model(ss)
    # same tensors, same config dataclass: the same fingerprint, and the same logits bit for bit
    assert ss_model.fingerprint == model.fingerprint
    assert torch.equal(ss_model.forward(ids, ss_model.new_state(1), all_logits=True), want)
    assert main(["convert", str(ss), str(tmp_path / "hf")]) == 0
    assert main(["convert", str(hf_path), str(tmp_path / "ss2")]) == 0
    for converted in (tmp_path / "hf", tmp_path / "ss2"):
        again = load_model(converted)
        assert again.fingerprint == model.fingerprint
        assert torch.equal(again.forward(ids, again.new_state(1), all_logits=True), want)


def test_v1_and_hf_directories_are_not_state_spaces(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"d_model": 8, "n_layer": 1, "ssm_cfg": {}}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    assert detect_state_spaces(tmp_path) is None
    assert detect_state_spaces(tmp_path / "missing") is None


def test_bf16_load_stays_close(tiny):
    _, model, path = tiny
    ids = prompt(model.vocab_size, 25, 9)
    want = model.forward(ids, model.new_state(1), all_logits=True)
    bf16 = load_model(path, dtype="bfloat16")
    got = bf16.forward(ids, bf16.new_state(1), all_logits=True)
    assert max_diff(got, want) < 0.05 * want.abs().max().item()


def test_weight_pack_streaming_equals_resident(tiny, tmp_path):
    _, model, path = tiny
    pack = write_pack(path, tmp_path / "pack")
    ids = prompt(model.vocab_size, 19, 11)
    want = model.forward(ids, model.new_state(1), all_logits=True)
    for streamed in (load_model(pack, weight_cache_layers=1), load_model(pack)):
        assert streamed.fingerprint == model.fingerprint
        state = streamed.new_state(1)
        assert max_diff(streamed.forward(ids, state, all_logits=True), want) < 1e-5
        assert max_diff(streamed.decode([3], state), model.decode([3], model.prefill(ids[0])[1])) < 1e-5


def test_a_state_spaces_config_of_the_wrong_sizes_is_refused_by_name(tiny, tmp_path):
    """Loading hunt (session 49): ssm_cfg.headdim 0, d_model null and dt_limit a number had escaped as a
    ZeroDivisionError / TypeError traceback; d_state "six" was taken; a config without ngroups takes mamba_ssm's 1,
    which the weights' state size then refuses (it had run another model silently)."""
    from wkvm.models.mamba2.checkpoint import convert

    _, model, path = tiny
    ss = tmp_path / "ss"
    convert(path, ss, "hf")
    config = json.loads((ss / "config.json").read_text())
    ids = prompt(model.vocab_size, 9, 3)
    assert torch.equal(load_model(ss).forward(ids, model.new_state(1)), model.forward(ids, model.new_state(1)))

    def edited(name, ssm=None, **changes):
        d = tmp_path / name
        d.mkdir()
        (d / "pytorch_model.bin").write_bytes((ss / "pytorch_model.bin").read_bytes())
        cfg = {**config, **changes, "ssm_cfg": {**config["ssm_cfg"], **(ssm or {})}}
        cfg["ssm_cfg"] = {k: v for k, v in cfg["ssm_cfg"].items() if v is not None}
        (d / "config.json").write_text(json.dumps(cfg))
        return d

    for name, d, says in [
        ("hd0", edited("hd0", {"headdim": 0}), "ssm_cfg.headdim 0 is not a positive integer"),
        ("six", edited("six", {"d_state": "six"}), "ssm_cfg.d_state 'six' is not a positive integer"),
        ("model", edited("model", d_model=None), "d_model None is not a positive integer"),
        ("expand", edited("expand", {"expand": [2]}), r"ssm_cfg.expand \[2\] is not a positive integer"),
        ("dt", edited("dt", {"dt_limit": 0.1}), "time_step_limit 0.1 is not a pair of numbers"),
        ("groups", edited("groups", {"ngroups": None}), "state_size 16 with n_groups 1 does not fit"),
    ]:  # fmt: skip
        with pytest.raises(CheckpointError, match=says) as e:
            load_model(d)
        assert str(tmp_path / name) in str(e.value)
