"""Issue #13: what a newcomer trips over: a wrong --model, /v1/models/{id}, /version, system messages, pack modes."""

import json
import os
import shutil
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import httpx
import openai
import pytest
from live_server import LiveServer

import wkvm
from wkvm.chat_template import load_chat_template
from wkvm.cli import EMBEDDED_MODEL


def serve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "wkvm.cli", "serve", "--port", "1", *args]  # never binds: it must fail first
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize(("model", "says"), [("/nonexistent/model.pth", "does not exist"),
                                             ("BlinkDL/rwkv7-g1", "never downloads")])  # fmt: skip
def test_wrong_model_fails_before_binding(model, says):
    r = serve("--model", model)
    assert r.returncode == 2 and says in r.stderr, r.stderr
    assert "Uvicorn running" not in r.stderr and "Traceback" not in r.stderr


def test_model_that_fails_to_load_later_exits(tmp_path, world_pth):
    from live_server import free_port

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "rwkv7"}))  # looks like a model, has no weights
    cmd = [sys.executable, "-m", "wkvm.cli", "serve", "--model", str(broken), "--port", str(free_port())]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    # a checkpoint that is not what it claims is the user's input, as for every other command: exit 2, one line
    assert r.returncode == 2 and "model load failed: " in r.stderr and "the model did not load" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr[-2000:]


def test_a_negative_weight_cache_is_refused(tiny_pth):
    """--weight-cache-layers -1 had loaded resident, as 0 does (hunt 16)."""
    r = serve("--weight-cache-layers", "-1")
    assert r.returncode == 2 and "--weight-cache-layers must be >= 0" in r.stderr, r.stderr
    from wkvm.weights.loader import load_model

    with pytest.raises(ValueError, match="weight_cache_layers must be an integer >= 0"):
        load_model(tiny_pth, weight_cache_layers=-1)


@pytest.mark.parametrize(("device", "says"), [("cuda", "use --device cpu"), ("mps", "runs on cpu or cuda"),
                                              ("gpu0", "not a device name")])  # fmt: skip
def test_a_device_this_machine_lacks_fails_before_binding(device, says):
    import torch

    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    r = serve("--device", device)
    assert r.returncode == 2 and says in r.stderr, r.stderr
    assert "Uvicorn running" not in r.stderr and "Traceback" not in r.stderr


def test_models_retrieve_created_and_version(world_pth):
    with LiveServer(model=str(world_pth), shutdown_grace=0) as s:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0)
        card = client.models.retrieve(s.ctx.model_name)
        assert card.id == s.ctx.model_name and card.created == int(os.stat(world_pth).st_mtime)
        assert client.models.list().data[0].created == card.created
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("gpt-9")
        v = httpx.get(f"{s.url}/version").json()
        assert v["family"] == "rwkv7" and v["fingerprint"] == s.ctx.model.fingerprint and v["version"]
        # the World tokenizer's byte table was built at load, not on the first token (or a moved stream's resume)
        assert "_bytes" in vars(s.ctx.tokenizer)


def test_embedded_template_renders_system_messages():
    tpl = load_chat_template(EMBEDDED_MODEL)
    user = [{"role": "user", "content": "What news?"}]
    with_system = tpl.render([{"role": "system", "content": "Speak in verse."}, *user])
    assert with_system == "Speak in verse.\n\n" + tpl.render(user)
    assert tpl.render(user) == "ROMEO:\nWhat news?\n\nJULIET:\n"


def test_the_embedded_models_answer_ends_at_its_templates_stop():
    """The embedded model's chat_template.json declares the stop "\\n\\n" (the end of a speech): the loaded model's
    template carries it, and a chat answer ends there (finish_reason stop, the stop cut off), where a completion of
    the same prompt, which no template stop applies to, runs on into the next speaker."""
    from wkvm.weights.loader import load_text_tools

    _, tpl = load_text_tools(EMBEDDED_MODEL, "rwkv7")
    assert tpl.stop == ["\n\n"] and tpl.name == "shakespeare-dialogue", tpl
    messages = [{"role": "user", "content": "What news?"}]
    with LiveServer(model=str(EMBEDDED_MODEL), shutdown_grace=0) as s:
        assert s.ctx.template.stop == ["\n\n"]
        body = {"max_tokens": 60, "temperature": 0}
        chat = httpx.post(f"{s.url}/v1/chat/completions", json={**body, "messages": messages}, timeout=60).json()
        prompt = s.ctx.template.render(messages)
        done = httpx.post(f"{s.url}/v1/completions", json={**body, "prompt": prompt}, timeout=60).json()
    answer, text = chat["choices"][0]["message"]["content"], done["choices"][0]["text"]
    assert chat["choices"][0]["finish_reason"] == "stop" and chat["usage"]["completion_tokens"] < 60, chat
    assert answer and "\n\n" not in answer and text.startswith(answer + "\n\n") and len(text) > len(answer) + 2


