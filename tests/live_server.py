"""Live servers for tests: the real app in a thread, or `wkvm serve` in another process."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

from wkvm.config import ServerConfig
from wkvm.server.background import BackgroundServer, first_free_port, wait_healthy

# Ports for servers in other processes: below the kernel's ephemeral range (32768-60999 by default), from which
# in-process servers and outgoing connections take theirs, and a range of its own for each pytest worker (gw0, gw1,
# ...). The kernel's own choice (bind port 0, release, hand the number to the child) could be taken by the other
# worker between the release and the child's bind, and the test would then talk to the other worker's server.
_WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
_PORTS = itertools.count(20_000 + 1_000 * _WORKER)


def free_port() -> int:
    """A loopback port nobody listens on now, never handed out twice in this process, from this worker's range."""
    port = first_free_port(_PORTS)
    assert port is not None  # the counter is endless
    return port


def until(done: Callable[[], bool], timeout: float = 30) -> bool:
    """Poll `done` until it holds (True) or `timeout` seconds pass (False): for a server's internal state, where a
    fixed sleep is either slow or, on a loaded machine, too short."""
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


class LiveServer(BackgroundServer):
    def __init__(self, **config):
        super().__init__(ServerConfig(**config))


class ServerProcess:
    """`wkvm serve` in a separate process (for cross-process tests). Its log is kept; on exit the test fails if
    the server answered a 5xx or logged a traceback (a 5xx is a bug)."""

    def __init__(self, *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "wkvm.cli", "serve", "--port", str(self.port), *args]
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 (kept open for the process's life)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ})

    def __enter__(self) -> ServerProcess:
        wait_healthy(self.url, alive=lambda: self.proc.poll() is None)
        return self

    def stop(self, timeout: float = 30, sig: int = signal.SIGTERM) -> int:
        """Send `sig` (SIGTERM; SIGINT is Ctrl-C), then wait; returns the exit code (killed after `timeout`)."""
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.stop()
        text = self.output()
        self.log.close()
        if exc[0] is None:
            assert "server error:" not in text and "Traceback" not in text, text[-3000:]
