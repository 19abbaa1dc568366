"""Both checkpoint formats: same weights give identical logits; conversion round trips are bit-identical."""

import gc
import json
import re
import sys
from pathlib import Path

import pytest
import torch

from wkvm.models.rwkv7.checkpoint import CheckpointError, convert, read_checkpoint
from wkvm.models.rwkv7.random_weights import RWKV7Shape, save_random_rwkv7
from wkvm.weights.arena import gather_small
from wkvm.weights.loader import load_model


def assert_bit_identical(a, b):
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k


def test_pth_and_hf_give_identical_logits(tiny_pth, tiny_hf):
    a, b = load_model(tiny_pth), load_model(tiny_hf)
    tokens = list(range(1, 40))
    la, _ = a.prefill(tokens, all_logits=True)
    lb, _ = b.prefill(tokens, all_logits=True)
    assert torch.equal(la, lb)
    assert a.fingerprint == b.fingerprint


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_a_loaded_checkpoint_is_not_left_mapped(tmp_path, tiny_pth, dtype):
    """torch.load maps a .pth file; a model tensor kept as it was read (fp32 norms, LoRAs, an fp32 embedding) held the
    whole mapping, so every page of the file stayed in the server's resident memory. The loader copies those."""
    path = tmp_path / "mapped.pth"
    path.write_bytes(tiny_pth.read_bytes())
    model = load_model(path, dtype=dtype)
    gc.collect()
    assert str(path.resolve()) not in Path("/proc/self/maps").read_text()
    reference = load_model(tiny_pth, dtype=dtype)
    ids = list(range(1, 9))
    assert torch.equal(model.prefill(ids)[0], reference.prefill(ids)[0])


def test_small_weights_are_gathered_into_one_block_in_order():
    """A quantized model's layer matrices are mostly under 2 MiB, below which torch allocates on 4 KiB pages: the
    loader moves them into one block (on huge pages), in the order the layers read them. The values stay; a tensor
    that is one object in two places stays one; tensors sharing a storage, views into a larger one, large tensors
    and oneDNN's blocked ones stay where they are."""
    g = torch.Generator().manual_seed(0)
    layers = [{"norm": torch.randn(576, generator=g), "w": torch.randint(-128, 127, (960, 580), dtype=torch.int8),
               "odd": torch.randn(3, 7, generator=g).to(torch.bfloat16)} for _ in range(6)]  # fmt: skip
    tied = torch.randn(1000, 250, generator=g)  # 1 MB, in both places
    shared = torch.randn(64, generator=g)
    large = torch.randn(1024, 1024, generator=g)  # 4 MiB: on huge pages already
    view = torch.randn(200, generator=g)[:100]  # the front of a larger storage
    glob = {"emb": tied, "head": tied, "a": shared, "b": shared.view(8, 8), "large": large, "view": view,
            "blocked": torch.randn(64, 64, generator=g).to_mkldnn()}  # fmt: skip
    before = [{k: t.clone() if not t.is_mkldnn else t for k, t in part.items()} for part in [*layers, glob]]
    kept = {k: glob[k].data_ptr() for k in ("a", "b", "large", "view")}
    moved = gather_small([*layers, glob])
    assert moved == sum(t.nbytes for part in layers for t in part.values()) + tied.nbytes
    for part, old in zip([*layers, glob], before, strict=True):
        for k, t in part.items():
            assert t.dtype == old[k].dtype and t.shape == old[k].shape
            if not t.is_mkldnn:
                assert torch.equal(t, old[k]), k
    block = layers[0]["norm"].untyped_storage().data_ptr()
    ptrs = [t.data_ptr() for part in layers for t in part.values()] + [glob["emb"].data_ptr()]
    assert all(t.untyped_storage().data_ptr() == block for part in layers for t in part.values())
    assert ptrs == sorted(ptrs) and all(p % 64 == 0 for p in ptrs)
    assert glob["emb"] is glob["head"] and glob["emb"].untyped_storage().data_ptr() == block
    assert {k: glob[k].data_ptr() for k in kept} == kept and glob["blocked"].is_mkldnn
    few = {"w": torch.randint(-128, 127, (100, 580), dtype=torch.int8)}  # 58 KB in all: no huge page to gain
    ptr = few["w"].data_ptr()
    assert gather_small([few]) == 0 and few["w"].data_ptr() == ptr


