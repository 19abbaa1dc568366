"""Everything a request handler needs: the engine client, state store and service, chat sessions, tokenizer and
template, metrics, auth. The loaded parts are set by `load()` (on a thread at startup); routes call
`require_ready()` before touching them."""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import logging
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from fastapi import Request

from wkvm import __version__
from wkvm.chat_template import ChatTemplate
from wkvm.config import NO_MODEL, ServerConfig
from wkvm.embeddings import EmbeddingModel
from wkvm.engine.client import EngineClient, LocalEngineClient, ModelInfo
from wkvm.engine.engine import Engine
from wkvm.models.linear import compute_paths
from wkvm.sampling_params import model_sampling_defaults
from wkvm.server.asgi import KeyRing, tenant_of
from wkvm.server.errors import APIError
from wkvm.server.handover import Handovers
from wkvm.server.metrics import Metrics
from wkvm.state.responses import ResponseStore
from wkvm.state.service import StateService
from wkvm.state.sessions import ChatSessions
from wkvm.state.statefile import FLOAT16_MAX
from wkvm.state.store import StateStore, StoreLimits
from wkvm.tokenizer import Tokenizer
from wkvm.weights.loader import load_model, load_text_tools, resolved_dtype

log = logging.getLogger("wkvm.server")


def freeze_startup_heap() -> None:
    """Put every object alive now out of the cyclic garbage collector's reach (`gc.freeze`, as vLLM does after
    start-up). A loaded server holds ~225-320k long-lived Python objects (torch, FastAPI, pydantic, Ray), and a full
    collection, which CPython runs whenever enough objects have outlived younger ones, walked all of them: 130-180 ms
    on a 2-core EPYC with every stream stalled (bench/stream_tail.py). Frozen, it walks only what came later (under
    10 ms there). Garbage is collected first, so only live objects are frozen."""
    gc.collect()
    gc.freeze()


# How long a thread that wants the GIL waits before the one holding it must let go (Python's default is 5 ms). The
# engine thread gives the GIL up around each kernel call and takes it back after; while the event loop runs Python
# (request parsing, a stream's chunks), each of those returns could wait up to the interval. 8 streamed completions
# of 128 tokens on the 0.1B int4 model, one process, AMD EPYC avx512, 2 cores, 2 x 3 rounds alternating: 0.5 ms gave
# 664-723 tok/s (inter-token p99 15-29 ms) against 557-667 (20-46 ms) at 5 ms.
GIL_SWITCH_SECONDS = 0.0005
STATE_DIR_WAIT = 30.0  # seconds a server waits for another process to let go of its state directory (a replica's
# predecessor in its slot still closing), then refuses to start, naming the holder


def backend_fingerprint(model: str, dtype: str, kv_dtype: str, device: str) -> str:
    """OpenAI's `system_fingerprint`: `fp_` and 12 hex digits naming what a seeded request's tokens depend on: the
    model's weights, the weights' and the keys' dtypes, the device, and `compute_paths` (a digest of wkvm's computing
    sources, torch's version and, on a CPU, its vector ISA and the kernel the weights' dtype runs: an AVX2-restricted
    run of an AVX-512 machine differs), so a client sees when the same seed may give other tokens (docs/http-api.md).
    It had been left out (hunt, session 49)."""
    made_of = "|".join([__version__, model, dtype, kv_dtype, device, compute_paths(dtype, device)])
    return "fp_" + hashlib.sha256(made_of.encode()).hexdigest()[:12]


