"""The `wkvm` command line."""

from __future__ import annotations

import argparse
import json
import logging
import logging.config
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import Field
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any

from wkvm import __version__
from wkvm.config import EMBEDDED_MODEL as EMBEDDED_MODEL  # noqa: F401  (tests and scripts name it here)
from wkvm.config import default_model
from wkvm.logs import QUIET_LOGGERS, TEXT_FORMAT, log_config

if TYPE_CHECKING:
    from wkvm.sampling_params import SamplingParams

log = logging.getLogger("wkvm")


def env_default(flag: str, default: str | None = None) -> str | None:
    """Every flag can also come from WKVM_<FLAG>."""
    return os.environ.get("WKVM_" + flag.upper().replace("-", "_"), default)


SIZE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
SIZE_UNITS |= {"ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}
SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?i?)b?\s*", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from '268435456', '256MiB', '2G', '1.5GB' or '512k': k/M/G/T count 1000s, KiB/MiB/GiB/TiB 1024s."""
    m = SIZE.fullmatch(str(text))
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in SIZE_UNITS:
        # ArgumentTypeError: argparse shows this message as is (for a ValueError it prints only the type's name)
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: give bytes, or a number with a unit: 512k, 256MiB, 2G, 1.5GB "
            "(k/M/G/T count 1000s, KiB/MiB/GiB/TiB 1024s; any case)"
        )
    return int(Fraction(m.group(1)) * SIZE_UNITS[unit])


def choice(*names: str) -> Callable[[str], str]:
    """An argparse type taking one of `names` in any case (an env var cannot use argparse's `choices`)."""

    def pick(text: str) -> str:
        if text.lower() not in names:
            raise argparse.ArgumentTypeError(f"{text!r} is not one of: {', '.join(names)}")
        return text.lower()

    pick.__name__ = "choice"
    return pick




KEY_FLAGS = [
    ("api-key", "API key(s), comma-separated; then every route but /health needs one (other users of the machine "
                "see a command line: prefer the env or --api-key-file)"),
    ("api-key-file", "file with one API key per line (lines starting with '#' are comments)"),
]


def format_size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def flag_type(f: Field[Any]) -> Callable[[str], Any]:
    """The argparse type of a ServerConfig field (see wkvm.config.opt)."""
    kind = f.metadata.get("kind", "")
    if kind == "size":
        return parse_size
    if kind.startswith("choice:"):
        return choice(*kind.removeprefix("choice:").split(","))
    return int if "int" in str(f.type) else float if "float" in str(f.type) else str


def read_api_keys(args: argparse.Namespace) -> list[str]:
    """The keys --api-key / --api-key-file (or their environment variables) give; a ValueError when they were given
    but hold none (blank, or a file of comments): keyless would leave the server open, and the container's entry
    point listens on every interface once a key is configured."""
    keys = [k.strip() for k in (args.api_key or "").split(",") if k.strip()]
    if args.api_key_file:
        try:
            text = Path(args.api_key_file).read_text()
        except OSError as e:  # "[Errno 21] Is a directory: '/tmp'" had named no option
            raise ValueError(f"--api-key-file {args.api_key_file}: {e.strerror or e}") from None
        for line in text.splitlines():
            line = line.strip()
            if line and not line.startswith("#"):  # '#' inside a key is part of the key
                keys.append(line)
    if not keys and (args.api_key is not None or args.api_key_file):
        raise ValueError("--api-key / --api-key-file (or WKVM_API_KEY / WKVM_API_KEY_FILE) holds no key, only blanks "
                         "or comments: give a key, or leave the option out to serve without one")  # fmt: skip
    return keys


def flag_names(message: str, settings: dict[str, object]) -> str:
    """A ServerConfig message with its field names as the flags that set them: `token_budget (1) must be at least
    slots (2)` -> `--token-budget (1) must be at least --slots (2)` (CLI hunt, session 48). Names with an underscore
    anywhere; a one-word name only where it starts the message or follows "at least" (plain words elsewhere)."""
    for name in sorted(settings, key=len, reverse=True):
        flag = "--" + name.replace("_", "-")
        if "_" in name:
            message = re.sub(rf"(?<![\w-]){name}(?!\w)", flag, message)
        else:
            message = re.sub(rf"^{name}\b|(?<=at least ){name}\b", flag, message)
    return message


