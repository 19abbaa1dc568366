"""`wkvm serve --replicas N [--ray-address ADDR]`: a Ray Serve application of one front and N engine replicas.

Ray is imported only here (and by the modules this one deploys), so single-process serving never loads it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from wkvm.cluster.forward import MISROUTED_REPLY
from wkvm.cluster.front import Front, build_front_app
from wkvm.cluster.replica import CALL_SECONDS, DIRECTORY, NAMESPACE, EngineReplica, directory_actor
from wkvm.cluster.router import AffinityRouter
from wkvm.config import ServerConfig
from wkvm.logs import wkvm_logger
from wkvm.models.family import first_line
from wkvm.server.context import freeze_startup_heap

log = logging.getLogger("wkvm.cluster")
APP = NAMESPACE
SLOT = re.compile(r"r\d+")
FRONT_CONTROL_REQUESTS = 64  # the front's room beyond the engines' for health, metrics, listings and moves
FRONT_DRAIN_SECONDS = 3600.0  # how long a replaced front relays its streams without a --request-timeout


@serve.ingress()
class FrontDeployment:
    def __init__(self, config: ServerConfig, engine: Any):
        wkvm_logger(config.log_level, config.log_format)
        self.front = Front(config, engine, ray.get_actor(DIRECTORY, namespace=NAMESPACE))
        freeze_startup_heap()  # the front's process holds Ray's and FastAPI's objects: keep full collections short

    def __serve_build_asgi_app__(self) -> Any:
        return build_front_app(self.front)


def application(config: ServerConfig, generation: int = 0) -> Any:
    """The bound Serve application (the directory actor must exist first: `directory_actor()`). A new `generation`
    changes the replicas' options, so deploying it replaces them one by one (a rolling restart)."""
    engine = serve.deployment(EngineReplica).options(
        name="wkvm-engine",
        num_replicas=config.replicas,
        # replicas share the machine's cores (each sets its torch threads)
        ray_actor_options={"num_cpus": 0, "runtime_env": {"env_vars": {"WKVM_GENERATION": str(generation)}}},
        max_ongoing_requests=config.slots + config.max_queue,  # beyond it the owner is overloaded: fall back
        request_router_config=RequestRouterConfig(request_router_class=AffinityRouter),
        graceful_shutdown_timeout_s=config.shutdown_grace + 30,
        health_check_period_s=2,
    )
    # a rolling restart replaces the front too (Serve redeploys the application): the old one keeps relaying the
    # streams it holds, which the engine replicas hand over among themselves, until they end (their clients'
    # connections are its); new requests go to the new front. When the engines stop for good, its relays end with them.
    grace = (config.request_timeout or FRONT_DRAIN_SECONDS) + config.shutdown_grace
    # the front relays every request the engines can hold at once, and control requests beside them (Serve's
    # default of 5 ongoing requests made the sixth stream, and a migrate call, wait for one of them to end)
    front = serve.deployment(FrontDeployment).options(
        name="wkvm-front", ray_actor_options={"num_cpus": 0}, graceful_shutdown_timeout_s=grace,
        max_ongoing_requests=config.replicas * (config.slots + config.max_queue) + FRONT_CONTROL_REQUESTS)  # fmt: skip
    return front.bind(config, engine.bind(config))


