"""Run the server in a background thread on a loopback port (tests, benchmarks, embedding)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import cast

import httpx

from wkvm.config import ServerConfig
from wkvm.server.app import create_app
from wkvm.server.context import ServerContext
from wkvm.server.serving import GracefulServer


def bound_socket() -> socket.socket:
    """A listening-ready TCP socket on a loopback port the kernel picked, held until the caller closes it."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    return s


def first_free_port(ports: Iterable[int]) -> int | None:
    """The first of `ports` nobody listens on now on loopback (None if none is)."""
    for port in ports:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    return None


def free_port() -> int:
    """A loopback port free now, for a server in another process (the benchmarks'). Released before it returns, so
    another process can take it first (rare: the kernel picks from ~14,000 even ports); a server in this process uses
    `bound_socket`, and the tests take theirs from a range of their own (tests/live_server.py)."""
    with bound_socket() as s:
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
        # The socket stays bound from here until exit, so no other process (a second pytest worker) can take the port
        # between choosing it and serving on it, and wait_healthy can only reach this server.
        self.socket = bound_socket()
        self.port = cast(int, self.socket.getsockname()[1])
        self.config = replace(config, host="127.0.0.1", port=self.port)
        self.app = create_app(self.config)
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = GracefulServer(self.app, "127.0.0.1", self.port, self.config.shutdown_grace, "warning")
        self.thread = threading.Thread(target=self.server.run, args=([self.socket],), name="wkvm-http", daemon=True)

    @property
    def ctx(self) -> ServerContext:
        return cast(ServerContext, self.app.state.ctx)  # create_app sets it

    def __enter__(self) -> BackgroundServer:
        self.thread.start()
        try:
            wait_healthy(self.url, alive=self.thread.is_alive)
        except BaseException:
            self.socket.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.begin_shutdown()
        self.thread.join(timeout=30 + self.config.shutdown_grace)
        self.socket.close()