def check_port(host: str, port: int) -> None:
    """That the server can listen on host:port, as uvicorn will (SO_REUSEADDR): a port in use had let the model's
    loading thread start and the process then abort in native code (exit 134) after uvicorn's error."""
    import socket

    if not 0 < port < 65536:  # before the host is looked up: -1 had read as a host problem
        raise ValueError("port must be in 1..65535")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"--host {host}: {e.strerror}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as e:
            raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def check_state_dir(d: Path) -> None:
    """--state-dir made where it is missing (as the store makes it: its owner's alone), or a ValueError saying why
    it cannot be used."""
    if d.exists() and not d.is_dir():
        raise ValueError(f"--state-dir {d}: not a directory")
    try:
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as e:
        raise ValueError(f"--state-dir {d}: cannot be made ({e.strerror or e})") from None
    if not os.access(d, os.W_OK | os.X_OK):
        raise ValueError(f"--state-dir {d}: this user cannot write in it")


def cmd_serve(args: argparse.Namespace) -> int:
    from wkvm.config import ServerConfig
    from wkvm.server.app import create_app
    from wkvm.server.asgi import is_loopback
    from wkvm.server.serving import GracefulServer
    from wkvm.weights.loader import check_model_path

    if args.bad_env:
        raise ValueError(args.bad_env[0])
    logs = log_config(args.log_level, args.log_format)
    logging.config.dictConfig(logs)  # now, before the first line is logged; uvicorn applies it again
    logging.captureWarnings(True)  # library warnings in the same format, not bare stderr lines
    model = args.model or str(default_model())
    if model == "none":  # embeddings only
        if not args.embeddings:
            raise ValueError("--model none serves embeddings only: give --embeddings DIR")
    else:
        check_model_path(model, args.weight_cache_layers)  # before binding the port: one line and exit 2, not a
        # 503 server
    # before the port is bound: one line and exit 2 (these had failed once the server listened, after its load)
    if args.embeddings:
        from wkvm.embeddings import check_model_dir

        try:
            check_model_dir(Path(args.embeddings))
        except ValueError as e:
            raise ValueError(f"--embeddings {e}") from None
    if args.state_dir:
        check_state_dir(Path(args.state_dir))
    keys = read_api_keys(args)
    from dataclasses import fields

    settings = {f.name: getattr(args, f.name) for f in fields(ServerConfig) if "help" in f.metadata}
    try:
        config = ServerConfig(**{**settings, "model": model, "api_keys": keys})
    except ValueError as e:  # its messages name fields ("max_queue must be at least 1"): here, the flags
        raise ValueError(flag_names(str(e), settings)) from None
    check_port(args.host, args.port)  # after the settings' own checks: those errors do not depend on the port
    if not is_loopback(args.host) and not keys:  # once the port is known to bind (it had warned, then failed)
        log.warning("binding %s without an API key: anyone who can reach this port can use the server (set "
                    "WKVM_API_KEY or --api-key-file)", args.host)  # fmt: skip
    if config.replicas:
        from wkvm.cluster import launch

        return launch.run(config)
    app = create_app(config)
    server = GracefulServer(app, config.host, config.port, config.shutdown_grace, config.log_level, logs,
                            config.access_log)  # fmt: skip
    server.run()
    ctx = app.state.ctx
    if ctx.load_outlived_shutdown():  # the interpreter's exit would unwind it inside native code: SIGABRT
        log.warning("the model was still loading after %g s (--shutdown-grace): exiting without it",
                    config.shutdown_grace)  # fmt: skip
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    if ctx.load_error:  # as every other command: 2 for input that is not what it should be, 1 for a bug
        return 2 if ctx.load_error_is_input else 1
    return 0


def from_env(typ: Callable[[str], Any], env: str, raw: str) -> Callable[[str], Any]:
    """`typ`, naming the variable when the value it cannot convert is the one from the environment (argparse would
    blame the flag)."""

    def convert(text: str) -> Any:
        try:
            return typ(text)
        except (ValueError, argparse.ArgumentTypeError) as e:
            if text is raw:
                raise argparse.ArgumentTypeError(f"{env}={raw!r}: {e}") from None
            raise

    convert.__name__ = getattr(typ, "__name__", "value")
    return convert


