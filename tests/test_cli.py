"""CLI smoke tests: convert round trip and generate --json."""

import json

import torch

from wkvm.cli import main
from wkvm.models.rwkv7_checkpoint import read_checkpoint


def test_convert_round_trip_via_cli(tmp_path, tiny_pth, capsys):
    assert main(["convert", str(tiny_pth), str(tmp_path / "hf")]) == 0
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "back.pth")]) == 0
    a, b = read_checkpoint(tiny_pth)[0], read_checkpoint(tmp_path / "back.pth")[0]
    assert all(torch.equal(a[k], b[k]) for k in a) and a.keys() == b.keys()


def test_generate_json(tiny_pth, capsys):
    assert main(["generate", "--model", str(tiny_pth), "--prompt-ids", "1,2,3", "--max-tokens", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["token_ids"]) == 4 and out["finish_reason"] == "length"


def test_bad_model_path_is_a_clear_error(tmp_path, capsys):
    assert main(["convert", str(tmp_path / "missing"), str(tmp_path / "out")]) == 2
    assert "not a BlinkDL .pth file" in capsys.readouterr().err
