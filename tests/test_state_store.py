"""Durable states: resume from every tier, fork isolation, export/import, mutations, LRU tiers, crash safety."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from wkvm.config import EngineConfig
from wkvm.engine.engine import Engine
from wkvm.models.rwkv7 import load_rwkv7
from wkvm.sampling_params import SamplingParams
from wkvm.state.mutations import register_mutation
from wkvm.state.service import StateService
from wkvm.state.statefile import StateFileError
from wkvm.state.store import StateNotFound, StateStore, StoreLimits
from wkvm.tokenizer import WorldTokenizer

PROMPT = [11, 22, 33, 44, 55, 66, 77, 88, 99, 111, 122, 133]
SUFFIX = [5, 6, 7]
LP_TOL = 1e-5


@pytest.fixture(scope="module")
def model(tiny_pth):
    return load_rwkv7(tiny_pth)


def make_service(model, root, limits=None):
    engine = Engine(model, WorldTokenizer(), EngineConfig(n_slots=4))
    store = StateStore(root, model.spec, model.fingerprint, model.vocab_size, limits=limits)
    return StateService(engine, store)


@pytest.fixture
def svc(model, tmp_path):
    return make_service(model, tmp_path / "states")


def params(n=12):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=2)


def fresh(svc, prompt, n=12):
    h = svc.engine.submit(prompt, params(n))
    svc.engine.run_until_done()
    return h.output


def assert_same(a, b):
    assert a.token_ids == b.token_ids
    for x, y in zip(a.logprobs, b.logprobs, strict=True):
        for tok in x.keys() & y.keys():
            assert abs(x[tok] - y[tok]) < LP_TOL


@pytest.mark.parametrize("tier", ["device", "host", "disk", "restart"])
def test_resume_from_each_tier_equals_uninterrupted(svc, model, tmp_path, tier):
    expected = fresh(svc, PROMPT + SUFFIX)
    rec = svc.create("a", "conv", PROMPT)
    assert rec.n_tokens == len(PROMPT) and rec.token_ids == PROMPT and rec.tier == "device"
    if tier in ("host", "disk"):
        assert svc.store.hibernate("a", "conv", tier).tier == tier
    if tier == "restart":
        svc = make_service(model, tmp_path / "states")
        assert svc.store.get("a", "conv").tier == "disk"
    h, _ = svc.generate("a", "conv", SUFFIX, params())
    assert_same(h.output, expected)
    assert svc.store.get("a", "conv").tier == "device"  # using a state moves it up


def test_save_as_then_continue(svc):
    first, saved = svc.generate("a", svc.create("a", "c", PROMPT).handle, SUFFIX, params(6), save_as="c")
    assert saved.handle == "c@2" and saved.parent == "c@1" and saved.op == "generate"
    assert saved.token_ids == PROMPT + SUFFIX + first.output.token_ids
    again, _ = svc.generate("a", "c", [9, 8], params())
    assert_same(again.output, fresh(svc, PROMPT + SUFFIX + first.output.token_ids + [9, 8]))
    rollback, _ = svc.generate("a", "c@1", SUFFIX, params(6))  # an earlier version is still there
    assert rollback.output.token_ids == first.output.token_ids


def test_snapshot_running_request(svc):
    expected = fresh(svc, PROMPT, n=20)
    h = svc.engine.submit(PROMPT, params(20))
    for _ in range(8):
        svc.engine.step()
    rec = svc.snapshot("a", h.request_id, "snap")
    svc.engine.run_until_done()
    assert_same(h.output, expected)  # the snapshot did not disturb the request
    done = rec.n_tokens - len(PROMPT)
    assert rec.token_ids == PROMPT + expected.token_ids[:done]
    cont, _ = svc.generate("a", "snap", [], params(20 - done))
    assert cont.output.token_ids == expected.token_ids[done:]


def test_fork_isolation(svc):
    base = svc.create("a", "root", PROMPT)
    before = {k: v.clone() for k, v in svc.store.load("a", "root")[1].items()}
    fork = svc.store.fork("a", "root", "branch")
    assert fork.parent == base.handle and fork.op == "fork" and fork.token_ids == base.token_ids
    a, a_saved = svc.generate("a", "root", [1, 2], params(), save_as="root")
    b, b_saved = svc.generate("a", "branch", [3, 4], params(), save_as="branch")
    assert a.output.token_ids == fresh(svc, PROMPT + [1, 2]).token_ids
    assert b.output.token_ids == fresh(svc, PROMPT + [3, 4]).token_ids
    after = svc.store.load("a", "root@1")[1]
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert a_saved.handle == "root@2" and b_saved.handle == "branch@2"


def test_tenants_and_handles(svc):
    svc.create("alice", "s", PROMPT)
    svc.create("alice", "s", PROMPT[:5])
    assert svc.store.get("alice", "s").version == 2 and svc.store.get("alice", "s@1").n_tokens == len(PROMPT)
    with pytest.raises(StateNotFound):
        svc.store.get("bob", "s")
    assert [r.handle for r in svc.store.list("bob")] == []
    svc.store.delete("alice", "s@2")
    assert svc.store.get("alice", "s").version == 1
    with pytest.raises(ValueError, match="invalid handle"):
        svc.store.get("alice", "s@x")
    with pytest.raises(StateFileError, match="invalid state name"):
        svc.create("alice", "../etc", PROMPT)


EXPORT_CHILD = textwrap.dedent(
    """
    import json, sys
    from wkvm.config import EngineConfig
    from wkvm.engine.engine import Engine
    from wkvm.models.rwkv7 import load_rwkv7
    from wkvm.sampling_params import SamplingParams
    from wkvm.state.service import StateService
    from wkvm.state.store import StateStore
    from wkvm.tokenizer import WorldTokenizer
    model_path, root, file, suffix = sys.argv[1:5]
    m = load_rwkv7(model_path)
    store = StateStore(root, m.spec, m.fingerprint, m.vocab_size)
    svc = StateService(Engine(m, WorldTokenizer(), EngineConfig()), store)
    rec = svc.store.import_bytes("other-tenant", open(file, "rb").read())
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    h, _ = svc.generate("other-tenant", rec.handle, json.loads(suffix), greedy)
    print(json.dumps({"handle": rec.handle, "op": rec.op, "tokens": h.output.token_ids}))
    """
)


def test_export_import_in_another_process(svc, tiny_pth, tmp_path):
    svc.create("a", "moving", PROMPT)
    data = svc.store.export_bytes("a", "moving")
    (tmp_path / "moving.state").write_bytes(data)
    out = subprocess.run(
        [sys.executable, "-c", EXPORT_CHILD, str(tiny_pth), str(tmp_path / "other"), str(tmp_path / "moving.state"),
         json.dumps(SUFFIX)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["tokens"] == fresh(svc, PROMPT + SUFFIX).token_ids
    assert got["handle"] == "moving@1" and got["op"] == "import"


def test_import_refuses_bad_files(svc, model, tmp_path):
    svc.create("a", "x", PROMPT)
    good = svc.store.export_bytes("a", "x")
    svc.store.import_bytes("b", good)  # the untouched file imports
    tampered = bytearray(good)
    tampered[-5] ^= 0x40
    cases = {
        "checksum": bytes(tampered),
        "truncated": good[: len(good) // 2],
        "not a readable": b"hello world, not a state file",
    }
    for reason, data in cases.items():
        with pytest.raises(StateFileError, match=reason):
            svc.store.import_bytes("b", data)
    other = StateStore(tmp_path / "o", model.spec, "0" * 64, model.vocab_size)
    with pytest.raises(StateFileError, match="another model"):
        other.import_bytes("b", good)
    n = int.from_bytes(good[:8], "little")
    header = json.loads(good[8 : 8 + n])
    header["__metadata__"]["token_ids"] = json.dumps(PROMPT[:-1] + [7])
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw = raw.ljust(-(-len(raw) // 8) * 8)
    with pytest.raises(StateFileError, match="token digest"):
        svc.store.import_bytes("b", len(raw).to_bytes(8, "little") + raw + good[8 + n :])


def test_mutations(svc):
    svc.create("a", "m", PROMPT)
    same = svc.mutate("a", "m", "decay", {"alpha": 1.0})
    assert same.op == "mutate" and same.op_params == {"rule": "decay", "alpha": 1.0} and same.parent == "m@1"
    h1, _ = svc.generate("a", "m@1", SUFFIX, params())
    h2, _ = svc.generate("a", same.handle, SUFFIX, params())
    assert h1.output.token_ids == h2.output.token_ids
    zero = svc.mutate("a", "m@1", "decay", {"alpha": 0.0})
    state = svc.store.load("a", zero.handle)[1]
    assert all(state[k].abs().sum() == 0 for k in state if k.endswith(".wkv"))
    assert any(state[k].abs().sum() > 0 for k in state if k.endswith("_shift"))
    svc.create("a", "other", [1, 2, 3])
    mid = svc.mutate("a", "m@1", "interpolate", {"other": "other", "t": 0.5})
    a, b, c = (svc.store.load("a", h)[1] for h in ("m@1", "other", mid.handle))
    assert all(torch.allclose(c[k], (a[k] + b[k]) / 2, atol=1e-6) for k in a)
    with pytest.raises(ValueError, match="alpha"):
        svc.mutate("a", "m@1", "decay", {"alpha": 2})
    with pytest.raises(ValueError, match="unknown mutation"):
        svc.mutate("a", "m@1", "nope", {})

    @register_mutation("negate_shift")
    def negate_shift(spec, st, p, load):
        return {k: -v if k.endswith("_shift") else v.clone() for k, v in st.items()}

    custom = svc.mutate("a", "m@1", "negate_shift", {})
    assert custom.op_params == {"rule": "negate_shift"}


def test_lru_tiers_stay_within_limits_and_pins_stay(model, tmp_path):
    one = model.spec.nbytes
    svc = make_service(model, tmp_path / "lru", StoreLimits(device_bytes=2 * one, host_bytes=3 * one))
    recs = [svc.create("a", f"s{i}", PROMPT[: i + 2]) for i in range(7)]
    svc.store.set_pinned("a", "s0", True)
    for i in range(7, 12):
        svc.create("a", f"s{i}", PROMPT[: (i % 10) + 2] + [i])
        assert svc.store.device_cache.nbytes <= 2 * one and svc.store.host_cache.nbytes <= 3 * one
    tiers = {r.name: r.tier for r in svc.store.list("a")}
    assert tiers["s0"] in ("device", "host") and tiers["s11"] == "device"
    blobs = {t: {r.blob for r in svc.store.list("a") if r.tier == t} for t in ("device", "host", "disk")}
    assert len(blobs["device"]) == 2 and len(blobs["host"]) == 3 and len(blobs["disk"]) >= 4
    svc.store.load("a", recs[3].handle)
    assert svc.store.get("a", "s3").tier == "device"
    assert svc.store.device_cache.nbytes <= 2 * one and svc.store.host_cache.nbytes <= 3 * one
    assert svc.store.get("a", "s0").tier in ("device", "host")


STORM_CHILD = textwrap.dedent(
    """
    import sys, torch
    from wkvm.models.rwkv7 import load_rwkv7
    from wkvm.state.store import StateStore
    m = load_rwkv7(sys.argv[1])
    store = StateStore(sys.argv[2], m.spec, m.fingerprint, m.vocab_size)
    g = torch.Generator().manual_seed(0)
    for i in range(100000):
        toks = [1 + (i * 7 + j) % 200 for j in range(1 + i % 9)]
        _, state = m.prefill(toks[:-1]) if len(toks) > 1 else (None, m.new_state())
        rec = store.put("t", f"s{i % 13}", state, toks)
        print("ACK", rec.handle, ",".join(map(str, toks)), flush=True)
    """
)


def test_sigkill_during_write_storm_loses_no_acknowledged_state(svc, model, tiny_pth, tmp_path):
    root = tmp_path / "storm"
    proc = subprocess.Popen([sys.executable, "-c", STORM_CHILD, str(tiny_pth), str(root)], stdout=subprocess.PIPE,
                            text=True)  # fmt: skip
    acked = []
    for line in proc.stdout:
        if line.startswith("ACK"):
            _, handle, toks = line.split()
            acked.append((handle, [int(t) for t in toks.split(",")]))
        if len(acked) >= 40:
            os.kill(proc.pid, signal.SIGKILL)
            break
    proc.wait()
    restarted = make_service(model, root)
    for handle, toks in acked:
        rec = restarted.store.get("t", handle)
        assert rec.token_ids == toks
    for handle, toks in acked[-5:]:
        h, _ = restarted.generate("t", handle, [3], params(5))
        assert h.output.token_ids == fresh(svc, toks + [3], 5).token_ids


def test_write_back_states_spill_when_they_leave_ram(model, tmp_path):
    one = model.spec.nbytes
    store = StateStore(tmp_path / "wb", model.spec, model.fingerprint, model.vocab_size,
                       limits=StoreLimits(device_bytes=one, host_bytes=one))  # fmt: skip
    states = [model.prefill([i + 1, i + 2])[1] for i in range(3)]
    recs = [store.put("t#ckpt", f"c{i}", s, [i + 1, i + 2, 9], durable=False) for i, s in enumerate(states)]
    files = {p.stem for p in (tmp_path / "wb" / "blobs").glob("*.state")}
    assert files == {recs[0].blob}  # only the state pushed out of RAM has a file so far
    for rec, s in zip(recs, states, strict=True):
        loaded = store.load("t#ckpt", rec.handle)[1]
        assert all(torch.equal(loaded[k], s[k]) for k in s)
    store.close()
    reopened = StateStore(tmp_path / "wb", model.spec, model.fingerprint, model.vocab_size)
    assert sorted(r.handle for r in reopened.list("t#ckpt")) == ["c0@1", "c1@1", "c2@1"]


def test_restart_reads_back_only_changed_files(model, tmp_path, monkeypatch):
    """A restart checks a state file's checksum only if its size/mtime/inode changed since it was written."""
    from wkvm.state import statefile

    def open_store():
        return StateStore(tmp_path / "r", model.spec, model.fingerprint, model.vocab_size)

    store = open_store()
    _, state = model.prefill(PROMPT)
    for i, name in enumerate("abc"):
        state["layers.0.att_shift"][0, 0] = float(i)  # distinct content: one file each
        store.put("t", name, state, PROMPT)
    paths = {n: store._blob_path(store.get("t", n).blob) for n in "abc"}
    store.close()
    decoded = []
    real_decode = statefile.decode
    monkeypatch.setattr(statefile, "decode", lambda *a, **k: decoded.append(1) or real_decode(*a, **k))
    open_store().close()
    assert decoded == []  # unchanged files: a stat each, nothing read
    data = bytearray(paths["b"].read_bytes())
    data[-5] ^= 0x40
    paths["b"].write_bytes(bytes(data))
    paths["c"].write_bytes(paths["c"].read_bytes()[:-100])
    reopened = open_store()
    assert [r.name for r in reopened.list("t")] == ["a"]  # b and c were read, failed and dropped
    assert len(decoded) == 2