SWITCH_ON, SWITCH_OFF = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def add_serve_flags(s: argparse.ArgumentParser) -> None:
    """One flag per ServerConfig field (its default and help), each also read from WKVM_<FLAG>."""
    from dataclasses import fields

    from wkvm.config import ServerConfig

    for flag, help_ in KEY_FLAGS:  # never shown with a default: --help must not print a key from the environment
        env = "WKVM_" + flag.upper().replace("-", "_")
        s.add_argument(f"--{flag}", default=env_default(flag), help=f"{help_} [env {env}]")
    bad_env: list[str] = []  # switches' variables that are neither on nor off: refused when `serve` runs
    s.set_defaults(bad_env=bad_env)
    for f in fields(ServerConfig):
        if "help" not in f.metadata:
            continue
        if isinstance(f.default, bool):  # a switch: --no-NAME turns a default-on setting off, --NAME one on
            flag = f.name.replace("_", "-") if not f.default else "no-" + f.name.replace("_", "-")
            word = (env_default(flag) or "").strip().lower()
            on = word in SWITCH_ON
            env = "WKVM_" + flag.upper().replace("-", "_")
            if not on and word not in SWITCH_OFF:  # had counted as off: WKVM_NO_PREFIX_REUSE=enabled kept reuse on
                bad_env.append(f"{env}={env_default(flag)!r}: give 1, true, yes or on (or 0, false, no, off)")
            s.add_argument(f"--{flag}", dest=f.name, action="store_false" if f.default else "store_true",
                           default=f.default != on, help=f"{f.metadata['help']} [env {env}=1]")
            continue
        flag, typ = f.name.replace("_", "-"), flag_type(f)
        env = "WKVM_" + f.name.upper()
        default = format_size(f.default) if typ is parse_size and isinstance(f.default, int) else f.default
        raw = env_default(flag)
        if raw is not None:  # argparse converts a string default with `type` when `serve` runs (not when any other
            default, typ = raw, from_env(typ, env, raw)  # command's parser is built); the help shows it as written
        shown = " (default: %(default)s)" if default is not None else ""
        metavar = "SIZE" if typ is parse_size else None
        s.add_argument(f"--{flag}", type=typ, default=default, metavar=metavar,
                       help=f"{f.metadata['help']}{shown} [env {env}]")


SAMPLING_FLAGS: list[tuple[str, type, object, str]] = [
    ("max-tokens", int, 200, "most tokens to generate (in chat: per answer)"),
    ("temperature", float, 0.8, "sampling temperature; 0 always picks the most likely token (repeatable)"),
    ("top-p", float, 0.9, "sample from the most likely tokens whose probabilities add up to this (1: all)"),
    ("seed", int, None, "random seed: the same seed gives the same sample (-1 or none: a new one each run)"),
]


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    """The sampling flags of `generate` and `chat`: one set of defaults for both."""
    for flag, typ, default, help_ in SAMPLING_FLAGS:
        shown = " (default: %(default)s)" if default is not None else ""
        p.add_argument(f"--{flag}", type=typ, default=default, help=help_ + shown)


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    from wkvm.sampling_params import SamplingParams

    seed = None if args.seed == -1 else args.seed  # llama.cpp's "random" (it had been one fixed seed)
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=seed)


def add_model_flags(p: argparse.ArgumentParser) -> None:
    model_help = "a checkpoint (file or directory) or weight pack (default: the embedded model) [env WKVM_MODEL]"
    p.add_argument("--model", default=env_default("model"), help=model_help)
    dtype_help = ("weights: float32, bfloat16, int8, int4 or auto (a GGUF file's own precision: Q4_0/Q4_1 int4, other "
                  "quantized types int8; float32 for everything else) (default: %(default)s) [env WKVM_DTYPE]")
    p.add_argument("--dtype", default=env_default("dtype") or "float32", help=dtype_help)
    spec_help = ("check up to N tokens a step copied from the context after a repeated n-gram (speculative decoding by "
                 "prompt lookup, as `wkvm serve`'s; the same answers; 0: off) (default: %(default)s) "
                 "[env WKVM_SPECULATIVE_TOKENS]")  # fmt: skip
    p.add_argument("--speculative-tokens", type=int, default=int(env_default("speculative_tokens") or 0),
                   help=spec_help)  # fmt: skip


