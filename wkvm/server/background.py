"""Run the server in a background thread on a loopback port (tests, benchmarks, embedding)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import cast

import httpx

from wkvm.config import ServerConfig
from wkvm.server.app import create_app
from wkvm.server.context import ServerContext
from wkvm.server.serving import GracefulServer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return cast(int, s.getsockname()[1])  # an AF_INET socket's name is (host, port)


def wait_healthy(url: str, timeout: float = 120, alive: Callable[[], bool] = lambda: True) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"server at {url} exited before it became healthy")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} not healthy after {timeout}s")


class BackgroundServer:
    """`with BackgroundServer(ServerConfig(model=...)) as s: httpx.get(s.url + "/health")`"""

    def __init__(self, config: ServerConfig):
        self.port = free_port()
        self.config = replace(config, host="127.0.0.1", port=self.port)
        self.app = create_app(self.config)
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = GracefulServer(self.app, "127.0.0.1", self.port, self.config.shutdown_grace, "warning")
        self.thread = threading.Thread(target=self.server.run, name="wkvm-http", daemon=True)

    @property
    def ctx(self) -> ServerContext:
        return cast(ServerContext, self.app.state.ctx)  # create_app sets it

    def __enter__(self) -> BackgroundServer:
        self.thread.start()
        wait_healthy(self.url, alive=self.thread.is_alive)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.begin_shutdown()
        self.thread.join(timeout=30 + self.config.shutdown_grace)
