"""The `wkvm` command line."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger("wkvm")


def env_default(flag: str, default=None):
    """Every flag can also come from WKVM_<FLAG>."""
    return os.environ.get("WKVM_" + flag.upper().replace("-", "_"), default)


EMBEDDED_MODEL = Path(__file__).parent / "assets" / "wkvm-tiny-shakespeare"


def default_model() -> Path:
    """The embedded model (a small RWKV-7 trained on Shakespeare); a random one if the assets are missing."""
    if (EMBEDDED_MODEL / "config.json").exists():
        return EMBEDDED_MODEL
    from wkvm.models.rwkv7_random import RWKV7Shape, save_random_rwkv7

    path = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "wkvm" / "random-rwkv7-tiny.pth"
    log.warning("embedded model missing at %s: using a RANDOM model (its output is noise)", EMBEDDED_MODEL)
    if not path.exists():
        save_random_rwkv7(path, RWKV7Shape(4, 128, 32, 65536, None, 16, 16, 8, 32), seed=0)
    return path


SERVE_FLAGS: list[tuple[str, type, object, str]] = [
    ("model", str, None, "BlinkDL .pth, HF/fla directory or weight pack (default: the embedded model)"),
    ("device", str, "cpu", "cpu, or cuda with a CUDA build of torch"),
    ("dtype", str, "float32", "float32, or bfloat16: half the memory; faster only with native bf16 (wkvm doctor)"),
    ("weight-cache-layers", int, 0, "stream a weight pack from disk, at most N layers in memory (0: resident)"),
    ("host", str, "127.0.0.1", "address to bind; anything but loopback is reachable from other machines"),
    ("port", int, 8000, "TCP port"),
    ("api-key", str, None, "API key(s), comma-separated; then every route but /health needs one"),
    ("api-key-file", str, None, "file with one API key per line (lines starting with '#' are comments)"),
    ("served-model-name", str, None, "model id reported by /v1/models"),
    ("slots", int, 8, "state slots: sequences running at once"),
    ("max-queue", int, 256, "waiting requests beyond which the server answers 429"),
    ("token-budget", int, 512, "tokens per engine step (decode + prefill)"),
    ("prefill-chunk", int, 256, "most prompt tokens one request feeds per step"),
    ("request-timeout", float, None, "seconds before a request is aborted"),
    ("state-dir", str, None, "directory of durable states (default: a temporary one)"),
    ("state-device-bytes", int, 256 << 20, "bytes of states kept on the device"),
    ("state-host-bytes", int, 1 << 30, "bytes of states kept in host RAM"),
    ("state-disk-quota", int, None, "bytes of state files on disk (default: unlimited)"),
    ("max-body-bytes", int, 256 << 20, "largest request body"),
    ("max-prompt-tokens", int, 1 << 17, "largest prompt in tokens"),
    ("max-tokens-limit", int, 1 << 14, "most tokens one request may generate"),
    ("max-chat-sessions", int, 1024, "parked chat sessions (parent-token-v1) kept"),
    ("chat-session-ttl", float, 24 * 3600.0, "seconds a parked chat session lives"),
    ("checkpoint-bytes", int, 1 << 30, "bytes of prefix-reuse checkpoints kept"),
    ("shutdown-grace", float, 10.0, "seconds running requests get to finish on SIGTERM/Ctrl-C before they are ended"),
]
SERVE_SWITCHES = [
    ("no-read-ahead", "with --weight-cache-layers: do not ask the OS for the next layer while one computes"),
    ("no-prefix-reuse", "switch off every kind of state reuse (the baseline)"),
    ("verify-state-loads", "check the sha256 of every state read from disk"),
]


def read_api_keys(args: argparse.Namespace) -> list[str]:
    keys = [k.strip() for k in (args.api_key or "").split(",") if k.strip()]
    if args.api_key_file:
        for line in Path(args.api_key_file).read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):  # '#' inside a key is part of the key
                keys.append(line)
    return keys


def cmd_serve(args: argparse.Namespace) -> int:
    from wkvm.config import ServerConfig
    from wkvm.models.loader import check_model_path
    from wkvm.server.app import create_app
    from wkvm.server.serving import GracefulServer

    model = args.model or str(default_model())
    check_model_path(model)  # before binding the port: a wrong path is one line and exit 2, not a 503 server
    keys = read_api_keys(args)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not keys:
        log.warning("binding %s without an API key: anyone who can reach this port can use the server", args.host)
    config = ServerConfig(
        model=model, device=args.device, dtype=args.dtype, weight_cache_layers=args.weight_cache_layers,
        read_ahead=not args.no_read_ahead, host=args.host, port=args.port, api_keys=keys,
        served_model_name=args.served_model_name,
        slots=args.slots, max_queue=args.max_queue, token_budget=args.token_budget, prefill_chunk=args.prefill_chunk,
        request_timeout=args.request_timeout, state_dir=args.state_dir, state_device_bytes=args.state_device_bytes,
        state_host_bytes=args.state_host_bytes, state_disk_quota=args.state_disk_quota,
        verify_state_loads=args.verify_state_loads, max_body_bytes=args.max_body_bytes,
        max_prompt_tokens=args.max_prompt_tokens, max_tokens_limit=args.max_tokens_limit,
        prefix_reuse=not args.no_prefix_reuse, max_chat_sessions=args.max_chat_sessions,
        chat_session_ttl=args.chat_session_ttl, checkpoint_bytes=args.checkpoint_bytes,
        shutdown_grace=args.shutdown_grace,
    )  # fmt: skip
    app = create_app(config)
    GracefulServer(app, args.host, args.port, config.shutdown_grace).run()
    return 1 if app.state.ctx.load_error else 0


def add_serve_flags(s: argparse.ArgumentParser) -> None:
    for flag, typ, default, help_ in SERVE_FLAGS:
        raw = env_default(flag)
        if flag == "api-key" and raw is None:
            raw = os.environ.get("WKVM_API_KEY")
        s.add_argument(f"--{flag}", type=typ, default=typ(raw) if raw is not None else default,
                       help=f"{help_} [env WKVM_{flag.upper().replace('-', '_')}]")  # fmt: skip
    for flag, help_ in SERVE_SWITCHES:
        on = (env_default(flag) or "").lower() in ("1", "true", "yes", "on")
        s.add_argument(f"--{flag}", action="store_true", default=on,
                       help=f"{help_} [env WKVM_{flag.upper().replace('-', '_')}=1]")  # fmt: skip


def cmd_generate(args: argparse.Namespace) -> int:
    from wkvm.llm import LLM
    from wkvm.sampling_params import SamplingParams

    llm = LLM(model=args.model or default_model(), dtype=args.dtype)
    prompt = [int(t) for t in args.prompt_ids.split(",")] if args.prompt_ids else args.prompt
    if prompt is None:
        print("wkvm generate: give a prompt or --prompt-ids", file=sys.stderr)
        return 2
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    out = llm.generate([prompt], params)[0]
    if args.json:
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason}))
    else:
        print(out.text)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from wkvm.cli_chat import ChatREPL

    state_dir = Path(args.state_dir or Path.home() / ".cache" / "wkvm" / "chat-states")
    ChatREPL(args.model or str(default_model()), state_dir, args.max_tokens, args.temperature, args.dtype).run()
    return 0


BENCHES = ("rwkv7_speed", "batch_decode", "state_ops", "multiturn", "weight_streaming", "bf16_speed")


def cmd_bench(args: argparse.Namespace) -> int:
    import subprocess

    bench_dir = Path(__file__).resolve().parent.parent / "bench"
    names = [n for n in BENCHES if (bench_dir / f"{n}.py").exists()] if args.name == "all" else [args.name]
    for name in names:
        script = bench_dir / f"{name}.py"
        if not script.exists():
            print(f"wkvm bench: {script} not found (benchmarks run from a source checkout)", file=sys.stderr)
            return 2
        rc = subprocess.call([sys.executable, str(script), *args.extra])
        if rc:
            return rc
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from wkvm.models.rwkv7_checkpoint import convert
    from wkvm.tokenizer import copy_companions

    if args.pack:
        from wkvm.weights.pack import write_pack

        write_pack(args.src, args.dst)
        what = "weight pack: manifest.json, globals and one file per layer"
    else:
        fmt = convert(args.src, args.dst)
        what = "HF/fla directory" if fmt == "hf" else "BlinkDL .pth"
    copied = copy_companions(args.src, args.dst)
    print(f"wrote {args.dst} ({what}{'; with ' + ', '.join(copied) if copied else ''})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="wkvm", description="A state-native inference engine for recurrent LMs.")
    sub = ap.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_serve_flags(s)
    s.set_defaults(func=cmd_serve)

    g = sub.add_parser("generate", help="generate from a prompt")
    g.add_argument("prompt", nargs="?")
    g.add_argument("--model", default=env_default("model"))
    g.add_argument("--prompt-ids", help="comma-separated token ids instead of text")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int)
    g.add_argument("--dtype", default=env_default("dtype") or "float32", help="weights: float32 or bfloat16")
    g.add_argument("--json", action="store_true", help="print text, token ids and finish reason as JSON")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("convert", help="convert between BlinkDL .pth and an HF/fla directory (lossless)")
    c.add_argument("src")
    c.add_argument("dst")
    c.add_argument("--pack", action="store_true", help="write a weight pack for --weight-cache-layers streaming")
    c.set_defaults(func=cmd_convert)

    ch = sub.add_parser("chat", help="chat in the terminal; the state is kept across turns")
    ch.add_argument("--model", default=env_default("model"))
    ch.add_argument("--state-dir", default=env_default("state_dir"), help="where /save keeps states")
    ch.add_argument("--max-tokens", type=int, default=200)
    ch.add_argument("--temperature", type=float, default=0.8)
    ch.add_argument("--dtype", default=env_default("dtype") or "float32", help="weights: float32 or bfloat16")
    ch.set_defaults(func=cmd_chat)

    b = sub.add_parser("bench", help="run a benchmark from bench/ and print its table")
    b.add_argument("name", choices=[*BENCHES, "all"])
    b.add_argument("extra", nargs=argparse.REMAINDER, help="arguments for the benchmark script")
    b.set_defaults(func=cmd_bench)

    from wkvm import cli_doctor, cli_states

    cli_states.add_parser(sub)
    cli_doctor.add_parser(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"wkvm {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
