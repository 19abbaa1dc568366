"""A peer's evaluation harness: lm-eval's `local-completions` model scores a local multiple-choice task through the
server (echo + logprobs) and gets the loglikelihoods that the same harness gets from the Python API and from
BlinkDL's `rwkv` package, within 1e-4 for every (item, choice). scripts/lm_eval_check.py runs it at full size."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("lm_eval", reason="lm-eval is in the `eval` extra: pip install -c constraints.txt -e '.[eval]'")

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "lm_eval_check.py"
PAIRS = ("server_python", "server_rwkv", "python_rwkv")


def load_check():
    spec = importlib.util.spec_from_file_location("lm_eval_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_lm_eval_through_the_server_equals_the_python_api_and_the_rwkv_package(one_thread):
    report = load_check().run_check(items=40)
    assert report["loglikelihoods"] == 40 * 4
    for pair in PAIRS:
        assert report[f"max_abs_diff_{pair}"] < 1e-4, report
        assert report[f"greedy_mismatches_{pair}"] == 0, report
    accs = {run["acc"] for run in report["runs"].values()}
    assert len(accs) == 1 and 0.25 < accs.pop() < 1  # the trained model beats chance and the runs agree
