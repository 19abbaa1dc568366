"""Multi-turn chat cost: S sessions x T turns (a 512-token first prompt, then +32 user tokens and 32 generated
tokens per turn), greedy, 0.1B shape, all in one run:

  reuse      `wkvm serve` in its own process, automatic prefix reuse on (sessions run concurrently, as users would)
  no-reuse   the same server with --no-prefix-reuse (re-prefills the whole history every turn)
  rwkv       BlinkDL's `rwkv` package re-prefilling the whole history every turn (one sequence at a time)
  bound      lower bound: wkvm's model prefilling only the new tokens, then batched decode (no server)

Writes bench/out/multiturn.{json,png}.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import checkpoint, machine, machine_line, plot, print_table, rwkv_reference, write_json  # noqa: E402

from wkvm.server.background import free_port, wait_healthy  # noqa: E402
from wkvm.weights.loader import load_model  # noqa: E402


def script(sessions: int, turns: int, first: int, user: int, vocab: int) -> list[list[list[int]]]:
    g = torch.Generator().manual_seed(7)
    rand = lambda n: torch.randint(0, vocab, (n,), generator=g).tolist()  # noqa: E731
    return [[rand(first)] + [rand(user) for _ in range(turns - 1)] for _ in range(sessions)]


class ServerProcess:
    """`wkvm serve` in its own process, as in production: the clients' Python does not share its GIL."""

    def __init__(self, path: Path, slots: int, reuse: bool):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = ["--model", str(path), "--port", str(self.port), "--slots", str(slots), "--token-budget", "1024",
                "--prefill-chunk", "512"] + ([] if reuse else ["--no-prefix-reuse"])  # fmt: skip
        self.proc = subprocess.Popen([sys.executable, "-m", "wkvm.cli", "serve", *args], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)  # fmt: skip

    def __enter__(self):
        wait_healthy(self.url, alive=lambda: self.proc.poll() is None)
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait(timeout=60)


def run_server(path: Path, plan, gen_tokens: int, reuse: bool) -> tuple[float, list[list[float]], list]:
    """Every session in its own client thread; returns wall time, per-turn latencies and the generated tokens."""
    lat = [[0.0] * len(plan[0]) for _ in plan]
    out = [[None] * len(plan[0]) for _ in plan]
    with ServerProcess(path, len(plan), reuse) as server:

        def session(i: int) -> None:
            history: list[int] = []
            with httpx.Client(base_url=server.url, timeout=600) as c:
                for t, new in enumerate(plan[i]):
                    history = history + new
                    body = {"prompt": history, "max_tokens": gen_tokens, "temperature": 0, "ignore_eos": True,
                            "return_token_ids": True}  # fmt: skip
                    t0 = time.perf_counter()
                    r = c.post("/v1/completions", json=body).json()
                    lat[i][t] = time.perf_counter() - t0
                    toks = r["choices"][0]["token_ids"]
                    out[i][t] = toks
                    history = history + toks

        t0 = time.perf_counter()
        threads = [threading.Thread(target=session, args=(i,)) for i in range(len(plan))]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        return time.perf_counter() - t0, lat, out


def run_rwkv(path: Path, plan, gen_tokens: int) -> tuple[float, list[list[float]], list]:
    ref = rwkv_reference()(str(path).removesuffix(".pth"), "cpu fp32")
    lat = [[0.0] * len(plan[0]) for _ in plan]
    out = [[None] * len(plan[0]) for _ in plan]
    t_all = time.perf_counter()
    for i, turns in enumerate(plan):
        history: list[int] = []
        for t, new in enumerate(turns):
            history = history + new
            t0 = time.perf_counter()
            logits, state = ref.forward(history, None)  # re-prefill the whole history
            toks = []
            for _ in range(gen_tokens):
                tok = int(torch.argmax(logits))
                toks.append(tok)
                logits, state = ref.forward([tok], state)
            lat[i][t] = time.perf_counter() - t0
            out[i][t] = toks
            history = history + toks
    return time.perf_counter() - t_all, lat, out


def lower_bound(path: Path, plan, gen_tokens: int) -> tuple[float, list[float]]:
    """Prefill only each turn's new tokens from the live state, then decode all sessions as one batch."""
    model = load_model(path)
    states = [model.new_state() for _ in plan]
    pending: list[list[int]] = [[] for _ in plan]
    per_turn = []
    t_all = time.perf_counter()
    for t in range(len(plan[0])):
        t0 = time.perf_counter()
        logits = [model.prefill(pending[i] + plan[i][t], states[i])[0] for i in range(len(plan))]
        batch = {k: torch.cat([s[k] for s in states]) for k in states[0]}
        toks = [[int(torch.argmax(lg))] for lg in logits]
        for _ in range(gen_tokens - 1):
            lg = model.decode([tk[-1] for tk in toks], batch)
            for i, row in enumerate(lg):
                toks[i].append(int(torch.argmax(row)))
        states = [{k: v[i : i + 1].clone() for k, v in batch.items()} for i in range(len(plan))]
        pending = [[tk[-1]] for tk in toks]  # the last generated token is fed with the next turn
        per_turn.append(time.perf_counter() - t0)
    return time.perf_counter() - t_all, per_turn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--first", type=int, default=512)
    ap.add_argument("--user", type=int, default=32)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--skip-rwkv", action="store_true", help="skip the slow rwkv-package baseline")
    args = ap.parse_args()
    if not args.skip_rwkv:
        rwkv_reference()  # missing: say so now, not after the server runs
    path = checkpoint()
    plan = script(args.sessions, args.turns, args.first, args.user, 65536)
    results, per_turn = {}, {}
    results["reuse"], lat, out_reuse = run_server(path, plan, args.gen, reuse=True)
    per_turn["reuse"] = [sum(col) / len(col) for col in zip(*lat, strict=True)]
    results["no-reuse"], lat, out_plain = run_server(path, plan, args.gen, reuse=False)
    per_turn["no-reuse"] = [sum(col) / len(col) for col in zip(*lat, strict=True)]
    results["bound"], per_turn["bound (all sessions)"] = lower_bound(path, plan, args.gen)
    same = out_reuse == out_plain
    if not args.skip_rwkv:
        results["rwkv"], lat, out_rwkv = run_rwkv(path, plan, args.gen)
        per_turn["rwkv"] = [sum(col) / len(col) for col in zip(*lat, strict=True)]
        same = same and out_reuse == out_rwkv
    rows = [[k, v, results["reuse"] / v if k != "reuse" else 1.0] for k, v in results.items()]
    print(machine_line())
    print_table(
        f"{args.sessions} sessions x {args.turns} turns ({args.first}-token first prompt, +{args.user} user, "
        f"{args.gen} generated per turn), RWKV-7 0.1B shape fp32",
        ["run", "total s", "reuse time / this"],
        rows,
    )
    if "rwkv" in results:
        print(f"reuse vs rwkv package: {results['rwkv'] / results['reuse']:.1f}x faster (target >= 10x)")
    print(f"reuse vs lower bound: {results['reuse'] / results['bound']:.2f}x (target <= 1.2x)")
    print(f"greedy tokens identical across runs: {same}")
    write_json("multiturn", {**machine(), "args": vars(args), "total_s": results, "per_turn_s": per_turn,
                             "identical": same})  # fmt: skip
    plot("multiturn", list(range(1, args.turns + 1)), per_turn, "turn", "seconds per turn (mean per session)",
         "Multi-turn chat, RWKV-7 0.1B shape")  # fmt: skip


if __name__ == "__main__":
    main()