def test_hf_layout_is_fla(tiny_hf):
    cfg = json.loads((tiny_hf / "config.json").read_text())
    assert cfg["model_type"] == "rwkv7"
    assert cfg["num_hidden_layers"] == 2 and cfg["hidden_size"] == 64 and cfg["head_dim"] == 16
    from safetensors import safe_open

    with safe_open(tiny_hf / "model.safetensors", "pt") as f:
        names = set(f.keys())
        assert f.get_slice("model.layers.1.attn.w_lora.lora.0.weight").get_shape() == [8, 64]
    assert "model.layers.0.pre_norm.weight" in names and "lm_head.weight" in names
    assert "model.layers.1.attn.v_lora.lora.2.bias" in names and "model.layers.0.attn.g_norm.weight" in names


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_convert_round_trip_pth_hf_pth(tmp_path, dtype):
    src = tmp_path / "m.pth"
    save_random_rwkv7(src, RWKV7Shape(3, 64, 16, 128), seed=2, dtype=dtype)
    assert convert(src, tmp_path / "hf") == "hf"
    assert convert(tmp_path / "hf", tmp_path / "back.pth") == "pth"
    assert_bit_identical(read_checkpoint(src)[0], read_checkpoint(tmp_path / "back.pth")[0])


def test_convert_round_trip_hf_pth_hf(tmp_path, tiny_hf):
    convert(tiny_hf, tmp_path / "m.pth")
    convert(tmp_path / "m.pth", tmp_path / "hf2")
    assert_bit_identical(read_checkpoint(tiny_hf)[0], read_checkpoint(tmp_path / "hf2")[0])
    a = (tiny_hf / "model.safetensors").read_bytes()
    assert a == (tmp_path / "hf2" / "model.safetensors").read_bytes()


def test_fingerprint_sees_weight_bytes(tmp_path):
    raw = save_random_rwkv7(tmp_path / "a.pth", RWKV7Shape(), seed=1)
    raw["blocks.1.ffn.value.weight"][0, 0] = torch.nextafter(raw["blocks.1.ffn.value.weight"][0, 0], torch.tensor(9.0))
    torch.save(raw, tmp_path / "b.pth")
    assert load_model(tmp_path / "a.pth").fingerprint != load_model(tmp_path / "b.pth").fingerprint


def test_dimensions_read_from_tensors(tmp_path):
    shape = RWKV7Shape(5, 80, 20, 77, 123, 6, 10, 3, 14)
    save_random_rwkv7(tmp_path / "odd.pth", shape)
    cfg = load_model(tmp_path / "odd.pth").config
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.head_size, cfg.vocab_size, cfg.ffn_size) == (5, 80, 4, 20, 77, 123)
    assert (cfg.decay_rank, cfg.a_rank, cfg.v_rank, cfg.gate_rank) == (6, 10, 3, 14)