# Serve probes a replica's queue length before routing to it and gives up after 0.1-1 s; a replica whose cores are
# busy decoding (2 cores, several replicas) answers later than that, and the give-ups pile up probes of their own.
SERVE_ENV = {"RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "1.0",
             "RAY_SERVE_MAX_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "5.0"}
RUNTIME_ENV = {"env_vars": SERVE_ENV}
WORKER_NICENESS = "RAY_worker_niceness"  # read by a local Ray's raylet when it starts (its default: 15)


def start(config: ServerConfig, after_init: Callable[[], None] = lambda: None) -> Any:
    """Join or start Ray, start Serve on --host/--port and deploy (returns once every replica is ready) and the
    directory's handle: the caller keeps it (an actor lives while a handle to it does). `after_init` runs right after
    ray.init, which installs its own SIGTERM handler (the caller's signal handlers go back there)."""
    for k, v in SERVE_ENV.items():  # a local Ray's processes (Serve's proxy and controller too) inherit these
        os.environ.setdefault(k, v)
    if config.ray_address:
        ray.init(address=config.ray_address, namespace=APP, include_dashboard=False, runtime_env=RUNTIME_ENV)
    else:
        # a local Ray runs its workers (the replicas, the front, the directory) at nice 15, so any other busy process
        # on the machine took their cores: beside a nice-0 process they had ~3% of a core (CFS weights 36 : 1024),
        # as wkvm serve without --replicas never does. Ours run at the launcher's priority (session 59)
        os.environ.setdefault(WORKER_NICENESS, "0")
        ray.init(namespace=APP, include_dashboard=False, runtime_env=RUNTIME_ENV)
    after_init()
    serve.start(http_options={"host": config.host, "port": config.port})
    directory = directory_actor()
    serve.run(application(config), name=APP, route_prefix="/")
    return directory


def absorb_unheld_slots(config: ServerConfig, directory: Any) -> None:
    """Give every slot directory no replica holds (a rolling restart may start new replicas in new slots before the
    old ones stop) to a live replica, which takes its named states. Call only when every replica is running."""
    if not config.state_dir or not Path(config.state_dir).is_dir():
        return
    deadline = time.monotonic() + config.shutdown_grace + 60
    while True:  # replaced replicas drain (Serve lets their requests finish), close their stores, release slots
        ray.get(directory.prune.remote())
        held: dict[str, str] = ray.get(directory.replicas.remote())
        if len(held) <= config.replicas or time.monotonic() > deadline:
            break
        time.sleep(1)
    unheld = sorted(p.name for p in Path(config.state_dir).iterdir() if SLOT.fullmatch(p.name) and p.name not in held)
    if not unheld or not held:
        return
    engine = serve.get_deployment_handle("wkvm-engine", app_name=APP)
    heirs = list(held.values())
    for i, slot in enumerate(unheld):
        for _ in range(30):  # the router may land it on another replica for a moment: that one says so
            try:
                n = engine.absorb.remote(slot, target=heirs[i % len(heirs)], strict=True).result()
            except Exception as e:  # the heir cannot take them (restarting; or its disk, its quota, a name it holds
                # already: no retry helps): they stay, whole, in their slot (the launcher had failed)
                why = first_line(str(e), 300)  # Ray's text has the cause's class and message past its first line
                if any(lasting in str(e) for lasting in ("QuotaExceeded", "DiskFull", "exists already")):
                    log.warning("slot %s has no replica and its states could not be moved (%s): they stay in %s",
                                slot, why, Path(config.state_dir) / slot)  # fmt: skip
                    break
                log.info("slot %s: its states did not move yet (%s); asking again", slot, why)
                time.sleep(1)
                continue
            if n != MISROUTED_REPLY:
                log.info("slot %s had no replica: %s named states moved to a live one", slot, n)
                break
            time.sleep(1)
        else:
            log.warning("slot %s has no replica and its states could not be moved: restart with --replicas %d",
                        slot, config.replicas)  # fmt: skip


def stop(directory: Any = None) -> None:
    """Delete the application (each replica drains: `EngineReplica.__del__`), then leave Ray. The directory first
    hears that the whole application stops, so no replica hands its streams to another that is stopping too: they
    finish where they run, within --shutdown-grace."""
    try:
        if directory is not None:
            with contextlib.suppress(Exception):
                ray.get(directory.stop_app.remote(), timeout=CALL_SECONDS)
        serve.delete(APP)
        serve.shutdown()
    finally:
        ray.shutdown()


class StopStarting(Exception):
    """SIGTERM or Ctrl-C while the replicas were starting."""


def run(config: ServerConfig) -> int:
    """Serve until SIGTERM or Ctrl-C; SIGHUP restarts the replicas one by one (Serve drains each first)."""
    done, restart = threading.Event(), threading.Event()
    starting = True

    def on_signal(sig: int, frame: FrameType | None) -> None:
        log.info("shutting down the replicas (running requests have %.0f s: --shutdown-grace)", config.shutdown_grace)
        done.set()
        if starting:  # serve.run waits for every replica to load: stop now, not once they all have
            raise StopStarting

    def on_hangup(sig: int, frame: FrameType | None) -> None:
        restart.set()
        done.set()

    def install() -> None:
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, on_signal)
        signal.signal(signal.SIGHUP, on_hangup)

    install()
    try:
        # again after ray.init, whose own SIGTERM handler ended the process without a graceful stop: a SIGTERM while
        # the replicas still loaded (the front's /health already answering) killed it with a stack dump (session 29)
        directory = start(config, after_init=install)
        starting = False
    except StopStarting:
        starting = False
        stop()
        return 0
    except RuntimeError as e:  # a replica failed to start (its traceback is in the log above)
        starting = False
        log.error("the replicas did not start: %s", e)
        stop()
        return 1
    absorb_unheld_slots(config, directory)  # a restart with fewer replicas than before
    log.info("wkvm serving on http://%s:%d with %d replicas", config.host, config.port, config.replicas)
    generation = 0
    while True:
        done.wait()
        if not restart.is_set():
            break
        done.clear()
        restart.clear()
        generation += 1
        log.info("rolling restart %d: replacing the replicas one by one", generation)
        serve.run(application(config, generation), name=APP, route_prefix="/")
        absorb_unheld_slots(config, directory)
    stop(directory)
    del directory
    return 0
