"""Building wkvm's C++ kernels (wkvm/models/int8.py `load_kernel`): a build killed halfway does not block every later
start, concurrent builds of one kernel wait for each other, and every checkout compiles the same copied path."""

import os
import subprocess
import sys
import time

from wkvm.models.int8 import exclusive, stable_copy

HOLDER = """
import fcntl, pathlib, sys, time
d = pathlib.Path(sys.argv[1])
with open(d / "wkvm-build.flock", "w") as guard:
    fcntl.flock(guard, fcntl.LOCK_EX)
    (d / "lock").touch()  # torch's own guard, as a build in progress holds it
    print("held", flush=True)
    time.sleep(1.5)
    (d / "lock").unlink()
    (d / "finished").touch()  # last, just before the flock goes
"""


def test_a_lock_left_by_a_build_that_died_is_removed(tmp_path, caplog):
    """torch waits forever on its `lock` file; a process killed mid-build (Ctrl-C on the first `make serve`) left
    one, and every later start hung in `load_kernel` (found in session 12)."""
    (tmp_path / "lock").touch()
    with exclusive(tmp_path):
        assert not (tmp_path / "lock").exists()
    assert "left by a build that did not finish" in caplog.text


def test_a_build_in_progress_in_another_process_is_waited_for(tmp_path, caplog):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with exclusive(tmp_path):
            assert not (tmp_path / "lock").exists()
            # entered only once the holder was done: it waited instead of taking the live lock for a stale one (a
            # measured wait had been asserted too, which a loaded machine could break)
            assert (tmp_path / "finished").exists()
    finally:
        holder.wait(timeout=30)
    assert "did not finish" not in caplog.text


def test_every_checkout_compiles_the_same_copy(tmp_path):
    for checkout in ("a", "b"):
        models = tmp_path / checkout / "models"
        (models / "family").mkdir(parents=True)
        (models / "shared.h").write_text("// shared\n")
        (models / "family" / "op.cpp").write_text('#include "../shared.h"\n')
    build = tmp_path / "build"
    first = stable_copy(tmp_path / "a" / "models" / "family" / "op.cpp", ["../shared.h"], build)
    assert first.read_text() == '#include "../shared.h"\n'
    assert (first.parent / "../shared.h").read_text() == "// shared\n"  # the include resolves next to the copy
    before = os.stat(first).st_mtime_ns
    time.sleep(0.01)
    second = stable_copy(tmp_path / "b" / "models" / "family" / "op.cpp", ["../shared.h"], build)
    assert second == first and os.stat(second).st_mtime_ns == before  # same text: not rewritten (ninja keeps it)