def test_pack_files_have_the_usual_mode(tmp_path):
    """Pack files get the mode open() gives under this process's umask (safetensors alone creates them 0600)."""
    from wkvm.atomic import FILE_MODE
    from wkvm.weights.pack import write_pack

    umask = os.umask(0o022)
    os.umask(umask)
    assert 0o666 & ~umask == FILE_MODE
    pack = write_pack(EMBEDDED_MODEL, tmp_path / "pack")
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in pack.iterdir() if p.is_file()}
    assert set(modes.values()) == {FILE_MODE}, modes
    if umask & 0o044 == 0:  # a umask that lets others read (022, 002): then they can read the pack
        assert FILE_MODE & 0o044 == 0o044


REPO = Path(__file__).resolve().parent.parent


def test_a_folder_named_wkvm_beside_a_script_does_not_shadow_the_package(tmp_path):
    (tmp_path / "wkvm").mkdir()  # e.g. the clone itself, next to a script saved in its parent
    (tmp_path / "snippet.py").write_text("import wkvm\nprint(wkvm.__version__)\n")
    r = subprocess.run([sys.executable, "snippet.py"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == wkvm.__version__, r.stderr


def test_wheel_carries_the_embedded_model(tmp_path):
    # from a copy of what the Dockerfile copies: a build/ left in the checkout by an earlier build kept files the
    # package data no longer names, and the wheel still had them
    src = tmp_path / "src"
    shutil.copytree(REPO / "wkvm", src / "wkvm", ignore=shutil.ignore_patterns("__pycache__"))
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / f, src / f)
    cmd = [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q", "-w",
           str(tmp_path)]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("wkvm-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for f in ("config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"):
        assert f"wkvm/assets/wkvm-tiny-shakespeare/{f}" in names
    # every kernel source and header (only models/*.cpp had been packaged: an installed wheel built no int8, int4 or
    # fused kernel, "int8_blocks.h: No such file", and dequantized per call)
    sources = {p.relative_to(REPO).as_posix() for p in (REPO / "wkvm").rglob("*") if p.suffix in (".cpp", ".h")}
    assert len(sources) >= 11 and sources <= names, sorted(sources - names)
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "wkvm = wkvm.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_dockerfile_lints_clean():
    hadolint = Path(sys.executable).parent / "hadolint"
    r = subprocess.run([str(hadolint), str(REPO / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize(("env", "args", "host"), [
    ({}, [], "127.0.0.1"),
    ({"WKVM_API_KEY": "k"}, [], "0.0.0.0"),
    ({"WKVM_API_KEY_FILE": "/keys"}, ["--model", "/m"], "0.0.0.0"),
    ({}, ["--model", "/m", "--api-key", "k"], "0.0.0.0"),
    ({}, ["--api-key-file=/keys"], "0.0.0.0"),
    ({}, ["--model", "/api-key models"], "127.0.0.1"),
])  # fmt: skip
def test_container_listens_outside_only_with_a_key(tmp_path, env, args, host):
    fake = tmp_path / "wkvm"
    fake.write_text('#!/bin/sh\necho "$WKVM_HOST|$*"\n')
    fake.chmod(0o755)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("WKVM_")}
    run_env = {**clean, **env, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    r = subprocess.run(["sh", str(REPO / "docker" / "entrypoint.sh"), *args], env=run_env, capture_output=True,
                       text=True, timeout=30)  # fmt: skip
    assert r.stdout.strip() == f"{host}|serve {' '.join(args)}".strip()


def docker_daemon() -> bool:
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=20).returncode == 0
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not docker_daemon(), reason="no Docker daemon here: the Dockerfile is linted instead")
def test_docker_image_builds():
    r = subprocess.run(["docker", "build", "-q", "-t", "wkvm-test", str(REPO)], capture_output=True, text=True,
                       timeout=1800)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
