"""`wkvm serve --replicas N [--ray-address ADDR]`: a Ray Serve application of one front and N engine replicas.

Ray is imported only here (and by the modules this one deploys), so single-process serving never loads it.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from types import FrameType
from typing import Any

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from wkvm.cluster.front import Front, build_front_app
from wkvm.cluster.replica import DIRECTORY, NAMESPACE, EngineReplica, directory_actor
from wkvm.cluster.router import AffinityRouter
from wkvm.config import ServerConfig

log = logging.getLogger("wkvm.cluster")
APP = NAMESPACE


@serve.ingress()
class FrontDeployment:
    def __init__(self, config: ServerConfig, engine: Any):
        self.front = Front(config, engine, ray.get_actor(DIRECTORY, namespace=NAMESPACE))

    def __serve_build_asgi_app__(self) -> Any:
        return build_front_app(self.front)


def application(config: ServerConfig) -> Any:
    """The bound Serve application (the directory actor must exist first: `directory_actor()`)."""
    engine = serve.deployment(EngineReplica).options(
        name="wkvm-engine",
        num_replicas=config.replicas,
        ray_actor_options={"num_cpus": 0},  # replicas share the machine's cores (each sets its torch threads)
        max_ongoing_requests=config.slots + config.max_queue,  # beyond it the owner is overloaded: fall back
        request_router_config=RequestRouterConfig(request_router_class=AffinityRouter),
        graceful_shutdown_timeout_s=config.shutdown_grace + 30,
        health_check_period_s=2,
    )
    front = serve.deployment(FrontDeployment).options(name="wkvm-front", ray_actor_options={"num_cpus": 0})
    return front.bind(config, engine.bind(config))


# Serve probes a replica's queue length before routing to it and gives up after 0.1-1 s; a replica whose cores are
# busy decoding (2 cores, several replicas) answers later than that, and the give-ups pile up probes of their own.
SERVE_ENV = {"RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "1.0",
             "RAY_SERVE_MAX_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "5.0"}
RUNTIME_ENV = {"env_vars": SERVE_ENV}


def start(config: ServerConfig) -> Any:
    """Join or start Ray, start Serve on --host/--port and deploy (returns once every replica is ready) and the
    directory's handle: the caller keeps it (an actor lives while a handle to it does)."""
    for k, v in SERVE_ENV.items():  # a local Ray's processes (Serve's proxy and controller too) inherit these
        os.environ.setdefault(k, v)
    if config.ray_address:
        ray.init(address=config.ray_address, namespace=APP, include_dashboard=False, runtime_env=RUNTIME_ENV)
    else:
        ray.init(namespace=APP, include_dashboard=False, runtime_env=RUNTIME_ENV)
    serve.start(http_options={"host": config.host, "port": config.port})
    directory = directory_actor()
    serve.run(application(config), name=APP, route_prefix="/")
    return directory


def stop() -> None:
    """Delete the application (each replica drains: `EngineReplica.__del__`), then leave Ray."""
    try:
        serve.delete(APP)
        serve.shutdown()
    finally:
        ray.shutdown()


def run(config: ServerConfig) -> int:
    """Serve until SIGTERM or Ctrl-C."""
    done = threading.Event()

    def on_signal(sig: int, frame: FrameType | None) -> None:
        log.info("shutting down the replicas (running requests have %.0f s: --shutdown-grace)", config.shutdown_grace)
        done.set()

    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, on_signal)
    try:
        directory = start(config)
    except RuntimeError as e:  # a replica failed to start (its traceback is in the log above)
        log.error("the replicas did not start: %s", e)
        stop()
        return 1
    log.info("wkvm serving on http://%s:%d with %d replicas", config.host, config.port, config.replicas)
    done.wait()
    stop()
    del directory
    return 0
