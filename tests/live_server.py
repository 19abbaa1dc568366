"""Live servers for tests: the real app in a thread, or `wkvm serve` in another process."""

from __future__ import annotations

import os
import subprocess
import sys

from wkvm.config import ServerConfig
from wkvm.server.background import BackgroundServer, free_port, wait_healthy


class LiveServer(BackgroundServer):
    def __init__(self, **config):
        super().__init__(ServerConfig(**config))


class ServerProcess:
    """`wkvm serve` in a separate process (for cross-process tests)."""

    def __init__(self, *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "wkvm.cli", "serve", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ})

    def __enter__(self) -> ServerProcess:
        wait_healthy(self.url, alive=lambda: self.proc.poll() is None)
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
