"""Engine and server configuration: dataclasses validated on creation; the server's fields are the CLI flags."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from wkvm.logs import FORMATS, LEVELS

REASONING_PARSERS = ("auto", "none", "deepseek_r1", "qwen3")  # --reasoning-parser (vLLM's names: one rule here)
GENERATION_CONFIGS = ("auto", "none", "vllm")  # --generation-config / LLM(generation_config=): auto reads the file

EMBEDDED_MODEL = Path(__file__).parent / "assets" / "wkvm-tiny-shakespeare"
NO_MODEL = "none"  # --model none: no generative model (an embeddings-only server)


def default_model() -> Path:
    """The embedded model (a small model trained on Shakespeare, shipped in the package's assets)."""
    if not (EMBEDDED_MODEL / "config.json").exists():
        raise FileNotFoundError(f"the embedded model is missing at {EMBEDDED_MODEL} (a damaged install: reinstall "
                                "wkvm), or pass --model PATH")  # fmt: skip
    return EMBEDDED_MODEL


if TYPE_CHECKING:
    import torch


KV_DTYPES = ("float32", "float16")
AUTO_DTYPE = "auto"  # --dtype: the checkpoint's own precision where wkvm has its kind (loader.auto_dtype)
# `wkvm serve --kv-dtype`: auto keeps keys and values as the weights' precision asks (docs/design-paged-kv.md)
KV_CHOICES = ("auto", *KV_DTYPES)
KV_ALIASES = {"fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
MAX_PROMPT_TOKENS = 1 << 17  # --max-prompt-tokens' default
# a draft and the pending token before it are checked as one chunk of at most models.family.STEP_CHUNK (8) tokens,
# the chunks a model runs with the bits of stepping
MAX_SPECULATIVE_TOKENS = 7
MAX_SLOTS = 65_536  # state slots: each holds a sequence's fixed-size state whether used or not


def physical_memory() -> int | None:
    """This machine's RAM in bytes, where the OS says (None elsewhere)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


@dataclass
class EngineConfig:
    n_slots: int = 8  # state slots on the device: the most sequences running at once
    max_queue: int = 256  # waiting requests beyond which submit() refuses with QueueFull
    token_budget: int = 512  # tokens fed to the model per step, decode and prefill together
    prefill_chunk: int = 256  # most prompt tokens one request feeds per step
    request_timeout: float | None = None  # seconds from arrival; None = no limit
    device: str = "cpu"
    kv_cache_bytes: int = 1 << 30  # attention models: the shared pool of key/value pages (untouched until used)
    kv_page_tokens: int = 16  # tokens per KV page
    kv_dtype: str = "float32"  # attention models: the pages' element type (float16 halves their bytes)
    # speculative decoding by prompt lookup (docs/speculative.md): the most draft tokens a step checks (0: off) and
    # the n-gram lengths looked up, longest first
    speculative_tokens: int = 0
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    speculative_max_running: int = 4  # no drafts while more requests than this run (a batch is compute-bound)

    def __post_init__(self) -> None:
        for name in ("n_slots", "max_queue", "token_budget", "prefill_chunk", "kv_cache_bytes", "kv_page_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, not {self.kv_dtype!r}")
        if self.token_budget < self.n_slots:
            raise ValueError("token_budget must be at least n_slots, so every running sequence can decode each step")
        if not 0 <= self.speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_tokens must be in 0..{MAX_SPECULATIVE_TOKENS} (a draft is checked with its "
                             "pending token as one chunk of at most 8 tokens)")  # fmt: skip
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("prompt lookup needs 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.speculative_max_running < 1:
            raise ValueError("speculative_max_running must be at least 1")
        if self.request_timeout is not None and not self.request_timeout > 0:  # NaN too
            raise ValueError("request_timeout must be positive")
        check_device(self.device)

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.kv_dtype)  # type: ignore[no-any-return]


def kv_dtype_for(kv_dtype: str, weights: str) -> str:
    """--kv-dtype with auto resolved for --dtype `weights`: float32 pages for float32 weights (exact against
    transformers), float16 for bfloat16 / int8 / int4 weights, whose own rounding dwarfs what float16 keys and values
    add (SmolLM2, 2,048 tokens teacher-forced, mean KL to the fp32 model: int8 0.00652 -> 0.00659, int4 0.00357 ->
    0.00357; with fp32 weights float16 pages alone add 6e-7) and whose decode reads the pages as much as the weights
    after a few thousand tokens (docs/design-paged-kv.md)."""
    if kv_dtype != "auto":
        return kv_dtype
    return "float32" if weights.lower() in ("float32", "fp32") else "float16"


def kv_dtype_name(value: object) -> str:
    """`kv_dtype` as `dtype` is taken: a name in any case ('FLOAT16', 'fp16', 'half', 'Auto') or a torch dtype that
    names one (`LLM(kv_dtype=torch.float16)` had been refused, its message leaving out auto; dtype hunt, session 49)."""
    import torch

    if isinstance(value, torch.dtype):
        name = {torch.float16: "float16", torch.float32: "float32"}.get(value)
    else:
        name = value.lower() if isinstance(value, str) else None
        name = KV_ALIASES.get(name or "", name)
    if name not in KV_CHOICES:
        raise ValueError(f"kv_dtype {value!r} is not supported; use {', '.join(KV_CHOICES)}")
    return str(name)


def check_device(device: str) -> None:
    """A device wkvm can run on here: cpu, or cuda[:N] where this torch build has CUDA and sees that GPU. Checked when
    a config is made, so `wkvm serve --device cuda` on a CPU-only build is one line before the port is bound, not a
    failed load after it."""
    import torch

    try:
        kind = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device {device!r} is not a device name: use cpu or cuda (cuda:1: the second GPU)") from None
    if kind.type == "cpu":
        return
    if kind.type != "cuda":
        raise ValueError(f"device {device!r}: wkvm runs on cpu or cuda")
    if not torch.cuda.is_available():
        why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
        raise ValueError(f"device {device!r}: {why} (torch {torch.__version__}); use --device cpu")
    if kind.index is not None and kind.index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r}: only {torch.cuda.device_count()} CUDA GPU(s) are visible")


def cors_origins(value: str | None) -> list[str]:
    """`--allowed-origins` as a browser's Origin header spells them: an http(s) origin's scheme and host in lower case,
    no default port, no trailing '/' (written otherwise, 'HTTP://B.example' had matched nothing, silently; docs hunt,
    session 49); other schemes (`app://obsidian.md`, `chrome-extension://ID`) and `null` (a file:// page) exactly as
    written; '*' as is. An http(s) entry with a path, a query or a wildcard in its host is refused: it could match
    no page."""
    from urllib.parse import urlsplit

    out = []
    for raw in (value or "").split(","):
        entry = raw.strip()
        if not entry:
            continue
        scheme = entry.split("://", 1)[0].lower() if "://" in entry else ""
        if entry == "*" or scheme not in ("http", "https"):  # as written, less a trailing '/' no Origin has
            out.append(entry.rstrip("/") or entry)  # (app://obsidian.md/ had stopped matching; review, session 49)
            continue
        try:
            u = urlsplit(entry)
            port = u.port
        except ValueError as e:
            raise ValueError(f"allowed_origins: {entry!r} is not an origin ({e})") from None
        if not u.hostname or "*" in entry or u.path not in ("", "/") or u.query or u.fragment \
                or u.username is not None:
            raise ValueError(f"allowed_origins: {entry!r} is not an origin: give a page's scheme and host (and port), "
                             "e.g. https://chat.example.com or http://localhost:3000, without a path or wildcards "
                             "(list each origin, or give *)")  # fmt: skip
        host = u.hostname.lower()
        host = f"[{host}]" if ":" in host else host
        default = {"http": 80, "https": 443}[scheme]
        out.append(f"{scheme}://{host}" + (f":{port}" if port is not None and port != default else ""))
    return out


def opt(default: Any, help: str, kind: str = "", **kw: Any) -> Any:
    """A ServerConfig field that is also a `wkvm serve` flag: `help` is its --help text (for a setting that is on
    by default, the text of its --no-NAME flag); `kind` "size" takes 256MiB / 2G, "choice:a,b" one of the names,
    "" the annotation's type."""
    return field(default=default, metadata={"help": help, "kind": kind}, **kw)


@dataclass
class ServerConfig:
    """Every `wkvm serve` setting: one source of names, defaults and help (the CLI flags are generated from it)."""

    model: str | None = opt(None, "a checkpoint (file or directory) or weight pack (default: the embedded model); "
                            "none: no generative model, only --embeddings")
    device: str = opt(EngineConfig.device, "cpu, or cuda with a CUDA build of torch")
    dtype: str = opt("float32", "float32 (exact against the reference); bfloat16: half the memory, faster only with "
                     "native bf16; int8: a quarter, faster decode; int4: 5 bits a weight, faster still (wkvm doctor); "
                     "auto: a GGUF file's own precision (Q4_0/Q4_1 int4, other quantized types int8), else float32",
                     "choice:float32,fp32,bfloat16,bf16,int8,int4,auto")
    weight_cache_layers: int = opt(0, "stream a weight pack from disk, at most N layers in memory (0: resident)")
    read_ahead: bool = opt(True, "with --weight-cache-layers: do not ask the OS for the next layer while one computes")
    host: str = opt("127.0.0.1", "address to bind; anything but loopback is reachable from other machines")
    allowed_origins: str | None = opt(None, "web pages (origins, comma-separated, or *) whose scripts may call the API "
                                      "from a browser (CORS); default: pages served from localhost / 127.0.0.1")
    allowed_hosts: str | None = opt(None, "Host header names answered besides local ones (comma-separated, or *: any); "
                                    "default: any, but only local names (IP addresses, localhost, *.localhost, "
                                    "*.local, *.internal, this machine's name) on loopback without an API key (DNS "
                                    "rebinding)")  # fmt: skip
    port: int = opt(8000, "TCP port")
    api_keys: list[str] = field(default_factory=list)  # flags: --api-key, --api-key-file
    served_model_name: str | None = opt(None, "model id reported by /v1/models (default: the model's file name)")
    embeddings: str | None = opt(None, "a sentence-transformers model directory served at /v1/embeddings beside the "
                                 "generative model (e.g. models/all-MiniLM-L6-v2, from `make minilm`)")
    # the engine's settings take EngineConfig's defaults: one source
    slots: int = opt(EngineConfig.n_slots, "state slots: sequences running at once")
    max_queue: int = opt(EngineConfig.max_queue, "waiting requests beyond which the server answers 429; each choice "
                         "of a request takes a place (and, with n > 1, one shared prefill per prompt), so a request "
                         "needing more places than this is a 400")
    token_budget: int | None = opt(None, "tokens per engine step (decode + prefill), at least --slots "
                                   f"(default: {EngineConfig.token_budget}, or --slots where that is more)")
    prefill_chunk: int = opt(EngineConfig.prefill_chunk, "most prompt tokens one request feeds per step")
    request_timeout: float | None = opt(EngineConfig.request_timeout, "seconds before a request is aborted")
    speculative_tokens: int = opt(EngineConfig.speculative_tokens, "speculative decoding by prompt lookup: check up "
                                  f"to N (at most {MAX_SPECULATIVE_TOKENS}) tokens copied from the context after a "
                                  "repeated n-gram in each step; answers stay the same (0: off)")
    prompt_lookup_max: int = opt(EngineConfig.prompt_lookup_max, "with --speculative-tokens: the longest n-gram "
                                 "looked up")
    prompt_lookup_min: int = opt(EngineConfig.prompt_lookup_min, "with --speculative-tokens: the shortest n-gram "
                                 "looked up")
    speculative_max_running: int = opt(EngineConfig.speculative_max_running, "with --speculative-tokens: no drafts "
                                       "while more requests than this are running (vLLM's disable_by_batch_size; "
                                       "a batch's step is bound by arithmetic, where checking drafts costs)")
    kv_cache_bytes: int = opt(EngineConfig.kv_cache_bytes, "attention models: bytes of key/value pages shared by "
                              "all sequences; with the model's context it bounds one sequence's tokens", "size")
    kv_page_tokens: int = opt(EngineConfig.kv_page_tokens, "attention models: tokens per key/value page")
    kv_dtype: str = opt("auto", "attention models: keys and values stored as float32 (exact) or float16 (half the "
                        "bytes, as llama.cpp; answers move slightly); auto: float32 with --dtype float32, else float16",
                        "choice:" + ",".join((*KV_CHOICES, *KV_ALIASES)))
    state_dir: str | None = opt(None, "directory of durable states (default: a temporary one)")
    state_device_bytes: int = opt(256 << 20, "bytes of states kept on the device (256MiB, 2G, ...)", "size")
    state_host_bytes: int = opt(1 << 30, "bytes of states kept in host RAM", "size")
    state_disk_quota: int | None = opt(None, "bytes of user state files on disk, index included (default: unlimited)",
                                       "size")
    state_tenant_quota: int | None = opt(None, "bytes of one tenant's (API key's) state files, "
                                         "so that no tenant's saves fill --state-disk-quota or the disk for the "
                                         "others (default: unlimited)", "size")
    max_state_tokens: int = opt(1 << 16, "attention models: the most cached tokens a stored state (save, hibernate, "
                                "export, import) may hold; a state file is at most this x the bytes per token")
    verify_state_loads: bool = opt(False, "check the sha256 of every state read from disk")
    max_body_bytes: int = opt(256 << 20, "largest request body", "size")
    max_prompt_tokens: int = opt(MAX_PROMPT_TOKENS, "largest prompt in tokens")
    max_tokens_limit: int = opt(1 << 14, "most tokens one request may generate")
    generation_config: str = opt("auto", "auto: a request that leaves temperature, top_p, top_k, min_p or "
                                 "repetition_penalty out takes the model's generation_config.json value, as vLLM's "
                                 "default; none (or vllm, vLLM's name): OpenAI's defaults",
                                 "choice:" + ",".join(GENERATION_CONFIGS))  # fmt: skip
    prefix_reuse: bool = opt(True, "switch off every kind of state reuse (the baseline)")
    reasoning_parser: str = opt("auto", "chat replies' <think>...</think> as message.reasoning_content, the rest as "
                                "content (vLLM's reasoning parsers); auto: where the model's chat template knows "
                                "</think>; deepseek_r1 / qwen3 (vLLM's names): always; none: never",
                                "choice:" + ",".join(REASONING_PARSERS))  # fmt: skip
    default_chat_template_kwargs: str | None = opt(None, "a JSON object of chat template variables every chat "
                                                   "request gets where it does not set them itself (vLLM's flag), "
                                                   "e.g. '{\"enable_thinking\": false}' for Qwen3 / Qwen3.5", "")
    reasoning_budget: int = opt(-1, "most tokens a chat reply may reason (inside <think>) before </think> is forced "
                                "and it answers (llama.cpp's flag, vLLM's thinking_token_budget, which a request "
                                "sets for itself); -1: no budget", "")
    reasoning_budget_message: str = opt("", "text forced before </think> when a reasoning budget runs out (llama.cpp's "
                                        "flag), so the reasoning reads as closed, e.g. 'Time to answer.'", "")
    max_chat_sessions: int = opt(1024, "parked chat sessions (parent-token-v1) kept")
    chat_session_ttl: float = opt(24 * 3600.0, "seconds a parked chat session lives")
    checkpoint_bytes: int = opt(1 << 30, "bytes of prefix-reuse checkpoints and parked chats kept", "size")
    shutdown_grace: float = opt(10.0, "seconds running requests get to finish on SIGTERM/Ctrl-C before they are ended")
    log_level: str = opt("info", "least severe log lines shown", "choice:" + ",".join(LEVELS))
    log_format: str = opt("text", "text, or json: one object per line (time, level, logger, message)",
                          "choice:" + ",".join(FORMATS))
    access_log: bool = opt(True, "do not log a line per HTTP request")
    replicas: int = opt(0, "engine replicas on Ray Serve behind one endpoint, requests routed to the replica holding "
                        "their state (0: one process; Ray is not imported)")
    ray_address: str | None = opt(None, "with --replicas: join this Ray cluster (default: start a local Ray instance)")

    def __post_init__(self) -> None:
        if self.state_dir == "":  # WKVM_STATE_DIR= (compose's ${X:-}) had kept every tenant's states in the current
            self.state_dir = None  # directory: the default, a temporary one (CLI hunt, session 48)
        dtype_name(self.dtype)  # a ValueError naming the choices (auto: resolved at load)
        if self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, not "
                             f"{self.reasoning_parser!r}")  # fmt: skip
        # 'fp16' (as LLM(kv_dtype=...) takes it) had been refused by the CLI's choices while the offline API took it
        self.kv_dtype = kv_dtype_name(self.kv_dtype)
        if self.generation_config not in GENERATION_CONFIGS:
            raise ValueError(f"generation_config must be one of {', '.join(GENERATION_CONFIGS)}, not "
                             f"{self.generation_config!r}")  # fmt: skip
        if not self.shutdown_grace >= 0:
            raise ValueError("shutdown_grace must be >= 0 seconds")
        self.chat_template_defaults()  # a ValueError for anything but a JSON object
        if self.reasoning_budget < -1:
            raise ValueError("reasoning_budget must be -1 (no budget) or a number of tokens >= 0")
        if len(self.reasoning_budget_message) > 1024:
            raise ValueError("reasoning_budget_message must be at most 1024 characters")
        if not 0 < self.port < 65536:
            raise ValueError("port must be in 1..65535")
        limits = ("max_body_bytes", "max_prompt_tokens", "max_tokens_limit", "max_state_tokens")
        for name in ("replicas", "weight_cache_layers"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.ray_address and not self.replicas:
            raise ValueError("--ray-address needs --replicas N")
        for name in ("slots", "max_queue", "max_chat_sessions", *limits):  # 0 chat sessions had made every parked
            if getattr(self, name) < 1:  # chat a 500 (CLI hunt, session 48)
                raise ValueError(f"{name} must be at least 1")
        if self.token_budget is not None and self.token_budget < self.slots:
            raise ValueError(f"token_budget ({self.token_budget}) must be at least slots ({self.slots}): every running "
                             "sequence decodes a token each step")
        if self.slots > MAX_SLOTS:  # beyond, the arena's allocation failed after the port was bound, with a traceback
            raise ValueError(f"slots must be at most {MAX_SLOTS:,}")
        memory = physical_memory()
        if self.device == "cpu" and memory is not None and self.kv_cache_bytes > memory:
            raise ValueError(f"kv_cache_bytes {self.kv_cache_bytes / 2**30:.1f} GiB is more than this machine's memory "
                             f"({memory / 2**30:.1f} GiB)")  # fmt: skip
        if not self.chat_session_ttl > 0:
            raise ValueError("chat_session_ttl must be > 0 seconds")
        if not math.isfinite(self.shutdown_grace):
            raise ValueError("shutdown_grace must be a finite number of seconds")
        cors_origins(self.allowed_origins)  # an entry that can match no page: refused before binding
        self.engine_config()  # its own checks (prefill_chunk, KV pages, request_timeout) before binding, not at load

    def served_name(self) -> str:
        """The model id in /v1/models and /health: --served-model-name, else the model's directory or file name."""
        if self.served_model_name:
            return self.served_model_name
        if self.model == NO_MODEL and self.embeddings:  # an embeddings-only server
            return Path(os.path.abspath(self.embeddings)).name
        if not self.model:
            return "wkvm"
        name = Path(os.path.abspath(self.model)).name  # a directory's whole name (`stem` cut Qwen2.5-0.5B-Instruct)
        for suffix in (".gguf", ".pth"):
            name = name.removesuffix(suffix)
        return name

    def engine_token_budget(self) -> int:
        """--token-budget, else the engine's default raised to --slots (every running sequence decodes each step);
        one given below --slots is refused by EngineConfig (it had been raised silently: vLLM refuses it too)."""
        if self.token_budget is not None:
            return self.token_budget
        return max(EngineConfig.token_budget, self.slots)

    def engine_kv_dtype(self) -> str:
        return kv_dtype_for(self.kv_dtype, self.dtype)

    def chat_template_defaults(self) -> dict[str, Any]:
        """--default-chat-template-kwargs as a dict ({} when not set)."""
        if not self.default_chat_template_kwargs:
            return {}
        try:
            value = json.loads(self.default_chat_template_kwargs)
        except ValueError as e:
            raise ValueError(f"default_chat_template_kwargs must be a JSON object: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("default_chat_template_kwargs must be a JSON object, e.g. '{\"enable_thinking\": false}'")
        return value

    def engine_config(self) -> EngineConfig:
        device = self.device
        return EngineConfig(
            n_slots=self.slots, max_queue=self.max_queue, token_budget=self.engine_token_budget(),
            prefill_chunk=self.prefill_chunk, request_timeout=self.request_timeout, device=device,
            kv_cache_bytes=self.kv_cache_bytes, kv_page_tokens=self.kv_page_tokens, kv_dtype=self.engine_kv_dtype(),
            speculative_tokens=self.speculative_tokens, prompt_lookup_max=self.prompt_lookup_max,
            prompt_lookup_min=self.prompt_lookup_min, speculative_max_running=self.speculative_max_running,
        )  # fmt: skip


WEIGHT_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16", "int8": "int8",
                 "int4": "int4"}  # fmt: skip


def dtype_name(dtype: object) -> str:
    """--dtype's canonical name for `dtype`: a name in any case ('BF16' -> 'bfloat16', 'AUTO' -> 'auto') or a torch
    dtype that names one (torch.bfloat16, as vLLM's LLM takes it); a ValueError listing the names for anything else
    (`LLM(dtype=torch.bfloat16)` had failed on `.lower()` deep in the KV choice)."""
    import torch

    if isinstance(dtype, torch.dtype):
        name = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.int8: "int8"}.get(dtype)
        name = "int4" if dtype == getattr(torch, "int4", None) else name
    else:
        name = dtype.lower() if isinstance(dtype, str) else None
        name = AUTO_DTYPE if name == AUTO_DTYPE else WEIGHT_DTYPES.get(name or "")
    if name is None:
        raise ValueError(f"dtype {dtype!r} is not supported; use float32, bfloat16, int8, int4 or auto")
    return name


def weight_dtype(name: str) -> torch.dtype:
    """'float32' / 'fp32', 'bfloat16' / 'bf16', 'int8' or 'int4' -> the torch dtype the large matrices are stored in
    (int8: weight-only, per-channel scales, wkvm/models/int8.py; int4: torch.int4 names group-wise int4 held in uint8
    tensors, wkvm/models/int4.py)."""
    import torch

    if str(name).lower() not in WEIGHT_DTYPES:
        raise ValueError(f"dtype {name!r} is not supported; use float32, bfloat16, int8, int4 or auto")
    dtype: torch.dtype = getattr(torch, WEIGHT_DTYPES[str(name).lower()])
    return dtype
