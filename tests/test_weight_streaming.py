"""Weight streaming: output identical to resident for several cache sizes, read-ahead or not, B=1 and B=8;
the cache never exceeds its bound; bad packs are refused."""

import json

import pytest
import torch

from wkvm import LLM, SamplingParams
from wkvm.cli import main
from wkvm.models.linear import onednn_available
from wkvm.models.rwkv7.random_weights import RWKV7Shape, save_random_rwkv7
from wkvm.server.metrics import STREAM_COUNTERS
from wkvm.weights.loader import load_model
from wkvm.weights.pack import Pack, PackError, write_pack

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8], [1, 6, 1, 8, 0, 3, 3, 9, 8, 8], [5, 7], [9, 9, 9], [4], [8, 6],
           [1, 1, 2, 3, 5, 8, 13]]  # fmt: skip


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    d = tmp_path_factory.mktemp("pack")
    save_random_rwkv7(d / "m.pth", RWKV7Shape(6, 64, 16, 256, None, 8, 8, 4, 8), seed=4, dtype=torch.bfloat16)
    assert main(["convert", str(d / "m.pth"), str(d / "pack"), "--pack"]) == 0
    return d


LONG = [(7 * i) % 250 + 1 for i in range(100)]  # a prefill of 100 tokens: chunked WKV and large-batch matmuls


def run(llm, batch):
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=3)
    return llm.generate(PROMPTS[:batch], params)


def assert_same(outs, want):
    for got, ref in zip(outs, want, strict=True):
        assert got.token_ids == ref.token_ids
        for a, b in zip(got.logprobs, ref.logprobs, strict=True):
            assert a == b  # the same bits: streamed layers run on the kernels resident ones do


def watch_bound(w) -> list[int]:
    """Record how many layers are held after every layer() call."""
    held, layer = [], w.layer

    def counted(i):
        out = layer(i)
        held.append(len(w.cached_layers))
        return out

    w.layer = counted
    return held


@pytest.fixture(scope="module")
def resident(pack):
    return {b: run(LLM(model=pack / "m.pth"), b) for b in (1, 8)}


@pytest.mark.parametrize("cache", [1, 2, 5, 6])
@pytest.mark.parametrize("read_ahead", [True, False])
@pytest.mark.parametrize("batch", [1, 8])
def test_streamed_equals_resident(pack, resident, cache, read_ahead, batch):
    llm = LLM(model=pack / "pack", weight_cache_layers=cache, read_ahead=read_ahead)
    w = llm.model.weights
    held = watch_bound(w)
    assert_same(run(llm, batch), resident[batch])
    assert w.blocked == (cache < 6 and onednn_available())  # with oneDNN, streamed layers come from the blocked copy
    assert max(held) <= cache
    assert w.stats.layer_calls == 6 * llm.engine.steps  # one sweep per step, prefills of any length included
    assert w.stats.bytes_read > 0
    assert w.read_ahead == (read_ahead and cache < 6)
    if w.read_ahead:
        assert w.stats.readahead_hits > 0
    w.close()


def test_layers_not_in_the_os_cache_are_read_from_disk(pack, resident, monkeypatch):
    from wkvm.weights.stream import _LayerFile

    monkeypatch.setattr(_LayerFile, "in_ram", lambda self: False)
    llm = LLM(model=pack / "pack", weight_cache_layers=2)
    assert_same(run(llm, 8), resident[8])
    w = llm.model.weights
    assert w.stats.disk_reads == w.stats.cache_misses > 0
    assert w.stats.readahead_requests > 0  # nothing looked cached, so read-ahead asked the OS each time
    w.close()


def test_long_prefill_streamed_equals_resident(pack):
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=3)
    want = LLM(model=pack / "m.pth").generate([LONG], params)
    llm = LLM(model=pack / "pack", weight_cache_layers=2)
    assert_same(llm.generate([LONG], params), want)
    llm.model.weights.close()