def test_unreadable_inputs_are_refused_with_reason(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nothing-here")
    (tmp_path / "w.bin").write_bytes(b"\0" * 64)
    with pytest.raises(CheckpointError, match="not a checkpoint wkvm reads .*rwkv7: RWKV-7 as a BlinkDL .pth"):
        load_model(tmp_path / "w.bin")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text('{"model_type": "bert"}')
    with pytest.raises(CheckpointError, match="model_type 'bert' is not a family wkvm runs .*'rwkv7'"):
        load_model(tmp_path / "d")
    torch.save({"foo": torch.zeros(2)}, tmp_path / "x.pth")
    with pytest.raises(CheckpointError, match="emb.weight"):
        load_model(tmp_path / "x.pth")
    raw = save_random_rwkv7(tmp_path / "y.pth", RWKV7Shape())
    del raw["blocks.1.att.k_k"]
    torch.save(raw, tmp_path / "y.pth")
    with pytest.raises(CheckpointError, match="blocks.1.att.k_k"):
        load_model(tmp_path / "y.pth")
    raw["blocks.1.att.k_k"] = 5  # not a tensor: it had been an AttributeError traceback
    torch.save(raw, tmp_path / "y.pth")
    with pytest.raises(CheckpointError, match=r"'blocks.1.att.k_k' is not a tensor \(int\)"):
        load_model(tmp_path / "y.pth")


def test_tensors_that_do_not_fit_or_hold_nan_are_refused_at_load(tmp_path, tiny_pth):
    """A matrix a few columns short loaded silently and failed every request (Mamba2, Bamba) or gave a traceback while
    the layers were prepared (Qwen3.5); NaN weights loaded and answered every request with an error. Each is now one
    CheckpointError at load naming the file (hunt 14)."""
    from families.mamba2 import write_checkpoint
    from safetensors.torch import load_file, save_file

    good = write_checkpoint(tmp_path / "m", vocab_size=64)
    weights = good / "model.safetensors"
    raw = load_file(weights)
    in_proj = "backbone.layers.0.mixer.in_proj.weight"  # its columns: the width (what a cut one leaves short)
    for edit, says in [(lambda t: t[:, :-3].contiguous(), rf"{in_proj} has shape \[328, 61\], expected \[328, 64\]"),
                       (lambda t: t.index_fill(1, torch.tensor([0]), float("nan")), "NaN or infinite")]:
        save_file({**raw, in_proj: edit(raw[in_proj])}, weights, metadata={"format": "pt"})
        with pytest.raises(CheckpointError, match=says) as e:
            load_model(good)
        assert str(good) in str(e.value)
    save_file(raw, weights, metadata={"format": "pt"})
    load_model(good)  # as written: loads
    ckpt = torch.load(tiny_pth)
    ckpt["blocks.0.ffn.value.weight"][0, 0] = float("inf")
    torch.save(ckpt, tmp_path / "inf.pth")
    with pytest.raises(CheckpointError, match="'blocks.0.ffn.value.weight' holds NaN or infinite values"):
        load_model(tmp_path / "inf.pth")


def test_an_rwkv7_tensor_that_differs_from_the_config_is_refused_naming_it(tmp_path, tiny_pth):
    """RWKV-7 read its sizes from layer 0 and checked no other tensor: a later layer's r_k of [8, 8] (layer 0's
    [4, 16]) was reshaped silently into another model, and a LoRA a rank wider or a norm a value longer failed in
    torch naming no tensor. Each is now refused at load naming the tensor and both shapes; a vector's leading 1s are
    the file's own (BlinkDL's [1, 1, C] and a flat [C] both load)."""
    ckpt = torch.load(tiny_pth)
    heads, size = ckpt["blocks.0.att.r_k"].shape
    width, rank, vocab = heads * size, ckpt["blocks.0.att.w1"].shape[1], ckpt["emb.weight"].shape[0]
    edits = {
        "blocks.1.att.r_k": (lambda t: t.reshape(heads // 2, size * 2), [heads // 2, size * 2], [heads, size]),
        "blocks.1.att.w1": (lambda t: torch.cat([t, t[:, :1]], 1), [width, rank + 1], [width, rank]),
        "blocks.1.att.ln_x.weight": (lambda t: torch.cat([t, t[:1]]), [width + 1], [width]),
        "head.weight": (lambda t: t[:-1], [vocab - 1, width], [vocab, width]),
    }
    for name, (edit, got, want) in edits.items():
        torch.save({**ckpt, name: edit(ckpt[name])}, tmp_path / "bad.pth")
        with pytest.raises(CheckpointError, match=re.escape(f"tensor {name} has shape {got}, expected {want}")):
            load_model(tmp_path / "bad.pth")
    torch.save({**ckpt, "blocks.0.att.x_r": ckpt["blocks.0.att.x_r"].reshape(-1)}, tmp_path / "flat.pth")
    load_model(tmp_path / "flat.pth")


def test_a_qwen3_5_tensor_that_differs_from_the_config_is_refused_naming_it(tmp_path):
    """Qwen3.5 read its sizes from its first layers and checked only the projections' heads: a later layer's tensor
    a row or a value off failed in torch ("split_with_sizes expects split_sizes to sum exactly to 201"), naming the
    file but no tensor. Now each tensor is checked against the config at load."""
    from families.qwen3_5_hybrid import write_checkpoint
    from safetensors.torch import load_file, save_file

    good = write_checkpoint(tmp_path / "q", vocab_size=64)
    weights = good / "model.safetensors"
    raw = load_file(weights)
    for name, edit, got, want in [
        ("model.layers.1.linear_attn.norm.weight", lambda t: torch.cat([t, t[:1]]), [17], [16]),
        ("model.layers.2.linear_attn.in_proj_b.weight", lambda t: torch.cat([t, t[:1]]), [5, 64], [4, 64]),
        ("model.layers.3.self_attn.q_norm.weight", lambda t: t[:-2], [14], [16]),
        ("model.layers.1.mlp.down_proj.weight", lambda t: t[:, :-1], [64, 95], [64, 96]),
    ]:  # fmt: skip
        save_file({**raw, name: edit(raw[name]).contiguous()}, weights, metadata={"format": "pt"})
        with pytest.raises(CheckpointError, match=re.escape(f"tensor {name} has shape {got}, expected {want}")):
            load_model(good)


def test_a_nan_that_the_first_pass_would_not_show_is_refused_in_files_and_packs(tmp_path, tiny_pth):
    """Crash-safety hunt (session 47): a NaN in one channel of a norm's weight loaded, and the first pass's logits came
    out finite (kernels' max / ReLU drop NaN), so the model answered finite, wrong text, from a checkpoint or a pack."""
    import json

    from wkvm import cli

    ckpt = torch.load(tiny_pth)
    ckpt["blocks.0.ln2.weight"][5] = float("nan")
    torch.save(ckpt, tmp_path / "nan.pth")
    with pytest.raises(CheckpointError, match="'blocks.0.ln2.weight' holds NaN"):
        load_model(tmp_path / "nan.pth")
    pack = tmp_path / "pack"
    assert cli.main(["convert", str(tiny_pth), str(pack), "--pack"]) == 0
    entry = json.loads((pack / "manifest.json").read_text())["layers"][1]
    (name, t), = [(n, t) for n, t in entry["tensors"].items() if n.endswith("ln2.weight")]
    with open(pack / "layer_001.safetensors", "r+b") as f:  # one float32 NaN in place: sizes and header unchanged
        f.seek(t["offset"] + 4 * 5)
        f.write(torch.tensor([float("nan")]).numpy().tobytes())
    for cache in (0, 1):  # resident, and streamed (its pinned layers and the compute copy read the files whole)
        with pytest.raises(CheckpointError, match=f"layer_001.safetensors: tensor '{name}' holds NaN"):
            load_model(pack, weight_cache_layers=cache)


def test_generate_says_when_the_generation_failed_and_exits_1(monkeypatch, capsys, tiny_pth):
    """`wkvm generate` printed an empty line and exited 0 when the engine failed the request (hunt 14)."""
    from wkvm import cli, cli_chat, llm
    from wkvm.outputs import GenerationOutput

    failed = GenerationOutput(prompt_token_ids=[1, 2], finish_reason="error", error="non-finite logits",
                              error_code="non_finite")  # fmt: skip
    monkeypatch.setattr(llm.LLM, "generate", lambda self, prompts, params: [failed])
    assert cli.main(["generate", "--model", str(tiny_pth), "--prompt-ids", "1,2", "--json"]) == 1
    assert "the generation failed: non-finite logits" in capsys.readouterr().err

    def fails(engine, h):  # the text path streams the request itself
        h.output.finish_reason, h.output.error = "error", "non-finite logits"
        return False

    monkeypatch.setattr(cli_chat, "stream_to_stdout", fails)
    assert cli.main(["generate", "--model", str(tiny_pth), "--prompt-ids", "1,2"]) == 1
    assert "the generation failed: non-finite logits" in capsys.readouterr().err


def test_fingerprint_covers_layer0_value_weights(tmp_path):
    raw = save_random_rwkv7(tmp_path / "a.pth", RWKV7Shape(), seed=1)
    raw["blocks.0.att.value.weight"][0, 0] += 1.0
    torch.save(raw, tmp_path / "b.pth")
    assert load_model(tmp_path / "a.pth").fingerprint != load_model(tmp_path / "b.pth").fingerprint


def edited_copy(src: Path, dst: Path, config: dict, **changes) -> Path:
    """A copy of checkpoint directory `src` at `dst` whose config.json is `config` with `changes` (None: left out)."""
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    edited = {k: v for k, v in {**config, **changes}.items() if v is not None}
    (dst / "config.json").write_text(json.dumps(edited))
    return dst


@pytest.mark.parametrize("family", ["mamba2", "bamba", "qwen3_5_hybrid", "lfm2", "granite_hybrid", "nemotron_h"])
def test_hf_configs_are_read_as_transformers_reads_them(family, tmp_path):
    """Found by review (each had loaded and computed another model): under tie_word_embeddings a stored head unlike
    the embedding is used (transformers 5; it was dropped); a num_hidden_layers the weights do not have, an activation
    other than SiLU, a bias flag the tensors contradict and Bamba's legacy `rope_scaling` are refused."""
    import importlib

    writer = importlib.import_module(f"families.{family}")
    src = writer.write_checkpoint(tmp_path / "src", 50, seed=2)
    config = json.loads((src / "config.json").read_text())
    assert not config.get("tie_word_embeddings")
    ids = list(range(1, 20))
    want = load_model(src).prefill(ids, all_logits=True)[0]

    def edited(name, **changes):
        return edited_copy(src, tmp_path / name, config, **changes)

    assert torch.equal(load_model(edited("tied", tie_word_embeddings=True)).prefill(ids, all_logits=True)[0], want)
    layers = config.get("num_hidden_layers") or len(config["layers_block_type"])  # Nemotron-H counts them so
    refused = {"layers": ({"num_hidden_layers": layers - 1}, f"says {layers - 1} layers; the weights hold {layers}"),
               "gelu": ({"hidden_act": "gelu"}, "gelu")}  # fmt: skip
    if family == "lfm2":  # its MLP is SiLU whatever the config says (transformers reads no hidden_act for it)
        refused = {"layers": refused["layers"], "bias": ({"conv_bias": True}, "conv_bias"),
                   "heads": ({"num_key_value_heads": 3}, "4 heads over 3 key/value heads"),
                   "head count": ({"num_attention_heads": 4.5}, "num_attention_heads 4.5 is not a positive integer")}
    if family == "mamba2":
        refused["bias"] = ({"use_conv_bias": False}, "use_conv_bias False but the checkpoint holds")
    if family == "bamba":
        refused["rope"] = ({"rope_scaling": {"type": "linear", "factor": 4.0}}, "RoPE type 'linear'")
    if family == "nemotron_h":  # its MLP's activation is mlp_hidden_act (transformers reads no hidden_act for it)
        refused["gelu"] = ({"mlp_hidden_act": "gelu"}, "gelu")
    if family == "granite_hybrid":
        refused["bias"] = ({"mamba_conv_bias": False}, "mamba_conv_bias False but the checkpoint holds")
    for name, (changes, says) in refused.items():
        with pytest.raises(CheckpointError, match=says):
            load_model(edited(name, **changes))


def test_an_hf_rwkv7_whose_epsilons_a_pth_cannot_carry_is_not_converted_to_one(tiny_hf, tmp_path):
    """BlinkDL's .pth has no config: its readers fix norm eps 1e-5 and group-norm eps 64e-5. An HF directory with
    others had converted to a .pth of another model (logits off by 0.06 for fla's head-16 group-norm eps; review)."""
    hf = tmp_path / "hf"
    hf.mkdir()
    for f in tiny_hf.iterdir():
        (hf / f.name).write_bytes(f.read_bytes())
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "norm_eps": 1e-3}))
    with pytest.raises(CheckpointError, match="cannot be carried by a .pth"):
        convert(hf, tmp_path / "out.pth")
    assert not (tmp_path / "out.pth").exists()
    (hf / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 5}))  # fla would build 5 layers
    with pytest.raises(CheckpointError, match="says 5 layers"):
        load_model(hf)