def cmd_generate(args: argparse.Namespace) -> int:
    from wkvm.llm import LLM

    if args.prompt is not None and args.prompt_ids:  # one would be silently dropped
        print("wkvm generate: give a prompt or --prompt-ids, not both", file=sys.stderr)
        return 2
    try:
        prompt = [int(t) for t in args.prompt_ids.split(",")] if args.prompt_ids else args.prompt
    except ValueError:
        raise ValueError(f"--prompt-ids {args.prompt_ids[:80]!r}: give integer token ids, comma-separated") from None
    if prompt == "-":  # the text from standard input (it had generated from the text "-"), less the one line end
        prompt = sys.stdin.read().removesuffix("\n")  # `echo` adds
    if prompt is None:
        print("wkvm generate: give a prompt (- reads it from standard input) or --prompt-ids", file=sys.stderr)
        return 2
    params = sampling_params(args)  # checked before the model loads
    llm = LLM(model=args.model or default_model(), dtype=args.dtype, speculative_tokens=args.speculative_tokens)
    if args.json:
        out = llm.generate([prompt], params)[0]
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason}))
    else:  # printed as it comes, as llama.cpp's CLI does; Ctrl-C stops it and keeps what was said
        from wkvm.cli_chat import stream_to_stdout

        params.check_vocabulary(llm.model.vocab_size)
        h = llm.engine.submit(llm.encode_prompt(prompt), params)
        if stream_to_stdout(llm.engine, h):
            return 130
        out = h.output
    if out.finish_reason == "error":  # what the engine said, and a failed exit (it had printed nothing and exited 0)
        print(f"wkvm generate: the generation failed: {out.error or out.error_code}", file=sys.stderr)
        return 1
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from wkvm.cli_chat import ChatREPL

    state_dir = Path(args.state_dir) if args.state_dir else None  # None: the model's own folder
    if state_dir is not None and state_dir.exists() and not state_dir.is_dir():
        raise ValueError(f"--state-dir {state_dir}: not a directory")  # was "[Errno 17] File exists"
    ChatREPL(args.model or str(default_model()), state_dir, sampling_params(args), args.dtype,
             args.speculative_tokens).run()
    return 0


BENCH_DIR = Path(__file__).resolve().parent.parent / "bench"


def benches() -> dict[str, str]:
    """name -> what it measures (the first sentence of bench/NAME.py's docstring); empty outside a checkout."""
    import ast

    out = {}
    for script in sorted(BENCH_DIR.glob("*.py")) if BENCH_DIR.is_dir() else []:
        doc = ast.get_docstring(ast.parse(script.read_text())) or ""
        if script.stem != "common":
            first = " ".join(doc.split("\n\n")[0].split())  # the first paragraph, on one line
            out[script.stem] = first.split(". ")[0].rstrip(".:")
    return out