@dataclass
class ServerContext:
    config: ServerConfig
    metrics: Metrics = field(default_factory=Metrics)
    ready: threading.Event = field(default_factory=threading.Event)
    load_error: str | None = None
    load_error_is_input: bool = False  # the load failed on its input (ValueError, OSError), not on a bug
    closing: bool = False  # a shutdown began: new requests get 503 shutting_down (running ones have the grace)
    started_at: float = field(default_factory=time.time)
    on_load_failure: Callable[[], None] | None = None  # `wkvm serve` exits instead of serving 503s forever
    # set by load(), read only after require_ready():
    client: EngineClient = field(init=False)
    model: ModelInfo = field(init=False)  # the client's: routes never see the model's tensors
    tokenizer: Tokenizer = field(init=False)
    longest_token_bytes: int = 1  # the vocabulary's longest token: a text's bytes bound its tokens from below
    system_fingerprint: str = ""  # OpenAI's field: what a seeded answer's tokens depend on (`backend_fingerprint`)
    template: ChatTemplate = field(init=False)
    # values from the model's generation_config.json for requests that leave those fields out (--generation-config)
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    store: StateStore = field(init=False)
    service: StateService = field(init=False)
    sessions: ChatSessions = field(init=False)
    responses: ResponseStore = field(init=False)  # the Responses API's stored responses
    embedder: EmbeddingModel | None = None  # --embeddings
    handovers: Handovers = field(default_factory=Handovers)  # streams that could move to another server
    reserved_places: int = 0  # queue places admitted requests hold until their prompts are queued (event loop only)
    # (tenant, name) -> whether this server holds the name (waiting a while for it): a stream that moved here saves its
    # final state under a name only once the name has followed it (a cluster replica sets it; one server holds all)
    holds_name: Callable[[str, str], bool] | None = None
    _tmp: tempfile.TemporaryDirectory[str] | None = None
    _torch_threads: int | None = None  # torch's process-wide thread count before the server set it to 1
    _threads_lock: threading.Lock = field(default_factory=threading.Lock)
    _shut_down: bool = False  # a load that ends after shutdown leaves torch's thread count alone
    loader: threading.Thread | None = None  # the background load (`create_app`), while the model loads

    @functools.cached_property
    def keys(self) -> KeyRing:
        return KeyRing(self.config.api_keys)

    @staticmethod
    def model_sampling_defaults(cfg: ServerConfig) -> dict[str, Any]:
        """The model's generation_config.json sampling values under `--generation-config auto` (logged, as vLLM logs
        them: a user sees why an answer without a temperature is not sampled at 1.0); {} otherwise."""
        if cfg.generation_config != "auto" or cfg.model is None:
            return {}
        found = model_sampling_defaults(cfg.model)
        if found:
            log.info("requests that leave them out take the model's generation_config.json values: %s "
                     "(--generation-config none: OpenAI's defaults)",
                     ", ".join(f"{k}={v}" for k, v in found.items()))  # fmt: skip
        return found

    @property
    def model_created(self) -> int:
        """/v1/models' `created`: the model file's modification time (seconds since the epoch)."""
        path = Path(self.config.model or ".")
        return int(path.stat().st_mtime) if path.exists() else int(self.started_at)

    @property
    def generative(self) -> bool:
        """False for an embeddings-only server (`--model none --embeddings DIR`)."""
        return self.config.model != NO_MODEL

    @property
    def model_name(self) -> str:
        return self.config.served_name()

    def load(self) -> None:
        """Load the model and build the engine and store (called on a background thread at startup)."""
        try:
            cfg = self.config
            if cfg.model is None:
                raise ValueError("no model given")
            if not self.generative:
                if not cfg.embeddings:
                    raise ValueError("--model none serves embeddings only: give --embeddings DIR")
                # --served-model-name names the server's one model, as vLLM's (it had named only /health's)
                self.embedder = EmbeddingModel(cfg.embeddings, cfg.device, self.model_name)
                freeze_startup_heap()
                self.ready.set()
                log.info("embedding model %s loaded (no generative model: --model none)", self.embedder.name)
                return
            path = cfg.model  # auto: the file's own precision, before anything reads the weights' kind
            cfg = self.config = replace(cfg, dtype=resolved_dtype(cfg.dtype, path, cfg.device))
            model = load_model(path, device=cfg.device, dtype=cfg.dtype,
                               weight_cache_layers=cfg.weight_cache_layers, read_ahead=cfg.read_ahead)  # fmt: skip
            self.tokenizer, self.template = load_text_tools(path, model.family)
            self.sampling_defaults = self.model_sampling_defaults(cfg)
            self.tokenizer.decode([0])  # tables built on first use (World: its byte table; HF: each token's bytes, for
            self.tokenizer.token_bytes(0)  # logprobs and the grammar) are built now, not on a
            self.longest_token_bytes = max(len(self.tokenizer.token_bytes(i)) for i in range(self.tokenizer.vocab_size))
            # stream's first token or a moved stream's resume (it had added ~400 ms to a replica's first move)
            engine = Engine(model, self.tokenizer, cfg.engine_config())
            self.client = LocalEngineClient(engine)
            self.model = m = self.client.model
            sys.setswitchinterval(GIL_SWITCH_SECONDS)
            engine.start()
            # the kernels built or loaded before the server says it is ready, and before anything computes the key
            # of its arithmetic (`compute_paths`: chat checkpoints', `system_fingerprint`), which names a kernel
            # that failed to build
            seconds = engine.warm_up()
            if seconds > 2:
                log.info("the warm-up request took %.0f s (a machine's first start builds the kernels, cached for "
                         "later ones; with --weight-cache-layers it reads every layer once)", seconds)  # fmt: skip
            root = cfg.state_dir
            if root is None:
                self._tmp = tempfile.TemporaryDirectory(prefix="wkvm-states-")
                root = self._tmp.name
            limits = StoreLimits.from_config(cfg)
            self.store = StateStore(root, m.spec, m.fingerprint, m.vocab_size, device=cfg.device, limits=limits,
                                    verify_on_load=cfg.verify_state_loads, lock_wait=STATE_DIR_WAIT)  # fmt: skip
            self.store.bring_up_pins()
            self.service = StateService(self.store, FLOAT16_MAX if cfg.engine_kv_dtype() == "float16" else None)
            self.responses = ResponseStore(Path(root) / "responses.sqlite")
            self.sessions = ChatSessions(self.service, m.fingerprint, cfg, self.metrics)
            if cfg.embeddings:
                self.embedder = EmbeddingModel(cfg.embeddings, cfg.device)
            # the step loop keeps its threads; every other thread of the server (anyio's workers: state import and
            # export, saves, KV cuts, embeddings) runs torch on one from here: one such thread that had run a
            # two-thread op made every later decode step ~2x slower (SmolLM2 int8, 7 -> 14-16 ms after a state import
            # as a fresh server's first request; libgomp throttles its waits once it manages more threads than CPUs)
            with self._threads_lock:
                if not self._shut_down:
                    self._torch_threads = torch.get_num_threads()
                    torch.set_num_threads(1)
            self.system_fingerprint = backend_fingerprint(m.fingerprint, cfg.dtype, cfg.engine_kv_dtype(), cfg.device)
            freeze_startup_heap()
            self.ready.set()
            kv = f", keys and values {self.config.engine_kv_dtype()}" if self.model.spec.has_kv else ""
            log.info("model %s loaded (fingerprint %s..., weights %s%s)", self.model_name, self.model.fingerprint[:12],
                     self.config.dtype, kv)  # fmt: skip
        except Exception as e:  # reported by /health and every route, instead of a dead process
            client: EngineClient | None = getattr(self, "client", None)
            if client is not None:  # its step loop started before what failed (a state directory in use): it holds
                with contextlib.suppress(Exception):  # the model's memory and a thread, and serves nothing now
                    client.shutdown(drain=False, timeout=5)
            self.load_error = f"{type(e).__name__}: {e}"
            # memory the settings ask for and the machine lacks (--slots' arena, --kv-cache-bytes): theirs, one line
            short = isinstance(e, MemoryError | torch.OutOfMemoryError) or "can't allocate memory" in str(e)
            if short:
                self.load_error = f"not enough memory for these settings (lower --slots or --kv-cache-bytes): {e}"
            self.load_error_is_input = short or isinstance(e, ValueError | OSError)
            if self.load_error_is_input:  # a checkpoint that is not what it claims, a missing file: one line
                log.error("model load failed: %s", self.load_error if short else e)
            else:  # a bug: its traceback
                log.exception("model load failed")
            if self.on_load_failure is not None:
                self.on_load_failure()

    def end_requests(self, grace: float) -> None:
        """Refuse new requests; give running ones `grace` seconds, then end them (streams still close cleanly)."""
        self.closing = True
        if not self.ready.is_set() or not self.generative:
            return
        self.client.stop_accepting()
        deadline = time.monotonic() + grace
        while self.client.stats().busy and time.monotonic() < deadline:
            time.sleep(0.05)
        self.client.abort_all("the server is shutting down")

    def shutdown(self) -> None:
        # a shutdown while the model loads waits for the load (up to the grace period): then it stops what the load
        # started. The process's exit with the load still in native code had aborted it (SIGABRT, "terminate called
        # without an active exception": the interpreter ends daemon threads by unwinding them; hunt, session 46);
        # `wkvm serve` exits at once past the wait (`load_outlived_shutdown`)
        if self.loader is not None and self.loader.is_alive():
            log.info("the model is still loading: waiting up to %g s for it before shutting down",
                     self.config.shutdown_grace)  # fmt: skip
            self.loader.join(self.config.shutdown_grace)
        if self.ready.is_set() and self.generative:
            self.client.shutdown(drain=True, timeout=30)
            self.store.close()
            self.responses.close()
        if self._tmp is not None:
            self._tmp.cleanup()
        if self.ready.is_set():
            gc.unfreeze()  # what this server held can be collected again (a process may run another one)
        with self._threads_lock:  # and the process's torch threads are its own again
            self._shut_down = True
            if self._torch_threads is not None:
                torch.set_num_threads(self._torch_threads)
                self._torch_threads = None

    def load_outlived_shutdown(self) -> bool:
        """Whether the background load still runs after `shutdown` waited for it."""
        return self.loader is not None and self.loader.is_alive()

    def require_ready(self, generative: bool = True) -> None:
        """503 while loading or after a failed load; 404 for a generative route on an embeddings-only server."""
        if self.load_error:
            raise APIError(503, f"the model failed to load: {self.load_error}", code="model_load_failed")
        if not self.ready.is_set():
            raise APIError(503, "the model is still loading; retry shortly", code="not_ready",
                           headers={"Retry-After": "1"})  # fmt: skip
        if generative and not self.generative:
            raise APIError(404, "this server serves embeddings only (--model none): /v1/embeddings and /v1/models",
                           "model", "model_not_found")  # fmt: skip
        self.refuse_if_closing()

    def refuse_if_closing(self) -> None:
        """503 `shutting_down` once a shutdown began (the queue's room reads 0 then: it had been a 429 `queue_full`,
        and state writes that need no engine had still been made)."""
        if self.closing:
            message = "the server is shutting down and accepts no new requests; retry shortly (a restarted or another "
            raise APIError(503, message + "server answers)", code="shutting_down", headers={"Retry-After": "1"})

    @functools.cached_property
    def template_defaults(self) -> dict[str, Any]:
        """--default-chat-template-kwargs, read once (the config checked it at start)."""
        return self.config.chat_template_defaults()

    def template_variables(self, given: dict[str, Any] | None) -> dict[str, Any] | None:
        """A chat request's template variables: its chat_template_kwargs over --default-chat-template-kwargs."""
        defaults = self.template_defaults
        return {**defaults, **(given or {})} if defaults else given

    def tenant(self, request: Request) -> str:
        """Name the tenant that owns states (`asgi.tenant_of`; keys are checked by ApiKeyGate before any route
        runs, and again here to keep routes safe without the gate)."""
        tenant = tenant_of(request.scope, self.keys)
        if tenant is None:
            raise APIError(401, "missing or invalid API key", code="invalid_api_key")
        return tenant