def test_plain_layout_when_no_blocked_copy(pack, resident, monkeypatch, caplog):
    """Without oneDNN, or when the blocked copy cannot be written, layers stream from the pack's plain files."""
    import wkvm.weights.blocked as blocked

    def out_of_space(p, d, *args):
        d.mkdir()
        (d / "layer_000.safetensors").write_bytes(b"half a copy")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(blocked, "_build", out_of_space)
    monkeypatch.setattr(blocked, "layout_key", lambda pack, dtype: "not-built-yet")
    llm = LLM(model=pack / "pack", weight_cache_layers=3)
    assert not llm.model.weights.blocked
    assert "cannot write the blocked copy" in caplog.text
    assert not (pack / "pack" / "onednn-not-built-yet").exists()  # no half-built copy left behind
    assert_same(run(llm, 8), resident[8])
    llm.model.weights.close()


NO_ONEDNN = "no oneDNN (WKVM_ONEDNN=0?), so no blocked copy; plain streaming: test_plain_layout_when_no_blocked_copy"


@pytest.mark.skipif(not onednn_available(), reason=NO_ONEDNN)
def test_blocked_copy_is_reused_and_rebuilt_when_stale(pack, resident, tmp_path):
    import shutil

    from wkvm.weights.stream import StreamingWeights

    d = tmp_path / "pack"
    shutil.copytree(pack / "pack", d, ignore=shutil.ignore_patterns("onednn-*"))
    StreamingWeights(Pack(d), 2).close()
    (copy,) = d.glob("onednn-*")
    layer = copy / "layer_004.safetensors"
    first = layer.stat().st_mtime_ns
    StreamingWeights(Pack(d), 2).close()
    assert layer.stat().st_mtime_ns == first  # valid: reused as is
    layer.write_bytes(layer.read_bytes()[:-64])  # damaged: rebuilt
    llm = LLM(model=d, weight_cache_layers=2)
    assert_same(run(llm, 8), resident[8])
    llm.model.weights.close()
    assert layer.stat().st_mtime_ns != first
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["source"][5] = "0" * 64  # the pack's layer 4 changed since the copy was made: rebuilt
    (copy / "manifest.json").write_text(json.dumps(manifest))
    StreamingWeights(Pack(d), 2).close()
    assert json.loads((copy / "manifest.json").read_text())["source"][1:] == [
        e["sha256"] for e in Pack(d).manifest["layers"]
    ]  # after the hash of the pack's family and config


def test_pack_resident_load_keeps_fingerprint(pack):
    a, b = load_model(pack / "m.pth"), load_model(pack / "pack")
    assert a.fingerprint == b.fingerprint
    assert torch.equal(a.prefill([1, 2, 3])[0], b.prefill([1, 2, 3])[0])


def test_loaded_weights_do_not_keep_file_buffers_alive(pack):
    """Each layer file is read in one go; kept tensors must not be views that pin the whole buffer (1.7x RSS)."""
    for kw in ({}, {"weight_cache_layers": 3}):
        w = load_model(pack / "pack", **kw).weights
        kept = [t for t in [*w.globals().values(), *w.layer(0).values()] if not t.is_mkldnn]
        assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in kept), kw