def cmd_bench(args: argparse.Namespace) -> int:
    import subprocess

    if not BENCH_DIR.is_dir():
        how = "clone the repository, `pip install -e .` in it, then run `wkvm bench all` there"
        print(f"wkvm bench: {BENCH_DIR} does not exist: benchmarks run from a source checkout ({how})", file=sys.stderr)
        return 2
    names = list(benches()) if args.name == "all" else [args.name]
    for name in names:
        script = BENCH_DIR / f"{name}.py"
        if not script.exists():
            print(f"wkvm bench: {script} not found (benchmarks run from a source checkout)", file=sys.stderr)
            return 2
        rc = subprocess.call([sys.executable, str(script), *args.extra])
        if rc:
            return rc
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from wkvm.atomic import fsync_dir
    from wkvm.models import registry
    from wkvm.tokenizer import COMPANIONS, HFTokenizer, companion_path, copy_companions, save_text_tools
    from wkvm.weights.loader import FILE_SUFFIXES, check_model_path, is_pack, unreadable

    check_model_path(args.src)
    if is_pack(args.src):  # the registry, which reads checkpoints, had said it has no manifest.json
        raise ValueError(f"{args.src} is a weight pack: packs are what convert writes, not what it reads; convert the "
                         "checkpoint the pack was made from")  # fmt: skip
    if Path(args.src).resolve() == Path(args.dst).resolve():
        raise ValueError("the destination is the source: write the converted checkpoint somewhere else")
    dst = Path(args.dst)  # written over, an old pack, shard index or tokenizer beside new weights had loaded instead
    if dst.is_file() or (dst.is_dir() and any(dst.iterdir())):
        raise ValueError(f"{dst} already exists{' and is not empty' if dst.is_dir() else ''}: convert into a new path "
                         "(or an empty directory)")  # fmt: skip
    # one file only from a directory to a .pth (RWKV-7's HF layout to BlinkDL's); every other conversion writes a
    # directory, which a file's name had got unstaged (a .pth) or misleadingly (a directory named X.gguf)
    one_file = dst.suffix == ".pth" and Path(args.src).is_dir() and not args.pack
    if dst.suffix.lower() in FILE_SUFFIXES and not one_file:
        raise ValueError(f"{dst} is named as a file, but this conversion writes a directory: name it without "
                         f"{dst.suffix}")  # fmt: skip
    # A directory is written under a hidden name and put in place when whole: a conversion that fails or is killed
    # leaves no part of one at the destination (shards, a half pack) to block the next try or load. A new one is
    # staged beside it and renamed; an existing empty one (a link to one, a mount point: no rename over those) is
    # staged inside it and its entries moved up, the file that makes it loadable last. A .pth is one atomic file;
    # its companions beside it go first (cut short after the weights, a .pth had loaded with the World tokenizer)
    # and a failed conversion takes them away.
    staged = not one_file
    into = dst.is_dir()
    out = dst
    if staged:  # a new, unpredictable name, made by this process alone (mkdtemp): nothing planted there is used
        dst.parent.mkdir(parents=True, exist_ok=True)
        out = Path(tempfile.mkdtemp(prefix=".wkvm-partial-", dir=dst) if into else
                   tempfile.mkdtemp(prefix=f".{dst.name}.partial-", dir=dst.parent))  # fmt: skip
        umask = os.umask(0)
        os.umask(umask)
        out.chmod(0o777 & ~umask)  # as mkdir would make it (mkdtemp's 0700 had kept other users, a container's, out)
    had = {name for name in COMPANIONS if companion_path(dst, name).exists()}
    try:
        copied = copy_companions(args.src, out)
        if args.pack:
            from wkvm.weights.pack import write_pack

            with unreadable(args.src, "a checkpoint"):
                write_pack(args.src, out)
            what = "weight pack: manifest.json, globals and one file per layer"
        else:
            family, _ = registry.detect(args.src)
            with unreadable(args.src, f"a {family.name} checkpoint"):
                what = f"{family.name}, format {family.convert(Path(args.src), out)}"
        if args.pack and "tokenizer.json" not in copied:  # a tokenizer the checkpoint carries itself (GGUF metadata)
            family = registry.detect(args.src)[0]
            tokenizer = family.default_tokenizer(Path(args.src))  # None: the family has none (a weights-only pack)
            if isinstance(tokenizer, HFTokenizer):  # RWKV's World tokenizer is the family's own: a pack gets it anyway
                template = None if "chat_template.jinja" in copied else family.default_chat_template(Path(args.src))
                copied += save_text_tools(tokenizer, template, out)
        if staged and into:
            for entry in sorted(out.iterdir(), key=lambda e: e.name in ("config.json", "manifest.json")):
                os.replace(entry, dst / entry.name)
            out.rmdir()
            fsync_dir(dst)
        elif staged:
            os.replace(out, dst)
            fsync_dir(dst.parent)
    except BaseException as e:  # what it wrote goes (copied in part too)
        if staged:
            shutil.rmtree(out, ignore_errors=True)
            # a message naming the staging path names the destination the user gave
            e.args = tuple(a.replace(str(out), str(dst)) if isinstance(a, str) else a for a in e.args)
        else:
            for name in set(COMPANIONS) - had:
                companion_path(dst, name).unlink(missing_ok=True)
        raise
    print(f"wrote {args.dst} ({what}{'; with ' + ', '.join(copied) if copied else ''})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="wkvm", description="A state-native inference engine for recurrent LMs.")
    ap.add_argument("--version", action="version", version=f"wkvm {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)

    about = "Serve the OpenAI-compatible HTTP API. Byte sizes take units: 512k, 2G (1000s), 256MiB (1024s)."
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server", description=about)
    add_serve_flags(s)
    s.set_defaults(func=cmd_serve)

    g = sub.add_parser("generate", help="generate from a prompt")
    g.add_argument("prompt", nargs="?", help="text to continue; - reads it from standard input, less a last line end "
                   "(or give --prompt-ids)")
    add_model_flags(g)
    g.add_argument("--prompt-ids", help="comma-separated token ids instead of text")
    add_sampling_flags(g)
    g.add_argument("--json", action="store_true", help="print text, token ids and finish reason as JSON")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("convert", help="convert a checkpoint between its family's formats, or into a weight pack")
    c.add_argument("src", help="a checkpoint (file or directory)")
    c.add_argument("dst", help="what to write: the family's other format (a directory from a .pth file, a .pth "
                               "from a directory), or a weight pack with --pack")  # fmt: skip
    c.add_argument("--pack", action="store_true", help="write a weight pack for --weight-cache-layers streaming")
    c.set_defaults(func=cmd_convert)

    ch = sub.add_parser("chat", help="chat in the terminal; the state is kept across turns")
    add_model_flags(ch)
    state_help = ("where /save and /fork keep states, one model's (default: ~/.cache/wkvm/chat-states/<the model's "
                  "fingerprint>, printed at start) [env WKVM_STATE_DIR]")  # fmt: skip
    ch.add_argument("--state-dir", default=env_default("state_dir"), help=state_help)
    add_sampling_flags(ch)
    ch.set_defaults(func=cmd_chat)

    listing = "\n".join(f"  {name:17} {what}" for name, what in benches().items()) or "  (none: not a checkout)"
    about = f"Run a benchmark from a source checkout's bench/ directory and print its table.\n\n{listing}"
    raw = argparse.RawDescriptionHelpFormatter  # keeps the one-line-per-benchmark listing
    b = sub.add_parser("bench", help="run a benchmark from bench/", description=about, formatter_class=raw)
    b.add_argument("name", choices=[*benches(), "all"], help="a benchmark listed above, or all of them in turn")
    extra = b.add_argument("extra", nargs=argparse.REMAINDER, help="arguments for the benchmark script")
    extra.required = False  # argparse had named it among the required arguments of `wkvm bench` alone
    b.set_defaults(func=cmd_bench)

    from wkvm import cli_doctor, cli_states

    cli_states.add_parser(sub)
    cli_doctor.add_parser(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format=TEXT_FORMAT)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command == "states" and not any(a.startswith("-") for a in extra):
        args.args += extra  # `states show --url U HANDLE`: argparse ends a `*` positional at the first option
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if sys.stdout is None and args.command != "serve":  # `>&-`: Python has no stdout object (a traceback at the end)
        print(f"wkvm {args.command}: standard output is closed: give it somewhere to write (> FILE)", file=sys.stderr)
        return 2
    try:
        rc: int = args.func(args)
        return rc
    except KeyboardInterrupt:  # Ctrl-C: the shell's status for it, without a traceback
        return 130
    except BrokenPipeError:  # `| head` closed the pipe: stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (ValueError, OSError, OverflowError) as e:  # bad input, a path that is not what it should be, a bad port
        print(f"wkvm {args.command}: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:  # torch (or another dependency) missing: one line, not a traceback (CLI hunt,
        if not e.name or e.name.split(".")[0] == "wkvm":  # 48); a module of wkvm's own missing is a broken install:
            raise  # its traceback
        print(f"wkvm {args.command}: {e.name} is not installed: {MISSING_HINT.get(e.name, 'pip install .')}",
              file=sys.stderr)  # fmt: skip
        return 2
    except Exception as e:
        import httpx

        from wkvm.state.store import DiskFull, StateNotFound

        # `wkvm states --url` with no server there (or not a URL); a handle a state directory does not hold; a state
        # directory on a full disk
        if not isinstance(e, httpx.HTTPError | StateNotFound | DiskFull):
            raise
        if isinstance(e, httpx.ConnectError):  # "ConnectError: [Errno 111] Connection refused" had named no URL
            where = getattr(args, "url", None) or os.environ.get("WKVM_URL")
            print(f"wkvm {args.command}: no server answers at {where} ({e}): start `wkvm serve`, or fix --url",
                  file=sys.stderr)  # fmt: skip
            return 2
        kind = f"{type(e).__name__}: " if isinstance(e, httpx.HTTPError) else ""  # its message says what; httpx's not
        print(f"wkvm {args.command}: {kind}{e}", file=sys.stderr)
        return 2


MISSING_HINT = {"torch": "install torch==2.13.0 first (pip install torch==2.13.0 --index-url "
                         "https://download.pytorch.org/whl/cpu), or run `make serve`, which sets up .venv"}


if __name__ == "__main__":
    sys.exit(main())
