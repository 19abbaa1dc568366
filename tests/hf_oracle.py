"""What each hybrid family's test against transformers' torch path checks in fp32 (tests/test_bamba.py,
test_lfm2.py, test_granite_hybrid.py), given `hf` (the transformers model), `m` (wkvm's, loaded from hf's saved
directory) and the attention layers' indices: whole-prompt logits, greedy tokens and every step's logits against
`generate`, chunked prefill against one shot (logits and state), and a streamed weight pack against resident
weights. Engine-level operations run in the conformance suite."""

from __future__ import annotations

from pathlib import Path

import torch
from conftest import ids_for

from wkvm.weights.loader import load_model
from wkvm.weights.pack import write_pack

ATOL = 1e-4


@torch.no_grad()
def full_prompt_logits(hf, m) -> None:
    ids = ids_for(m.vocab_size, 2, 45)  # more than two SSD chunks
    want = hf(ids, use_cache=False).logits
    assert (m.forward(ids, m.new_state(2), all_logits=True) - want).abs().max() < ATOL
    assert want[0].std(0).mean() > 0.1  # a model whose logits vary, so that the comparison says something


@torch.no_grad()
def greedy_and_decode_logits(hf, m) -> None:
    for seed, length in ((3, 1), (4, 11)):
        prompt = ids_for(m.vocab_size, 1, length, seed=seed)
        out = hf.generate(prompt, max_new_tokens=20, do_sample=False, output_logits=True, return_dict_in_generate=True)
        logits, state = m.prefill(prompt[0])
        got, got_logits = [], []
        for _ in range(20):
            got_logits.append(logits)
            got.append(int(logits.argmax()))
            logits = m.decode([got[-1]], state)[0]
        assert got == out.sequences[0, length:].tolist()
        assert (torch.stack(got_logits) - torch.cat(out.logits)).abs().max() < ATOL


@torch.no_grad()
def chunked_prefill_and_streamed_pack(path: Path, m, attention: set[int], tmp_path: Path,
                                      chunks: tuple[int, ...] = (1, 7, 16)) -> None:  # fmt: skip
    """Chunks of every size in `chunks` give one shot's logits and state; the state is keys and values exactly for
    the `attention` layers; a pack streamed through a one-layer cache gives resident weights' logits."""
    ids = ids_for(m.vocab_size, 1, 40, seed=6)[0]
    want, want_state = m.prefill(ids, all_logits=True)
    for chunk in chunks:
        got, state = m.prefill(ids, all_logits=True, chunk_size=chunk)
        assert (got - want).abs().max() < ATOL
        for k in state:
            assert torch.allclose(state[k], want_state[k], atol=1e-4), (chunk, k)
    assert m.kv_layers == tuple(sorted(attention))
    for t in m.spec.tensors:
        assert (t.kind == "kv") == (int(t.name.split(".")[1]) in attention), t
    write_pack(path, tmp_path / "pack")
    streamed = load_model(tmp_path / "pack", weight_cache_layers=1)
    assert streamed.fingerprint == m.fingerprint
    assert (streamed.prefill(ids, all_logits=True)[0] - want).abs().max() < 1e-5


def saved_pair(model_class, config, randomize, directory: Path) -> tuple[Path, object, object]:
    """A random transformers model of `config` (seeded; `randomize` moves its weights off their initial values),
    saved under `directory`, and wkvm's model loaded from it: (path, hf, m)."""
    torch.manual_seed(3)
    hf = model_class(config).eval()
    randomize(hf)
    path = directory / "ckpt"
    hf.save_pretrained(path, safe_serialization=True)
    return path, hf, load_model(path)