def test_bad_packs_are_refused(pack, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(pack / "pack", bad)
    layer = bad / "layer_003.safetensors"
    layer.write_bytes(layer.read_bytes()[:-100])
    with pytest.raises(PackError, match="truncated"):
        load_model(bad, weight_cache_layers=2)
    shutil.rmtree(bad)
    shutil.copytree(pack / "pack", bad)  # the header's length edited, the file's size kept (a MemoryError before)
    data = bytearray(layer.read_bytes())
    data[:8] = (1 << 62).to_bytes(8, "little")
    layer.write_bytes(bytes(data))
    with pytest.raises(PackError, match="a header of"):
        load_model(bad, weight_cache_layers=2)
    shutil.rmtree(bad)
    shutil.copytree(pack / "pack", bad)
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest["layers"][2]["tensors"]["att.k_k"]["shape"] = [1, 1, 65]
    (bad / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(PackError, match="does not match the manifest"):
        load_model(bad, weight_cache_layers=2)
    (bad / "layer_005.safetensors").unlink()
    with pytest.raises(PackError):
        load_model(bad)
    with pytest.raises(ValueError, match="needs a weight pack"):
        load_model(pack / "m.pth", weight_cache_layers=2)
    write_pack(pack / "m.pth", tmp_path / "again")
    assert (tmp_path / "again" / "manifest.json").exists()


def test_streaming_counters_in_metrics(pack):
    import httpx
    from live_server import LiveServer
    from prometheus_client.parser import text_string_to_metric_families

    with LiveServer(model=str(pack / "pack"), weight_cache_layers=2) as s:
        r = httpx.post(f"{s.url}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        text = httpx.get(f"{s.url}/metrics").text
        w, steps = s.ctx.client.engine.model.weights, s.ctx.client.engine.steps
    got = {m.name: m.samples[0].value for m in text_string_to_metric_families(text) if m.name.startswith("wkvm_weight")}
    assert got == {f"wkvm_weight_{k}": getattr(w.stats, k) for k in STREAM_COUNTERS}  # scraped = the provider's
    hits, misses = got["wkvm_weight_cache_hits"], got["wkvm_weight_cache_misses"]
    # 6 layers, a cache of 2: layer 0 stays and hits every sweep; layers 1..5 take the one buffer in turn and miss
    assert steps > 0 and hits + misses == w.stats.layer_calls == 6 * steps
    assert hits == steps and misses == 5 * steps
    # each miss was looked at ahead: layer 0 (pinned) asks for layer 1, layer i for layer i + 1
    assert got["wkvm_weight_readahead_hits"] == misses and got["wkvm_weight_readahead_misses"] == 0
    assert got["wkvm_weight_disk_reads"] <= misses and got["wkvm_weight_readahead_requests"] <= misses
    streamed = {i: f.nbytes for i, f in w._files.items()}
    assert set(streamed) == {1, 2, 3, 4, 5}
    # layer 0 read once at load, and every streamed layer once per sweep
    assert got["wkvm_weight_bytes_read"] == Pack(pack / "pack").layer_bytes(0) + steps * sum(streamed.values())


def test_a_pack_file_truncated_while_streaming_is_an_error_not_a_crash(pack, tmp_path):
    import shutil

    from wkvm.weights.stream import StreamingWeights

    d = tmp_path / "pack"
    shutil.copytree(pack / "pack", d)
    w = StreamingWeights(Pack(d), 2)
    w.layer(3)
    (layer,) = d.glob("onednn-*/layer_004.safetensors") if w.blocked else [d / "layer_004.safetensors"]
    with open(layer, "r+b") as f:
        f.truncate(100)
    with pytest.raises(PackError, match="changed size"):
        w.layer(4)
    w.close()


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_quantized_layers_stream_from_their_own_copy(pack, dtype):
    """`--dtype int8/int4` over a pack: the layers are quantized once into `<dtype>-v1/` beside it, a streamed layer
    reads a fraction of fp32's bytes and is not converted per read, the outputs equal resident weights', and the
    next server reuses the copy."""
    ids = torch.tensor(LONG[:40])
    want = load_model(pack / "m.pth", dtype=dtype).prefill(ids, all_logits=True)[0]
    streamed = load_model(pack / "pack", dtype=dtype, weight_cache_layers=2)
    w, copy = streamed.weights, pack / "pack" / f"{dtype}-v1"
    assert w.blocked and (copy / "manifest.json").is_file()
    before, misses = w.stats.bytes_read, w.stats.cache_misses
    assert torch.equal(streamed.prefill(ids, all_logits=True)[0], want)
    per_read = (w.stats.bytes_read - before) / (w.stats.cache_misses - misses)
    fp32 = Pack(pack / "pack").layer_bytes(3)
    # the matrices in 8 or 5 bits; this tiny shape's LoRA matrices and vectors, kept fp32, are a large share of it
    assert per_read < {"int8": 0.4, "int4": 0.3}[dtype] * fp32, per_read / fp32  # measured 0.32 and 0.23
    w.close()
    written = (copy / "manifest.json").stat().st_mtime_ns
    again = load_model(pack / "pack", dtype=dtype, weight_cache_layers=2)
    assert torch.equal(again.prefill(ids, all_logits=True)[0], want)
    assert (copy / "manifest.json").stat().st_mtime_ns == written
    again.weights.close()


def edited_pack(pack, tmp_path, name, edit):
    """A copy of the pack (with its blocked copies) whose manifest `edit` changed in place."""
    import shutil

    d = tmp_path / name
    shutil.copytree(pack / "pack", d)
    manifest = json.loads((d / "manifest.json").read_text())
    manifest = edit(manifest) or manifest
    (d / "manifest.json").write_text(json.dumps(manifest))
    return d


def test_hand_edited_pack_manifests_are_pack_errors(pack, tmp_path):
    """A manifest edited by hand is a PackError naming the pack: it was an AttributeError, KeyError or TypeError
    traceback, a torch shape error at the first read (a tensor's length), or silently another layer's weights (an
    entry naming another layer's file)."""

    def drop(key):
        return lambda m: m.pop(key) and None

    def set_layers(value):
        return lambda m: m.update(layers=value)

    def no_offset(m):
        del m["layers"][2]["tensors"]["att.k_k"]["offset"]

    def short(m):
        m["layers"][2]["tensors"]["att.k_k"]["length"] -= 4

    def swapped(m):
        m["layers"][1] = m["layers"][2]

    edits = {"list": lambda m: [m], "fingerprint": drop("fingerprint"), "layers": set_layers(None),
             "offset": no_offset, "length": short, "swapped": swapped}  # fmt: skip
    def no_layers(m):
        m["config"]["n_layer"], m["layers"] = 0, []

    def text_layers(m):
        m["config"]["n_layer"] = str(m["config"]["n_layer"])

    edits = {**edits, "no_layers": no_layers, "text_layers": text_layers}
    for name, edit in edits.items():
        d = edited_pack(pack, tmp_path, name, edit)
        for cache in (0, 2):
            with pytest.raises(PackError):
                load_model(d, weight_cache_layers=cache)


def test_a_pack_whose_data_cannot_hold_its_shapes_is_a_pack_error(pack, tmp_path):
    """A layer file cut short with its manifest's size edited to match, or header and manifest agreeing on data
    shorter than the shape: a PackError naming the file, resident or streamed (it had been a torch traceback,
    "shape '[32]' is invalid for input of size 31", at a resident load; hunt, session 49)."""

    def cut(m):
        m["layers"][1]["bytes"] -= 4

    d = edited_pack(pack, tmp_path, "cut", cut)
    layer = d / "layer_001.safetensors"
    layer.write_bytes(layer.read_bytes()[:-4])
    for cache in (0, 2):
        with pytest.raises(PackError, match="layer_001.safetensors: tensor .* does not hold its shape"):
            load_model(d, weight_cache_layers=cache)


def test_a_manifest_config_its_tensors_do_not_fit_is_a_checkpoint_error_when_streamed(pack, tmp_path):
    from wkvm.models.family import CheckpointError

    def wrong_heads(m):
        m["config"]["head_size"] = 8

    d = edited_pack(pack, tmp_path, "heads", wrong_heads)
    for cache in (0, 2):  # resident said so already; streamed raised torch's RuntimeError
        with pytest.raises(CheckpointError, match="do not fit its config"):
            load_model(d, weight_cache_layers=cache)

    def eps_text(m):  # a field of the wrong type: it had been torch's TypeError traceback (hunt, session 47)
        m["config"]["ln_eps"] = "x"

    d = edited_pack(pack, tmp_path, "eps", eps_text)
    for cache in (0, 2):
        with pytest.raises(CheckpointError, match="its config does not read as a rwkv7 model's"):
            load_model(d, weight_cache_layers=cache)


@pytest.mark.skipif(not onednn_available(), reason=NO_ONEDNN)
def test_a_blocked_copy_follows_the_packs_config_and_its_own_manifest(pack, tmp_path):
    """The copy is made from the layers and the config (`prepare_layer` reads both): a config edited with the layer
    files kept had the old copy served; a copy's manifest listing no layers or another layer's file for one is
    rebuilt (an IndexError, and layer 4's weights served as layer 3's, before)."""
    import shutil

    ids = torch.tensor(LONG[:20])
    d = tmp_path / "p"
    shutil.copytree(pack / "pack", d)
    load_model(d, weight_cache_layers=2).weights.close()  # its blocked copy, made under n_head 4
    want = load_model(d).prefill(ids)[0]
    for edit in ("no layers", "swapped"):
        (copy,) = d.glob("onednn-*")
        manifest = json.loads((copy / "manifest.json").read_text())
        if edit == "no layers":
            manifest["layers"] = []
        else:
            manifest["layers"][3] = manifest["layers"][4]
        (copy / "manifest.json").write_text(json.dumps(manifest))
        streamed = load_model(d, weight_cache_layers=1)
        assert streamed.weights.blocked and torch.equal(streamed.prefill(ids)[0], want), edit
        streamed.weights.close()
    manifest = json.loads((d / "manifest.json").read_text())
    manifest["config"]["n_head"], manifest["config"]["head_size"] = 8, 8
    (d / "manifest.json").write_text(json.dumps(manifest))
    want = load_model(d).prefill(ids)[0]
    streamed = load_model(d, weight_cache_layers=2)
    assert streamed.weights.blocked and torch.equal(streamed.prefill(ids)[0], want)
    streamed.weights.close()


class Killed(BaseException):
    """The process dying halfway through a build (no cleanup runs)."""


@pytest.mark.skipif(not onednn_available(), reason=NO_ONEDNN)
def test_a_blocked_copy_rebuild_cut_off_is_not_trusted_when_its_old_pack_comes_back(pack, tmp_path, monkeypatch):
    """Pack A streamed (copy of A), pack B written over it and its copy's rebuild cut off after 3 files, then A
    written back (a restore): the old manifest had stayed and matched A again, so layers 0-2 came from B's copy."""
    import wkvm.weights.blocked as blocked

    save_random_rwkv7(tmp_path / "b.pth", RWKV7Shape(6, 64, 16, 256, None, 8, 8, 4, 8), seed=5, dtype=torch.bfloat16)
    d = tmp_path / "p"
    write_pack(pack / "m.pth", d)
    load_model(d, weight_cache_layers=2).weights.close()
    write_pack(tmp_path / "b.pth", d)
    write_file, calls = blocked.write_file, []

    def cut_off(*args):
        calls.append(args)
        if len(calls) == 4:
            raise Killed
        return write_file(*args)

    monkeypatch.setattr(blocked, "write_file", cut_off)
    with pytest.raises(Killed):
        load_model(d, weight_cache_layers=2)
    monkeypatch.setattr(blocked, "write_file", write_file)
    write_pack(pack / "m.pth", d)
    ids = torch.tensor(LONG[:20])
    streamed = load_model(d, weight_cache_layers=2)
    assert torch.equal(streamed.prefill(ids)[0], load_model(d).prefill(ids)[0])
    streamed.weights.close()


def test_closed_streaming_weights_refuse_reads(pack):
    """After close() the files' descriptors may be another file's: a read is a PackError, not that file's bytes."""
    streamed = load_model(pack / "pack", weight_cache_layers=2)
    streamed.weights.close()
    with pytest.raises(PackError, match="closed"):
        streamed.weights.layer(4)
