"""A memory soak: the server's resident memory over many chats, each from a different `user` (a reuse scope each).

`wkvm serve` on the embedded model with small state budgets (16 MiB per RAM tier, 32 MiB of checkpoints by default),
so the caches fill within the first few hundred requests; after that RSS should stay flat. A rise that goes on is
memory kept per request or per user (session 30: the prefix tries kept every evicted checkpoint, +43 MB per 1,000
users; flat since).

    .venv/bin/python scripts/soak_rss.py [--requests 2000] [--port 8931] [-- extra serve flags]

Prints RSS and the state tiers' bytes at a few points; exits 1 if a request fails.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

SYSTEM = "You are a helpful assistant who answers in one short sentence. " * 4


def rss_mb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024
    raise RuntimeError("no VmRSS")


def wait_ready(url: str, proc: subprocess.Popen) -> None:
    for _ in range(600):
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit("the server did not become ready in 600 s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--port", type=int, default=8931)
    ap.add_argument("serve_args", nargs="*", help="more `wkvm serve` flags (after --)")
    args = ap.parse_args()
    marks = sorted({1, args.requests // 8, args.requests // 4, args.requests // 2, args.requests * 3 // 4,
                    args.requests} - {0})  # fmt: skip
    wkvm = Path(sys.executable).with_name("wkvm")
    url = f"http://127.0.0.1:{args.port}"
    with tempfile.TemporaryDirectory(prefix="wkvm-soak-") as tmp:
        cmd = [str(wkvm), "serve", "--port", str(args.port), "--state-dir", tmp + "/states", "--state-device-bytes",
               "16M", "--state-host-bytes", "16M", "--checkpoint-bytes", "32M", *args.serve_args]  # fmt: skip
        with open(tmp + "/server.log", "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_ready(url, proc)
            start = time.monotonic()
            with httpx.Client(timeout=120) as client:
                for i in range(1, args.requests + 1):
                    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Greet {i}."}]
                    body = {"messages": messages, "max_tokens": 4, "temperature": 0, "user": f"user-{i}"}
                    r = client.post(url + "/v1/chat/completions", json=body)
                    if r.status_code != 200:
                        print(f"request {i}: {r.status_code} {r.text}")
                        return 1
                    if i in marks:
                        tiers = {}
                        for line in client.get(url + "/metrics").text.splitlines():
                            if line.startswith("wkvm_state_bytes{"):
                                tiers[line.split('"')[1]] = round(float(line.split()[-1]) / 2**20, 1)
                        print(f"{i:>6} requests  RSS {rss_mb(proc.pid):>5} MB  state MiB {tiers}  "
                              f"{time.monotonic() - start:.0f} s", flush=True)
        finally:
            proc.terminate()
            proc.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
