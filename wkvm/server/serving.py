"""Run the app under uvicorn with a bounded shutdown.

On SIGTERM or Ctrl-C the server stops taking connections, lets running requests finish for up to
`--shutdown-grace` seconds, then ends the rest: every stream gets a final chunk (`finish_reason: "abort"`)
and `[DONE]`, blocking requests get their partial answer. Then parked states are written and the process
exits 0. A second signal ends the running requests at once. Uvicorn alone would wait for every stream to
finish (minutes for a long generation), and its forced exit cuts streams without `[DONE]`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from types import FrameType
from typing import TYPE_CHECKING, Any

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.config import LOGGING_CONFIG
from uvicorn.protocols.http.h11_impl import H11Protocol

if TYPE_CHECKING:
    from wkvm.server.context import ServerContext

log = logging.getLogger("wkvm.server")
# The HTTP parser: h11, with a cap on a request's head (request line and headers). httptools, which uvicorn picks
# when it is installed (the cluster extra brings it), reads a head of any size before the API key can be checked:
# a 100 MB header held every other request ~10 s and 300 MB took 2 minutes and 370 MB (security review). 64 KiB
# takes any real client's headers and URL. Streaming through h11 cost nothing measurable: 8 streams of 256 tokens
# of the embedded model (int8), 3 rounds each, AMD EPYC Zen 4, 2 cores: 3,429-4,063 chunks/s vs httptools'
# 3,675-3,828 (/tmp harness, session 39).
MAX_HEAD_BYTES = 64 * 1024
HEAD_SECONDS = 20.0  # a connection's request head (line and headers) must be whole this long after it opened or sent


class HeadDeadline(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request head (apache's RequestReadTimeout, nginx's
    client_header_timeout): a connection that opens and sends nothing, or dribbles its headers, is closed HEAD_SECONDS
    after it opened or its response ended. uvicorn waits for a head forever, so clients without a key could hold every
    file descriptor (300 such connections under `ulimit -n 256` refused /health and a keyed save; security hunt,
    session 48). The rest of a body answered before it was read (a 401 on the head, a 413) has the same time. A
    body the server is reading is not timed: on a server with keys only a key holder gets that far."""

    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._watch_head()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_head()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def _waiting(self) -> bool:
        """Whether the connection only waits on the client: for the next request's head (h11's IDLE), or for the rest
        of a body whose response has gone (a 401 or 413 answered on the head alone: a client dribbling that body had
        held the connection forever; review, session 48)."""
        state = self.conn.their_state
        answered = self.cycle is None or self.cycle.response_complete
        return state is h11.IDLE or (state is h11.SEND_BODY and answered)

    def _watch_head(self) -> None:
        """A timer while the connection only waits on the client; stopped once a request is whole or being answered."""
        if not self._waiting() or self.transport.is_closing():
            self._stop_head_timer()
        elif self._head_timer is None:
            self._head_timer = self.loop.call_later(HEAD_SECONDS, self._head_late)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        mine = self.transport.get_protocol() is self  # not a connection upgraded to another protocol since
        if mine and self._waiting() and not self.transport.is_closing():
            self.transport.close()


HTTP_PARSER = HeadDeadline


class GracefulServer(uvicorn.Server):
    def __init__(
        self,
        app: FastAPI,
        host: str,
        port: int,
        grace: float,
        log_level: str = "info",
        log_config: dict[str, Any] | None = None,
        access_log: bool = True,
    ):
        """`log_config` (a dictConfig dictionary, see wkvm.logs) replaces uvicorn's own formats; None keeps them."""
        # uvicorn's own limit is a backstop only: by then every request has been ended
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log_level,
            log_config=log_config or LOGGING_CONFIG,
            access_log=access_log,
            http=HTTP_PARSER,
            h11_max_incomplete_event_size=MAX_HEAD_BYTES,
            # the stub says int | None; uvicorn only passes it to asyncio.wait_for, which takes a float
            timeout_graceful_shutdown=grace + 10,  # type: ignore[arg-type]
        )
        super().__init__(config)
        self.ctx: ServerContext = app.state.ctx
        self.grace = grace
        self._drainer: threading.Thread | None = None
        self.ctx.on_load_failure = self._load_failed

    def _load_failed(self) -> None:
        log.error("exiting: the model did not load (the line above says why)")
        self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drainer is None:
            log.info("shutting down: running requests have %.0f s to finish (--shutdown-grace)", self.grace)
            self._start_drain()  # uvicorn's handler below sets should_exit (set here first, a SIGINT would force-exit)
        else:
            log.info("second signal: ending running requests now")
            self.ctx.end_requests(0)
        super().handle_exit(sig, frame)
        # uvicorn re-raises caught signals after shutting down (exit status 143); ours drains, so it is a clean 0
        getattr(self, "_captured_signals", []).clear()

    def begin_shutdown(self) -> None:
        """Stop accepting requests and end the running ones after the grace period (returns at once)."""
        self._start_drain()
        self.should_exit = True

    def _start_drain(self) -> None:
        self._drainer = threading.Thread(target=self.ctx.end_requests, args=(self.grace,), name="wkvm-drain",
                                         daemon=True)  # fmt: skip
        self._drainer.start()