def test_quantized_or_mismatched_checkpoints_are_refused_at_load(tmp_path):
    """Review (session 38): an FP8 / int8 checkpoint (quantization_config, integer weights and their scales) loaded
    with its values cast to floats and answered nonsense; a head of other rows than the embedding ran (or failed the
    first step past them); a config field of the wrong type or value was a TypeError / ZeroDivisionError traceback.
    Each is one CheckpointError naming the file now."""
    from families.llama import write_checkpoint
    from safetensors.torch import load_file, save_file

    base = write_checkpoint(tmp_path / "base", 64, tie_word_embeddings=False)
    load_model(base)  # loads as written

    def variant(name, config=None, tensors=None):
        d = tmp_path / name
        d.mkdir()
        cfg = json.loads((base / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, **(config or {})}))
        raw = load_file(base / "model.safetensors")
        save_file({**raw, **(tensors(raw) if tensors else {})}, d / "model.safetensors")
        return d

    cases = {
        "quantized checkpoint": variant("fp8", {"quantization_config": {"quant_method": "fp8"}}),
        "is int8, not floating point": variant("int8", tensors=lambda raw: {
            "model.layers.0.mlp.up_proj.weight": raw["model.layers.0.mlp.up_proj.weight"].to(torch.int8)}),
        r"lm_head.weight has shape \[50, 48\], expected \[64, 48\]": variant("head", tensors=lambda raw: {
            "lm_head.weight": raw["lm_head.weight"][:50].contiguous()}),
        "config does not read": variant("heads", {"num_attention_heads": None}),
    }  # fmt: skip
    for says, path in cases.items():
        with pytest.raises(CheckpointError, match=says):
            load_model(path)


