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


def default_model() -> Path:
    """Until an embedded model ships, a small random RWKV-7 in the user cache (output is noise)."""
    from wkvm.models.rwkv7_random import RWKV7Shape, save_random_rwkv7

    path = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "wkvm" / "random-rwkv7-tiny.pth"
    if not path.exists():
        save_random_rwkv7(path, RWKV7Shape(4, 128, 32, 65536, None, 16, 16, 8, 32), seed=0)
    return path


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from wkvm.llm import LLM
    from wkvm.server.minimal import create_app

    model = args.model
    if not model:
        model = default_model()
        log.warning("no --model given: serving a small RANDOM model from %s (its output is noise)", model)
    name = args.served_model_name or Path(model).stem
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("binding %s: the server is reachable from other machines", args.host)
    app = create_app(LLM(model=model), name)
    uvicorn.run(app, host=args.host, port=int(args.port), log_level="info")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from wkvm.llm import LLM
    from wkvm.sampling_params import SamplingParams

    llm = LLM(model=args.model or default_model())
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


def cmd_convert(args: argparse.Namespace) -> int:
    from wkvm.models.rwkv7_checkpoint import convert

    fmt = convert(args.src, args.dst)
    print(f"wrote {args.dst} ({'HF/fla directory' if fmt == 'hf' else 'BlinkDL .pth'})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="wkvm", description="A state-native inference engine for recurrent LMs.")
    sub = ap.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    s.add_argument("--model", default=env_default("model"), help="BlinkDL .pth or HF/fla directory")
    s.add_argument("--host", default=env_default("host", "127.0.0.1"))
    s.add_argument("--port", default=env_default("port", "8000"))
    s.add_argument("--served-model-name", default=env_default("served_model_name"))
    s.set_defaults(func=cmd_serve)

    g = sub.add_parser("generate", help="generate from a prompt")
    g.add_argument("prompt", nargs="?")
    g.add_argument("--model", default=env_default("model"))
    g.add_argument("--prompt-ids", help="comma-separated token ids instead of text")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int)
    g.add_argument("--json", action="store_true", help="print text, token ids and finish reason as JSON")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("convert", help="convert between BlinkDL .pth and an HF/fla directory (lossless)")
    c.add_argument("src")
    c.add_argument("dst")
    c.set_defaults(func=cmd_convert)
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