def test_a_legacy_pth_loads_as_the_zip_one(tiny_pth, tmp_path):
    """A .pth written by torch.save's old (non-zip) format cannot be memory-mapped: it had been refused with torch's
    message about mmap (review, session 38); it is read whole now, still tensors only (weights_only)."""
    legacy = tmp_path / "legacy.pth"
    torch.save(torch.load(tiny_pth, weights_only=True), legacy, _use_new_zipfile_serialization=False)
    ids = [1, 2, 3]
    assert torch.equal(load_model(legacy).prefill(ids)[0], load_model(tiny_pth).prefill(ids)[0])


class Payload:
    """A pickle that would run a command when unpickled (it never is: wkvm loads tensors only)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def test_a_pth_with_code_is_refused_without_running_it_or_advising_the_unsafe_load(tiny_pth, tmp_path):
    """Crash-safety hunt (session 47): the refusal repeated torch's advice to load with weights_only=False (its
    reason sits in a later paragraph in this torch, not after "WeightsUnpickler error:")."""
    marker = tmp_path / "ran"
    for legacy in (False, True):
        evil = tmp_path / f"evil{legacy}.pth"
        torch.save({**torch.load(tiny_pth, weights_only=True), "x": Payload(marker)}, evil,
                   _use_new_zipfile_serialization=not legacy)  # fmt: skip
        with pytest.raises(CheckpointError, match="not a file of tensors alone") as e:
            load_model(evil)
        assert "weights_only" not in str(e.value) and "system" in str(e.value), str(e.value)
    assert not marker.exists()


def test_a_pth_whose_records_or_views_do_not_hold_its_tensors_is_refused(tiny_pth, tmp_path):
    """Loading hunt (session 49): mapped, a storage record cut short had loaded the next zip header's bytes as weights,
    a re-zipped (deflated) archive its compressed bytes as floats (then blamed as NaN), and a stride-0 view of a small
    storage had been copied to GiBs. Each is refused by name before anything large is made."""
    import zipfile

    src = zipfile.ZipFile(tiny_pth)
    names = src.namelist()
    emb = next(n for n in names if n.endswith("/data/0"))  # emb.weight's storage: the first one saved

    def rezipped(name, method=zipfile.ZIP_STORED, cut=0):
        with zipfile.ZipFile(tmp_path / name, "w", method) as z:
            for n in names:
                data = src.read(n)
                z.writestr(n, data[: len(data) - cut] if n == emb else data)
        return tmp_path / name

    load_model(rezipped("same.pth"))  # re-zipped as torch stores it: loads
    with pytest.raises(CheckpointError, match=r"short.pth: tensor emb.weight's storage data/0 holds 65528 bytes of its "
                                              r"65536 \(a record cut short\)"):  # fmt: skip
        load_model(rezipped("short.pth", cut=8))
    with pytest.raises(CheckpointError, match="deflated.pth: tensor emb.weight's storage data/0 is compressed"):
        load_model(rezipped("deflated.pth", zipfile.ZIP_DEFLATED))
    sd = torch.load(tiny_pth, weights_only=True)
    sd["emb.weight"] = sd["emb.weight"][:1].expand(4096, sd["emb.weight"].shape[1])  # 1 MiB of a 64 KiB storage
    torch.save(sd, tmp_path / "expanded.pth")
    with pytest.raises(CheckpointError, match=r"expanded.pth: tensor emb.weight of shape \[4096, 64\] needs 1048576 "
                                              "bytes, its storage holds 65536"):  # fmt: skip
        load_model(tmp_path / "expanded.pth")
    sd["emb.weight"] = torch.load(tiny_pth, weights_only=True)["emb.weight"].t().contiguous().t()  # a view in bounds
    torch.save(sd, tmp_path / "transposed.pth")
    load_model(tmp_path / "transposed.pth")
    # saved without CRCs (torch.serialization.set_crc32_options(False)): read unmapped, as torch reads it (zipfile's
    # CRC check had refused it; review, session 49)
    torch.serialization.set_crc32_options(False)
    try:
        torch.save(torch.load(tiny_pth, weights_only=True), tmp_path / "nocrc.pth")
    finally:
        torch.serialization.set_crc32_options(True)
    ids = [1, 2, 3]
    assert torch.equal(load_model(tmp_path / "nocrc.pth").prefill(ids)[0], load_model(tiny_pth).prefill(ids)[0])


def test_config_values_of_the_wrong_type_are_one_named_error(tiny_hf, tmp_path, monkeypatch):
    """Loading hunt (session 49): a config value a family's reading trips over had escaped as a traceback or a line
    naming no file; each is now a CheckpointError naming the model (by key where a check is cheap)."""
    from wkvm.models.rwkv7 import FAMILY

    config = json.loads((tiny_hf / "config.json").read_text())

    def edited(name, **changes):
        return edited_copy(tiny_hf, tmp_path / name, config, **changes)

    for value in ([2], "six", True):
        with pytest.raises(CheckpointError, match=re.escape(f"num_hidden_layers {value!r} is not a layer count")) as e:
            load_model(edited(f"layers{value}", num_hidden_layers=value))
        assert str(tmp_path) in str(e.value)
    for value in (0, -1e-5, "x"):
        with pytest.raises(CheckpointError, match=rf"norm_eps {value!r} is not a number > 0"):
            load_model(edited(f"eps{value}", norm_eps=value))
    # whatever else a family's reading trips over: one CheckpointError naming the model, its own kept as it is
    path = edited("any")
    for error in (TypeError("unsupported operand"), ZeroDivisionError("division by zero"), AttributeError("no x")):
        def reading(path, fmt, error=error):
            raise error
        monkeypatch.setattr(FAMILY, "read_checkpoint", reading)
        want = f"{path}: its config or tensors do not read as a rwkv7 model's ({type(error).__name__}: {error})"
        with pytest.raises(CheckpointError, match=re.escape(want)):
            load_model(path)

    def refusing(path, fmt):
        raise CheckpointError("head_dim 1 is odd")  # names no file: the loader puts the model's path in front
    monkeypatch.setattr(FAMILY, "read_checkpoint", refusing)
    with pytest.raises(CheckpointError, match=f"^{re.escape(str(path))}: head_dim 1 is odd$"):
        load_model(path)


@pytest.mark.parametrize("family", ["mamba2", "bamba"])
def test_an_ssm_group_count_the_weights_do_not_have_is_refused(family, tmp_path):
    """Loading hunt (session 49): d_state had been derived from the conv's channels with config.json's n_groups and
    never checked against its state_size, so a wrong n_groups ran another model silently (logits off by 1.4); 1.5 and
    true were taken. transformers refuses such a directory (size mismatch)."""
    import importlib

    writer = importlib.import_module(f"families.{family}")
    src = writer.write_checkpoint(tmp_path / "src", 50, seed=2)
    config = json.loads((src / "config.json").read_text())
    groups, size = ("n_groups", "state_size") if family == "mamba2" else ("mamba_n_groups", "mamba_d_state")
    assert (config[groups], config[size]) == (2, 16)
    want = load_model(src).prefill([1, 2, 3])[0]

    def edited(name, **changes):
        return edited_copy(src, tmp_path / name, config, **changes)

    says = f"{size} 16 with {groups} 1 does not fit conv1d's 192 channels (128 + 2 x groups x state size gives 32)"
    with pytest.raises(CheckpointError, match=re.escape(says)) as e:
        load_model(edited("one", **{groups: 1}))
    assert str(tmp_path / "one") in str(e.value)
    for value in (1.5, True, 0, "2"):
        with pytest.raises(CheckpointError, match=f"{groups} {value!r} is not a positive integer"):
            load_model(edited(f"g{value}", **{groups: value}))
    with pytest.raises(CheckpointError, match=f"{size} 'six' is not a positive integer"):
        load_model(edited("six", **{size: "six"}))
    # without a state size the weights' is used, as before
    assert torch.equal(load_model(edited("derived", **{size: None})).prefill([1, 2, 3])[0], want)
